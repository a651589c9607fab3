"""The BitDelta quality report: how much of each fine-tune's gain survives 1-bit compression.

    python train/eval.py                                   # make eval: every variant, every setting
    python train/eval.py variants=[math] distill.enabled=false logger=csv
    python train/eval.py max_test_blocks=64 math.problems=50 distill.steps=20 '~logger'

Reads ``conf/eval.yaml``. For each variant (its ``domain`` from ``conf/variant/<name>.yaml``) on
its held-out test split (``data/<domain>/test.jsonl``, packed into ``seq_len`` blocks with the
base tokenizer) it evaluates these settings:

- ``base`` and ``fine-tune`` (``models/base``, ``models/<variant>``);
- ``bitdelta-<g>`` for each granularity ``g`` (``matrix``: one α per matrix, ``row``: one per
  output row, ``rowcol``: one per row and a column scale β per input, format version 2), exported
  afresh with :func:`deltafleet.compress.bitdelta.compress` into
  ``<run dir>/artifacts/<variant>-<g>`` (``artifacts/`` and ``models/`` are only read);
- ``bitdelta-<g>+distill-<loss>``: the same signs with scales distilled on the variant's train
  split (:func:`deltafleet.compress.distill.distill_scales`) for each loss in ``distill.losses`` (``mse``:
  logit MSE, the paper's; ``kl``: KL(fine-tune ‖ compressed)), unless ``distill.enabled=false``;
  ``build=false`` builds none of these;
- artifacts that already exist, scored as they are: ``existing`` maps a setting name to a folder
  (``{variant}`` stands for the variant), by default ``exported``: what ``make export`` (or the
  end of a training run) wrote for the variant. A folder without an artifact is skipped; an
  artifact of another base is refused (its fingerprint).

Metrics, all on the same test blocks:

- loss: token-weighted mean next-token cross-entropy (nats/token, ``T − 1`` predictions per
  block, as :func:`deltafleet.train.module.heldout_loss`), and perplexity ``exp(loss)``;
- task metric: exact-match accuracy of greedy answers to the first ``math.problems`` problems
  of the test split (all by default) for the math variant (:func:`exact_match`); next-token (top-1) accuracy
  for the others;
- KL(ft ‖ model): token mean of Σ_v p_ft(v)·(log p_ft(v) − log p_model(v)) over the same
  positions (nats/token; 0 for the fine-tune itself);
- gain recovered, for the loss and for the task metric: ``(m − m_base) / (m_ft − m_base)``
  (1 = all of the fine-tune's gain, 0 = none; the same formula whether lower or higher is
  better); undefined (``None``, "n/a") when the fine-tune does no better than the base on that
  metric;
- bits per parameter: every stored byte of the artifact's delta files
  (``stats.bits_per_parameter`` of its manifest); the fine-tune's is the bits of the dtype
  its checkpoint stores (32 for float32, 16 for bf16); the base's is 0 (it is resident anyway).

Writes ``${report.dir}/${report.name}.{md,json,png}`` (Markdown table per variant; every number
and the resolved config; bar chart of gain recovered with the goal line), prints the table and,
per variant, the best setting at ≤ ``goal.max_bits_per_parameter`` bits/param, and logs the rows
(a ``wandb.Table``) and summary metrics to the configured logger (W&B offline by default).
"""
from __future__ import annotations

import io
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Mapping

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from deltafleet.atomic import write_bytes, write_text
from deltafleet.cli import build_hint, finish_wandb, no_base, variant_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
COLUMNS = ["setting", "bits/param", "loss", "ppl", "task metric", "KL(ft‖·)", "gain recovered (loss)",
           "gain recovered (task)"]

# --------------------------------------------------------------------------------------------
# Math problems: splitting the test documents, parsing generated answers
# --------------------------------------------------------------------------------------------

