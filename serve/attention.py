"""Attention over a paged KV cache (vLLM's PagedAttention layout, Kwon et al. 2023), through
PyTorch's kernels: FlexAttention for decode rows, scaled-dot-product attention for prefill chunks.

The cache of layer ``l`` is two tensors ``[n_kv_heads, n_slots, head_dim]`` (keys, values), head
major, so a block of ``block_size`` tokens of one head is one contiguous tile. Slot ``s`` belongs to
block ``s // block_size``; :class:`~deltafleet.serve.kv.BlockPool` hands the blocks to sequences and a
sequence's block table lists its blocks in token order. The last block (id ``n_blocks``) is never
handed out: padding rows of a CUDA-graph batch write there (serve/graphs.py).

One engine step is a flat batch of ``T`` tokens (:class:`PagedStep`): the first ``n_decode`` are
decode rows (one token each, of distinct sequences), the rest prefill chunks (a run of one
sequence's consecutive tokens). Every token's key and value are written to its slot first; then

- **decode rows** attend to their sequence's blocks: FlexAttention (``torch.nn.attention.
  flex_attention``) over the whole cache, with a block mask made from the block tables in blocks of
  :func:`mask_block` keys (every mask block of the row before its position's is read whole,
  that one up to the row's position), so the kernel reads only live blocks and nothing is gathered.
  Off CUDA, or with ``backend="sdpa"``, the rows' keys are gathered and read by
  ``F.scaled_dot_product_attention`` (the reference the tests compare with);
- **the prefill chunks**, with FlexAttention: every chunk's tokens, whole prompts and continuing
  ones alike, in one call per layer over the cache (:class:`PrefillLists`): query blocks of
  :data:`PREFILL_Q_BLOCK` tokens, each reading its chunks' blocks up to their positions, whole where
  every query of the block sees all of a block (causal, no mask evaluated), through the mask
  elsewhere; the query length is padded to a power of two (few shapes to compile). With SDPA (off
  CUDA, or ``backend="sdpa"``), a chunk of tokens ``start … start + n − 1`` gathers its sequence's
  keys ``0 … start + n − 1`` and runs ``F.scaled_dot_product_attention`` (causal from ``start``),
  whole prompts of one length in one call over their own keys.

Why these kernels (measured on an H200, Llama-2-7B attention shape, one layer, decode): FlexAttention
over 128-token pages ran at about 1.1–2× the live KV bytes' read time from 16 to 256 rows, where the
same with 16-token pages was 5–10× slower, gathering then SDPA 4–40×, and the former static cache
(SDPA masked over 1,024 positions) read every row's whole context. For prefill, one FlexAttention call
replaces per-chunk gathers and SDPA calls with a dense mask (no causal skipping): docs/serving.md
("Attention") has the measurement. FlashInfer and FlashAttention's
paged kernels do not install on the GPU image; FlexAttention ships with PyTorch.

A leaf module (torch and numpy; on CUDA, serve/rope_cache.py's Triton kernel is imported on first
use).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("auto", "flex", "sdpa")


def _flex():
    """``flex_attention``, compiled once per process (eager FlexAttention materializes every score)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        # One compiled kernel per decode bucket (1, 2, 4, … 256 rows): more than dynamo's default
        # recompile limit (8), past which it would fall back to the unfused implementation.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _FLEX = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _FLEX


_FLEX = None
_ROPE_STORE = None  # serve/rope_cache.rope_store once imported; False without triton


def _rope_store():
    """serve/rope_cache.py's ``rope_store`` (imported on first use on CUDA), or None without triton."""
    global _ROPE_STORE
    if _ROPE_STORE is None:
        try:
            from deltafleet.serve.rope_cache import rope_store
        except ImportError:
            rope_store = False
        _ROPE_STORE = rope_store
    return _ROPE_STORE or None

