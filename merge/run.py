"""Offline merge of fine-tuned checkpoints (``make merge``): ``conf/merge_models.yaml``.

    python merge/run.py base=models/base models=[models/coder,models/writer] method=ties params.density=0.3
    python merge/run.py models=[a,b] base=null method=linear params.weights=[1,3]

Streams one tensor at a time (merge/stream.py), so models larger than RAM merge; writes a Hugging
Face checkpoint (config and tokenizer from the base) plus ``merge.json`` (method, parameters,
inputs, time). An existing ``out_dir`` is replaced only if it is an earlier merge's output (it holds
``merge.json``) or with ``overwrite=true``.
"""
from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="../conf", config_name="merge_models")
def main(cfg: DictConfig) -> None:
    from deltafleet.cli import USER_ERRORS, check_settings, flag, interruptible, refuse, stop_on_sigterm
    from deltafleet.merge.methods import get_method
    from deltafleet.merge.stream import merge_checkpoints

    from deltafleet.threads import set_threads

    stop_on_sigterm()  # a stopped merge removes its staged folder, as Ctrl-C does
    try:
        with interruptible("merge"):
            check_settings(cfg, "merge_models.yaml", ("params",))
            set_threads(cfg)
            if not OmegaConf.is_list(cfg.models):
                raise ValueError(f"models must be a list of checkpoint folders, e.g. models=[models/coder,models/writer]; "
                                 f"got {cfg.models!r}")
            for key, value in [*((f"models[{i}]", m) for i, m in enumerate(cfg.models)), ("out_dir", cfg.out_dir),
                               *([("base", cfg.base)] if cfg.base is not None else [])]:
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(f"{key} must be a folder path, got {value!r}")
            shard_gb = cfg.max_shard_gb
            if isinstance(shard_gb, bool) or not isinstance(shard_gb, (int, float)) or not 0 < shard_gb < float("inf"):
                raise ValueError(f"max_shard_gb must be a positive number of GB, got {shard_gb!r}")
            overwrite, progress = flag(cfg, "overwrite"), flag(cfg, "progress")
            if cfg.params is not None and not OmegaConf.is_dict(cfg.params):
                raise ValueError(f"params must be the method's parameters by name, e.g. params.density=0.3 "
                                 f"(null: the method's defaults), got {cfg.params!r}")
            given = {} if cfg.params is None else OmegaConf.to_container(cfg.params, resolve=True)
            params = {k: v for k, v in given.items() if v is not None}
            method = get_method(cfg.method, **params)
            summary = merge_checkpoints(cfg.base, list(cfg.models), cfg.out_dir, method,
                                        max_shard_bytes=max(1, int(shard_gb * 1e9)), show_progress=progress,
                                        overwrite=overwrite)
    except USER_ERRORS as e:
        refuse(e)
    except OSError as e:  # the output's file system: read-only, full, a mount point
        refuse(f"cannot write the merge to out_dir {cfg.out_dir}: {e.strerror or e}")
    print(json.dumps(summary, indent=1, default=str))
    print(f"wrote {cfg.out_dir}")


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