_PROBLEM = re.compile(r"Question: (?P<q>.+)\nAnswer: (?P<a>-?\d+)", re.S)
_ANSWER = re.compile(r"\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    """One math problem of a test document: ``prompt`` ends with ``"Answer:"``."""

    question: str
    answer: int

    @property
    def prompt(self) -> str:
        return f"Question: {self.question}\nAnswer:"


def split_problems(text: str) -> list[Problem]:
    """The problems of one math document (``deltafleet.train.data``'s format).

    A document is ``"Question: <q>\\nAnswer: <int>"`` pairs separated by blank lines.

    Raises:
        ValueError: if a blank-line-separated chunk is not one such pair (the message quotes it).
    """
    out = []
    for chunk in text.strip().split("\n\n"):
        m = _PROBLEM.fullmatch(chunk.strip())
        if m is None:
            raise ValueError(f"not a 'Question: …\\nAnswer: <int>' problem: {chunk[:200]!r}")
        out.append(Problem(m["q"], int(m["a"])))
    return out


def load_problems(data_dir: str | Path, domain: str, split: str, limit: int | None) -> list[Problem]:
    """The first ``limit`` problems (all when ``None``) of ``data/<domain>/<split>.jsonl``, in file order."""
    path = Path(data_dir) / domain / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `make data` first (domain {domain!r})")
    problems: list[Problem] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                problems += split_problems(json.loads(line)["text"])
            if limit is not None and len(problems) >= limit:
                break
    return problems if limit is None else problems[:limit]


def parse_answer(text: str) -> int | None:
    """The integer a generated continuation of ``"…\\nAnswer:"`` starts with, or ``None``.

    Leading whitespace is skipped and the integer ends at the first non-digit, so
    ``" 1104\\n\\nQuestion: …"`` gives 1104 and ``" -285"`` gives −285; ``" apples"`` gives None.
    """
    m = _ANSWER.match(text)
    return int(m[1]) if m else None


@torch.no_grad()
def generate_answers(model: torch.nn.Module, tokenizer, problems: list[Problem], batch_size: int,
                     max_new_tokens: int, device: torch.device | str = "cpu") -> list[str]:
    """Greedy continuations (decoded text) of each problem's prompt.

    Each prompt is ``<eos> + prompt`` — a document start, as in the packed training stream — and
    a batch is left-padded (attention mask 0 on the padding), so batching does not change the
    answers. Generation stops after ``max_new_tokens`` tokens or at ``eos``.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for start in range(0, len(problems), batch_size):
        ids = [[eos, *tokenizer(p.prompt, add_special_tokens=False)["input_ids"]]
               for p in problems[start:start + batch_size]]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, x in enumerate(ids):
            input_ids[r, width - len(x):] = torch.tensor(x)
            mask[r, width - len(x):] = 1
        out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=pad, eos_token_id=eos)
        texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train(was_training)
    return texts


def exact_match(model: torch.nn.Module, tokenizer, problems: list[Problem], batch_size: int, max_new_tokens: int,
                device: torch.device | str = "cpu") -> tuple[float, list[int | None]]:
    """Exact-match accuracy (fraction in [0, 1]) of greedy answers, and the parsed answers."""
    if not problems:
        raise ValueError("exact_match needs at least one problem")
    texts = generate_answers(model, tokenizer, problems, batch_size, max_new_tokens, device)
    answers = [parse_answer(t) for t in texts]
    return sum(a == p.answer for a, p in zip(answers, problems)) / len(problems), answers


# --------------------------------------------------------------------------------------------
# Token metrics and gain recovered
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def token_metrics(models: Mapping[str, torch.nn.Module], blocks: torch.Tensor, batch_size: int,
                  reference: torch.nn.Module | None = None, device: torch.device | str = "cpu") -> dict[str, dict]:
    """Loss, perplexity, next-token accuracy and KL(reference ‖ model) of several models in one pass.

    Every batch of ``blocks`` is run through the reference once and through each model once; the
    predictions are positions ``0 … T−2`` of each block (targets ``1 … T−1``), as in
    :func:`deltafleet.train.module.heldout_loss`. A model that *is* the reference reuses its logits.

    Args:
        models: name → causal LM returning ``.logits`` ``[B, T, V]``.
        blocks: int64 ``[num_blocks, T]`` from :func:`deltafleet.train.datamodule.load_blocks`.
        batch_size: blocks per forward pass.
        reference: the distribution P of KL(P ‖ Q_model) (the fine-tune); ``None``: no KL.
        device: where to run.

    Returns:
        name → ``{"loss": nats/token, "perplexity": exp(loss) (:func:`perplexity`), "next_token_accuracy": fraction,
        "kl": nats/token (None without a reference), "tokens": predicted tokens}``.
    """
    import torch.nn.functional as F

    sums = {name: {"nll": 0.0, "correct": 0, "kl": 0.0} for name in models}
    count = 0
    modes = {name: m.training for name, m in models.items()}
    for m in [*models.values(), *([reference] if reference is not None else [])]:
        m.eval()
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start:start + batch_size].to(device)
        target = batch[:, 1:]
        ref = None
        if reference is not None:
            ref = F.log_softmax(reference(input_ids=batch).logits[:, :-1].float(), dim=-1)
        for name, m in models.items():
            lp = ref if m is reference else F.log_softmax(m(input_ids=batch).logits[:, :-1].float(), dim=-1)
            s = sums[name]
            s["nll"] -= lp.gather(-1, target.unsqueeze(-1)).sum().item()
            s["correct"] += (lp.argmax(-1) == target).sum().item()
            if ref is not None and m is not reference:
                s["kl"] += (ref.exp() * (ref - lp)).sum().item()
        count += target.numel()
    for name, m in models.items():
        m.train(modes[name])
    return {name: {"loss": s["nll"] / count, "perplexity": perplexity(s["nll"] / count),
                   "next_token_accuracy": s["correct"] / count,
                   "kl": s["kl"] / count if reference is not None else None, "tokens": count}
            for name, s in sums.items()}


