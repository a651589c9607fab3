"""Decode-only engine steps as CUDA graphs, one per batch-size bucket (vLLM, gpt-fast).

A decode step of a small model, or of a big one at a small batch, is dozens of short kernels per
layer; launching them from Python costs more than running them. A CUDA graph records the launches
of one step of :class:`~deltafleet.serve.runner.ModelRunner` once and replays them with one call. A
graph has fixed shapes and fixed addresses, so:

- the live batch of ``n`` decode rows is padded to a bucket ``B ≥ n`` (1, 2, 4, 8, … and
  ``max_batch``), one graph per bucket (and per "any variant in the batch": a batch of base rows
  only runs the plain ``F.linear`` path, as the eager step does; and per block size of the grouped
  rows, :meth:`DecodeGraphs.block_m`);
- the step reads its inputs from static tensors (tokens, positions, cache slots, variant slots,
  block tables) that :meth:`DecodeGraphs.pad` overwrites in place before each replay; the attention
  metadata (FlexAttention's block mask) and ``BatchDeltas`` are built from them inside the captured
  region, so they are recomputed at every replay;
- padding rows run the base on one token at position 0 in the paged cache's scratch block
  (serve/attention.py), which no sequence owns;
- everything the graph reads stays where it was at capture: the paged cache is allocated once, and
  the variant slots (serve/batch.py, ``DeltaSlots``) are stacked tensors that ``put``/``free``
  overwrite in place, so loading and evicting variants needs no re-capture.

A graph is captured lazily, on a bucket's first use, after two eager runs on a side stream (the
PyTorch CUDA-graphs recipe): they compile FlexAttention and the Triton kernels for these shapes and
allocate the kernels' split-K workspace, none of which may happen during capture. The eager runs
write the same keys and values the replay then writes again, so they change nothing.

Steps with prefill chunks can run as piecewise graphs (:class:`PiecewiseGraphs`); steps that score
prompt tokens, steps on the CPU, under tensor parallelism (the other ranks run each step
eagerly) and steps that cannot be captured (:meth:`DecodeGraphs.capturable`) run eagerly, as every
step does for good if a capture fails. The padding itself (:meth:`DecodeGraphs.pad` +
:meth:`DecodeGraphs.forward_padded`) runs anywhere, which is how it is tested without a GPU; the
``gpu`` tests of tests/test_serve_graphs.py (``make test-gpu``) check replays against the eager step.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor

from deltafleet.serve.attention import PagedLayer, fill_tables, prefill_length
from deltafleet.kernels import segments_supported
from deltafleet.kernels.reference import ZERO_SLOT, max_segment_tiles, segment_tiles
from deltafleet.serve.batch import GROUPED_MIN_ROWS, BatchDeltas, with_decode_run
from deltafleet.serve.transfer import feed_tokens, upload


def kernel_workspace(dev):
    """The split-K workspace the Triton kernels write on ``dev`` (kernels/triton_bitdelta.py,
    ``_workspace``), or None. A graph holds its address: should a later, larger call replace it, a
    reference kept with the graph keeps it allocated."""
    triton_mod = sys.modules.get("deltafleet.kernels.triton_bitdelta")
    return getattr(triton_mod, "_WORKSPACE", {}).get(dev)


def in_graphs():
    """``deltafleet.kernels.decode_chain.in_graphs``: a graph's warm-up and capture take the decode
    chain (imported here, on CUDA only: CPU callers never import triton)."""
    from deltafleet.kernels.decode_chain import in_graphs as chain_in_graphs

    return chain_in_graphs()


def buckets(max_batch: int) -> list[int]:
    """The padded batch sizes for ``max_batch`` rows: powers of two below it, then ``max_batch``
    (``buckets(12) == [1, 2, 4, 8, 12]``). Raises ValueError if ``max_batch < 1``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket(n: int, max_batch: int) -> int:
    """The smallest of :func:`buckets` holding ``n ≤ max_batch`` rows."""
    return min(1 << (n - 1).bit_length(), max_batch)


