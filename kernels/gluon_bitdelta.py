"""Hopper (sm_90) prefill kernel for ``bitdelta_linear`` written in Gluon, Triton's lower-level
dialect (ARCHITECTURE.md, "Kernel").

``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta, arXiv:2402.10193, §3.1 Eq. 2) for many rows
(prefill). Why a second prefill kernel: with ``tl.dot`` on an operand computed in registers,
Triton 3.6 waits for every wgmma to finish before the next K step (``warp_group_dot_wait
{pendings = 0}``), so the sign expansion and the tensor cores take turns and the Triton prefill
kernel ran at 2.75× dense bf16 on an H200. Gluon exposes the pieces, so this kernel schedules them
itself, one K step of ``BLOCK_K`` per iteration:

1. TMA copies the x tile ``[BLOCK_M, BLOCK_K]`` and the W tile ``[BLOCK_N, BLOCK_K]`` into a ring of
   ``STAGES`` shared-memory buffers, ``STAGES − 1`` steps ahead (one mbarrier per stage). The
   ``[BLOCK_N, BLOCK_K/8]`` sign bytes are small (1/16 of W) and are loaded into registers one
   step ahead.
2. Every thread reads 8 consecutive weights of the W tile and the sign byte that covers them,
   forms ``W + α·s`` in float32, rounds it once to the activation dtype and writes it to one of two
   shared-memory buffers of the reconstructed tile. The reconstructed weight never leaves the SM.
3. An asynchronous wgmma multiplies the x tile with the reconstructed tile (float32 accumulator)
   and the warps go on to the next step while it runs; only the wgmma of the step before is
   waited for, so the expansion of step k overlaps the tensor-core product of step k − 1.

Measured on an H200 (Triton 3.6; ``tests/gpu/prefill_gluon.py``,
reports/prefill-gluon-2026-11-30-h200.json), time ÷ dense bf16 over the Llama-2-70B layer set at
2048 tokens: 1.65× for the best configuration, 1.60× with the best per layer (the Triton kernel:
2.75×); W from global memory into registers (``W_TMA=False``) 1.69×. Both configurations pass the
GPU tests (``tests/test_kernels_triton.py -k gluon``).

Constraints (the wrapper falls back to the Triton kernel otherwise): compute capability 9.x, K a
multiple of 8 (TMA needs 16-byte row strides), 16-byte aligned x and W, contiguous rows.
"""
from __future__ import annotations

import torch
import triton

try:  # Gluon ships with Triton ≥ 3.4; without it only the Triton kernels are available
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the TMA load was renamed after Triton 3.6 (``async_copy_global_to_shared`` → ``async_load``)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # also renamed
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, W_TMA): two warpgroups share the reconstructed W
# tile. W_TMA: W through shared memory by TMA like x; else W from global memory straight into
# registers, two K steps ahead, which saves a shared-memory write and read of every W tile (the
# kernel's shared-memory traffic per K step is then that of a dense GEMM plus one store).
CONFIGS = ((256, 128, 64, 3, 8, True), (128, 128, 64, 4, 8, True), (128, 256, 64, 3, 8, True),
           (256, 128, 64, 4, 8, False), (128, 128, 64, 4, 8, False))
DEFAULT_CONFIG = CONFIGS[0]


