"""Normalised score vs pool size for the LoRA adapter pool (``make kmerge-eval``,
``conf/kmerge_eval.yaml``; the pool is merge/kmerge.py).

For each policy and each K, the adapters arrive one at a time into a pool of K slots; then every
adapter is served by its slot and scored on its own domain's held-out text:
``S = mean_i gain(slot of i) / gain(i's own adapter)`` with ``gain = loss(base) − loss(base + ΔW)``
(nats/token on the test split). Policies: ``kmerge``, ``kmerge++``, ``budget_opcm`` (byte budget =
K slots, OPCM, quality gate on the val split) and two baselines that fill the K slots in arrival
order (adapter i → slot i mod K) and merge by plain averaging (``linear``) or TIES (``ties``) of
``ΔW``, re-factorised to the same rank. JSON, a Markdown table and a PNG in ``reports/``.

An adapter whose own gain is not above 0 (no better than the base on its domain) has no gain to keep:
its ratio is undefined (:func:`gain_ratio`: ``null`` in the JSON), and S is the mean over the other
adapters, with those left out named under the table (an S over none is ``n/a``).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]


def train_adapter(cfg: DictConfig, domain: str, seed: int, out: Path) -> None:
    """``train/run.py variant=<domain> variant.adapter=lora seed=<seed>`` into ``out``, unless ``out``
    holds an adapter whose ``training.json`` says it was trained on ``base_dir``."""
    from deltafleet.checkpoint import read_json

    trained_on = (read_json(out / "training.json") or {}).get("base_dir")
    if (out / "adapter" / "adapter_model.safetensors").is_file() and isinstance(trained_on, str) \
            and Path(trained_on).resolve() == Path(cfg.base_dir).resolve():
        return
    r = subprocess.run([sys.executable, str(REPO / "train" / "run.py"), f"variant={domain}", "variant.adapter=lora",
                        f"variant.name={domain}-lora-s{seed}", f"seed={seed}", "export.enabled=false", "logger=csv",
                        # absolute: the training runs in the repository, not in this job's folder
                        *(f"{k}={Path(v).resolve()}" for k, v in (("out_dir", out), ("paths.root", cfg.paths.root),
                                                                   ("base_dir", cfg.base_dir)))], cwd=REPO,
                       capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode != 0:
        raise SystemExit(f"training the {domain} adapter (seed {seed}) failed:\n{r.stderr[-2000:]}")


def load_factors(adapter_dir: Path) -> dict:
    """PEFT LoRA adapter → ``{module: (A, B·s)}`` keyed by the module's name in the model
    (``model.layers.0.self_attn.q_proj``), with PEFT's scale ``s``: ``lora_alpha / r``, or
    ``lora_alpha / √r`` for rsLoRA (``use_rslora``); ``r`` is the module's own rank (its A's rows, as
    ``rank_pattern`` sets them) and ``alpha_pattern`` overrides ``lora_alpha`` for the modules it names.
    A DoRA adapter (``use_dora``), whose update is not B·A, is refused (ValueError)."""
    from safetensors.torch import load_file

    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    if conf.get("use_dora"):
        raise ValueError(f"{adapter_dir} is a DoRA adapter (use_dora), whose update is not B·A: not supported")
    alphas = conf.get("alpha_pattern") or {}

    def scale(module: str, r: int) -> float:
        alpha = next((v for k, v in alphas.items() if k == module or re.fullmatch(rf"(.*\.)?(?:{k})", module)),
                     conf["lora_alpha"])
        return alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r

    t = load_file(adapter_dir / "adapter_model.safetensors")
    out = {}
    for k, a in t.items():
        if k.endswith(".lora_A.weight"):
            mod = k[: -len(".lora_A.weight")].removeprefix("base_model.model.")
            b = t[k.replace(".lora_A.", ".lora_B.")]
            out[mod] = (a.double(), b.double() * scale(mod, a.shape[0]))
    return out


class Scorer:
    """Held-out loss of the base with a LoRA update added to its weights (restored after)."""

    def __init__(self, cfg: DictConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from deltafleet.train.datamodule import load_blocks

        self.model = AutoModelForCausalLM.from_pretrained(cfg.base_dir, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(cfg.base_dir)
        data = Path(cfg.paths.root) / "data"
        self.blocks = {(d, s): load_blocks(data, d, s, tok, seq_len=cfg.seq_len) for d in cfg.domains
                       for s in ("test", "val")}
        self.cfg = cfg
        self.params = dict(self.model.named_parameters())
        self.calls = 0

    def loss(self, factors: dict | None, domain: str, split: str = "test") -> float:
        from deltafleet.train.module import heldout_loss

        n = self.cfg.eval_batches if split == "test" else self.cfg.gate_batches
        saved = {}
        with torch.no_grad():
            for mod, (a, b) in (factors or {}).items():
                w = self.params[f"{mod}.weight"]
                saved[mod] = w.detach().clone()
                w += (b @ a).to(w.dtype)
            try:
                self.calls += 1
                return float(heldout_loss(self.model, self.blocks[(domain, split)], self.cfg.batch_size, n))
            finally:
                for mod, w0 in saved.items():
                    self.params[f"{mod}.weight"].copy_(w0)


def baseline_pool(policy: str, k: int, adapters: dict, rank: int, density: float) -> tuple[dict, dict]:
    """Arrival-order slots (adapter i → slot i mod K), merged by averaging (``linear``) or TIES (``ties``)
    of the members' ΔW, re-factorised to ``rank``. Returns (slot → factors, task → slot)."""
    from deltafleet.merge.kmerge import refactor, svd_factors
    from deltafleet.merge.methods import get_method

    names = list(adapters)
    groups = {s: [n for i, n in enumerate(names) if i % k == s] for s in range(min(k, len(names)))}
    slots = {}
    for s, members in groups.items():
        f = {}
        for mod in adapters[members[0]]:
            if policy == "linear" or len(members) == 1:
                parts = [(1.0 / len(members), *adapters[n][mod]) for n in members]
                f[mod] = refactor(parts, rank)
            else:
                dense = [adapters[n][mod][1] @ adapters[n][mod][0] for n in members]
                zero = torch.zeros_like(dense[0])
                f[mod] = svd_factors(get_method("ties", density=density).merge(mod, zero, dense), rank)
        slots[s] = f
    return slots, {n: i % k for i, n in enumerate(names)}


