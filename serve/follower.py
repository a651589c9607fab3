"""The other ranks of a tensor-parallel server (rank 0 runs the engine and the HTTP app): each loads
its slice of the base, then replays the commands rank 0 announces (serve/engine.py, ``collective``).
"""
from __future__ import annotations

import torch

from deltafleet.compress.bitdelta import load_artifact
from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.delta import VariantDelta
from deltafleet.serve.loading import load_model
from deltafleet.serve.runner import ModelRunner
from deltafleet.serve.synthetic import SOURCE_PREFIX, read_synthetic
from deltafleet.serve.tp import TPContext, shard_delta


def run_follower(ctx: TPContext, base_dir: str, device: str, dtype: torch.dtype) -> None:
    """A rank other than 0: load its slice of the base, then run every command rank 0 sends until
    ``("stop",)``: ``("init", n_slots, max_batch, max_seq_len, sign_layout, n_blocks, block_size, attention, col_scales)``,
    ``("load", artifact_dir, slot, from_host)``, ``("free", slot, kept)``, ``("drop", artifact_dir)``,
    ``("step", StepInput)`` (serve/runner.py). A variant that leaves its slot for rank 0's host tier
    (``kept``) is kept in host memory (this rank's slice) as rank 0 keeps its own: a load ``from_host``
    takes that copy back, not the artifact on disk, which may have changed or gone since; ``drop`` is
    rank 0's host tier letting its copy go. A slot freed without ``kept`` (its variant dropped, or an
    old version of a changed artifact whose last request ended) keeps nothing.
    Steps only take part in the all-reduces (eagerly, over this rank's own paged KV cache of the
    same blocks); the logits are rank 0's to use. A synthetic family's
    folder (serve/synthetic.py) has the base and each variant (``"synthetic:<name>"``) generated."""
    synthetic = read_synthetic(base_dir)
    if synthetic is None:
        model = load_model(base_dir, device, dtype, tp=ctx.shard)
    else:
        model = synthetic.build_base(device, dtype, tp=ctx.shard)
    slots = runner = None
    views: dict[int, tuple[str, object]] = {}  # slot → (artifact folder, the slot's views)
    kept: dict[str, VariantDelta] = {}  # host copies by artifact folder, as rank 0's host tier holds them
    dev = model.device
    while True:
        cmd = ctx.recv()
        op = cmd[0]
        if op == "stop":
            return
        if op == "init":
            _, n_slots, max_batch, max_seq_len, sign_layout, n_blocks, block_size, attention, col_scales = cmd
            slots = DeltaSlots(model, n_slots, sign_layout, col_scales)
            runner = ModelRunner(model, slots, n_blocks, block_size, max_batch, max_seq_len, attention=attention)
        elif op == "load":
            _, artifact_dir, slot, from_host = cmd
            delta = kept.pop(artifact_dir, None)
            if synthetic is not None and artifact_dir.startswith(SOURCE_PREFIX):
                delta = synthetic.variant(artifact_dir.removeprefix(SOURCE_PREFIX), dev, ctx.shard)
            elif not from_host or delta is None:
                delta = VariantDelta(load_artifact(artifact_dir, force=True, verify_hashes=False), "cpu", dtype)
                delta = shard_delta(delta, ctx.rank, ctx.world)
            views[slot] = (artifact_dir, slots.put(delta, slot))
        elif op == "free":
            _, slot, kept_by_rank0 = cmd
            artifact_dir, view = views.pop(slot)
            if kept_by_rank0 and not artifact_dir.startswith(SOURCE_PREFIX):  # a synthetic one is generated again
                kept[artifact_dir] = view.to("cpu", pin=dev.type == "cuda")
            slots.free(view)
        elif op == "drop":
            kept.pop(cmd[1], None)
        elif op == "step":
            with torch.inference_mode():
                runner.forward(cmd[1])
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")
