"""Fused Triton kernels for ``bitdelta_linear`` and ``bitdelta_linear_batched`` (docs/kernels.md,
"Contract"), and the dispatch between them and the Hopper kernels of ``deltafleet.kernels.gluon_bitdelta``,
``deltafleet.kernels.gluon_prefill_rs`` and ``deltafleet.kernels.gluon_planes``.

``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta, arXiv:2402.10193, §3.1 Eq. 2 applied to a
linear layer). The packed sign bytes (one byte per 8 weights, least significant bit first: 1/16 of
the bf16 bytes) are read once per tile and unpacked in registers; the reconstructed weight exists
only in registers and nothing but ``y`` is written to memory. Every kernel here reads the signs as
rows ``[N, ceil(K/8)]`` or in ``deltafleet.kernels.reference.tile_signs``' layout.

Kernels:

* **decode** (M ≤ ``GEMV_MAX_M``), ``_decode_kernel`` with ``ONE_DELTA``: a GEMV on CUDA cores.
  A program owns ``BLOCK_N`` output features and a chunk of K, walked in steps of ``BLOCK_KB``
  sign bytes (``8·BLOCK_KB`` weights); each thread holds 8 consecutive weights (one 16-byte load)
  and the sign byte that covers them, forms ``W + α·s`` in float32 (no rounding) and
  multiply-adds it with each of the M activation rows. When N alone gives too few programs, K is
  split across programs (``CHUNK_ITERS``): their float32 partial sums are added into a workspace
  and the last program of each tile (an atomic counter) writes ``y`` and zeroes the workspace, so
  one launch does it all. Memory-bound: W and the signs are read once. On a Hopper GPU from two
  rows up the register-operand kernel below runs instead, unless timed slower (``_prefill_choice``).
* **small batches and prefill** (M > ``GEMV_MAX_M``): on a Hopper GPU, the register-operand kernel of
  ``deltafleet.kernels.gluon_prefill_rs`` (``yᵀ = (W + α·s)·xᵀ`` with the reconstructed weight formed in the
  wgmma's register operand; K a multiple of 64·U; up to 128 rows with small token tiles, K split
  and persistent programs, and then alone up to 64 rows) or the Gluon kernel of ``deltafleet.kernels.gluon_bitdelta``
  (TMA, asynchronous wgmma, the sign expansion of K step k overlapping the product of step k − 1),
  whichever is faster for the shape (``_prefill_choice``); elsewhere, or when it does not apply (K
  not a multiple of 8, unaligned rows), ``_mm_kernel``: a tensor-core GEMM in Triton. Per K step a
  ``[BLOCK_N, BLOCK_K]`` tile of W and its ``[BLOCK_N, BLOCK_K/8]`` sign bytes are loaded (both
  pipelined through shared memory), ``W + α·s`` is formed in float32 and rounded once to the
  activation dtype, and multiplied with the x tile, accumulating in float32. ``W_AS_A`` chooses
  whether the reconstructed tile is the product's register operand (``yᵀ = (W + α·s)·xᵀ``) or
  its shared-memory operand (``y = x·(W + α·s)ᵀ``). Triton waits for each wgmma whose operand is
  computed in registers, so in this kernel the expansion and the tensor cores take turns: the
  reason for the Gluon kernels.
* **mixed tenants**, ``bitdelta_linear_batched``: decode batches in which every row has its own
  variant (``slot[m]``, −1 = base only). ``_tenants_kernel`` (``impl="lut"``): the base product of
  the rows on tensor cores, the signs by table lookup (see its docstring). On a Hopper GPU,
  ``deltafleet.kernels.gluon_bitdelta._tenants_kernel`` (``impl="gluon"``): the base product on the tensor
  cores with the operands swapped while the same warps add each row's ±x on the CUDA cores. On a
  Hopper GPU with K a multiple of 128, ``deltafleet.kernels.gluon_planes`` (``impl="planes"``, the default
  there): the sign part on the int8 tensor cores, the packed sign bits as the 0/1 operand and the
  activations as two int8 planes of a 16-bit fixed-point copy, in a warp-specialised kernel; or
  (``bits``) on the binary tensor cores, the sign words as stored against the 16 bit planes of that
  copy. From two rows up the dispatcher times the candidates once per shape and keeps the fastest
  (``_tenants_choice``).
  ``_decode_kernel`` without ``ONE_DELTA`` (``impl="fma"``, the default for one row, with the
  decode tiles): the W tile is loaded once per K step and shared by the program's ``BLOCK_M`` rows,
  each row forms its own tenant's ``W + α_t·s_t``. Bytes read: W once + each distinct tenant's
  signs, ``1 + T/16`` of a dense read for T tenants.

Tuning: tile shapes are autotuned per problem shape on the GPU (``triton.autotune`` over the
``_*_configs`` lists, aimed at H100/H200, timed by CUDA-graph replay as a serving engine replays
decode steps); the choice between kernels for prefill and mixed tenants is timed once per shape
(``_prefill_choice``, ``_tenants_choice``), on copies of the operands cycled past the L2
(``_fastest``). ``DELTAFLEET_TRITON_AUTOTUNE=0`` (read at import): every kernel's first tile and
the default kernel choices, nothing timed; during a CUDA-graph capture the kernel choices take
their defaults too; ``DELTAFLEET_TRITON_QUICK_TUNE=1`` (tests): each tile
timed by a few runs, the kernel choices untimed. Each path's current time ÷ dense bf16 over the
Llama-2-70B layer set is in docs/kernels.md ("Current figures"), from ``make bench-kernels``.

Under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, used by the tests) a fixed small tile is
used, and because the interpreter computes bf16 ``tl.dot`` wrongly the prefill kernel multiplies the
same rounded tiles in float32 there (``DOT_FP32``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltafleet.kernels import gluon_bitdelta, gluon_planes, gluon_prefill_rs, timing
from deltafleet.kernels.reference import check_batched_args, check_tensors, check_weight_and_bias, tiled_shape

GEMV_MAX_M = 4  # decode path up to this many rows; the tensor-core kernel above


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _emit(part, row, M, N, y_ptr, stride_ym, ws_ptr, b_ptr, rn, offs_n, SPLIT, HAS_BIAS: tl.constexpr):
    """Write one row's partial sums ``part`` [BLOCK_N] (float32): straight to y when K is not
    split; else added into the float32 workspace, whose values the last K-split program of this
    N-tile reads back (from L2), writes to y and resets to 0 (``_finish``)."""
    mask = (offs_n < N) & ((offs_n * 0 + row) < M)
    if SPLIT == 1:
        if HAS_BIAS:
            part += tl.load(b_ptr + rn).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, part.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ws_ptr + row * N + offs_n, part, mask=mask, sem="relaxed")


@triton.jit
def _finish(row, M, N, y_ptr, stride_ym, ws_ptr, b_ptr, rn, offs_n, HAS_BIAS: tl.constexpr):
    mask = (offs_n < N) & ((offs_n * 0 + row) < M)
    ptrs = ws_ptr + row * N + offs_n
    v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # from L2, past L1
    tl.store(ptrs, tl.zeros_like(v), mask=mask)  # leave the workspace zero for the next call
    if HAS_BIAS:
        v += tl.load(b_ptr + rn).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish_tile(pid_m, pid_n, SPLIT, M, N, y_ptr, stride_ym, ws_ptr, cnt_ptr, b_ptr, rn, offs_n,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):
    """End of a K-split program: count it in; the last K-chunk of the (row block, N-tile) takes the
    sums of its ``BLOCK_M`` rows (``_finish``) and resets the counter."""
    tl.debug_barrier()  # every thread's partial sums are in before the count
    done = tl.atomic_add(cnt_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
    if done == SPLIT - 1:
        for i in tl.static_range(BLOCK_M):
            _finish(pid_m * BLOCK_M + i, M, N, y_ptr, stride_ym, ws_ptr, b_ptr, rn, offs_n, HAS_BIAS)
        tl.atomic_xchg(cnt_ptr + pid_m * tl.num_programs(0) + pid_n, 0, sem="relaxed")


@triton.jit
def _sign_off(rn, kb, stride_sn, TILED: tl.constexpr):
    """Offset of packed sign byte ``kb`` of row ``rn`` within one matrix's signs (broadcast shapes).
    Rows: ``rn·stride_sn + kb``. Tiled (``deltafleet.kernels.reference.tile_signs``): ``stride_sn`` is one
    64-row block's bytes, and a block holds tiles of 64 rows × 16 bytes, each contiguous."""
    if TILED:
        return (rn >> 6) * stride_sn + ((kb >> 4) << 10) + ((rn & 63) << 4) + (kb & 15)  # indices ≥ 0
    else:
        return rn * stride_sn + kb


