"""The continuous-batching decode step as CUDA graphs, one per batch-size bucket (vLLM, gpt-fast).

A decode step of a small model, or of a big one at a small batch, is dozens of short kernels per
layer; launching them from Python costs more than running them. A CUDA graph records the launches
of one :meth:`Transformer.forward_rows <serve.model.Transformer.forward_rows>` once and replays
them with one call. A graph has fixed shapes and fixed addresses, so:

- the live batch of ``n`` rows is padded to a bucket ``B ≥ n`` (1, 2, 4, 8, … and ``max_batch``),
  one graph per bucket (and per "any variant in the batch": a batch of base rows only runs the
  plain ``F.linear`` path, as the eager step does);
- the step reads its inputs from static tensors (tokens, positions, cache rows, variant slots)
  that :meth:`DecodeGraphs.pad` overwrites in place before each replay; ``BatchDeltas`` is built
  from the static slot tensor inside the captured region, so its derived tensors are recomputed
  at every replay;
- padding rows run the base (slot −1) on one token at position 0 in a scratch row of the KV cache
  (the cache has ``max_batch + 1`` rows; the last is never given to a sequence), so they write
  nothing a real sequence reads;
- everything the graph reads stays where it was at capture: the KV cache is static, and the
  variant slots (serve/batch.py, ``DeltaSlots``) are stacked tensors allocated once, which
  ``put``/``free`` overwrite in place, so loading and evicting variants needs no re-capture.

A graph is captured lazily, on a bucket's first use, after two eager runs on a side stream (the
PyTorch CUDA-graphs recipe): they compile and autotune the Triton kernels for these shapes, and
allocate the kernels' split-K workspace, none of which may happen during capture. The eager runs
write the same keys/values the replay then writes again, so they change nothing.

Graphs are for CUDA in one process (``cuda_graphs`` in conf/serve.yaml); on the CPU, with tensor
parallelism (the other ranks run each step eagerly) or for a step that cannot be captured (see
:meth:`DecodeGraphs.capturable`) the scheduler runs the step eagerly, as it does for good if a
capture fails. The padding itself, :meth:`DecodeGraphs.pad` + :meth:`DecodeGraphs.forward_padded`,
runs anywhere, which is how it is tested without a GPU; the ``gpu`` tests of
tests/test_serve_graphs.py (``make test-gpu``) check graphs against the eager step on a GPU.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from deltafleet.serve.batch import BatchDeltas


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


class DecodeGraphs:
    """CUDA graphs of ``model.forward_rows`` over ``cache``, one per (bucket, any variant) pair.

    Args:
        model: the resident :class:`~deltafleet.serve.model.Transformer`.
        slots: the :class:`~deltafleet.serve.batch.DeltaSlots` the rows' variant slots index.
        cache: the scheduler's KV cache, one :class:`~deltafleet.serve.model.KVCache` per layer with
            ``max_batch + 1`` rows: rows ``[0, max_batch)`` hold sequences, row ``max_batch`` is
            the scratch row that padding rows write.

    Raises:
        ValueError: if the cache has fewer than 2 rows (no room for a sequence and the scratch row).
    """

    pad_token = 0  # what padding rows feed (any id of the vocabulary)

    def __init__(self, model, slots, cache: list):
        n_rows = cache[0].k.shape[0]
        if n_rows < 2:
            raise ValueError(f"the cache needs max_batch + 1 rows (the last for padding), got {n_rows}")
        self.model, self.slots, self.cache = model, slots, cache
        self.max_batch = self.scratch_row = n_rows - 1
        self.buckets = buckets(self.max_batch)
        # rows: tokens, positions, cache rows, variant slots (int64; BatchDeltas casts the slots)
        self.static = torch.zeros(4, self.max_batch, dtype=torch.int64, device=model.device)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Tensor, object]] = {}
        self.pool = None  # one memory pool for every bucket's graph: they never run at once
        self.replays = 0

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows (ValueError outside ``[1, max_batch]``)."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode batch has 1 to {self.max_batch} rows, got {n}")
        return next(b for b in self.buckets if b >= n)

    def pad(self, tokens: list[int], positions: list[int], rows: list[int], slots: list[int]) -> int:
        """Write a batch of ``n`` rows into the static inputs, padded to its bucket; return the bucket.

        Row ``b < n`` is sequence ``rows[b]`` (a cache row in ``[0, max_batch)``) feeding
        ``tokens[b]`` at ``positions[b]`` with variant slot ``slots[b]`` (−1: base). Rows
        ``n..bucket-1`` feed :attr:`pad_token` at position 0 into the scratch row with slot −1.

        Raises:
            ValueError: if the lists differ in length, or ``n`` is not in ``[1, max_batch]``.
        """
        n = len(tokens)
        if not len(positions) == len(rows) == len(slots) == n:
            raise ValueError(f"tokens, positions, rows and slots differ in length: "
                             f"{n}, {len(positions)}, {len(rows)}, {len(slots)}")
        b = self.bucket(n)
        k = b - n
        host = torch.tensor([tokens + [self.pad_token] * k, positions + [0] * k, rows + [self.scratch_row] * k,
                             slots + [-1] * k], dtype=torch.int64)
        self.static[:, :b].copy_(host)
        return b

    def forward_padded(self, bucket: int, with_deltas: bool) -> Tensor:
        """The eager step on the static inputs of ``bucket`` rows (what a graph records): logits
        ``[bucket, vocab]`` in the model's dtype; the rows past the real batch are padding.
        ``with_deltas=False`` runs every row on the base (the static slots are not read)."""
        tokens, positions, rows, slots = self.static[:, :bucket]
        delta = BatchDeltas(self.slots, slots) if with_deltas else None
        return self.model.forward_rows(tokens, positions, self.cache, rows, delta)

    def capturable(self, with_deltas: bool) -> bool:
        """Whether a step can be captured: on CUDA, and, for batches with variant rows, when the
        mixed-tenant linear runs the Triton op (bf16/fp16 and triton installed); the plain-torch
        reference waits for the device (``slot.unique()``) and cannot be captured."""
        if self.model.device.type != "cuda":
            return False
        if not with_deltas:
            return True
        from deltafleet import kernels

        return self.model.dtype in (torch.bfloat16, torch.float16) and bool(kernels._ops())

    def run(self, tokens: list[int], positions: list[int], rows: list[int], slots: list[int]) -> Tensor:
        """One decode step by graph replay (capturing the bucket's graph on first use); arguments
        as :meth:`pad`. Call under ``torch.inference_mode()``.

        Returns:
            logits ``[n, vocab]`` in the model's dtype: a view of the graph's output, which the next
            replay (of any bucket: the graphs share one memory pool) overwrites.

        Raises:
            RuntimeError: if :meth:`capturable` is False for this batch (not CUDA; variant rows
                without the Triton op); ValueError: as :meth:`pad`.
        """
        with_deltas = any(s >= 0 for s in slots)
        if not self.capturable(with_deltas):
            raise RuntimeError("this decode step cannot be captured as a CUDA graph (see DecodeGraphs.capturable)")
        b = self.pad(tokens, positions, rows, slots)
        key = (b, with_deltas)
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, with_deltas)
        graph, out, _ = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out[:len(tokens)]

    def _capture(self, bucket: int, with_deltas: bool) -> tuple[torch.cuda.CUDAGraph, Tensor, object]:
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile, autotune, allocate the split-K workspace: not during capture
                self.forward_padded(bucket, with_deltas)
        torch.cuda.current_stream(dev).wait_stream(side)
        # The graph holds the workspace's address; should a later, larger call replace it
        # (kernels/triton_bitdelta.py, _workspace), this reference keeps it allocated.
        triton_mod = sys.modules.get("deltafleet.kernels.triton_bitdelta")
        workspace = getattr(triton_mod, "_WORKSPACE", {}).get(dev)
        graph = torch.cuda.CUDAGraph()
        # thread_local: request threads may copy a variant into its slot meanwhile (other memory)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.forward_padded(bucket, with_deltas)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out, workspace
