"""Hopper (sm_90) kernels for ``bitdelta_linear`` (prefill) and ``bitdelta_linear_batched`` (the
CUDA-core mixed-tenant kernel, ``impl="gluon"``) written in Gluon, Triton's lower-level dialect
(contract: docs/kernels.md, "Contract").

``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta, arXiv:2402.10193, §3.1 Eq. 2) for many rows
(prefill). Why a second prefill kernel: with ``tl.dot`` on an operand computed in registers,
Triton waits for every wgmma to finish before the next K step (``warp_group_dot_wait
{pendings = 0}``), so in ``deltafleet.kernels.triton_bitdelta._mm_kernel`` the sign expansion and the tensor
cores take turns. Gluon exposes the pieces, so this kernel schedules them itself, one K step of
``BLOCK_K`` per iteration:

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

The dispatcher (``deltafleet.kernels.triton_bitdelta._prefill_choice``) times each of :data:`CONFIGS`
against the register-operand kernel (``deltafleet.kernels.gluon_prefill_rs``), which keeps the reconstructed
tile out of shared memory, and the Triton GEMM, once per shape; current figures: docs/kernels.md
(``make bench-kernels``).

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
    def _neg_alpha_bits(a_ptr, rn, ALPHA_PER_ROW: gl.constexpr):
        """−α as int32 bits: ``[BN, 1, 1]`` for the rows ``rn`` (α per row), else a scalar."""
        if ALPHA_PER_ROW:
            alpha = gl.expand_dims(gl.expand_dims(gl.load(a_ptr + rn), 1), 2)          # [BN, 1, 1]
        else:
            alpha = gl.load(a_ptr)
        return (-alpha).to(gl.int32, bitcast=True)

    @gluon.jit
    def _plus_delta(w, sgn, shifts, neg_alpha_bits, dtype: gl.constexpr):
        """``W + α·s`` for a ``[BN, BK/8, 8]`` tile ``w`` and its ``[BN, BK/8]`` sign bytes, formed in
        float32 and rounded once to ``dtype``: bit j of a byte moved onto the float sign bit of −α
        flips it to +α, so no select is needed (``shifts`` = ``[1, 1, 8]`` of 0…7)."""
        SIGN_BIT: gl.constexpr = -2147483648  # 0x80000000 as int32
        top = (gl.expand_dims(sgn.to(gl.int32), 2) << (31 - shifts)) & SIGN_BIT
        d = (top ^ neg_alpha_bits).to(gl.float32, bitcast=True)
        return (w.to(gl.float32) + d).to(dtype)  # the one rounding

    @gluon.jit
    def _k_chunk(K, BK: gl.constexpr):
        """This program's share of the K steps when K is split over ``program_id(2)``: ``(first K
        step, number of K steps)``; the last chunks may be short or empty."""
        num_k_all = gl.cdiv(K, BK)
        per = gl.cdiv(num_k_all, gl.num_programs(2))
        k_first = gl.program_id(2) * per
        return k_first, gl.minimum(per, num_k_all - k_first)

    @gluon.jit
    def _tile_col(kb, TILED: gl.constexpr):
        """``[1, B]`` offsets of the sign bytes ``kb`` from a row's start: ``kb`` in rows, ``(kb // 16)·1024
        + kb % 16`` in ``deltafleet.kernels.reference.tile_signs``' layout (16 bytes per tile row, 1 KiB tiles)."""
        if TILED:
            return gl.expand_dims(((kb >> 4) << 10) + (kb & 15), 0)  # kb ≥ 0
        else:
            return gl.expand_dims(kb, 0)

    @gluon.jit
    def _prefill_kernel(x_desc, w_desc, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, M, N, K, stride_wn, stride_sn, stride_ym,
                        ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                        W_TMA: gl.constexpr, num_warps: gl.constexpr, TILED: gl.constexpr = False):
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
        neg_alpha_bits = _neg_alpha_bits(a_ptr, rn, ALPHA_PER_ROW)
        rn2 = gl.expand_dims(rn, 1)  # each row's start ([BN, 1]); _tile_col adds the bytes' offsets
        if TILED:  # kernels.reference.tile_signs' layout: stride_sn is one 64-row block's bytes
            s_ptrs = s_ptr + (rn2 >> 6) * stride_sn + ((rn2 & 63) << 4)
        else:
            s_ptrs = s_ptr + rn2 * stride_sn
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
        sgn = gl.load(s_ptrs + _tile_col(offs_b, TILED), mask=gl.expand_dims(offs_b < KB, 0), other=0)
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
            sgn_next = gl.load(s_ptrs + _tile_col(nxt, TILED), mask=gl.expand_dims(nxt < KB, 0), other=0)
            mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
            if W_TMA:
                w = gl.convert_layout(gl.reshape(w_smem.index(stage).load(l2), [BLOCK_N, BLOCK_KB, 8]), l3)
            else:
                w = w_cur
                w_cur = w_nxt
                w_nxt = gl.load(w_ptrs + (ki + 2) * BLOCK_K, mask=kk + (ki + 2) * BLOCK_K < K, other=0.0)
            w_eff = _plus_delta(w, sgn, shifts, neg_alpha_bits, dtype)
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
        weight: ``[N, K]`` same dtype. sign: uint8 ``[N, K/8]`` (LSB first), or the same in
            ``deltafleet.kernels.reference.tile_signs``' layout (4-D). alpha: float32 ``[]``
            or ``[N]`` on the device. bias: ``[N]`` contiguous or None.
        y: ``[M, N]`` output in ``x2.dtype`` (row stride ``y.stride(0)``).
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, W_TMA)``, one of :data:`CONFIGS`.

    Returns:
        ``y``. Arguments are checked by the caller (``deltafleet.kernels.triton_bitdelta``), not here.
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
                          HAS_BIAS=bias is not None, STAGES=stages, W_TMA=w_tma, num_warps=warps,
                          TILED=sign.dim() == 4)
    return y