@triton.jit
def _decode_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, slot_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, KB, NSLOT,
    stride_xm, stride_wn, stride_ss, stride_sn, stride_as, stride_ym,
    ONE_DELTA: tl.constexpr, ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, CHUNK_ITERS: tl.constexpr,
    LATE_REDUCE: tl.constexpr = False, TILED: tl.constexpr = False,
):
    """Decode (small M) on CUDA cores. Program (n-tile, K-chunk, row block): W is loaded once per
    K step and used from registers by each of the program's ``BLOCK_M`` rows (``tl.static_range``);
    the rows' sums are accumulated over the K chunk and written once, after the loop. ``ONE_DELTA``: a single variant, so
    ``W + α·s`` is formed once; else each row forms its own tenant's ``W + α_t·s_t`` (slot −1: α = 0).
    K is split into chunks of ``CHUNK_ITERS`` steps across programs when N alone gives too few
    programs; their float32 partial sums meet in a workspace (see ``_emit``). ``LATE_REDUCE`` (one
    row per program): keep a partial sum per thread and reduce across threads once after the K loop
    instead of every step (a step then has no barrier, shuffle or shared-memory round trip)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    SPLIT = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # rows past N re-read row n mod N (in bounds, never written): no load mask on N
    offs_b = tl.arange(0, BLOCK_KB)
    offs_j = tl.arange(0, 8)
    if ONE_DELTA:
        if ALPHA_PER_ROW:
            alpha1 = tl.load(a_ptr + rn)[:, None, None]
        else:
            alpha1 = tl.load(a_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    LATE: tl.constexpr = LATE_REDUCE and BLOCK_M == 1
    if LATE:
        acc1 = tl.zeros((BLOCK_N, BLOCK_KB), dtype=tl.float32)  # per-thread partial sums
    kb_lo = pid_k * (BLOCK_KB * CHUNK_ITERS)
    for kb0 in range(kb_lo, tl.minimum(kb_lo + BLOCK_KB * CHUNK_ITERS, KB), BLOCK_KB):
        kb = kb0 + offs_b
        k = kb[:, None] * 8 + offs_j[None, :]                                       # [BKB, 8]
        if EVEN:
            w = tl.load(w_ptr + rn[:, None, None] * stride_wn + k[None, :, :]).to(tl.float32)
        else:
            w = tl.load(w_ptr + rn[:, None, None] * stride_wn + k[None, :, :], mask=(k < K)[None, :, :],
                        other=0.0).to(tl.float32)
        if ONE_DELTA:
            byte = tl.load(s_ptr + _sign_off(rn[:, None], kb[None, :], stride_sn, TILED), mask=(kb < KB)[None, :],
                           other=0)
            bit = (byte.to(tl.int32)[:, :, None] >> offs_j[None, None, :]) & 1
            w_eff = w + tl.where(bit != 0, alpha1, -alpha1)                         # W + α·s in float32
        for i in tl.static_range(BLOCK_M):
            r = (pid_m * BLOCK_M + i) % M
            if EVEN:
                x = tl.load(x_ptr + r * stride_xm + k).to(tl.float32)
            else:
                x = tl.load(x_ptr + r * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)  # 0 past K
            if not ONE_DELTA:  # this row's own tenant
                slot = tl.load(slot_ptr + r)
                has = (slot >= 0) & (slot < NSLOT)  # −1 (or out of range): base only
                sl = tl.where(has, slot, 0)
                # base-only rows read nothing (there may be no slot at all: S = 0); `has` as a tensor mask
                slot_n = rn * 0 + slot
                has_n = (slot_n >= 0) & (slot_n < NSLOT)                                 # [BN]
                if ALPHA_PER_ROW:
                    alpha_i = tl.load(a_ptr + sl * stride_as + rn, mask=has_n, other=0.0)[:, None, None]
                else:
                    alpha_i = tl.load(a_ptr + sl * stride_as + rn * 0, mask=has_n, other=0.0)[:, None, None]
                byte = tl.load(s_ptr + sl * stride_ss + _sign_off(rn[:, None], kb[None, :], stride_sn, TILED),
                               mask=(kb < KB)[None, :] & has_n[:, None], other=0)
                bit = (byte.to(tl.int32)[:, :, None] >> offs_j[None, None, :]) & 1
                w_eff = w + tl.where(bit != 0, alpha_i, -alpha_i)
            if LATE:  # (a constexpr: only one branch is compiled)
                acc1 += tl.sum(w_eff * x[None, :, :], axis=2)                      # within each thread
            else:
                part = tl.sum(tl.sum(w_eff * x[None, :, :], axis=2), axis=1)        # [BN]
                acc = tl.where(offs_m[:, None] == i, acc + part[None, :], acc)
    if LATE:
        acc = tl.sum(acc1, axis=1)[None, :]
    for i in tl.static_range(BLOCK_M):
        _emit(tl.sum(tl.where(offs_m[:, None] == i, acc, 0.0), axis=0), pid_m * BLOCK_M + i, M, N, y_ptr,
              stride_ym, ws_ptr, b_ptr, rn, offs_n, SPLIT, HAS_BIAS)
    if SPLIT > 1:
        _finish_tile(pid_m, pid_n, SPLIT, M, N, y_ptr, stride_ym, ws_ptr, cnt_ptr, b_ptr, rn, offs_n, HAS_BIAS, BLOCK_M)


@triton.jit
def _mm_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
    W_AS_A: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    TILED: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # consecutive programs share one panel of W (read once from HBM, then L2)
    pid_n = pid // num_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = offs_n % N
    rm = offs_m % M
    offs_b = tl.arange(0, BLOCK_K // 8)
    offs_j = tl.arange(0, 8)
    offs_k = tl.arange(0, BLOCK_K)
    if ALPHA_PER_ROW:
        alpha = tl.load(a_ptr + rn)[:, None, None]                                  # [BN, 1, 1]
    else:
        alpha = tl.load(a_ptr)
    w_ptrs = w_ptr + rn[:, None, None] * stride_wn + (offs_b[:, None] * 8 + offs_j[None, :])[None, :, :]
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_ptrs = x_ptr + rm[None, :] * stride_xm + offs_k[:, None]                  # xᵀ tile [BK, BM]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]                  # x tile [BM, BK]
    for k0 in range(0, K, BLOCK_K):
        s_ptrs = s_ptr + _sign_off(rn[:, None], (k0 // 8 + offs_b)[None, :], stride_sn, TILED)
        if EVEN_K:
            w = tl.load(w_ptrs)                                                     # [BN, BK/8, 8]
            byte = tl.load(s_ptrs)                                                  # [BN, BK/8]
            xt = tl.load(x_ptrs)
        else:
            kk = k0 + offs_b[:, None] * 8 + offs_j[None, :]
            w = tl.load(w_ptrs, mask=(kk < K)[None, :, :], other=0.0)
            byte = tl.load(s_ptrs, mask=(k0 // 8 + offs_b < (K + 7) // 8)[None, :], other=0)
            if W_AS_A:
                xt = tl.load(x_ptrs, mask=(k0 + offs_k < K)[:, None], other=0.0)    # x = 0 past K
            else:
                xt = tl.load(x_ptrs, mask=(k0 + offs_k < K)[None, :], other=0.0)
        bit = (byte.to(tl.int32)[:, :, None] >> offs_j[None, None, :]) & 1
        w_eff = (w.to(tl.float32) + tl.where(bit != 0, alpha, -alpha)).to(xt.dtype)  # the one rounding
        w_eff = tl.reshape(w_eff, (BLOCK_N, BLOCK_K))
        if W_AS_A:
            if DOT_FP32:
                acc += tl.dot(w_eff.to(tl.float32), xt.to(tl.float32))
            else:
                acc = tl.dot(w_eff, xt, acc)
        else:
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), tl.trans(w_eff.to(tl.float32)))
            else:
                acc = tl.dot(xt, tl.trans(w_eff), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if W_AS_A:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _tenants_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, slot_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, KB, NSLOT,
    stride_xm, stride_wn, stride_ss, stride_sn, stride_as, stride_ym,
    ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_ITERS: tl.constexpr,
    TILED: tl.constexpr = False,
):
    """Mixed tenants with a table lookup for the signs (the "Four Russians" trick).

    ``y[m] = x[m]·Wᵀ + α_t ⊙ (x[m]·S_tᵀ)``, ``S_t = 2·B_t − 1``, so
    ``x[m]·S_tᵀ = 2·x[m]·B_tᵀ − Σ_k x[m, k]``. The base product of the program's rows is one
    tensor-core ``tl.dot`` (W read once, shared by all rows). For the 0/1 part each row builds, per
    K step and per sign byte b, two tables of the 16 sums of every subset of 4 activations
    (``lut_lo[b, e] = Σ_{j: bit j of e} x[8b + j]``, ``lut_hi`` the same for ``x[8b + 4 + j]``),
    from 8 strided loads of x; each sign byte of the row's tenant is loaded once and its two
    nibbles pick one entry each (``tl.gather``, warp shuffles): two lookups and adds per 8 weights
    instead of unpacking and multiply-adding each bit, several times fewer instructions per row and
    weight than the FMA kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    SPLIT = tl.num_programs(1)
    BMP: tl.constexpr = 16 if BLOCK_M < 16 else BLOCK_M  # the dot's N dimension (≥ 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BMP)
    rows_p = pid_m * BLOCK_M + offs_p
    ok_p = (offs_p < BLOCK_M) & (rows_p < M)
    kb_lo = pid_k * (BLOCK_K // 8 * CHUNK_ITERS)
    kb_hi = tl.minimum(kb_lo + BLOCK_K // 8 * CHUNK_ITERS, KB)
    # 1. base product of all rows: acc_b[n, i] = Σ_k W[n, k]·x[row i, k]
    acc_b = tl.zeros((BLOCK_N, BMP), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, BLOCK_K // 8):
        k = kb0 * 8 + offs_k
        if EVEN:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :])
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=(k < K)[None, :], other=0.0)
        xt = tl.load(x_ptr + (rows_p % M)[None, :] * stride_xm + k[:, None], mask=ok_p[None, :] & (k < K)[:, None],
                     other=0.0)                                                     # [BK, BMP]
        if DOT_FP32:
            acc_b += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc_b = tl.dot(w, xt, acc_b)
    # 2. per row: its tenant's 0/1 sums by table lookup
    GB: tl.constexpr = BLOCK_K // 8                         # sign bytes per K step
    offs_gb = tl.arange(0, GB)
    e = tl.arange(0, 16)                                    # table entries: the 16 values of a nibble
    for i in tl.static_range(BLOCK_M):
        row = pid_m * BLOCK_M + i
        r = row % M
        slot = tl.load(slot_ptr + r)
        has = (slot >= 0) & (slot < NSLOT)  # −1 (or out of range): base only
        sl = tl.where(has, slot, 0)
        base = tl.sum(tl.where(offs_p[None, :] == i, acc_b, 0.0), axis=1)          # [BN]
        part = base
        if has:
            acc_s = tl.zeros((GB, BLOCK_N), dtype=tl.float32)
            xsum = tl.zeros((GB, 1), dtype=tl.float32)
            for kb0 in range(kb_lo, kb_hi, GB):
                kbyte = kb0 + offs_gb                                               # [GB]: sign byte index
                xr = x_ptr + r * stride_xm + kbyte * 8
                lut_lo = tl.zeros((GB, 16), dtype=tl.float32)  # subsets of x[8b .. 8b+3] (low nibble)
                lut_hi = tl.zeros((GB, 16), dtype=tl.float32)  # subsets of x[8b+4 .. 8b+7] (high nibble)
                for j in tl.static_range(4):
                    if EVEN:
                        xl = tl.load(xr + j).to(tl.float32)[:, None]
                        xh = tl.load(xr + 4 + j).to(tl.float32)[:, None]
                    else:  # x = 0 past K
                        xl = tl.load(xr + j, mask=kbyte * 8 + j < K, other=0.0).to(tl.float32)[:, None]
                        xh = tl.load(xr + 4 + j, mask=kbyte * 8 + 4 + j < K, other=0.0).to(tl.float32)[:, None]
                    bit_j = ((e >> j) & 1).to(tl.float32)[None, :]
                    lut_lo += xl * bit_j
                    lut_hi += xh * bit_j
                    xsum += xl + xh
                s_ptrs = s_ptr + sl * stride_ss + _sign_off(rn[None, :], kbyte[:, None], stride_sn, TILED)
                if EVEN:
                    byte = tl.load(s_ptrs).to(tl.int32)                             # [GB, BN], each byte once
                else:
                    byte = tl.load(s_ptrs, mask=(kbyte < KB)[:, None], other=0).to(tl.int32)
                acc_s += tl.gather(lut_lo, byte & 15, axis=1) + tl.gather(lut_hi, byte >> 4, axis=1)
            if ALPHA_PER_ROW:
                alpha_i = tl.load(a_ptr + sl * stride_as + rn)
            else:
                alpha_i = tl.load(a_ptr + sl * stride_as)
            part = base + alpha_i * (2.0 * tl.sum(acc_s, axis=0) - tl.sum(tl.sum(xsum, axis=1), axis=0))
        _emit(part, row, M, N, y_ptr, stride_ym, ws_ptr, b_ptr, rn, offs_n, SPLIT, HAS_BIAS)
    if SPLIT > 1:
        _finish_tile(pid_m, pid_n, SPLIT, M, N, y_ptr, stride_ym, ws_ptr, cnt_ptr, b_ptr, rn, offs_n, HAS_BIAS, BLOCK_M)


