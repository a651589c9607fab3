"""Offline merges of Hugging Face checkpoints, one tensor at a time (mergekit's lazy merge).

Every input is read with :class:`compress.stream.Checkpoint` (plain reads, no memory map), so the
process holds one parameter of each input, its merge and the output shard being filled — a model
larger than RAM merges. The output is a Hugging Face safetensors checkpoint (sharded with an index
past ``max_shard_bytes``) with the config and tokenizer files of the base (or the first model),
written to a staged folder and renamed into place: a failed merge leaves nothing behind.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from compress.atomic import staged_dir
from compress.stream import Checkpoint
from merge.methods import MergeMethod

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def merge_checkpoints(base_dir: str | Path | None, model_dirs: Sequence[str | Path], out_dir: str | Path,
                      method: MergeMethod, *, max_shard_bytes: int = 2_000_000_000,
                      show_progress: bool = False) -> dict:
    """Merge ``model_dirs`` (fine-tunes of ``base_dir``) with ``method`` into ``out_dir``.

    Args:
        base_dir: the common base (task vectors are taken against it); None only for ``linear``.
        model_dirs: one or more checkpoints with the base's tensor names and shapes.
        out_dir: the merged checkpoint folder (replaced atomically if it exists).
        method: a :class:`merge.methods.MergeMethod` (``get_method(name, **params)``).
        max_shard_bytes: output shard size in bytes.
        show_progress: a tqdm bar over tensors.

    Returns:
        A summary: ``tensors``, ``bytes``, ``seconds``, ``shards``.

    Raises:
        ValueError: no models, a missing base for a task-vector method, or inputs whose tensor
            names or shapes differ (the message names the first difference).
        FileNotFoundError / compress.stream.CheckpointError: an unreadable input.
    """
    if not model_dirs:
        raise ValueError("no models to merge")
    if base_dir is None and method.name != "linear":
        raise ValueError(f"merge method {method.name!r} needs the base checkpoint (task vectors are W − W_base)")
    t0 = time.perf_counter()
    models = [Checkpoint(d) for d in model_dirs]
    base = Checkpoint(base_dir) if base_dir is not None else None
    names = models[0].names()
    for ck in models[1:] + ([base] if base is not None else []):
        if ck.names() != names:
            diff = sorted(set(ck.names()) ^ set(names))
            raise ValueError(f"{ck.dir} and {models[0].dir} hold different tensors, e.g. {diff[0]!r}")
        for n in names:
            if ck.info(n).shape != models[0].info(n).shape:
                raise ValueError(f"{n}: shape {ck.info(n).shape} in {ck.dir}, {models[0].info(n).shape} in "
                                 f"{models[0].dir}")

    def inputs(name: str):
        ws = [m.get(name) for m in models]
        return (base.get(name) if base is not None else ws[0]), ws

    from tqdm.auto import tqdm

    if method.two_pass:
        for name in tqdm(names, desc="merge: statistics", disable=not show_progress):
            method.observe(name, *inputs(name))
    parts: list[dict[str, str]] = []
    with staged_dir(out_dir) as tmp:
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            nonlocal shard, size
            k = len(parts)
            save_file(shard, tmp / f"part-{k}.safetensors", metadata={"format": "pt"})
            parts.append({n: f"part-{k}.safetensors" for n in shard})
            shard, size = {}, 0

        for name in tqdm(names, desc=f"merge: {method.name}", disable=not show_progress):
            merged = method.merge(name, *inputs(name)).contiguous()
            nbytes = merged.numel() * merged.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
            shard[name] = merged
            size += nbytes
            total += nbytes
        flush()
        if len(parts) == 1:
            (tmp / "part-0.safetensors").rename(tmp / "model.safetensors")
        else:
            weight_map = {}
            for k, part in enumerate(parts):
                final = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
                (tmp / f"part-{k}.safetensors").rename(tmp / final)
                weight_map.update({n: final for n in part})
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        src = Path(base_dir if base_dir is not None else model_dirs[0])
        for f in COPIED_FILES:
            if (src / f).is_file():
                shutil.copyfile(src / f, tmp / f)
        summary = {"method": method.name, "params": {k: v for k, v in vars(method).items() if not k.startswith("_")},
                   "base": None if base_dir is None else str(base_dir), "models": [str(d) for d in model_dirs],
                   "tensors": len(names), "bytes": total, "shards": len(parts),
                   "seconds": time.perf_counter() - t0}
        (tmp / "merge.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary
