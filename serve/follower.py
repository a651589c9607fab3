"""The other ranks of a tensor-parallel server (rank 0 runs the engine and the HTTP app): each loads
its slice of the base, then replays the commands rank 0 announces (serve/engine.py, ``collective``).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deltafleet.compress.bitdelta import ArtifactError, load_artifact
from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.delta import VariantDelta, artifact_stamp
from deltafleet.serve.loading import load_model
from deltafleet.serve.runner import ModelRunner
from deltafleet.serve.synthetic import SOURCE_PREFIX, read_synthetic
from deltafleet.serve.tp import TPContext, shard_delta


def run_follower(ctx: TPContext, base_dir: str, device: str, dtype: torch.dtype) -> None:
    """A rank other than 0: load its slice of the base, then run every command rank 0 sends until
    ``("stop",)``: ``("init", n_slots, max_batch, max_seq_len, sign_layout, n_blocks, block_size, attention, col_scales)``,
    ``("prefetch", key, source, stamp)``, ``("reading", key)``, ``("load", key, source, slot, from_host, stamp)``,
    ``("free", slot, kept)``, ``("drop", key)``, ``("step", StepInput)`` (serve/runner.py).

    ``key`` names one read of a variant's artifact on rank 0 (serve/engine.py): a variant that
    leaves its slot for rank 0's host tier (``kept``) is kept in host memory (this rank's slice) by
    that name, as rank 0 keeps its own, and a load ``from_host`` takes that copy back, not the
    artifact on disk, which may have changed or gone since; ``drop`` is rank 0's host tier letting
    its copy go. A slot freed without ``kept`` (its variant dropped, or an old version of a changed
    artifact whose last request ended) keeps nothing. A load from disk reads the folder ``source``
    only while its files' stamp (serve/delta.py) is the one rank 0 read, and answers rank 0
    (``TPContext.gather``) with None, or why it could not (the artifact changed or went since rank 0
    read it, or cannot be read): then it takes nothing, nor does rank 0, which frees the slot on the
    ranks that took it (a rank that holds nothing there lets nothing go). Rank 0 announces a read
    (``prefetch``) as it starts its own: this rank then reads its slice on a thread of its own while
    it goes on taking part in steps; rank 0 asks (``reading``: True while it still reads) between
    steps until every rank has it, then announces the load, which takes that read. So a load holds
    the steps of every model only for the copy into the slot, not for a read from disk. A read rank 0
    does not load (it failed there) is let go by ``drop``; at most :data:`MAX_PREFETCHED` are held,
    the oldest let go first (its load then reads from disk).
    Steps only take part in the all-reduces (eagerly, over this rank's own paged KV cache of the
    same blocks); the logits are rank 0's to use. A synthetic family's folder
    (serve/synthetic.py) has the base and each variant (``source`` ``"synthetic:<name>"``) generated."""
    synthetic = read_synthetic(base_dir)
    if synthetic is None:
        model = load_model(base_dir, device, dtype, tp=ctx.shard)
    else:
        model = synthetic.build_base(device, dtype, tp=ctx.shard)
    slots = runner = None
    views: dict[int, tuple[object, str, object]] = {}  # slot → (read's key, source, the slot's views)
    kept: dict[object, VariantDelta] = {}  # host copies by read's key, as rank 0's host tier holds them
    reads: dict[object, Future] = {}  # prefetched reads by key, oldest first
    reader = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
    dev = model.device
    while True:
        cmd = ctx.recv()
        op = cmd[0]
        if op == "stop":
            reader.shutdown(wait=False, cancel_futures=True)
            return
        if op == "prefetch":
            _, key, source, stamp = cmd
            reads[key] = reader.submit(_read, source, stamp, dtype, ctx)
            while len(reads) > MAX_PREFETCHED:
                reads.pop(next(iter(reads))).cancel()
            continue
        if op == "reading":  # whether this rank still reads it (rank 0 waits before it loads)
            read = reads.get(cmd[1])
            ctx.gather(read is not None and not read.done())
            continue
        if op == "init":
            _, n_slots, max_batch, max_seq_len, sign_layout, n_blocks, block_size, attention, col_scales = cmd
            slots = DeltaSlots(model, n_slots, sign_layout, col_scales)
            runner = ModelRunner(model, slots, n_blocks, block_size, max_batch, max_seq_len, attention=attention)
        elif op == "load":
            _, key, source, slot, from_host, stamp = cmd
            delta, why = kept.pop(key, None), None
            read = reads.pop(key, None)
            if synthetic is not None and source.startswith(SOURCE_PREFIX):
                delta = synthetic.variant(source.removeprefix(SOURCE_PREFIX), dev, ctx.shard)
            elif not from_host or delta is None:  # rank 0's read of this version: prefetched, done or under way
                delta, why = read.result() if read is not None else _read(source, stamp, dtype, ctx)
            ctx.gather(why)
            if delta is not None:
                views[slot] = (key, source, slots.put(delta, slot))
        elif op == "free":
            _, slot, kept_by_rank0 = cmd
            if slot not in views:  # a load this rank could not take, given back by the ranks that took it
                continue
            key, source, view = views.pop(slot)
            if kept_by_rank0 and not source.startswith(SOURCE_PREFIX):  # a synthetic one is generated again
                kept[key] = view.to("cpu", pin=dev.type == "cuda")
            slots.free(view)
        elif op == "drop":
            kept.pop(cmd[1], None)
            if (read := reads.pop(cmd[1], None)) is not None:
                read.cancel()
        elif op == "step":
            with torch.inference_mode():
                runner.forward(cmd[1])
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")


MAX_PREFETCHED = 4  # prefetched reads a rank holds (a variant's slice each) before letting the oldest go


def _read(source: str, stamp, dtype: torch.dtype, ctx: TPContext) -> tuple[VariantDelta | None, str | None]:
    """This rank's slice of the artifact in ``source`` as rank 0 read it (``stamp``), or why not."""
    if artifact_stamp(source) != stamp:
        return None, f"tensor-parallel rank {ctx.rank}: its artifact changed or went on disk since rank 0 read it"
    try:
        delta = VariantDelta(load_artifact(source, force=True, verify_hashes=False), "cpu", dtype)
    except (ArtifactError, OSError, ValueError) as e:
        return None, f"tensor-parallel rank {ctx.rank} could not read it: {e}"
    if artifact_stamp(source) != stamp:  # changed while this rank read it
        return None, f"tensor-parallel rank {ctx.rank}: its artifact changed on disk while it was read"
    return shard_delta(delta, ctx.rank, ctx.world), None
