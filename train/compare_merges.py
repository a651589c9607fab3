"""Does the checkpoint-merging callback earn its place? Same seeds, same steps, one method each.

    python -m train.compare_merges [--variants coder math writer legal] [--every 30] [--steps 120]
    python -m train.compare_merges --jobs 4 --extra trainer=gpu trainer.precision=32-true   # on a GPU

Fine-tunes every demo variant from its family's base (``models/base``; with ``--extra model=smollm2``,
``models/smollm2-base``) once per method — ``none``, ``average``,
``svd_soup``, ``monosoup`` and Lightning's EMA as a reference — through the real
``train/run.py`` command line (CSV logger, no export), then reports for each run the final
held-out loss on the variant's test split and the roughness of its training-loss curve:
the mean absolute second difference of the per-step loss, ``mean_t |L_{t+1} − 2L_t + L_{t−1}|``
(nats/token; 0 for a straight line, larger for a jagged curve). Writes
``reports/merge-comparison-<date>.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("none", "average", "svd_soup", "monosoup", "ema")


def roughness(losses: list[float]) -> float:
    """Mean absolute second difference of a loss curve (nats/token); needs ≥ 3 points."""
    if len(losses) < 3:
        raise ValueError(f"roughness needs at least 3 points, got {len(losses)}")
    return statistics.fmean(abs(losses[i + 1] - 2 * losses[i] + losses[i - 1]) for i in range(1, len(losses) - 1))


def read_curve(metrics_csv: Path, key: str = "train/loss") -> list[float]:
    """The per-step values of ``key`` from a Lightning ``CSVLogger`` metrics file, in step order."""
    return [v for _, v in read_points(metrics_csv, key)]


def base_dir(extra: list[str]) -> str:
    """The folder the runs fine-tune from: ``models/<dirs.base>`` of the model family that ``extra``'s
    ``model=<name>`` override picks (conf/model/<name>.yaml; without one, ``tiny``)."""
    from omegaconf import OmegaConf

    name = "tiny"
    for e in extra:
        if e.startswith("model="):
            name = e.split("=", 1)[1]
    return f"models/{OmegaConf.load(REPO / 'conf' / 'model' / f'{name}.yaml').dirs.base}"


def run_one(variant: str, method: str, work: Path, args) -> dict:
    run_dir = work / f"{variant}-{method}"
    cmd = [sys.executable, str(REPO / "train/run.py"), f"variant={variant}", f"merge={method}",
           f"paths.root={args.root}", f"hydra.run.dir={run_dir}", f"out_dir={work}/models/{variant}-{method}",
           f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=1", "logger=csv",
           f"logger.save_dir={run_dir}/csv", "export.enabled=false", "checkpoint.every_n_steps=100000",
           f"variant.val_check_interval={args.val_every}", f"seed={args.seed}", *args.extra]
    if method in ("average", "svd_soup", "monosoup"):
        cmd.append(f"merge.every_n_steps={args.every}")
    shutil.rmtree(run_dir / "csv", ignore_errors=True)  # an earlier run's log here would be read as this one's
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}/{method} failed:\n{proc.stderr[-4000:]}")
    return collect(variant, method, run_dir, time.perf_counter() - t0)


def collect(variant: str, method: str, run_dir: Path, seconds: float | None) -> dict:
    """One finished run's result from its folder: ``metrics.json`` and the Lightning CSV log."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    log = latest_log(run_dir)
    curve = read_curve(log)
    val = read_points(log, "val/loss")
    return {"variant": variant, "method": method, "heldout_loss": metrics["heldout/loss"],
            "base_loss": metrics["heldout/base_loss"], "roughness": roughness(curve), "train_curve": curve,
            "val_curve": val, "merges": merge_rows(log), "seconds": seconds}


def latest_log(run_dir: Path) -> Path:
    """The Lightning CSV log of the last run in ``run_dir``: ``CSVLogger`` adds a ``version_N`` folder
    each time, so the highest N (a folder without a number counts as 0)."""
    logs = list(run_dir.glob("csv/**/metrics.csv"))
    if not logs:
        raise FileNotFoundError(f"no Lightning CSV log (csv/**/metrics.csv) under {run_dir}")

    def version(path: Path) -> int:
        found = re.fullmatch(r"version_(\d+)", path.parent.name)
        return int(found.group(1)) if found else 0
    return max(logs, key=version)


def read_points(metrics_csv: Path, key: str) -> list[list[float]]:
    """``[step, value]`` for each logged value of ``key`` (validation runs every few steps), in step order;
    ``step`` the optimizer steps done when it was logged, as the merges' ``merge/step`` counts them
    (Lightning's CSV ``step`` column is that count less one: the index of the step just taken)."""
    by_step: dict[int, float] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            if row.get(key):
                by_step[int(row["step"]) + 1] = float(row[key])
    return [[s, by_step[s]] for s in sorted(by_step)]


def merge_rows(metrics_csv: Path) -> list[dict]:
    """The callback's merges in a run's Lightning CSV: step, validation loss before and after, seconds."""
    rows = []
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            if row.get("merge/val_loss_after"):
                rows.append({"step": int(float(row["merge/step"])), "before": float(row["merge/val_loss_before"]),
                             "after": float(row["merge/val_loss_after"]),
                             "seconds": float(row["merge/seconds"]) if row.get("merge/seconds") else None})
    return rows


