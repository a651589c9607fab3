"""The model runner: executes one engine step, a flat batch of decode rows and prefill chunks, over
the paged KV cache (vLLM v1's ``GPUModelRunner``, at this size).

The scheduler (serve/scheduler.py) turns a :class:`~deltafleet.serve.plan.StepPlan` into a
:class:`StepInput` of plain lists (which tensor-parallel ranks receive as it is, serve/follower.py);
:meth:`ModelRunner.execute` puts it on the device and runs
:meth:`Transformer.forward_paged <deltafleet.serve.model.Transformer.forward_paged>` once: every
linear sees all the step's tokens (the decode rows multiplied batched over their variants, each
prefill chunk by the one-variant kernel), attention reads each sequence's live blocks
(serve/attention.py), and the head runs on the rows that sample only. A step of decode rows only is
replayed as a CUDA graph when it can be (serve/graphs.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from deltafleet.serve.attention import (FlexMask, PagedKVCache, PagedStep, PrefillLists, max_blocks, pick_backend,
                                       prefill_length, prefill_lists, table_tensor)
from deltafleet.serve.batch import BatchDeltas
from deltafleet.serve.graphs import bucket
from deltafleet.serve.transfer import feed_tokens, upload

log = logging.getLogger(__name__)


@dataclass
class StepInput:
    """One step as plain lists: ``T`` tokens, decode rows first.

    Attributes:
        tokens, positions, kv_slots, variants: per token: its id, its position, the cache slot its key
            and value go to, its variant slot (−1: the base).
        n_decode: the first ``n_decode`` tokens are decode rows (one per sequence).
        tables: the decode rows' block tables.
        chunks: per prefill chunk ``(flat start, length, start position, block table)``.
        sample: the flat indices of the tokens whose next token is sampled (in the order the
            scheduler reads them back).
        score: more flat indices whose logits are wanted, after ``sample``'s (prompt positions of
            requests that asked for the prompt's log-probabilities).
        prev_rows: empty, or per decode row the row of the previous step's sampled tokens that is
            its token (−1: its ``tokens`` entry): a step planned while the previous one still runs
            (asynchronous scheduling, serve/scheduler.py) takes those tokens on the device.
    """

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)
    variants: list[int] = field(default_factory=list)
    n_decode: int = 0
    tables: list[list[int]] = field(default_factory=list)
    chunks: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    sample: list[int] = field(default_factory=list)
    score: list[int] = field(default_factory=list)
    prev_rows: list[int] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return not self.chunks

    def runs(self) -> list[tuple[int, int, int]]:
        """``(first, stop, variant)`` of each stretch of prefill chunks of one variant, adjacent chunks of
        the same variant as one run (what :class:`BatchDeltas` multiplies by run: one call per run
        and layer, whatever the number of prompts in it)."""
        out: list[tuple[int, int, int]] = []
        for first, n, _, _ in self.chunks:
            v = self.variants[first]
            if out and out[-1][1] == first and out[-1][2] == v:
                out[-1] = (out[-1][0], first + n, v)
            else:
                out.append((first, first + n, v))
        return out


class ModelRunner:
    """Runs steps of ``model`` over a paged KV cache of ``n_blocks`` blocks of ``block_size`` tokens.

    Args:
        model: the resident :class:`~deltafleet.serve.model.Transformer` (or this rank's slice of it).
        slots: the :class:`~deltafleet.serve.batch.DeltaSlots` the variant ids index.
        n_blocks, block_size: the cache (serve/kv.py's pool hands out block ids ``0 … n_blocks − 1``).
        max_batch: decode rows a step has at most (CUDA graphs are captured up to it).
        max_seq_len: the longest sequence (block-table width).
        cuda_graphs: replay decode-only steps as CUDA graphs (CUDA only; serve/graphs.py).
        attention: ``auto`` (FlexAttention on CUDA, SDPA elsewhere), ``flex`` or ``sdpa``.
        prefill_graphs: with ``cuda_graphs`` on CUDA, steps with prefill chunks of up to this many
            tokens run as piecewise CUDA graphs (serve/graphs.py,
            :class:`~deltafleet.serve.graphs.PiecewiseGraphs`); 0: eagerly.
    """

    def __init__(self, model, slots, n_blocks: int, block_size: int, max_batch: int, max_seq_len: int,
                 cuda_graphs: bool = False, attention: str = "auto", prefill_graphs: int = 0):
        self.model, self.slots = model, slots
        self.device = model.device
        attn = model.layers[0].self_attn
        self.cache = PagedKVCache(len(model.layers), attn.n_kv, attn.head_dim, n_blocks, block_size, model.dtype,
                                  self.device)
        self.block_size, self.max_batch = block_size, max_batch
        self.max_blocks = max_blocks(max_seq_len, block_size)
        self.backend = pick_backend(attention, self.device)
        self.masks = FlexMask(n_blocks, block_size, max_batch, self.device) if self.backend == "flex" else None
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from deltafleet.serve.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)
        self.piecewise = None
        if cuda_graphs and prefill_graphs > 0 and self.device.type == "cuda":
            from deltafleet.serve.graphs import FullGraphs, PiecewiseGraphs

            # with FlexAttention, attention's inputs are static too: one graph a step
            kind = FullGraphs if self.backend == "flex" else PiecewiseGraphs
            self.piecewise = kind(self, prefill_graphs, max_batch)
        self.steps = 0

    def capture_graphs(self) -> int:
        """Capture every CUDA graph this runner replays (decode buckets, and piecewise buckets with
        ``prefill_graphs``) before the first step; returns how many were captured (0 without graphs)."""
        n = 0
        with torch.inference_mode():
            if self.graphs is not None:
                n += self.graphs.capture_all()
            if self.piecewise is not None:
                with_deltas = self.graphs.capturable(True) if self.graphs is not None else False
                n += self.piecewise.capture_all(with_deltas)
                self.compile_prefill_attention(self.piecewise.max_tokens)
        return n

    def compile_prefill_attention(self, max_tokens: int) -> None:
        """Compile FlexAttention for every padded prefill length up to ``max_tokens`` tokens (a
        compile takes seconds: not in the step that first needs it), on one dummy chunk over the
        scratch block (read, not written). Only with the ``flex`` backend on CUDA."""
        if self.backend != "flex" or self.device.type != "cuda":
            return
        attn = self.model.layers[0].self_attn
        length = 16
        while length <= prefill_length(max_tokens):
            table = [self.cache.scratch_block] * -(-length // self.block_size)
            paged = self.paged_step(torch.zeros(0, dtype=torch.int64, device=self.device), 0,
                                    torch.zeros(0, 1, dtype=torch.int32, device=self.device),
                                    torch.zeros(0, dtype=torch.int32, device=self.device),
                                    torch.zeros(0, dtype=torch.int64, device=self.device), [])
            paged.prefill = self.prefill_lists([(0, length, 0, table)], 0, 0)
            q = torch.zeros(length, attn.n_head, 1, attn.head_dim, dtype=self.model.dtype, device=self.device)
            paged.layer(0)._prefill(q, self.cache.k[0], self.cache.v[0])
            length *= 2

    def paged_step(self, kv_slots: Tensor, n_decode: int, tables: Tensor, num_blocks: Tensor, positions: Tensor,
                   chunks: list[tuple[int, int, int, Tensor]], prompts=()) -> PagedStep:
        return PagedStep(self.cache, kv_slots, n_decode, tables, num_blocks, positions, chunks, self.backend,
                         self.masks, prompts=list(prompts))

    def execute(self, step: StepInput, prev: Tensor | None = None) -> Tensor:
        """Run ``step``; returns the float32 logits ``[len(step.sample) + len(step.score), vocab]`` of its
        sampled then scored rows
        (on a CUDA-graph replay, a view the next replay overwrites). ``prev``: the previous step's
        sampled tokens on the device, which ``step.prev_rows`` index. Call under
        ``torch.inference_mode()``."""
        assert prev is not None or not step.prev_rows, "a step fed by the previous one's tokens needs them"
        self.steps += 1
        if self.graphs is not None and step.decode_only and step.n_decode <= self.max_batch:
            with_deltas = any(v >= 0 for v in step.variants)
            if self.graphs.capturable(with_deltas):
                try:
                    return self.graphs.run(step, with_deltas, prev).float()
                except Exception:  # a capture that fails once fails again: serve eagerly (the step rewrites its KV)
                    log.exception("decoding by CUDA graph failed; decoding eagerly from now on")
                    self.graphs = None
        if self.piecewise is not None and not step.decode_only and self.piecewise.accepts(step):
            try:
                return self.piecewise.run(step, prev).float()
            except Exception:  # as above
                log.exception("a step with prefill chunks by piecewise CUDA graphs failed; "
                              "running such steps eagerly from now on")
                self.piecewise = None
        return self.forward(step, prev).float()

    def forward(self, step: StepInput, prev: Tensor | None = None) -> Tensor:
        """The eager step: logits ``[len(step.sample), vocab]`` in the model's dtype."""
        tokens, positions, paged, delta, rows = self.prepare(step)
        if step.prev_rows:
            feed_tokens(tokens, upload(step.prev_rows, torch.int64, tokens.device), prev)
        return self.model.forward_paged(tokens, positions, paged, delta, rows)

    def prefill_lists(self, chunks: list, n_decode: int, first_owner: int) -> PrefillLists:
        """:func:`~deltafleet.serve.attention.prefill_lists` of ``chunks`` on the device (two copies)."""
        h = prefill_lists(chunks, n_decode, self.cache.n_blocks + 1, self.block_size, first_owner)
        nq, n_chunk_blocks = len(h["kv_num"]), len(h["blocks"])
        ints = np.concatenate([h["kv_num"], h["full_num"], h["kv_idx"].ravel(), h["full_idx"].ravel(), h["seq"]])
        longs = np.concatenate([h["blocks"], h["owners"], h["logical"], h["pos"]])
        ints, longs = upload(ints, torch.int32, self.device), upload(longs, torch.int64, self.device)
        w = self.cache.n_blocks + 1
        kv_num, full_num, kv_idx, full_idx, seq = ints.split([nq, nq, nq * w, nq * w, h["length"]])
        blocks, owners, logical, pos = longs.split([n_chunk_blocks] * 3 + [h["length"]])
        return PrefillLists(h["length"], kv_num, kv_idx.view(nq, w), full_num, full_idx.view(nq, w),
                            blocks, owners, logical, seq, pos)

    def prepare(self, step: StepInput, deltas: bool = True) -> tuple[Tensor, Tensor, PagedStep, BatchDeltas | None,
                                                                     Tensor | None]:
        """``step`` on the device: ``(tokens, positions, paged step, deltas or None, rows that sample or
        None for all)``, the arguments of ``Transformer.forward_paged``; ``deltas=False`` leaves the
        deltas None (a piecewise graph reads the variants from its own buffer)."""
        dev = self.device
        as_long = lambda xs: upload(xs, torch.int64, dev)
        nd = step.n_decode
        tokens, positions, kv_slots = as_long(step.tokens), as_long(step.positions), as_long(step.kv_slots)
        if nd:
            dec_pos = positions[:nd]
            width, pad = max(len(t) for t in step.tables), 0
            if self.backend == "flex":
                # FlexAttention is compiled for fixed shapes: decode rows padded to a graph bucket and
                # tables to the full width, as a replay has them, or every row count would compile anew.
                width, pad = self.max_blocks, bucket(nd, self.max_batch) - nd
                dec_pos = torch.cat([dec_pos, dec_pos.new_zeros(pad)])
            tables = table_tensor(step.tables, width, pad, self.cache.scratch_block)
            tables = upload(tables, tables.dtype, dev)
            num_blocks = (dec_pos // self.block_size + 1).to(torch.int32)
        else:
            dec_pos = positions[:0]
            tables = torch.zeros(0, 1, dtype=torch.int32, device=dev)
            num_blocks = torch.zeros(0, dtype=torch.int32, device=dev)
        chunks, whole, prefill = [], {}, None
        bs = self.block_size
        if self.backend == "flex" and step.chunks:  # every chunk in one FlexAttention call
            prefill = self.prefill_lists(step.chunks, nd, tables.shape[0])
        for first, n, start, table in ([] if prefill is not None else step.chunks):
            if start == 0:  # a whole prompt (or its first chunk): attends to its own keys only
                whole.setdefault(n, []).append(first)
                continue
            logical = torch.arange(start + n, device=dev)
            ctx = as_long(table)[logical // bs] * bs + logical % bs
            chunks.append((first, n, start, ctx))
        prompts = [(n, firsts, None if len(firsts) == 1 else as_long([f + i for f in firsts for i in range(n)]))
                   for n, firsts in whole.items()]
        paged = self.paged_step(kv_slots, nd, tables, num_blocks, dec_pos, chunks, prompts)
        paged.prefill = prefill
        delta = None
        if deltas and any(v >= 0 for v in step.variants):
            delta = BatchDeltas(self.slots, as_long(step.variants), step.runs() or None)
        wanted = step.sample + step.score
        rows = None if wanted == list(range(len(step.tokens))) else as_long(wanted)
        return tokens, positions, paged, delta, rows