# FlexAttention's decoding kernel (one query per row) on CUDA, and the keys per block of the decode
# rows' block mask (a divisor of the cache's block size, and so the kernel's largest key tile: BLOCK_N
# must divide it), both by the step's decode rows (padded). A row's last mask block is read whole and
# masked: with 128-key mask blocks over 128-token cache blocks a row at position 256 reads 384 keys
# for its 257, with 32-key blocks 288, with 16-key blocks 272. Above FLEX_FEW_ROWS rows 16-key blocks
# with two warps read least; up to it, 32-key blocks with four warps (a 16-key tile is little work,
# which long contexts of few rows pay for). Two pipeline stages: the kernel's default (one) leaves the
# loads unpipelined. docs/serving.md ("Attention") has the sweeps these come from. The options are
# passed only where that kernel runs (a power-of-two ratio of query to key-value heads), else
# FlexAttention takes its main kernel.
FLEX_FEW_ROWS = 16
FLEX_MASK_BLOCK = 16       # above FLEX_FEW_ROWS rows
FLEX_MASK_BLOCK_FEW = 32   # up to FLEX_FEW_ROWS rows
FLEX_DECODE_OPTIONS = {"BLOCK_N": 64, "num_stages": 2, "num_warps": 2}
FLEX_DECODE_OPTIONS_FEW = {"BLOCK_N": 64, "num_stages": 2, "num_warps": 4}


def mask_block(block_size: int, rows: int | None = None) -> int:
    """The FlexAttention mask's keys per block for ``rows`` decode rows (None: many) over a cache of
    ``block_size``-token blocks: :data:`FLEX_MASK_BLOCK` (:data:`FLEX_MASK_BLOCK_FEW` up to
    :data:`FLEX_FEW_ROWS` rows) where it divides the block size, else the block size."""
    mb = FLEX_MASK_BLOCK_FEW if rows is not None and rows <= FLEX_FEW_ROWS else FLEX_MASK_BLOCK
    return mb if block_size % mb == 0 else block_size


def decode_options(rows: int, mb: int) -> dict:
    """FlexAttention's decoding kernel options for ``rows`` decode rows over mask blocks of ``mb`` keys."""
    opts = FLEX_DECODE_OPTIONS_FEW if rows <= FLEX_FEW_ROWS else FLEX_DECODE_OPTIONS
    return {**opts, "BLOCK_N": min(opts["BLOCK_N"], mb)}