# ---------------------------------------------------------------------------------------------
# tile configurations for the autotuner (GPU); under the interpreter the wrappers launch fixed tiles

NO_SPLIT = 1 << 20  # CHUNK_ITERS meaning "the whole K in one program"


def _decode_configs(batched: bool):
    """Decode tiles (BLOCK_N, BLOCK_KB, CHUNK_ITERS, warps) chosen for the Llama-2-70B layer shapes on
    Hopper: few rows per program, 1–2 K bytes per step; ``batched``: the mixed-tenant (FMA) tiles,
    with ``BLOCK_M`` rows per program."""
    if batched:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_KB": bkb, "CHUNK_ITERS": it}, num_warps=w)
                for bm, bn, bkb, it, w in ((1, 4, 128, 1, 4), (1, 2, 128, NO_SPLIT, 4), (2, 4, 128, 1, 4),
                                           (4, 4, 128, 1, 4), (4, 2, 128, NO_SPLIT, 4), (8, 4, 128, 1, 4),
                                           (4, 8, 64, 1, 4), (16, 4, 64, 1, 4))]
    tiles = ((2, 128, NO_SPLIT, 4), (1, 256, NO_SPLIT, 4), (2, 256, NO_SPLIT, 8), (1, 128, NO_SPLIT, 2),
             (2, 128, 2, 4), (2, 128, 4, 4), (4, 128, 2, 4), (1, 256, 2, 4), (2, 64, NO_SPLIT, 2), (4, 128, 1, 4),
             (4, 64, NO_SPLIT, 4))
    # LATE_REDUCE (used when M = 1) variants of the leading tiles: fewer instructions per K step (one
    # cross-thread reduction after the loop); the tuner chooses between them and the plain ones
    return [triton.Config({"BLOCK_N": bn, "BLOCK_KB": bkb, "CHUNK_ITERS": it}, num_warps=w) for bn, bkb, it, w in tiles] \
        + [triton.Config({"BLOCK_N": bn, "BLOCK_KB": bkb, "CHUNK_ITERS": it, "LATE_REDUCE": True}, num_warps=w)
           for bn, bkb, it, w in tiles[:3] + tiles[4:5] + tiles[6:7]]


