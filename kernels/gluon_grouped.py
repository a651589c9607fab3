"""Hopper (sm_90a) grouped sign product on the int8 tensor cores (Gluon): one sign tile per block of
rows that share a variant.

``y[m] += α_t ⊙ (x[m]·S_tᵀ)`` in place for every row m whose variant ``t = slot[m]`` is in ``[0, S)``
(BitDelta, arXiv:2402.10193, §3.1 Eq. 2, the delta term), ``S_t = 2·bits_t − 1``; base rows are left
untouched. It is ``deltafleet.kernels.triton_grouped.add_sign_products``' contract: the caller has
already written the base product ``x·Wᵀ`` of every row into ``y`` (``torch.mm``, cuBLAS), and the rows
come grouped by variant (:class:`~deltafleet.kernels.triton_grouped.RowGroups` from
``group_rows(slot, S, block_m)``: rows sorted by variant, ``first[b]`` the first sorted row of block b,
M past the last, a block up to ``block_m`` rows of one variant).

Why: ``triton_grouped._grouped_kernel`` unpacks every sign bit to a ±1 bf16 operand (about five
instructions per weight) for every block of rows, and is bound by that, not by memory. Here the sign
product is an int8 tensor-core product whose sign operand is the packed bits themselves, as in
``deltafleet.kernels.gluon_planes._planes_ws_kernel``, but with one expanded sign tile per *block of
rows*, not per row:

* ``s·x = 2·(s'·x) − Σx`` with ``s' = (s + 1)/2 ∈ {0, 1}``: bytes ``j = 0..3`` of one 32-bit A register
  hold bits ``q, q+8, q+16, q+24`` of a sign word in their bit 7, ``(word · 2^(7−q)) & 0x80808080``
  (two instructions for four weights: a multiply on the FMA pipe and an AND on the integer pipe, which
  a shift and an AND would load twice as much), so each byte is ``−128·s'`` and the sums are divided
  by −128 (exactly) in the epilogue; logical K position ``4q + j`` of every 32-block is physical
  ``q + 8j`` on both operands.
* The activations are a 16-bit fixed-point copy with one scale per row, ``x ≈ scale·(256·hi + lo)``,
  ``scale = max|x|/32639``, stored as two int8 planes in that permuted K order (``gluon_planes``'
  ``_planes_kernel`` arithmetic, :func:`sorted_planes`). Integer sums are exact; the only rounding is
  ``x`` to 16 bits, at most ``scale/2`` per element (plus the float32 rounding of ``1/scale``), so
  the sign term of a row is off by at most ``α·K·1.01·scale/2``, and in practice by about
  ``α·√K·scale/√12``.
* The planes are stored in *sorted* row order: :func:`sorted_planes` reads row ``order[i]`` of x into
  planes rows ``2i`` (hi) and ``2i + 1`` (lo), so block b's rows are the consecutive planes rows
  ``2·first[b] …`` and one TMA box ``[2·BLOCK_M, BLOCK_K]`` loads them all. Rows of the box beyond the
  block (another variant's, base rows, or past M) are multiplied too and discarded at the store; the
  planes of base rows are not even written (their contents never reach ``y``).
* One int8 wgmma ``m64 n(2·BLOCK_M) k32`` per 64 features and 32 weights: A the 64 features' sign bits
  (registers), B the block's planes (shared memory), so each sign tile is expanded once per block and
  multiplied by all its rows; accumulator columns ``2i`` and ``2i + 1`` are −128 times row i's hi and lo
  sums.

Grid: ``(max_blocks, ceil(N / BLOCK_N))``, program ``(b, f)`` takes ``BLOCK_N`` = 64·NSUB features of
block b. The grid depends on M, S and ``block_m`` only (``group_rows``' upper bound on the blocks), so
a CUDA graph records it; programs past the last block (``first[b] ≥ M``) return at once; nothing
synchronises with the host. Blocks run fastest, so the blocks of one variant, which read the same sign
tiles, run side by side and share them through L2 (one variant's signs of a large matrix do not fit
in L2: blocks of a variant far apart in launch order would each read them from HBM); the planes,
``2·M·K`` bytes, stay in L2 whatever the order. ``BLOCK_N`` above 64 shares one planes tile among
several sign tiles: per K step a program reads ``BLOCK_N·BLOCK_K/8`` sign bytes and ``2·BLOCK_M·BLOCK_K``
plane bytes (from L2, again for every column of programs), so the plane traffic into the
multiprocessors is ``16·BLOCK_M/BLOCK_N`` times the sign traffic.

Pipeline (warp-specialised, as ``_planes_ws_kernel``): one loader warp issues per K step NSUB sign
copies (each the ``BLOCK_K/128`` consecutive 64 × 128 tiles of one feature tile in
``deltafleet.kernels.tile_signs``' layout, one contiguous piece) and one planes copy into a ring of
``STAGES`` buffers (``ready``/``empty`` mbarriers); one, two or four consumer warpgroups each own
``NSUB/CONSUMERS`` feature tiles: per K step and 32 weights each reads its tiles' sign words from
shared memory, forms the A registers and issues asynchronous wgmmas against the shared planes, all of
the step's wgmmas in flight together (or at most ``inflight`` after each feature tile), and waits for
them at the end of the step: a wgmma with a register operand in flight across the loop's back edge
makes ptxas serialise them all, and so do too few registers (C7512/C7515). :data:`CONFIGS` lists only
configurations that compile without either and without spills (tests/test_kernels_compile.py).
A consumer frees its stage with the mbarrier arrive alone, which has release semantics: every shared
load of the step is ordered before it, so the loader's next copy into the stage (issued once it sees
the phase) cannot overwrite what is still being read. No proxy fence (``fence.proxy.async``, a
``MEMBAR.ALL.CTA`` per K step in the SASS, which also waited for the prefetched epilogue loads) is
needed for reads followed by a copy, as in CUTLASS's consumer release.

Programmatic dependent launch (``pdl``): the loader fills the ring with its first sign tiles, then
waits (``griddepcontrol.wait``) for the kernel before, which writes the planes, before copying their
boxes; the consumers wait before reading anything else, and then let the next such launch start
(``griddepcontrol.launch_dependents``), so a launch's fill overlaps the tail of the one before. A
wait covers the launch just before only, so chained launches stay ordered only if each ends after its
predecessor: a launch whose programs all lie past the last block (a part of ``groups.parts()`` can
have none) still waits in program (0, 0), which is live whenever any program is.

A *sibling* launch (``sibling``: the launch before is the sign products of another matrix or part
over the same planes, as k after q) waits for nothing it reads: the planes, their scales and the
groups were complete before its predecessor let it start, since every program of that one had passed
its own wait by then (by induction along the chain, back to the launch after the planes), and its
column block of y is its own. So its programs let the next launch start at once and begin their
products while the last programs of the one before still run, instead of holding their
multiprocessors idle until it ends; only program (0, 0) waits, after its products, so that the chain
still ends in order.

``sync_mma`` (the configurations of ``block_m`` 4 and 8): the consumer multiplies by per-warp
``mma.sync`` m16n8k32 int8 products instead, each warp 16 of a tile's 64 features, a K chunk's planes
loaded into B registers once and shared by the consumer's tiles. Nothing is asynchronous, so the
warps' sign expansion and products interleave freely, and blocks of 8 rows (n16) or 4 (n8: one
product per tile and chunk) waste fewer tensor-core rows on a variant's short run than wgmma's blocks
of 16. For decode steps of up to 128 rows this is the faster path, with blocks of 4 where most
variants hold one or two rows (``triton_grouped.grouped_block_m``); above that the wgmma's larger
blocks expand each sign tile fewer times.

Bit accumulators (``bitacc``, with ``sync_mma`` and ``BLOCK_K`` 256): the expansion above costs two
instructions per four weights and runs once per K chunk. Instead, each thread loads its share of the K
step's sign bytes into A registers once, viewed as ``[64, 32]`` bytes (``_STEP_BYTES``: row r, column
``16u + b`` is byte b of row r of the step's tile u), and chunk c multiplies ``byte & 2^c`` (one AND per
four weights: bytes 0 or 2^c, −128 for c = 7) into its own accumulator, so each of the eight sums has
one scale. :func:`sorted_planes` (``bits=True``) writes the planes so that column ``32c + s`` of each
256-block holds logical K ``128·(s // 16) + 8·(s % 16) + c``, the weight of bit c of that byte; rows
are K rounded up to 256 wide, zeros past K. After the K loop ``s'·plane = Σ_{c<7} acc_c / 2^c − acc_7 /
128``, each division exact. Eight accumulators per feature tile cost 8·``block_m`` registers.

With ``BLOCK_K`` 256 the last step of an odd number of 128-weight tiles reads a sign tile past the
feature tile's K range (the next tile's bits, or zeros past the tensor) against planes past K, which
TMA fills with zeros: it adds nothing.

Epilogue, per consumer and feature tile, in the accumulator's own register layout (no shared-memory
scratch): ``(hi, lo)`` = the accumulator's column pairs (int32, held by one thread) divided by −128
(exactly: ``−(acc >> 7)``), ``s·x = scale·(512·hi + 2·lo − Σq)`` in float32 (``Σq`` of the quantised
row, from :func:`sorted_planes`), times ``α_t`` (per feature, ``[S, N]``, or one per matrix, ``[S]``),
added to ``y`` at row ``order[first + i]`` for the live rows (``i < first[b + 1] − first[b]``, the same
variant, ``< M``) and features ``< N``, rounded once to ``y``'s dtype. Each (row, feature) belongs to
exactly one program, so no atomics are needed. Live rows are bounded by the next block's start, so
groups cut with a *smaller* ``block_m`` than the kernel's are still right (just slower); a *larger* one
would drop rows: call ``group_rows`` with :attr:`GroupedConfig.block_m` of the configuration launched.

Constraints (:func:`supported`): compute capability 9.x with Gluon, x bf16/fp16 with K a multiple of
128 up to :data:`MAX_K` (beyond it the int32 sums could overflow), signs in the tiled layout of
128-weight K steps (``[S, ceil(N/64), K/128, 64, 16]``), contiguous and 16-byte aligned, y ``[M, N]``
with unit stride along N.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltafleet.kernels.gluon_bitdelta import HAVE_GLUON
from deltafleet.kernels.gluon_planes import _row_planes
from deltafleet.kernels.gluon_prefill_rs import multiprocessors

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from deltafleet.kernels.gluon_bitdelta import _tma_load
    from deltafleet.kernels.gluon_planes import _as_view, _as_words, _gdc_wait

TILE_N = 64    # features per sign tile: the wgmma's M
TILE_K = 128   # weights per sign tile (tile_signs' K step): 64 rows × 16 bytes, one contiguous KiB
SMEM_PER_BLOCK = 232448  # bytes of shared memory one Hopper block may use (227 KiB)
MAX_K = 130944  # K products of up to 128·128 (sign bytes −128·s', plane bytes) stay below 2³¹ in int32


class GroupedConfig(NamedTuple):
    """A launch configuration of :func:`add_sign_products_planes`.

    Attributes:
        block_m: rows per block (4, 8, 16, 32 or 64); ``group_rows`` must cut the blocks with the same
            ``block_m`` (a smaller one is also correct). The product's N is ``2·block_m``.
        block_n: features per program, 64·NSUB (64, 128 or 256), NSUB sign tiles sharing one planes tile.
        block_k: weights per K step (128 or 256; at most 256, the TMA box's longest side).
        stages: ring buffers (sign tiles + planes per K step).
        consumers: consumer warpgroups (1, 2 or 4), each owning ``block_n / 64 / consumers`` feature tiles.
        regs: registers per thread of the launch (``maxnreg``), which sets the program's register
            allocation; the loader gives up all but 24 (``setmaxnreg``) and one consumer takes them,
            two or four get ``regs`` each.
        inflight: after each feature tile's wgmmas of a K step, wait until at most this many are in
            flight (fewer live A registers); 0: wait only at the end of the step. Register operand only.
        sync_mma: multiply by ``mma.sync`` per warp (m16n8k32) instead of the warpgroup's wgmma, whose
            register operand makes each K step wait for its own products (module docstring).
        bitacc: with ``sync_mma`` and ``block_k`` 256, one accumulator per sign bit position (module
            docstring, "Bit accumulators"): one instruction per four weights instead of two.
        prefetch: with ``sync_mma`` (not ``bitacc``), the epilogue's loads (y's base values, α, the
            rows' scales) are issued before the K loop, so their latency hides behind it, at the cost
            of the registers that hold them through the loop.
    """

    block_m: int
    block_n: int
    block_k: int
    stages: int
    consumers: int
    regs: int
    inflight: int = 0
    sync_mma: bool = False
    bitacc: bool = False
    prefetch: bool = False

    def smem(self) -> int:
        """Bytes of the ring: per stage the sign tiles and the block's planes (the barriers come on
        top)."""
        return self.stages * (self.block_n * self.block_k // 8 + 2 * self.block_m * self.block_k)


# Per block_m, configurations that compile for sm_90a without spills or wgmma serialisation
# (tests/test_kernels_compile.py), in order of preference: :func:`choose_config` takes the first that
# gives the GPU enough programs. ``regs`` sets the launch's register allocation, ``regs × 32 × 4·(consumers
# + 1)`` per program (the loader warp is padded to a warpgroup); with one consumer its warpgroup takes the
# loader's share too (``setmaxnreg``), so 80 still leaves it 136, and three programs fit a multiprocessor
# by registers. Accumulators take ``block_m`` int32 registers per thread and feature tile. The
# ``mma.sync`` ones prefetch: their decode programs run only K/256 steps each (16 for a 4096-wide
# matrix), so the epilogue's loads, exposed once per program, are worth hiding (docs/kernels.md).
CONFIGS: dict[int, tuple[GroupedConfig, ...]] = {
    4: (GroupedConfig(4, 128, 256, 4, 1, 80, sync_mma=True, prefetch=True),),
    8: (GroupedConfig(8, 128, 256, 4, 1, 80, sync_mma=True, prefetch=True),
        GroupedConfig(8, 128, 256, 4, 1, 96, sync_mma=True, bitacc=True)),
    16: (GroupedConfig(16, 128, 256, 4, 1, 80), GroupedConfig(16, 256, 256, 4, 1, 128),
         GroupedConfig(16, 64, 256, 6, 1, 80), GroupedConfig(16, 256, 256, 4, 2, 128)),
    32: (GroupedConfig(32, 128, 256, 4, 1, 128), GroupedConfig(32, 64, 256, 4, 1, 80),
         GroupedConfig(32, 256, 256, 3, 2, 168), GroupedConfig(32, 128, 128, 6, 2, 128)),
    64: (GroupedConfig(64, 128, 128, 4, 2, 168), GroupedConfig(64, 64, 128, 6, 1, 96),
         GroupedConfig(64, 64, 256, 3, 1, 96), GroupedConfig(64, 128, 256, 3, 2, 168)),
}
BLOCK_MS = tuple(CONFIGS)


def default_config(block_m: int = 16) -> GroupedConfig:
    """The first configuration of :data:`CONFIGS` for blocks of ``block_m`` rows (4, 8, 16, 32 or 64).

    Raises:
        ValueError: if ``block_m`` is not one of :data:`BLOCK_MS`.
    """
    if block_m not in CONFIGS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {block_m}")
    return CONFIGS[block_m][0]


def choose_config(n: int, max_blocks: int, block_m: int = 16, sms: int = 132) -> GroupedConfig:
    """The untimed configuration for N features and a grid of ``max_blocks`` row blocks: the first
    of :data:`CONFIGS` ``[block_m]`` whose grid ``ceil(N / block_n) × max_blocks`` is at least two
    programs per multiprocessor (of ``sms``), else the one of the smallest ``block_n`` (the most
    programs). ``max_blocks`` is ``group_rows``' upper bound, so the live programs may be fewer.

    Raises:
        ValueError: if ``block_m`` is not one of :data:`BLOCK_MS`.
    """
    default_config(block_m)  # checks block_m
    configs = CONFIGS[block_m]
    for cfg in configs:
        if triton.cdiv(n, cfg.block_n) * max_blocks >= 2 * sms:
            return cfg
    return min(configs, key=lambda c: c.block_n)


def supported(x: torch.Tensor, signs: torch.Tensor, y: torch.Tensor | None = None) -> bool:
    """Whether :func:`add_sign_products_planes` can run: Gluon and a CUDA device of compute capability
    9.x, x a 2-D bf16/fp16 tensor with K a positive multiple of 128 up to :data:`MAX_K`, signs
    contiguous and 16-byte aligned in ``deltafleet.kernels.tile_signs``' layout
    (``[S, ceil(N/64), K/128, 64, 16]`` uint8), and (if given) y ``[M, N]`` in x's dtype or float32
    with unit stride along N."""
    if not HAVE_GLUON or x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[1] % TILE_K or x.shape[1] == 0:
        return False
    m, k = x.shape
    if k > MAX_K:  # the int32 sums could overflow
        return False
    if (signs.dtype != torch.uint8 or signs.dim() != 5 or tuple(signs.shape[2:]) != (k // TILE_K, TILE_N, 16)
            or not signs.is_contiguous() or signs.data_ptr() % 16 or signs.device != x.device):
        return False
    if y is not None:
        if (y.dim() != 2 or y.shape[0] != m or triton.cdiv(y.shape[1], TILE_N) != signs.shape[1]
                or y.dtype not in (x.dtype, torch.float32) or y.stride(1) != 1 or y.device != x.device):
            return False
    return True


@triton.jit(do_not_specialize=["NSLOT"])
def _sorted_planes_kernel(x_ptr, order_ptr, key_ptr, p_ptr, sc_ptr, K, KP, stride_xm, NSLOT, BLOCK: tl.constexpr,
                          BITS: tl.constexpr, PDL: tl.constexpr = False):
    """Program i: sorted row i = x row ``order[i]``, unless it is a base row (``key[i] ≥ NSLOT``, whose
    planes no store ever uses: left unwritten). As ``gluon_planes._planes_kernel``: ``scale =
    max|x|/PLANE_MAX``, ``q = round(x/scale)``, planes ``p[2i] = hi``, ``p[2i + 1] = lo`` with ``q =
    256·hi + lo`` in the permuted K order (logical ``4a + j`` of each 32-block ← physical ``a + 8j``; with
    ``BITS``, the bit accumulators' order), ``sc[2i] = scale``, ``sc[2i + 1] = Σq``. ``PDL``: let the
    next kernel, if launched with programmatic dependent launch, start at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    if tl.load(key_ptr + i) >= NSLOT:
        return
    _row_planes(x_ptr, tl.load(order_ptr + i).to(tl.int64), i, p_ptr, sc_ptr, K, KP, stride_xm, BLOCK, BITS)


def sorted_planes(x: torch.Tensor, order: torch.Tensor, key: torch.Tensor, n_slots: int, bits: bool = False,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activation planes of x's rows in sorted order (``gluon_planes.activation_planes`` of
    ``x[order]``, without forming ``x[order]``).

    Args:
        x: ``[M, K]`` bf16/fp16, K a multiple of 32, unit stride along K.
        order, key: int32 ``[M]``, ``RowGroups.order`` and ``RowGroups.key``.
        n_slots: S; sorted rows with ``key ≥ S`` (base rows) are skipped.
        bits: the bit accumulators' order (module docstring): rows K rounded up to 256 wide,
            permuted within 256-blocks, zeros past K.
        pdl: let the next kernel, if launched with programmatic dependent launch (the sign products'
            ``pdl``), start at once; it must wait for this one before reading the planes.

    Returns:
        ``(planes, sc)``: int8 ``[2M, K]`` (K rounded up to 256 with ``bits``; rows ``2i``, ``2i + 1``: hi
        and lo bytes of x row ``order[i]``, K permuted within 32-blocks) and float32 ``[M, 2]`` (``scale``, ``Σq``), with
        ``x[order[i], k] ≈ scale_i·(256·hi + lo)`` to within ``scale_i/2``, ``scale_i = max|x|/PLANE_MAX``.
        Rows of base rows are left uninitialised.
    """
    m, k = x.shape
    kp = triton.cdiv(k, 256) * 256 if bits else k
    planes = torch.empty(2 * m, kp, dtype=torch.int8, device=x.device)
    sc = torch.empty(m, 2, dtype=torch.float32, device=x.device)
    if m:
        _sorted_planes_kernel[(m,)](x, order, key, planes, sc, k, kp, x.stride(0), n_slots,
                                    BLOCK=min(8192, triton.next_power_of_2(kp)), BITS=bits, PDL=pdl,
                                    num_warps=8)
    return planes, sc


def _descriptors(signs: torch.Tensor, planes: torch.Tensor, cfg: GroupedConfig):
    """TMA descriptors of the tiled signs (rows of 128 bytes, a box of ``BLOCK_K/128`` tiles of one
    feature tile) and of the planes (a box of the block's ``2·BLOCK_M`` rows × ``BLOCK_K``)."""
    unswizzled = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)  # read back as words
    s_desc = TensorDescriptor.from_tensor(signs.view(-1, 128), [8 * (cfg.block_k // TILE_K), 128], unswizzled)
    pl = gl.NVMMASharedLayout.get_default_for([2 * cfg.block_m, cfg.block_k], gl.int8)
    p_desc = TensorDescriptor.from_tensor(planes, [2 * cfg.block_m, cfg.block_k], pl)
    return s_desc, p_desc


def _check_config(cfg: GroupedConfig) -> None:
    if cfg.block_m not in (4, 8, 16, 32, 64):
        raise ValueError(f"block_m must be 4, 8, 16, 32 or 64, got {cfg.block_m}")
    if cfg.block_m < 8 and not cfg.sync_mma:
        raise ValueError(f"block_m {cfg.block_m} takes sync_mma (wgmma's smallest useful N is 16)")
    if cfg.block_k not in (128, 256):
        raise ValueError(f"block_k must be 128 or 256, got {cfg.block_k}")
    if cfg.block_n not in (64, 128, 256) or cfg.consumers not in (1, 2, 4) or (cfg.block_n // TILE_N) % cfg.consumers:
        raise ValueError(f"block_n = {cfg.block_n} (64, 128 or 256) must split into {cfg.consumers} consumer "
                         "warpgroups (1, 2 or 4) of whole 64-feature tiles")
    if cfg.stages < 2:
        raise ValueError(f"stages must be 2 or more, got {cfg.stages}")
    if cfg.bitacc and not (cfg.sync_mma and cfg.block_k == 256):
        raise ValueError("bitacc needs sync_mma and block_k 256")
    if cfg.prefetch and not (cfg.sync_mma and not cfg.bitacc):
        raise ValueError("prefetch needs sync_mma without bitacc")


def add_sign_products_planes(x: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor, groups, y: torch.Tensor,
                             block_m: int = 16, planes: tuple[torch.Tensor, torch.Tensor] | None = None,
                             pdl: bool = False, sibling: bool = False, **config) -> torch.Tensor:
    """``y[m] += α_t ⊙ (x[m]·S_tᵀ)`` for every row of a variant, in place, on the int8 tensor cores.

    Args:
        x: ``[M, K]`` bf16/fp16 (:func:`supported`: K a multiple of 128 up to :data:`MAX_K`, unit stride
            along K).
        signs: ``deltafleet.kernels.tile_signs`` of the ``[S, N, K/8]`` signs: uint8
            ``[S, ceil(N/64), K/128, 64, 16]``, contiguous, 16-byte aligned.
        alphas: float32 ``[S]`` (one per matrix) or ``[S, N]`` (per feature), contiguous rows.
        groups: ``triton_grouped.group_rows(slot, S, block_m)`` with **this** ``block_m`` (a smaller
            one is also correct; a larger one drops rows).
        y: ``[M, N]`` in x's dtype (or float32), unit stride along N, holding the base product; the
            sign term is added in float32 and the sum rounded once to y's dtype.
        block_m: rows per block, 4 or 8 (``mma.sync``), 16, 32 or 64 (wgmma); the product's N is twice that.
        planes: :func:`sorted_planes` of x for ``groups``' order and key (``bits=False``), when the
            caller has them (several launches over the same rows); computed here otherwise. Not
            taken by a ``bitacc`` configuration, which reads planes in its own order.
        config: fields of :class:`GroupedConfig` other than ``block_m`` (``block_n``, ``block_k``,
            ``stages``, ``consumers``, ``regs``, ``inflight``, ``sync_mma``, ``bitacc``, ``prefetch``)
            overriding ``default_config(block_m)`` (whose ``prefetch`` is dropped where the overrides
            rule it out); without any, :func:`choose_config` picks one by the grid size.
        pdl: launch with programmatic dependent launch: the programs start while the kernel before
            runs (it must let them: ``sorted_planes(pdl=True)``, or another such launch), read the
            row groups and copy their first sign tiles, then wait for it to end before reading the
            planes, the scales, α or y; they let the next such launch start too. So the signs and
            ``groups`` must be ready before the kernel before starts, as they are in a serving step.
        sibling: with ``pdl`` and ``planes``: the kernel before is another such launch over the same
            planes and groups (the matrix before, or the part before), which writes none of what this
            one reads. Its programs then neither copy ahead nor wait: they run while the last programs
            of the one before still do, and only program (0, 0) waits for it, at its end (module
            docstring, "Programmatic dependent launch"). Ignored where this call makes its own planes.

    Returns:
        ``y``. Trusts its inputs, as ``triton_grouped.add_sign_products`` does (check with
        :func:`supported`); no host synchronisation, so a CUDA graph can record it.

    Raises:
        ValueError: if ``block_m`` or a configuration field is not one the kernel takes.
    """
    m, k = x.shape
    n = y.shape[1]
    cfg = default_config(block_m)  # checks block_m
    if config:
        cfg = cfg._replace(**config)
        if "prefetch" not in config and (cfg.bitacc or not cfg.sync_mma):
            cfg = cfg._replace(prefetch=False)  # the default's prefetch only where the overrides leave it possible
    else:
        cfg = choose_config(n, groups.max_blocks, block_m, multiprocessors(x.device))
    _check_config(cfg)
    if m == 0:
        return y
    s = signs.shape[0]
    if planes is None or cfg.bitacc:  # planes of its own: the kernel just before writes them
        planes, sibling = sorted_planes(x, groups.order, groups.key, s, bits=cfg.bitacc, pdl=pdl), False
    planes, sc = planes
    s_desc, p_desc = _descriptors(signs, planes, cfg)
    grid = (groups.max_blocks, triton.cdiv(n, cfg.block_n))  # blocks fastest: see the module docstring
    _grouped_planes_kernel[grid](
        s_desc, p_desc, groups.order, groups.key, groups.first, sc, alphas, y,
        m, n, k, s, groups.max_blocks, alphas.stride(0), y.stride(0),
        ALPHA_PER_ROW=alphas.dim() == 2, NSUB=cfg.block_n // TILE_N, STAGES=cfg.stages, CONSUMERS=cfg.consumers,
        CONS_REGS=cfg.regs, INFLIGHT=cfg.inflight, SYNC_MMA=cfg.sync_mma, BITACC=cfg.bitacc, PREFETCH=cfg.prefetch,
        PDL=pdl, SIBLING=pdl and sibling, num_warps=4, maxnreg=cfg.regs, launch_pdl=pdl)
    return y


def compile_for_sm90(cfg: GroupedConfig, dtype: str = "bf16", alpha_per_row: bool = True, pdl: bool = False,
                     sibling: bool = False):
    """Compile the kernel for sm_90a ahead of time, without a GPU, for the compile test
    (tests/test_kernels_compile.py) and offline inspection of its PTX and SASS.

    Args:
        cfg: a :class:`GroupedConfig`. dtype: y's element type, ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        alpha_per_row: α per output feature (``[S, N]``) rather than one per matrix.
        pdl, sibling: the programmatic-dependent-launch forms (:func:`add_sign_products_planes`).

    Returns:
        Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    _check_config(cfg)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    pl = gl.NVMMASharedLayout.get_default_for([2 * cfg.block_m, cfg.block_k], gl.int8)
    sig = {"s_desc": f"tensordesc<u8[{8 * (cfg.block_k // TILE_K)}, 128],{sl!r}>",
           "p_desc": f"tensordesc<i8[{2 * cfg.block_m}, {cfg.block_k}],{pl!r}>",
           "order_ptr": "*i32", "key_ptr": "*i32", "first_ptr": "*i32", "sc_ptr": "*fp32", "a_ptr": "*fp32",
           "y_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "NSLOT": "i32", "NBLK": "i32",
           "stride_as": "i32", "stride_ym": "i32"}
    consts = dict(ALPHA_PER_ROW=alpha_per_row, NSUB=cfg.block_n // TILE_N, STAGES=cfg.stages,
                  CONSUMERS=cfg.consumers, CONS_REGS=cfg.regs, INFLIGHT=cfg.inflight, SYNC_MMA=cfg.sync_mma,
                  BITACC=cfg.bitacc, PREFETCH=cfg.prefetch, PDL=pdl, SIBLING=pdl and sibling, num_warps=4)
    sig.update({c: "constexpr" for c in consts})
    names = _grouped_planes_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("order_ptr", "key_ptr", "first_ptr", "sc_ptr", "a_ptr", "y_ptr", "N", "K", "stride_ym")}
    return triton.compile(GluonASTSource(fn=_grouped_planes_kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": cfg.regs})


# ---------------------------------------------------------------------------------------------
# The kernel: a loader warp issues the TMA copies; consumer warpgroups own 64-feature sign tiles.

if HAVE_GLUON:
    @gluon.jit
    def _gdc_launch_dependents():
        """``griddepcontrol.launch_dependents``: the next kernel, if launched with programmatic dependent
        launch, may start once every program of this one has run this (or ended)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _gp_load(p, NSUB: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
        """The loader warp: per K step, wait until the consumers have freed the stage, then copy the
        NSUB sign boxes (feature tiles ``f0 … f0 + NSUB − 1`` of the block's variant) and the block's
        planes box into it. ``PDL``: the first ``STAGES`` steps' sign boxes are copied before waiting for
        the kernel before (which writes the planes), their planes boxes after."""
        (s_desc, p_desc, s_smem, p_smem, ready, empty, first, slot, off_n, M, N, K, NSLOT) = p
        BK: gl.constexpr = p_desc.block_type.shape[1]
        R: gl.constexpr = s_desc.block_type.shape[0]  # 128-byte rows of one box: 8 per 128-weight tile
        nbytes: gl.constexpr = NSUB * s_desc.block_type.nbytes + p_desc.block_type.nbytes
        NT = gl.cdiv(N, 64)
        KT = K // 128
        # first 128-byte row of (slot, feature tile off_n/64, K tile 0); tiles past NT belong to the
        # next slot or lie past the tensor (zeros): their features are ≥ N and never stored
        srow = (slot * NT + off_n // 64) * KT * 8
        nk = gl.cdiv(K, BK)
        start = 0
        if PDL:  # the ring is empty: fill it with sign tiles, which no kernel before writes
            for ki in gl.static_range(STAGES):
                if ki < nk:
                    _gp_load_signs(s_desc, s_smem, ready.index(ki), nbytes, srow + ki * R, KT * 8, ki, NSUB)
            _gdc_wait()
            for ki in gl.static_range(STAGES):
                if ki < nk:
                    _tma_load(p_desc, [2 * first, ki * BK], ready.index(ki), p_smem.index(ki))
            start = STAGES
        for ki in range(start, nk):
            stage = ki % STAGES
            mbarrier.wait(empty.index(stage), ((ki // STAGES) & 1) ^ 1)  # the consumers are done with it
            _gp_load_signs(s_desc, s_smem, ready.index(stage), nbytes, srow + ki * R, KT * 8, stage, NSUB)
            _tma_load(p_desc, [2 * first, ki * BK], ready.index(stage), p_smem.index(stage))

    @gluon.jit
    def _gp_load_signs(s_desc, s_smem, bar, nbytes: gl.constexpr, row, tile_rows, stage, NSUB: gl.constexpr):
        """Expect ``nbytes`` (the stage's sign and planes boxes) on ``bar`` and copy the NSUB sign boxes
        of one K step into ``stage``: box j from 128-byte row ``row + j·tile_rows``."""
        mbarrier.expect(bar, nbytes)
        for j in gl.static_range(NSUB):
            _tma_load(s_desc, [row + j * tile_rows, 0], bar, s_smem.index(stage * NSUB + j))

    @gluon.jit
    def _int_accumulators(NW: gl.constexpr, BM2: gl.constexpr, acc_l: gl.constexpr):
        """NW zero int32 accumulators ``[64, BM2]`` (one per feature tile) in layout ``acc_l``."""
        acc = ()
        for t in gl.static_range(NW):
            acc = acc + (gl.zeros([64, BM2], gl.int32, acc_l), )
        return acc

    @gluon.jit
    def _sign_operand(tile, c: gl.constexpr, KS: gl.constexpr, dot_a: gl.constexpr):
        """K chunk c (32 weights) of a staged sign tile as the A operand: ``−128·s'`` int8 in ``dot_a``.
        Chunk c is word ``c % 4`` of the 64 feature rows of 128-weight tile ``c // 4``; byte j of the
        register of column group q is bit ``q + 8j`` of the word, ``(word · 2^(7−q)) & 0x80808080``
        (module docstring)."""
        word_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        kq = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, dot_a)) // 4, 0)  # [1, 32]: q of 4q + j
        words = _as_words(tile, 64 * KS, 4, word_l)                                      # [64·KS, 4] int32
        wc = words.slice(64 * (c // 4), 64, dim=0).slice(c % 4, 1, dim=1).load(dot_a)    # [64, 1]
        # bit q of each byte to the byte's bit 7 by a multiply (the FMA pipe) and an AND (the integer
        # pipe), rather than a shift and an AND both on the integer pipe: bytes 0 or −128
        return gl.inline_asm_elementwise("{ .reg .b32 t; mul.lo.u32 t, $1, $5; and.b32 $0, t, 0x80808080; }",
                                         "=r,r,r,r,r,r,r,r,r", [wc, 128 >> kq], dtype=gl.int8, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _gp_consume(p, q, NSUB: gl.constexpr, STAGES: gl.constexpr, T0: gl.constexpr, NW: gl.constexpr,
                    ALPHA_PER_ROW: gl.constexpr, INFLIGHT: gl.constexpr):
        """Feature tiles ``T0 … T0 + NW − 1`` of the program's NSUB, as one warpgroup: the K loop of
        int8 wgmmas (A: the tile's sign bits as bytes 0 or −128 in registers, B: the block's planes), then
        the epilogue into y."""
        (s_desc, p_desc, s_smem, p_smem, ready, empty, first, slot, off_n, M, N, K, NSLOT) = p
        BK: gl.constexpr = p_desc.block_type.shape[1]
        BM2: gl.constexpr = p_desc.block_type.shape[0]  # 2·BLOCK_M plane rows: the wgmma's N
        BM: gl.constexpr = BM2 // 2
        KS: gl.constexpr = BK // 128                      # 128-weight sign tiles per K step
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BM2, 32])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)

        acc = _int_accumulators(NW, BM2, acc_l)
        for ki in range(gl.cdiv(K, BK)):
            stage = ki % STAGES
            mbarrier.wait(ready.index(stage), (ki // STAGES) & 1)
            pbuf = p_smem.index(stage)
            new = ()
            for t in gl.static_range(NW):
                a_t = acc[t]
                for c in gl.static_range(BK // 32):
                    a = _sign_operand(s_smem.index(stage * NSUB + T0 + t), c, KS, dot_a)
                    b = pbuf.slice(32 * c, 32, dim=1).permute((1, 0))                               # [32, 2·BM]
                    a_t = warpgroup_mma(a, b, a_t, is_async=True)
                if INFLIGHT > 0:
                    a_t = warpgroup_mma_wait(num_outstanding=INFLIGHT, deps=(a_t, ))
                new = new + (a_t, )
            done = warpgroup_mma_wait(num_outstanding=0, deps=new)
            if NW == 1:  # one dependency comes back as a tensor, not a tuple
                acc = (done, )
            else:
                acc = done
            mbarrier.arrive(empty.index(stage), count=1)

        _gp_epilogue(acc, first, slot, off_n, M, N, q, BM, T0, NW, ALPHA_PER_ROW, True)

    @gluon.jit
    def _gp_epilogue(acc, first, slot, off_n, M, N, q, BM: gl.constexpr, T0: gl.constexpr, NW: gl.constexpr,
                     ALPHA_PER_ROW: gl.constexpr, NEG128: gl.constexpr):
        """Add ``α·(s·x)`` of the consumer's NW feature tiles (int32 accumulators ``[64, 2·BM]`` of
        ``s'·plane``, or of ``−128·s'·plane`` with ``NEG128``) into y."""
        _gp_epilogue_add(acc, _gp_epilogue_loads(acc, first, slot, off_n, M, N, q, BM, T0, NW, ALPHA_PER_ROW),
                         q, BM, NW, NEG128)

    @gluon.jit
    def _gp_epilogue_loads(acc, first, slot, off_n, M, N, q, BM: gl.constexpr, T0: gl.constexpr, NW: gl.constexpr,
                           ALPHA_PER_ROW: gl.constexpr):
        """What the epilogue reads besides the accumulators, in their layout (``acc`` gives it; its
        values are not read): the live rows' scales and sums, and per feature tile α, y's base values,
        their pointers and mask. Nothing here depends on the K loop, so ``prefetch`` loads it before."""
        (order_ptr, key_ptr, first_ptr, sc_ptr, a_ptr, y_ptr, NBLK, stride_as, stride_ym) = q
        # in the accumulator's own layout (no shared-memory scratch, no layout conversion): (hi, lo) of
        # row i are the accumulator's columns (2i, 2i + 1), which one thread holds
        h0, _ = gl.split(gl.reshape(acc[0], [64, BM, 2]))
        out_l: gl.constexpr = h0.type.layout                  # [64 features, BM rows]
        i = gl.arange(0, BM, layout=gl.SliceLayout(0, out_l))
        srow = first + i                                      # the box's sorted rows
        nxt = gl.load(first_ptr + gl.program_id(0) + 1, mask=gl.program_id(0) + 1 < NBLK, other=M)
        live = (srow < nxt) & (srow < M)                      # this block's rows ...
        live = live & (gl.load(key_ptr + srow, mask=live, other=-1) == slot)  # ... of its variant
        orow = gl.load(order_ptr + srow, mask=live, other=0).to(gl.int64)
        scale = gl.expand_dims(gl.load(sc_ptr + 2 * srow, mask=live, other=0.0), 0)      # [1, BM]
        qsum = gl.expand_dims(gl.load(sc_ptr + 2 * srow + 1, mask=live, other=0.0), 0)
        live2 = gl.expand_dims(live, 0)
        yrow = gl.expand_dims(orow * stride_ym, 0)
        alphas = ()
        bases = ()
        ptrs = ()
        masks = ()
        for t in gl.static_range(NW):
            feat = off_n + (T0 + t) * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
            fmask = feat < N
            if ALPHA_PER_ROW:
                alpha = gl.load(a_ptr + slot * stride_as + feat, mask=fmask, other=0.0)
            else:
                alpha = gl.load(a_ptr + slot * stride_as + feat * 0, mask=fmask, other=0.0)
            m2 = gl.expand_dims(fmask, 1) & live2
            ptr = y_ptr + yrow + gl.expand_dims(feat, 1)
            alphas = alphas + (gl.expand_dims(alpha, 1), )
            bases = bases + (gl.load(ptr, mask=m2, other=0.0).to(gl.float32), )
            ptrs = ptrs + (ptr, )
            masks = masks + (m2, )
        return scale, qsum, alphas, bases, ptrs, masks

    @gluon.jit
    def _gp_epilogue_add(acc, pre, q, BM: gl.constexpr, NW: gl.constexpr, NEG128: gl.constexpr):
        """y = base + α·(s·x), rounded once to y's dtype, for the live rows of the NW feature tiles;
        ``pre``: :func:`_gp_epilogue_loads`."""
        (order_ptr, key_ptr, first_ptr, sc_ptr, a_ptr, y_ptr, NBLK, stride_as, stride_ym) = q
        scale, qsum, alphas, bases, ptrs, masks = pre
        for t in gl.static_range(NW):
            hi, lo = gl.split(gl.reshape(acc[t], [64, BM, 2]))
            if NEG128:
                hi = -(hi >> 7)  # sums of −128·s'·plane: exact multiples of −128
                lo = -(lo >> 7)
            # s·x = 2·(s'·x) − Σx with x = scale·(256·hi + lo)
            sdot = scale * (512.0 * hi.to(gl.float32) + 2.0 * lo.to(gl.float32) - qsum)
            gl.store(ptrs[t], (bases[t] + alphas[t] * sdot).to(y_ptr.dtype.element_ty), mask=masks[t])

    @gluon.jit
    def _gp_consume_mma(p, q, NSUB: gl.constexpr, STAGES: gl.constexpr, T0: gl.constexpr, NW: gl.constexpr,
                        ALPHA_PER_ROW: gl.constexpr, PREFETCH: gl.constexpr):
        """As :func:`_gp_consume`, by ``mma.sync`` (m16n8k32, int8) instead of wgmma (``sync_mma``).
        Each warp of the warpgroup owns 16 of a tile's 64 features and expands its own sign words into
        its A registers; a K chunk's planes are loaded into B registers once and shared by the NW
        tiles. Nothing waits on an asynchronous product, so one warp's expansion overlaps another's
        products: at ``block_m`` 8 (n = 16 plane rows) this beats the wgmma path, whose smallest
        useful N leaves the tensor cores idle while the signs are expanded."""
        (s_desc, p_desc, s_smem, p_smem, ready, empty, first, slot, off_n, M, N, K, NSLOT) = p
        BK: gl.constexpr = p_desc.block_type.shape[1]
        BM2: gl.constexpr = p_desc.block_type.shape[0]
        BM: gl.constexpr = BM2 // 2
        KS: gl.constexpr = BK // 128
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_l, k_width=4)

        acc = _int_accumulators(NW, BM2, acc_l)
        if PREFETCH:  # the epilogue's loads in flight during the K loop
            pre = _gp_epilogue_loads(acc, first, slot, off_n, M, N, q, BM, T0, NW, ALPHA_PER_ROW)
        for ki in range(gl.cdiv(K, BK)):
            stage = ki % STAGES
            mbarrier.wait(ready.index(stage), (ki // STAGES) & 1)
            pbuf = p_smem.index(stage)
            for c in gl.static_range(BK // 32):
                b = pbuf.slice(32 * c, 32, dim=1).permute((1, 0)).load(dot_b)                   # [32, 2·BM]
                new = ()
                for t in gl.static_range(NW):
                    a = _sign_operand(s_smem.index(stage * NSUB + T0 + t), c, KS, dot_a)
                    new = new + (mma_v2(a, b, acc[t]), )
                acc = new
            mbarrier.arrive(empty.index(stage), count=1)

        if PREFETCH:
            _gp_epilogue_add(acc, pre, q, BM, NW, True)
        else:
            _gp_epilogue(acc, first, slot, off_n, M, N, q, BM, T0, NW, ALPHA_PER_ROW, True)

    # the sign bytes of one K step (two 128-weight tiles of 64 rows × 16 bytes) as ``[64, 32]``: row r,
    # column 16·u + b is byte b of row r of tile u (the mma's A fragment then holds, per thread and row,
    # word t of tile 0 and word t of tile 1)
    _STEP_BYTES = gl.constexpr(gl.SharedLinearLayout(
        offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0], [4, 0], [8, 0], [16, 0], [32, 0], [0, 16]]))

    @gluon.jit
    def _as_step_bytes(buf):
        return _as_view(buf, gl.int8, 64, 32, _STEP_BYTES)

    @gluon.jit
    def _and(w, MASK: gl.constexpr):
        """``w & MASK`` on each packed register of four int8 (``MASK`` spelt as a PTX literal)."""
        return gl.inline_asm_elementwise("and.b32 $0, $1, " + MASK + ";", "=r,r", [w], dtype=gl.int8, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _bits_chunk(words, pbuf, C: gl.constexpr, MASK: gl.constexpr, acc, NW: gl.constexpr, dot_b: gl.constexpr):
        """Chunk C of a K step: bit C of every sign byte of the NW tiles (``& MASK``, ``MASK`` = 2^C in
        each byte: bytes 0 or 2^C, −128 for C = 7) by the planes' columns ``32C …``, into the tiles'
        accumulators of bit C."""
        b = pbuf.slice(32 * C, 32, dim=1).permute((1, 0)).load(dot_b)                       # [32, 2·BM]
        new = ()
        for t in gl.static_range(NW):
            new = new + (mma_v2(_and(words[t], MASK), b, acc[t]), )
        return new

    @gluon.jit
    def _bits_total(a0, a1, a2, a3, a4, a5, a6, a7, t: gl.constexpr):
        """``s'·plane`` of tile t from its eight bit accumulators (bit c's sums are multiples of 2^c; bit
        7's bytes were −128)."""
        return (a0[t] + (a1[t] >> 1) + (a2[t] >> 2) + (a3[t] >> 3) + (a4[t] >> 4) + (a5[t] >> 5) + (a6[t] >> 6)
                - (a7[t] >> 7))

    @gluon.jit
    def _gp_consume_bits(p, q, NSUB: gl.constexpr, STAGES: gl.constexpr, T0: gl.constexpr, NW: gl.constexpr,
                         ALPHA_PER_ROW: gl.constexpr):
        """As :func:`_gp_consume_mma` with one accumulator per sign bit position (``bitacc``): the K step's
        sign bytes are loaded into A registers once, and chunk c of the step multiplies bit c of all of
        them (``byte & 2^c``, one AND per four weights) by planes columns ``32c …``, which
        :func:`sorted_planes` wrote in that order; the eight sums are combined once, after the loop."""
        (s_desc, p_desc, s_smem, p_smem, ready, empty, first, slot, off_n, M, N, K, NSLOT) = p
        BK: gl.constexpr = p_desc.block_type.shape[1]
        gl.static_assert(BK == 256, "bit accumulators take 256-weight K steps")
        BM2: gl.constexpr = p_desc.block_type.shape[0]
        BM: gl.constexpr = BM2 // 2
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_l, k_width=4)

        a0 = _int_accumulators(NW, BM2, acc_l)
        a1 = _int_accumulators(NW, BM2, acc_l)
        a2 = _int_accumulators(NW, BM2, acc_l)
        a3 = _int_accumulators(NW, BM2, acc_l)
        a4 = _int_accumulators(NW, BM2, acc_l)
        a5 = _int_accumulators(NW, BM2, acc_l)
        a6 = _int_accumulators(NW, BM2, acc_l)
        a7 = _int_accumulators(NW, BM2, acc_l)
        for ki in range(gl.cdiv(K, BK)):
            stage = ki % STAGES
            mbarrier.wait(ready.index(stage), (ki // STAGES) & 1)
            pbuf = p_smem.index(stage)
            words = ()
            for t in gl.static_range(NW):
                words = words + (_as_step_bytes(s_smem.index(stage * NSUB + T0 + t)).load(dot_a), )
            a0 = _bits_chunk(words, pbuf, 0, "0x01010101", a0, NW, dot_b)
            a1 = _bits_chunk(words, pbuf, 1, "0x02020202", a1, NW, dot_b)
            a2 = _bits_chunk(words, pbuf, 2, "0x04040404", a2, NW, dot_b)
            a3 = _bits_chunk(words, pbuf, 3, "0x08080808", a3, NW, dot_b)
            a4 = _bits_chunk(words, pbuf, 4, "0x10101010", a4, NW, dot_b)
            a5 = _bits_chunk(words, pbuf, 5, "0x20202020", a5, NW, dot_b)
            a6 = _bits_chunk(words, pbuf, 6, "0x40404040", a6, NW, dot_b)
            a7 = _bits_chunk(words, pbuf, 7, "0x80808080", a7, NW, dot_b)
            mbarrier.arrive(empty.index(stage), count=1)

        acc = ()
        for t in gl.static_range(NW):
            acc = acc + (_bits_total(a0, a1, a2, a3, a4, a5, a6, a7, t), )
        _gp_epilogue(acc, first, slot, off_n, M, N, q, BM, T0, NW, ALPHA_PER_ROW, False)

    @gluon.jit
    def _gp_worker(p, q, NSUB: gl.constexpr, STAGES: gl.constexpr, T0: gl.constexpr, NW: gl.constexpr,
                   ALPHA_PER_ROW: gl.constexpr, INFLIGHT: gl.constexpr, LOADER: gl.constexpr, SYNC_MMA: gl.constexpr,
                   BITACC: gl.constexpr, PREFETCH: gl.constexpr, PDL: gl.constexpr, SIBLING: gl.constexpr):
        """A worker partition: the loader warp, or a consumer warpgroup of tiles ``T0 …``. With ``PDL`` a
        consumer first waits for the kernel before (the planes, their scales and sums, y's base values),
        then lets the next launch start; with ``SIBLING`` neither waits (module docstring)."""
        if LOADER:
            _gp_load(p, NSUB, STAGES, PDL and not SIBLING)
        else:
            if PDL and not SIBLING:
                _gdc_wait()
                _gdc_launch_dependents()  # every program of a sibling launched next has passed this wait
            if BITACC:
                _gp_consume_bits(p, q, NSUB, STAGES, T0, NW, ALPHA_PER_ROW)
            elif SYNC_MMA:
                _gp_consume_mma(p, q, NSUB, STAGES, T0, NW, ALPHA_PER_ROW, PREFETCH)
            else:
                _gp_consume(p, q, NSUB, STAGES, T0, NW, ALPHA_PER_ROW, INFLIGHT)

    # M, S and the block count vary with every serving step: no recompile when one of them is 1 or a
    # multiple of 16
    @gluon.jit(do_not_specialize=["M", "NSLOT", "NBLK"])
    def _grouped_planes_kernel(s_desc, p_desc, order_ptr, key_ptr, first_ptr, sc_ptr, a_ptr, y_ptr,
                               M, N, K, NSLOT, NBLK, stride_as, stride_ym,
                               ALPHA_PER_ROW: gl.constexpr, NSUB: gl.constexpr, STAGES: gl.constexpr,
                               CONSUMERS: gl.constexpr, CONS_REGS: gl.constexpr, INFLIGHT: gl.constexpr,
                               SYNC_MMA: gl.constexpr, BITACC: gl.constexpr, PREFETCH: gl.constexpr,
                               PDL: gl.constexpr, SIBLING: gl.constexpr, num_warps: gl.constexpr):
        """Program ``(b, f)``: features ``f·64·NSUB …`` of block b's rows (module docstring)."""
        if PDL and SIBLING:  # the next launch may start at once (else once this program has waited)
            _gdc_launch_dependents()
        first = gl.load(first_ptr + gl.program_id(0))
        if first < M:  # programs past the last block do nothing
            slot = gl.load(key_ptr + first)
            off_n = gl.program_id(1) * (64 * NSUB)
            BK: gl.constexpr = p_desc.block_type.shape[1]
            s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NSUB, s_desc.block_type.shape[0],
                                                          s_desc.block_type.shape[1]], s_desc.layout)
            p_smem = gl.allocate_shared_memory(gl.int8, [STAGES, p_desc.block_type.shape[0], BK], p_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
                mbarrier.init(empty.index(s), count=CONSUMERS)
            p = (s_desc, p_desc, s_smem, p_smem, ready, empty, first, slot, off_n, M, N, K, NSLOT)
            q = (order_ptr, key_ptr, first_ptr, sc_ptr, a_ptr, y_ptr, NBLK, stride_as, stride_ym)
            NW: gl.constexpr = NSUB // CONSUMERS
            A: gl.constexpr = ALPHA_PER_ROW
            I: gl.constexpr = INFLIGHT
            # consumer 0 is the default partition; the other consumers and the loader warp are workers
            # (a partition list is a literal: Gluon tuples cannot hold functions)
            SM: gl.constexpr = SYNC_MMA
            BA: gl.constexpr = BITACC
            PF: gl.constexpr = PREFETCH
            SB: gl.constexpr = SIBLING
            if CONSUMERS == 1:
                gl.warp_specialize([
                    (_gp_worker, (p, q, NSUB, STAGES, 0, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, 0, NW, A, I, True, SM, BA, PF, PDL, SB)),
                ], [1], [24])
            elif CONSUMERS == 2:
                gl.warp_specialize([
                    (_gp_worker, (p, q, NSUB, STAGES, 0, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, NW, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, 0, NW, A, I, True, SM, BA, PF, PDL, SB)),
                ], [4, 1], [CONS_REGS, 24])
            elif CONSUMERS == 4:
                gl.warp_specialize([
                    (_gp_worker, (p, q, NSUB, STAGES, 0, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, NW, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, 2 * NW, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, 3 * NW, NW, A, I, False, SM, BA, PF, PDL, SB)),
                    (_gp_worker, (p, q, NSUB, STAGES, 0, NW, A, I, True, SM, BA, PF, PDL, SB)),
                ], [4, 4, 4, 1], [CONS_REGS, CONS_REGS, CONS_REGS, 24])
            else:
                gl.static_assert(False, "1, 2 or 4 consumer warpgroups")
            if PDL and SIBLING:
                if gl.program_id(0) == 0 and gl.program_id(1) == 0:
                    _gdc_wait()  # a sibling launch too ends only after the one before (module docstring)
        elif PDL and gl.program_id(0) == 0 and gl.program_id(1) == 0:
            # a launch without any block still ends only after the kernel before, since the next launch
            # waits for this one: program (0, 0) waits (it is live if any program is; the others exit)
            _gdc_wait()

