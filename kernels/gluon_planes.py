"""Hopper (sm_90) mixed-tenant kernel with the sign part on the int8 or the binary tensor cores
("planes").

``y[m] = x[m]·Wᵀ + α_t ⊙ (x[m]·S_tᵀ) (+ bias)``, ``t = slot[m]`` (BitDelta, arXiv:2402.10193, §3.1
Eq. 2; the ``bitdelta_linear_batched`` contract of docs/kernels.md), for decode-sized M (every row
its own variant).

Why: the CUDA-core kernels spend several instructions per row and weight on the sign part
(``deltafleet.kernels.gluon_bitdelta._tenants_kernel``: shift, and-xor, add), which at 16 tenants leaves them
issue-bound whatever the memory system does. Here the sign part is a matrix product on the tensor
cores, and the CUDA cores only turn packed sign bits into wgmma operands:

* ``s·x = 2·(s'·x) − Σx`` with ``s' = (s + 1)/2 ∈ {0, 1}``: the sign bits themselves are the 0/1
  int8 operand. Bytes ``j = 0..3`` of one 32-bit A register are bits ``q, q+8, q+16, q+24`` of a
  sign word, ``(word >> q) & 0x01010101``: two instructions for four weights. For that, logical
  position ``4q + j`` of every 32-wide K block holds physical ``k = q + 8j`` on both operands.
* The activations become 16-bit fixed point with one scale per row, ``x ≈ scale·(256·hi + lo)``
  with ``hi, lo ∈ [−128, 127]``, ``scale = max|x| / 32639``, stored as two int8 "planes" in that
  permuted K order by a small Triton kernel (:func:`activation_planes`). The planes of four rows are
  the eight columns of one ``m64n8k32`` B operand; row ``r`` reads its two columns of its own
  product. Integer sums are exact; the only rounding is ``x`` to 16 bits (≤ ``scale/2`` per element,
  about 3·10⁻⁵ of the row's largest activation, plus the float32 rounding of ``1/scale``; the tests
  hold the error to 1.01·scale/2).
* The base product ``W·xᵀ`` stays a bf16/fp16 wgmma with W as the 64-row A operand (swap-AB), as in
  ``_tenants_kernel``. W, x, the planes and every row's ``[64, BK/8]`` sign tile arrive by TMA
  through a ring of ``STAGES`` shared-memory buffers; a row without a variant (slot −1, out of range,
  or past M) loads its sign tile from outside the tensor, which TMA fills with zeros and reads
  nothing.

The kernel, :func:`_planes_ws_kernel`, is warp-specialised: 1, 2 or 4 loader warps issue the copies
(each costs the issuing warp about twenty instructions of address and barrier work, 22 copies per K
step at 16 rows) and one consumer warpgroup per 2, 4 or 8 rows does the products; the consumers' K
loop takes about one instruction per row and weight. ptxas serialises the wgmmas (C7512/C7515) when
a consumer has too few registers or more than four wgmmas in flight, so :data:`WS_CONFIGS` only
lists configurations that compile without.

Memory: the x tile and the planes are read again by every column of programs (from L2), and a
K step of 128 weights is a 16-byte piece of each of 64 sign rows, half of a 32-byte sector each. With
``tiled=True`` the signs are in :func:`tile_signs`' layout, each K step's sign tile one contiguous
copy; for ``BLOCK_K`` 128 that is ``deltafleet.kernels.tile_signs``' layout, which the server's variant slots use
(``deltafleet.serve.batch.DeltaSlots``).

**Binary tensor cores** (``bits=True``): the sign part as ``mma.sync.m16n8k128`` on 1-bit operands
(AND, then POPC, summed into int32), whose A operand is 16 features' sign words exactly as stored (two
32-bit words per thread, read with ``ldmatrix`` from the same shared-memory tile) and whose B operand
is 8 bit planes of one row's activations: ``x ≈ scale·q`` with ``q`` 16-bit two's complement
(:func:`activation_bitplanes`, ``scale = max|x|/BIT_MAX``), ``s·q = 2·Σ_p w_p·popc(s' & b_p) − Σq``
with ``w_p = 2^p`` and ``w_15 = −2^15``. Two mmas per row and 128 weights cover the 16 planes; the
plane words (256 bytes per row and 128 weights, from global memory through L1, one K step ahead) are
the only extra reads, and nothing is expanded on the CUDA cores. Accumulator layout ``l3`` over
``[64 features, 4, 4]``: register bits (m, pb, h), lane bits (t0, t1, g0, g1, g2), warp bits
(features 16, 32); element ``[f, t, j]`` is mma ``m = j % 2``'s column ``2t + j // 2``, i.e. plane
``8·(j % 2) + 2t + j // 2`` of feature f.

**Persistent and stream-K launches** (``persistent=True``, ``stream_k=True``; binary path only with
PDL). The kernel walks work units (feature block × row block × K chunk) with its ring position and
phase carried across them, so one program per resident slot (:func:`ws_slots`) can take several.
With stream-K each resident program takes an equal run of at least four of all tiles' K steps, cut at
tile boundaries; every piece adds into the float32 workspace and counts itself in, and the piece
that brings the tile's count to its total writes the output (:func:`ws_pieces` mirrors the cut).
Stream-K keeps every multiprocessor busy to the end where the tiles do not divide them evenly (qkv's
160 feature blocks on 132 multiprocessors).

Which configuration, split and launch runs is timed once per shape by
``deltafleet.kernels.triton_bitdelta._tenants_choice``; current figures: docs/kernels.md (``make bench-kernels``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafleet.kernels.gluon_bitdelta import HAVE_GLUON, _gl_dtype, supported

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from deltafleet.kernels.gluon_bitdelta import _tma_load

    @gluon.jit
    def _gdc_wait():
        """``griddepcontrol.wait``: block until the kernel before (programmatic dependent launch) has
        finished and its writes are visible; a no-op without programmatic dependent launch."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    # two binary mmas of 16 features × 8 bit planes × 128 weights (AND, then POPC, summed into int32):
    # operands per thread, in ``l3``'s register order (m + 2·pb + 4·h, see ``_ws_consume``): $0–$7
    # the results, $8–$15 the sign words (a0 = rows g, $8; a1 = rows g + 8, $12), $16–$23 the plane
    # words (mma m reads $16 + m), $24–$31 the accumulators
    _BMMA = gl.constexpr(
        "mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {$0,$2,$4,$6}, {$8,$12}, {$16}, {$24,$26,$28,$30};\n"
        "mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {$1,$3,$5,$7}, {$8,$12}, {$17}, {$25,$27,$29,$31};")

    # a shared-memory view under another element type: ``_reinterpret`` in Triton 3.6, ``reinterpret``
    # from 3.7 on
    if hasattr(gl.shared_memory_descriptor, "reinterpret"):
        @gluon.jit
        def _as_view(buf, dtype: gl.constexpr, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
            return buf.reinterpret(dtype, [R, C], layout)
    else:
        @gluon.jit
        def _as_view(buf, dtype: gl.constexpr, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
            return buf._reinterpret(dtype, [R, C], layout)

    @gluon.jit
    def _as_words(buf, BN: gl.constexpr, W: gl.constexpr, layout: gl.constexpr):
        return _as_view(buf, gl.int32, BN, W, layout)

SMEM_PER_SM = 233472  # bytes of shared memory per Hopper multiprocessor (228 KiB)
BIT_MAX = 32767    # the largest |q| of the binary-plane copy: 16-bit two's complement
TINY = tl.constexpr(1e-30)  # rows whose largest |x| is below this are quantised as zero (error ≤ 1e-30)
PLANE_MAX = 32639  # 127·256 + 127: the largest |q| whose high byte still fits int8 after rounding
BLOCK_K = 128      # a sign tile row is BLOCK_K/8 = 16 bytes, TMA's smallest inner box
BLOCK_N = 64       # features per program: the wgmma's M
# Warp-specialised kernel, per row count: (BLOCK_K, rows per consumer warpgroup, STAGES, registers per
# thread, loader warps). Registers × threads must fit the 64 K register file; ptxas serialises the
# wgmmas when a consumer has too few (C7512), so every entry compiles without
# (tests/test_kernels_compile.py compiles each for sm_90a, no GPU needed, and checks). The first of
# each row count is the untimed default, the fastest over the 70B layer set at its best K splits;
# the dispatcher times the others. Loader warps: each TMA copy costs its warp about twenty
# instructions, and a K step at 16 rows takes 22 copies (x, W, four plane groups, sixteen sign
# tiles), which several loader warps share out. (128, 8, 4, 128, 2) is there for stream-K on layers
# like qkv at 16 rows.
WS_CONFIGS = {
    2: ((128, 2, 3, 80, 1), (256, 2, 2, 104, 1)),
    4: ((256, 4, 2, 104, 1), (128, 4, 3, 80, 1), (128, 4, 2, 80, 1), (128, 4, 3, 80, 2)),
    8: ((128, 4, 3, 80, 2), (128, 4, 3, 80, 1), (256, 4, 3, 104, 1), (128, 4, 3, 80, 4), (256, 4, 3, 104, 4)),
    16: ((128, 4, 4, 96, 2), (128, 4, 4, 96, 1), (256, 8, 2, 128, 1), (256, 4, 2, 96, 4), (128, 4, 4, 96, 4),
         (256, 8, 2, 128, 4), (128, 8, 4, 128, 2)),
}


def default_config(rows: int, k: int) -> tuple | None:
    """The untimed configuration for a row block of ``rows`` (2, 4, 8 or 16) at this K: the first of
    :data:`WS_CONFIGS` whose ``BLOCK_K`` divides K, or None if none does."""
    return next((c for c in WS_CONFIGS[rows] if k % c[0] == 0), None)


def ws_slots(m: int, config: tuple, sms: int, bits: bool = False) -> int:
    """Programs of the warp-specialised kernel resident at once on ``sms`` multiprocessors, by its
    registers (``config``'s per thread × its warps, of 64 K) and shared memory (the ring: x, W, the
    sign tiles and, without ``bits``, the int8 planes, of 228 KiB), for ``m`` rows."""
    bk, rh, stages, regs, loaders = config
    rows = max(2, min(16, triton.next_power_of_2(m)))
    warps = 4 * triton.cdiv(4 * (rows // min(rows, rh)) + loaders, 4)
    smem = stages * (2 * 16 * bk + 2 * BLOCK_N * bk + rows * BLOCK_N * bk // 8
                     + (0 if bits else triton.cdiv(rows, 4) * 8 * bk))
    # 228 KiB per multiprocessor, of which each resident block takes its shared memory, 1 KiB the
    # hardware reserves per block, and the barriers and scratch (under 1 KiB in the offline compiles:
    # (128, 4, 3, 80, 1) at 4 rows is 77 116 bytes against the ring's 76 800, so two fit, not three)
    return sms * max(1, min(65536 // (regs * 32 * warps), SMEM_PER_SM // (smem + 2048)))


def ws_pieces(pid: int, nprog: int, tiles: int, kt: int, split: int, per: int) -> list[tuple[int, int, int, int]]:
    """Program ``pid``'s pieces as the kernel cuts them (``_ws_npieces`` / ``_ws_piece``, mirrored here
    for tests): ``(tile, first K step, K steps, pieces of that tile)`` for ``tiles`` output tiles of
    ``kt`` K steps, ``nprog`` programs, K chunks ``split`` (``per`` = 0) or stream-K runs of ``per``
    steps. A K chunk past the last step (``split`` > steps) is a piece of 0 steps: the kernel runs
    no K loop for it but still counts it toward the tile's ``split`` pieces."""
    out = []
    if per > 0:
        g0, g1 = pid * per, min(pid * per + per, tiles * kt)
        for i in range((g1 - 1) // kt - g0 // kt + 1):
            t = g0 // kt + i
            k_first = max(g0 - t * kt, 0)
            out.append((t, k_first, min(g1 - t * kt, kt) - k_first, ((t + 1) * kt - 1) // per - (t * kt) // per + 1))
    else:
        chunk = -(-kt // split)
        for i in range(-(-(tiles * split - pid) // nprog)):
            u = pid + i * nprog
            k_first = (u // tiles) * chunk
            out.append((u % tiles, k_first, max(0, min(chunk, kt - k_first)), split))
    return out


def ws_split(m: int, n: int, k: int, config: tuple, sms: int, bits: bool = False) -> int:
    """K split of the warp-specialised kernel, by a wave model: ``sms`` × programs per multiprocessor
    (from registers and shared memory) run at once, so ``tiles × split`` programs take
    ``ceil(tiles·split / slots)`` waves of ``ceil(steps/split) + 3`` K steps each (3: filling the
    ring); the split (1–8, at least 4 K steps per chunk) with the fewest steps wins, the smaller on
    ties. It is the untimed default; the dispatcher times the candidate splits. ``bits``: the binary
    path's ring (no int8 planes), which can leave room for more programs per multiprocessor
    (:func:`ws_slots`)."""
    bk = config[0]
    slots = ws_slots(m, config, sms, bits)
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, 16)
    steps = triton.cdiv(k, bk)
    splits = [s for s in range(1, 9) if steps // s >= 4] or [1]
    return min(splits, key=lambda s: (triton.cdiv(tiles * s, slots) * (triton.cdiv(steps, s) + 3), s))


@triton.jit
def _row_inv(x_ptr, r, K, stride_xm, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Row r's ``(max|x|, QMAX/max|x|)`` over K in blocks of BLOCK; a row whose max|x| is below ``TINY``
    (where the quotient would overflow float32) counts as zero: ``(0, 0)``."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + r * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    a = tl.max(amax, axis=0)
    a = tl.where(a >= TINY, a, 0.0)
    return a, tl.where(a > 0, QMAX / a, 0.0)


@triton.jit
def _round_q(v):
    """Round half away from zero to int32."""
    return tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)


@triton.jit
def _row_planes(x_ptr, r, out, p_ptr, sc_ptr, K, KP, stride_xm, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """x row ``r`` as planes row pair ``out``: ``scale = max|x|/PLANE_MAX``; ``q = round(x/scale)``;
    planes ``p[2·out] = hi``, ``p[2·out+1] = lo`` with ``q = 256·hi + lo``, in the permuted K order
    (logical ``4a + j`` of each 32-block ← physical ``a + 8j``); ``sc[2·out] = scale``,
    ``sc[2·out+1] = Σq``. Rows are ``KP`` wide (zeros past K). ``BITS``: the grouped kernel's bit
    accumulators' order instead (``gluon_grouped``): physical ``32c + s`` of each 256-block holds
    logical ``128·(s // 16) + 8·(s % 16) + c``."""
    offs = tl.arange(0, BLOCK)
    a, inv = _row_inv(x_ptr, r, K, stride_xm, 32639.0, BLOCK)
    qsum = tl.zeros([BLOCK], tl.int32)
    for k0 in range(0, KP, BLOCK):
        kp = k0 + offs
        if BITS:
            s = kp % 32
            kl = (kp // 256) * 256 + 128 * (s // 16) + 8 * (s % 16) + (kp % 256) // 32
        else:
            kl = (kp // 32) * 32 + (kp % 32) // 4 + 8 * (kp % 4)
        q = _round_q(tl.load(x_ptr + r * stride_xm + kl, mask=kl < K, other=0.0).to(tl.float32) * inv)
        hi = (q + 128) >> 8
        lo = q - hi * 256
        tl.store(p_ptr + (2 * out) * KP + kp, hi.to(tl.int8), mask=kp < KP)
        tl.store(p_ptr + (2 * out + 1) * KP + kp, lo.to(tl.int8), mask=kp < KP)
        qsum += q
    tl.store(sc_ptr + 2 * out, a / 32639.0)
    tl.store(sc_ptr + 2 * out + 1, tl.sum(qsum.to(tl.int64), axis=0).to(tl.float32))


@triton.jit
def _planes_kernel(x_ptr, p_ptr, sc_ptr, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program per row r: its planes as row pair r (:func:`_row_planes`). ``PDL``: let the next
    kernel (launched with programmatic dependent launch) start at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    _row_planes(x_ptr, r, r, p_ptr, sc_ptr, K, K, stride_xm, BLOCK, False)


def _check_activations(x: torch.Tensor, multiple: int) -> tuple[int, int]:
    """``(M, K)`` of activations an activation-plane kernel can read: a 2-D bf16/fp16 tensor with unit
    stride along K, K a positive multiple of ``multiple``; else ValueError naming what is wrong."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be a 2-D bf16/fp16 tensor with unit stride along K, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    m, k = x.shape
    if k % multiple or k == 0:
        raise ValueError(f"K = {k} is not a positive multiple of {multiple}")
    return m, k


def activation_planes(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Split activations into the two int8 planes of a 16-bit fixed-point copy (module docstring).

    Args:
        x: ``[M, K]`` bf16/fp16, K a multiple of 32, on a device Triton runs on.

    Returns:
        ``(planes, sc)``: int8 ``[2M, K]`` (row ``2r`` the high bytes of row r, ``2r + 1`` the low
        bytes, K permuted within 32-blocks) and float32 ``[M, 2]`` (``scale``, ``Σq`` per row), with
        ``x[r, k] ≈ scale_r·(256·hi + lo)`` to within ``scale_r/2``. ``pdl``: the kernel lets a
        following kernel launched with programmatic dependent launch start before it ends (that
        kernel must wait, ``griddepcontrol.wait``, before it reads the planes).

    Raises:
        ValueError: if x is not a 2-D bf16/fp16 tensor with unit stride along K, or K is not a
            positive multiple of 32 (the permutation works on whole 32-blocks).
    """
    m, k = _check_activations(x, 32)
    planes = torch.empty(2 * m, k, dtype=torch.int8, device=x.device)
    sc = torch.empty(m, 2, dtype=torch.float32, device=x.device)
    # one program per row, whole blocks of up to 8192 activations per load: the kernel is a few
    # round trips to memory, so fewer, larger loads
    _planes_kernel[(m,)](x, planes, sc, k, x.stride(0), BLOCK=min(8192, triton.next_power_of_2(k)),
                         PDL=pdl, num_warps=8)
    return planes, sc


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _bitplanes_kernel(x_ptr, b_ptr, sc_ptr, K, stride_xm, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program ``(r, c)``: row r's ``scale = max|x|/BIT_MAX`` (every program of the row reads the whole
    row for it), then for weights ``c·CHUNK … + CHUNK``: ``q = round(x/scale)`` (16-bit two's
    complement) and its 16 bit planes packed 32 weights to a word, bit i of word w the weight
    ``32w + i`` (the sign bits' order), stored ``[row, K/128, 8, 4, 2]``: word ``(j, g, t, m)`` is plane
    ``8m + g`` at weights ``128j + 32t … + 31``. Program ``(r, 0)`` also writes ``sc[2r] = scale`` and
    ``sc[2r + 1] = Σq`` over the row."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    a, inv = _row_inv(x_ptr, r, K, stride_xm, 32767.0, BLOCK)
    ko = c * CHUNK + tl.arange(0, CHUNK)
    q = _round_q(tl.load(x_ptr + r * stride_xm + ko, mask=ko < K, other=0.0).to(tl.float32) * inv)
    q2 = tl.reshape(q, [CHUNK // 32, 32])
    shift = tl.arange(0, 32)[None, :]
    w = c * (CHUNK // 32) + tl.arange(0, CHUNK // 32)  # word index along K
    dst = b_ptr + (r * (K // 128) + w // 4) * 64 + (w % 4) * 2
    for p in tl.static_range(16):
        word = tl.reduce(((q2 >> p) & 1) << shift, 1, _or)
        tl.store(dst + (p % 8) * 8 + p // 8, word, mask=w < K // 32)
    if c == 0:  # the row's scale and Σq (a second pass over the row, in this program only)
        qsum = tl.zeros([BLOCK], tl.int32)
        for k0 in range(0, K, BLOCK):
            qsum += _round_q(tl.load(x_ptr + r * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                             * inv)
        tl.store(sc_ptr + 2 * r, a / 32767.0)
        tl.store(sc_ptr + 2 * r + 1, tl.sum(qsum.to(tl.int64), axis=0).to(tl.float32))  # int32 overflows from K = 65 664


def activation_bitplanes(x: torch.Tensor, pdl: bool = False, chunk: int | None = None,
                         num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16 bit planes of a 16-bit fixed-point copy of the activations, for the binary tensor cores.

    ``x[r, k] ≈ scale_r·q[r, k]``, ``q = round(x/scale)`` in ``[−BIT_MAX, BIT_MAX]`` with ``scale_r =
    max|x[r]|/BIT_MAX`` (error ≤ ``scale_r/2`` = max|x|/65534, plus the float32 rounding of
    ``1/scale_r``, held to 1.01·scale_r/2 by the tests; a row whose max|x| is below ``TINY`` =
    1e-30, where ``BIT_MAX/max|x|`` would overflow float32, is quantised as zero; NaN is not
    handled), ``q = Σ_{p<15} 2^p·b_p − 2^15·b_15`` (two's complement).
    A sign vector ``s ∈ {±1}`` with bits ``s' = (s + 1)/2`` then has ``s·q = 2·Σ_p w_p·popc(s' & b_p) −
    Σq``, ``w_p = 2^p`` (``−2^15`` for p = 15): the products the binary mmas of ``_planes_ws_kernel``
    form with ``bits=True``.

    Args:
        x: ``[M, K]`` bf16/fp16, K a multiple of 128, on a device Triton runs on.
        pdl: let a following kernel launched with programmatic dependent launch start early.
        chunk: weights per program along K, a power of two from 128 to 8192 (default: 1024, or K
            rounded up to a power of two if smaller); num_warps: warps per program (4 or 8). Both
            only change the speed, not the result.

    Source: BitDelta (arXiv:2402.10193) §3.1 Eq. 2 for the product; the bit-plane split of a fixed-point
    operand is the usual binary-network decomposition (e.g. DoReFa-Net, arXiv:1606.06160, §2.1).

    Returns:
        ``(bits, sc)``: int32 ``[M, K/128, 64]``, per row and 128 weights the words ``[g, t, m]``
        (``8·4·2``): plane ``8m + g`` at weights ``32t … 32t + 31`` of the piece, bit i weight ``32t + i``
        (the packed signs' order); and float32 ``[M, 2]`` (``scale``, ``Σq`` per row).

    Raises:
        ValueError: if x is not a 2-D bf16/fp16 tensor with unit stride along K, K is not a
            positive multiple of 128, or ``chunk`` / ``num_warps`` is not one of the values above.
    """
    m, k = _check_activations(x, 128)
    if chunk is not None and (chunk < 128 or chunk > 8192 or chunk & (chunk - 1)):
        raise ValueError(f"chunk = {chunk} is not a power of two from 128 to 8192")
    if num_warps not in (4, 8):
        raise ValueError(f"num_warps = {num_warps}: the bit-plane kernel runs with 4 or 8")
    bits = torch.empty(m, k // 128, 64, dtype=torch.int32, device=x.device)
    sc = torch.empty(m, 2, dtype=torch.float32, device=x.device)
    # programs over 1024-weight chunks, several per row: one program per row leaves the GPU idle
    chunk = chunk or min(1024, triton.next_power_of_2(k))
    _bitplanes_kernel[(m, triton.cdiv(k, chunk))](x, bits, sc, k, x.stride(0), BLOCK=min(8192, triton.next_power_of_2(k)),
                                                  CHUNK=chunk, PDL=pdl, num_warps=num_warps)
    return bits, sc


def planes_supported(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor) -> bool:
    """Whether :func:`bitdelta_linear_batched_planes` can run: Hopper and aligned tensors
    (``gluon_bitdelta.supported``), 2 or more rows, K a multiple of 128, contiguous sign rows."""
    return (supported(x, weight) and x.shape[0] >= 2 and weight.shape[1] % BLOCK_K == 0 and signs.is_contiguous()
            and signs.data_ptr() % 16 == 0)


def tile_signs(signs: torch.Tensor, block_k: int) -> torch.Tensor:
    """Store each sign tile the int8 tenant kernel copies per K step whole: ``[S, N, K/8]`` →
    ``[S, ceil(N/64), K/block_k, 64, block_k/8]`` (features past N zero), so that the tile of slot s,
    feature block f and K step j, ``signs[s, 64f : 64f + 64, j·block_k/8 : (j + 1)·block_k/8]``, is
    ``out[s, f, j]``: 1 or 2 KiB in one piece instead of 64 pieces of 16 or 32 bytes a row apart.

    Args:
        signs: uint8 ``[S, N, K/8]``, K a multiple of ``block_k``. block_k: 128 or 256.

    Returns:
        A new contiguous uint8 tensor on ``signs``' device.

    Raises:
        ValueError: if ``block_k`` is not 128 or 256, ``signs`` is not 3-D uint8, or K/8 is not a
            multiple of ``block_k/8``.
    """
    if block_k not in (128, 256):
        raise ValueError(f"block_k must be 128 or 256, got {block_k}")
    if signs.dtype != torch.uint8 or signs.dim() != 3:
        raise ValueError(f"signs must be uint8 [S, N, K/8], got {signs.dtype} {tuple(signs.shape)}")
    s, n, kb = signs.shape
    if kb % (block_k // 8):
        raise ValueError(f"{kb} sign bytes per row are not a whole number of {block_k // 8}-byte K steps")
    if block_k == 128:  # the serving layout (kernels.reference.tile_signs), whose tiles are these
        from deltafleet.kernels.reference import tile_signs as tile_128
        return tile_128(signs)
    nt = triton.cdiv(n, BLOCK_N)
    padded = signs.new_zeros(s, nt * BLOCK_N, kb)
    padded[:, :n] = signs
    return padded.view(s, nt, BLOCK_N, kb // (block_k // 8), block_k // 8).permute(0, 1, 3, 2, 4).contiguous()


def bitdelta_linear_batched_planes(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                                   slot: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, ws: torch.Tensor,
                                   cnt: torch.Tensor, config: tuple | None = None, split: int | None = None,
                                   pdl: bool = False, tiled: bool = False, base_spread: bool = False,
                                   bits: bool = False, persistent: bool = False, stream_k: bool = False,
                                   _copies_only: bool = False) -> torch.Tensor:
    """Launch the int8 tensor-core mixed-tenant kernel: ``y[m] = x[m]·(W + α_t·s_t)ᵀ (+ bias)``.

    Args:
        x: ``[M, K]`` bf16/fp16, M ≥ 2, K a multiple of 128 (:func:`planes_supported`).
        weight: ``[N, K]`` same dtype. signs: contiguous uint8 ``[S, N, K/8]``. alphas: float32 ``[S]``
            or ``[S, N]``. slot: int32 ``[M]`` (−1 or out of range: the base only). bias: ``[N]`` or
            None. y: ``[M, N]`` in ``x.dtype``. ws, cnt: float32 zeros of at least ``M·N`` and int32
            zeros of one per output tile, left zero.
        config: ``(BLOCK_K, rows per consumer warpgroup, STAGES, registers per thread, loader warps)``,
            default :func:`default_config`. split: K chunks (default :func:`ws_split`).
        pdl: launch with programmatic dependent launch, so that the copies of W, x and the signs for
            the first ring overlap the activation-planes kernel.
        tiled: ``signs`` is :func:`tile_signs` of the ``[S, N, K/8]`` signs for the configuration's
            ``BLOCK_K`` (each K step's sign tile one contiguous copy).
        base_spread: with 8 or 16 rows and two or four consumer warpgroups, each computes the base
            product of every row over its share of each K step's columns (one wgmma of N = rows on a
            K slice) instead of the whole step for its group of eight rows (which at 16 rows with
            four consumers computes each product twice); the partial sums meet in the workspace,
            even without a K split.
        bits: the sign part on the binary tensor cores (``mma.sync`` b1, AND + POPC) with the
            activations' 16 bit planes (:func:`activation_bitplanes`) instead of on the int8 ones: each
            consumer thread reads two sign words per row and 128 weights as stored and expands nothing.
        persistent: launch one program per resident slot (:func:`ws_slots`) instead of one per work
            unit (feature block × row block × K chunk); each walks units ``p, p + grid, …`` and its
            loaders fill the ring for the next unit while the consumers finish the last. Not with
            ``pdl`` unless ``bits``.
        stream_k: persistent, and instead of whole K chunks each program takes an equal run of all
            tiles' K steps laid end to end (at least 4), so that no multiprocessor idles at the end
            (qkv's 160 feature blocks on 132 multiprocessors); ``split`` is ignored. Same ``pdl`` rule.
        _copies_only: with ``bits``, the memory side alone, for profiling: the same copies and
            barriers, no products (``y`` is wrong).

    Returns:
        ``y``. The tensors are checked by the caller (``deltafleet.kernels.triton_bitdelta``), not here.

    Raises:
        ValueError: if ``persistent`` and ``pdl`` without ``bits``; if K is not a multiple of the
            configuration's ``BLOCK_K``, its rows per warpgroup
            do not split the row block into 1, 2 or 4 warpgroups of 2, 4 or 8 rows, or its loader
            warps are not 1, 2 or 4; with ``tiled``, if ``signs`` is not tiled for this ``BLOCK_K``.
    """
    m, k = x.shape
    n = weight.shape[0]
    s = signs.shape[0]
    rows = max(2, min(16, triton.next_power_of_2(m)))
    if config is None:
        config = default_config(rows, k) or WS_CONFIGS[rows][0]
    if not isinstance(config, (tuple, list)) or len(config) != 5:
        raise ValueError(f"config must be (BLOCK_K, rows per warpgroup, stages, registers, loader warps), got {config!r}")
    if split is not None and (not isinstance(split, int) or split < 1):
        raise ValueError(f"split must be 1 or more K chunks, got {split}")
    bk, per_wg, stages, regs, loaders = config
    rh = min(rows, per_wg)
    if rh not in (2, 4, 8) or rows % rh or rows // rh not in (1, 2, 4):
        raise ValueError(f"{per_wg} rows per warpgroup do not split {rows} rows into 1, 2 or 4 warpgroups of "
                         "2, 4 or 8 rows")
    if k % bk:
        raise ValueError(f"K = {k} is not a multiple of the configuration's BLOCK_K = {bk}")
    if loaders not in (1, 2, 4):
        raise ValueError(f"{loaders} loader warps: the kernel takes 1, 2 or 4")
    if tiled and tuple(signs.shape[1:]) != (triton.cdiv(n, BLOCK_N), k // bk, BLOCK_N, bk // 8):
        raise ValueError(f"tiled signs of shape {tuple(signs.shape)} are not tile_signs(…, {bk}) of "
                         f"[S, {n}, {k // 8}]")
    if (persistent or stream_k) and pdl and not bits:
        raise ValueError("a persistent launch with programmatic dependent launch needs bits=True (the int8 "
                         "planes' deferred copies assume each program's first K steps fill the ring)")
    if split is None or persistent or stream_k:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if split is None:
        split = ws_split(m, n, k, (bk, rh, stages, regs, loaders), sms, bits)
    if bits:
        bitplanes, sc = activation_bitplanes(x, pdl=pdl)
        planes = bitplanes.view(torch.int8).view(-1, 256)  # an unused descriptor's tensor
    else:
        planes, sc = activation_planes(x, pdl=pdl)
        bitplanes = sc
    dt = _gl_dtype(x.dtype)
    x_desc = TensorDescriptor.from_tensor(x, [16, bk], gl.NVMMASharedLayout.get_default_for([16, bk], dt))
    w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, bk], gl.NVMMASharedLayout.get_default_for([BLOCK_N, bk], dt))
    unswizzled = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)  # read back as words
    if tiled:  # one K step's tile: BLOCK_N·bk/8 contiguous bytes as rows of 128
        s_desc = TensorDescriptor.from_tensor(signs.view(-1, 128), [BLOCK_N * bk // 8 // 128, 128], unswizzled)
    else:
        s_desc = TensorDescriptor.from_tensor(signs.view(s * n, k // 8), [BLOCK_N, bk // 8], unswizzled)
    p_desc = TensorDescriptor.from_tensor(planes, [8, bk], gl.NVMMASharedLayout.get_default_for([8, bk], gl.int8))
    units = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, 16) * split
    per = 0
    if persistent or stream_k:
        slots = ws_slots(m, (bk, rh, stages, regs, loaders), sms, bits)
        units = min(units, slots)
        if stream_k:  # every resident program the same number of steps (at least 4), across tiles
            steps = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, 16) * (k // bk)
            per = max(4, triton.cdiv(steps, slots))
            units, split = triton.cdiv(steps, per), 1
    _planes_ws_kernel[(units, )](x_desc, w_desc, s_desc, p_desc, slot, sc, alphas, bias if bias is not None else alphas,
                            y, ws, cnt, bitplanes, m, n, k, s, alphas.stride(0), y.stride(0), split, per,
                            ALPHA_PER_ROW=alphas.dim() == 2,
                            HAS_BIAS=bias is not None, ROWS=rows, STAGES=stages, INFLIGHT=4, CONS_REGS=regs, RH=rh,
                            PDL=pdl, LOADERS=loaders, BS=base_spread and rows // rh > 1 and rows >= 8, BITS=(2 if _copies_only else 1) if bits else 0, num_warps=4,
                            maxnreg=regs, launch_pdl=pdl)
    return y


# ---------------------------------------------------------------------------------------------
# The kernel: loader warps issue the TMA copies; consumer warpgroups of 2, 4 or 8 rows do the
# products.

if HAVE_GLUON:
    @gluon.jit
    def _ws_npieces(K, NTN, NTM, SPLIT, PER, BK: gl.constexpr):
        """How many pieces (a tile's K steps ``k_first … k_first + num_k − 1``) this program takes: with
        ``PER`` = 0 the work units ``program_id, + grid, …`` of ``NTN·NTM·SPLIT`` (tile × K chunk); with
        ``PER`` > 0 (stream-K) the tiles its ``PER`` consecutive steps of the ``NTN·NTM·K/BK`` touch."""
        pid = gl.program_id(0)
        KT = gl.cdiv(K, BK)
        if PER > 0:
            g0 = pid * PER
            g1 = gl.minimum(g0 + PER, NTN * NTM * KT)
            n = (g1 - 1) // KT - g0 // KT + 1
        else:
            n = gl.cdiv(NTN * NTM * SPLIT - pid, gl.num_programs(0))
        return n

    @gluon.jit
    def _ws_piece(i, K, NTN, NTM, SPLIT, PER, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """This program's piece ``i`` → ``(off_m, off_n, first K step, K steps, 1.0 if it holds the tile's
        step 0 else 0.0, tile, pieces of the tile)`` (:func:`_ws_npieces`; tile = row block · NTN +
        feature block). Units: unit ``program_id + i·grid`` is tile ``u % (NTN·NTM)``, chunk ``u //
        (NTN·NTM)`` of ``SPLIT`` (the last may be short or empty). Stream-K: the steps ``[g0, g1)`` of
        this program, ``g0 = program_id·PER``, cut at tile boundaries."""
        pid = gl.program_id(0)
        KT = gl.cdiv(K, BK)
        if PER > 0:
            g0 = pid * PER
            g1 = gl.minimum(g0 + PER, NTN * NTM * KT)
            tile = g0 // KT + i
            k_first = gl.maximum(g0 - tile * KT, 0)
            num_k = gl.minimum(g1 - tile * KT, KT) - k_first
            count = ((tile + 1) * KT - 1) // PER - (tile * KT) // PER + 1
        else:
            u = pid + i * gl.num_programs(0)
            tile = u % (NTN * NTM)
            per = gl.cdiv(KT, SPLIT)
            k_first = (u // (NTN * NTM)) * per
            num_k = gl.minimum(per, KT - k_first)
            count = SPLIT
        return ((tile // NTN) * BM, (tile % NTN) * BN, k_first, num_k, (k_first == 0).to(gl.float32), tile, count)

    @gluon.jit
    def _ws_load(p, ROWS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, J: gl.constexpr,
                 LOADERS: gl.constexpr, BITS: gl.constexpr):
        """Loader warp ``J`` of ``LOADERS``: of the copies of one K step, numbered x 0, W 1, plane
        groups ``2 … 1 + G``, sign rows ``2 + G …``, it issues those whose number is ``J`` modulo
        ``LOADERS`` (every loader arrives on the stage's ``ready`` barrier with its own bytes)."""
        (x_desc, w_desc, s_desc, p_desc, x_smem, w_smem, s_smem, p_smem, ready, empty,
         slot_ptr, M, N, K, NSLOT, NTN, NTM, SPLIT, PER) = p
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        G: gl.constexpr = 0 if BITS else (ROWS + 3) // 4  # BITS: the consumers read bit planes themselves
        L: gl.constexpr = LOADERS
        TILED: gl.constexpr = s_desc.block_type.shape[1] == 128  # sign tiles stored whole (tile_signs)
        R: gl.constexpr = s_desc.block_type.shape[0]
        # copies numbered in [a, b) that are J modulo L: (b − J + L − 1)//L − (a − J + L − 1)//L
        N_X: gl.constexpr = (1 - J + L - 1) // L
        N_W: gl.constexpr = (2 - J + L - 1) // L - N_X
        N_P: gl.constexpr = (2 + G - J + L - 1) // L - (2 - J + L - 1) // L
        N_S: gl.constexpr = (2 + G + ROWS - J + L - 1) // L - (2 + G - J + L - 1) // L
        nbytes: gl.constexpr = (N_X * x_desc.block_type.nbytes + N_W * w_desc.block_type.nbytes
                                + N_S * s_desc.block_type.nbytes + N_P * p_desc.block_type.nbytes)
        it = 0  # K steps issued so far: the ring's position and phase
        for i in range(_ws_npieces(K, NTN, NTM, SPLIT, PER, BK)):
            off_m, off_n, k_first, num_k, first, tile, count = _ws_piece(i, K, NTN, NTM, SPLIT, PER, BM, BN, BK)
            srow = ()
            for r in gl.static_range(ROWS):
                row = off_m + r
                sl = gl.load(slot_ptr + row, mask=row < M, other=-1)
                ok = (sl >= 0) & (sl < NSLOT)
                if TILED:  # tile (slot, feature block, K step) of R rows of 128 bytes: first row of K step 0
                    NT = gl.cdiv(N, 64)
                    KT = K // BK
                    srow = srow + (gl.where(ok, (sl * NT + off_n // 64) * KT, NSLOT * NT * KT) * R, )
                else:
                    srow = srow + (gl.where(ok, sl * N + off_n, NSLOT * N), )
            for ki in range(num_k):
                stage = it % STAGES
                mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # the consumers are done with it
                kk = (k_first + ki) * BK
                bar = ready.index(stage)
                mbarrier.expect(bar, nbytes)
                if J == 0:
                    _tma_load(x_desc, [off_m, kk], bar, x_smem.index(stage))
                if (1 % L) == J:
                    _tma_load(w_desc, [off_n, kk], bar, w_smem.index(stage))
                for r in gl.static_range(ROWS):
                    if ((2 + G + r) % L) == J:
                        if TILED:
                            _tma_load(s_desc, [srow[r] + (k_first + ki) * R, 0], bar, s_smem[r].index(stage))
                        else:
                            _tma_load(s_desc, [srow[r], kk // 8], bar, s_smem[r].index(stage))
                if PDL:  # the planes come from the kernel before: W, x and signs of the first ring go first
                    if ki == gl.minimum(num_k, STAGES) - 1:
                        _gdc_wait()
                        for j in range(ki + 1):
                            for g in gl.static_range(G):
                                if ((2 + g) % L) == J:
                                    _tma_load(p_desc, [2 * off_m + 8 * g, (k_first + j) * BK], ready.index(j),
                                              p_smem[g].index(j))
                    if ki >= STAGES:
                        for g in gl.static_range(G):
                            if ((2 + g) % L) == J:
                                _tma_load(p_desc, [2 * off_m + 8 * g, kk], bar, p_smem[g].index(stage))
                else:
                    for g in gl.static_range(G):
                        if ((2 + g) % L) == J:
                            _tma_load(p_desc, [2 * off_m + 8 * g, kk], bar, p_smem[g].index(stage))
                it += 1

    @gluon.jit
    def _base_mma(w_buf, x_buf, acc_b, BS: gl.constexpr, XR0: gl.constexpr, NB: gl.constexpr, K0: gl.constexpr,
                  KQ: gl.constexpr):
        """Issue one K step's base wgmma (swap-AB: the W tile the 64-row A operand, x rows the B operand),
        asynchronously: with ``BS`` the block's ``NB`` rows over this consumer's K slice ``K0 … K0 + KQ``,
        else the eight rows from ``XR0`` over the whole step."""
        if BS:
            out = warpgroup_mma(w_buf.slice(K0, KQ, dim=1), x_buf.slice(XR0, NB, dim=0).slice(K0, KQ, dim=1).permute((1, 0)),
                                acc_b, is_async=True)
        else:
            out = warpgroup_mma(w_buf, x_buf.slice(XR0, 8, dim=0).permute((1, 0)), acc_b, is_async=True)
        return out

    @gluon.jit
    def _ws_consume(p, q, ROWS: gl.constexpr, STAGES: gl.constexpr, ROW0: gl.constexpr, RH: gl.constexpr,
                    ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, INFLIGHT: gl.constexpr, PDL: gl.constexpr,
                    BS: gl.constexpr, BITS: gl.constexpr):
        """Rows ``ROW0 … ROW0 + RH − 1`` of the row block, as one warpgroup. ``BS`` (base spread, more
        than one consumer): the base product of every row of the block over this consumer's
        ``1/NCONS`` of each K step (one wgmma of N = ``ROWS`` on a K slice) instead of the whole K step
        for the eight rows of its own (N = 8, the same product in two consumers at 16 rows); the
        partial base sums meet in the split-K workspace."""
        (x_desc, w_desc, s_desc, p_desc, x_smem, w_smem, s_smem, p_smem, ready, empty,
         slot_ptr, M, N, K, NSLOT, NTN, NTM, SPLIT, PER) = p
        (sc_ptr, a_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, stride_as, stride_ym, bits_ptr) = q
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        SB: gl.constexpr = BK // 8
        NCONS: gl.constexpr = ROWS // RH
        XR0: gl.constexpr = 0 if BS else (ROW0 // 8) * 8  # the first x row of the base wgmma
        NB: gl.constexpr = ROWS if BS else 8               # its N: every row of the block, or eight
        KQ: gl.constexpr = BK // NCONS if BS else BK        # its K: this consumer's slice of the step
        K0: gl.constexpr = (ROW0 // RH) * KQ if BS else 0
        dtype: gl.constexpr = x_desc.dtype
        acc_b_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NB, 16])
        acc_s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_s_l, k_width=4)
        word_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        kq = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, dot_a)) // 4, 0)  # [1, 32]

        it = 0  # K steps consumed so far: the ring's position and phase
        for i in range(_ws_npieces(K, NTN, NTM, SPLIT, PER, BK)):
            off_m, off_n, k_first, num_k, first, tile, count = _ws_piece(i, K, NTN, NTM, SPLIT, PER, BM, BN, BK)
            acc_b = gl.zeros([BN, NB], gl.float32, acc_b_l)
            if BITS:
                # binary tensor cores (mma.sync m16n8k128 b1, AND + POPC): per row and 128 weights, the
                # row's 64 × 128 sign bits (A, two words per thread, read as stored) against its 16 bit
                # planes (B, eight per mma); the layout l3 below is described in the module docstring
                l3: gl.constexpr = gl.DistributedLinearLayout(
                    reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
                    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[BN, 4, 4])
                word_l3: gl.constexpr = gl.SliceLayout(2, l3)
                r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, word_l3)), 1), 2)
                t3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, word_l3)), 0), 2)
                j3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3))), 0), 1)
                boff = ((r3 % 8) * 4 + t3) * 2 + j3 % 2  # [BN, 4, 4]: word of plane 8·(j % 2) + row % 8, K word t
                KW: gl.constexpr = BK // 128  # 128-weight pieces per K step
                if PDL:
                    _gdc_wait()  # the bit planes come from the kernel before
                brow = ()
                for r in gl.static_range(RH):  # rows past M read row M − 1: their sign tiles are zeros
                    brow = brow + (gl.minimum(off_m + ROW0 + r, M - 1).to(gl.int64) * (K // 128) * 64, )
                zero = gl.zeros([BN, 4, 4], gl.int32, l3)
                acc_s = ()
                for r in gl.static_range(RH):
                    acc_s = acc_s + (zero, )
                # each step's plane words are loaded one step ahead (an L2 round trip off the critical path)
                bw_next = ()
                for r in gl.static_range(RH):
                    for c in gl.static_range(KW):
                        # an empty K chunk (k_first past the last step) reads the last step instead
                        bw_next = bw_next + (gl.load(bits_ptr + brow[r] + gl.minimum(k_first, K // BK - 1) * KW * 64
                                                     + c * 64 + boff), )
                for ki in range(num_k):
                    stage = it % STAGES
                    bw = bw_next
                    kw = (k_first + gl.minimum(ki + 1, num_k - 1)) * KW * 64
                    bw_next = ()
                    for r in gl.static_range(RH):
                        for c in gl.static_range(KW):
                            bw_next = bw_next + (gl.load(bits_ptr + brow[r] + kw + c * 64 + boff), )
                    mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
                    if BITS == 1:
                        acc_b = _base_mma(w_smem.index(stage), x_smem.index(stage), acc_b, BS, XR0, NB, K0, KQ)
                    new = ()
                    for r in gl.static_range(RH):
                        words = _as_words(s_smem[ROW0 + r].index(stage), BN, SB // 4, word_l)
                        acc = acc_s[r]
                        for c in gl.static_range(KW if BITS == 1 else 0):  # BITS 2: the copies alone (profiling)
                            a = words.slice(4 * c, 4, dim=1).load(word_l3)                  # [BN, 4]
                            a3, _ = gl.broadcast(gl.expand_dims(a, 2), zero)
                            acc = gl.inline_asm_elementwise(_BMMA, "=r,=r,=r,=r,=r,=r,=r,=r," + "r," * 23 + "r",
                                                            [a3, bw[r * KW + c], acc], dtype=gl.int32, is_pure=True,
                                                            pack=8)
                        new = new + (acc, )
                    acc_s = new
                    if BITS == 1:
                        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b, ))
                    fence_async_shared()  # the sign words' shared loads come before the loader's next copy
                    mbarrier.arrive(empty.index(stage), count=1)
                    it += 1
            else:
                acc_s = ()
                for r in gl.static_range(RH):
                    acc_s = acc_s + (gl.zeros([BN, 8], gl.int32, acc_s_l), )
                for ki in range(num_k):
                    stage = it % STAGES
                    mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
                    acc_b = _base_mma(w_smem.index(stage), x_smem.index(stage), acc_b, BS, XR0, NB, K0, KQ)
                    new = ()
                    for r in gl.static_range(RH):
                        words = _as_words(s_smem[ROW0 + r].index(stage), BN, SB // 4, word_l)
                        acc = acc_s[r]
                        for c in gl.static_range(BK // 32):
                            wc = words.slice(c, 1, dim=1).load(dot_a)                          # [BN, 1]
                            a = gl.inline_asm_elementwise(
                                "{ .reg .b32 t; shr.b32 t, $1, $5; and.b32 $0, t, 0x01010101; }",
                                "=r,r,r,r,r,r,r,r,r", [wc, kq], dtype=gl.int8, is_pure=True, pack=4)
                            b = p_smem[(ROW0 + r) // 4].index(stage).slice(32 * c, 32, dim=1).permute((1, 0))
                            acc = warpgroup_mma(a, b, acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=INFLIGHT, deps=(acc, ))
                        new = new + (acc, )
                    done = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b, ) + new)
                    acc_b = done[0]
                    acc_s = ()
                    for r in gl.static_range(RH):
                        acc_s = acc_s + (done[r + 1], )
                    fence_async_shared()  # the sign words' shared loads come before the loader's next copy
                    mbarrier.arrive(empty.index(stage), count=1)
                    it += 1

            out_l: gl.constexpr = gl.SliceLayout(1, acc_s_l)
            cols_b = gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(0, acc_b_l)), 0)
            cols_s = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, acc_s_l)), 0)
            feat = off_n + gl.arange(0, BN, layout=out_l)
            fmask = feat < N
            if BITS:  # the weight of each accumulator column: plane p = 8·(j % 2) + 2·t + j // 2
                pl = 8 * (j3 % 2) + 2 * t3 + j3 // 2
                pw = gl.where(pl == 15, -32768.0, (1 << pl).to(gl.float32))
            if PDL:
                _gdc_wait()  # the row scales come from the kernel before
            if BS:  # this consumer's partial base sums of the other consumers' rows go to the workspace
                for r in gl.static_range(ROWS):
                    if (r < ROW0) or (r >= ROW0 + RH):
                        row = off_m + r
                        part = gl.convert_layout(gl.sum(gl.where(cols_b == r, acc_b, 0.0), axis=1), out_l)
                        gl.atomic_add(ws_ptr + row * N + feat, part, mask=fmask & (row < M), sem="relaxed")
            for r in gl.static_range(RH):
                row = off_m + ROW0 + r
                base = gl.convert_layout(gl.sum(gl.where(cols_b == ROW0 + r - XR0, acc_b, 0.0), axis=1), out_l)
                if BITS:  # Σ over planes of 2^p · popc, plane 15 the sign (−2^15)
                    s16 = gl.sum(gl.sum(acc_s[r].to(gl.float32) * pw, axis=2), axis=1)
                    twice = gl.convert_layout(2.0 * s16, out_l)
                else:
                    d = acc_s[r]
                    hi = gl.sum(gl.where(cols_s == 2 * ((ROW0 + r) % 4), d, 0), axis=1).to(gl.float32)
                    lo = gl.sum(gl.where(cols_s == 2 * ((ROW0 + r) % 4) + 1, d, 0), axis=1).to(gl.float32)
                    twice = 512.0 * hi + 2.0 * lo
                sl = gl.load(slot_ptr + row, mask=row < M, other=-1)
                ok = (sl >= 0) & (sl < NSLOT) & (row < M)
                scale = gl.load(sc_ptr + 2 * row, mask=row < M, other=0.0)
                qsum = gl.load(sc_ptr + 2 * row + 1, mask=row < M, other=0.0)
                sdot = scale * (twice - first * qsum)
                if ALPHA_PER_ROW:
                    alpha = gl.load(a_ptr + sl * stride_as + feat, mask=fmask & ok, other=0.0)
                else:
                    alpha = gl.load(a_ptr + sl * stride_as + feat * 0, mask=fmask & ok, other=0.0)
                out = base + alpha * sdot
                m = fmask & (row < M)
                if BS or count > 1:
                    gl.atomic_add(ws_ptr + row * N + feat, out, mask=m, sem="relaxed")
                else:
                    if HAS_BIAS:
                        out = out + gl.load(b_ptr + feat, mask=fmask, other=0.0).to(gl.float32)
                    gl.store(y_ptr + row * stride_ym + feat, out.to(dtype), mask=m)
            if BS or count > 1:
                done_n = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")  # after this warpgroup's adds
                if done_n == count * NCONS - 1:  # the last of the tile: read (and zero) every row's sums, write y
                    for r in gl.static_range(ROWS):
                        row = off_m + r
                        m = fmask & (row < M)
                        out = gl.atomic_xchg(ws_ptr + row * N + feat, gl.zeros([BN], gl.float32, out_l), mask=m,
                                             sem="relaxed")
                        if HAS_BIAS:
                            out = out + gl.load(b_ptr + feat, mask=fmask, other=0.0).to(gl.float32)
                        gl.store(y_ptr + row * stride_ym + feat, out.to(dtype), mask=m)
                    gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")

    @gluon.jit
    def _ws_worker(p, q, ROWS: gl.constexpr, STAGES: gl.constexpr, ROW0: gl.constexpr, RH: gl.constexpr,
                   ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, INFLIGHT: gl.constexpr, PDL: gl.constexpr,
                   BS: gl.constexpr, BITS: gl.constexpr, LOADER: gl.constexpr, LOADERS: gl.constexpr):
        """A worker partition: loader warp ``LOADER`` of ``LOADERS``, or (``LOADER`` = −1) the consumer
        warpgroup of rows ``ROW0 … ROW0 + RH − 1``."""
        if LOADER >= 0:
            _ws_load(p, ROWS, STAGES, PDL, LOADER, LOADERS, BITS)
        else:
            _ws_consume(p, q, ROWS, STAGES, ROW0, RH, ALPHA_PER_ROW, HAS_BIAS, INFLIGHT, PDL, BS, BITS)

    @gluon.jit
    def _planes_ws_kernel(x_desc, w_desc, s_desc, p_desc, slot_ptr, sc_ptr, a_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                          bits_ptr, M, N, K, NSLOT, stride_as, stride_ym, SPLIT, PER,
                          ALPHA_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, ROWS: gl.constexpr,
                          STAGES: gl.constexpr, INFLIGHT: gl.constexpr, CONS_REGS: gl.constexpr,
                          RH: gl.constexpr, PDL: gl.constexpr, LOADERS: gl.constexpr, BS: gl.constexpr,
                          BITS: gl.constexpr,
                          num_warps: gl.constexpr):
        """Work units of ``ROWS`` (≤ 16) rows × 64 features × one of ``SPLIT`` K chunks, unit ``u`` =
        feature block + blocks·(row block + row blocks·chunk), program p taking units p, p + grid, …
        (one each when the grid is the unit count; fewer programs: persistent, the loaders filling
        the ring for the next unit while the consumers finish the last); or, with ``PER`` > 0
        (stream-K), program p takes the ``PER`` steps from ``p·PER`` of all tiles' K steps laid end to
        end, cut at tile boundaries, every piece of a tile adding into the workspace. Per K step the base wgmma
        (W from shared memory, swap-AB) and, per row, ``BK/32`` int8 wgmmas of its sign bits
        (registers) with its plane group (shared memory), at most ``INFLIGHT`` in flight per
        consumer, or (``BITS``) two binary mmas per 128 weights. Split K meets in a self-cleaning
        workspace (``gluon_bitdelta._tenants_kernel``)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        SB: gl.constexpr = BK // 8
        G: gl.constexpr = 0 if BITS else (ROWS + 3) // 4
        NCONS: gl.constexpr = ROWS // RH  # consumer warpgroups of RH rows each
        NTN = gl.cdiv(N, BN)
        NTM = gl.cdiv(M, BM)

        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        s_smem = ()
        for r in gl.static_range(ROWS):
            s_smem = s_smem + (gl.allocate_shared_memory(gl.uint8, [STAGES, s_desc.block_type.shape[0],
                                                                   s_desc.block_type.shape[1]], s_desc.layout), )
        p_smem = ()
        for g in gl.static_range(G):
            p_smem = p_smem + (gl.allocate_shared_memory(gl.int8, [STAGES, 8, BK], p_desc.layout), )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=LOADERS)
            mbarrier.init(empty.index(i), count=NCONS)
        p = (x_desc, w_desc, s_desc, p_desc, x_smem, w_smem, s_smem, p_smem, ready, empty,
             slot_ptr, M, N, K, NSLOT, NTN, NTM, SPLIT, PER)
        q = (sc_ptr, a_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, stride_as, stride_ym, bits_ptr)
        A: gl.constexpr = ALPHA_PER_ROW
        B: gl.constexpr = HAS_BIAS
        # consumer 0 is the default partition; consumers 1 … NCONS − 1 and the loader warps are workers
        # (a partition list is a literal: Gluon tuples cannot hold functions)
        if NCONS == 1 and LOADERS == 1:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 1)),
            ], [1], [24])
        elif NCONS == 1 and LOADERS == 2:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 1, 2)),
            ], [1, 1], [24, 24])
        elif NCONS == 1 and LOADERS == 4:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 2, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 3, 4)),
            ], [1, 1, 1, 1], [24, 24, 24, 24])
        elif NCONS == 2 and LOADERS == 1:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 1 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 1)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 1)),
            ], [4, 1], [CONS_REGS, 24])
        elif NCONS == 2 and LOADERS == 2:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 1 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 1, 2)),
            ], [4, 1, 1], [CONS_REGS, 24, 24])
        elif NCONS == 2 and LOADERS == 4:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 1 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 2, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 3, 4)),
            ], [4, 1, 1, 1, 1], [CONS_REGS, 24, 24, 24, 24])
        elif NCONS == 4 and LOADERS == 1:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 1 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 1)),
                (_ws_worker, (p, q, ROWS, STAGES, 2 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 1)),
                (_ws_worker, (p, q, ROWS, STAGES, 3 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 1)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 1)),
            ], [4, 4, 4, 1], [CONS_REGS, CONS_REGS, CONS_REGS, 24])
        elif NCONS == 4 and LOADERS == 2:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 1 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 2 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 3 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 2)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 1, 2)),
            ], [4, 4, 4, 1, 1], [CONS_REGS, CONS_REGS, CONS_REGS, 24, 24])
        elif NCONS == 4 and LOADERS == 4:
            gl.warp_specialize([
                (_ws_consume, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS)),
                (_ws_worker, (p, q, ROWS, STAGES, 1 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 2 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 3 * RH, RH, A, B, INFLIGHT, PDL, BS, BITS, -1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 0, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 1, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 2, 4)),
                (_ws_worker, (p, q, ROWS, STAGES, 0, RH, A, B, INFLIGHT, PDL, BS, BITS, 3, 4)),
            ], [4, 4, 4, 1, 1, 1, 1], [CONS_REGS, CONS_REGS, CONS_REGS, 24, 24, 24, 24])
        else:
            gl.static_assert(False, "1, 2 or 4 consumer warpgroups and 1, 2 or 4 loader warps")
