"""Warp-specialised Hopper (sm_90) prefill kernel for ``bitdelta_linear`` (Gluon).

``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta, arXiv:2402.10193, §3.1 Eq. 2) for many rows.
Status: compiled for sm_90a in CI (tests/test_kernels_compile.py), not yet run on a GPU; the
dispatcher does not call it. ``kernels.gluon_bitdelta._prefill_kernel`` stays the prefill path.

Why: in ``gluon_bitdelta._prefill_kernel`` the same warps expand the signs and issue the wgmmas, so
at 2048 tokens it issues in 30 % of cycles at 12.5 % occupancy and runs at 1.62× dense (ncu,
reports/ncu-kernels-2026-11-30-h200.json). Here the work is split over warpgroups, the way
mixed-input GEMMs do it (one operand transformed in shared memory by its own warps):

* a **transform** warpgroup reads each ``[BLOCK_N, BLOCK_K]`` tile of W and its sign bytes from
  global memory straight into registers (two K steps ahead), forms ``W + α·s`` in float32, rounds it
  once to the activation dtype and stores it into a ring of ``STAGES`` shared-memory buffers; it
  also issues the TMA copies of the x tiles into a second ring;
* two **consumer** warpgroups, 128 rows each, multiply their half of the x tile with the
  reconstructed tile (asynchronous wgmma, float32 accumulators of ``128 × BLOCK_N``), release each
  ring slot when the wgmma that read it has finished, and write ``y``.

Per K step of 64 the tensor cores need about 1000 cycles for the 256 × 128 tile and the transform
about 300, so the transform hides behind the products; shared-memory traffic is that of a dense
GEMM plus one store of the W tile (W never goes through shared memory on its way in).
"""
from __future__ import annotations

import torch
import triton

from kernels.gluon_bitdelta import HAVE_GLUON, _gl_dtype, supported

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels.gluon_bitdelta import _neg_alpha_bits, _plus_delta, _tma_load

BLOCK_M = 256   # two consumer warpgroups of 128 rows
BLOCK_N = 128   # features per program (the wgmma's N)
BLOCK_K = 64
CONFIGS = ((4, 168), (3, 168))  # (STAGES, registers per thread)