def perplexity(loss: float) -> float:
    """``exp(loss)``; inf where that overflows a float (a loss above about 709.8 nats/token)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def gain_recovered(m: float | None, m_base: float | None, m_ft: float | None,
                   lower_is_better: bool | None = None) -> float | None:
    """``(m − m_base) / (m_ft − m_base)``: the share of the fine-tune's change that ``m`` keeps.

    1 means the compressed model matches the fine-tune, 0 that it is no better than the base;
    it is the same ratio of differences whether the metric is lower-is-better (loss) or
    higher-is-better (accuracy). Returns ``None`` (undefined) when the fine-tune equals the base
    on this metric, or, given the metric's direction (``lower_is_better``), does worse than it (no
    gain to recover: the ratio would read a worse model as a recovered gain), or any input is
    missing or NaN.
    """
    if m is None or m_base is None or m_ft is None or any(math.isnan(x) for x in (m, m_base, m_ft)):
        return None
    if m_ft == m_base or (lower_is_better is not None and (m_ft > m_base) == lower_is_better):
        return None
    return (m - m_base) / (m_ft - m_base) + 0.0  # + 0.0: the base's own -0.0 reads as 0.0


def checkpoint_bits_per_parameter(checkpoint_dir: str | Path) -> float:
    """Stored bits per parameter of a Hugging Face safetensors checkpoint: 8·tensor bytes / elements.

    Read from the safetensors headers only (no tensor is loaded): 32.0 for float32, 16.0 for bf16.
    """
    d = Path(checkpoint_dir)
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    nbytes = numel = 0
    for name in files:
        with open(d / name, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, t in header.items():
            if key != "__metadata__":
                nbytes += t["data_offsets"][1] - t["data_offsets"][0]
                numel += math.prod(t["shape"])
    return 8 * nbytes / numel


# --------------------------------------------------------------------------------------------
# Settings: load, compress, distill
# --------------------------------------------------------------------------------------------


def variant_domain(name: str) -> str:
    """The ``domain`` of ``conf/variant/<name>.yaml``."""
    path = CONF / "variant" / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (CONF / "variant").glob("*.yaml"))
        raise ValueError(f"unknown variant {name!r}: no {path} (one of {options})")
    return OmegaConf.load(path).domain


def load_hf(checkpoint_dir: str | Path, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).to(device).eval()


def finetuned_dir(cfg, variant: str) -> Path:
    """The family's fine-tune of ``variant``: ``models/<model.dirs.prefix><variant>``."""
    return Path(cfg.paths.models_dir) / f"{cfg.model.dirs.prefix}{variant}"


def load_bitdelta(base_dir: str | Path, artifact_dir: str | Path, base_fingerprint: str, device) -> torch.nn.Module:
    """Base + BitDelta artifact (:func:`deltafleet.compress.bitdelta.materialize`) as a float32 causal LM.

    The model is built from the base's ``config.json``; the artifact is checked against the base
    fingerprint and its file hashes.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltafleet.compress.bitdelta import load_artifact, materialize

    artifact = load_artifact(artifact_dir, base_fingerprint=base_fingerprint)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir), dtype=torch.float32)
    result = model.load_state_dict(materialize(base_dir, artifact), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{artifact_dir}: parameters the base architecture lacks: {result.unexpected_keys[:5]}")
    sd = model.state_dict()
    loaded = {sd[k].data_ptr() for k in sd if k not in result.missing_keys}
    missing = [k for k in result.missing_keys if sd[k].data_ptr() not in loaded]  # tied weights are loaded
    if missing:
        raise ValueError(f"{artifact_dir}: base + artifact lacks parameters {missing[:5]}")
    return model.float().to(device).eval()


def calibration_blocks(cfg: DictConfig, domain: str, tokenizer) -> torch.Tensor:
    """A seeded random subset (``distill.max_calibration_blocks``) of the domain's train blocks."""
    from deltafleet.train.datamodule import load_blocks  # datasets and Lightning: imported once work starts

    blocks = load_blocks(cfg.paths.data_dir, domain, "train", tokenizer, cfg.seq_len)
    cap = cfg.distill.max_calibration_blocks
    if cap is not None and blocks.shape[0] > cap:
        keep = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(cfg.seed))[:cap]
        blocks = blocks[keep.sort().values]
    return blocks


