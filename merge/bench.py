"""Memory of offline merges (``make bench-merge``, ``conf/bench_merge.yaml``): peak resident set of
``merge/run.py`` merging two 7B-shaped checkpoints (with their base for the task-vector methods),
each method in its own process, next to the size of one checkpoint. JSON + PNG in ``reports/``.

The inputs (``work_dir/a``: base and fine-tune, ``work_dir/b``: another model) are generated once
and reused while their ``pair.json`` records this run's shape, dtype and seed. Every setting is
checked before any work (``error: ...``, exit status 2). ``work_dir`` must be absent, empty or hold
only the benchmark's own inputs and merges; ``keep_inputs=false`` deletes those and nothing else. A
run in which a method's merge failed still writes its report, then exits with status 1."""
from __future__ import annotations

import contextlib
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
DELTA_STD = 1e-3  # the generated fine-tune: base + N(0, DELTA_STD²)


def _child_env() -> dict:
    """The environment of a worker process: this one's, with the repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def _generate(pair_dir: Path, shape: dict, dtype: str, seed: int) -> None:
    """compress's generator (base + fine-tune), in a child process."""
    args = {"pair_dir": str(pair_dir), "shape": shape, "dtype": dtype, "delta_std": DELTA_STD, "seed": seed,
            "shard_bytes": 2_000_000_000}
    r = subprocess.run([sys.executable, str(REPO / "compress" / "bench.py"), "--worker", "generate", json.dumps(args)],
                       capture_output=True, text=True, env=_child_env())
    if r.returncode != 0:
        raise SystemExit(f"generating {pair_dir} failed:\n{r.stderr[-2000:]}")


def _not_own_work(folder: Path) -> str | None:
    """Why ``folder`` (``work_dir``) holds more than this benchmark's inputs (``a/``, ``b/``: generated
    pairs), or None. Its merges (``merged-<method>/``) are deleted as soon as they are measured, so
    one found there is not its own: ``merge/run.py`` writes the same folders for a user."""
    from deltafleet.compress.bench import not_pair

    for p in sorted(folder.iterdir()):
        if p.name not in ("a", "b"):
            return f"files the benchmark did not write: {p.name}"
        if p.is_symlink() or not p.is_dir():
            return f"{p.name} is not a folder"
        why = any(p.iterdir()) and not_pair(p)
        if why:
            return f"in {p.name}/: {why}"
    return None


def check_config(cfg: DictConfig) -> dict:
    """Check every setting of ``conf/bench_merge.yaml`` before any work, and apply ``threads``.

    Returns:
        ``{"shape", "keep_inputs", "report_name", "work_dir"}``, the folder resolved.

    Raises:
        ValueError: naming the setting: an unknown one, a bad value, a method that cannot merge the two
            models (an unknown name or parameter, no base for a task-vector method), a ``work_dir`` that
            is not the benchmark's own (:func:`deltafleet.compress.bench.check_own_folder`).
    """
    from deltafleet.cli import check_report_name, check_settings, flag
    from deltafleet.compress.bench import DTYPES, check_own_folder, check_reports_dir, check_shape
    from deltafleet.merge.methods import get_method
    from deltafleet.threads import set_threads
    from deltafleet.values import real, whole

    check_settings(cfg, "bench_merge.yaml", ("shape",))
    set_threads(cfg)
    shape = OmegaConf.to_container(cfg.shape, resolve=True)
    check_shape(shape)
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if not whole(cfg.seed) or cfg.seed < 0:
        raise ValueError(f"seed must be a whole number, at least 0, got {cfg.seed!r}")
    if not real(cfg.rss_limit_gb) or cfg.rss_limit_gb <= 0:
        raise ValueError(f"rss_limit_gb must be a positive number, got {cfg.rss_limit_gb!r}")
    keep_inputs = flag(cfg, "keep_inputs")
    report_name = check_report_name(cfg.report_name)
    if not OmegaConf.is_list(cfg.methods) or not cfg.methods:
        raise ValueError(f"methods must be a list of {{method: <name>, base: true|false, params: {{...}}}}, "
                         f"got {cfg.methods!r}")
    for i, spec in enumerate(cfg.methods):
        if not OmegaConf.is_dict(spec) or set(spec) != {"method", "base", "params"}:
            raise ValueError(f"methods[{i}] must be {{method: <name>, base: true|false, params: {{...}}}}, "
                             f"got {spec!r}")
        uses_base = flag(cfg, f"methods[{i}].base")
        if spec.params is not None and not OmegaConf.is_dict(spec.params):
            raise ValueError(f"methods[{i}].params must be a mapping of the method's parameters, got {spec.params!r}")
        params = OmegaConf.to_container(spec.params, resolve=True) if spec.params is not None else {}
        try:
            method = get_method(str(spec.method), **params)
        except ValueError as e:
            raise ValueError(f"methods[{i}]: {e}") from None
        if not uses_base and method.name != "linear":
            raise ValueError(f"methods[{i}]: merge method {method.name!r} needs the base (task vectors are "
                             f"W − W_base): base: true")
        if method.n_models not in (None, 2):
            raise ValueError(f"methods[{i}]: merge method {method.name!r} merges the base with {method.n_models} "
                             "model(s); the benchmark merges 2")
        if method.weights is not None and len(method.weights) != 2:
            raise ValueError(f"methods[{i}]: {len(method.weights)} weights for the benchmark's 2 models")
    if not isinstance(cfg.work_dir, str) or not cfg.work_dir.strip():
        raise ValueError(f"work_dir must be a folder path, got {cfg.work_dir!r}")
    reports = Path(cfg.paths.reports_dir).resolve()  # not inside a folder the benchmark deletes
    work_dir = check_own_folder(cfg.work_dir, "work_dir", _not_own_work, inputs=[reports])
    check_reports_dir(reports)
    return {"shape": shape, "keep_inputs": keep_inputs, "report_name": report_name, "work_dir": work_dir,
            "work_existed": work_dir.exists()}