if HAVE_GLUON:
    @gluon.jit
    def _prefill_kernel(x_desc, w_desc, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, M, N, K, stride_wn, stride_sn, stride_ym,
                        ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                        W_TMA: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_KB: gl.constexpr = BLOCK_K // 8
        dtype: gl.constexpr = x_desc.dtype

        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BLOCK_M)
        off_m = (pid % num_m) * BLOCK_M  # consecutive programs share one W panel (HBM once, then L2)
        off_n = (pid // num_m) * BLOCK_N

        # registers: each thread owns 8 consecutive weights (16 bytes) and their sign byte
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // BLOCK_KB, BLOCK_KB, 1], [num_warps, 1, 1], [2, 1, 0])
        l2: gl.constexpr = gl.BlockedLayout([1, 8], [32 // BLOCK_KB, BLOCK_KB], [num_warps, 1], [1, 0])
        ls: gl.constexpr = gl.SliceLayout(2, l3)  # sign bytes [BLOCK_N, BLOCK_KB]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_N, 16])

        x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        if W_TMA:
            w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        r_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K], w_desc.layout)  # W + α·s
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        rn = (off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ls))) % N
        offs_b = gl.arange(0, BLOCK_KB, layout=gl.SliceLayout(0, ls))
        shifts = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
        shifts = gl.expand_dims(gl.expand_dims(shifts, 0), 0)                          # [1, 1, 8]
        if ALPHA_PER_ROW:
            alpha = gl.expand_dims(gl.expand_dims(gl.load(a_ptr + rn), 1), 2)          # [BN, 1, 1]
        else:
            alpha = gl.load(a_ptr)
        SIGN_BIT: gl.constexpr = -2147483648  # 0x80000000 as int32
        neg_alpha_bits = (-alpha).to(gl.int32, bitcast=True)
        s_ptrs = s_ptr + gl.expand_dims(rn, 1) * stride_sn + gl.expand_dims(offs_b, 0)
        KB = K // 8
        num_k = gl.cdiv(K, BLOCK_K)
        if W_TMA:
            nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = x_desc.block_type.nbytes
        for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES − 1 steps in flight
            if i < num_k:
                mbarrier.expect(bars.index(i), nbytes)
                _tma_load(x_desc, [off_m, i * BLOCK_K], bars.index(i), x_smem.index(i))
                if W_TMA:
                    _tma_load(w_desc, [off_n, i * BLOCK_K], bars.index(i), w_smem.index(i))
        sgn = gl.load(s_ptrs, mask=gl.expand_dims(offs_b < KB, 0), other=0)
        if not W_TMA:
            # W straight from global memory into registers, two steps ahead (16 bytes per thread)
            kk = gl.expand_dims(gl.expand_dims(offs_b, 0), 2) * 8 + shifts                 # [1, BKB, 8]
            w_ptrs = w_ptr + gl.expand_dims(gl.expand_dims(rn, 1), 2) * stride_wn + kk
            w_cur = gl.load(w_ptrs, mask=kk < K, other=0.0)
            w_nxt = gl.load(w_ptrs + BLOCK_K, mask=kk + BLOCK_K < K, other=0.0)

        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        for ki in range(num_k):
            stage = ki % STAGES
            # the next step's sign bytes, issued before this step needs anything
            nxt = (ki + 1) * BLOCK_KB + offs_b
            sgn_next = gl.load(s_ptrs + (ki + 1) * BLOCK_KB, mask=gl.expand_dims(nxt < KB, 0), other=0)
            mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
            if W_TMA:
                w = gl.convert_layout(gl.reshape(w_smem.index(stage).load(l2), [BLOCK_N, BLOCK_KB, 8]), l3)
            else:
                w = w_cur
                w_cur = w_nxt
                w_nxt = gl.load(w_ptrs + (ki + 2) * BLOCK_K, mask=kk + (ki + 2) * BLOCK_K < K, other=0.0)
            # ±α without a select: bit j of the byte moved to the float sign bit flips −α to +α
            top = (gl.expand_dims(sgn.to(gl.int32), 2) << (31 - shifts)) & SIGN_BIT
            d = (top ^ neg_alpha_bits).to(gl.float32, bitcast=True)
            w_eff = (w.to(gl.float32) + d).to(dtype)  # the one rounding
            r_buf = r_smem.index(ki % 2)  # its last reader, wgmma ki − 2, was waited for in step ki − 1
            r_buf.store(gl.convert_layout(gl.reshape(w_eff, [BLOCK_N, BLOCK_K]), l2))
            fence_async_shared()
            _cta_barrier()  # every warp's part of the tile is written before the wgmma reads it
            acc = warpgroup_mma(x_smem.index(stage), r_buf.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # wgmma ki − 1 is done
            # its stage is free: refill it with step ki + STAGES − 1
            nk = ki + STAGES - 1
            if nk < num_k:
                ns = nk % STAGES
                mbarrier.expect(bars.index(ns), nbytes)
                _tma_load(x_desc, [off_m, nk * BLOCK_K], bars.index(ns), x_smem.index(ns))
                if W_TMA:
                    _tma_load(w_desc, [off_n, nk * BLOCK_K], bars.index(ns), w_smem.index(ns))
            sgn = sgn_next
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(b_ptr + offs_n % N).to(gl.float32), 0)
        y_ptrs = y_ptr + gl.expand_dims(offs_m, 1) * stride_ym + gl.expand_dims(offs_n, 0)
        mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
        gl.store(y_ptrs, acc.to(dtype), mask=mask)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`bitdelta_linear_gluon` can run on these tensors: Gluon present, a CUDA device
    of compute capability 9.x (Hopper), K a multiple of 8, 16-byte aligned contiguous rows."""
    if not HAVE_GLUON or x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    k = x.shape[-1]
    return (k % 8 == 0 and x.stride(-1) == 1 and weight.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and weight.stride(0) % 8 == 0)


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def bitdelta_linear_gluon(x2: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                          bias: torch.Tensor | None, y: torch.Tensor, config: tuple = DEFAULT_CONFIG) -> torch.Tensor:
    """Launch the Hopper prefill kernel: ``y[M, N] = x2 · (W + α·s)ᵀ (+ bias)``, writing into ``y``.

    Args:
        x2: ``[M, K]`` bf16/fp16, rows contiguous, K a multiple of 8 (:func:`supported`).
        weight: ``[N, K]`` same dtype. sign: uint8 ``[N, K/8]`` (LSB first). alpha: float32 ``[]``
            or ``[N]`` on the device. bias: ``[N]`` contiguous or None.
        y: ``[M, N]`` output in ``x2.dtype`` (row stride ``y.stride(0)``).
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, W_TMA)``, one of :data:`CONFIGS`.

    Returns:
        ``y``. Arguments are checked by the caller (``kernels.triton_bitdelta``), not here.
    """
    bm, bn, bk, stages, warps, w_tma = config
    m, k = x2.shape
    n = weight.shape[0]
    dt = _gl_dtype(x2.dtype)
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dt))
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _prefill_kernel[grid](x_desc, w_desc, weight, sign, alpha, bias if bias is not None else alpha, y, m, n, k,
                          weight.stride(0), sign.stride(0), y.stride(0), ALPHA_PER_ROW=alpha.dim() == 1,
                          HAS_BIAS=bias is not None, STAGES=stages, W_TMA=w_tma, num_warps=warps)
    return y
