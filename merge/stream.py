"""Offline merges of Hugging Face checkpoints, one tensor at a time (mergekit's lazy merge).

Every input is read with :class:`deltafleet.checkpoint.Checkpoint` (plain reads, no memory map), so the
process holds one parameter of each input, its merge and the output shard being filled — a model
larger than RAM merges. Elementwise methods merge blocks of rows
(``MergeMethod.merge_rows``), and each shard's header is written from the inputs' headers before
its tensors, which are appended as they are merged: nothing waits in memory for a shard to fill.
The output is a Hugging Face safetensors checkpoint (sharded with an index
past ``max_shard_bytes``) with the config and tokenizer files of the base (or the first model),
written to a staged folder and renamed into place: a failed merge leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch

from deltafleet.atomic import check_replaceable, not_recorded_output, staged_dir
from deltafleet.checkpoint import SIDECAR_FILES, Checkpoint, check_same_architecture, read_json, ties_head
from deltafleet.merge.methods import MergeMethod



def _peak_rss() -> int | None:
    """This process's peak resident set (``VmHWM``), bytes; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


WRITTEN_BY = "deltafleet merge"  # merge.json's signature: a folder it describes may be replaced by a new merge


def _not_merge_output(folder: Path) -> str | None:
    """Why ``folder`` is not (only) an earlier merge's output (its ``merge.json`` lists every file), or None."""
    return not_recorded_output(folder, "merge.json", WRITTEN_BY, "merge")