def _decode_configs_tiled():
    """Decode tiles for signs in ``tile_signs``' layout: the row tiles above plus tiles of 4–16 rows
    and 16–128 bytes per K step, so that a program reads whole 64–256-byte runs of a 64-row × 16-byte
    sign tile (a program of one or two rows reads 16-byte pieces a KiB apart there, slower than the
    same tile on sign rows)."""
    tiles = ((4, 64, NO_SPLIT, 4), (8, 32, NO_SPLIT, 4), (16, 16, NO_SPLIT, 4), (8, 64, NO_SPLIT, 8),
             (16, 32, NO_SPLIT, 8), (4, 128, NO_SPLIT, 8), (8, 32, 4, 4), (4, 64, 2, 4), (16, 16, 8, 4))
    return _decode_configs(False) \
        + [triton.Config({"BLOCK_N": bn, "BLOCK_KB": bkb, "CHUNK_ITERS": it}, num_warps=w) for bn, bkb, it, w in tiles] \
        + [triton.Config({"BLOCK_N": bn, "BLOCK_KB": bkb, "CHUNK_ITERS": it, "LATE_REDUCE": True}, num_warps=w)
           for bn, bkb, it, w in tiles[:4]]


def _lut_configs():
    """Table-lookup mixed-tenant tiles (BLOCK_N, BLOCK_K, CHUNK_ITERS, warps, stages): two pipeline
    stages keep the shared memory of a program small; wide N tiles share each row's table among more
    output features."""
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "CHUNK_ITERS": it}, num_warps=w, num_stages=st)
            for bn, bk, it, w, st in ((128, 128, 8, 4, 2), (256, 128, 8, 4, 2), (256, 64, 8, 4, 2), (128, 64, 8, 4, 2))]


def _mm_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "W_AS_A": wa}, num_warps=w, num_stages=st)
            for bn, bm, bk, w, st, wa in (
                (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 3, False), (64, 256, 64, 8, 3, False),
                (128, 128, 64, 8, 3, True), (128, 16, 128, 4, 4, True), (64, 16, 128, 4, 4, True),
                (128, 32, 64, 4, 4, True), (128, 64, 64, 4, 4, True),
                # BLOCK_K = 128: half as many K steps, so half as many of the waits Triton puts after a
                # wgmma with a computed operand (139–199 KB of shared memory)
                (128, 256, 128, 8, 2, True), (128, 256, 128, 8, 2, False), (256, 128, 128, 8, 2, True))]


_WORKSPACE: dict = {}  # device -> (float32 partial sums [≥ M·N], int32 counters): zero between calls