# ---------------------------------------------------------------------------------------------
# Mixed tenants: every row its own variant (bitdelta_linear_batched), decode-sized M

# (BLOCK_N, STAGES): one warpgroup per program, BLOCK_K = 64; K is split across programs
# (:func:`tenant_split`) so that there are about two programs per multiprocessor. A configuration
# applies to a row count when it gives each thread 1–8 output features (:func:`tenant_configs`): more
# features per thread share each activation's conversion among more weights, and above 8 the sums
# no longer fit in registers.
TENANT_CONFIGS = ((64, 4), (128, 4), (256, 3), (64, 6), (128, 3))
TENANT_BLOCK_K = 64


def tenant_configs(rows: int) -> list[tuple[int, int]]:
    """The :data:`TENANT_CONFIGS` usable for ``rows`` (2, 4, 8 or 16) rows, the default first (8
    features per thread where possible, the widest tile otherwise)."""
    usable = []
    for c in TENANT_CONFIGS:
        try:
            spt_n = _tenant_layout(rows, c[0])[0]
        except ValueError:  # the tile does not split evenly over the threads
            continue
        if spt_n <= 8:
            usable.append((spt_n, c))
    return [c for _, c in sorted(usable, key=lambda u: (abs(u[0] - 8), -u[1][1]))]


