"""Hopper (sm_90) kernel for ``bitdelta_linear`` from two rows up (decode batches, prefill chunks,
prefill) with the reconstructed weight as the register operand of the wgmma (Gluon).

``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` (BitDelta, arXiv:2402.10193, §3.1 Eq. 2).

Why a second Hopper prefill kernel: ``gluon_bitdelta._prefill_kernel`` writes every
reconstructed ``W + α·s`` tile to shared memory, meets all its warps at a barrier, and lets the
wgmma read it back. Here the product is computed transposed, ``yᵀ = (W + α·s) · xᵀ`` ("swap-AB"),
so the reconstructed weight is the wgmma's A operand, which Hopper reads **from registers**:

* a loader warpgroup (the default partition; it gives its registers to the consumers) copies the
  ``[BLOCK_T, BLOCK_K]`` tile of x (the tokens) and the ``[128, BLOCK_K]`` tile of W by TMA into a
  ring of ``STAGES`` shared-memory buffers;
* two consumer warpgroups own 64 output features each. Per 32 weights of K, each reads its slice
  of the W tile with ``ldmatrix`` into the wgmma's A-operand layout, forms ``W + α·s`` two weights at
  a time in packed 16-bit arithmetic (shift, mask, multiply, xor onto ``−α``, one ``add.rn.bf16x2``;
  the 32-bit sign words come from global memory one loop body ahead), and issues the asynchronous
  wgmma ``[64, 32] × [32, BLOCK_T]`` against the shared x tile; the next slice is read and formed
  while it runs. The reconstructed weight exists only in registers, and the two warpgroups never
  wait for each other.
* ptxas serialises every wgmma of a kernel in which a wgmma with a register operand is still in
  flight at the loop's back edge (C7512), so the loop body covers ``U`` K steps and waits for its
  wgmmas at its end; the other consumer's wgmmas keep the tensor cores busy meanwhile.

W reaches the registers through shared memory (TMA, then ``ldmatrix``), not by 4-byte global loads
straight into the A layout, which keep the L1 busy and the warps waiting on them.

Small batches (:data:`SMALL_CONFIGS`, 8–128 tokens per tile): a matrix of few 128-feature tiles
would leave most multiprocessors idle, so the K steps of a tile are split into chunks; a work unit
is one tile's chunk. Each unit's float32 sums are added into the split-K workspace and the last
unit of a tile (an atomic counter per consumer warpgroup) writes ``y`` and zeroes its sums.
Programs are one per unit, or persistent (one per multiprocessor, walking units ``program,
+ programs, …`` with the ring kept full between them). The dispatcher
(``deltafleet.kernels.triton_bitdelta._prefill_choice``) times the configurations, splits and launch
forms against the other kernels once per shape; current figures: docs/kernels.md
(``make bench-kernels``).

Rounding: ``α`` is rounded to the activation dtype before the add (bf16: relative error ≤ 2⁻⁹ of
``α``, far below one ulp of a weight of the usual size); the sum is rounded once.

Constraints (the dispatcher uses the other kernels otherwise): compute capability 9.x, K a multiple
of ``BLOCK_K`` (64), 16-byte aligned contiguous rows of x and W, sign rows 4-byte aligned.
"""
from __future__ import annotations

import torch
import triton

from deltafleet.kernels.gluon_bitdelta import HAVE_GLUON, _gl_dtype, supported
from deltafleet.kernels.reference import SEGMENT_ROWS

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from deltafleet.kernels.gluon_bitdelta import _cta_barrier, _tma_load

BLOCK_N = 128   # features per program: two consumer warpgroups of 64 (the wgmma's M)
BLOCK_K = 64
# (BLOCK_T tokens per program = the wgmma's N, STAGES, K steps per loop body U, PRE, registers per
# consumer thread). A body waits for its U ring stages before releasing any, so STAGES ≥ U. PRE: each
# body also forms the next body's first slice while its own wgmmas finish, so it needs STAGES > U
# (else it deadlocks). The kernel launches 384 threads at LAUNCH_REGS registers (the 64 K register file);
# the loader warpgroup then gives registers up and the consumers take them (setmaxnreg).
CONFIGS = ((256, 4, 2, False, 240), (256, 4, 2, True, 240), (256, 4, 4, False, 240), (256, 4, 1, True, 240),
           (256, 3, 2, True, 240))