def _workspace(device: torch.device, n_sums: int, n_counts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace of ``device``: zeros, and left as zeros by every kernel that uses it (the
    last program of each tile reads its sums back and zeroes them, ``_finish``). Not for concurrent
    kernels on two streams of one device."""
    ws, cnt = _WORKSPACE.get(device, (None, None))
    if ws is None or ws.numel() < n_sums or cnt.numel() < n_counts:
        n_sums = max(n_sums, 0 if ws is None else ws.numel(), 1 << 16)
        n_counts = max(n_counts, 0 if cnt is None else cnt.numel(), 1 << 14)
        ws = torch.zeros(n_sums, device=device, dtype=torch.float32)
        cnt = torch.zeros(n_counts, device=device, dtype=torch.int32)
        _WORKSPACE[device] = (ws, cnt)
    return ws, cnt


@triton.jit
def _mm_entry(x_ptr, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, M, N, K, M_BUCKET,
              stride_xm, stride_wn, stride_sn, stride_ym,
              ALPHA_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
              W_AS_A: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              TILED: tl.constexpr = False):
    """Autotuning entry of ``_mm_kernel``: ``M_BUCKET`` (M rounded up to a power of two) is only in
    the tuning key, so every M of one bucket reuses one tuned tile."""
    _mm_kernel(x_ptr, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
               ALPHA_PER_ROW, HAS_BIAS, EVEN_K, DOT_FP32, W_AS_A, BLOCK_N, BLOCK_M, BLOCK_K, TILED)


def _quick_bench(fn, quantiles=None):
    """Autotuning timer for tests (``DELTAFLEET_TRITON_QUICK_TUNE=1``): a few runs per configuration
    instead of Triton's ~100 ms, so a test suite of many small shapes does not spend minutes tuning."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=1, rep=2, quantiles=quantiles)


def _graph_bench(fn, quantiles=None):
    """Autotuning timer: CUDA-graph replay, as a serving engine runs decode. Triton's default timer
    launches eagerly, and for kernels of tens of µs its launch overhead and noise, not the kernel,
    decide the choice: it can keep a tile several times slower than the best."""
    from triton.testing import do_bench_cudagraph

    # do_bench_cudagraph times on a side stream that does not wait for the caller's stream: let the
    # work queued there (the inputs being written, a kernel using the split-K workspace) finish first
    torch.cuda.current_stream().synchronize()
    return do_bench_cudagraph(fn, rep=20, quantiles=quantiles)


# DELTAFLEET_TRITON_AUTOTUNE=0 (read at import): every kernel runs its first (default) tile and the
# prefill and mixed-tenant choices take their defaults, with nothing compiled or timed beyond that. A
# server then starts answering at once instead of compiling and timing every tile for every new layer
# shape and row count (minutes for a 7B model on a fresh machine), at some cost in speed.
AUTOTUNE = os.environ.get("DELTAFLEET_TRITON_AUTOTUNE", "1") != "0"


def _autotune(configs, key, fn):
    """``triton.autotune`` over ``configs`` keyed by the argument names ``key`` (launch keywords such
    as ``TILED`` included: a sign layout gets its own tuned tile)."""
    quick = os.environ.get("DELTAFLEET_TRITON_QUICK_TUNE") == "1"
    return triton.autotune(configs=configs if AUTOTUNE else configs[:1], key=key,
                           do_bench=_quick_bench if quick else _graph_bench)(fn)


_batched_tuned = _autotune(_decode_configs(True), ["N", "K", "M", "TILED"], _decode_kernel)
# decode and one mixed row: a tuner per sign layout (tiled signs: the row tiles and tiles of more rows)
_decode_tuned = _autotune(_decode_configs(False), ["N", "K", "BLOCK_M"], _decode_kernel)
_batched1_tuned = _autotune(_decode_configs(False), ["N", "K"], _decode_kernel)
_decode_tiled_tuned = _autotune(_decode_configs_tiled(), ["N", "K", "BLOCK_M"], _decode_kernel)
_batched1_tiled_tuned = _autotune(_decode_configs_tiled(), ["N", "K"], _decode_kernel)
# EVEN (no K masks) needs every K step of every tile whole: K a multiple of the longest step
_DECODE_EVEN = 8 * max(c.kwargs["BLOCK_KB"] for c in _decode_configs(False) + _decode_configs_tiled())
_BATCHED_EVEN = 8 * max(c.kwargs["BLOCK_KB"] for c in _decode_configs(True))
_LUT_EVEN = max(c.kwargs["BLOCK_K"] for c in _lut_configs())
_mm_tuned = _autotune(_mm_configs(), ["N", "K", "M_BUCKET", "TILED"], _mm_entry)
_lut_tuned = _autotune(_lut_configs(), ["N", "K", "M", "TILED"], _tenants_kernel)


def decode_counters(n: int) -> int:
    """Split-K counters the one-variant decode (one row block) needs for N outputs: one per N tile,
    and its tiles go down to one row of W a program (``BLOCK_N = 1``)."""
    return n


def _decode_grid(n: int, kb: int, m: int, bm: int | None = None):
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(kb, meta["BLOCK_KB"] * meta["CHUNK_ITERS"]),
                         triton.cdiv(m, bm or meta["BLOCK_M"]))


def _check_dtypes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must both be bf16 or fp16, got {x.dtype} and {weight.dtype}")