def summarize(results: list[dict]) -> list[dict]:
    """Per method: mean held-out loss, mean gain over the base, mean roughness across variants."""
    out = []
    for m in METHODS:
        rs = [r for r in results if r["method"] == m]
        if not rs:
            continue
        out.append({"method": m, "heldout_loss": statistics.fmean(r["heldout_loss"] for r in rs),
                    "gain": statistics.fmean(r["base_loss"] - r["heldout_loss"] for r in rs),
                    "roughness": statistics.fmean(r["roughness"] for r in rs)})
    return out


def write_report(results: list[dict], args, out_stem: Path) -> None:
    import matplotlib

    from deltafleet.atomic import write_figure, write_text

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(results)
    machine = args.machine or f"{platform.node() or 'unknown'} ({platform.machine()}, {os.cpu_count()} CPUs)"
    payload = {"date": date.today().isoformat(), "machine": machine,
               "command": "python -m train.compare_merges " + " ".join(sys.argv[1:]),
               "settings": {"steps": args.steps, "merge_every": args.every, "val_every": args.val_every,
                            "seed": args.seed, "overrides": args.extra}, "summary": summary, "runs": results}
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    write_text(out_stem.with_suffix(".json"), json.dumps(payload, indent=2) + "\n")
    lines = [f"# Checkpoint merging during fine-tuning — {payload['date']}", "",
             f"Machine: {machine}. Command: `{payload['command']}`.",
             f"Each variant fine-tuned from {base_dir(args.extra)} for {args.steps} steps (seed {args.seed}); merges every "
             f"{args.every} steps against the best validation checkpoint (validation every {args.val_every} steps).",
             "Held-out loss: nats/token on the variant's test split (lower is better). Roughness: mean "
             "|second difference| of the per-step training loss (lower is smoother).", "",
             "Validation loss: its lowest (at step) and its last, on the validation split.", "",
             "| variant | method | held-out loss | gain over base | roughness | val loss: lowest · last | "
             "merges (val loss before → after) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        merges = ", ".join(f"{m['step']}: {m['before']:.3f}→{m['after']:.3f}" for m in r["merges"]) or "—"
        val, val_text = r.get("val_curve") or [], "—"
        if val:
            step, low = min(val, key=lambda p: p[1])
            val_text = f"{low:.3f} ({step}) · {val[-1][1]:.3f}"
        lines.append(f"| {r['variant']} | {r['method']} | {r['heldout_loss']:.4f} | "
                     f"{r['base_loss'] - r['heldout_loss']:+.4f} | {r['roughness']:.4f} | {val_text} | {merges} |")
    lines += ["", "| method | mean held-out loss | mean gain | mean roughness |", "|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['method']} | {s['heldout_loss']:.4f} | {s['gain']:+.4f} | {s['roughness']:.4f} |")
    write_text(out_stem.with_suffix(".md"), "\n".join(lines) + "\n")

    variants = sorted({r["variant"] for r in results})
    fig, axes = plt.subplots(1, len(variants) + 1, figsize=(4.2 * (len(variants) + 1), 3.6))
    for ax, v in zip(axes, variants):
        for r in (r for r in results if r["variant"] == v):
            ax.plot(r["train_curve"], label=r["method"], linewidth=0.9)
        ax.set_title(f"{v}: training loss")
        ax.set_xlabel("step")
        ax.set_ylabel("nats/token")
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    xs = range(len(summary))
    ax.bar(xs, [s["gain"] for s in summary])
    ax.set_xticks(list(xs), [s["method"] for s in summary], rotation=30)
    ax.set_title("mean held-out gain over base")
    ax.set_ylabel("nats/token")
    fig.tight_layout()
    write_figure(fig, out_stem.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["coder", "math", "writer", "legal"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=30, help="merge every N optimizer steps")
    p.add_argument("--val-every", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default=str(REPO), help="paths.root holding data/ and models/base/")
    p.add_argument("--work", default=str(REPO / "outputs/compare_merges"))
    p.add_argument("--out", default=str(REPO / "reports" / f"merge-comparison-{date.today().isoformat()}"))
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each is its own process)")
    p.add_argument("--machine", default=None, help="machine description for the report")
    p.add_argument("--extra", nargs="*", default=[], help="further train/run.py overrides for every run")
    args = p.parse_args(argv)
    if args.steps < 3:  # before any run: the report's roughness needs three points of each curve
        p.error(f"--steps must be at least 3 (a curve's roughness needs three points), got {args.steps}")

    def one(vm):
        r = run_one(*vm, Path(args.work), args)
        merging = sum(m["seconds"] or 0.0 for m in r["merges"])
        print(f"[compare] {r['variant']:7s} {r['method']:9s} held-out {r['heldout_loss']:.4f} "
              f"roughness {r['roughness']:.4f} ({r['seconds']:.0f} s, {len(r['merges'])} merges {merging:.1f} s)",
              flush=True)
        return r

    pairs = [(v, m) for v in args.variants for m in args.methods]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # threads only wait on subprocesses
        results = list(pool.map(one, pairs))
    write_report(results, args, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