class PagedKVCache:
    """Keys and values of every layer: ``k[l]``, ``v[l]`` of shape ``[n_kv_heads, (n_blocks + 1) ·
    block_size, head_dim]``; block ``n_blocks`` is the scratch block (see the module docstring)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"n_blocks and block_size must be ≥ 1, got {n_blocks} and {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.scratch_block = n_blocks
        shape = (n_layers, n_kv_heads, (n_blocks + 1) * block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over every layer, keys and values."""
        return 2 * n_layers * n_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class PagedStep:
    """One step's attention inputs, on the cache's device (built by serve/runner.py).

    Attributes:
        cache: the :class:`PagedKVCache`.
        kv_slots: int64 ``[T]``, the cache slot each token's key and value go to.
        n_decode: the first ``n_decode`` tokens are decode rows.
        tables: int32 ``[R, max_blocks]``, the decode rows' block tables (padded with any block id:
            only the first ``num_blocks[b]`` are read), ``R ≥ n_decode``: rows past ``n_decode`` are
            padding (a scratch-block table, position 0) that keeps FlexAttention's shapes to a few.
        num_blocks: int32 ``[R]``, the blocks each decode row reads.
        positions: int64 ``[R]``, each decode row's position (it attends to ``0 … position``).
        chunks: per prefill chunk that continues a sequence ``(flat start, length, start position,
            context slots)``: the chunk's tokens are ``flat start …`` of the batch at positions ``start
            position …``, and its context slots (int64, ``start position + length`` of them) are where
            its sequence's keys lie.
        prompts: the chunks that start a sequence (position 0), by length: ``(length, flat starts,
            rows)`` with ``rows`` the int64 flat indices of all their tokens (None for one chunk).
            They attend to their own keys only, so these are read from the step, not the cache, and
            chunks of one length are one batched call.
        backend: ``"flex"`` or ``"sdpa"`` for the decode rows.
    """

    cache: PagedKVCache
    kv_slots: Tensor
    n_decode: int
    tables: Tensor
    num_blocks: Tensor
    positions: Tensor
    chunks: list[tuple[int, int, int, Tensor]] = field(default_factory=list)
    backend: str = "sdpa"
    masks: FlexMask | None = None  # flex: the mask buffers and mask_mod, reused every step
    _mask: object = None
    prompts: list[tuple[int, list[int], Tensor | None]] = field(default_factory=list)
    prefill: PrefillLists | None = None  # flex: every chunk's tokens in one FlexAttention call
    # A step of fixed shapes (serve/graphs.py, FullGraphs): all T tokens go through the prefill call
    # (``prefill.length == T``, decode rows see nothing there) and the first R through the decode call;
    # bool [R] says which of those R are decode rows, whose output is the decode call's.
    decode_rows: Tensor | None = None
    _prefill_mask: object = None
    _masks_set: bool = False

    def layer(self, i: int) -> PagedLayer:
        return PagedLayer(self, i)

    def block_mask(self):
        """The FlexAttention block mask of the decode rows (made once per step, shared by every layer),
        in blocks of :func:`mask_block` keys: a row reads the mask blocks before its position's whole
        ("full" blocks: no mask evaluated) and its position's one slot by slot; :class:`FlexMask`'s
        ``mask_mod`` gives the whole mask."""
        if self._mask is None:
            from torch.nn.attention.flex_attention import BlockMask

            bs, b = self.cache.block_size, self.tables.shape[0]  # decode rows and any padding rows
            mb = mask_block(bs, b)
            self._set_masks()
            # eager FlexAttention (off CUDA) makes a dense mask: a column per block of the cache
            width = None if self.tables.is_cuda else self.cache.k.shape[2] // bs
            partial, full, n_full = block_lists(self.tables, self.positions, bs, mb, width)
            self._mask = BlockMask.from_kv_blocks(
                torch.ones(b, 1, 1, dtype=torch.int32, device=full.device), partial.view(b, 1, 1, -1),
                n_full.view(b, 1, 1), full.view(b, 1, 1, -1),
                BLOCK_SIZE=(128, mb), mask_mod=self.masks.mask_mod, seq_lengths=(1, self.cache.k.shape[2]),
                compute_q_blocks=False)
        return self._mask

    def prefill_mask(self):
        """The FlexAttention block mask of the prefill tokens (:class:`PrefillLists`), made once per
        step and shared by every layer: query blocks of :data:`PREFILL_Q_BLOCK` tokens over cache
        blocks, a block read whole where every token of the query block sees all of it."""
        if self._prefill_mask is None:
            from torch.nn.attention.flex_attention import BlockMask

            p, bs = self.prefill, self.cache.block_size
            self._set_masks()
            self._prefill_mask = BlockMask.from_kv_blocks(
                p.kv_num[None, None], p.kv_idx[None, None], p.full_num[None, None], p.full_idx[None, None],
                BLOCK_SIZE=(PREFILL_Q_BLOCK, bs), mask_mod=self.masks.prefill_mod,
                seq_lengths=(p.length, self.cache.k.shape[2]), compute_q_blocks=False)
        return self._prefill_mask

    def _set_masks(self) -> None:
        """Fill the mask buffers (:meth:`FlexMask.update`) once per step, for whichever mask comes first."""
        if not self._masks_set:
            self._masks_set = True
            p = self.prefill
            self.masks.update(self.tables, self.num_blocks, self.positions,
                              None if p is None else (p.blocks, p.owners, p.logical, p.seq, p.pos))


# Query tokens per block of the prefill tokens' FlexAttention block mask (FlexAttention's default).
PREFILL_Q_BLOCK = 128


@dataclass
class PrefillLists:
    """The prefill tokens of a step as FlexAttention sees them (:func:`prefill_lists`), on the device.

    Attributes:
        length: the query length, the prefill tokens padded (a power of two, at least 16: few shapes
            to compile); token ``i`` is the step's token ``n_decode + i``.
        kv_num, kv_idx, full_num, full_idx: int32 ``[Q]``, ``[Q, W]``: per query block of
            :data:`PREFILL_Q_BLOCK` tokens, the cache blocks read through the mask and those read whole.
        blocks, owners, logical: int64, per cache block of a chunk's sequence: its id, the owner id of
            its sequence (``first_owner + c`` for chunk ``c``) and its index in the sequence's table.
        seq, pos: per query token: its sequence's owner id (−1 for padding: it sees nothing) and its
            position.
    """

    length: int
    kv_num: Tensor
    kv_idx: Tensor
    full_num: Tensor
    full_idx: Tensor
    blocks: Tensor
    owners: Tensor
    logical: Tensor
    seq: Tensor
    pos: Tensor