def bitdelta_linear_triton(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``bitdelta_linear``: same contract as :func:`deltafleet.kernels.reference.bitdelta_linear`.

    Args:
        x: ``[..., K]`` bf16 or fp16 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        weight: ``[N, K]`` in ``x.dtype``.
        sign: ``[N, ceil(K/8)]`` uint8, or the same in ``deltafleet.kernels.reference.tile_signs``' layout
            (4-D), which every kernel here reads.
        alpha: float32 ``[]`` or ``[N]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``. From the CUDA-core kernel (one row; up to ``GEMV_MAX_M`` rows
        off Hopper or where it is timed fastest): no rounding of ``W + α·s`` (float32 sums); from
        the tensor-core kernels: ``W + α·s`` rounded once to ``x.dtype`` before the float32-
        accumulating product.

    Raises:
        ValueError: on a dtype or shape that does not fit the contract, or an argument on the wrong
            device (:func:`deltafleet.kernels.reference.check_tensors`).
    """
    check_tensors(x=x, weight=weight, sign=sign, alpha=alpha, bias=bias)  # before any launch: devices
    _check_dtypes(x, weight)
    n, k = check_weight_and_bias(weight, bias)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    kb = (k + 7) // 8
    tiled = sign.dim() == 4  # kernels.reference.tile_signs' layout
    want = tiled_shape(n, k) if tiled else (n, kb)
    if sign.dtype != torch.uint8 or tuple(sign.shape) != want:
        raise ValueError(f"sign must be uint8 {list(want)}, got {sign.dtype} {tuple(sign.shape)}")
    alpha = alpha.to(device=x.device, dtype=torch.float32).contiguous()
    if alpha.dim() not in (0, 1) or (alpha.dim() == 1 and alpha.shape[0] != n):
        raise ValueError(f"alpha must be [] or [{n}], got {tuple(alpha.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    sign = sign.contiguous() if tiled or sign.stride(-1) != 1 else sign
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y.reshape(*lead, n)
    flags = dict(ALPHA_PER_ROW=alpha.dim() == 1, HAS_BIAS=bias is not None, TILED=tiled)
    b = bias.to(x.device).contiguous() if bias is not None else alpha  # the kernels read bias[n] densely
    dev_bias = b if bias is not None else None  # on x's device, contiguous
    hopper = not _interpret() and gluon_bitdelta.supported(x2, weight)
    strides = (x2.stride(0), weight.stride(0), sign.stride(0), y.stride(0))
    if m <= GEMV_MAX_M:
        bm = triton.next_power_of_2(m)
        ws, cnt = _workspace(x.device, m * n, decode_counters(n))
        args = (x2, weight, sign, alpha, alpha, b, y, ws, cnt, m, n, k, kb, 1,
                x2.stride(0), weight.stride(0), 0, sign.stride(0), 0, y.stride(0))
        if _interpret():
            _decode_kernel[(triton.cdiv(n, 8), triton.cdiv(kb, 64), 1)](
                *args, ONE_DELTA=True, **flags, EVEN=k % 256 == 0, BLOCK_M=bm, BLOCK_N=8, BLOCK_KB=32, CHUNK_ITERS=2,
                LATE_REDUCE=bm == 1)
            return y.reshape(*lead, n)
        tuned = _decode_tiled_tuned if tiled else _decode_tuned

        def decode(x2=x2, weight=weight, sign=sign, alpha=alpha):  # (the dispatcher times it on copies)
            tuned[_decode_grid(n, kb, m, bm)](x2, weight, sign, alpha, *args[4:], ONE_DELTA=True, **flags,
                                              EVEN=k % _DECODE_EVEN == 0, BLOCK_M=bm)

        # from two rows up on a Hopper GPU, the register-operand kernel (its token tile of 8) by default
        config = _prefill_choice(x2, weight, sign, alpha, dev_bias, y, strides, flags, b, decode) \
            if m > 1 and hopper else "decode"
        if config in ("decode", None):  # None: every candidate failed to run
            decode()
            return y.reshape(*lead, n)
        return gluon_prefill_rs.bitdelta_linear_prefill_rs(x2, weight, sign, alpha, dev_bias, y,
                                                           *config[1:]).reshape(*lead, n)
    if hopper:
        config = _prefill_choice(x2, weight, sign, alpha, dev_bias, y, strides, flags, b)
        if config is not None and config[0] == "rs":
            return gluon_prefill_rs.bitdelta_linear_prefill_rs(x2, weight, sign, alpha, dev_bias, y,
                                                               *config[1:]).reshape(*lead, n)
        if config is not None:
            return gluon_bitdelta.bitdelta_linear_gluon(x2, weight, sign, alpha, dev_bias, y, config).reshape(*lead, n)
    if _interpret():
        _mm_kernel[(triton.cdiv(m, 32) * triton.cdiv(n, 32),)](
            x2, weight, sign, alpha, b, y, m, n, k, *strides, **flags, EVEN_K=k % 32 == 0, DOT_FP32=True,
            W_AS_A=m % 2 == 0, BLOCK_N=32, BLOCK_M=32, BLOCK_K=32)
    else:
        _mm_triton(x2, weight, sign, alpha, b, y, strides, flags)
    return y.reshape(*lead, n)


def _mm_triton(x2, weight, sign, alpha, b, y, strides, flags) -> None:
    m, k = x2.shape
    n = weight.shape[0]
    _mm_tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](
        x2, weight, sign, alpha, b, y, m, n, k, triton.next_power_of_2(m), *strides, **flags,
        EVEN_K=k % 128 == 0, DOT_FP32=False)


_PREFILL_CHOICE: dict = {}  # (N, K, M bucket, dtype, flags) -> Gluon config, or None for the Triton kernel


def _prefill_choice(x2, weight, sign, alpha, bias, y, strides, flags, b, decode=None):
    """Pick the kernel for this problem shape beyond one row (``bias``: on x's device and
    contiguous, or None), timed once per shape (M rounded up to a power of two) by CUDA-graph replay
    (``_fastest``), the fastest kept:

    * the register-operand kernel (``("rs", config, split, persistent, whole)``), each of the first
      four of ``deltafleet.kernels.gluon_prefill_rs.usable_configs`` at its default K split
      (``gluon_prefill_rs.default_split``), half and twice that (or, where the default runs the full
      waves' tiles whole and splits the rest: that, and every tile whole or in two chunks), with one
      program per work unit and persistent, where it runs;
    * up to 64 rows where it runs, only those, and ``decode`` (the CUDA-core kernel, a call with no
      arguments, given up to ``GEMV_MAX_M`` rows) as ``"decode"``;
    * else also the Gluon kernel (``deltafleet.kernels.gluon_bitdelta.CONFIGS``) and the autotuned
      Triton kernel (None).

    While a CUDA graph is being captured, with ``DELTAFLEET_TRITON_QUICK_TUNE=1`` (tests) or
    ``DELTAFLEET_TRITON_AUTOTUNE=0``, nothing is timed: the register-operand kernel's first
    configuration, persistent at its default split, where it runs (from two rows up it is faster
    than the CUDA-core kernel on every Llama-2 layer shape, docs/kernels.md), else ``"decode"`` when
    given, else the Gluon kernel's default."""
    m, k = x2.shape
    n = weight.shape[0]
    key = (n, k, triton.next_power_of_2(m), x2.dtype, tuple(sorted(flags.items())))  # (decode: rows ≤ 4)
    if key in _PREFILL_CHOICE:
        return _PREFILL_CHOICE[key]
    configs = gluon_prefill_rs.usable_configs(x2, weight, sign)
    sms = gluon_prefill_rs.multiprocessors(x2.device) if configs else 0
    if (torch.cuda.is_current_stream_capturing() or os.environ.get("DELTAFLEET_TRITON_QUICK_TUNE") == "1"
            or not AUTOTUNE):
        if configs:
            split, whole = gluon_prefill_rs.default_split(m, n, k, configs[0], sms)
            return ("rs", configs[0], split, True, whole)
        return "decode" if decode is not None else gluon_bitdelta.DEFAULT_CONFIG
    runs = {}
    for cfg in configs[:4]:  # (up to 128 rows: the smallest token tiles that hold the rows first)
        d, whole = gluon_prefill_rs.default_split(m, n, k, cfg, sms)
        forms = sorted({(d, whole), (1, 0), (2, 0)} if whole else {(s, 0) for s in (d, max(1, d // 2), 2 * d)})
        for persistent in (False, True):
            for split, whole in forms:
                runs[("rs", cfg, split, persistent, whole)] = (
                    lambda x2, weight, sign, alpha, cfg=cfg, split=split, persistent=persistent, whole=whole:
                    gluon_prefill_rs.bitdelta_linear_prefill_rs(x2, weight, sign, alpha, bias, y, cfg, split,
                                                                persistent, whole))
    if decode is not None:
        runs["decode"] = decode
    if not configs or m > 64:
        runs.update({cfg: (lambda x2, weight, sign, alpha, cfg=cfg: gluon_bitdelta.bitdelta_linear_gluon(
            x2, weight, sign, alpha, bias, y, cfg)) for cfg in gluon_bitdelta.CONFIGS})
        runs[None] = lambda x2, weight, sign, alpha: _mm_triton(x2, weight, sign, alpha, b if bias is not None
                                                                else alpha, y, strides, flags)
    _PREFILL_CHOICE[key] = _fastest(runs, operands=(x2, weight, sign, alpha))
    return _PREFILL_CHOICE[key]


def _fastest(runs: dict, bench=None, finalists: int = 4, rounds: int = 3, operands: tuple | None = None,
             l2_bytes: int | None = None):
    """The key of the fastest of ``runs`` (key → a call), each run once outside the timing
    (compiling, and autotuning a Triton kernel), then timed by CUDA-graph replay; a run that fails
    (a configuration that does not fit this device) is skipped. None if all fail.

    ``operands`` (the tensors the runs read, each run called as ``run(*operands)``): every timed call
    reads its own copy of them, cycled past the L2 (:func:`deltafleet.kernels.timing.cold_copies`,
    ``l2_bytes``: the first tensor's device's L2 by default), as a decode step reads each layer's
    weights from memory; a graph replaying calls on one set would read a matrix smaller than the L2
    from it and rank the candidates by what they do there. None: the runs take no arguments.

    The ``finalists`` fastest of that first pass are timed again, ``rounds`` times each in turn
    (interleaved, so a clock or neighbour change hits all alike), and the lowest median wins: at 16
    rows the best candidates lie within 1–2 % of each other, about the size of one timing's noise.
    ``bench`` (a call → milliseconds) replaces ``do_bench_cudagraph`` (tests)."""
    if bench is None:
        from triton.testing import do_bench_cudagraph

        def bench(fn):
            return do_bench_cudagraph(fn, rep=20)

    if operands is not None:
        if l2_bytes is None:
            l2_bytes = timing.l2_size(next(t for t in operands if isinstance(t, torch.Tensor)).device)
        copies = timing.cold_copies(operands, l2_bytes)
        runs = {key: timing.rotating(fn, copies) for key, fn in runs.items()}
    times = {}
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # the timing runs on a side stream (see _graph_bench)
    for key, fn in runs.items():
        try:
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[key] = bench(fn)
        except Exception:  # noqa: BLE001 - a configuration that does not fit this device is skipped
            continue
    if not times:
        return None
    order = sorted(times, key=times.get)
    best = order[:max(1, finalists)]
    if len(best) == 1 or rounds < 1:
        return best[0]
    again = {key: [] for key in best}
    for _ in range(rounds):
        for key in list(again):
            try:
                again[key].append(bench(runs[key]))
            except Exception:  # noqa: BLE001 - a finalist that fails now (out of memory, …) drops out
                del again[key]
    if not again:  # every finalist failed this time: the fastest of the rest, else none (table lookup)
        return next(iter(order[len(best):]), None)
    return min(again, key=lambda key: sorted(again[key])[(len(again[key]) - 1) // 2])


_TENANTS_CHOICE: dict = {}  # (N, K, row bucket, dtype, flags) -> Gluon tenant config, or None for table lookup


def _tenants_choice(x, weight, signs, alphas, slot, bias, y, ws, cnt, lut_args, tiled=False):
    """Pick the mixed-tenant kernel for this problem shape (M rounded up to a power of two), timing
    candidates with CUDA-graph replay (``_fastest``: the four fastest again, lowest median kept):
    where the warp-specialised kernel runs (``gluon_planes.planes_supported``), each of its
    configurations (``WS_CONFIGS``, on tiled signs those of 128-weight K steps) at the modelled K
    splits (``gluon_planes.ws_split`` for the int8 and the binary ring) and at 1, 2, 3, 4, 6 and 8;
    from four rows up also with the sign part on the binary tensor cores (``bits``: alone, with
    programmatic dependent launch, and persistent, at the modelled splits and 1, 2, 4; stream-K once;
    from eight rows with the base spread); at sixteen rows only bits alone and with PDL at those
    splits, and stream-K. Elsewhere each tile of the Hopper CUDA-core kernel
    (``gluon_bitdelta.tenant_configs``, row signs only) and the table-lookup kernel. A candidate
    that fails to compile or launch is skipped.
    While a CUDA graph is being captured, or with ``DELTAFLEET_TRITON_QUICK_TUNE=1`` (tests), nothing
    is timed and the default is used: the warp-specialised kernel (``gluon_planes.default_config``,
    from four rows up on the binary tensor cores) where it can run, else the Hopper CUDA-core kernel's
    default tile (the table-lookup kernel with ``DELTAFLEET_TRITON_AUTOTUNE=0``)."""
    m, k = x.shape
    rows = max(2, min(16, triton.next_power_of_2(m)))
    # whether the int8/binary kernel can run is part of the key: a first call with signs not 16-byte
    # aligned must not fix the choice for aligned ones
    can_planes = gluon_planes.planes_supported(x, weight, signs)
    key = (weight.shape[0], k, triton.next_power_of_2(m), x.dtype, alphas.dim(), bias is not None, tiled,
           can_planes)
    if key in _TENANTS_CHOICE:
        return _TENANTS_CHOICE[key]
    configs = [] if tiled else gluon_bitdelta.tenant_configs(rows)  # the CUDA-core kernel reads sign rows
    # int8 tensor-core configurations that run here: with tiled signs those of 128-weight K steps
    planes = ([c for c in gluon_planes.WS_CONFIGS[rows] if k % c[0] == 0 and (not tiled or c[0] == 128)]
              if can_planes else [])
    untimed = (not AUTOTUNE or torch.cuda.is_current_stream_capturing()
               or os.environ.get("DELTAFLEET_TRITON_QUICK_TUNE") == "1")
    if untimed:  # the warp-specialised kernel's default, from four rows up with the sign part on the
        # binary tensor cores (there the faster of the two sign paths on the 70B layer set)
        if planes:
            return ("planes", planes[0], None) + (((("bits", True), ), ) if rows >= 4 else ())
        return configs[0] if AUTOTUNE and configs else None
    runs = {}
    # each configuration of the warp-specialised int8 tensor-core kernel at several K splits: where it
    # runs it is faster than every other tenant kernel from two rows up, so the others are not timed
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if planes else 0
    # from four rows up each also with the sign part on the binary tensor cores (bits): alone, with
    # programmatic dependent launch, persistent (one program per resident slot walking the work
    # units), from eight rows with the base product spread over the consumers, and stream-K
    # (persistent, equal runs of steps across tiles; the split does not apply: timed once).
    # At 16 rows only the binary path is timed (alone and with PDL at splits d, 1, 2, 4, and stream-K):
    # int8, base spread and one program per resident slot are slower there, and each timed variant is
    # one more compile per layer shape.
    bits, pdl = ("bits", True), ("pdl", True)
    sixteen = rows >= 16
    if sixteen:
        variants = [(bits, ), (bits, pdl)]
    elif rows >= 4:
        variants = [(), (bits, ), (bits, pdl), (bits, ("persistent", True)), (bits, pdl, ("persistent", True))]
    else:
        variants = [()]
    stream_k = [(bits, ("stream_k", True)), (bits, pdl, ("stream_k", True))] if rows >= 4 else []
    for cfg in planes:
        d = gluon_planes.ws_split(m, weight.shape[0], k, cfg, sms)
        d_bits = gluon_planes.ws_split(m, weight.shape[0], k, cfg, sms, bits=True)  # a smaller ring: more slots
        opts = variants + ([(bits, ("base_spread", True))]
                           if rows >= 8 and rows // min(rows, cfg[1]) > 1 and not sixteen else [])
        for split in sorted({d, d_bits} | {s for s in (1, 2, 3, 4, 6, 8) if k // cfg[0] // s >= 4}):
            if sixteen and split not in (d, d_bits, 1, 2, 4):
                continue
            for opt in (opts if split in (d, d_bits, 1, 2, 4) else [()]) + (stream_k if split == d else []):
                runs[("planes", cfg, split) + ((opt, ) if opt else ())] = (
                    lambda x, weight, signs, alphas, cfg=cfg, split=split, opt=opt:
                    gluon_planes.bitdelta_linear_batched_planes(x, weight, signs, alphas, slot, bias, y, ws, cnt,
                                                                cfg, split, tiled=tiled, **dict(opt)))
    if not runs:
        runs = {cfg: (lambda x, weight, signs, alphas, cfg=cfg: gluon_bitdelta.bitdelta_linear_batched_gluon(
            x, weight, signs, alphas, slot, bias, y, ws, cnt, cfg)) for cfg in configs}
        runs[None] = lambda x, weight, signs, alphas: _lut_launch(
            (x, weight, signs, alphas) + tuple(lut_args[4:]), alphas, bias, tiled)
    _TENANTS_CHOICE[key] = _fastest(runs, operands=(x, weight, signs, alphas))
    return _TENANTS_CHOICE[key]


def _lut_launch(args: tuple, alphas: torch.Tensor, bias: torch.Tensor | None, tiled: bool = False) -> None:
    """Launch the table-lookup mixed-tenant kernel with the wrapper's argument tuple (fixed tiles
    under the interpreter, autotuned on a GPU); ``tiled``: the signs are in ``tile_signs``' layout."""
    m, n, k, kb = args[9:13]
    flags = dict(ALPHA_PER_ROW=alphas.dim() == 2, HAS_BIAS=bias is not None, TILED=tiled)
    bm = min(16, triton.next_power_of_2(m))
    if _interpret():
        _tenants_kernel[(triton.cdiv(n, 16), triton.cdiv(kb, 16), triton.cdiv(m, bm))](
            *args, **flags, EVEN=k % 128 == 0, DOT_FP32=True, BLOCK_M=bm, BLOCK_N=16, BLOCK_K=64, CHUNK_ITERS=2)
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),  # noqa: E731
                             triton.cdiv(kb, meta["BLOCK_K"] // 8 * meta["CHUNK_ITERS"]), triton.cdiv(m, bm))
        _lut_tuned[grid](*args, **flags, EVEN=k % _LUT_EVEN == 0, DOT_FP32=False, BLOCK_M=bm)


def bitdelta_linear_batched_triton(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor,
                                   alphas: torch.Tensor, slot: torch.Tensor,
                                   bias: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """Triton mixed-tenant linear: same contract as :func:`deltafleet.kernels.reference.bitdelta_linear_batched`.

    Every row ``m`` computes ``x[m] · (W + α_t·s_t)ᵀ`` with ``t = slot[m]`` (−1: ``x[m] · Wᵀ``); each
    base tile is loaded once per program and shared by the program's rows. Four kernels (``impl``):
    ``"lut"`` (``_tenants_kernel``: base product on tensor cores, signs by table lookup), ``"gluon"``
    (Hopper only, two rows or more, K a multiple of 64: ``deltafleet.kernels.gluon_bitdelta``, base product on
    the tensor cores, signs on the CUDA cores meanwhile), ``"planes"`` (Hopper only, two rows or
    more, K a multiple of 128: ``deltafleet.kernels.gluon_planes``, the sign part on the int8 tensor cores with
    the activations in 16-bit fixed point, error ≤ max|x|/65278 per activation, to float32 rounding) and ``"fma"``
    (``_decode_kernel``: ``W + α_t·s_t`` formed in float32 registers per row; the default for one
    row, with the decode tiles). By default, from two rows up where ``"planes"`` runs, each of its
    configurations (``gluon_planes.WS_CONFIGS``) is timed at its modelled K split and 1, 2, 3, 4, 6
    and 8, from four rows up also on the binary tensor cores (``bits``: alone, with programmatic
    dependent launch, persistent and stream-K, and from eight rows with the base spread; at sixteen
    rows only bits alone, with PDL, and stream-K), once per shape, the four fastest timed again and the
    lowest median kept (``_tenants_choice``; untimed under CUDA-graph capture, with
    ``DELTAFLEET_TRITON_QUICK_TUNE=1`` or ``DELTAFLEET_TRITON_AUTOTUNE=0``: its default); elsewhere
    ``"lut"`` and each tile of ``"gluon"``. None of them rounds ``W + α·s``. Current times ÷ dense
    per tenant count: docs/kernels.md ("Current figures", ``make bench-kernels``).

    Args:
        x: ``[M, K]`` bf16/fp16; weight ``[N, K]`` same dtype; signs uint8 ``[S, N, ceil(K/8)]``, or
        the same in ``deltafleet.kernels.reference.tile_signs``' layout (5-D: each K step's 64 × 16-byte sign tile
        contiguous, read by every kernel here but ``"gluon"``); alphas float32 ``[S]`` or ``[S, N]``;
        slot ``[M]`` int (−1: base only); bias ``[N]``.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: on a dtype or shape outside the contract, an argument on the wrong device
            (:func:`deltafleet.kernels.reference.check_tensors`), a slot outside ``[−1, S)`` (checked
            when ``slot`` is on the CPU; on a GPU such rows get the base only), an unknown ``impl``,
            or ``impl="gluon"`` / ``impl="planes"`` where that kernel cannot run (``"gluon"`` never
            reads tiled signs).
    """
    check_tensors(x=x, weight=weight, signs=signs, alphas=alphas, slot=slot, bias=bias)  # before any launch
    _check_dtypes(x, weight)
    if impl not in (None, "fma", "lut", "gluon", "planes"):
        raise ValueError(f"impl must be 'fma', 'lut', 'gluon' or 'planes', got {impl!r}")
    check_batched_args(x, weight, signs, alphas, slot, check_slot_values=slot.device.type == "cpu")
    n, k = check_weight_and_bias(weight, bias)
    m = x.shape[0]
    bias = bias.to(x.device).contiguous() if bias is not None else None  # the kernels read bias[n] densely
    kb = (k + 7) // 8
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    signs = signs.contiguous()
    alphas = alphas.to(device=x.device, dtype=torch.float32).contiguous()
    slot = slot.to(device=x.device, dtype=torch.int32).contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    ws, cnt = _workspace(x.device, m * n, m * triton.cdiv(n, 2))
    # tiled signs (kernels.reference.tile_signs): stride(1) is then one 64-row block's bytes
    tiled = signs.dim() == 5
    args = (x, weight, signs, alphas, slot, bias if bias is not None else alphas, y, ws, cnt,
            m, n, k, kb, signs.shape[0], x.stride(0), weight.stride(0), signs.stride(0), signs.stride(1),
            alphas.stride(0), y.stride(0))
    if tiled and impl == "gluon":
        raise ValueError("impl='gluon' reads sign rows; tiled signs run with impl=None, 'fma', 'lut' or 'planes'")
    if impl is None and m >= 2 and not _interpret() and gluon_bitdelta.tenants_supported(x, weight, signs):
        config = _tenants_choice(x, weight, signs, alphas, slot, bias, y, ws, cnt, args, tiled)
        if config is not None and config[0] == "planes":  # only chosen where planes_supported (in the key)
            return gluon_planes.bitdelta_linear_batched_planes(x, weight, signs, alphas, slot, bias, y, ws, cnt,
                                                               config[1], config[2], tiled=tiled,
                                                               **dict(config[3] if len(config) > 3 else ()))
        if config is not None:
            return gluon_bitdelta.bitdelta_linear_batched_gluon(x, weight, signs, alphas, slot, bias, y, ws, cnt, config)
    if impl == "planes":
        if _interpret() or not gluon_planes.planes_supported(x, weight, signs):
            raise ValueError("impl='planes' needs a Hopper GPU, two rows or more, K a multiple of 128 and "
                             "16-byte aligned contiguous signs")
        rows = max(2, min(16, triton.next_power_of_2(m)))
        cfg = next((c for c in gluon_planes.WS_CONFIGS[rows] if c[0] == 128), None) if tiled else None
        return gluon_planes.bitdelta_linear_batched_planes(x, weight, signs, alphas, slot, bias, y, ws, cnt, cfg,
                                                           tiled=tiled)
    if impl == "gluon":
        if _interpret() or not gluon_bitdelta.tenants_supported(x, weight, signs):
            raise ValueError("impl='gluon' needs a Hopper GPU, two rows or more, K a multiple of 64 and "
                             "8-byte aligned sign rows")
        return gluon_bitdelta.bitdelta_linear_batched_gluon(x, weight, signs, alphas, slot, bias, y, ws, cnt)
    impl = impl or ("fma" if m == 1 else "lut")
    if impl == "lut":
        _lut_launch(args, alphas, bias, tiled)
        return y
    flags = dict(ONE_DELTA=False, ALPHA_PER_ROW=alphas.dim() == 2, HAS_BIAS=bias is not None, TILED=tiled)
    if _interpret():
        _decode_kernel[(triton.cdiv(n, 4), triton.cdiv(kb, 64), triton.cdiv(m, 4))](
            *args, **flags, EVEN=k % 256 == 0, BLOCK_M=4, BLOCK_N=4, BLOCK_KB=32, CHUNK_ITERS=2)
    elif m == 1:
        tuned = _batched1_tiled_tuned if tiled else _batched1_tuned
        tuned[_decode_grid(n, kb, 1, 1)](*args, **flags, EVEN=k % _DECODE_EVEN == 0, BLOCK_M=1)
    else:
        _batched_tuned[_decode_grid(n, kb, m)](*args, **flags, EVEN=k % _BATCHED_EVEN == 0)
    return y
