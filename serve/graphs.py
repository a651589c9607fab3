"""Decode-only engine steps as CUDA graphs, one per batch-size bucket (vLLM, gpt-fast).

A decode step of a small model, or of a big one at a small batch, is dozens of short kernels per
layer; launching them from Python costs more than running them. A CUDA graph records the launches
of one step of :class:`~deltafleet.serve.runner.ModelRunner` once and replays them with one call. A
graph has fixed shapes and fixed addresses, so:

- the live batch of ``n`` decode rows is padded to a bucket ``B ≥ n`` (1, 2, 4, 8, … and
  ``max_batch``), one graph per bucket (and per "any variant in the batch": a batch of base rows
  only runs the plain ``F.linear`` path, as the eager step does);
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

Steps with prefill chunks, steps on the CPU, under tensor parallelism (the other ranks run each step
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

from deltafleet.serve.attention import fill_tables
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


def bucket(n: int, max_batch: int) -> int:
    """The smallest of :func:`buckets` holding ``n ≤ max_batch`` rows."""
    return min(1 << (n - 1).bit_length(), max_batch)


class DecodeGraphs:
    """CUDA graphs of ``runner``'s decode-only steps, one per (bucket, any variant) pair.

    Args:
        runner: the :class:`~deltafleet.serve.runner.ModelRunner` (its model, delta slots, paged cache).
    """

    pad_token = 0  # what padding rows feed (any id of the vocabulary)

    def __init__(self, runner):
        self.runner = runner
        self.max_batch = runner.max_batch
        self.buckets = buckets(self.max_batch)
        dev = runner.device
        # rows: tokens, positions, cache slots, variant slots
        self.static = torch.zeros(4, self.max_batch, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(self.max_batch, runner.max_blocks, dtype=torch.int32, device=dev)
        # Host staging of the same, pinned on CUDA so the copies do not wait for the device: a
        # pageable copy would first drain the stream, leaving the GPU idle while the next step is
        # prepared. ``_copied`` marks when the last copies have read the staging buffers.
        pin = dev.type == "cuda"
        self._host = torch.zeros(4, self.max_batch, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(self.max_batch, runner.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Tensor, object]] = {}
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
        k = b - n
        scratch = self.runner.cache.scratch_block
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the buffers
        host = self._host.numpy()
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = step.tokens, step.positions, step.kv_slots, step.variants
        host[:, n:b] = np.array([[self.pad_token], [0], [scratch * self.runner.block_size], [-1]])
        fill_tables(self._host_tables.numpy()[:b], step.tables, scratch)
        self.static[:, :b].copy_(self._host[:, :b], non_blocking=True)
        self.tables[:b].copy_(self._host_tables[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return b

    def forward_padded(self, bucket: int, with_deltas: bool) -> Tensor:
        """The eager step on the static inputs of ``bucket`` rows (what a graph records): logits
        ``[bucket, vocab]`` in the model's dtype; the rows past the real batch are padding.
        ``with_deltas=False`` runs every row on the base (the static variant slots are not read)."""
        r = self.runner
        tokens, positions, kv_slots, variants = self.static[:, :bucket]
        num_blocks = (positions // r.block_size + 1).to(torch.int32)
        step = r.paged_step(kv_slots, bucket, self.tables[:bucket], num_blocks, positions, [])
        delta = BatchDeltas(r.slots, variants) if with_deltas else None
        return r.model.forward_paged(tokens, positions, step, delta)

    def capturable(self, with_deltas: bool) -> bool:
        """Whether a step can be captured: on CUDA, and, for batches with variant rows, when the
        mixed-tenant linear runs the Triton op (bf16/fp16 and triton installed); the plain-torch
        reference waits for the device (``slot.unique()``) and cannot be captured."""
        model = self.runner.model
        if model.device.type != "cuda":
            return False
        if not with_deltas:
            return True
        from deltafleet import kernels

        return model.dtype in (torch.bfloat16, torch.float16) and bool(kernels._ops())

    def run(self, step, with_deltas: bool) -> Tensor:
        """One decode step by graph replay (capturing the bucket's graph on first use). Call under
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
        key = (b, with_deltas)
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, with_deltas)
        graph, out, _ = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out[:step.n_decode]

    def _capture(self, bucket: int, with_deltas: bool) -> tuple[torch.cuda.CUDAGraph, Tensor, object]:
        dev = self.runner.device
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