def build_artifacts(cfg: DictConfig, variant: str, domain: str, tokenizer, work: Path, run_id: str,
                    device) -> dict[str, dict]:
    """Export (and distill) every compressed setting of ``variant`` under ``work``.

    Returns:
        setting name → ``{"dir": artifact folder, "manifest": its manifest, "seconds": build time,
        "distillation": provenance.distillation or None}``, in report order.
    """
    from deltafleet.compress.bitdelta import compress

    ft_dir = finetuned_dir(cfg, variant)
    distill_scales = calib = None
    if cfg.distill.enabled:
        try:
            from deltafleet.compress.distill import distill_scales
        except ImportError as e:
            raise RuntimeError(f"distill.enabled=true but compress.distill cannot be imported ({e}); "
                               "run with distill.enabled=false") from e
        calib = calibration_blocks(cfg, domain, tokenizer)
    out: dict[str, dict] = {}
    for g in cfg.granularities:
        t0 = time.perf_counter()
        art = work / f"{variant}-{g}"
        manifest = compress(cfg.base_dir, ft_dir, art, variant=variant, granularity=g,
                            provenance={"run_id": run_id})
        out[f"bitdelta-{g}"] = {"dir": art, "manifest": manifest, "seconds": time.perf_counter() - t0,
                                "distillation": None}
        print(f"[eval] {variant}: exported {g} α → {art} ({manifest['stats']['bits_per_parameter']:.3f} "
              f"bits/param, {time.perf_counter() - t0:.1f} s)", flush=True)
        for loss in (cfg.distill.losses if distill_scales is not None else []):
            t0 = time.perf_counter()
            d = cfg.distill
            dart = work / f"{variant}-{g}-distill-{loss}"
            dman = distill_scales(cfg.base_dir, ft_dir, art, dart, calib, steps=d.steps, lr=d.lr, beta_lr=d.beta_lr,
                                  batch_size=d.batch_size, loss=loss, seed=cfg.seed, device=str(device),
                                  log_every=d.log_every, show_progress=False, provenance={"run_id": run_id})
            info = dman.get("provenance", {}).get("distillation")
            out[f"bitdelta-{g}+distill-{loss}"] = {"dir": dart, "manifest": dman,
                                                   "seconds": time.perf_counter() - t0, "distillation": info}
            before, after = (info or {}).get("loss_before"), (info or {}).get("loss_after")
            print(f"[eval] {variant}: distilled {g} α on {calib.shape[0]} train blocks, {d.steps} steps "
                  f"({loss} {_fmt(before, '{:.4g}')} → {_fmt(after, '{:.4g}')}, "
                  f"{time.perf_counter() - t0:.1f} s)", flush=True)
    return out


# --------------------------------------------------------------------------------------------
# One variant
# --------------------------------------------------------------------------------------------


def existing_artifacts(cfg: DictConfig, variant: str) -> dict[str, dict]:
    """The settings of ``cfg.existing`` (name → folder, ``{variant}`` replaced) whose folder holds an
    artifact, as :func:`build_artifacts` returns them; a folder without one is skipped, and said so.

    Raises:
        ValueError: a manifest that is no regular file, no JSON or no JSON object, naming the setting.
    """
    from deltafleet.compress.bitdelta import ArtifactError, manifest_json

    out: dict[str, dict] = {}
    for name, pattern in (cfg.get("existing") or {}).items():
        folder = Path(str(pattern).replace("{variant}", variant))
        try:
            manifest = manifest_json(folder)  # only a regular file is read: a named pipe would block
        except ArtifactError as e:
            raise ValueError(f"existing.{name}: {e}") from None
        if manifest is None:
            print(f"[eval] {variant}: no artifact at {folder}: setting {name!r} skipped", flush=True)
            continue
        if not isinstance(manifest, dict):
            raise ValueError(f"existing.{name}: {folder / 'bitdelta.json'}: the manifest must be a JSON object")
        out[name] = {"dir": folder, "manifest": manifest, "seconds": 0.0,
                     "distillation": (manifest.get("provenance") or {}).get("distillation")}
    return out