# Decode batches and short prefill chunks (2–128 tokens): the wgmma's N shrinks to the rows, the ring
# deepens (a W tile is 16 KiB; the x tile is small), and K is split across programs (``split``) so that
# a matrix of few 128-feature tiles still spreads its bytes over every multiprocessor.
SMALL_CONFIGS = ((8, 8, 2, True, 240), (16, 8, 2, True, 240), (32, 8, 2, True, 240), (64, 6, 2, True, 240),
                 (128, 4, 2, True, 240), (16, 6, 1, True, 240), (32, 10, 2, True, 240))
LAUNCH_REGS = 168

if HAVE_GLUON:
    @gluon.jit
    def _neg_alpha_pair(a_ptr, rn, ALPHA_PER_ROW: gl.constexpr, dtype: gl.constexpr):
        """``−α`` rounded to ``dtype``, its 16 bits in both halves of an int32: ``[R, 1]`` for the
        rows ``rn`` (the one α repeated when not per row)."""
        if ALPHA_PER_ROW:
            alpha = gl.expand_dims(gl.load(a_ptr + rn), 1)
        else:
            alpha = gl.expand_dims(gl.load(a_ptr + rn * 0), 1)
        h = (-alpha).to(dtype).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return h | (h << 16)

    @gluon.jit
    def _expand_pairs(w, word, sh, nab, dtype: gl.constexpr):
        """``W + α·s`` for a tile ``w`` in the wgmma A-operand layout (pairs of neighbouring k in one
        register): bits ``sh`` and ``sh + 1`` of the pair's sign ``word`` pick ``+α`` or ``−α`` per half
        (``t·0x40008000 & 0x80008000`` puts bit 0 of ``t`` on bit 15 and bit 1 on bit 31, the sign bits
        of the two halves), flipped onto ``−α`` (``nab``) and added in one packed instruction."""
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 t, m; shr.b32 t, $2, $4; and.b32 t, t, 3; mul.lo.u32 m, t, 0x40008000; "
                "and.b32 m, m, 0x80008000; xor.b32 m, m, $6; add.rn.bf16x2 $0, $1, m; }",
                "=r,r,r,r,r,r,r,r", [w, word, sh, nab], dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 t, m; shr.b32 t, $2, $4; and.b32 t, t, 3; mul.lo.u32 m, t, 0x40008000; "
                "and.b32 m, m, 0x80008000; xor.b32 m, m, $6; add.rn.f16x2 $0, $1, m; }",
                "=r,r,r,r,r,r,r,r", [w, word, sh, nab], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _sign_words(s_ptr, rn, w, stride_sw, TILED: gl.constexpr):
        """Sign word ``w`` (weights ``32w … 32w + 31``) of the rows ``rn``, as int32: rows at
        ``rn·stride_sw + w``, or in ``deltafleet.kernels.reference.tile_signs``' layout, where ``stride_sw`` is
        one 64-row block's words and a tile row holds 4 words."""
        if TILED:
            # shifts and masks (the indices are never negative): no signed-division fix-ups
            return gl.load(s_ptr + (rn >> 6) * stride_sw + ((w >> 2) << 8) + ((rn & 63) << 2) + (w & 3))
        else:
            return gl.load(s_ptr + rn * stride_sw + w)

    @gluon.jit
    def _unit(u, M, N, K, SPLIT, PER, WHOLE, BT: gl.constexpr, BK: gl.constexpr):
        """Work unit ``u``: ``(off_t, off_n, first K step, K steps, tile)``. The first ``WHOLE`` units
        are the first ``WHOLE`` tiles, whole (a multiple of the token tiles: the wrapper); then each
        further tile's ``SPLIT`` K chunks. Units run along the tokens, then the K chunks of a tile,
        then the feature tiles, so the units running at once share W panels; a chunk has ``PER``
        steps (the last may be shorter, never empty: the wrapper)."""
        num_t = gl.cdiv(M, BT)
        if u < WHOLE:
            pid_t = u % num_t
            pid_n = u // num_t
            k_first = u * 0
            num_k = K // BK
        else:
            v = u - WHOLE
            pid_t = v % num_t
            pid_k = (v // num_t) % SPLIT
            pid_n = WHOLE // num_t + v // (num_t * SPLIT)
            k_first = pid_k * PER
            num_k = gl.minimum(PER, K // BK - k_first)
        return pid_t * BT, pid_n * 128, k_first, num_k, pid_n * num_t + pid_t

    @gluon.jit
    def _seg_unit(u, NT, tile_ptr, N, K, BK: gl.constexpr):
        """Work unit ``u`` over a tile table (``SEGMENTS``): ``(off_t, off_n, 0, K steps, stop, slot)``
        of tile ``u % NT`` (``(first row, stop, slot)``) and feature tile ``u // NT``, so the units
        running at once share W panels; no K step for an unused entry or a zero tile (slot −2)."""
        t = u % NT
        off_t = gl.load(tile_ptr + 3 * t)
        stop = gl.load(tile_ptr + 3 * t + 1)
        slot = gl.load(tile_ptr + 3 * t + 2)
        live = (off_t < stop) & (slot >= -1)
        return off_t, (u // NT) * 128, 0, (K // BK) * live.to(gl.int32), stop, slot

    @gluon.jit
    def _rs_load(p, STAGES: gl.constexpr, SEGMENTS: gl.constexpr):
        """The loader: the x and W tiles of each K step of the program's units by TMA, ``STAGES``
        steps ahead of the slower consumer (across units: the ring stays full between them)."""
        (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, SPLIT, PER, UNITS, tile_ptr, WHOLE) = p
        BT: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        it = 0
        for u in range(gl.program_id(0), UNITS, gl.num_programs(0)):
            if SEGMENTS:
                off_t, off_n, k_first, num_k, stop, slot = _seg_unit(u, M, tile_ptr, N, K, BK)
            else:
                off_t, off_n, k_first, num_k, tile = _unit(u, M, N, K, SPLIT, PER, WHOLE, BT, BK)
            for ki in range(num_k):
                stage = it % STAGES
                mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # both consumers are done with it
                mbarrier.expect(ready.index(stage), nbytes)
                _tma_load(x_desc, [off_t, (k_first + ki) * BK], ready.index(stage), x_smem.index(stage))
                _tma_load(w_desc, [off_n, (k_first + ki) * BK], ready.index(stage), w_smem.index(stage))
                it += 1

    @gluon.jit
    def _rs_consume(p, q, STAGES: gl.constexpr, U: gl.constexpr, PRE: gl.constexpr, ROW0: gl.constexpr,
                    ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, TILED: gl.constexpr,
                    SEGMENTS: gl.constexpr):
        """A consumer warpgroup: features ``off_n + ROW0 … + 63`` of each of the program's units."""
        (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, SPLIT, PER, UNITS, tile_ptr, WHOLE) = p
        (s_base, a_base, b_ptr, y_ptr, stride_sw, stride_ym, ws_ptr, cnt_ptr, stride_ss, stride_as) = q
        BT: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        H: gl.constexpr = BK // 32  # 32 weights per sign word
        RW: gl.constexpr = 64
        dtype: gl.constexpr = x_desc.dtype
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BT, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)

        sh = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, dot_a)), 0)      # bit of each weight
        it0 = 0  # the ring position of the unit's first K step
        for u in range(gl.program_id(0), UNITS, gl.num_programs(0)):
            rn_l: gl.constexpr = gl.SliceLayout(1, dot_a)
            if SEGMENTS:  # the tile's slot: its signs and scales; the base (−1) adds ±0
                off_t, off_n, k_first, num_k, stop, slot = _seg_unit(u, M, tile_ptr, N, K, BK)
                tile = 0
                s_ptr = s_base + gl.maximum(slot, 0).to(gl.int64) * stride_ss
                a_ptr = a_base + gl.maximum(slot, 0).to(gl.int64) * stride_as
                rn = (off_n + ROW0 + gl.arange(0, RW, layout=rn_l)) % N
                nab = _neg_alpha_pair(a_ptr, rn, ALPHA_PER_ROW, dtype)
                nab = gl.where(slot >= 0, nab, -2147450880)  # 0x80008000: −0.0 in both halves
            else:
                off_t, off_n, k_first, num_k, tile = _unit(u, M, N, K, SPLIT, PER, WHOLE, BT, BK)
                stop = M
                s_ptr = s_base
                rn = (off_n + ROW0 + gl.arange(0, RW, layout=rn_l)) % N
                nab = _neg_alpha_pair(a_base, rn, ALPHA_PER_ROW, dtype)
            num_b = num_k // U  # loop bodies of U K steps
            b0 = k_first // U   # the first one's index in the whole K

            s_nxt = ()
            for j in gl.static_range(U * H):  # sign words of 32-weight slice j of the first body
                s_nxt = s_nxt + (gl.expand_dims(_sign_words(s_ptr, rn, b0 * (U * H) + j, stride_sw, TILED), 1), )
            acc = gl.zeros([RW, BT], gl.float32, acc_l)
            if PRE:  # the first slice, formed before the loop (then each body forms the next body's)
                mbarrier.wait(ready.index(it0 % STAGES), (it0 // STAGES) & 1)
                w = w_smem.index(it0 % STAGES).slice(ROW0, RW, dim=0).slice(0, 32, dim=1).load(dot_a)
                a_pre = _expand_pairs(w, s_nxt[0], sh, nab, dtype)
            for bi in range(num_b):
                s_cur = s_nxt
                bn = b0 + gl.minimum(bi + 1, num_b - 1)  # the next body's signs (the last loads itself again)
                s_nxt = ()
                for j in gl.static_range(U * H):
                    s_nxt = s_nxt + (gl.expand_dims(_sign_words(s_ptr, rn, bn * (U * H) + j, stride_sw, TILED), 1), )
                for j in gl.static_range(U * H):  # slice j: W from shared memory (ldmatrix), formed, multiplied
                    ki = it0 + bi * U + j // H
                    stage = ki % STAGES
                    if PRE and j == 0:
                        a = a_pre
                    else:
                        if j % H == 0:
                            mbarrier.wait(ready.index(stage), (ki // STAGES) & 1)
                        w = w_smem.index(stage).slice(ROW0, RW, dim=0).slice(32 * (j % H), 32, dim=1).load(dot_a)
                        a = _expand_pairs(w, s_cur[j], sh, nab, dtype)
                    # asynchronous: the next slice is read and formed while this wgmma runs
                    acc = warpgroup_mma(a, x_smem.index(stage).slice(32 * (j % H), 32, dim=1).permute((1, 0)),
                                        acc, is_async=True)
                if PRE:  # the next body's first slice, while this body's wgmmas finish
                    if bi + 1 < num_b:
                        kn = it0 + (bi + 1) * U
                        mbarrier.wait(ready.index(kn % STAGES), (kn // STAGES) & 1)
                        w = w_smem.index(kn % STAGES).slice(ROW0, RW, dim=0).slice(0, 32, dim=1).load(dot_a)
                        a_pre = _expand_pairs(w, s_nxt[0], sh, nab, dtype)
                # no wgmma stays in flight across the loop's back edge: ptxas would serialise every wgmma
                # whose register operand does (C7512); the other consumer's wgmmas fill the gap
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                for v in gl.static_range(U):
                    mbarrier.arrive(empty.index((it0 + bi * U + v) % STAGES), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

            feat = off_n + ROW0 + gl.arange(0, RW, layout=gl.SliceLayout(1, acc_l))
            if (SPLIT > 1) & (u >= WHOLE):  # a K chunk: the sums meet in the workspace; the last chunk writes y
                tok = off_t + gl.arange(0, BT, layout=gl.SliceLayout(0, acc_l))
                ws_ptrs = ws_ptr + gl.expand_dims(tok, 0) * N + gl.expand_dims(feat, 1)  # M·N < 2³¹ (the wrapper)
                wmask = gl.expand_dims(feat < N, 1) & gl.expand_dims(tok < M, 0)
                gl.atomic_add(ws_ptrs, acc, mask=wmask, sem="relaxed")
                _cta_barrier()  # every warp of this warpgroup has added its sums before the count
                done = gl.atomic_add(cnt_ptr + 2 * tile + ROW0 // RW, 1, sem="acq_rel")
                if done == SPLIT - 1:  # the last chunk of this warpgroup's features: read (and zero) the sums
                    tot = gl.atomic_xchg(ws_ptrs, gl.zeros([RW, BT], gl.float32, acc_l), mask=wmask, sem="relaxed")
                    if HAS_BIAS:
                        tot = tot + gl.expand_dims(gl.load(b_ptr + feat % N).to(gl.float32), 1)
                    y_ptrs = y_ptr + gl.expand_dims(tok.to(gl.int64), 0) * stride_ym + gl.expand_dims(feat, 1)
                    gl.store(y_ptrs, tot.to(dtype), mask=wmask)
                    gl.atomic_xchg(cnt_ptr + 2 * tile + ROW0 // RW, 0, sem="relaxed")
            else:
                if HAS_BIAS:
                    acc = acc + gl.expand_dims(gl.load(b_ptr + feat % N).to(gl.float32), 1)
                # yᵀ tile → y: through shared memory, so each thread writes 16 contiguous bytes of a y row
                st_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
                out = gl.convert_layout(acc.to(dtype), st_l)
                fo = off_n + ROW0 + gl.arange(0, RW, layout=gl.SliceLayout(1, st_l))
                to = off_t + gl.arange(0, BT, layout=gl.SliceLayout(0, st_l))
                y_ptrs = y_ptr + gl.expand_dims(to.to(gl.int64), 0) * stride_ym + gl.expand_dims(fo, 1)  # M·N ≥ 2³¹
                mask = gl.expand_dims(fo < N, 1) & gl.expand_dims(to < stop, 0)
                gl.store(y_ptrs, out, mask=mask)
            it0 += num_k

    @gluon.jit
    def _prefill_rs_kernel(x_desc, w_desc, s_ptr, a_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_sw,
                           stride_ym, SPLIT, PER,
                           ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                           U: gl.constexpr, PRE: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr,
                           TILED: gl.constexpr = False, tile_ptr=None, stride_ss=0, stride_as=0,
                           SEGMENTS: gl.constexpr = False, WHOLE=0):
        """Work units of one ``[BLOCK_T tokens, 128 features]`` output tile and one chunk of ``PER`` K
        steps (of ``SPLIT``; the first ``WHOLE`` tiles unsplit): unit ``program_id, + num_programs,
        …`` (one per program, or persistent programs walking several with the ring kept full between
        them). Consumer warpgroup 0 (the default partition) and 1, and the loader warp (module
        docstring). With ``SEGMENTS`` M is
        the number of entries of the tile table ``tile_ptr`` and a unit is one tile's feature tile,
        its slot's signs ``stride_ss`` words and its scales ``stride_as`` apart (``SPLIT`` 1, no PRE)."""
        BT: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        if SEGMENTS:
            UNITS = M * gl.cdiv(N, 128)
        else:
            UNITS = WHOLE + (gl.cdiv(M, BT) * gl.cdiv(N, 128) - WHOLE) * SPLIT

        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BT, BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 128, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        p = (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, SPLIT, PER, UNITS, tile_ptr, WHOLE)
        q = (s_ptr, a_ptr, b_ptr, y_ptr, stride_sw, stride_ym, ws_ptr, cnt_ptr, stride_ss, stride_as)
        gl.warp_specialize([
            (_rs_load, (p, STAGES, SEGMENTS)),
            (_rs_consume, (p, q, STAGES, U, PRE, 0, ALPHA_PER_ROW, HAS_BIAS, TILED, SEGMENTS)),
            (_rs_consume, (p, q, STAGES, U, PRE, 64, ALPHA_PER_ROW, HAS_BIAS, TILED, SEGMENTS)),
        ], [4, 4], [REGS, REGS])


def rs_supported(x2: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor) -> bool:
    """Whether :func:`bitdelta_linear_prefill_rs` runs on these tensors: the Hopper prefill
    conditions (``gluon_bitdelta.supported``), K a multiple of :data:`BLOCK_K`, and sign rows that can
    be read as 32-bit words (contiguous, 4-byte aligned starts and row stride)."""
    return (supported(x2, weight) and x2.shape[-1] % BLOCK_K == 0 and sign.stride(-1) == 1
            and sign.data_ptr() % 4 == 0 and sign.stride(0) % 4 == 0)


def usable_configs(x2: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor) -> list[tuple]:
    """The configurations that :func:`bitdelta_linear_prefill_rs` runs for these tensors, in order
    (the first is the untimed default): none unless :func:`rs_supported`; else
    :func:`ordered_configs` for their rows and features on this device's multiprocessors, each only
    if its loop body (``64·U`` weights of K) divides K."""
    if not rs_supported(x2, weight, sign):
        return []
    (m, k), n = x2.shape, weight.shape[0]
    return [c for c in ordered_configs(m, n, multiprocessors(x2.device)) if k % (BLOCK_K * c[2]) == 0]


def ordered_configs(m: int, n: int, sms: int) -> list[tuple]:
    """The configurations for ``m`` rows of ``n`` features, the untimed default first.

    Up to 128 rows: those of :data:`SMALL_CONFIGS` whose token tile is at most twice the rows (at
    least 8), the smallest tile that holds every row first. Beyond: :data:`CONFIGS` (256 tokens) and
    the first small configurations of 128 and 64 tokens, led by the largest token tile whose tiles,
    unsplit, occupy at least half of the ``sms`` multiprocessors (else the 64-token one, split by
    :func:`default_split`): a 256-token tile of few features leaves most of them idle (Llama-2-7B's o at
    256 rows: 32 programs on 132), and a split of 256-token tiles pays their sums' atomic adds."""
    if m <= 128:
        cap = max(8, 2 * triton.next_power_of_2(m))
        fits = [c for c in SMALL_CONFIGS if c[0] <= cap]
        fits.sort(key=lambda c: (c[0] < m, c[0]))  # the smallest tile that holds every row first
        return fits
    fits = list(CONFIGS) + [next(c for c in SMALL_CONFIGS if c[0] == bt) for bt in (128, 64)]
    first = next((c for c in fits if triton.cdiv(m, c[0]) * triton.cdiv(n, BLOCK_N) >= sms / 2), fits[-1])
    return [first] + [c for c in fits if c is not first]


def default_split(m: int, n: int, k: int, config: tuple, sms: int) -> tuple[int, int]:
    """``(split, whole)``: K chunks per split output tile, and how many leading tiles run whole. One
    program per multiprocessor (the register file holds one):

    * up to one wave of tiles: as many chunks as keep every unit in that wave, ``max(1, sms //
      tiles)``, at most one per loop body;
    * more tiles, with a last wave at most half full: the full waves' tiles whole and the rest in
      ``sms // rest`` chunks, so the rest spread over every multiprocessor (Llama-2-7B gate_up: 172
      tiles on 132);
    * otherwise whole: the programs already draw nearly the whole memory bandwidth, and each chunk
      adds its float32 sums to the workspace (docs/kernels.md).

    Token tiles of 256 are never split: their ``[128, 256]`` sums' atomic adds cost more than the
    wave they would fill."""
    bt, u = config[0], config[2]
    if bt >= 256:
        return 1, 0
    num_t = triton.cdiv(m, bt)
    tiles = num_t * triton.cdiv(n, BLOCK_N)
    bodies = max(1, k // (BLOCK_K * u))
    whole, rest = 0, tiles
    if tiles > sms:
        if tiles % sms == 0 or sms // (tiles % sms) < 2:
            return 1, 0
        whole = (tiles - tiles % sms) // num_t * num_t
        rest = tiles - whole
    s = min(max(1, sms // rest), bodies)
    s = triton.cdiv(bodies, triton.cdiv(bodies, s))  # no chunk short of a body
    return (s, whole) if s > 1 else (1, 0)


_SMS: dict = {}  # device index -> multiprocessors


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (asked once per device)."""
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def bitdelta_linear_prefill_rs(x2: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                               bias: torch.Tensor | None, y: torch.Tensor,
                               config: tuple = CONFIGS[0], split: int = 1, persistent: bool = False,
                               whole: int = 0) -> torch.Tensor:
    """Launch the register-operand kernel: ``y[M, N] = x2 · (W + α·s)ᵀ (+ bias)``.

    Args:
        x2: ``[M, K]`` bf16/fp16, rows contiguous, K a multiple of 64 (:func:`rs_supported`).
        weight: ``[N, K]`` same dtype. sign: uint8 ``[N, K/8]`` (LSB first), rows 4-byte aligned, or
            the same in ``deltafleet.kernels.reference.tile_signs``' layout (4-D).
            alpha: float32 ``[]`` or ``[N]`` on the device. bias: ``[N]`` contiguous or None.
            y: ``[M, N]`` output in ``x2.dtype``, rows contiguous.
        config: ``(BLOCK_T, STAGES, U, PRE, registers)``, one of :data:`CONFIGS` or
            :data:`SMALL_CONFIGS`; K must be a multiple of ``64·U``.
        split: K chunks per output tile (:func:`default_split`), at most one per loop body; the
            chunks' float32 sums meet in the split-K workspace of
            ``deltafleet.kernels.triton_bitdelta`` and the last chunk of each tile writes ``y``.
            It is rounded down to a count that leaves no chunk short of a body.
        persistent: launch one program per multiprocessor, each walking the work units (a tile's
            K chunk) ``program, + programs, …`` with its ring kept full between them, instead of
            one program per unit.
        whole: with a split, the first ``whole`` output tiles (rounded down to whole feature tiles)
            run unsplit and only the rest in ``split`` chunks (:func:`default_split`).

    Returns:
        ``y``.

    Raises:
        ValueError: if the tensors are not ones this kernel runs on (:func:`rs_supported`), M is 0,
            alpha is not float32 ``[]`` or ``[N]``, y rows are not contiguous, K is not a multiple of
            ``64·U``, the ring is too short for the loop body (``STAGES < U``, or ``STAGES ≤ U`` with
            PRE), which would deadlock, split is not a positive integer, or ``M·N`` is too large for
            the split-K workspace (2³¹ sums).
    """
    bt, stages, u, pre, regs = config
    if stages < u + pre:  # a body waits for its U steps (and with PRE the next one) before releasing any
        need = "PRE needs more ring stages than" if pre else "the ring needs at least as many stages as"
        raise ValueError(f"config {config}: {need} K steps per loop body (STAGES {'>' if pre else '≥'} U)")
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"split must be 1 or more K chunks, got {split!r}")
    if not rs_supported(x2, weight, sign):
        raise ValueError("the register-operand prefill kernel needs a Hopper GPU, K a multiple of 64, "
                         "16-byte aligned contiguous rows of x and W and 4-byte aligned sign rows")
    n = weight.shape[0]
    if x2.shape[0] == 0:
        raise ValueError("the register-operand prefill kernel needs at least one row")
    if alpha.dtype != torch.float32 or alpha.shape not in ((), (n, )) or not alpha.is_contiguous():
        raise ValueError(f"alpha must be contiguous float32 [] or [{n}], got {alpha.dtype} {list(alpha.shape)}")
    if y.stride(-1) != 1:
        raise ValueError("y needs contiguous rows")
    m, k = x2.shape
    if k % (BLOCK_K * u):
        raise ValueError(f"K = {k} is not a multiple of {BLOCK_K * u}, the K of one loop body of {config}")
    bodies = k // (BLOCK_K * u)
    per = triton.cdiv(bodies, min(split, bodies))  # bodies per chunk
    split = triton.cdiv(bodies, per)               # no empty chunk
    num_t = triton.cdiv(m, bt)
    tiles = num_t * triton.cdiv(n, BLOCK_N)
    whole = min(max(whole, 0), tiles) // num_t * num_t if split > 1 else 0
    if split > 1 and m * n >= 2**31:
        raise ValueError(f"M·N = {m * n} sums do not fit the split-K workspace; use split=1")
    from deltafleet.kernels.triton_bitdelta import _workspace

    # (not read without a split, but typed: the kernel's split branch is compiled either way)
    ws, cnt = _workspace(x2.device, m * n if split > 1 else 1, 2 * tiles if split > 1 else 1)
    dt = _gl_dtype(x2.dtype)
    x_desc = TensorDescriptor.from_tensor(x2, [bt, BLOCK_K], gl.NVMMASharedLayout.get_default_for([bt, BLOCK_K], dt))
    w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dt))
    words = sign.view(torch.int32)  # little-endian: bit j of word i is k = 32·i + j
    units = whole + (tiles - whole) * split
    grid = (min(units, multiprocessors(x2.device)) if persistent else units, )
    _prefill_rs_kernel[grid](x_desc, w_desc, words, alpha, bias if bias is not None else alpha, y, ws, cnt, m, n, k,
                             words.stride(0), y.stride(0), split, per * u, ALPHA_PER_ROW=alpha.dim() == 1,
                             HAS_BIAS=bias is not None, STAGES=stages, U=u, PRE=pre, REGS=regs, num_warps=4,
                             maxnreg=LAUNCH_REGS, TILED=sign.dim() == 4, WHOLE=whole)
    return y


# the configuration of bitdelta_linear_segments: tiles of SEGMENT_ROWS (128) tokens (a prompt's usual
# size; at 2,048 rows of the 7B shapes 1.4× cuBLAS, where 256-token tiles reach 1.1× but waste half a
# tile on a 128-token prompt); no PRE (a tile of no K step, unused or zeros, must not wait for a first
# slice)
SEGMENT_CONFIG = (SEGMENT_ROWS, 4, 2, False, 240)


def segments_supported(x2: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor) -> bool:
    """Whether :func:`bitdelta_linear_segments_rs` runs on these tensors: :func:`rs_supported` for one
    slot's signs, K a multiple of one loop body (128 weights), stacked slots contiguous."""
    return (signs.dim() in (3, 5) and signs.is_contiguous() and rs_supported(x2, weight, signs[0])
            and x2.shape[-1] % (BLOCK_K * SEGMENT_CONFIG[2]) == 0)


def bitdelta_linear_segments_rs(x2: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                                tiles: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Launch the register-operand kernel over a tile table, one launch for rows of many variants:
    ``y[a:b] = x2[a:b] · (W + α_t·s_t)ᵀ`` for every row ``(a, b, t)`` of ``tiles`` (int32 ``[T, 3]`` on
    the device, ``b − a ≤`` :data:`SEGMENT_ROWS`, ``reference.segment_tiles``; ``t`` −1: W alone, −2
    (``reference.ZERO_SLOT``): zeros; ``a ≥ b``: an unused entry). Rows of ``y`` in no tile are left
    as they are.

    Units run tile-fastest, so the units in flight share one 128-feature panel of W whatever their
    variants: it comes from HBM about once and from L2 after, and each token's FLOPs are done once,
    where a GEMM per variant's stretch reads W once per stretch and the base GEMM plus grouped sign
    products do a prompt's FLOPs twice.

    Args: ``signs`` the slots' stacked signs ``[S, N, K/8]`` or ``[S, N/64, K/128, 64, 16]`` (tiled),
    ``alphas`` float32 ``[S, N]``; the rest as :func:`bitdelta_linear_prefill_rs`. Trusts its inputs
    (:func:`segments_supported`; the caller checks the rest)."""
    bt, stages, u, pre, regs = SEGMENT_CONFIG
    m, k = x2.shape
    n, nt = weight.shape[0], tiles.shape[0]
    if nt == 0 or m == 0:
        return y
    dt = _gl_dtype(x2.dtype)
    x_desc = TensorDescriptor.from_tensor(x2, [bt, BLOCK_K], gl.NVMMASharedLayout.get_default_for([bt, BLOCK_K], dt))
    w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dt))
    words = signs.view(torch.int32)  # little-endian: bit j of word i is k = 32·i + j
    _prefill_rs_kernel[(nt * triton.cdiv(n, BLOCK_N), )](
        x_desc, w_desc, words, alphas, alphas, y, alphas, tiles, nt, n, k, words.stride(1), y.stride(0), 1, k // BLOCK_K,
        ALPHA_PER_ROW=True, HAS_BIAS=False, STAGES=stages, U=u, PRE=pre, REGS=regs, num_warps=4,
        maxnreg=LAUNCH_REGS, TILED=signs.dim() == 5, tile_ptr=tiles, stride_ss=words.stride(0),
        stride_as=alphas.stride(0), SEGMENTS=True)
    return y


def compile_for_sm90(config: tuple, dtype: str = "bf16", tiled: bool = False, segments: bool = False):
    """Compile the kernel for sm_90a ahead of time, without a GPU (α per row, with a bias), for the
    compile test (tests/test_kernels_compile.py) and offline inspection of its PTX and SASS.

    Args:
        config: one of :data:`CONFIGS` or :data:`SMALL_CONFIGS`. dtype: ``"bf16"`` or ``"fp16"``. tiled: signs in
            ``deltafleet.kernels.reference.tile_signs``' layout. segments: over a tile table, as
            :func:`bitdelta_linear_segments_rs` launches it (no bias).

    Returns:
        Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bt, stages, u, pre, regs = config
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    xl = gl.NVMMASharedLayout.get_default_for([bt, BLOCK_K], gdt)
    wl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gdt)
    sig = {"x_desc": f"tensordesc<{dtype}[{bt}, {BLOCK_K}],{xl!r}>",
           "w_desc": f"tensordesc<{dtype}[{BLOCK_N}, {BLOCK_K}],{wl!r}>", "s_ptr": "*i32",
           "a_ptr": "*fp32", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_sw": "i32", "stride_ym": "i32", "SPLIT": "i32", "PER": "i32",
           "WHOLE": "i32"}
    consts = dict(ALPHA_PER_ROW=True, HAS_BIAS=not segments, STAGES=stages, U=u, PRE=pre, REGS=regs, num_warps=4,
                  TILED=tiled, SEGMENTS=segments)
    if segments:
        sig.update({"tile_ptr": "*i32", "stride_ss": "i32", "stride_as": "i32"})
    else:
        consts.update(tile_ptr=None, stride_ss=0, stride_as=0)
    sig.update({c: "constexpr" for c in consts})
    names = _prefill_rs_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("s_ptr", "a_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "N", "K", "stride_sw", "stride_ym")
             + (("tile_ptr", "stride_ss", "stride_as") if segments else ())}
    return triton.compile(GluonASTSource(fn=_prefill_rs_kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": LAUNCH_REGS})
