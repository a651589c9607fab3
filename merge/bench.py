"""Memory of offline merges (``make bench-merge``, ``conf/bench_merge.yaml``): peak resident set of
``merge/run.py`` merging two 7B-shaped checkpoints (with their base for the task-vector methods),
each method in its own process, next to the size of one checkpoint. JSON + PNG in ``reports/``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


def _child_env() -> dict:
    """The environment of a worker process: this one's, with the repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def _generate(pair_dir: Path, shape: dict, dtype: str, seed: int) -> None:
    """compress's generator (base + fine-tune), in a child process."""
    args = {"pair_dir": str(pair_dir), "shape": shape, "dtype": dtype, "delta_std": 1e-3, "seed": seed,
            "shard_bytes": 2_000_000_000}
    r = subprocess.run([sys.executable, str(REPO / "compress" / "bench.py"), "--worker", "generate", json.dumps(args)],
                       capture_output=True, text=True, env=_child_env())
    if r.returncode != 0:
        raise SystemExit(f"generating {pair_dir} failed:\n{r.stderr[-2000:]}")


def _inputs(cfg: DictConfig) -> tuple[Path, Path, Path]:
    work = Path(cfg.work_dir)
    base, ft, other = work / "a" / "base", work / "a" / "ft", work / "b" / "ft"
    shape = OmegaConf.to_container(cfg.shape, resolve=True)
    if not (work / "a" / "pair.json").is_file():
        _generate(work / "a", shape, cfg.dtype, cfg.seed)
    if not (work / "b" / "pair.json").is_file():
        _generate(work / "b", shape, cfg.dtype, cfg.seed + 1)
        shutil.rmtree(work / "b" / "base", ignore_errors=True)  # only its second model is used
    return base, ft, other


def _merge(cfg: DictConfig, spec, base: Path, models: list[Path], out: Path, log: Path) -> dict:
    params = [f"params.{k}={v}" for k, v in (spec.params or {}).items()]
    cmd = [sys.executable, str(REPO / "merge" / "run.py"), f"base={base if spec.base else 'null'}",
           f"models=[{','.join(str(m) for m in models)}]", f"method={spec.method}", f"out_dir={out}",
           "progress=false", f"hydra.run.dir={log}", *params]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_child_env())
    if r.returncode != 0:
        return {"method": spec.method, "error": r.stderr[-2000:]}
    summary = json.loads((out / "merge.json").read_text())
    summary["process_wall_s"] = time.perf_counter() - t0
    return summary


def main(cfg: DictConfig) -> dict:
    from deltafleet.atomic import write_text

    base, ft, other = _inputs(cfg)
    ck_bytes = json.loads((Path(cfg.work_dir) / "a" / "pair.json").read_text())["checkpoint_bytes"]
    runs = []
    for spec in cfg.methods:
        out = Path(cfg.work_dir) / f"merged-{spec.method}"
        res = _merge(cfg, spec, base, [ft, other], out, Path(cfg.paths.output_dir) / "bench-merge" / spec.method)
        shutil.rmtree(out, ignore_errors=True)
        res["within_rss_limit"] = "error" not in res and res["peak_rss_bytes"] <= cfg.rss_limit_gb * GB
        runs.append(res)
        print(f"{spec.method:12s} peak RSS {res.get('peak_rss_bytes', 0) / GB:6.2f} GB  "
              f"{res.get('seconds', float('nan')):7.1f} s  {'ok' if res['within_rss_limit'] else 'OVER/ERROR'}",
              flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": cfg.machine, "cpus": os.cpu_count(),
              "shape": OmegaConf.to_container(cfg.shape), "dtype": cfg.dtype, "checkpoint_bytes": ck_bytes,
              "inputs": {"base": str(base), "models": [str(ft), str(other)],
                         "note": "the second model is a random checkpoint of the same shape (another seed)"},
              "rss_limit_gb": cfg.rss_limit_gb, "runs": runs}
    reports = Path(cfg.paths.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    write_text(reports / f"{cfg.report_name}.json", json.dumps(report, indent=1, default=str) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["method"] for r in runs]
    ax.bar(names, [r.get("peak_rss_bytes", 0) / GB for r in runs])
    ax.axhline(cfg.rss_limit_gb, color="r", ls=":", label=f"target {cfg.rss_limit_gb} GB")
    ax.axhline(ck_bytes / GB, color="k", ls="--", label="one checkpoint")
    ax.set_ylabel("peak resident memory (GB)")
    ax.set_title(f"offline merge of two {cfg.shape.name} checkpoints ({cfg.shape.num_hidden_layers} layers), "
                 f"{cfg.machine}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(reports / f"{cfg.report_name}.png", dpi=110)
    if not cfg.keep_inputs:
        shutil.rmtree(cfg.work_dir, ignore_errors=True)
    print(f"wrote {reports / cfg.report_name}.json and .png")
    return report


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_merge")
def _entry(cfg: DictConfig) -> None:
    from deltafleet.cli import user_errors
    from deltafleet.threads import set_threads

    with user_errors("bench-merge"):  # a bad threads setting: one line, not a traceback
        set_threads(cfg)
    main(cfg)


if __name__ == "__main__":
    _entry()