def check_settings(cfg: DictConfig) -> None:
    """Raises ValueError, before any work, for a yes/no setting that is not true or false (Hydra keeps
    ``build=no`` as text, which reads as true), a count that is not a positive integer (``null`` where
    the config allows it), a goal that is not a finite number, variants given twice, an ``existing``
    setting named as a built one or whose folder is not a text, or nothing to compare."""
    from deltafleet.cli import flag

    for key in ("build", "distill.enabled"):
        flag(cfg, key)
    counts = {"seq_len": False, "batch_size": False, "max_test_blocks": True, "math.problems": True,
              "math.batch_size": False, "math.max_new_tokens": False, "distill.steps": False,
              "distill.batch_size": False, "distill.max_calibration_blocks": False}
    for key, nullable in counts.items():
        v = OmegaConf.select(cfg, key)
        if not (v is None and nullable) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{key} must be a positive integer{' or null' if nullable else ''}, got {v!r}")
    for key in ("goal.max_bits_per_parameter", "goal.gain_recovered"):
        v = OmegaConf.select(cfg, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{key} must be a finite number, got {v!r}")
    if not OmegaConf.is_list(cfg.variants):
        raise ValueError(f"variants must be a list, e.g. 'variants=[coder,math]', got {cfg.variants!r}")
    twice = sorted({v for v in cfg.variants if list(cfg.variants).count(v) > 1})
    if twice:
        raise ValueError(f"variants lists {twice} more than once")
    names = set(cfg.get("existing") or {})
    bad = sorted(n for n, v in (cfg.get("existing") or {}).items() if not isinstance(v, str) or not v)
    if bad:
        raise ValueError(f"existing: the folders of {bad} must be paths (text, with {{variant}} for the variant)")
    clash = sorted(n for n in names if n in ("base", "fine-tune") or n.startswith("bitdelta-"))
    if clash:
        raise ValueError(f"existing: setting names {clash} are reserved (base, fine-tune, bitdelta-*)")
    if not cfg.build and not names:
        raise ValueError("build=false and no existing artifacts: nothing compressed to evaluate")


def evaluate_variant(cfg: DictConfig, variant: str, tokenizer, base_fingerprint: str, work: Path, run_id: str,
                     device) -> dict:
    """Build and evaluate every setting of one variant; returns its section of the report."""
    from deltafleet.train.datamodule import load_blocks

    domain = variant_domain(variant)
    ft_dir = finetuned_dir(cfg, variant)  # present: run() checked every variant's before any work
    t_start = time.perf_counter()
    blocks = load_blocks(cfg.paths.data_dir, domain, "test", tokenizer, cfg.seq_len)
    if cfg.max_test_blocks is not None:
        blocks = blocks[: cfg.max_test_blocks]
    artifacts = build_artifacts(cfg, variant, domain, tokenizer, work, run_id, device) if cfg.build else {}
    artifacts.update(existing_artifacts(cfg, variant))
    if not artifacts:  # build=false and none of the existing folders holds an artifact
        raise FileNotFoundError(f"{variant}: no artifact in any folder of existing ({dict(cfg.existing)}) and "
                                "build=false: nothing compressed to evaluate")

    models = {"base": load_hf(cfg.base_dir, device), "fine-tune": load_hf(ft_dir, device)}
    for name, a in artifacts.items():
        models[name] = load_bitdelta(cfg.base_dir, a["dir"], base_fingerprint, device)
    t0 = time.perf_counter()
    metrics = token_metrics(models, blocks, cfg.batch_size, reference=models["fine-tune"], device=device)
    metrics_seconds = time.perf_counter() - t0

    problems: list[Problem] = []
    task_name = "next-token accuracy"
    t0 = time.perf_counter()
    if variant in cfg.math.variants:
        problems = load_problems(cfg.paths.data_dir, domain, "test", cfg.math.problems)
        task_name = "exact match"
        for name, m in models.items():
            metrics[name]["exact_match"], _ = exact_match(m, tokenizer, problems, cfg.math.batch_size,
                                                          cfg.math.max_new_tokens, device)
    task_seconds = time.perf_counter() - t0
    task_key = "exact_match" if problems else "next_token_accuracy"

    bits = {"base": 0.0, "fine-tune": checkpoint_bits_per_parameter(ft_dir)}
    bits.update({name: float(a["manifest"]["stats"]["bits_per_parameter"]) for name, a in artifacts.items()})
    b, f = metrics["base"], metrics["fine-tune"]
    rows = []
    for name, m in metrics.items():
        rows.append({"setting": name, "bits_per_parameter": bits[name], "loss": m["loss"],
                     "perplexity": m["perplexity"], "task_metric": m[task_key],
                     "next_token_accuracy": m["next_token_accuracy"], "exact_match": m.get("exact_match"),
                     "kl": m["kl"],
                     "gain_recovered_loss": gain_recovered(m["loss"], b["loss"], f["loss"], lower_is_better=True),
                     "gain_recovered_task": gain_recovered(m[task_key], b[task_key], f[task_key],
                                                           lower_is_better=False),
                     "artifact": str(artifacts[name]["dir"]) if name in artifacts else None,
                     "distillation": artifacts[name]["distillation"] if name in artifacts else None})
    del models
    return {"variant": variant, "domain": domain, "test_blocks": int(blocks.shape[0]), "tokens": f["tokens"],
            "task_metric": task_name, "problems": len(problems), "rows": rows,
            "best": best_setting(rows, cfg.goal.max_bits_per_parameter),
            "seconds": {"total": time.perf_counter() - t_start, "metrics": metrics_seconds, "task": task_seconds,
                        "build": {k: a["seconds"] for k, a in artifacts.items()}}}


def best_setting(rows: list[dict], max_bits: float) -> dict | None:
    """The compressed row (not base, not fine-tune) at ≤ ``max_bits`` with the highest loss gain recovered."""
    cands = [r for r in rows if r["setting"] not in ("base", "fine-tune") and r["bits_per_parameter"] <= max_bits
             and r["gain_recovered_loss"] is not None]
    return max(cands, key=lambda r: r["gain_recovered_loss"], default=None)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _fmt(x, fmt: str = "{:.4f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def format_table(section: dict) -> list[str]:
    """The Markdown table of one variant (columns :data:`COLUMNS`)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in section["rows"]:
        cells = [r["setting"], _fmt(r["bits_per_parameter"], "{:.3f}"), _fmt(r["loss"]),
                 _fmt(r["perplexity"], "{:.2f}"), _fmt(r["task_metric"]), _fmt(r["kl"]),
                 _fmt(r["gain_recovered_loss"], "{:.3f}"), _fmt(r["gain_recovered_task"], "{:.3f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def best_line(section: dict, goal: DictConfig | dict) -> str:
    best = section["best"]
    if best is None:
        rows = {r["setting"]: r for r in section["rows"]}
        if "base" in rows and "fine-tune" in rows and not rows["fine-tune"]["loss"] < rows["base"]["loss"]:
            return (f"{section['variant']}: the fine-tune's loss is no lower than the base's on the test blocks: "
                    "no gain to recover")
        return (f"{section['variant']}: no compressed setting at ≤ {goal['max_bits_per_parameter']} bits/param "
                "with a defined gain recovered")
    g = best["gain_recovered_loss"]
    verdict = "meets" if g >= goal["gain_recovered"] else "misses"
    return (f"{section['variant']}: best at ≤ {goal['max_bits_per_parameter']} bits/param is {best['setting']} "
            f"({best['bits_per_parameter']:.3f} bits/param): gain recovered (loss) {g:.3f}, "
            f"(task) {_fmt(best['gain_recovered_task'], '{:.3f}')} — {verdict} the goal ≥ {goal['gain_recovered']}")


def report_markdown(payload: dict) -> str:
    cfg = payload["config"]
    d = cfg["distill"]
    distill = (f"scale distillation: {d['steps']} steps of {' and of '.join(d['losses'])} on ≤ {d['max_calibration_blocks']} train "
               f"blocks (batch {d['batch_size']}, lr {d['lr']}; β lr {d.get('beta_lr')} for rowcol)"
               if d["enabled"] else "scale distillation: off")
    if not cfg.get("build", True):
        distill = "nothing built (build=false): existing artifacts scored as they are"
    lines = [f"# BitDelta quality — {payload['date']}", "",
             f"Machine: {payload['machine']}; device {payload['device']}. Command: `{payload['command']}`. "
             f"Wall time: {payload['seconds']:.0f} s.",
             f"Family `{cfg['model']['name']}`, base `{cfg['base_dir']}`; seq_len {cfg['seq_len']}; {distill}.",
             "Loss: token-weighted mean next-token cross-entropy on the variant's test split (nats/token); "
             "ppl = exp(loss). KL(ft‖·): token mean of KL(fine-tune ‖ model), nats/token. "
             "Gain recovered = (m − m_base)/(m_ft − m_base) (n/a: the fine-tune does no better than the base on m). "
             "Bits/param count every stored byte of the delta files; the fine-tune's is its checkpoint dtype's "
             "bits, the base's 0.", ""]
    for s in payload["variants"]:
        task = (f"exact-match accuracy on {s['problems']} problems" if s["problems"]
                else "next-token accuracy")
        rows = {r["setting"]: r for r in s["rows"]}
        if s["problems"]:
            solved = {k: round(rows[k]["task_metric"] * s["problems"]) for k in ("base", "fine-tune")}
            extra = solved["fine-tune"] - solved["base"]
            task += (f"; base solves {solved['base']}, fine-tune {solved['fine-tune']}"
                     + (f", so one problem moves the task's gain recovered by {1 / abs(extra):.2f}" if extra else ""))
        lines += [f"## {s['variant']} (data/{s['domain']}/test: {s['test_blocks']} blocks, {s['tokens']} predicted "
                  f"tokens; task metric: {task})", "", *format_table(s), ""]
    lines += [f"## Best setting at ≤ {cfg['goal']['max_bits_per_parameter']} bits/param "
              f"(goal: gain recovered ≥ {cfg['goal']['gain_recovered']})", ""]
    lines += [f"- {best_line(s, cfg['goal'])}" for s in payload["variants"]]
    return "\n".join(lines) + "\n"


def _bits_label(bits: list[float]) -> str:
    lo, hi = min(bits), max(bits)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def plot_png(payload: dict) -> bytes:
    """Bar chart: gain recovered (loss, and task) per variant per compressed setting, goal line.

    The settings are those of every variant (an existing artifact one variant lacks is a missing bar
    there); a setting whose bits/param differ between variants is labelled with their range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = payload["variants"]
    bits: dict[str, list[float]] = {}  # every compressed setting of any variant, in report order
    for s in sections:
        for r in s["rows"]:
            if r["setting"] not in ("base", "fine-tune"):
                bits.setdefault(r["setting"], []).append(r["bits_per_parameter"])
    settings = list(bits)
    labels = [f"{name} ({_bits_label(b)} bits/param)" for name, b in bits.items()]
    tasks = ", ".join(f"{s['variant']}: {s['task_metric']}" for s in sections)
    goal = payload["config"]["goal"]["gain_recovered"]
    fig, axes = plt.subplots(1, 2, figsize=(8 + 1.6 * len(sections), 4.0), sharey=True)
    width = 0.8 / max(1, len(settings))
    for ax, key, title in zip(axes, ("gain_recovered_loss", "gain_recovered_task"),
                              ("gain recovered: loss (nats/token)", f"gain recovered: task metric\n({tasks})")):
        for i, name in enumerate(settings):
            vals = []
            for s in sections:
                r = next((r for r in s["rows"] if r["setting"] == name), None)
                vals.append(float("nan") if r is None or r[key] is None else r[key])
            ax.bar([x + (i - (len(settings) - 1) / 2) * width for x in range(len(sections))], vals, width,
                   label=labels[i])
        ax.axhline(goal, color="k", linestyle="--", linewidth=1, label=f"goal {goal}")
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.set_xticks(range(len(sections)), [s["variant"] for s in sections])
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("(m − m_base) / (m_ft − m_base)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def _strict_json(x):
    """``x`` with every NaN or infinite float as None: JSON has no such numbers (``json.dumps`` would
    write ``NaN`` / ``Infinity``, which strict readers refuse)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict_json(v) for v in x]
    return x


def write_report(payload: dict, stem: Path) -> str:
    """Write ``stem.json`` (the payload, a NaN or infinite number as null), ``stem.md`` and
    ``stem.png`` atomically; returns the Markdown.

    All three are made before any is written: one that cannot be made (the chart) leaves none."""
    text = report_markdown(payload)
    blob = json.dumps(_strict_json(payload), indent=2, allow_nan=False) + "\n"
    png = plot_png(payload)
    write_text(stem.with_suffix(".json"), blob)
    write_text(stem.with_suffix(".md"), text)
    write_bytes(stem.with_suffix(".png"), png)
    return text


def log_to_logger(logger, payload: dict, png: Path) -> None:
    """Summary metrics to any Lightning logger; on W&B also the rows as a ``wandb.Table`` and the chart."""
    from lightning.pytorch.loggers import WandbLogger

    logger.log_hyperparams(payload["config"])
    summary = {}
    for s in payload["variants"]:
        for r in s["rows"]:
            for k in ("bits_per_parameter", "loss", "perplexity", "task_metric", "kl", "gain_recovered_loss",
                      "gain_recovered_task"):
                if r[k] is not None:
                    summary[f"eval/{s['variant']}/{r['setting']}/{k}"] = float(r[k])
        if s["best"] is not None:
            summary[f"eval/{s['variant']}/best_gain_recovered_loss"] = float(s["best"]["gain_recovered_loss"])
    logger.log_metrics(summary, step=0)
    if isinstance(logger, WandbLogger):
        data = [[s["variant"], r["setting"], r["bits_per_parameter"], r["loss"], r["perplexity"], r["task_metric"],
                 r["kl"], r["gain_recovered_loss"], r["gain_recovered_task"]]
                for s in payload["variants"] for r in s["rows"]]
        logger.log_table(key="eval", columns=["variant", "setting", "bits_per_parameter", "loss", "perplexity",
                                              "task_metric", "kl", "gain_recovered_loss", "gain_recovered_task"],
                         data=data)
        logger.log_image(key="gain_recovered", images=[str(png)])
    logger.save()


def _machine() -> str:
    cpu = f"{platform.node() or 'unknown'} ({platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if torch.cuda.is_available():
        cpu += f", {torch.cuda.get_device_name(0)}"
    return cpu + ")"


def trainable_variants() -> list[str]:
    """The variants ``train/run.py variant=<name>`` trains: the configs of ``conf/variant/``
    (``deltafleet.cli.variant_configs``), the base's own aside."""
    return [v for v in variant_configs() if v != "base"]


def run(cfg: DictConfig) -> dict:
    """The whole report (module docstring); returns the JSON payload."""
    from deltafleet.checkpoint import load_tokenizer
    from deltafleet.compress.bitdelta import fingerprint

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if not cfg.variants:
        raise ValueError("variants is empty: nothing to evaluate")
    check_settings(cfg)
    if not (Path(cfg.base_dir) / "config.json").is_file():
        raise FileNotFoundError(no_base(cfg))
    missing = [v for v in cfg.variants if not (finetuned_dir(cfg, v) / "config.json").is_file()]
    known = trainable_variants()
    unknown = [v for v in missing if v not in known]
    if unknown:  # no command would build it: say which names there are
        raise FileNotFoundError(
            f"no fine-tune of {', '.join(missing)} under {cfg.paths.models_dir}, and {', '.join(unknown)} "
            f"{'is' if len(unknown) == 1 else 'are'} not a variant train/run.py trains (conf/variant/: "
            f"{', '.join(known)}): pick variants=[...]")
    if missing:
        raise FileNotFoundError(
            f"no fine-tune of {', '.join(missing)} under {cfg.paths.models_dir}: build it with "
            + "; ".join(f"`{build_hint(cfg, 'variant', v)}`" for v in missing) + ", or pick variants=[...]")
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() \
        else Path(cfg.paths.output_dir) / "eval"
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    tokenizer = load_tokenizer(cfg.base_dir)
    base_fp = fingerprint(cfg.base_dir)
    logger = None
    if cfg.get("logger") is not None and "_target_" in cfg.logger:
        logger = hydra.utils.instantiate(cfg.logger)
    stopped: BaseException | None = None
    try:
        sections = []
        for variant in cfg.variants:
            built = len(cfg.granularities) * (1 + cfg.distill.enabled * len(cfg.distill.losses)) if cfg.build else 0
            print(f"[eval] {variant}: building {built} settings, evaluating them, the base, the fine-tune and "
                  f"what exists of {sorted(cfg.get('existing') or {})}", flush=True)
            s = evaluate_variant(cfg, variant, tokenizer, base_fp, run_dir / "artifacts", f"eval/{run_dir.name}",
                                 device)
            print("\n".join([f"[eval] {variant} ({s['test_blocks']} test blocks, task metric: {s['task_metric']})",
                             *format_table(s)]), flush=True)
            sections.append(s)
        payload = {"date": date.today().isoformat(), "machine": _machine(),
                   "command": " ".join(["python train/eval.py", *sys.argv[1:]]),
                   "device": str(device), "seconds": time.perf_counter() - t0,
                   "config": OmegaConf.to_container(cfg, resolve=True), "variants": sections}
        stem = Path(cfg.report.dir) / cfg.report.name
        print(write_report(payload, stem), flush=True)
        print(f"[eval] wrote {stem}.md, .json, .png ({payload['seconds']:.0f} s)", flush=True)
        if logger is not None:
            log_to_logger(logger, payload, stem.with_suffix(".png"))
    except BaseException as e:
        stopped = e
        raise
    finally:
        finish_wandb(stopped)
    return payload


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from deltafleet.cli import stop_on_sigterm, user_errors

    stop_on_sigterm()  # a stopped eval removes what it staged, as Ctrl-C does
    with user_errors("eval"):
        from deltafleet.threads import set_threads

        set_threads(cfg)
        payload = run(cfg)
    best = [s["best"]["gain_recovered_loss"] for s in payload["variants"] if s["best"] is not None]
    return min(best) if best else None


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