if HAVE_GLUON:
    @gluon.jit
    def _pf_transform(p, q, STAGES: gl.constexpr, BN: gl.constexpr, ALPHA_PER_ROW: gl.constexpr):
        """The transform warpgroup: x copies and ``W + α·s`` tiles, one K step at a time."""
        (x_desc, x_smem, r_smem, x_ready, r_ready, empty, off_m, off_n, M, N, K) = p
        (w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, stride_wn, stride_sn, stride_ym) = q
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BKB: gl.constexpr = BK // 8
        dtype: gl.constexpr = x_desc.dtype
        # registers: each thread owns 8 consecutive weights (16 bytes) and their sign byte
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // BKB, BKB, 1], [4, 1, 1], [2, 1, 0])
        l2: gl.constexpr = gl.BlockedLayout([1, 8], [32 // BKB, BKB], [4, 1], [1, 0])
        ls: gl.constexpr = gl.SliceLayout(2, l3)

        rn = (off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ls))) % N
        offs_b = gl.arange(0, BKB, layout=gl.SliceLayout(0, ls))
        shifts = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
        shifts = gl.expand_dims(gl.expand_dims(shifts, 0), 0)                          # [1, 1, 8]
        neg_alpha_bits = _neg_alpha_bits(a_ptr, rn, ALPHA_PER_ROW)
        s_ptrs = s_ptr + gl.expand_dims(rn, 1) * stride_sn + gl.expand_dims(offs_b, 0)
        kk = gl.expand_dims(gl.expand_dims(offs_b, 0), 2) * 8 + shifts                 # [1, BKB, 8]
        w_ptrs = w_ptr + gl.expand_dims(gl.expand_dims(rn, 1), 2) * stride_wn + kk
        KB = K // 8
        num_k = gl.cdiv(K, BK)

        w_cur = gl.load(w_ptrs, mask=kk < K, other=0.0)
        w_nxt = gl.load(w_ptrs + BK, mask=kk + BK < K, other=0.0)
        s_cur = gl.load(s_ptrs, mask=gl.expand_dims(offs_b < KB, 0), other=0)
        s_nxt = gl.load(s_ptrs + BKB, mask=gl.expand_dims(offs_b + BKB < KB, 0), other=0)
        for ki in range(num_k):
            stage = ki % STAGES
            mbarrier.wait(empty.index(stage), ((ki // STAGES) & 1) ^ 1)  # both consumers are done with it
            mbarrier.expect(x_ready.index(stage), x_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, ki * BK], x_ready.index(stage), x_smem.index(stage))
            w = w_cur
            sg = s_cur
            w_cur = w_nxt
            s_cur = s_nxt
            w_nxt = gl.load(w_ptrs + (ki + 2) * BK, mask=kk + (ki + 2) * BK < K, other=0.0)
            s_nxt = gl.load(s_ptrs + (ki + 2) * BKB, mask=gl.expand_dims(offs_b + (ki + 2) * BKB < KB, 0), other=0)
            w_eff = _plus_delta(w, sg, shifts, neg_alpha_bits, dtype)
            r_smem.index(stage).store(gl.convert_layout(gl.reshape(w_eff, [BN, BK]), l2))
            fence_async_shared()  # the generic-proxy stores before the consumers' wgmma reads
            mbarrier.arrive(r_ready.index(stage), count=1)

    @gluon.jit
    def _pf_consume(p, q, STAGES: gl.constexpr, BN: gl.constexpr, ROW0: gl.constexpr, HAS_BIAS: gl.constexpr):
        """A consumer warpgroup: rows ``ROW0 … ROW0 + 127`` of the program's x tile."""
        (x_desc, x_smem, r_smem, x_ready, r_ready, empty, off_m, off_n, M, N, K) = p
        (w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, stride_wn, stride_sn, stride_ym) = q
        BK: gl.constexpr = x_desc.block_type.shape[1]
        RM: gl.constexpr = 128
        dtype: gl.constexpr = x_desc.dtype
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, 16])
        acc = gl.zeros([RM, BN], gl.float32, acc_l)
        num_k = gl.cdiv(K, BK)
        for ki in range(num_k):
            stage = ki % STAGES
            phase = (ki // STAGES) & 1
            mbarrier.wait(x_ready.index(stage), phase)
            mbarrier.wait(r_ready.index(stage), phase)
            acc = warpgroup_mma(x_smem.index(stage).slice(ROW0, RM, dim=0), r_smem.index(stage).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # the wgmma of step ki − 1 is done
            mbarrier.arrive(empty.index((ki + STAGES - 1) % STAGES), count=1, pred=ki > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

        offs_m = off_m + ROW0 + gl.arange(0, RM, layout=gl.SliceLayout(1, acc_l))
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(b_ptr + offs_n % N).to(gl.float32), 0)
        y_ptrs = y_ptr + gl.expand_dims(offs_m.to(gl.int64), 1) * stride_ym + gl.expand_dims(offs_n, 0)  # M·N ≥ 2³¹
        mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
        gl.store(y_ptrs, acc.to(dtype), mask=mask)

    @gluon.jit
    def _pf_worker(p, q, STAGES: gl.constexpr, BN: gl.constexpr, ROW0: gl.constexpr, ALPHA_PER_ROW: gl.constexpr,
                   HAS_BIAS: gl.constexpr, TRANSFORM: gl.constexpr):
        if TRANSFORM:
            _pf_transform(p, q, STAGES, BN, ALPHA_PER_ROW)
        else:
            _pf_consume(p, q, STAGES, BN, ROW0, HAS_BIAS)

    @gluon.jit
    def _prefill_ws_kernel(x_desc, w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, M, N, K, stride_wn, stride_sn, stride_ym,
                           ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                           BN: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
        """One ``[BLOCK_M, BN]`` output tile per program: consumer warpgroup 0 (the default partition)
        and 1, and the transform warpgroup (module docstring). Programs along M are consecutive, so
        the programs that share a W panel run together and read it from HBM about once."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        dtype: gl.constexpr = x_desc.dtype
        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BM)
        off_m = (pid % num_m) * BM
        off_n = (pid // num_m) * BN

        x_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], x_desc.layout)
        r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], dtype)
        r_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], r_layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        r_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(i), count=1)
            mbarrier.init(r_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        p = (x_desc, x_smem, r_smem, x_ready, r_ready, empty, off_m, off_n, M, N, K)
        q = (w_ptr, s_ptr, a_ptr, b_ptr, y_ptr, stride_wn, stride_sn, stride_ym)
        gl.warp_specialize([
            (_pf_consume, (p, q, STAGES, BN, 0, HAS_BIAS)),
            (_pf_worker, (p, q, STAGES, BN, 128, ALPHA_PER_ROW, HAS_BIAS, False)),
            (_pf_worker, (p, q, STAGES, BN, 0, ALPHA_PER_ROW, HAS_BIAS, True)),
        ], [4, 4], [REGS, REGS])


def bitdelta_linear_prefill_ws(x2: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                               bias: torch.Tensor | None, y: torch.Tensor,
                               config: tuple = CONFIGS[0]) -> torch.Tensor:
    """Launch the warp-specialised prefill kernel: ``y[M, N] = x2 · (W + α·s)ᵀ (+ bias)``.

    Args:
        x2: ``[M, K]`` bf16/fp16, rows contiguous, K a multiple of 8 (``gluon_bitdelta.supported``).
        weight: ``[N, K]`` same dtype. sign: uint8 ``[N, K/8]`` (LSB first). alpha: float32 ``[]``
            or ``[N]`` on the device. bias: ``[N]`` contiguous or None. y: ``[M, N]`` output in
            ``x2.dtype``. config: ``(STAGES, registers per thread)``, one of :data:`CONFIGS`.

    Returns:
        ``y``.

    Raises:
        ValueError: if the tensors are not ones this kernel runs on (``gluon_bitdelta.supported``), M is
            0, alpha is not float32 ``[]`` or ``[N]``, or sign / y rows are not contiguous.
    """
    if not supported(x2, weight):
        raise ValueError("the warp-specialised prefill kernel needs a Hopper GPU, K a multiple of 8 and "
                         "16-byte aligned contiguous rows")
    n = weight.shape[0]
    if x2.shape[0] == 0:
        raise ValueError("the warp-specialised prefill kernel needs at least one row")
    if alpha.dtype != torch.float32 or alpha.shape not in ((), (n, )) or not alpha.is_contiguous():
        raise ValueError(f"alpha must be contiguous float32 [] or [{n}], got {alpha.dtype} {list(alpha.shape)}")
    if sign.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("sign and y need contiguous rows")
    stages, regs = config
    m, k = x2.shape
    dt = _gl_dtype(x2.dtype)
    x_desc = TensorDescriptor.from_tensor(x2, [BLOCK_M, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dt))
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _prefill_ws_kernel[grid](x_desc, weight, sign, alpha, bias if bias is not None else alpha, y, m, n, k,
                             weight.stride(0), sign.stride(0), y.stride(0), ALPHA_PER_ROW=alpha.dim() == 1,
                             HAS_BIAS=bias is not None, STAGES=stages, BN=BLOCK_N, REGS=regs, num_warps=4,
                             maxnreg=regs)
    return y
