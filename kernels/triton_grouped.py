"""Grouped mixed-variant linear: the base product of every row once, by cuBLAS (decode batches on
Hopper: ``triton_base``, beside the sign products), and each variant's sign product over its own rows,
its signs read once per group of up to ``BLOCK_M`` rows.

``y[m] = x[m] · Wᵀ + α_t ⊙ (x[m] · S_tᵀ)`` with ``t = slot[m]`` (−1: the base only) and
``S_t = 2·bits_t − 1``. A decode batch of a serving engine holds M rows over T distinct variants
in any order and any group sizes. Reading ``W + α_t·S_t`` per row (the per-tenant kernels of
``deltafleet.kernels.triton_bitdelta``) pays for each variant's signs once per row, or once per tile of rows
that mixes variants; here the rows are grouped by variant first, so the bytes read are W once
(``torch.addmm``, at the bandwidth of the vendor's GEMM) plus each present variant's signs once
per group of ``BLOCK_M`` rows: ``1 + T/16`` of a dense read for groups of up to ``BLOCK_M`` rows.

Two parts:

* :func:`group_rows` (torch ops on the device, no host synchronisation, so a CUDA graph records it):
  the rows sorted by variant (stable), and the first sorted row of each block of at most
  ``BLOCK_M`` rows of one variant. Its result depends on the slots only, so an engine step computes
  it once and every layer reuses it (``serve/batch.py``).
* ``_grouped_kernel``: program ``(n tile, block)`` computes ``yᵀ`` for its block's rows of x
  (gathered through the sort order). It walks K in steps of ``BLOCK_K`` weights, each taken as 8
  bit planes of ``BLOCK_K / 8`` sign bytes: plane j, unpacked to ±1, is the left operand of a
  tensor-core product (``tl.dot``, float32 accumulation) with the x columns ``8b + j``, so no
  unpacked tile is reshaped. It then scales by ``α_t`` and adds the product into those rows of
  ``y``, which already hold the base product. The grid has a fixed size (an upper bound on the
  number of blocks); programs past the last block return at once.

Rounding: the base product is rounded to ``x.dtype`` by the GEMM, the sum once more; the
reconstructed weight ``W + α·S`` is never formed.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltafleet.kernels.reference import (check_batched_args, check_stacked, check_tensors,
                                          check_weight_and_bias)
from deltafleet.kernels import triton_base
from deltafleet.kernels.triton_bitdelta import _interpret

BLOCK_M = 16  # rows of one variant per program (the tensor cores' smallest M)
# On Hopper, a batch of more than SHORT_MAX_ROWS rows cuts each variant's run into whole blocks of
# LONG_M rows first (grouped_long_m: wgmma blocks, a prompt chunk's sign tiles expanded once per 64
# rows); the rest goes in blocks of 4 (mma.sync n8) up to BLOCK4_MAX_ROWS rows, where most
# variants hold one or two rows, of 8 (mma.sync n16) up to BLOCK8_MAX_ROWS, of 16 beyond, where a
# decode batch's runs are longer (grouped_block_m; docs/kernels.md, "Grouped mixed batches")
SHORT_MAX_ROWS = 64
BLOCK4_MAX_ROWS = 32
BLOCK8_MAX_ROWS = 128
LONG_M = 64


OVERLAP_ROWS_LIMIT = 256  # the engine's largest decode batch; each row keeps 4·n bytes per width


def _overlap_rows(value: str) -> int:
    """``DELTAFLEET_GROUPED_OVERLAP``: a row count from 0 to :data:`OVERLAP_ROWS_LIMIT`."""
    if not value.strip().isdigit() or int(value) > OVERLAP_ROWS_LIMIT:
        raise ValueError(f"DELTAFLEET_GROUPED_OVERLAP must be a row count up to {OVERLAP_ROWS_LIMIT} (0 turns "
                         f"the two-stream grouped product off), got {value!r}")
    return int(value)


# Decode batches of up to OVERLAP_MAX_ROWS rows on Hopper compute the base product by
# triton_base.base_mm beside the sign products, on two streams (_base_beside_signs);
# DELTAFLEET_GROUPED_OVERLAP sets it (0 turns it off)
OVERLAP_MAX_ROWS = _overlap_rows(os.environ.get("DELTAFLEET_GROUPED_OVERLAP", "64"))


@dataclass
class RowGroups:
    """Rows of a batch grouped by variant (:func:`group_rows`).

    Attributes:
        order: int32 ``[M]``, the rows sorted by slot (stable; base rows and slots outside
            ``[0, S)`` last).
        key: int32 ``[M]``, the sorted rows' slots (``S`` for the base rows).
        first: int32 ``[max_blocks]``, the first sorted row of each block (``M`` past the last).
        block_m: rows a block holds at most (the kernels multiply blocks of this many rows).
        long: with ``group_rows(…, long_m=L)``, the whole blocks of ``L`` rows that lead each
            variant's run, as groups of their own (same ``order`` and ``key``, ``block_m = L``); then
            ``first`` holds only the blocks of the rest of each run (fewer than ``L`` rows). None
            otherwise.
    """

    order: torch.Tensor
    key: torch.Tensor
    first: torch.Tensor
    block_m: int = BLOCK_M
    long: RowGroups | None = None

    @property
    def max_blocks(self) -> int:
        return self.first.shape[0]

    def parts(self) -> list[RowGroups]:
        """The groupings a kernel launch each: the long blocks (if any), then the others."""
        return ([self.long] if self.long is not None else []) + [self]


def max_blocks(m: int, n_slots: int, block_m: int = BLOCK_M, long_m: int | None = None) -> int:
    """An upper bound on the blocks of :func:`group_rows` (``RowGroups.first``): each variant's rows
    make ``ceil(m_t / block_m) ≤ m_t / block_m + 1`` blocks; with ``long_m``, only a run's rest of fewer
    than ``long_m`` rows is cut so, at most ``ceil((long_m − 1) / block_m)`` blocks per variant."""
    nb = max(1, min(m, triton.cdiv(m, block_m) + n_slots))
    if long_m and long_m <= m:  # as group_rows: no long blocks in fewer rows than one
        nb = min(nb, max(1, n_slots * triton.cdiv(long_m - 1, block_m)))
    return nb


def _hopper(device: torch.device | str) -> bool:
    """Whether ``gluon_grouped`` runs on ``device``: a Hopper GPU with Gluon, not the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or _interpret():
        return False
    from deltafleet.kernels.gluon_bitdelta import HAVE_GLUON

    return HAVE_GLUON and torch.cuda.get_device_capability(device)[0] == 9