def _inputs(cfg: DictConfig, work: Path, shape: dict) -> tuple[Path, Path, Path]:
    """The base, fine-tune and other model under ``work``, generated unless ``a/`` and ``b/`` hold
    pairs of this ``shape``, ``cfg.dtype`` and seed (``cfg.seed``, ``cfg.seed + 1``)."""
    import torch

    from deltafleet.compress.bench import cached_pair

    base, ft, other = work / "a" / "base", work / "a" / "ft", work / "b" / "ft"
    for pair_dir, seed in ((work / "a", cfg.seed), (work / "b", cfg.seed + 1)):
        want = {"shape": shape, "dtype": str(getattr(torch, cfg.dtype)), "delta_std": DELTA_STD, "seed": seed}
        info, differs = cached_pair(pair_dir, want)
        if info is None:
            if differs:
                print(f"{pair_dir} holds a model of other settings ({'; '.join(differs)}): generating it again",
                      flush=True)
            _generate(pair_dir, shape, cfg.dtype, seed)
            if pair_dir.name == "b":
                shutil.rmtree(pair_dir / "base", ignore_errors=True)  # only its second model is used
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
    """One run of the benchmark: :func:`run` after :func:`check_config`.

    Raises:
        ValueError: a setting :func:`check_config` refuses, before any work.
    """
    return run(cfg, check_config(cfg))


def run(cfg: DictConfig, checked: dict) -> dict:
    """The benchmark with ``cfg``'s settings, as :func:`check_config` returned them in ``checked``;
    its report, whose ``failed`` names the methods whose merge failed (empty for a complete run)."""
    from hydra.core.hydra_config import HydraConfig

    from deltafleet.atomic import remove_dir, write_figure, write_text

    work = checked["work_dir"]
    base, ft, other = _inputs(cfg, work, checked["shape"])
    ck_bytes = json.loads((work / "a" / "pair.json").read_text())["checkpoint_bytes"]
    # each merge's own Hydra run folder (its log), in this run's
    logs = (Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized()
            else Path(cfg.paths.output_dir) / "bench-merge")
    runs = []
    for spec in cfg.methods:
        out = work / f"merged-{spec.method}"
        res = _merge(cfg, spec, base, [ft, other], out, logs / spec.method)
        shutil.rmtree(out, ignore_errors=True)
        res["within_rss_limit"] = "error" not in res and res["peak_rss_bytes"] <= cfg.rss_limit_gb * GB
        runs.append(res)
        if "error" in res:
            last = next((ln for ln in reversed(res["error"].splitlines()) if ln.strip()), "no message")
            print(f"{spec.method:12s} ERROR: {last}", flush=True)
        else:
            print(f"{spec.method:12s} peak RSS {res['peak_rss_bytes'] / GB:6.2f} GB  {res['seconds']:7.1f} s  "
                  f"{'ok' if res['within_rss_limit'] else 'OVER'}", flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": cfg.machine, "cpus": os.cpu_count(),
              "shape": OmegaConf.to_container(cfg.shape), "dtype": cfg.dtype, "checkpoint_bytes": ck_bytes,
              "inputs": {"base": str(base), "models": [str(ft), str(other)],
                         "note": "the second model is a random checkpoint of the same shape (another seed)"},
              "rss_limit_gb": cfg.rss_limit_gb, "runs": runs,
              "failed": [r["method"] for r in runs if "error" in r]}
    name = checked["report_name"]
    reports = Path(cfg.paths.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    write_text(reports / f"{name}.json", json.dumps(report, indent=1, default=str) + "\n")
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
    write_figure(fig, reports / f"{name}.png", dpi=110)
    plt.close(fig)
    if not checked["keep_inputs"]:  # its inputs (check_config: nothing else was there); the folder if it made it
        for made in ("a", "b"):
            if (work / made).is_dir():
                remove_dir(work / made)
        if not checked["work_existed"]:
            with contextlib.suppress(OSError):
                work.rmdir()
    print(f"wrote {reports / name}.json and .png")
    if report["failed"]:
        print(f"FAILED: {', '.join(report['failed'])}", flush=True)
    return report


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_merge")
def _entry(cfg: DictConfig) -> None:
    """A refused setting is ``error: <why>`` on stderr and exit status 2, before any work (its Hydra run
    folder removed); a run in which a method's merge failed exits with 1, after its report is written."""
    from deltafleet.cli import checked_run

    checked_run("bench-merge", cfg, check_config, run)


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(_entry)
