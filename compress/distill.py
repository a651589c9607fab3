"""BitDelta scale distillation: fit the scales of an artifact to the fine-tune's logits (the source's
format version in, the same out).

    python compress/distill.py variant=math                  # artifacts/math → artifacts/math-distilled
    python compress/distill.py variant=math granularity=row  # from a row-α export of models/math
    python compress/distill.py variant=math granularity=rowcol loss=kl   # α per row and β per column
    python compress/distill.py variant=math loss=kl steps=400 logger=wandb

BitDelta (Liu et al., arXiv:2402.10193, §3.2) keeps the signs ``sign(Δ)`` of an export fixed and
trains only the scales: the student is the base with every compressed weight replaced by
``W_base + α·sign(Δ)`` (Eq. 2), the teacher is the fine-tuned model, and α is fitted by Adam to
minimise the mean squared error between their logits on a little calibration text (the paper: 200
steps of 4 samples of 128 tokens, lr 1e-4; its reference code, FasterDecoding/BitDelta
``bitdelta/train.py``, uses AdamW with a cosine schedule — here plain Adam at a constant lr).
Starting from α = mean|Δ| (the per-matrix L2 optimum, §3.1), this corrects the errors the 1-bit
approximation makes *in the model's outputs*, which the per-matrix optimum does not see; unlike the
reference code, α is clamped to ≥ 0 after every step, as the format requires.

Here the student is a Hugging Face model whose compressed weights are ``torch.nn.utils.parametrize``
parametrizations (:class:`ScaledSign`) of the frozen base weights; the α of each matrix (shape
``[]``) or row (``[d_out]``, always for ``embed_tokens`` / ``lm_head``) is the only trainable
tensor, with the column scales β (``[d_in]``) of a rowcol artifact (format version 2), which start at
1 and only distillation moves. The result is a new artifact folder with the same signs, full
tensors and sharding as the source and only the scales replaced, written atomically;
``provenance.distillation`` records how.
"""
from __future__ import annotations

import sys
from pathlib import Path

import json
import logging
import math
import shutil
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Literal

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from deltafleet.atomic import check_replaceable, fsync_path, staged_dir
from deltafleet.compress.bitdelta import (
    ALPHA_SUFFIX,
    BETA_SUFFIX,
    DELTA_INDEX_NAME,
    DELTA_NAME,
    GRANULARITIES,
    Artifact,
    ArtifactError,
    _deltafleet_version,
    _sha256_file,
    fingerprint,
    load_artifact,
    manifest_json,
    not_artifact,
    write_manifest,
)
from deltafleet.kernels import unpack_signs

log = logging.getLogger("deltafleet.compress.distill")

LOSSES = ("mse", "kl")
METHOD = "scale distillation (BitDelta arXiv:2402.10193 §3.2)"
FP16_MAX = float(torch.finfo(torch.float16).max)  # rowcol scales are stored in float16
EVAL_BLOCKS = 8  # loss_before / loss_after are measured on the first min(n_blocks, 8) blocks


# --------------------------------------------------------------------------------------------
# Calibration text
# --------------------------------------------------------------------------------------------


def relative_change(before: float, after: float) -> str:
    """``after`` against ``before`` in words: ``"12.3% lower"``, ``"4.0% higher"``, ``"unchanged"``,
    or ``"from 0"`` where no ratio exists."""
    if after == before:
        return "unchanged"
    if not before:
        return "from 0"
    pct = 100 * (after - before) / abs(before)
    return f"{abs(pct):.1f}% {'higher' if pct > 0 else 'lower'}"