def grouped_block_m(m: int, device: torch.device | str, prefill: bool = False) -> int:
    """The ``block_m`` to group an M-row batch on ``device`` with. On a Hopper GPU with Gluon
    (``gluon_grouped``'s ``mma.sync`` configurations, which waste fewer tensor-core rows on a
    variant's short run; a run's long stretch goes in blocks of :func:`grouped_long_m` rows): 4 for a
    decode batch of up to :data:`BLOCK4_MAX_ROWS` rows (one or two per variant: half the products of
    blocks of 8), 8 up to :data:`BLOCK8_MAX_ROWS` rows, or at any M for a step with prompt chunks
    (``prefill``: what is left after the long blocks is decode rows and a prompt's rest of up to 63
    rows); else :data:`BLOCK_M`. Host-side, from M and the device only, so a CUDA graph's grouping is
    fixed at capture."""
    if not _hopper(device):
        return BLOCK_M
    if prefill:
        return 8
    return 4 if m <= BLOCK4_MAX_ROWS else 8 if m <= BLOCK8_MAX_ROWS else BLOCK_M


# Time of one block of a decode batch's grouped rows relative to a block of 4, by block size, on an
# H200 (the sweeps of docs/kernels.md, "Block size from the batch"): what decode_block_m weighs by.
BLOCK_COST = {4: 1.0, 8: 1.21, 16: 1.84, 32: 2.94}