class DecodeGraphs:
    """CUDA graphs of ``runner``'s decode-only steps, one per (bucket, any variant, block size of the
    grouped rows) key.

    Args:
        runner: the :class:`~deltafleet.serve.runner.ModelRunner` (its model, delta slots, paged cache).
    """

    pad_token = 0  # what padding rows feed (any id of the vocabulary)

    def __init__(self, runner):
        self.runner = runner
        self.max_batch = runner.max_batch
        self.buckets = buckets(self.max_batch)
        dev = runner.device
        # rows: tokens, positions, cache slots, variant slots; and the previous step's row of each token
        # still on the device (StepInput.prev_rows), read outside the graph
        self.static = torch.zeros(5, self.max_batch, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(self.max_batch, runner.max_blocks, dtype=torch.int32, device=dev)
        # Host staging of the same, pinned on CUDA so the copies do not wait for the device: a
        # pageable copy would first drain the stream, leaving the GPU idle while the next step is
        # prepared. ``_copied`` marks when the last copies have read the staging buffers.
        pin = dev.type == "cuda"
        self._host = torch.zeros(5, self.max_batch, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(self.max_batch, runner.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        # (bucket, any variant, block size of the grouped rows or None) → graph, output, workspace
        self.graphs: dict[tuple[int, bool, int | None], tuple[torch.cuda.CUDAGraph, Tensor, object]] = {}
        self.pool = None  # one memory pool for every bucket's graph: they never run at once
        self.replays = 0

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows (ValueError outside ``[1, max_batch]``)."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode batch has 1 to {self.max_batch} rows, got {n}")
        return bucket(n, self.max_batch)

    def pad(self, step) -> int:
        """Write the decode rows of ``step`` (a :class:`~deltafleet.serve.runner.StepInput` without
        prefill chunks) into the static inputs, padded to its bucket; return the bucket. Padding rows
        feed :attr:`pad_token` at position 0 into the scratch block, on the base.

        Raises:
            ValueError: if the step has prefill chunks, or ``n`` is not in ``[1, max_batch]``.
        """
        if step.chunks:
            raise ValueError("a step with prefill chunks is not replayed as a graph")
        n = step.n_decode
        b = self.bucket(n)
        scratch = self.runner.cache.scratch_block
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the buffers
        host = self._host.numpy()
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = step.tokens, step.positions, step.kv_slots, step.variants
        host[4, :n] = step.prev_rows or -1
        host[:, n:b] = np.array([[self.pad_token], [0], [scratch * self.runner.block_size], [-1], [-1]])
        fill_tables(self._host_tables.numpy()[:b], step.tables, scratch)
        self.static.copy_(self._host, non_blocking=True)  # whole: a column slice is not contiguous
        self.tables[:b].copy_(self._host_tables[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return b

    def forward_padded(self, bucket: int, with_deltas: bool, block_m: int | None = None) -> Tensor:
        """The eager step on the static inputs of ``bucket`` rows (what a graph records): logits
        ``[bucket, vocab]`` in the model's dtype; the rows past the real batch are padding.
        ``with_deltas=False`` runs every row on the base (the static variant slots are not read);
        ``block_m``: the grouped rows' block size (:meth:`block_m`; None: the row count's default)."""
        r = self.runner
        tokens, positions, kv_slots, variants = self.static[:4, :bucket]
        num_blocks = (positions // r.block_size + 1).to(torch.int32)
        step = r.paged_step(kv_slots, bucket, self.tables[:bucket], num_blocks, positions, [])
        delta = BatchDeltas(r.slots, variants, block_m=block_m) if with_deltas else None
        return r.model.forward_paged(tokens, positions, step, delta)

    def block_m(self, bucket: int, variants: list[int]) -> int | None:
        """The block size a bucket's grouped rows take for these rows' variants (host side:
        ``triton_grouped.decode_block_m``), or None where the rows are not grouped (fewer than
        ``GROUPED_MIN_ROWS`` rows, or not on a GPU)."""
        if bucket < GROUPED_MIN_ROWS or self.runner.device.type != "cuda" or not self.runner.slots.small_blocks:
            return None
        from deltafleet.kernels.triton_grouped import decode_block_m

        return decode_block_m(variants, self.runner.slots.n_slots, self.runner.device, bucket)

    def block_sizes(self, bucket: int) -> list[int | None]:
        """Every :meth:`block_m` a bucket's batches with variant rows can take (what
        :meth:`capture_all` captures): those of one variant's run of each length up to the bucket
        (or the 64 rows of a long block, past which runs repeat), which reach every block size a
        batch of several variants can."""
        return sorted({self.block_m(bucket, [0] * run) for run in range(1, min(bucket, 64) + 1)},
                      key=lambda b: b or 0)

    def capture_all(self) -> int:
        """Capture every bucket's graph now, base-only and (where :meth:`capturable`) with variants,
        on padding rows (the scratch block, the base); returns the graphs captured. A server calls
        it before it serves (vLLM does the same), so no request waits for a capture."""
        scratch = self.runner.cache.scratch_block * self.runner.block_size
        kinds = [False] + ([True] if self.capturable(True) else [])
        n = 0
        for b in self.buckets:
            for with_deltas in kinds:
                for bm in self.block_sizes(b) if with_deltas else [None]:
                    if (b, with_deltas, bm) in self.graphs:
                        continue
                    self.static[:, :b].copy_(torch.tensor([[self.pad_token], [0], [scratch], [-1], [-1]]))
                    self.tables[:b].fill_(self.runner.cache.scratch_block)
                    self.graphs[b, with_deltas, bm] = self._capture(b, with_deltas, bm)
                    n += 1
        return n

    def capturable(self, with_deltas: bool) -> bool:
        """Whether a step can be captured: on CUDA, and, for batches with variant rows, when the
        mixed-tenant linear runs the Triton op (bf16/fp16 and triton installed); the plain-torch
        reference waits for the device (``slot.unique()``) and cannot be captured."""
        model = self.runner.model
        if model.device.type != "cuda":
            return False
        if not with_deltas:
            return True
        from deltafleet.kernels import linear

        return model.dtype in (torch.bfloat16, torch.float16) and bool(linear._ops())

    def run(self, step, with_deltas: bool, prev: Tensor | None = None) -> Tensor:
        """One decode step by graph replay (capturing the bucket's graph on first use); ``prev``: the
        previous step's sampled tokens, which ``step.prev_rows`` index. Call under
        ``torch.inference_mode()``.

        Returns:
            logits ``[n, vocab]`` in the model's dtype: a view of the graph's output, which the next
            replay (of any bucket: the graphs share one memory pool) overwrites.

        Raises:
            RuntimeError: if :meth:`capturable` is False for this batch; ValueError: as :meth:`pad`.
        """
        if not self.capturable(with_deltas):
            raise RuntimeError("this decode step cannot be captured as a CUDA graph (see DecodeGraphs.capturable)")
        b = self.pad(step)
        if step.prev_rows:
            n = step.n_decode
            feed_tokens(self.static[0, :n], self.static[4, :n], prev)
        key = (b, with_deltas, self.block_m(b, step.variants) if with_deltas else None)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out, _ = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out[:step.n_decode]

    def _capture(self, bucket: int, with_deltas: bool, block_m: int | None = None
                 ) -> tuple[torch.cuda.CUDAGraph, Tensor, object]:
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), in_graphs():
            for _ in range(2):  # compile, autotune, allocate the split-K workspace: not during capture
                self.forward_padded(bucket, with_deltas, block_m)
        torch.cuda.current_stream(dev).wait_stream(side)
        workspace = kernel_workspace(dev)
        graph = torch.cuda.CUDAGraph()
        # thread_local: request threads may copy a variant into its slot meanwhile (other memory)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"), in_graphs():
            out = self.forward_padded(bucket, with_deltas, block_m)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out, workspace


def token_buckets(max_tokens: int, first: int = 16, fine_from: int = 256) -> list[int]:
    """The padded token counts of steps with prefill chunks: ``first``, twice that, … up to
    ``fine_from``, then steps of a quarter of the power of two below (``fine_from`` 256: 320, 384,
    448, 512, 640, …), below ``max_tokens``, then ``max_tokens`` (``token_buckets(100) == [16, 32,
    64, 100]``; ``token_buckets(1024)`` has 13 buckets).

    A step's GEMMs cost about its padded tokens once they are bound by the tensor cores (from a few
    hundred tokens at 7B shapes), so doubling there would pay up to twice a step's work for its
    padding; the quarter steps bound it to 25% at the price of more graphs to capture. Below
    ``fine_from`` the steps are bound by the weights' bytes, and every bucket up to a server's
    ``max_batch`` is also a decode row count FlexAttention is compiled for, so they stay powers of
    two."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
    out, b = [], first
    while b < max_tokens:
        out.append(b)
        b += b if b < fine_from else 1 << (b.bit_length() - 3)
    return out + [max_tokens]


# buckets of at least this many tokens multiply a step's rows by tiles of one variant each
# (PiecewiseGraphs.segmented); below, a step is mostly decode rows: one base GEMM over all its tokens
# (cuBLAS) plus the grouped sign products
SEGMENT_MIN_TOKENS = 512


class PiecewiseGraphs:
    """Steps with prefill chunks as CUDA graphs of everything but attention (vLLM's piecewise CUDA
    graphs).

    Attention's shapes follow a step's chunks, so such a step cannot be one graph; everything else in a
    layer is shaped by the step's token count alone. With the tokens padded to a bucket
    (:func:`token_buckets`), each bucket has one graph per *segment*: segment 0 is the embedding and
    layer 0 up to its attention; segment ``l`` is layer ``l − 1`` from its attention's output on, then
    layer ``l`` up to its attention; segment ``L`` is the last layer's rest, the final norm and the head
    over the sampling rows. Between two replays attention runs eagerly on the real tokens
    (serve/attention.py: the cache writes, with the rotation of q and k on CUDA; the decode rows; the
    chunks, in one FlexAttention call), reading ``q, k, v`` from static buffers and writing its output
    into one. A step then costs ``L + 1`` replays and ``L`` attention
    calls from Python, where the eager step makes every launch of every layer.

    Every buffer a segment reads or writes is allocated once, for ``max_tokens`` tokens, and a bucket
    uses its first rows (fixed addresses); what a segment allocates inside its graph is dead by the
    time the next one runs, so all segments of all buckets share one memory pool. Padding tokens run
    token 0 at position 0; attention never reads them, and their rows are dropped. Graphs are
    captured on a bucket's first use, after one eager pass of its segments on a side stream (it
    compiles the fused functions for the shapes); ``capture=False`` runs the same segments eagerly
    (how it is tested off the GPU).

    Rows of variants: each token's variant slot is a static buffer too, and the segments multiply
    through :class:`~deltafleet.serve.batch.BatchDeltas` on it (the mixed-variant kernels, grouped by
    variant from :data:`~deltafleet.serve.batch.GROUPED_MIN_ROWS` tokens on), so the variant layout is
    data, as in a decode graph; a bucket has one set of graphs for base-only steps (the plain
    ``F.linear`` path) and one for steps with a variant. Segment 0 groups the tokens by variant into
    static buffers (``deltafleet.kernels.triton_grouped.group_rows``) that every later segment reads.
    """

    def __init__(self, runner, max_tokens: int, max_sample: int, capture: bool = True):
        m = runner.model
        a, dev, dt = m.args, runner.device, m.dtype
        self.runner, self.model = runner, m
        self.max_tokens, self.max_sample, self.capture = max_tokens, max_sample, capture
        self.buckets = token_buckets(max_tokens)
        attn = m.layers[0].self_attn
        n_head, n_kv, hd = attn.n_head, attn.n_kv, attn.head_dim
        t = max_tokens
        self.tokens = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.variants = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.groups: dict[int, object] = {}  # bucket -> static RowGroups (tokens grouped by variant)
        self.rows = torch.zeros(max_sample, dtype=torch.int64, device=dev)
        self.cos = torch.zeros(t, 1, 1, hd, dtype=dt, device=dev)
        self.sin = torch.zeros(t, 1, 1, hd, dtype=dt, device=dev)
        self.x = torch.zeros(t, 1, a.dim, dtype=dt, device=dev)
        self.q = torch.zeros(t, n_head, 1, hd, dtype=dt, device=dev)
        self.k = torch.zeros(t, n_kv, 1, hd, dtype=dt, device=dev)
        self.v = torch.zeros(t, n_kv, 1, hd, dtype=dt, device=dev)
        self.attn = torch.zeros(t, n_head, 1, hd, dtype=dt, device=dev)
        self.logits = torch.zeros(max_sample, a.vocab_size, dtype=dt, device=dev)
        pin = dev.type == "cuda"
        self._host = torch.zeros(3, t, dtype=torch.int64, pin_memory=pin)
        self._host_rows = torch.zeros(max_sample, dtype=torch.int64, pin_memory=pin)
        # buckets of SEGMENT_MIN_TOKENS tokens or more, with variants: the rows' tiles (one per
        # SEGMENT_ROWS rows of the decode rows and of a variant's chunks; the scheduler sorts them by
        # variant) and the slots of the first D = min(bucket, max_batch) rows, the decode rows
        # (BatchDeltas.segments)
        self.decode_rows = min(t, runner.max_batch)
        self.tiles = torch.zeros(self._n_tiles(t), 3, dtype=torch.int32, device=dev)
        self.decode_variants = torch.full((self.decode_rows,), -1, dtype=torch.int64, device=dev)
        self._host_tiles = torch.zeros(tuple(self.tiles.shape), dtype=torch.int32, pin_memory=pin)
        self._host_decode = torch.zeros(self.decode_rows, dtype=torch.int64, pin_memory=pin)
        self._segmented: dict[int, bool] = {}
        self._tiles_ok: bool | None = None  # _tiles_run, asked once (it depends on the model only)
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.replays = 0
        self._workspaces = []  # the kernels' split-K workspaces the graphs were captured with (kept alive)
        # On CUDA with triton, attention rotates q and k as it writes the cache (serve/rope_cache.py):
        # the segments hand it q and k unrotated.
        self.rotates = PagedLayer.rotates(self.q)

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` tokens (ValueError outside ``[1, max_tokens]``)."""
        if not 1 <= n <= self.max_tokens:
            raise ValueError(f"a step has 1 to {self.max_tokens} tokens here, got {n}")
        return next(b for b in self.buckets if b >= n)

    def capture_all(self, with_deltas: bool) -> int:
        """Capture every bucket's segments now, base-only and, with ``with_deltas``, with variants
        (on token 0 at position 0, the base); returns the buckets captured. See
        :meth:`DecodeGraphs.capture_all`."""
        n = 0
        for b in self.buckets:
            for kind in (False, True) if with_deltas else (False,):
                if (b, kind) in self.graphs:
                    continue
                self.tokens[:b].zero_()
                self.positions[:b].zero_()
                self.variants[:b].fill_(-1)
                self.rows.zero_()
                self.tiles.zero_()  # no tile: no row of a larger bucket's table is written past this one
                self.decode_variants.fill_(-1)
                self.graphs[b, kind] = self._capture(b, kind)
                n += 1
        return n

    def accepts(self, step) -> bool:
        """Whether ``step`` (a :class:`~deltafleet.serve.runner.StepInput`) runs here: at most
        ``max_tokens`` tokens, at most ``max_sample`` sampling rows, no scored rows."""
        return (0 < len(step.tokens) <= self.max_tokens and len(step.sample) <= self.max_sample
                and not step.score)

    def segmented(self, b: int) -> bool:
        """Whether bucket ``b``'s steps with variants multiply their rows by tiles of one variant each
        (``bitdelta_linear_segments``: W read about once, each token's FLOPs once; the decode rows by
        the base's tiles, their variants' sign products added after), rather than every token by the
        base GEMM plus the grouped sign products (a second pass of a prompt's FLOPs): from
        :data:`SEGMENT_MIN_TOKENS` tokens on, where the kernel runs and no variant has column scales."""
        if b not in self._segmented:
            self._segmented[b] = (b >= SEGMENT_MIN_TOKENS and b > self.decode_rows and not self.runner.slots.betas
                                  and (not self.capture or self._tiles_run()))  # eagerly (tests): tile by tile
        return self._segmented[b]

    def _n_tiles(self, b: int) -> int:
        """Entries of the tile table a bucket of ``b`` tokens uses: the decode rows, one run per slot
        and the base (the scheduler sorts the chunks by variant), and the padding."""
        return max_segment_tiles(b, self.runner.slots.n_slots + 3)

    def _tiles_run(self) -> bool:
        """Whether the tile kernel runs for every linear of a layer (``segments_supported``: on a
        Hopper GPU, K a multiple of 128, ...): a graph cannot fall back to the tiles one by one,
        which reads the table on the host."""
        if self._tiles_ok is None:
            table = self.runner.slots
            mods = [m for m in self.model.layers[0].modules() if getattr(m, "delta_kind", None) == "linear"]
            self._tiles_ok = all(segments_supported(self.x.new_empty(1, m.weight.shape[1]), m.weight,
                                                    table.signs[f"{m.name}.weight"]) for m in mods)
        return self._tiles_ok

    def _deltas(self, b: int, i: int) -> BatchDeltas:
        """The variants of bucket ``b``'s tokens, for segment ``i``: segment 0 groups them (where the
        grouped kernels run) into the bucket's static :class:`RowGroups`, later segments read those.
        A :meth:`segmented` bucket groups only its decode rows (``decode_variants``)."""
        from deltafleet.kernels.triton_grouped import RowGroups, group_rows, max_blocks

        table, slots = self.runner.slots, self.variants[:b]
        delta = BatchDeltas(table, slots)
        prefill = True
        if self.segmented(b):
            slots = self.decode_variants
            delta = BatchDeltas(table, self.variants[:b], segments=(self.tiles[:self._n_tiles(b)], slots))
            prefill = False
        if not BatchDeltas.grouped(self.x[:slots.shape[0], 0], sign_products=not prefill):
            return delta
        if b not in self.groups:
            bm, lm = table.grouping(slots.shape[0], slots.device, prefill=prefill)
            zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=slots.device)
            m = slots.shape[0]
            order, key = zeros(m), zeros(m)
            long = RowGroups(order, key, zeros(m // lm), lm) if lm else None
            self.groups[b] = RowGroups(order, key, zeros(max_blocks(m, table.n_slots, bm, lm)), bm, long)
        static = self.groups[b]
        if i == 0:
            g = group_rows(slots, table.n_slots, static.block_m, static.long.block_m if static.long else None)
            static.order.copy_(g.order)
            static.key.copy_(g.key)
            for part, new in zip(static.parts(), g.parts()):
                part.first.copy_(new.first)
        delta.use_groups(static)
        return delta

    def segment(self, b: int, i: int, with_deltas: bool = False) -> None:
        """Segment ``i`` of bucket ``b`` (see the class docstring), on the static buffers; with
        ``with_deltas`` through each token's variant."""
        m = self.model
        n_layers = len(m.layers)
        delta = self._deltas(b, i) if with_deltas else None
        if i == 0:
            cos, sin = m.rope(self.positions[:b])
            self.cos[:b].copy_(cos)
            self.sin[:b].copy_(sin)
            x, r = m.embed_tokens(self.tokens[:b, None], delta), None
        else:
            prev = m.layers[i - 1]
            x, r = prev.after_attention(self.x[:b], prev.self_attn.out(self.attn[:b], delta), delta)
        if i < n_layers:
            h, q, k, v = m.layers[i].before_attention(x, self.cos[:b], self.sin[:b], delta, r, not self.rotates)
            self.x[:b].copy_(h)
            self.q[:b].copy_(q)
            self.k[:b].copy_(k)
            self.v[:b].copy_(v)
        else:
            s = min(b, self.max_sample)
            rows = self.rows[:s]
            self.logits[:s].copy_(m.head(x[rows], None if delta is None else delta.select(rows), r[rows])[:, 0])

    def run(self, step, prev: Tensor | None = None) -> Tensor:
        """Run ``step`` (:meth:`accepts` it); returns its logits ``[len(step.sample), vocab]`` in the
        model's dtype: a view of a static buffer that the next step overwrites. ``prev``: the previous
        step's sampled tokens, which ``step.prev_rows`` index. Call under ``torch.inference_mode()``."""
        n = len(step.tokens)
        b = self.bucket(n)
        with_deltas = any(v >= 0 for v in step.variants)
        self._stage(step, b, prev)
        _, _, paged, _, _ = self.runner.prepare(step, deltas=False)
        graphs = self._graph(b, with_deltas) if self.capture else None
        for i in range(len(self.model.layers) + 1):
            if graphs is None:
                self.segment(b, i, with_deltas)
            else:
                graphs[i].replay()
            if i < len(self.model.layers):
                rope = (self.cos[:n], self.sin[:n]) if self.rotates else None
                self.attn[:n].copy_(paged.layer(i).attend(self.q[:n], self.k[:n], self.v[:n], rope))
        self.replays += graphs is not None
        return self.logits[:len(step.sample)]

    def _stage(self, step, b: int, prev: Tensor | None = None) -> None:
        """Write ``step``'s tokens, positions, variants and sampling rows, padded to bucket ``b``, into
        the pinned staging buffers (with :meth:`_stage_more`'s), and copy them to the static ones; the
        decode rows that ``step.prev_rows`` names take their tokens from ``prev``."""
        n, s = len(step.tokens), len(step.sample)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        host = self._host.numpy()
        host[0, :n], host[1, :n], host[2, :n] = step.tokens, step.positions, step.variants
        host[:2, n:b] = 0
        host[2, n:b] = -1  # padding tokens: the base
        rows = self._host_rows.numpy()
        rows[:s] = step.sample
        rows[s:] = 0
        self.tokens[:b].copy_(self._host[0, :b], non_blocking=True)
        self.positions[:b].copy_(self._host[1, :b], non_blocking=True)
        self.variants[:b].copy_(self._host[2, :b], non_blocking=True)
        self.rows.copy_(self._host_rows, non_blocking=True)
        if step.prev_rows:
            feed_tokens(self.tokens[:n], upload(step.prev_rows, torch.int64, self.tokens.device), prev)
        if self.segmented(b) and any(v >= 0 for v in step.variants):
            self._stage_tiles(step, b)
        self._stage_more(step, b)
        if self._copied is not None:
            self._copied.record()

    def _stage_tiles(self, step, b: int) -> None:
        """The tiles of ``step``'s rows (``batch.with_decode_run``: its decode rows as the base's,
        then its prompt chunks) and of its padding tokens (zeros: no row is left unwritten), and the
        slots of its decode rows, staged and copied."""
        n = len(step.tokens)
        runs = with_decode_run(step.runs(), step.n_decode)
        tiles = segment_tiles(runs + ([(n, b, ZERO_SLOT)] if n < b else []))
        n_tiles = self._n_tiles(b)
        if len(tiles) > n_tiles:  # rows would be left unwritten
            raise RuntimeError(f"{len(tiles)} tiles for a bucket of {n_tiles}: prompt chunks not sorted by variant")
        host = self._host_tiles.numpy()
        host[:len(tiles)] = tiles
        host[len(tiles):n_tiles] = 0
        nd = step.n_decode
        dec = self._host_decode.numpy()
        dec[:nd] = step.variants[:nd]
        dec[nd:] = -1
        self.tiles[:n_tiles].copy_(self._host_tiles[:n_tiles], non_blocking=True)
        self.decode_variants.copy_(self._host_decode, non_blocking=True)

    def _stage_more(self, step, b: int) -> None:
        """More static inputs of the step (a subclass's), staged and copied as :meth:`_stage`'s."""

    def _graph(self, b: int, with_deltas: bool):
        """The graph(s) of bucket ``b``, captured on first use."""
        key = (b, with_deltas)
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, with_deltas)
        return self.graphs[key]

    def _capture(self, b: int, with_deltas: bool) -> list[torch.cuda.CUDAGraph]:
        dev = self.runner.device
        n_seg = len(self.model.layers) + 1
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), in_graphs():  # compile the fused functions for these shapes: not during capture
            for i in range(n_seg):
                self.segment(b, i, with_deltas)
        torch.cuda.current_stream(dev).wait_stream(side)
        self._workspaces.append(kernel_workspace(dev))
        graphs = []
        for i in range(n_seg):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"), in_graphs():
                self.segment(b, i, with_deltas)
            if self.pool is None:
                self.pool = g.pool()
            graphs.append(g)
        return graphs


class FullGraphs(PiecewiseGraphs):
    """Steps with prefill chunks as one CUDA graph each, attention included (vLLM's full CUDA graphs
    for mixed batches), with the ``flex`` attention backend.

    A :class:`PiecewiseGraphs` step leaves attention to Python between its segments, and so pays a
    few launches and two compiled FlexAttention calls per layer from the host, about as long as the
    GPU takes for a step of a few hundred tokens. Here the attention's inputs are static tensors
    too, so a bucket of ``b`` tokens is one graph: every token is rotated and written to the cache
    (padding tokens to the scratch block), the first ``R = min(b, max_batch)`` tokens go through
    FlexAttention's decoding call (the step's decode rows; the rest of the ``R`` read the scratch
    block) and all ``b`` through its prefill call over the cache (serve/attention.py,
    :class:`~deltafleet.serve.attention.PrefillLists`; decode rows and padding see nothing there);
    each decode row keeps the decoding call's output. Per step the host writes the inputs and the
    block lists into pinned buffers, copies them, and replays one graph.
    """

    def __init__(self, runner, max_tokens: int, max_sample: int, capture: bool = True):
        super().__init__(runner, max_tokens, max_sample, capture)
        from deltafleet.serve.attention import PREFILL_Q_BLOCK

        t, dev, r = max_tokens, runner.device, runner
        self.rows_max = min(t, r.max_batch)
        self.width = r.cache.n_blocks + 1
        nq = -(-t // PREFILL_Q_BLOCK)
        rm, w = self.rows_max, self.width
        # int64: cache slots [t], decode positions [R], chunk blocks / owners / logical [w], positions [t]
        self._long_sizes = [t, rm, w, w, w, t]
        # int32: decode tables [R · max_blocks], decode rows [R], kv_num, full_num [nq], kv_idx, full_idx
        # [nq · w], the tokens' owners [t]
        self._int_sizes = [rm * r.max_blocks, rm, nq, nq, nq * w, nq * w, t]
        pin = dev.type == "cuda"
        self._host_longs = torch.zeros(sum(self._long_sizes), dtype=torch.int64, pin_memory=pin)
        self._host_ints = torch.zeros(sum(self._int_sizes), dtype=torch.int32, pin_memory=pin)
        self.longs = torch.zeros(sum(self._long_sizes), dtype=torch.int64, device=dev)
        self.ints = torch.zeros(sum(self._int_sizes), dtype=torch.int32, device=dev)
        # the longest padded query (prefill_length): eager steps and the attention's compile reach it too
        r.masks.reserve(prefill_length(t), fixed=True)

    def _views(self, longs: Tensor, ints: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        return list(longs.split(self._long_sizes)), list(ints.split(self._int_sizes))

    def paged(self, b: int):
        """The static :class:`~deltafleet.serve.attention.PagedStep` of bucket ``b`` (its tensors are
        views of the static buffers)."""
        from deltafleet.serve.attention import PREFILL_Q_BLOCK, PrefillLists

        r = self.runner
        rows, nq, w = min(b, r.max_batch), -(-b // PREFILL_Q_BLOCK), self.width
        (slots, dec_pos, blocks, owners, logical, pos), (tables, is_dec, kv_num, full_num, kv_idx, full_idx, seq) = \
            self._views(self.longs, self.ints)
        tables = tables.view(self.rows_max, r.max_blocks)[:rows]
        num_blocks = (dec_pos[:rows] // r.block_size + 1).to(torch.int32)
        step = r.paged_step(slots[:b], rows, tables, num_blocks, dec_pos[:rows], [])
        step.prefill = PrefillLists(b, kv_num[:nq], kv_idx.view(-1, w)[:nq], full_num[:nq], full_idx.view(-1, w)[:nq],
                                    blocks, owners, logical, seq[:b], pos[:b])
        step.decode_rows = is_dec[:rows] != 0
        return step

    def step(self, b: int, with_deltas: bool) -> None:
        """The whole step of bucket ``b`` on the static buffers (what a graph records)."""
        paged = self.paged(b)
        n_layers = len(self.model.layers)
        for i in range(n_layers + 1):
            self.segment(b, i, with_deltas)
            if i < n_layers:
                rope = (self.cos[:b], self.sin[:b]) if self.rotates else None
                self.attn[:b].copy_(paged.layer(i).attend(self.q[:b], self.k[:b], self.v[:b], rope))

    def capture_all(self, with_deltas: bool) -> int:
        self._host_longs.zero_()
        self._host_ints.zero_()
        longs, _ = self._views(self._host_longs, self._host_ints)
        longs[0].fill_(self.runner.cache.scratch_block * self.runner.block_size)  # every token: the scratch block
        self.longs.copy_(self._host_longs)
        self.ints.copy_(self._host_ints)
        return super().capture_all(with_deltas)

    def run(self, step, prev: Tensor | None = None) -> Tensor:
        b = self.bucket(len(step.tokens))
        with_deltas = any(v >= 0 for v in step.variants)
        self._stage(step, b, prev)
        if not self.capture:
            self.step(b, with_deltas)
        else:
            self._graph(b, with_deltas).replay()
            self.replays += 1
        return self.logits[:len(step.sample)]

    def _stage_more(self, step, b: int) -> None:
        """Attention's static inputs: cache slots, the decode rows' tables and positions, the prefill
        block lists (padding tokens write the scratch block; rows past the decode rows read it)."""
        from deltafleet.serve.attention import fill_tables, prefill_lists

        n, nd, r = len(step.tokens), step.n_decode, self.runner
        rows = min(b, r.max_batch)
        h = prefill_lists(step.chunks, 0, self.width, r.block_size, rows, length=b)
        (slots, dec_pos, blocks, owners, logical, pos), (tables, is_dec, kv_num, full_num, kv_idx, full_idx, seq) = \
            (list(map(Tensor.numpy, v)) for v in self._views(self._host_longs, self._host_ints))
        scratch = r.cache.scratch_block
        slots[:n], slots[n:b] = step.kv_slots, scratch * r.block_size
        dec_pos[:nd], dec_pos[nd:rows] = step.positions[:nd], 0
        fill_tables(tables.reshape(self.rows_max, r.max_blocks)[:rows], step.tables, scratch)
        is_dec[:nd], is_dec[nd:rows] = 1, 0
        m = len(h["blocks"])
        blocks[:m], blocks[m:] = h["blocks"], scratch + 1  # the owner table's sink entry
        owners[:m], logical[:m] = h["owners"], h["logical"]
        nq = len(h["kv_num"])
        kv_num[:nq], full_num[:nq] = h["kv_num"], h["full_num"]
        kv_idx.reshape(-1, self.width)[:nq], full_idx.reshape(-1, self.width)[:nq] = h["kv_idx"], h["full_idx"]
        seq[:b], pos[:b] = h["seq"], h["pos"]
        self.longs.copy_(self._host_longs, non_blocking=True)
        self.ints.copy_(self._host_ints, non_blocking=True)

    def _capture(self, b: int, with_deltas: bool) -> torch.cuda.CUDAGraph:
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), in_graphs():  # compile for these shapes: not during capture
            for _ in range(2):
                self.step(b, with_deltas)
        torch.cuda.current_stream(dev).wait_stream(side)
        self._workspaces.append(kernel_workspace(dev))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"), in_graphs():
            self.step(b, with_deltas)
        if self.pool is None:
            self.pool = g.pool()
        return g