def _tenant_layout(rows: int, block_n: int, num_warps: int = 4) -> tuple[int, int, int]:
    """Thread layout of the sign work for ``rows`` (a power of two, 2–16) tenant rows: returns
    ``(SPT_N, TPW_R, WPC_R)``, the output features per thread, the rows across a warp's lanes and the
    rows across warps, such that the ``32·num_warps`` threads cover ``[rows, block_n]`` exactly once.

    Raises:
        ValueError: if ``rows`` is not 2, 4, 8 or 16, or ``block_n`` does not split evenly."""
    if rows not in (2, 4, 8, 16):
        raise ValueError(f"rows must be 2, 4, 8 or 16, got {rows}")
    tpw_r = {16: 4, 8: 2, 4: 1, 2: 1}[rows]
    wpc_r = rows // tpw_r
    n_threads = (32 // tpw_r) * (num_warps // wpc_r)
    if block_n % n_threads or block_n < n_threads:
        raise ValueError(f"BLOCK_N={block_n} does not split over {n_threads} threads for {rows} rows")
    return block_n // n_threads, tpw_r, wpc_r


def tenant_split(m: int, n: int, k: int, block_n: int, sms: int) -> int:
    """K split of the mixed-tenant kernel: about two programs per multiprocessor (``sms``), each
    with at least 8 K steps of :data:`TENANT_BLOCK_K`."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, 16)
    steps = triton.cdiv(k, TENANT_BLOCK_K)
    return max(1, min(triton.cdiv(2 * sms, tiles), steps // 8))


if HAVE_GLUON:
    @gluon.jit
    def _tenants_kernel(x_desc, w_desc, x_ptr, s_ptr, a_ptr, slot_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, NSLOT,
                        stride_xm, stride_ss, stride_sn, stride_as, stride_ym,
                        ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, ROWS: gl.constexpr,
                        STAGES: gl.constexpr, SPT_N: gl.constexpr, TPW_R: gl.constexpr, WPC_R: gl.constexpr,
                        num_warps: gl.constexpr):
        """``y[m] = x[m]·Wᵀ + α_t ⊙ (x[m]·S_tᵀ) (+ bias)``, ``t = slot[m]`` (−1: base only), for the
        ``ROWS`` (≤ 16) rows of a row block, over the K chunk ``program_id(2)`` of ``num_programs(2)``.

        The base product runs on the tensor cores with the operands swapped (``yᵀ = W·xᵀ``: W is the
        wgmma's 64-row A operand, the rows its N = 16), W and x streamed by TMA through a ring of
        ``STAGES`` buffers. The wgmma is asynchronous: while it runs, the same warps do the sign part
        on the CUDA cores. Every thread owns ``SPT_N`` output features × 64 weights of one row's
        tenant; per K step it reads their two 32-bit sign words per feature (one 8-byte load) and the
        row's 64 activations (reused for all ``SPT_N`` features), and adds ``±x[k]`` by moving sign
        bit k onto the float sign bit of ``x[k]`` (a shift, one and-xor, an add: three instructions
        per row and weight). The sums stay in the thread until the end of its K chunk. With K split,
        the programs' float32 partial results meet in a workspace (atomic adds) and the last program
        of a tile (a counter) writes ``y`` and leaves workspace and counter zero."""
        BM: gl.constexpr = x_desc.block_type.shape[0]   # 16: the wgmma's N
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BKW: gl.constexpr = BK // 32                     # 32-bit sign words per feature per K step
        TPW_N: gl.constexpr = 32 // TPW_R
        WPC_N: gl.constexpr = num_warps // WPC_R
        dtype: gl.constexpr = x_desc.dtype
        SIGN_BIT: gl.constexpr = -2147483648  # 0x80000000 as int32

        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        SPLIT = gl.num_programs(2)
        off_n = pid_n * BN
        off_m = pid_m * BM
        k_first, num_k = _k_chunk(K, BK)

        l4: gl.constexpr = gl.BlockedLayout([1, SPT_N, BKW, 32], [TPW_R, TPW_N, 1, 1], [WPC_R, WPC_N, 1, 1],
                                            [3, 2, 1, 0])
        l3: gl.constexpr = gl.SliceLayout(3, l4)   # sign words [ROWS, BN, BKW]
        lo: gl.constexpr = gl.SliceLayout(2, l3)   # per (row, feature) sums [ROWS, BN]
        lx: gl.constexpr = gl.SliceLayout(1, l4)   # activations [ROWS, BKW, 32]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BM, 16])

        x_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        # the sign part's pointers: the rows' tenants, the features, the sign words (K/32 per feature)
        w32_ptr = s_ptr.to(gl.pointer_type(gl.int32))
        rows_s = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
        slot_s = gl.load(slot_ptr + rows_s, mask=rows_s < M, other=-1)
        has_s = (slot_s >= 0) & (slot_s < NSLOT)
        sl_s = gl.where(has_s, slot_s, 0)
        rn_s = (off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))) % N
        kw_s = gl.arange(0, BKW, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        kw3 = gl.expand_dims(gl.expand_dims(kw_s, 0), 1) + k_first * BKW                  # [1, 1, BKW]
        s_ptrs = (w32_ptr + gl.expand_dims(gl.expand_dims(sl_s, 1), 2) * (stride_ss // 4)
                  + gl.expand_dims(gl.expand_dims(rn_s, 0), 2) * (stride_sn // 4) + kw3)
        s_row_ok = gl.expand_dims(gl.expand_dims(has_s, 1), 2)
        rows_x = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, lx)))
        kw_x = gl.arange(0, BKW, layout=gl.SliceLayout(0, gl.SliceLayout(2, lx)))
        p_x = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, lx)))
        k_x = (gl.expand_dims(gl.expand_dims(kw_x, 0), 2) * 32 + gl.expand_dims(gl.expand_dims(p_x, 0), 1)
               + k_first * BK)                                                              # [1, BKW, 32]
        x_ptrs = x_ptr + gl.expand_dims(gl.expand_dims(rows_x, 1), 2) * stride_xm + k_x
        x_row_ok = gl.expand_dims(gl.expand_dims(rows_x < M, 1), 2)
        shifts = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, l4))))
        shifts = 31 - gl.expand_dims(gl.expand_dims(gl.expand_dims(shifts, 0), 0), 0)  # [1, 1, 1, 32]: bit p → 31

        KW = K // 32
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        for i in gl.static_range(STAGES):  # prologue: the first STAGES steps in flight
            if i < num_k:
                mbarrier.expect(bars.index(i), nbytes)
                _tma_load(x_desc, [off_m, (k_first + i) * BK], bars.index(i), x_smem.index(i))
                _tma_load(w_desc, [off_n, (k_first + i) * BK], bars.index(i), w_smem.index(i))
        sgn = gl.load(s_ptrs, mask=s_row_ok & (kw3 < KW), other=0)
        xv = gl.load(x_ptrs, mask=x_row_ok & (k_x < K), other=0.0)

        acc_b = gl.zeros([BN, BM], gl.float32, acc_l)
        acc_s = gl.zeros([ROWS, BN], gl.float32, lo)
        for ki in range(num_k):
            stage = ki % STAGES
            mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
            acc_b = warpgroup_mma(w_smem.index(stage), x_smem.index(stage).permute((1, 0)), acc_b, is_async=True)
            # the next step's signs and activations, in flight during this step's arithmetic
            nw = (ki + 1) * BKW
            sgn_next = gl.load(s_ptrs + nw, mask=s_row_ok & (kw3 + nw < KW), other=0)
            xv_next = gl.load(x_ptrs + nw * 32, mask=x_row_ok & (k_x + nw * 32 < K), other=0.0)
            xb = gl.expand_dims(xv.to(gl.float32).to(gl.int32, bitcast=True), 1)           # [ROWS, 1, BKW, 32]
            # bit 0 → flip the sign of x: x ^ (¬(word << (31 − p)) & 0x80000000), one LOP3 after the shift
            flip = ((gl.expand_dims(sgn, 3) << shifts) ^ -1) & SIGN_BIT
            acc_s += gl.sum(gl.sum((flip ^ xb).to(gl.float32, bitcast=True), axis=3), axis=2)
            acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b, ))
            nk = ki + STAGES
            if nk < num_k:  # this stage's wgmma is done: refill it
                mbarrier.expect(bars.index(stage), nbytes)
                _tma_load(x_desc, [off_m, (k_first + nk) * BK], bars.index(stage), x_smem.index(stage))
                _tma_load(w_desc, [off_n, (k_first + nk) * BK], bars.index(stage), w_smem.index(stage))
            sgn = sgn_next
            xv = xv_next
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        # epilogue: the base product (features × rows) through shared memory into the sign sums' layout
        t_smem = gl.allocate_shared_memory(gl.float32, [BM, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        t_smem.store(gl.permute(acc_b, (1, 0)))
        _cta_barrier()
        base = t_smem.slice(0, ROWS, dim=0).load(lo)
        rows_o = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, lo))
        cols_o = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, lo))
        slot_o = gl.load(slot_ptr + rows_o, mask=rows_o < M, other=-1)
        ok_o = (slot_o >= 0) & (slot_o < NSLOT)
        has_o = gl.expand_dims(ok_o, 1)
        sl_o = gl.expand_dims(gl.where(ok_o, slot_o, 0), 1)
        rn_o = gl.expand_dims(cols_o % N, 0)
        if ALPHA_PER_ROW:
            alpha = gl.load(a_ptr + sl_o * stride_as + rn_o, mask=has_o, other=0.0)
        else:
            alpha = gl.load(a_ptr + sl_o * stride_as + rn_o * 0, mask=has_o, other=0.0)
        out = base + alpha * acc_s
        mask = gl.expand_dims(rows_o < M, 1) & gl.expand_dims(cols_o < N, 0)
        y_ptrs = y_ptr + gl.expand_dims(rows_o, 1) * stride_ym + gl.expand_dims(cols_o, 0)
        if SPLIT > 1:
            ws_ptrs = ws_ptr + gl.expand_dims(rows_o, 1) * N + gl.expand_dims(cols_o, 0)
            gl.atomic_add(ws_ptrs, out, mask=mask, sem="relaxed")
            tile = pid_m * gl.num_programs(0) + pid_n
            done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")  # after this program's adds
            if done == SPLIT - 1:  # the last K chunk of this tile: read (and zero) the sums, write y
                out = gl.atomic_xchg(ws_ptrs, gl.zeros([ROWS, BN], gl.float32, lo), mask=mask, sem="relaxed")
                if HAS_BIAS:
                    out = out + gl.load(b_ptr + rn_o).to(gl.float32)
                gl.store(y_ptrs, out.to(dtype), mask=mask)
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
        else:
            if HAS_BIAS:
                out = out + gl.load(b_ptr + rn_o).to(gl.float32)
            gl.store(y_ptrs, out.to(dtype), mask=mask)


def tenants_supported(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor) -> bool:
    """Whether :func:`bitdelta_linear_batched_gluon` can run: :func:`supported`, 2 or more rows, K a
    multiple of 64, and sign rows whose 32-bit words are aligned (strides multiples of 8 bytes)."""
    return (supported(x, weight) and x.shape[0] >= 2 and weight.shape[1] % TENANT_BLOCK_K == 0
            and signs.stride(-1) == 1 and signs.stride(1) % 8 == 0 and signs.stride(0) % 8 == 0
            and signs.data_ptr() % 8 == 0)


def bitdelta_linear_batched_gluon(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                                  slot: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                                  ws: torch.Tensor, cnt: torch.Tensor, config: tuple | None = None,
                                  split: int | None = None) -> torch.Tensor:
    """Launch the Hopper mixed-tenant kernel: ``y[m] = x[m]·(W + α_t·s_t)ᵀ (+ bias)``, ``t = slot[m]``.

    Args:
        x: ``[M, K]`` bf16/fp16, M ≥ 2 (:func:`tenants_supported`). weight: ``[N, K]`` same dtype.
        signs: uint8 ``[S, N, K/8]``. alphas: float32 ``[S]`` or ``[S, N]``. slot: int32 ``[M]`` on the
        device (−1 or out of range: the base only). bias: ``[N]`` or None. y: ``[M, N]`` in ``x.dtype``.
        ws, cnt: float32 zeros of at least ``M·N`` and int32 zeros of at least one per output tile
            (``deltafleet.kernels.triton_bitdelta._workspace``); left zero.
        config: ``(BLOCK_N, STAGES)``, one of :func:`tenant_configs` for the row count (default:
            its first). split: K chunks (default :func:`tenant_split`).

    Returns:
        ``y``. Arguments are checked by the caller (``deltafleet.kernels.triton_bitdelta``), not here.
    """
    m, k = x.shape
    n = weight.shape[0]
    rows = max(2, min(16, triton.next_power_of_2(m)))
    bn, stages = config or tenant_configs(rows)[0]
    spt_n, tpw_r, wpc_r = _tenant_layout(rows, bn)
    if split is None:
        split = tenant_split(m, n, k, bn, torch.cuda.get_device_properties(x.device).multi_processor_count)
    dt = _gl_dtype(x.dtype)
    x_desc = TensorDescriptor.from_tensor(x, [16, TENANT_BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([16, TENANT_BLOCK_K], dt))
    w_desc = TensorDescriptor.from_tensor(weight, [bn, TENANT_BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([bn, TENANT_BLOCK_K], dt))
    grid = (triton.cdiv(n, bn), triton.cdiv(m, 16), split)
    _tenants_kernel[grid](x_desc, w_desc, x, signs, alphas, slot, bias if bias is not None else alphas, y, ws, cnt,
                          m, n, k, signs.shape[0], x.stride(0), signs.stride(0), signs.stride(1),
                          alphas.stride(0), y.stride(0), ALPHA_PER_ROW=alphas.dim() == 2,
                          HAS_BIAS=bias is not None, ROWS=rows, STAGES=stages, SPT_N=spt_n, TPW_R=tpw_r,
                          WPC_R=wpc_r, num_warps=4)
    return y
