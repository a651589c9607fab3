"""Fused Triton kernel for ``bitdelta_linear`` (ARCHITECTURE.md, "Kernel"): first version.

``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta arXiv:2402.10193, Eq. 2 applied to a linear
layer), tiled like a standard GEMM: each program owns a ``[BLOCK_M, BLOCK_N]`` tile of ``y`` and
walks K in ``BLOCK_K`` steps. Per step it loads the base tile ``W[n, k]`` and the packed sign
bytes ``sign[n, k // 8]`` (one byte per 8 weights — 1/16 of the bf16 bytes), unpacks the bits in
registers, forms ``W + α·s`` in float32 and rounds it to the activation dtype for ``tl.dot``. The
reconstructed weight only ever exists in registers; nothing but ``y`` is written.

Precision: the tile ``W + α·s`` is rounded once to the activation dtype (bf16/fp16) before the
tensor-core product, which accumulates in float32. Against the float32 reference the error is that
of one bf16/fp16 rounding of each reconstructed weight (relative ≈ 2⁻⁸ / 2⁻¹¹ per weight, averaging
out over K).

Two paths: for M ≤ ``GEMV_MAX_M`` (decode) a GEMV-style kernel on CUDA cores that loads each
sign byte once, expands it to 8 lanes in registers and keeps x·Wᵀ and x·Sᵀ as two float32 sums
(``y = x·Wᵀ + α·(x·Sᵀ)``, no rounding of the reconstructed weight); above it the tiled tensor-core
kernel described above. Not yet: split-K, autotuning, the mixed-tenant kernel, custom-op
registration (issue 5).

Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (slow; for tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.reference import check_batched_args


@triton.jit
def _bitdelta_linear_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_ym, stride_yn,
    ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if ALPHA_PER_ROW:
        alpha = tl.load(a_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    else:
        alpha = tl.load(a_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wk_mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :] * stride_wk, mask=wk_mask, other=0.0)
        byte = tl.load(s_ptr + offs_n[:, None] * stride_sn + (k[None, :] // 8), mask=wk_mask, other=0)
        bit = (byte.to(tl.int32) >> (k[None, :] % 8)) & 1
        w_eff = w.to(tl.float32) + alpha * (2 * bit - 1).to(tl.float32)
        w_eff = tl.where(wk_mask, w_eff, 0.0).to(x.dtype)  # the one rounding (see the module doc)
        if DOT_FP32:  # Triton's CPU interpreter gets bf16 tl.dot wrong: same rounded values, fp32 product
            acc += tl.dot(x.to(tl.float32), tl.trans(w_eff.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w_eff))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _bitdelta_gemv_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Decode path (M ≤ 4): CUDA-core dot products, each sign byte loaded once and expanded to 8
    lanes in registers; y = x·Wᵀ + α·(x·Sᵀ), both sums in float32 (no rounding of W + α·s)."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = tl.arange(0, 8)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc_w = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)                                       # [BM, BK]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)                                       # [BN, BK]
        kb = k0 // 8 + offs_kb
        byte = tl.load(s_ptr + offs_n[:, None] * stride_sn + kb[None, :],
                       mask=mask_n[:, None] & (kb[None, :] < (K + 7) // 8), other=0).to(tl.int32)  # [BN, BK/8]
        bits = (byte[:, :, None] >> shifts[None, None, :]) & 1                      # [BN, BK/8, 8]
        sgn = tl.reshape(2 * bits - 1, (BLOCK_N, BLOCK_K)).to(tl.float32)
        sgn = tl.where(mask_k[None, :], sgn, 0.0)
        acc_w += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        acc_s += tl.sum(x[:, None, :] * sgn[None, :, :], axis=2)
    if ALPHA_PER_ROW:
        alpha = tl.load(a_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        alpha = tl.load(a_ptr)
    acc = acc_w + alpha * acc_s
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


GEMV_MAX_M = 4

# decode tiles, tuned per (N, K, BLOCK_M) on first use on a GPU (not under the interpreter)
_gemv_autotuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
             for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (2, 4, 8)
             if bn * bk <= 16384],
    key=["N", "K", "BLOCK_M"],
)(_bitdelta_gemv_kernel)


@triton.jit
def _bitdelta_batched_gemv_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, slot_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ss, stride_sn, stride_as, stride_ym,
    ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Mixed tenants, small M: the base tile W[n, k] is read once per K-step and shared by all
    BLOCK_M rows; each row m then reads its own tenant's sign bytes (slot[m], −1: none) and adds
    α_slot ⊙ (x[m]·S_slotᵀ). The signs of T distinct tenants are 1/16 of W each: 1 + T/16 bytes."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8)
    mask_n = offs_n < N
    for i in tl.static_range(BLOCK_M):
        m = pid_m * BLOCK_M + i
        if m < M:
            slot = tl.load(slot_ptr + m)
            acc_w = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                mask_k = k < K
                x = tl.load(x_ptr + m * stride_xm + k, mask=mask_k, other=0.0).to(tl.float32)     # [BK]
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                            mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)     # [BN, BK]
                acc_w += tl.sum(w * x[None, :], axis=1)
                if slot >= 0:
                    kb = k0 // 8 + offs_kb
                    byte = tl.load(s_ptr + slot * stride_ss + offs_n[:, None] * stride_sn + kb[None, :],
                                   mask=mask_n[:, None] & (kb[None, :] < (K + 7) // 8), other=0).to(tl.int32)
                    bits = (byte[:, :, None] >> shifts[None, None, :]) & 1
                    sgn = tl.reshape(2 * bits - 1, (BLOCK_N, BLOCK_K)).to(tl.float32)
                    sgn = tl.where(mask_k[None, :], sgn, 0.0)
                    acc_s += tl.sum(sgn * x[None, :], axis=1)
            acc = acc_w
            if slot >= 0:
                if ALPHA_PER_ROW:
                    alpha = tl.load(a_ptr + slot * stride_as + offs_n, mask=mask_n, other=0.0)
                else:
                    alpha = tl.load(a_ptr + slot * stride_as)
                acc += alpha * acc_s
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): a GEMV-like tile for decode, a GEMM tile for prefill."""
    if m <= 16:
        return 16, 64, 128
    if m <= 64:
        return 64, 64, 64
    return 128, 128, 64


