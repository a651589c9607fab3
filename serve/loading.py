"""Loading a served base from a Hugging Face checkpoint, whole or as one tensor-parallel rank's
slice (gpt-fast's ``_load_model``, outside the model as there).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from deltafleet.checkpoint import Checkpoint
from deltafleet.serve.model import ModelArgs, Transformer
from deltafleet.serve.tp import _kind, shard_model, slice_for


def load_model(checkpoint_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               tp: tuple | None = None) -> Transformer:
    """Load a Hugging Face safetensors checkpoint (single file or index + shards), one copy.

    ``tp = (rank, world, group)``: this rank's tensor-parallel slice only (serve/tp.py); each tensor is
    read from the file as that slice, so a rank never holds the whole model.

    Raises:
        FileNotFoundError: if ``config.json`` or the safetensors weights are missing.
        CheckpointError: a malformed index or header, a shard the index names missing or outside the
            folder (:class:`deltafleet.checkpoint.Checkpoint`; a ValueError).
        NotImplementedError: on an unsupported architecture (see :meth:`ModelArgs.from_hf_config`).
        ValueError: if the checkpoint's tensors do not match the config.
    """
    d = Path(checkpoint_dir)
    args = ModelArgs.from_hf_config(json.loads((d / "config.json").read_text()))
    with torch.device("meta"):
        model = Transformer(args)
    full_shapes = model.hf_param_shapes()  # what a (whole) variant's deltas are checked against
    if tp is not None:
        shard_model(model, *tp)
    # the files as the checkpoint reader finds them: its index checked (shards present, in the folder, holding
    # what it maps to them) and every header against its file's size
    if not (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json")
    files = sorted({info.file.name for info in Checkpoint(d).tensors.values()})
    state: dict[str, Tensor] = {}
    for f in files:
        with safe_open(d / f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.endswith("rotary_emb.inv_freq") or (args.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if tp is not None and tp[0] != 0 and _kind(name) == "row" and name.endswith(".bias"):
                    continue  # a row-parallel bias is added by rank 0 only
                if tp is None:
                    t = sf.get_tensor(name)
                else:
                    t = slice_for(name, sf.get_slice(name), tp[0], tp[1])
                t = t.to(device)
                state[name.removeprefix("model.")] = t.to(dtype) if t.is_floating_point() else t
    keys = set(model.state_dict()) - ({"lm_head.weight"} if args.tie_word_embeddings else set())
    missing, unexpected = sorted(keys - set(state)), sorted(set(state) - keys)
    if missing or unexpected:
        raise ValueError(f"{d}: checkpoint does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    expected = model.state_dict()
    wrong = [f"{k} {tuple(t.shape)} (config: {tuple(expected[k].shape)})" for k, t in state.items()
             if t.shape != expected[k].shape]
    if wrong:
        raise ValueError(f"{d}: checkpoint does not match its config: shapes of {', '.join(wrong[:5])}")
    return model.adopt(state, full_shapes, device)