def decode_block_m(slots: list[int], n_slots: int, device: torch.device | str, rows: int | None = None) -> int:
    """The ``block_m`` for a decode batch whose variant slots the host knows (``slots``, one per row;
    outside ``[0, n_slots)``: the base) and that runs as ``rows`` rows (its padded size; default
    ``len(slots)``). On a Hopper GPU with Gluon, the size of :data:`BLOCK_COST` whose blocks cost the
    least: ``Σ ceil(r_t / b) · BLOCK_COST[b]`` over the variants present, ``r_t`` a variant's rows
    past its whole blocks of :func:`grouped_long_m` rows (which go first), ties to the smaller. A
    short block expands a variant's sign tiles once per few rows, a long one multiplies padding rows;
    the row count alone cannot tell them apart (docs/kernels.md). Elsewhere, and for a batch without
    variant rows, :func:`grouped_block_m` of ``rows``."""
    rows = len(slots) if rows is None else rows
    counts: dict[int, int] = {}
    for v in slots:
        if 0 <= v < n_slots:
            counts[v] = counts.get(v, 0) + 1
    if not counts or not _hopper(device):
        return grouped_block_m(rows, device)
    long_m = grouped_long_m(rows, device)
    rest = [r % long_m if long_m else r for r in counts.values()]
    return min(BLOCK_COST, key=lambda b: (sum(-(-r // b) for r in rest) * BLOCK_COST[b], b))


def grouped_long_m(m: int, device: torch.device | str) -> int | None:
    """The ``long_m`` to group an M-row batch on ``device`` with (:func:`group_rows`): :data:`LONG_M`
    on a Hopper GPU with Gluon when M exceeds :data:`SHORT_MAX_ROWS` (a prompt chunk, or a popular
    variant's decode rows, may then hold whole long blocks), else None."""
    return LONG_M if m > SHORT_MAX_ROWS and _hopper(device) else None


def _firsts(starts: torch.Tensor, idx: torch.Tensor, m: int, nb: int) -> torch.Tensor:
    """int32 ``[nb]``: the sorted rows where ``starts`` is set, in order, then ``m``."""
    block = torch.where(starts, torch.cumsum(starts, 0) - 1, nb)  # non-starts go to a sink entry
    first = torch.full((nb + 1,), m, dtype=torch.int32, device=idx.device)
    first.scatter_(0, block, idx.to(torch.int32))
    return first[:nb]


def group_rows(slot: torch.Tensor, n_slots: int, block_m: int | None = None, long_m: int | None = None) -> RowGroups:
    """Group the rows of a batch by variant: ``slot`` int ``[M]`` (−1 or anything outside ``[0,
    n_slots)``: the base), in blocks of ``block_m`` rows (None: :func:`grouped_block_m` of M and
    slot's device, and then ``long_m`` :func:`grouped_long_m`'s). Device ops only, of shapes fixed by
    ``M``, ``n_slots``, ``block_m`` and ``long_m``.

    ``long_m`` (a multiple of ``block_m``, 16 or more: the Triton kernel's smallest tile): each
    variant's run is cut into whole blocks of ``long_m`` rows first (:attr:`RowGroups.long`), and only
    its rest into blocks of ``block_m``, so a long run (a prompt chunk) is multiplied in large blocks,
    which expand each sign tile once per ``long_m`` rows, while the short runs of a decode batch keep
    small blocks."""
    m, dev = slot.shape[0], slot.device
    if block_m is None:
        block_m = grouped_block_m(m, dev)
        long_m = grouped_long_m(m, dev) if long_m is None else long_m
    if long_m is not None and (long_m % block_m or long_m < BLOCK_M):
        raise ValueError(f"long_m must be a multiple of block_m ({block_m}) and at least {BLOCK_M}, got {long_m}")
    slot = slot.to(torch.int64)
    key = torch.where((slot >= 0) & (slot < n_slots), slot, n_slots)
    key, order = torch.sort(key, stable=True)
    idx = torch.arange(m, device=dev)
    new_group = torch.ones(m, dtype=torch.bool, device=dev)
    new_group[1:] = key[1:] != key[:-1]
    pos = idx - torch.cummax(torch.where(new_group, idx, 0), 0).values  # the row's place in its run
    variant = key < n_slots
    order32, key32 = order.to(torch.int32), key.to(torch.int32)
    long = None
    if long_m and long_m <= m:
        runs = torch.zeros(n_slots + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
        whole = runs[key] // long_m * long_m  # the rows of the run in whole long blocks
        in_long = pos < whole
        long = RowGroups(order32, key32, _firsts(in_long & (pos % long_m == 0) & variant, idx, m, m // long_m),
                         long_m)
        pos = torch.where(in_long, -1, pos - whole)  # -1: no short block starts there
    starts = (pos % block_m == 0) & (pos >= 0) & variant
    return RowGroups(order32, key32, _firsts(starts, idx, m, max_blocks(m, n_slots, block_m, long_m)), block_m, long)


@triton.jit
def _grouped_kernel(
    x_ptr, s_ptr, a_ptr, y_ptr, order_ptr, key_ptr, first_ptr,
    M, N, K, KB, NBLK,
    stride_xm, stride_ss, stride_sn, stride_as, stride_ym,
    ALPHA_PER_ROW: tl.constexpr, TILED: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    first = tl.load(first_ptr + b)
    if first >= M:
        return
    slot = tl.load(key_ptr + first)
    rows = first + tl.arange(0, BLOCK_M)
    # the block's rows end where the next block starts (groups cut smaller than BLOCK_M)
    live = rows < tl.minimum(tl.load(first_ptr + b + 1, mask=b + 1 < NBLK, other=M), M)
    live = live & (tl.load(key_ptr + rows, mask=live, other=-1) == slot)
    xrow = tl.load(order_ptr + rows, mask=live, other=0)
    x_rows = x_ptr + xrow.to(tl.int64) * stride_xm                                    # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # rows past N re-read row n mod N (in bounds, never written)
    BKB: tl.constexpr = BLOCK_K // 8
    offs_b = tl.arange(0, BKB)
    s_base = s_ptr + slot.to(tl.int64) * stride_ss
    # yᵀ tile [BN, BM]; plane j of a K step holds weights 8b + j (b < BKB): see the module docstring
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 8 + offs_b
        if TILED:
            off = (rn[:, None] >> 6) * stride_sn + ((kb[None, :] >> 4) << 10) + ((rn[:, None] & 63) << 4) \
                + (kb[None, :] & 15)
        else:
            off = rn[:, None] * stride_sn + kb[None, :]
        byte = tl.load(s_base + off, mask=(kb < KB)[None, :], other=0).to(tl.int32)    # [BN, BKB]
        for j in tl.static_range(8):
            k = kb * 8 + j
            xt = tl.load(x_rows[None, :] + k[:, None], mask=live[None, :] & (k < K)[:, None], other=0.0)  # [BKB, BM]
            pm = (((byte >> j) & 1) * 2 - 1)
            if DOT_FP32:
                acc += tl.dot(pm.to(tl.float32), xt.to(tl.float32))
            else:
                acc = tl.dot(pm.to(xt.dtype), xt, acc)
    if ALPHA_PER_ROW:
        alpha = tl.load(a_ptr + slot * stride_as + rn)
    else:
        alpha = tl.load(a_ptr + slot * stride_as + rn * 0)
    y_off = xrow[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    ymask = live[None, :] & (offs_n < N)[:, None]
    y = tl.load(y_ptr + y_off, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_off, (y + acc * alpha[:, None]).to(y_ptr.dtype.element_ty), mask=ymask)


def _block_n(n: int, blocks: int) -> int:
    """Output features per program: 64 (one sign tile) unless that leaves the GPU short of programs."""
    if _interpret():
        return 16
    for bn in (64, 32):
        if triton.cdiv(n, bn) * blocks >= 264:
            return bn
    return 16


CONFIG = {"BLOCK_K": 256, "num_warps": 4, "num_stages": 3}  # per program, besides BLOCK_N (_block_n)


def add_sign_products(x: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor, groups: RowGroups,
                      y: torch.Tensor, block_n: int | None = None, **config) -> torch.Tensor:
    """``y[m] += α_t ⊙ (x[m] · S_tᵀ)`` for every row of a variant, in place (``y`` ``[M, N]`` in
    ``x.dtype`` with unit stride along N: a column block of a wider output too); returns ``y``.
    Trusts its inputs: :func:`bitdelta_linear_grouped` checks them."""
    m, k = x.shape
    n = y.shape[1]
    if m == 0:
        return y
    tiled = signs.dim() == 5
    config = {**CONFIG, **config}
    for part in groups.parts():
        bn = block_n or _block_n(n, part.max_blocks)
        _grouped_kernel[(triton.cdiv(n, bn), part.max_blocks)](
            x, signs, alphas, y, part.order, part.key, part.first,
            m, n, k, (k + 7) // 8, part.max_blocks,
            x.stride(0), signs.stride(0), signs.stride(1), alphas.stride(0), y.stride(0),
            ALPHA_PER_ROW=alphas.dim() == 2, TILED=tiled, DOT_FP32=_interpret(),
            BLOCK_M=max(part.block_m, BLOCK_M), BLOCK_N=bn, **config)  # smaller blocks: fewer live rows
    return y


def bitdelta_linear_grouped(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                            slot: torch.Tensor, bias: torch.Tensor | None = None,
                            groups: RowGroups | None = None, betas: torch.Tensor | None = None) -> torch.Tensor:
    """The contract of :func:`deltafleet.kernels.reference.bitdelta_linear_batched` (same arguments,
    shapes and errors; slots outside ``[0, S)`` get the base only), by the base product and the
    sign products: on a Hopper GPU with tiled signs ``deltafleet.kernels.gluon_grouped`` (the int8
    tensor cores, each sign tile expanded once per block of rows), else :func:`add_sign_products`.
    Up to :data:`OVERLAP_MAX_ROWS` rows without a bias, the former runs beside the base product
    (:func:`_base_beside_signs`).
    ``groups``: :func:`group_rows` of ``slot``, when the caller has it (it is the same for every layer
    of a step); its ``block_m`` (4, 8, 16, 32 or 64; :func:`grouped_block_m` by default) is the rows a
    program multiplies. ``betas`` (float32 ``[S, K]``, granularity rowcol): the sign products read
    ``x ⊙ β_slot``, rounded to ``x.dtype`` (one elementwise product; the kernels are unchanged). In
    float16, where x ⊙ β can overflow with x and β in range, a slot's β above 1 is divided by its peak
    and the slot's α multiplied by it first."""
    check_tensors(x=x, weight=weight, signs=signs, alphas=alphas, slot=slot, bias=bias, betas=betas)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a floating dtype, got {x.dtype} and {weight.dtype}")
    check_batched_args(x, weight, signs, alphas, slot, check_slot_values=slot.device.type == "cpu", betas=betas)
    check_weight_and_bias(weight, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    xs = x
    if betas is not None and signs.shape[0]:  # base rows (slot −1) read some slot's β, never added; no slot: none
        b = betas.to(x.device, torch.float32)
        if x.dtype == torch.float16:  # x and β in range, x ⊙ β may not be: β at most 1, each slot's peak into α
            peak = b.abs().amax(-1).clamp_min(1.0)
            b = b / peak[:, None]
            alphas = alphas * peak.view(-1, *[1] * (alphas.dim() - 1)).to(alphas.dtype)
        b = b[0] if b.shape[0] == 1 else b[slot.long().clamp(0, b.shape[0] - 1)]  # one variant: broadcast
        xs = (x.float() * b).to(x.dtype)
    if groups is None:
        groups = group_rows(slot, signs.shape[0])
    if bias is None and _overlaps(x, weight, [signs]):
        return _base_beside_signs(x, xs, weight, [weight.shape[0]], [signs], [alphas], groups)
    y = torch.addmm(bias.to(x.dtype), x, weight.t()) if bias is not None else torch.mm(x, weight.t())
    _add_signs(xs, signs, alphas, groups, y, {})
    return y


_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device index, thread) → side stream
# The side stream's priority (lower is higher, PyTorch's convention): the sign products are the longer
# chain of a two-stream call, so the block scheduler serves them before the base GEMM's blocks.
SIDE_PRIORITY = -1
# Sibling launches (_add_signs): each sign-product launch after the first of a chain over the same
# planes starts its products while the one before ends; False launches every one as the first
# (kept for measuring one against the other)
SIBLINGS = True
# (device index, n, thread, or GRAPHS) → a zeroed float32 accumulator (_accumulator)
_ACCUMULATORS: dict[tuple[int, int, int | str], torch.Tensor] = {}
GRAPHS = "graphs"  # the accumulators' key of the calls captured in CUDA graphs, from any thread


def _overlaps(x: torch.Tensor, weight: torch.Tensor, signs: list[torch.Tensor]) -> bool:
    """Whether :func:`_base_beside_signs` runs: up to :data:`OVERLAP_MAX_ROWS` rows, the Gluon sign
    products for every matrix (``gluon_grouped.supported``: Hopper, tiled contiguous signs) and
    :func:`triton_base.base_mm`."""
    if not 0 < x.shape[0] <= OVERLAP_MAX_ROWS or not _hopper(x.device) or not triton_base.supported(x, weight):
        return False
    from deltafleet.kernels import gluon_grouped

    return all(gluon_grouped.supported(x, s) for s in signs)


def _base_beside_signs(x: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, sizes: list[int],
                       signs: list[torch.Tensor], alphas: list[torch.Tensor], groups: RowGroups) -> torch.Tensor:
    """``y = x·Wᵀ`` plus every matrix's sign products of ``xs`` (x, or x ⊙ β) in its column block, with
    the two running at once: the sign products (planes made once, then each matrix's launches) go into
    a zeroed float32 ``z`` on a side stream, while :func:`triton_base.base_mm` writes ``y`` on the
    current one, whose blocks fit beside the sign kernel's programs; after the join ``y += z``, the sum
    in float32 rounded once to y's dtype, by ``triton_base.add_and_clear``, which also leaves ``z``
    zeroed: ``z`` is a view of an accumulator kept per device and width (:func:`_accumulator`), so no
    launch clears it first. (The sign kernel's own epilogue fuses the scale and the add,
    so an element may differ from it by a unit in the last place; base rows get exactly the base
    product.) The side stream waits for the current one first, and the current one for it before the
    add, so a CUDA graph captures both branches.

    ``z`` outlives the call (:func:`_accumulator`), so its uses must stay ordered: eagerly, the side
    stream (the only one that writes ``z`` before its clear) also waits for the clear, so the thread's
    next call is ordered after it whatever stream it is on; a call that raises after launching sign
    products clears ``z`` before re-raising (while capturing, it only joins the streams, so that the
    capture fails on the first error), so no later call adds them. The other tensors used on the side
    stream are either the caller's or allocated there (the planes), so the caching allocator reuses
    none of them early. One side stream per device and thread, kept distinct from the current stream
    (PyTorch hands streams out of a pool), at :data:`SIDE_PRIORITY`: the sign products outlast the
    GEMM, so their blocks go first (a CUDA graph keeps each captured kernel's priority)."""
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    capturing = torch.cuda.is_current_stream_capturing()
    z = _accumulator(x.device, m, n, capturing)
    cur = torch.cuda.current_stream(x.device)
    key = (x.device.index, threading.get_ident())
    side = _SIDE_STREAMS.get(key)
    while side is None or side == cur:  # the pool's next stream: at most one more try
        side = _SIDE_STREAMS[key] = torch.cuda.Stream(x.device, priority=SIDE_PRIORITY)
    side.wait_stream(cur)
    try:
        with torch.cuda.stream(side):
            planes: dict = {}
            for i, (zi, s, a) in enumerate(zip(z.split(list(sizes), 1), signs, alphas)):
                _add_signs(xs, s, a, groups, zi, planes, sibling=i > 0)
        triton_base.base_mm(x, weight, y)
        cur.wait_stream(side)
        triton_base.add_and_clear(y, z)
    except BaseException:
        try:
            cur.wait_stream(side)
            if not capturing:  # a failed capture ran nothing
                z.zero_()
                side.wait_stream(cur)
        except Exception:  # a device that fails this too: the first error is the one to see
            pass
        raise
    if not capturing:
        side.wait_stream(cur)
    return y


def _accumulator(device: torch.device, m: int, n: int, capturing: bool) -> torch.Tensor:
    """A zeroed float32 ``[m, n]`` for :func:`_base_beside_signs` (``m`` ≤ :data:`OVERLAP_MAX_ROWS`, as
    :func:`_overlaps` ensures): the first ``m·n`` elements of a buffer of ``OVERLAP_MAX_ROWS · n``
    kept per device and width ``n`` (a model has four: qkv, o, gate_up, down), made with zeros once
    and zeroed again by each use's ``add_and_clear``.

    Eager calls use their thread's buffer, calls captured in a CUDA graph (from any thread) another,
    keyed :data:`GRAPHS`, so a replay never shares one with an eager call that its stream does not
    wait for; graphs that share it must not replay at once (as graphs sharing a memory pool). Both
    are made at the width's first eager call (a graph's warm-up), as ordinary tensors even under
    inference mode (a later clear outside it must be allowed). A width first needed during a capture
    gets a zeroed buffer of the graph's own, its zeros a node of that graph: a kept one made then
    would hold zeros only once that graph replays."""
    key = (device.index, n, GRAPHS if capturing else threading.get_ident())
    buf = _ACCUMULATORS.get(key)
    if buf is None:
        if capturing:
            return torch.zeros(m, n, dtype=torch.float32, device=device)
        with torch.inference_mode(False):
            for k in (key, (device.index, n, GRAPHS)):
                if k not in _ACCUMULATORS:
                    _ACCUMULATORS[k] = torch.zeros(OVERLAP_MAX_ROWS * n, dtype=torch.float32, device=device)
        buf = _ACCUMULATORS[key]
    assert m * n <= buf.numel(), "more rows than OVERLAP_MAX_ROWS on the two-stream path"
    return buf[:m * n].view(m, n)


def _add_signs(x: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor, groups: RowGroups, y: torch.Tensor,
               planes: dict, pdl: bool = True, sibling: bool = False) -> None:
    """``y += `` the sign products of ``groups``' rows (``y`` ``[M, N]``, unit stride along N, may be a
    column block of a wider output): on a Hopper GPU with tiled signs by ``gluon_grouped``, whose
    activation planes are made once and kept in ``planes`` for the next matrix over the same rows;
    else by :func:`add_sign_products`.

    ``pdl``: launch with programmatic dependent launch (``gluon_grouped``): each launch copies its
    first sign tiles while the kernel before (the planes, or the sign products of the matrix or part
    before) ends. Such a launch reads the signs and ``groups`` before it waits, so they must be
    complete before that kernel starts: pass False when the kernel just before may have written
    ``groups`` (made right before, with the planes already in ``planes``). A copy of the signs made
    here turns it off unless the planes are made after it.

    ``sibling``: the last kernel launched before this call is the last launch of an ``_add_signs``
    call over the same ``planes`` (the matrix before). Then, as every launch after this call's first,
    it is a sibling launch (``gluon_grouped.add_sign_products_planes``): it starts its products
    without waiting for the one before."""
    alphas = alphas.to(device=x.device, dtype=torch.float32).contiguous()
    copied = not signs.is_contiguous()
    signs = signs.contiguous()
    if not _interpret():
        from deltafleet.kernels import gluon_grouped

        if gluon_grouped.supported(x, signs, y):  # Hopper, tiled signs: the int8 tensor cores
            made = "planes" not in planes
            if made:
                planes["planes"] = gluon_grouped.sorted_planes(x, groups.order, groups.key, signs.shape[0], pdl=pdl)
            pdl = pdl and (made or not copied)
            for i, part in enumerate(groups.parts()):  # after the first, each launch follows a sibling
                gluon_grouped.add_sign_products_planes(x, signs, alphas, part, y, block_m=part.block_m,
                                                       planes=planes["planes"], pdl=pdl,
                                                       sibling=SIBLINGS and (i > 0 or (sibling and not made)))
            return
    add_sign_products(x, signs, alphas, groups, y)


def bitdelta_linears_grouped(x: torch.Tensor, weight: torch.Tensor, sizes: list[int], signs: list[torch.Tensor],
                             alphas: list[torch.Tensor], slot: torch.Tensor,
                             groups: RowGroups | None = None) -> torch.Tensor:
    """Several matrices that read the same rows (q, k and v; gate and up) as one: ``y [M, ΣN]``,
    whose column block i is :func:`bitdelta_linear_grouped` of matrix i (no bias), and is rounded
    the same way.

    ``weight`` ``[ΣN, K]`` holds the matrices' base weights stacked in order (serve/model.py's
    ``fuse_rows``), ``sizes`` their N, ``signs[i]`` and ``alphas[i]`` matrix i's, as
    :func:`bitdelta_linear_grouped` takes them. The base product of all of them is one GEMM, and on
    a Hopper GPU the activation planes of the rows are made once for all the sign products, which
    run beside that GEMM up to :data:`OVERLAP_MAX_ROWS` rows (:func:`_base_beside_signs`).

    Raises:
        ValueError: as :func:`bitdelta_linear_grouped` for any matrix, or if ``sizes`` do not add up to
            the weight's rows or the lists differ in length.
    """
    check_stacked(weight, sizes, signs, alphas)
    check_tensors(x=x, weight=weight, slot=slot)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a floating dtype, got {x.dtype} and {weight.dtype}")
    blocks = weight.split(list(sizes))
    for w, s, a in zip(blocks, signs, alphas):
        check_tensors(x=x, weight=w, signs=s, alphas=a, slot=slot)
        if s.dtype != torch.uint8:
            raise ValueError(f"signs must be uint8, got {s.dtype}")
        check_batched_args(x, w, s, a, slot, check_slot_values=slot.device.type == "cpu")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if groups is None:
        groups = group_rows(slot, signs[0].shape[0])
    if _overlaps(x, weight, signs):
        return _base_beside_signs(x, x, weight, sizes, signs, alphas, groups)
    y = torch.mm(x, weight.t())
    planes: dict = {}
    for i, (yi, s, a) in enumerate(zip(y.split(list(sizes), 1), signs, alphas)):
        _add_signs(x, s, a, groups, yi, planes, sibling=i > 0)
    return y