def gain_ratio(served: float, own: float) -> float | None:
    """``served / own``: the share of its own adapter's held-out gain (nats/token) that a task keeps with
    the slot that serves it. None (undefined) where ``own <= 0``: the adapter is no better than the
    base, so there is no gain to keep, as ``make eval``'s gain recovered is undefined then."""
    return served / own if own > 0 else None


def mean_ratio(per: dict[str, float | None]) -> float | None:
    """S: the mean of the defined ratios of ``per`` (adapter → :func:`gain_ratio`); None where none is."""
    defined = [v for v in per.values() if v is not None]
    return sum(defined) / len(defined) if defined else None


def _fmt(x: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def main(cfg: DictConfig) -> dict:
    from deltafleet.atomic import write_figure, write_text
    from deltafleet.merge.kmerge import AdapterPool

    t0 = time.perf_counter()
    specs = [(d, s) for s in cfg.seeds for d in cfg.domains] if cfg.order == "interleaved" else \
        [(d, s) for d in cfg.domains for s in cfg.seeds]
    adapters, domain_of = {}, {}
    for d, s in specs:
        out = Path(cfg.adapters_dir) / f"{d}-s{s}"
        train_adapter(cfg, d, s, out)
        name = f"{d}-s{s}"
        adapters[name], domain_of[name] = load_factors(out / "adapter"), d
    print(f"[kmerge] {len(adapters)} adapters ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    scorer = Scorer(cfg)
    base_loss = {d: scorer.loss(None, d) for d in cfg.domains}
    base_val = {d: scorer.loss(None, d, "val") for d in cfg.domains}
    own = {n: base_loss[domain_of[n]] - scorer.loss(f, domain_of[n]) for n, f in adapters.items()}
    print("[kmerge] own gains (nats/token): " + ", ".join(f"{n} {g:+.4f}" for n, g in own.items()), flush=True)

    def quality(task, factors):  # the gate's metric: val gain of the task's domain
        d = domain_of[task]
        return base_val[d] - scorer.loss(factors, d, "val")

    results: dict = {}
    for policy in cfg.policies:
        results[policy] = {}
        for k in cfg.ks:
            if policy in ("linear", "ties"):
                slots, t2s = baseline_pool(policy, k, adapters, cfg.rank, cfg.ties_density)
                log = []
            else:
                kw = dict(rank=cfg.rank, threshold=cfg.threshold, gate=cfg.gate, alpha=cfg.alpha,
                          evicted_to=cfg.evicted_to)
                if policy == "budget_opcm":
                    probe = AdapterPool("kmerge", rank=cfg.rank, k=1)
                    kw.update(byte_budget=k * probe.slot_bytes(next(iter(adapters.values()))), quality=quality)
                else:
                    kw.update(k=k)
                pool = AdapterPool(policy, **kw)
                for n, f in adapters.items():
                    pool.admit(n, f)
                slots = {sid: s.factors for sid, s in pool.slots.items()}
                t2s, log = dict(pool.task_to_slot), pool.log
            cache, per = {}, {}
            for n in adapters:
                key = (t2s[n], domain_of[n])
                if t2s[n] is None:  # its slot was evicted: served by the base, gain 0
                    per[n] = gain_ratio(0.0, own[n])
                    continue
                if key not in cache:
                    cache[key] = base_loss[domain_of[n]] - scorer.loss(slots[t2s[n]], domain_of[n])
                per[n] = gain_ratio(cache[key], own[n])
            s_val = mean_ratio(per)
            results[policy][k] = {"S": s_val, "per_adapter": per, "slots_used": len(slots),
                                  "task_to_slot": {n: (None if v is None else int(v)) for n, v in t2s.items()},
                                  "actions": [r["action"] for r in log]}
            print(f"[kmerge] {policy:12s} K={k}: S = {_fmt(s_val)} ({len(slots)} slots)", flush=True)
    undefined = [n for n, g in own.items() if gain_ratio(0.0, g) is None]
    report = {"date": time.strftime("%Y-%m-%d"), "machine": cfg.machine,
              "config": OmegaConf.to_container(cfg, resolve=True), "adapters": list(adapters),
              "own_gain_nats": own, "undefined_ratio": undefined, "base_loss": base_loss, "results": results,
              "evaluations": scorer.calls, "seconds": time.perf_counter() - t0}
    reports = Path(cfg.paths.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    write_text(reports / f"{cfg.report_name}.json", json.dumps(report, indent=1, default=str) + "\n")
    lines = ["| policy | " + " | ".join(f"K={k}" for k in cfg.ks) + " |", "|---|" + "---|" * len(cfg.ks)]
    for p in cfg.policies:
        lines.append(f"| {p} | " + " | ".join(_fmt(results[p][k]["S"]) for k in cfg.ks) + " |")
    if undefined:
        lines += ["", f"S leaves out {', '.join(undefined)}: own gain ≤ 0 (no better than the base), so "
                      "gain(served) / gain(own) is undefined."]
    write_text(reports / f"{cfg.report_name}.md", "\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in cfg.policies:
        ax.plot(list(cfg.ks), [math.nan if results[p][k]["S"] is None else results[p][k]["S"] for k in cfg.ks],
                marker="o", label=p)
    ax.axhline(1.0, color="k", ls=":", lw=0.8)
    ax.set_xlabel("slots K")
    ax.set_ylabel("S = mean gain(served) / gain(own)")
    ax.set_title(f"{len(adapters)} LoRA adapters of the demo family, {cfg.order} arrival — {cfg.machine}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(fig, reports / f"{cfg.report_name}.png", dpi=110)
    print("\n".join(lines))
    print(f"wrote {reports / cfg.report_name}.{{json,md,png}}")
    return report


POLICIES = ("kmerge", "kmerge++", "budget_opcm", "linear", "ties")


def check_config(cfg: DictConfig) -> None:
    """Raises ValueError naming the first bad setting, before any adapter is trained: a domain with
    no ``conf/variant/`` config (its training would fail after the others'), seeds, slot counts,
    policies, the evaluation's sizes and the report's name."""
    from deltafleet.cli import check_report_name, check_settings, variant_configs
    from deltafleet.values import real, whole

    check_settings(cfg, "kmerge_eval.yaml")
    known = variant_configs()
    for key, items, ok, what in (
            ("domains", cfg.domains, lambda d: d in known, f"a variant config ({', '.join(known)})"),
            ("seeds", cfg.seeds, lambda v: whole(v) and v >= 0, "a whole number ≥ 0"),
            ("ks", cfg.ks, lambda v: whole(v) and v >= 1, "a whole number ≥ 1"),
            ("policies", cfg.policies, lambda v: v in POLICIES, f"one of {', '.join(POLICIES)}")):
        if not OmegaConf.is_list(items) or not items:
            raise ValueError(f"{key} must be a non-empty list, got {items!r}")
        bad = [v for v in items if not ok(v)]
        if bad:
            raise ValueError(f"{key}: each must be {what}, got {bad[0]!r}")
        if len(set(items)) != len(items):
            raise ValueError(f"{key} lists {next(v for v in items if list(items).count(v) > 1)!r} twice")
    if cfg.order not in ("interleaved", "grouped"):
        raise ValueError(f"order must be interleaved or grouped, got {cfg.order!r}")
    if cfg.evicted_to not in ("similar", "base"):
        raise ValueError(f"evicted_to must be similar or base, got {cfg.evicted_to!r}")
    for key in ("rank", "seq_len", "batch_size", "eval_batches", "gate_batches"):
        if not whole(cfg[key]) or cfg[key] < 1:
            raise ValueError(f"{key} must be a whole number ≥ 1, got {cfg[key]!r}")
    if not real(cfg.threshold) or not 0 <= cfg.threshold <= 1:
        raise ValueError(f"threshold must be a number from 0 to 1, got {cfg.threshold!r}")
    # the bounds AdapterPool takes: refused here, not after every adapter is trained
    if not real(cfg.gate) or not 0 < cfg.gate <= 1:
        raise ValueError(f"gate must be a number above 0, at most 1, got {cfg.gate!r}")
    if not real(cfg.alpha) or not 0 < cfg.alpha < 1:
        raise ValueError(f"alpha must be a number above 0, below 1, got {cfg.alpha!r}")
    if not real(cfg.ties_density) or not 0 < cfg.ties_density <= 1:  # the share of each task vector TIES keeps
        raise ValueError(f"ties_density must be a number above 0, at most 1, got {cfg.ties_density!r}")
    check_report_name(cfg.report_name)
    if not (Path(cfg.base_dir) / "config.json").is_file():
        raise FileNotFoundError(f"base_dir {cfg.base_dir} holds no config.json: build the base first (make base)")


@hydra.main(version_base="1.3", config_path="../conf", config_name="kmerge_eval")
def _entry(cfg: DictConfig) -> None:
    from deltafleet.cli import user_errors
    from deltafleet.threads import set_threads

    with user_errors("kmerge-eval"):  # a bad setting: one line, not a traceback, and no run folder left
        set_threads(cfg)
        check_config(cfg)
    main(cfg)


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(_entry)