def merge_checkpoints(base_dir: str | Path | None, model_dirs: Sequence[str | Path], out_dir: str | Path,
                      method: MergeMethod, *, max_shard_bytes: int = 2_000_000_000,
                      show_progress: bool = False, overwrite: bool = False) -> dict:
    """Merge ``model_dirs`` (fine-tunes of ``base_dir``) with ``method`` into ``out_dir``.

    Args:
        base_dir: the common base (task vectors are taken against it); None only for ``linear``.
        model_dirs: one or more checkpoints with the base's tensor names and shapes.
        out_dir: the merged checkpoint folder. If it exists it is replaced atomically, but only if it is
            empty, an earlier merge's output (it holds ``merge.json``) or ``overwrite`` is set.
        method: a :class:`deltafleet.merge.methods.MergeMethod` (``get_method(name, **params)``).
        max_shard_bytes: output shard size in bytes.
        show_progress: a tqdm bar over tensors.
        overwrite: replace an existing ``out_dir`` whatever it holds, deleting what the merge did not
            write (never the current directory or a folder holding it).

    Returns:
        A summary: ``tensors``, ``bytes``, ``seconds``, ``shards``, ``peak_rss_bytes`` (the process's
        peak resident memory so far: the merge's, when it runs in a process of its own).

    Raises:
        ValueError: no models, a model listed twice (the same folder, however written), a missing base
            for a task-vector method, inputs whose tensor names or
            shapes differ (the message names the first difference), an ``out_dir`` that overlaps an
            input, is a file, or holds files of something other than a merge (without ``overwrite``).
        FileNotFoundError / deltafleet.checkpoint.CheckpointError: an unreadable input.
    """
    if not model_dirs:
        raise ValueError("no models to merge")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    if method.n_models is not None and len(model_dirs) != method.n_models:
        raise ValueError(f"merge method {method.name!r} merges the base with {method.n_models} model"
                         f"{'s' if method.n_models > 1 else ''}, got {len(model_dirs)} models")
    if method.weights is not None and len(method.weights) != len(model_dirs):
        raise ValueError(f"{len(method.weights)} weights for {len(model_dirs)} models")
    seen: dict[Path, str | Path] = {}
    for d in model_dirs:
        if Path(d).resolve() in seen:
            first = seen[Path(d).resolve()]
            same = "" if str(first) == str(d) else f" (as {first} and {d})"
            raise ValueError(f"models lists {Path(d).resolve()} twice{same}: each model is merged once; to give a "
                             f"model more weight, set params.weights")
        seen[Path(d).resolve()] = d
    out = Path(out_dir).resolve()
    check_replaceable(out, [*model_dirs] + ([base_dir] if base_dir is not None else []), _not_merge_output,
                      job="merge", overwrite=overwrite)
    if base_dir is None and method.name != "linear":
        raise ValueError(f"merge method {method.name!r} needs the base checkpoint (task vectors are W − W_base)")
    t0 = time.perf_counter()
    models = [Checkpoint(d) for d in model_dirs]  # (a folder without a checkpoint is named here)
    base = Checkpoint(base_dir) if base_dir is not None else None
    _check_family(base_dir, model_dirs, method.task_vectors)  # before the tensors: the clearer error
    for ck in models + ([base] if base is not None else []):
        if HEAD in ck and ties_head(ck.dir):
            # transformers ties the head of a model whose config says so and ignores a stored one
            # (as the export does): the model runs with its embedding as the head, so it merges so
            del ck.tensors[HEAD]
    names = models[0].names()
    for ck in models[1:] + ([base] if base is not None else []):
        if ck.names() != names:
            diff = sorted(set(ck.names()) ^ set(names))
            if diff == [HEAD]:
                own, tied = (ck, models[0]) if HEAD in ck else (models[0], ck)
                raise ValueError(f"{own.dir} has an LM head of its own ({HEAD}), while {tied.dir} ties its head "
                                 f"to the embedding (tie_word_embeddings in its config.json): merge models that "
                                 f"all tie their heads, or none")
            raise ValueError(f"{ck.dir} and {models[0].dir} hold different tensors, e.g. {diff[0]!r}")
        for n in names:
            if ck.info(n).shape != models[0].info(n).shape:
                raise ValueError(f"{n}: shape {ck.info(n).shape} in {ck.dir}, {models[0].info(n).shape} in "
                                 f"{models[0].dir}")
    ref = base if base is not None else models[0]  # the output takes the base's dtype and shape

    def reader(name: str):
        width = ref.info(name).shape[-1] if ref.info(name).shape else 1

        def read(start: int, stop: int):
            ms = [m.get_rows(name, start, stop) for m in models]
            b = base.get_rows(name, start, stop) if base is not None else ms[0]
            _check_finite(name, [*models, base], [*ms, b])
            return b, ms
        return read, width

    from tqdm.auto import tqdm

    if method.two_pass:
        method.reset()
        for name in tqdm(names, desc="merge: statistics", disable=not show_progress):
            ws = [m.get(name) for m in models]
            b = base.get(name) if base is not None else ws[0]
            _check_finite(name, [*models, base], [*ws, b])
            method.observe(name, b, ws)
            del ws, b
    # shards planned from the headers, so each tensor is written as soon as it is merged
    plan: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = ref.info(name).nbytes
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += nbytes
    total = sum(ref.info(n).nbytes for n in names)
    files = ["model.safetensors"] if len(plan) == 1 else \
        [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    with staged_dir(out) as tmp:  # an out_dir that is a link gets its target replaced
        bar = tqdm(total=len(names), desc=f"merge: {method.name}", disable=not show_progress)
        try:
            for file, shard in zip(files, plan):
                _write_shard(tmp / file, shard, ref, reader, method, bar)
        finally:
            bar.close()
        if len(plan) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total},
                 "weight_map": dict(sorted((n, f) for f, shard in zip(files, plan) for n in shard))}, indent=2))
        src = Path(base_dir if base_dir is not None else model_dirs[0])
        for f in SIDECAR_FILES:
            if (src / f).is_file():
                shutil.copyfile(src / f, tmp / f)
        from deltafleet.compress.bitdelta import fingerprint

        summary = {"written_by": WRITTEN_BY, "method": method.name,
                   # the method's parameters as get_method takes them (None: its default, left out)
                   "params": {k: v for k, v in vars(method).items() if not k.startswith("_") and v is not None},
                   "base": None if base_dir is None else str(Path(base_dir).absolute()),
                   "models": [str(Path(d).absolute()) for d in model_dirs],
                   # what was written (the export's fingerprint): a record of these weights, not the folder's
                   "fingerprint": fingerprint(tmp),
                   "tensors": len(names), "bytes": total, "shards": len(plan),
                   "seconds": time.perf_counter() - t0, "peak_rss_bytes": _peak_rss(),
                   "files": sorted([p.name for p in tmp.iterdir()] + ["merge.json"])}
        (tmp / "merge.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _check_finite(name: str, checkpoints: list, tensors: list[torch.Tensor]) -> None:
    """Refuse NaN or infinity in any input's ``tensors`` (``checkpoints``: where each was read; None,
    the base of a merge without one, is skipped). One-byte float types (float8) are checked in
    float32, which ``isfinite`` supports."""
    for ck, t in zip(checkpoints, tensors):
        if ck is None or not t.is_floating_point():
            continue
        if not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
            raise ValueError(f"{name}: {ck.dir} holds non-finite values (NaN or infinity)")


HEAD = "lm_head.weight"


def _check_family(base_dir, model_dirs, task_vectors: bool = True) -> None:
    """Refuse checkpoints of different architectures (their ``config.json``'s ``model_type``,
    ``architectures`` or layer and head counts differ: ``check_same_architecture``), as mergekit does;
    warn where the output will have no ``config.json`` (the base, or the first model without a base,
    has none: transformers cannot load it), and, for a method of ``task_vectors``, where a
    model's ``training.json`` (written by ``train/run.py``) names another base than ``base_dir``, unless
    that one holds the same weights (a copy of the base: :func:`_same_weights`)."""
    dirs = ([Path(base_dir)] if base_dir is not None else []) + [Path(d) for d in model_dirs]
    check_same_architecture(dirs)
    if read_json(dirs[0] / "config.json") is None:
        warnings.warn(f"{dirs[0]} has no readable config.json, so the merged checkpoint has none either: "
                      "transformers cannot load it without one", stacklevel=3)
    if base_dir is not None and task_vectors:
        for d in dirs[1:]:
            trained_on = (read_json(d / "training.json") or {}).get("base_dir")
            if isinstance(trained_on, str) and Path(trained_on).resolve() != Path(base_dir).resolve() \
                    and not _same_weights(trained_on, base_dir):
                gone = "" if Path(trained_on).is_dir() else \
                    " (that folder is gone, so its weights could not be compared; if it moved to the base, ignore this)"
                warnings.warn(f"{d} was fine-tuned from {trained_on} (its training.json), not from the base "
                              f"{base_dir}{gone}: its task vector against this base is not its fine-tune's",
                              stacklevel=3)


def _same_weights(a, b) -> bool:
    """Whether checkpoint folders ``a`` and ``b`` hold the same weights, by the export's fingerprint (a
    copy of the base elsewhere is the same base); False where either cannot be read."""
    from deltafleet.compress.bitdelta import fingerprint

    try:
        return fingerprint(a) == fingerprint(b)
    except Exception:
        return False


def _write_shard(path: Path, shard: list[str], ref: Checkpoint, reader, method: MergeMethod, bar) -> None:
    """One safetensors file: its header from the inputs' headers, then each tensor as it is merged."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n in shard:
        info = ref.info(n)
        header[n] = {"dtype": info.dtype_name, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for n in shard:
            info = ref.info(n)
            read, width = reader(n)
            if info.dtype.is_floating_point:
                blocks = method.merge_rows(n, tuple(info.shape), read)
            else:  # integer buffers: the base's
                blocks = iter([read(0, info.numel // max(width, 1))[0]])
            written = 0
            for blk in blocks:
                if blk.is_floating_point() and not bool(torch.isfinite(blk.float() if blk.element_size() == 1
                                                                     else blk).all()):
                    raise ValueError(f"{n}: the merge gives non-finite values (NaN or infinity) from finite "
                                     "inputs: the method's weights or scaling overflow the dtype")
                data = blk.contiguous().view(torch.uint8).numpy()
                f.write(memoryview(data))
                written += data.nbytes
            if written != info.nbytes:
                raise RuntimeError(f"{n}: {written} bytes merged, {info.nbytes} expected")
            bar.update(1)
        f.flush()
        os.fsync(f.fileno())

