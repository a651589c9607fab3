"""Serve the base and every BitDelta artifact found, OpenAI-compatible (``make serve``).

    python serve/run.py                              # http://127.0.0.1:8000/v1, models tiny, tiny-<variant>...
    python serve/run.py port=8001 paths.root=/scratch/df
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-coder", "prompt": "def ", "max_tokens": 32, "temperature": 0}'

Composes ``conf/serve.yaml``, loads the base from ``base_dir`` (Hugging Face checkpoint +
tokenizer), lists ``<artifacts_dir>/*/bitdelta.json`` as ``<family>-<variant>`` (each loaded on its
first request) and runs uvicorn on ``host:port``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import serve.app  # noqa: F401  (installed with `pip install -e .`)
except ImportError:  # `python serve/run.py` puts serve/ first on sys.path, not the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    import torch
    import uvicorn

    from serve.app import create_app
    from serve.engine import Engine

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Leave a core to the HTTP event loop: on a busy CPU, intra-op threads spinning at every op's
    # barrier starve it, and a one-token decode step gains nothing from them (10-20x slower on 2 cores).
    torch.set_num_threads(cfg.threads or max(1, cores - 1))
    try:
        dc = cfg.delta_cache
        cache = {"device_slots": dc.device_slots,
                 "device_budget_bytes": None if dc.device_budget_gb is None else int(dc.device_budget_gb * 1e9),
                 "host_budget_bytes": None if dc.host_budget_gb is None else int(dc.host_budget_gb * 1e9),
                 "pinned": list(dc.pinned or []), "pin_top_n": dc.pin_top_n, "half_life_s": dc.half_life_s,
                 "wait_timeout_s": dc.wait_timeout_s}
        engine = Engine(cfg.base_dir, cfg.artifacts_dir, family=cfg.family, device=cfg.device, dtype=cfg.dtype,
                        force=cfg.force, delta_cache=cache, max_batch=cfg.max_batch)
    except (FileNotFoundError, ValueError) as e:  # no base checkpoint; a dtype that is not served
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    url = f"http://{cfg.host}:{cfg.port}/v1"
    ids = [m.id for m in engine.models()]
    print(f"serving {', '.join(ids)} ({engine.device}, {cfg.dtype}, context {engine.max_model_len}, "
          f"{torch.get_num_threads()} threads) at {url}",
          flush=True)
    api_key = cfg.api_key or os.environ.get("DELTAFLEET_API_KEY") or None
    uvicorn.run(create_app(engine, max_waiting=cfg.max_waiting, api_key=api_key), host=cfg.host, port=cfg.port,
                log_level=cfg.log_level)


if __name__ == "__main__":
    main()