def prefill_length(n: int) -> int:
    """The padded query length of ``n`` prefill tokens: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def prefill_lists(chunks: list[tuple[int, int, int, list[int]]], n_decode: int, n_cache_blocks: int,
                  block_size: int, first_owner: int, length: int | None = None) -> dict[str, np.ndarray | int]:
    """The block lists of :class:`PrefillLists` on the host (numpy), for ``chunks`` ``(flat start,
    length, start position, block table)`` whose tokens follow ``n_decode`` decode rows in the step.

    Chunk ``c``'s token at position ``p`` reads its sequence's keys ``0 … p`` (its own among them:
    they are in the cache before attention runs). Per query block, a chunk's blocks wholly before the
    block's first token of that chunk are read whole ("full", no mask evaluated) when the query block
    holds that chunk's tokens alone (with padding at most); every other block it needs is read
    through the mask. The lists are ``n_cache_blocks`` wide, so no step can overflow them.
    ``length``: the query length (default :func:`prefill_length` of the chunks' tokens)."""
    if length is None:
        length = prefill_length(sum(c[1] for c in chunks))
    nq = -(-length // PREFILL_Q_BLOCK)
    seq = np.full(length, -1, dtype=np.int32)
    pos = np.zeros(length, dtype=np.int64)
    pieces: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in range(nq)]
    blocks, owners, logical = [], [], []
    for c, (first, m, start, table) in enumerate(chunks):
        a, owner = first - n_decode, first_owner + c
        seq[a:a + m] = owner
        pos[a:a + m] = np.arange(start, start + m)
        used = (start + m - 1) // block_size + 1
        blocks += table[:used]
        owners += [owner] * used
        logical += range(used)
        for j in range(a // PREFILL_Q_BLOCK, (a + m - 1) // PREFILL_Q_BLOCK + 1):
            lo, hi = max(a, j * PREFILL_Q_BLOCK), min(a + m, (j + 1) * PREFILL_Q_BLOCK)
            pieces[j].append((start + lo - a, start + hi - 1 - a, c, table))
    kv_num = np.zeros(nq, dtype=np.int32)
    full_num = np.zeros(nq, dtype=np.int32)
    kv_idx = np.zeros((nq, n_cache_blocks), dtype=np.int32)
    full_idx = np.zeros((nq, n_cache_blocks), dtype=np.int32)
    for j, ps in enumerate(pieces):
        partial, full = [], []
        for lo, hi, _, table in ps:
            whole = (lo + 1) // block_size if len(ps) == 1 else 0  # blocks whose last key is ≤ lo
            full += table[:whole]
            partial += table[whole:hi // block_size + 1]
        kv_num[j], full_num[j] = len(partial), len(full)
        kv_idx[j, :len(partial)] = partial
        full_idx[j, :len(full)] = full
    return {"length": length, "kv_num": kv_num, "kv_idx": kv_idx, "full_num": full_num, "full_idx": full_idx,
            "blocks": np.asarray(blocks, dtype=np.int64), "owners": np.asarray(owners, dtype=np.int64),
            "logical": np.asarray(logical, dtype=np.int64), "seq": seq, "pos": pos}


def block_lists(tables: Tensor, positions: Tensor, block_size: int, mask_block: int | None = None,
                width: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """FlexAttention's block lists for decode rows, in mask blocks of ``mask_block`` keys (a divisor of
    ``block_size``; default the block size): ``(partial, full, n_full)``. ``partial`` and ``full`` are
    int32 ``[B, W]`` of one shape and strides (the kernels index both with the partial list's
    strides): ``full[b]`` lists row b's mask blocks in token order (cache block ``t`` is mask blocks
    ``t·r … t·r + r − 1``, ``r = block_size / mask_block``), ``partial[b, 0]`` is the one holding its
    position (read up to it), and ``n_full[b]`` (int32 ``[B]``) counts those before it (read whole).
    ``width``: pad the tables to this many cache blocks first (None: their own width)."""
    mb = mask_block or block_size
    r = block_size // mb
    tables = tables.to(torch.int32).contiguous()
    if width is not None:
        tables = F.pad(tables, (0, width - tables.shape[1]))
    if r > 1:
        sub = torch.arange(r, dtype=torch.int32, device=tables.device)
        tables = (tables[:, :, None] * r + sub).reshape(tables.shape[0], -1)
    n_full = (positions // mb).to(torch.int64)
    last = tables.gather(1, n_full[:, None])
    return torch.cat([last, tables[:, 1:]], 1), tables, n_full.to(torch.int32)


class FlexMask:
    """The decode rows' mask, slot by slot, for FlexAttention: slot ``kv`` of block ``kv // block_size``
    is read by row ``b`` if the block is one of the row's (``owner``) and its token (the block's index
    in the row's table, ``logical``, times the block size, plus the slot's offset) is at most the row's
    position. Rows at position 0 read the scratch block: those are the padding rows of a CUDA-graph
    batch (a decode row is at position 1 or later, after its prompt). The buffers are filled in place at every
    step (no host synchronisation, so a CUDA graph can record it) and ``mask_mod`` is made once, so a
    compiled FlexAttention sees the same function and the same tensors at every step."""

    def __init__(self, n_blocks: int, block_size: int, max_rows: int, device):
        self.block_size, self.scratch = block_size, n_blocks
        # one entry per block, the scratch block, and a sink for the unused table columns
        self.owner = torch.full((n_blocks + 2,), -1, dtype=torch.int32, device=device)
        self.logical = torch.zeros(n_blocks + 2, dtype=torch.int32, device=device)
        self.row_pos = torch.zeros(max_rows, dtype=torch.int64, device=device)
        owner, logical, row_pos, bs, scratch = self.owner, self.logical, self.row_pos, block_size, n_blocks

        def mask_mod(b, h, q_idx, kv_idx):
            blk = kv_idx // bs
            mine = (owner[blk] == b) | ((blk == scratch) & (row_pos[b] == 0))
            return mine & (logical[blk] * bs + kv_idx % bs <= row_pos[b])

        self.mask_mod = mask_mod
        # prefill tokens (PrefillLists): each token's sequence (an owner id) and position, grown as needed
        self.seq_q = torch.full((16,), -1, dtype=torch.int32, device=device)
        self.pos_q = torch.zeros(16, dtype=torch.int64, device=device)
        self.fixed = False  # reserve(..., fixed=True): graphs read seq_q and pos_q where they are

        def prefill_mod(b, h, q_idx, kv_idx):
            blk = kv_idx // bs
            return (owner[blk] == self.seq_q[q_idx]) & (logical[blk] * bs + kv_idx % bs <= self.pos_q[q_idx])

        self.prefill_mod = prefill_mod

    def reserve(self, n: int, fixed: bool = False) -> None:
        """Room for ``n`` prefill tokens in the buffers (before a CUDA graph captures them); ``fixed``:
        the buffers stay where they are from now on (graphs record their addresses).

        Raises:
            RuntimeError: past a fixed size.
        """
        if self.seq_q.numel() < n:
            if self.fixed:
                raise RuntimeError(f"{n} prefill tokens past the {self.seq_q.numel()} that CUDA graphs recorded")
            self.seq_q = torch.full((n,), -1, dtype=torch.int32, device=self.seq_q.device)
            self.pos_q = torch.zeros(n, dtype=torch.int64, device=self.pos_q.device)
        self.fixed = self.fixed or fixed

    def update(self, tables: Tensor, num_blocks: Tensor, positions: Tensor,
               chunks: tuple[Tensor, ...] | None = None) -> None:
        """Record the rows' blocks (``tables [B, W]``, the first ``num_blocks[b]`` of row b) and positions,
        and ``chunks``: the prefill tokens' ``(blocks, owners, logical, seq, pos)`` (:class:`PrefillLists`)."""
        b, w = tables.shape
        self.owner.fill_(-1)
        if b:
            cols = torch.arange(w, device=tables.device, dtype=torch.int32).expand(b, w)
            rows = torch.arange(b, device=tables.device, dtype=torch.int32)[:, None].expand(b, w)
            target = torch.where(cols < num_blocks[:, None], tables, self.scratch + 1).reshape(-1).to(torch.int64)
            self.owner.scatter_(0, target, rows.reshape(-1))
            self.logical.scatter_(0, target, cols.reshape(-1))
            self.row_pos[:b].copy_(positions)
        if chunks is not None:
            blocks, owners, logical, seq, pos = chunks
            self.owner.scatter_(0, blocks, owners.to(torch.int32))
            self.logical.scatter_(0, blocks, logical.to(torch.int32))
            self.reserve(seq.numel())
            self.seq_q[:seq.numel()].copy_(seq)
            self.pos_q[:pos.numel()].copy_(pos)


class PagedLayer:
    """Layer ``i`` of a :class:`PagedStep`: what serve/model.py's attention calls."""

    paged = True

    def __init__(self, step: PagedStep, i: int):
        self.step, self.i = step, i

    @staticmethod
    def rotates(q: Tensor) -> bool:
        """Whether :meth:`attend` can rotate ``q`` and the keys itself (``rope``): on CUDA, with triton."""
        return q.is_cuda and _rope_store() is not None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Write ``k``, ``v`` (``[T, n_kv, 1, hd]``) to their slots, then attend ``q`` (``[T, H, 1, hd]``)
        as the module docstring says; returns ``[T, H, 1, hd]``. ``q`` and ``k`` come rotated, or, where
        :meth:`rotates`, with ``rope = (cos, sin)`` are rotated here, by the same kernel that writes
        the cache (serve/rope_cache.py)."""
        st = self.step
        kc, vc = st.cache.k[self.i], st.cache.v[self.i]  # [KV, S, hd]
        if rope is not None:
            assert self.rotates(q)
            # the rotated keys are wanted besides the cache only where prompts attend to their own keys
            q, rk = _rope_store()(q, k, v, *rope, kc, vc, st.kv_slots, bool(st.prompts))
            k = k if rk is None else rk
        else:
            kc.index_copy_(1, st.kv_slots, k[:, :, 0].transpose(0, 1))
            vc.index_copy_(1, st.kv_slots, v[:, :, 0].transpose(0, 1))
        nd = st.n_decode
        if st.decode_rows is not None:  # fixed shapes: both calls over the whole batch, then pick
            out = self._prefill(q, kc, vc)
            out[:nd] = torch.where(st.decode_rows[:, None, None, None], self._decode(q[:nd], kc, vc), out[:nd])
            return out
        if not st.chunks and not st.prompts and st.prefill is None:
            return self._decode(q, kc, vc)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kc, vc)
        gqa = k.shape[1] != q.shape[1]
        if st.prefill is not None:  # every chunk's tokens in one call, over the cache
            out[nd:] = self._prefill(q[nd:], kc, vc)
            return out
        for n, firsts, rows in st.prompts:  # whole prompts: their own keys, one call per length
            if rows is None:
                f = firsts[0]
                qc, kk, vv = (t[f:f + n, :, 0].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                y = F.scaled_dot_product_attention(qc, kk, vv, is_causal=True, enable_gqa=gqa)
                out[f:f + n, :, 0] = y[0].transpose(0, 1)
            else:
                b = len(firsts)
                qc, kk, vv = (t.index_select(0, rows)[:, :, 0].view(b, n, t.shape[1], -1).transpose(1, 2)
                              for t in (q, k, v))                           # [b, heads, n, hd]
                y = F.scaled_dot_product_attention(qc, kk, vv, is_causal=True, enable_gqa=gqa)
                out.index_copy_(0, rows, y.transpose(1, 2).reshape(b * n, q.shape[1], 1, -1))
        for first, n, start, ctx in st.chunks:  # chunks that continue a sequence: causal from `start`
            qc = q[first:first + n, :, 0].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            kk, vv = kc[:, ctx].unsqueeze(0), vc[:, ctx].unsqueeze(0)    # [1, KV, start + n, hd]
            mask = torch.arange(start + n, device=q.device) <= torch.arange(start, start + n, device=q.device)[:, None]
            y = F.scaled_dot_product_attention(qc, kk, vv, attn_mask=mask, enable_gqa=gqa)
            out[first:first + n, :, 0] = y[0].transpose(0, 1)
        return out

    def _prefill(self, q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        """The prefill tokens ``q [P, H, 1, hd]`` (the step's tokens after its decode rows) attending
        to their sequences' keys in the cache, by one FlexAttention call (:meth:`PagedStep.prefill_mask`)."""
        st, n = self.step, q.shape[0]
        length = st.prefill.length
        if length > n:
            q = torch.cat([q, q.new_zeros(length - n, *q.shape[1:])])
        qq = q[:, :, 0].transpose(0, 1).unsqueeze(0)  # [1, H, length, hd]
        kk, vv = kc.unsqueeze(0), vc.unsqueeze(0)
        gqa = kc.shape[0] != q.shape[1]
        if not q.is_cuda:  # eager (tests on the CPU)
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(qq, kk, vv, block_mask=st.prefill_mask(), enable_gqa=gqa)
        else:
            bs = st.cache.block_size
            opts = None if bs >= 128 else {"BLOCK_N": bs}
            y = _flex()(qq, kk, vv, block_mask=st.prefill_mask(), enable_gqa=gqa, kernel_options=opts)
        return y[0, :, :n].transpose(0, 1).unsqueeze(2)

    def _decode(self, q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        st = self.step
        gqa = kc.shape[0] != q.shape[1]
        if st.backend == "flex":
            n, b = q.shape[0], st.tables.shape[0]
            if b > n:  # padding rows (see PagedStep): they read the scratch block, their output is dropped
                q = torch.cat([q, q.new_zeros(b - n, *q.shape[1:])])
            kk = kc.unsqueeze(0).expand(b, -1, -1, -1)
            vv = vc.unsqueeze(0).expand(b, -1, -1, -1)
            if not q.is_cuda:  # eager: materializes the scores (tests on the CPU)
                from torch.nn.attention.flex_attention import flex_attention

                return flex_attention(q, kk, vv, block_mask=st.block_mask(), enable_gqa=gqa)[:n]
            ratio = q.shape[1] // kc.shape[0]
            mb = mask_block(st.cache.block_size, b)
            if ratio & (ratio - 1) == 0:  # the decoding kernel
                opts = decode_options(b, mb)
            else:  # the main kernel, its own options but a key tile that divides the mask's blocks
                opts = {"BLOCK_N": mb} if mb < 128 else None
            return _flex()(q, kk, vv, block_mask=st.block_mask(), enable_gqa=gqa, kernel_options=opts)[:n]
        return decode_sdpa(q, kc, vc, st.tables, st.positions, st.cache.block_size)


def fill_tables(out: np.ndarray, tables: list[list[int]], pad_block: int = 0) -> np.ndarray:
    """Write block tables into ``out`` (int32 ``[R, width]``, ``R ≥ len(tables)``): each table
    left-aligned and padded with block 0, then the rows past ``len(tables)`` all ``pad_block``
    (padding rows' tables). Returns ``out``."""
    out[:len(tables)] = 0
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    out[len(tables):] = pad_block
    return out


def table_tensor(tables: list[list[int]], width: int, pad_rows: int = 0, pad_block: int = 0) -> Tensor:
    """Block tables as an int32 CPU tensor ``[len(tables) + pad_rows, width]`` (see :func:`fill_tables`)."""
    return torch.from_numpy(fill_tables(np.empty((len(tables) + pad_rows, width), dtype=np.int32), tables, pad_block))


def decode_sdpa(q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Decode rows by gathering each row's keys ``0 … max(positions)`` through its block table, then
    ``F.scaled_dot_product_attention`` masked at each row's position: ``q [B, H, 1, hd]`` → same."""
    length = int(positions.max()) + 1
    logical = torch.arange(length, device=q.device)
    blocks = tables[:, (logical // block_size).clamp(max=tables.shape[1] - 1)].to(torch.int64)
    slots = blocks * block_size + logical % block_size                       # [B, L]
    kk, vv = kc[:, slots].transpose(0, 1), vc[:, slots].transpose(0, 1)      # [B, KV, L, hd]
    mask = (logical[None, :] <= positions[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=kc.shape[0] != q.shape[1])


def pick_backend(backend: str, device: torch.device) -> str:
    """``"auto"``: FlexAttention on CUDA, SDPA elsewhere. Raises ValueError for an unknown name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


def check_block_size(block_size: int, backend: str, device: torch.device) -> None:
    """Refuse a KV block size the attention kernels cannot tile: compiled FlexAttention (``backend``
    as :func:`pick_backend` gives it, on CUDA) takes each cache block's keys in tiles of a power of
    two of at least 16 (a Triton block), so its blocks must be such a size too, as vLLM's block sizes
    are. SDPA, and FlexAttention run eagerly off CUDA, take any size ≥ 1.

    Raises:
        ValueError: naming ``kv_cache.block_size``."""
    if backend == "flex" and torch.device(device).type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"kv_cache.block_size must be a power of two ≥ 16 with FlexAttention on CUDA "
                         f"(16, 32, 64, 128, …), got {block_size}")


def max_blocks(max_seq_len: int, block_size: int) -> int:
    """Block-table width for sequences of up to ``max_seq_len`` tokens."""
    return math.ceil(max_seq_len / block_size)