def calibration_blocks(jsonl_path: str | Path, tokenizer, seq_len: int, max_blocks: int | None = None
                       ) -> torch.Tensor:
    """Pack the documents of a JSONL split into token blocks, the way training packs them.

    Each record's ``text`` is tokenized without special tokens and followed by the tokenizer's
    eos; the documents are concatenated in file order and cut into blocks of ``seq_len`` tokens,
    dropping the trailing partial block (the same blocks as ``deltafleet.train.datamodule.load_blocks``, first
    ones first). Reading stops as soon as ``max_blocks`` blocks are full.

    Args:
        jsonl_path: ``<data_dir>/<domain>/<split>.jsonl``, one ``{"text": str, ...}`` per line.
        tokenizer: a Hugging Face tokenizer with an ``eos_token_id``.
        seq_len: tokens per block (≥ 1).
        max_blocks: keep at most this many blocks (≥ 1); None: every full block.

    Returns:
        int64 ``[n_blocks, seq_len]`` token ids, ``1 ≤ n_blocks ≤ max_blocks``.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: on ``seq_len < 1``, ``max_blocks < 1``, a tokenizer without eos, a line that
            is not a JSON object with a string ``text``, or fewer than ``seq_len`` tokens in all.
    """
    path = Path(jsonl_path)
    if seq_len < 1:
        raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be ≥ 1 or None, got {max_blocks}")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `make data` first")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id to separate documents with")
    want = None if max_blocks is None else max_blocks * seq_len
    flat: list[int] = []

    def add(texts: list[str]) -> None:
        for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            flat.extend(ids)
            flat.append(eos)

    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object with a 'text' field ({e})") from e
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: 'text' must be a string")
            texts.append(text)
            if len(texts) == 64:
                add(texts)
                texts = []
                if want is not None and len(flat) >= want:
                    break
    if texts:
        add(texts)
    n = len(flat) // seq_len
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n == 0:
        raise ValueError(f"{path} holds {len(flat)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


# --------------------------------------------------------------------------------------------
# Student: base + α·sign(Δ) with α the only trainable tensors
# --------------------------------------------------------------------------------------------


class ScaledSign(torch.nn.Module):
    """Parametrization ``W ↦ W + α·sign(Δ)`` of one compressed weight (BitDelta Eq. 2, §3.2), or
    ``W ↦ W + diag(α)·sign(Δ)·diag(β)`` with column scales (granularity rowcol).

    Args:
        sign: uint8 ``[d_out, ceil(d_in/8)]`` packed signs of the artifact (the format's bit order).
        alpha: ``[]`` or ``[d_out]``: the initial scale(s); becomes the trainable float32
            parameter ``alpha`` (a copy).
        d_in: columns of the weight.
        beta: optional ``[d_in]`` initial column scales; becomes the trainable float32 parameter
            ``beta`` (a copy). None: ``beta`` is None.

    The signs are unpacked once to an int8 ``[d_out, d_in]`` buffer of ±1 (one byte a weight);
    ``forward(W_base)`` returns the weight in ``W_base``'s dtype, so the gradient of any loss
    reaches the scales and nothing else (the base weight it is applied to is frozen).
    """

    def __init__(self, sign: torch.Tensor, alpha: torch.Tensor, d_in: int, beta: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("sign", unpack_signs(sign, d_in, torch.int8), persistent=False)
        self.alpha = torch.nn.Parameter(alpha.detach().to(torch.float32).clone())
        self.beta = None if beta is None else torch.nn.Parameter(beta.detach().to(torch.float32).clone())

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        a = self.alpha.unsqueeze(1) if self.alpha.dim() == 1 else self.alpha
        s = self.sign.to(weight.dtype)
        if self.beta is not None:
            s = s * self.beta.to(weight.dtype)
        return weight + a.to(weight.dtype) * s


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(parameter) → every (module, attribute) that holds it (tied weights have several)."""
    out: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((module, attr))
    return out


def build_student(base_dir: str | Path, finetuned_dir: str | Path, artifact: Artifact,
                  device: str | torch.device = "cpu"
                  ) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    """The base model with ``W_base + α·sign(Δ)`` for every compressed weight (rowcol:
    ``W_base + diag(α)·sign(Δ)·diag(β)``), the scales trainable only.

    The model is the base checkpoint loaded in float32 with the fine-tuned checkpoint's
    ``config.json`` (so that a resized vocabulary, stored in full in the artifact, fits); the
    artifact's full tensors then replace the base's. Each compressed weight ``P`` gets a
    :class:`ScaledSign` parametrization (shared by every module a tied weight belongs to). Every
    other parameter has ``requires_grad=False``.

    Args:
        base_dir: the base Hugging Face safetensors checkpoint the artifact was exported against.
        finetuned_dir: the fine-tuned checkpoint (only its config is read here).
        artifact: from :func:`deltafleet.compress.bitdelta.load_artifact`.
        device: where the model is placed; float32 throughout.

    Returns:
        ``(model, alphas, betas)``: the model in eval mode, ``{P: α parameter}`` (float32 ``[]`` or
        ``[d_out]``, initialised from the artifact's α) and ``{P: β parameter}`` (float32
        ``[d_in]``, from the artifact's β; empty unless granularity rowcol).

    Raises:
        ArtifactError: if a full or compressed tensor of the artifact is not a parameter of the
            model or does not fit it, or a parameter of the model is in neither the base nor the
            artifact.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # a re-initialised tensor must not move the caller's RNG
        model, info = AutoModelForCausalLM.from_pretrained(
            base_dir, config=AutoConfig.from_pretrained(finetuned_dir), dtype=torch.float32,
            output_loading_info=True, ignore_mismatched_sizes=True,
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(p for p in [*artifact.full, *artifact.signs] if p not in params)
    if unknown:
        raise ArtifactError(f"{artifact.path}: {', '.join(unknown[:5])} not parameter(s) of the model "
                            f"built from {finetuned_dir}/config.json")
    not_loaded = {k for k in info["missing_keys"]} | {k for k, *_ in info["mismatched_keys"]}
    not_loaded -= set(artifact.full)
    if not_loaded:
        raise ArtifactError(f"parameter(s) {', '.join(sorted(not_loaded)[:5])} of the model are in neither the "
                            f"base {base_dir} (same shape) nor stored in full in the artifact {artifact.path}")
    with torch.no_grad():
        for name, t in artifact.full.items():
            if params[name].shape != t.shape:
                raise ArtifactError(f"{artifact.path}: full tensor {name} {list(t.shape)} does not fit the "
                                    f"model's {list(params[name].shape)}")
            params[name].copy_(t.to(torch.float32))
    model.requires_grad_(False)
    model.eval().to(device)

    owners = _owners(model)
    alphas: dict[str, torch.nn.Parameter] = {}
    betas: dict[str, torch.nn.Parameter] = {}
    for name, sign in artifact.signs.items():
        weight = model.get_parameter(name)
        if weight.dim() != 2 or tuple(sign.shape) != (weight.shape[0], (weight.shape[1] + 7) // 8):
            raise ArtifactError(f"{artifact.path}: {name}.sign {list(sign.shape)} does not fit "
                                f"weight {list(weight.shape)}")
        beta = artifact.betas.get(name)
        if beta is not None and beta.shape != (weight.shape[1],):
            raise ArtifactError(f"{artifact.path}: {name}.beta {list(beta.shape)} does not fit weight "
                                f"{list(weight.shape)}")
        p = ScaledSign(sign.to(device), artifact.alphas[name].to(device), weight.shape[1],
                       None if beta is None else beta.to(device))
        for module, attr in owners[id(weight)]:
            parametrize.register_parametrization(module, attr, p)
        alphas[name] = p.alpha
        if p.beta is not None:
            betas[name] = p.beta
    return model, alphas, betas


# --------------------------------------------------------------------------------------------
# Distillation
# --------------------------------------------------------------------------------------------


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 loss: Literal["mse", "kl"] = "mse") -> torch.Tensor:
    """Distillation loss between logits ``[..., vocab]`` (any float dtype; computed in float32).

    ``"mse"``: mean over every element of ``(student − teacher)²`` (BitDelta §3.2's objective).
    ``"kl"``: ``KL(p_teacher ‖ p_student)`` of the softmax distributions, in nats, summed over the
    vocabulary and averaged over tokens.

    Raises:
        ValueError: on an unknown ``loss`` or logits of different shapes.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    s, t = student_logits.float(), teacher_logits.float()
    if loss == "mse":
        return F.mse_loss(s, t)
    tokens = s.numel() // s.shape[-1]
    return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum") / tokens


@torch.no_grad()
def evaluate(student: torch.nn.Module, teacher: torch.nn.Module, blocks: torch.Tensor, *,
             loss: Literal["mse", "kl"] = "mse", batch_size: int = 4,
             device: str | torch.device = "cpu") -> float:
    """:func:`distill_loss` of ``student`` against ``teacher`` over int64 ``blocks`` ``[n, seq_len]``.

    Runs ``batch_size`` blocks at a time; the result is the token-weighted mean, i.e. the loss of
    the whole set as one batch (up to float32 rounding).
    """
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        ids = blocks[i : i + batch_size].to(device)
        s = student(input_ids=ids, use_cache=False).logits
        t = teacher(input_ids=ids, use_cache=False).logits
        total += float(distill_loss(s, t, loss)) * ids.numel()
        count += ids.numel()
    return total / count


def _batches(n: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of block indices: a seeded permutation of ``range(n)``, reshuffled each pass,
    read ``batch_size`` at a time across pass boundaries."""
    g = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while pending.numel() < batch_size:
            pending = torch.cat([pending, torch.randperm(n, generator=g)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def _validate(calibration: Any, loss: str, steps: int, lr: float, batch_size: int, beta_lr: float = 1.0) -> None:
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer ≥ 1, got {steps!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer ≥ 1, got {batch_size!r}")
    for key, value in (("lr", lr), ("beta_lr", beta_lr)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
    if not isinstance(calibration, torch.Tensor) or calibration.dtype != torch.int64 or calibration.dim() != 2:
        what = (f"{calibration.dtype} {list(calibration.shape)}" if isinstance(calibration, torch.Tensor)
                else type(calibration).__name__)
        raise ValueError(f"calibration must be an int64 tensor [n_blocks, seq_len] of token ids, got {what}")
    if calibration.numel() == 0:
        raise ValueError(f"calibration is empty: {list(calibration.shape)}; need ≥ 1 block of ≥ 1 token")


def distill_scales(
    base_dir: str | Path,
    finetuned_dir: str | Path,
    artifact_dir: str | Path,
    out_dir: str | Path,
    calibration: torch.Tensor,
    *,
    steps: int = 200,
    lr: float = 1e-4,
    batch_size: int = 4,
    loss: Literal["mse", "kl"] = "mse",
    seed: int = 0,
    beta_lr: float = 1e-2,
    device: str | torch.device = "cpu",
    log_every: int = 20,
    show_progress: bool = False,
    callback: Callable[[int, float], None] | None = None,
    provenance: dict | None = None,
) -> dict:
    """Distil the scales α of a BitDelta artifact against the fine-tuned model (arXiv:2402.10193 §3.2).

    The student is the base with every compressed weight ``W_base + α·sign(Δ)`` (signs from the
    artifact, fixed) and the artifact's full tensors; the teacher is the fine-tuned model; both
    float32 on ``device``, in eval mode. Only the α (float32 ``[]`` per matrix or ``[d_out]`` per
    row, as in the artifact) are trained, and for granularity rowcol the column scales β too (float32
    ``[d_in]`` near 1, at their own learning rate ``beta_lr``): Adam(``lr``) for ``steps`` steps on
    batches of ``batch_size`` calibration blocks (a seeded random order, reshuffled each pass),
    minimising :func:`distill_loss`. After each step the scales are clamped to ≥ 0 (the format
    rejects negative ones). Scales are written back in the artifact's dtype (float32; float16 for
    rowcol).

    ``loss_before`` / ``loss_after`` are the loss on a fixed evaluation slice, the first
    ``min(n_blocks, 8)`` calibration blocks, before the first and after the last step (no grad);
    both are logged to the ``deltafleet.compress.distill`` logger. ``callback(step, loss)`` gets the training
    batch's loss (before that step's update) at every ``log_every``-th step (1-based) and the last.

    The new artifact in ``out_dir`` has the source's layout and sharding (``delta.safetensors``, or
    the same shard names and ``delta.safetensors.index.json`` weight map), its sign and full
    tensors byte for byte, and each ``P.alpha`` replaced by the distilled float32 α of the same
    shape. Its manifest is the source's with new ``files`` sha256, recomputed ``stats.bytes`` /
    ``stats.bits_per_parameter``, and ``provenance`` the source's with a fresh ``run_id``,
    ``created``, ``deltafleet_version`` and ``distillation = {method, source_artifact, loss, steps,
    lr, batch_size, seq_len, calibration_blocks, seed, loss_before, loss_after}`` (then
    ``provenance`` merged over that). It is built in a temporary folder next to ``out_dir`` and
    renamed into place: on any error nothing is left and an existing ``out_dir`` is untouched.
    ``out_dir`` must not be ``artifact_dir`` (nor lie inside it or hold it): the source stays as it
    was, to compare against or distil again (refused before any work, ValueError).

    Args:
        base_dir: Hugging Face safetensors checkpoint of the base.
        finetuned_dir: the fine-tuned checkpoint the artifact was exported from (the teacher).
        artifact_dir: the source artifact; loaded with the base fingerprint enforced and its
            file hashes checked.
        out_dir: the distilled artifact folder to create or replace.
        calibration: int64 ``[n_blocks, seq_len]`` token ids (see :func:`calibration_blocks`).
        steps: optimiser steps (≥ 1). The paper: 200.
        lr: Adam learning rate (> 0). The paper: 1e-4.
        batch_size: blocks per step (≥ 1).
        loss: ``"mse"`` on logits (the paper's) or ``"kl"`` (teacher ‖ student), see
            :func:`distill_loss`.
        seed: seeds the batch order (the only randomness).
        beta_lr: Adam learning rate of the column scales β (granularity rowcol; > 0).
        device: ``"cpu"``, ``"cuda"``, ...
        log_every: log and call ``callback`` every this many steps; < 1: only at the last step.
        show_progress: a tqdm bar over the steps.
        callback: ``callback(step, loss)``, e.g. a W&B logger.
        provenance: extra keys merged over the manifest's provenance (e.g. ``run_id``, ``config``).

    Returns:
        The manifest written to ``out_dir/bitdelta.json``.

    Raises:
        ValueError: unknown ``loss``, ``steps < 1``, ``batch_size < 1``, an ``lr`` or ``beta_lr`` that is
            not a finite number > 0, a
            ``calibration`` that is not a non-empty 2-D int64 tensor or has token ids outside
            the teacher's vocabulary, or an ``out_dir`` that overlaps an input or holds another
            variant's artifact.
        FingerprintMismatchError: the artifact was exported against another base.
        ArtifactError: a damaged artifact, or one that does not fit the models.
        FileNotFoundError: a folder without a safetensors checkpoint.
    """
    _validate(calibration, loss, steps, lr, batch_size, beta_lr)
    from transformers import AutoModelForCausalLM

    base_dir, finetuned_dir = Path(base_dir), Path(finetuned_dir)
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir).absolute()
    t0 = time.perf_counter()
    artifact = load_artifact(artifact_dir, base_fingerprint=fingerprint(base_dir))
    # the source is read to the end: never the output; nor another variant's artifact
    check_replaceable(out_dir, [artifact_dir, base_dir, finetuned_dir],
                      lambda f: not_artifact(f, artifact.manifest.get("variant"), "distillation"), job="distillation")
    if not artifact.signs:
        log.warning("%s has no compressed matrices: nothing to distil, α is copied as is", artifact_dir)
    source_prov = artifact.manifest.get("provenance")  # informational: the reader does not check it
    source_ft = (source_prov.get("finetuned") if isinstance(source_prov, dict) else None) or {}
    exported_from = source_ft.get("fingerprint") if isinstance(source_ft, dict) else None
    if exported_from is not None and exported_from != (teacher_fp := fingerprint(finetuned_dir)):
        log.warning("%s was exported from a fine-tune with fingerprint %s, but the teacher %s has %s",
                    artifact_dir, exported_from, finetuned_dir, teacher_fp)

    teacher = AutoModelForCausalLM.from_pretrained(finetuned_dir, dtype=torch.float32).to(device).eval()
    teacher.requires_grad_(False)
    student, alphas, betas = build_student(base_dir, finetuned_dir, artifact, device)
    vocab = teacher.get_output_embeddings().weight.shape[0]
    if int(calibration.min()) < 0 or int(calibration.max()) >= vocab:
        raise ValueError(f"calibration token ids must lie in [0, {vocab}), got "
                         f"[{int(calibration.min())}, {int(calibration.max())}]")

    n_blocks, seq_len = calibration.shape
    eval_blocks = calibration[: min(n_blocks, EVAL_BLOCKS)]
    n_alpha = sum(a.numel() for a in [*alphas.values(), *betas.values()])
    log.info("distilling %d scales (%d matrices) of %s: %d blocks × %d tokens, %d steps, batch %d, lr %g, loss %s",
             n_alpha, len(alphas), artifact_dir, n_blocks, seq_len, steps, batch_size, lr, loss)
    loss_before = evaluate(student, teacher, eval_blocks, loss=loss, batch_size=batch_size, device=device)
    log.info("step 0: %s on the evaluation slice (%d blocks) %.6g", loss, eval_blocks.shape[0], loss_before)

    params = [*alphas.values(), *betas.values()]
    groups = [{"params": list(alphas.values()), "lr": lr}, {"params": list(betas.values()), "lr": beta_lr}]
    opt = torch.optim.Adam([g for g in groups if g["params"]]) if params else None
    batches = _batches(n_blocks, batch_size, seed)
    progress = tqdm(range(1, steps + 1), desc=f"distil {artifact.variant}", unit="step",
                    disable=not show_progress)
    for step in progress:
        ids = calibration[next(batches)].to(device)
        with torch.no_grad():
            target = teacher(input_ids=ids, use_cache=False).logits
        value = distill_loss(student(input_ids=ids, use_cache=False).logits, target, loss)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            with torch.no_grad():
                for a in params:  # the format: scales ≥ 0, and float16 ones finite
                    a.clamp_(0.0, FP16_MAX if artifact.granularity == "rowcol" else None)
        if step == steps or (log_every >= 1 and step % log_every == 0):
            v = float(value.detach())
            progress.set_postfix(loss=f"{v:.4g}")
            log.info("step %d/%d: batch %s %.6g", step, steps, loss, v)
            if callback is not None:
                callback(step, v)
    progress.close()
    loss_after = evaluate(student, teacher, eval_blocks, loss=loss, batch_size=batch_size, device=device)
    log.info("after %d steps: %s on the evaluation slice %.6g (before %.6g, %s) in %.1f s",
             steps, loss, loss_after, loss_before, relative_change(loss_before, loss_after), time.perf_counter() - t0)

    stored = {**{name + ALPHA_SUFFIX: (a, artifact.alphas[name].dtype) for name, a in alphas.items()},
              **{name + BETA_SUFFIX: (b, artifact.betas[name].dtype) for name, b in betas.items()}}
    new_scales = {key: t.detach().to("cpu", dtype).contiguous() for key, (t, dtype) in stored.items()}
    bad = next((k for k, t in new_scales.items() if not bool(torch.isfinite(t).all())), None)
    if bad is not None or not math.isfinite(loss_after):  # an lr too large: the optimisation diverged
        raise ValueError(f"the distillation diverged ({loss} {loss_before:.6g} → {loss_after:.6g}"
                         + (f", {bad} not finite" if bad is not None else "") + f") at lr={lr}: nothing was "
                         f"written; {out_dir} is as it was. Try a smaller lr")
    if loss_after > loss_before:
        log.warning("the distilled scales fit the fine-tune worse than the source's (%s %.6g → %.6g): a smaller "
                    "lr may help", loss, loss_before, loss_after)
    distillation = {
        "method": METHOD,
        "source_artifact": str(artifact_dir),
        "loss": loss,
        "steps": steps,
        "lr": float(lr),
        "batch_size": batch_size,
        "seq_len": int(seq_len),
        "calibration_blocks": int(n_blocks),
        "seed": seed,
        **({"beta_lr": float(beta_lr)} if betas else {}),
        "loss_before": loss_before,
        "loss_after": loss_after,
    }
    return _write_distilled(artifact, new_scales, out_dir, distillation, provenance)


def _write_distilled(artifact: Artifact, scales: dict[str, torch.Tensor], out_dir: Path,
                     distillation: dict, provenance: dict | None) -> dict:
    """Copy ``artifact`` to ``out_dir`` (atomically) with every stored scale tensor (``P.alpha``,
    ``P.beta``) replaced by ``scales[that name]``."""
    src, manifest = artifact.path, artifact.manifest
    files = manifest["files"]
    index = None
    if DELTA_INDEX_NAME in files:
        index = json.loads((src / DELTA_INDEX_NAME).read_text())
        tensor_files = sorted(set(index["weight_map"].values()))
    else:
        tensor_files = [DELTA_NAME]
    with staged_dir(out_dir) as tmp:
        replaced: set[str] = set()
        for file in tensor_files:  # one file in memory at a time
            with safe_open(src / file, framework="pt") as f:
                metadata = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            for key in tensors:
                if key in scales:
                    if scales[key].shape != tensors[key].shape or scales[key].dtype != tensors[key].dtype:
                        raise ArtifactError(f"distilled {key} is {scales[key].dtype} {list(scales[key].shape)}, "
                                            f"the source's {tensors[key].dtype} {list(tensors[key].shape)}")
                    tensors[key] = scales[key]
                    replaced.add(key)
            save_file(tensors, tmp / file, metadata=metadata)
            fsync_path(tmp / file)
            del tensors
        if replaced != set(scales):
            raise ArtifactError(f"{src}: scales {sorted(set(scales) - replaced)[:5]} not found in its files")
        if index is not None:
            index.setdefault("metadata", {})["total_size"] = sum((tmp / f).stat().st_size for f in tensor_files)
            (tmp / DELTA_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for name in files:  # anything else the manifest lists is carried over byte for byte
            if not (tmp / name).exists():
                shutil.copyfile(src / name, tmp / name)
        new_files = {name: _sha256_file(tmp / name) for name in files}
        nbytes = sum((tmp / name).stat().st_size for name in new_files)

        out = json.loads(json.dumps(manifest))  # a deep copy
        out["files"] = new_files
        # stats and provenance are informational (the reader does not check them): another value is none
        stats = out["stats"] = out["stats"] if isinstance(out.get("stats"), dict) else {}
        parameters = stats.get("parameters") or 0
        stats["bytes"] = nbytes
        stats["bits_per_parameter"] = 8 * nbytes / parameters if parameters else 0.0
        prov = dict(out["provenance"]) if isinstance(out.get("provenance"), dict) else {}
        prov.update({
            "run_id": uuid.uuid4().hex,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "deltafleet_version": _deltafleet_version(),
            "distillation": distillation,
        })
        prov.update(provenance or {})
        out["provenance"] = prov
        write_manifest(tmp, out)
    return out


# --------------------------------------------------------------------------------------------
# CLI (conf/distill.yaml)
# --------------------------------------------------------------------------------------------


def _finish_wandb() -> None:
    if "wandb" in sys.modules:
        import wandb

        wandb.finish()


def _source_artifact(cfg, run_dir: Path) -> Path:
    """``cfg.artifact_dir``, or a fresh export of the requested granularity when it has another one."""
    from deltafleet.compress.bitdelta import compress

    artifact_dir = Path(cfg.artifact_dir)
    manifest = manifest_json(artifact_dir)  # ArtifactError: no regular file, no JSON
    if manifest is None:
        raise SystemExit(f"{artifact_dir} holds no BitDelta artifact: export it first "
                         f"(python compress/run.py variant={cfg.variant.name})")
    have = manifest.get("granularity") if isinstance(manifest, dict) else None  # (load_artifact says what is wrong)
    if cfg.granularity is None or cfg.granularity == have:
        return artifact_dir
    out = run_dir / f"source-{cfg.granularity}"
    print(f"{artifact_dir} has granularity {have!r}: exporting a {cfg.granularity!r} one to {out}")
    compress(cfg.base_dir, cfg.finetuned_dir, out, variant=cfg.variant.name, granularity=cfg.granularity,
             provenance={"run_id": f"export/{cfg.variant.name}/{run_dir.name}"})
    return out


@hydra.main(config_path="../conf", config_name="distill", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from deltafleet.cli import stop_on_sigterm, user_errors

    stop_on_sigterm()  # a stopped distillation removes its staged folder, as Ctrl-C does
    with user_errors("distill"):
        from deltafleet.threads import set_threads

        set_threads(cfg)
        return _main(cfg)


def _main(cfg: DictConfig) -> dict:
    from deltafleet.checkpoint import load_tokenizer
    from deltafleet.cli import require_checkpoints

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    variant = cfg.variant.name
    if cfg.variant.init != "base":
        raise SystemExit(f"variant={variant} is the base itself, not a fine-tune of it: nothing to distil "
                         f"(pick a variant, e.g. variant=math)")
    # the arguments first, before minutes of tokenising and re-exporting
    _validate(torch.zeros(1, 1, dtype=torch.long), cfg.loss, cfg.steps, cfg.lr, cfg.batch_size)
    if cfg.granularity is not None and cfg.granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be null (the artifact's own) or one of {GRANULARITIES}, "
                         f"got {cfg.granularity!r}")
    require_checkpoints(cfg, variant)
    context = json.loads((Path(cfg.base_dir) / "config.json").read_text()).get("max_position_embeddings")
    if isinstance(cfg.seq_len, bool) or not isinstance(cfg.seq_len, int) or cfg.seq_len < 1 \
            or (isinstance(context, int) and cfg.seq_len > context):
        raise ValueError(f"seq_len must be a positive integer up to the model's context ({context} tokens, "
                         f"max_position_embeddings), got {cfg.seq_len!r}")
    tokenizer = load_tokenizer(cfg.base_dir)
    jsonl = Path(cfg.paths.data_dir) / cfg.variant.domain / f"{cfg.split}.jsonl"
    calibration = calibration_blocks(jsonl, tokenizer, cfg.seq_len, cfg.max_calibration_blocks)
    source = _source_artifact(cfg, run_dir)
    logger = hydra.utils.instantiate(cfg.logger) if cfg.get("logger") else None
    callback = None
    if logger is not None:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

        def callback(step: int, value: float) -> None:
            logger.log_metrics({f"distill/{cfg.loss}": value}, step=step)

    try:
        t0 = time.perf_counter()
        manifest = distill_scales(
            cfg.base_dir, cfg.finetuned_dir, source, cfg.out_dir, calibration,
            steps=cfg.steps, lr=cfg.lr, batch_size=cfg.batch_size, loss=cfg.loss, seed=cfg.seed,
            beta_lr=cfg.beta_lr,
            device=cfg.device, log_every=cfg.log_every, show_progress=True, callback=callback,
            provenance={"run_id": f"distill/{variant}/{run_dir.name}",
                        "config": OmegaConf.to_container(cfg, resolve=True)},
        )
        seconds = time.perf_counter() - t0
        d = manifest["provenance"]["distillation"]
        if logger is not None:
            logger.log_metrics({"distill/loss_before": d["loss_before"], "distill/loss_after": d["loss_after"],
                                "distill/seconds": seconds}, step=cfg.steps)
            logger.save()
    finally:
        if logger is not None:
            _finish_wandb()
    before, after = d["loss_before"], d["loss_after"]
    print(f"{variant}: {cfg.loss} to the fine-tune {before:.6g} → {after:.6g} "
          f"({relative_change(before, after)}) after {cfg.steps} steps on "
          f"{d['calibration_blocks']} × {d['seq_len']} tokens, granularity {manifest['granularity']}, "
          f"{seconds:.1f} s → {cfg.out_dir}")
    return manifest


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