def bitdelta_linear_triton(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``bitdelta_linear``: same contract as :func:`kernels.reference.bitdelta_linear`.

    Args:
        x: ``[..., K]`` bf16 or fp16 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        weight: ``[N, K]`` in ``x.dtype``.
        sign: ``[N, ceil(K/8)]`` uint8, contiguous rows.
        alpha: float32 ``[]`` or ``[N]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: on a dtype or shape that does not fit the contract.
    """
    n, k = weight.shape
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must both be bf16 or fp16, got {x.dtype} and {weight.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if sign.dtype != torch.uint8 or sign.shape != (n, (k + 7) // 8):
        raise ValueError(f"sign must be uint8 [{n}, {(k + 7) // 8}], got {sign.dtype} {tuple(sign.shape)}")
    alpha = alpha.to(device=x.device, dtype=torch.float32).contiguous()
    if alpha.dim() not in (0, 1) or (alpha.dim() == 1 and alpha.shape[0] != n):
        raise ValueError(f"alpha must be [] or [{n}], got {tuple(alpha.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    sign = sign.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m <= GEMV_MAX_M and x2.stride(1) == 1 and weight.stride(1) == 1:
        args = (x2, weight, sign, alpha, bias if bias is not None else alpha, y,
                m, n, k, x2.stride(0), weight.stride(0), sign.stride(0), y.stride(0))
        flags = dict(ALPHA_PER_ROW=alpha.dim() == 1, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m))
        if os.environ.get("TRITON_INTERPRET") == "1":
            _bitdelta_gemv_kernel[(triton.cdiv(n, 16),)](*args, **flags, BLOCK_N=16, BLOCK_K=256)
        else:
            _gemv_autotuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
        return y.reshape(*lead, n)
    bm, bn, bk = _blocks(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _bitdelta_linear_kernel[grid](
        x2, weight, sign, alpha, bias if bias is not None else alpha, y,
        m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), sign.stride(0), y.stride(0), y.stride(1),
        ALPHA_PER_ROW=alpha.dim() == 1, HAS_BIAS=bias is not None,
        DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return y.reshape(*lead, n)


def bitdelta_linear_batched_triton(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor,
                                   alphas: torch.Tensor, slot: torch.Tensor,
                                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton mixed-tenant linear: same contract as :func:`kernels.reference.bitdelta_linear_batched`.

    First version: a GEMV-style kernel (base tile shared by ``BLOCK_M`` rows, each row's own
    tenant's signs unpacked in registers), aimed at decode batches (M = number of tenants' tokens).

    Args:
        x: ``[M, K]`` bf16/fp16; weight ``[N, K]`` same dtype; signs uint8 ``[S, N, ceil(K/8)]``;
        alphas float32 ``[S]`` or ``[S, N]``; slot ``[M]`` int (−1: base only); bias ``[N]``.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: on a dtype or shape outside the contract, or a slot outside ``[−1, S)``.
    """
    n, k = weight.shape
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must both be bf16 or fp16, got {x.dtype} and {weight.dtype}")
    if signs.dtype != torch.uint8:
        raise ValueError(f"signs must be uint8, got {signs.dtype}")
    check_batched_args(x, weight, signs, alphas, slot)
    m = x.shape[0]
    x, weight, signs = x.contiguous(), weight.contiguous(), signs.contiguous()
    alphas = alphas.to(device=x.device, dtype=torch.float32).contiguous()
    slot = slot.to(device=x.device, dtype=torch.int32).contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm, bn, bk = 4, 16, 256
    _bitdelta_batched_gemv_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, weight, signs, alphas, slot, bias if bias is not None else alphas, y,
        m, n, k, x.stride(0), weight.stride(0), signs.stride(0), signs.stride(1),
        alphas.stride(0), y.stride(0),
        ALPHA_PER_ROW=alphas.dim() == 2, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return y
