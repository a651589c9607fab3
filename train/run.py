"""Train the base or fine-tune a variant, then export the variant as a BitDelta artifact.

    python train/run.py variant=base                 # tokenizer + tiny Llama base from scratch
    python train/run.py variant=coder                # fine-tune models/base on data/coder
    python train/run.py variant=math logger=csv      # same numbers without Weights & Biases
    python train/run.py -m variant=coder,math,writer,legal        # Hydra multirun, one by one
    python train/run.py variant=coder ckpt_path=outputs/train/coder/<run>/checkpoints/last.ckpt
    python train/run.py variant=coder ckpt_path=last     # the newest of the variant's runs
    python train/run.py variant=coder trainer=deepspeed_zero3     # every visible GPU
    python train/run.py variant=coder variant.adapter=lora        # LoRA instead of full weights

Composes ``conf/train.yaml``, builds the model (from the ``model`` shape preset, or from
``models/base`` for a variant), fits it with a Lightning ``Trainer`` (checkpointing every
``checkpoint.every_n_steps`` steps; the ``merge`` callback averaging checkpoints), consolidates
the weights one parameter at a time (ZeRO shards included), writes a Hugging Face checkpoint to
``models/<variant>/`` atomically, and reports held-out loss on the variant's domain for the base
and for the result. For a variant it then writes ``artifacts/<variant>/`` (BitDelta format v1),
reports the held-out loss of the BitDelta-reconstructed model too, and logs a quality table and
the artifact (its manifest as metadata) to W&B.
"""
from __future__ import annotations

import inspect
import json
import math
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from deltafleet.atomic import check_replaceable, remove_dir, staged_dir, unlisted_files, write_text
from deltafleet.checkpoint import read_json
from deltafleet.cli import (finish_wandb, fit, flag, interruptible, no_base, output_write, refuse_unknown_settings,
                            stop_on_sigterm, user_errors)
from deltafleet.values import real, whole
# Lightning, datasets and the training modules are imported where a run starts, after check_config:
# a bad setting is refused in seconds, not after the ten it takes to import them.
from deltafleet.train.data import SPLITS, split_file


def build_model(cfg: DictConfig, tokenizer):
    """A new ``LlamaForCausalLM`` of the ``model`` preset's shape, or one loaded from ``base_dir``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if cfg.variant.init == "scratch":
        if cfg.model.name_or_path:
            return AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32).train()
        shape = {k: v for k, v in OmegaConf.to_container(cfg.model).items()
                 if k not in ("name", "name_or_path", "dirs", "finetune_lr", "distill_lr")}
        shape["vocab_size"] = len(tokenizer)
        config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        return LlamaForCausalLM(config)
    if cfg.variant.init == "base":
        # from_pretrained returns the model in eval mode; Lightning keeps each module's mode
        return AutoModelForCausalLM.from_pretrained(cfg.base_dir, dtype=torch.float32).train()
    raise ValueError(f"variant.init must be 'scratch' or 'base', got {cfg.variant.init!r}")


def learning_rate(cfg: DictConfig) -> float:
    """The variant's ``lr``, or for a fine-tune (``init: base``) the family's ``model.finetune_lr``
    where it sets one (a pretrained base needs a far smaller step than the tiny family)."""
    family = cfg.model.get("finetune_lr")
    return float(family) if cfg.variant.init == "base" and family is not None else float(cfg.variant.lr)


def load_tokenizer(cfg: DictConfig, run_dir: Path):
    """The family tokenizer: trained on the base's corpus for ``init=scratch``, else read from ``base_dir``."""
    from deltafleet.checkpoint import load_tokenizer as read_tokenizer

    if cfg.variant.init == "scratch" and not cfg.model.name_or_path:
        from deltafleet.train.tokenizer import train_tokenizer

        corpus = Path(cfg.paths.data_dir) / cfg.variant.domain / "train.jsonl"
        if not corpus.is_file():
            raise FileNotFoundError(f"{corpus} not found: run `make data` first")
        return train_tokenizer([corpus], cfg.model.vocab_size, run_dir / "tokenizer",
                               model_max_length=cfg.model.max_position_embeddings)
    src = cfg.model.name_or_path if cfg.variant.init == "scratch" else cfg.base_dir
    return read_tokenizer(src)


def save_checkpoint(model, tokenizer, out_dir: Path, extra: dict, adapter_dir: Path | None = None) -> None:
    """Write model + tokenizer (Hugging Face format) and ``training.json`` to ``out_dir`` atomically.

    A PEFT ``adapter_dir`` is moved in as ``out_dir/adapter`` before the folder is swapped in.
    """
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if adapter_dir is not None:
            shutil.move(str(adapter_dir), tmp / "adapter")
        files = sorted([p.name for p in tmp.iterdir()] + ["training.json"])
        (tmp / "training.json").write_text(json.dumps({**extra, "files": files}, indent=2) + "\n")


def _not_training_output(folder: Path) -> str | None:
    """Why ``folder`` is not (only) an earlier training run's checkpoint, or None if it is: it must hold
    ``training.json``, and no file but those it lists (``files``; records of older runs list none)."""
    try:
        record = json.loads((folder / "training.json").read_text())
    except (OSError, ValueError):
        return "no readable training.json of a training run"
    files = record.get("files") if isinstance(record, dict) else None
    return unlisted_files(folder, files, "training") if isinstance(files, list) else None


def check_resume(ckpt_path: str | None, variant: str, max_steps: int | None = None, lr: float | None = None,
                 domain: str | None = None, init: str | None = None, schedule: dict | None = None,
                 lora_r: int | None = None) -> None:
    """Refuse a ``ckpt_path`` that is missing, was written by another variant's run, or by a run on
    another ``domain``'s data or from other initial weights (``init``: a fine-tune of the base against
    a model trained from scratch), was trained at another learning rate than ``lr`` or other
    ``schedule`` settings (``variant.<key>``: a resume restores the checkpoint's optimizer and
    schedule, so the run would not use them), holds LoRA adapters of another rank than ``lora_r``
    (None: a full fine-tune, no adapters), was saved while a merge wrote the weights (part merged),
    or is already at or past ``max_steps`` (nothing would be trained). Another ``max_steps`` is a run made longer or shorter: the cosine decay stretches to the
    new end, as Lightning and transformers' Trainer rebuild a schedule. Checkpoints of older runs
    record no domain, init or schedule; those are not compared."""
    if not ckpt_path:
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path {ckpt_path} does not exist")
    if path.is_dir() and not ((path / "latest").is_file() or any(path.glob("*/*model_states.pt"))):
        found = sorted(path.glob("**/checkpoints/last.ckpt"), key=lambda f: f.stat().st_mtime)
        hint = f"e.g. ckpt_path={found[-1]}, its newest" if found else "a run's checkpoints/last.ckpt"
        raise ValueError(f"ckpt_path {ckpt_path} is a folder, not a checkpoint (nor a DeepSpeed checkpoint's "
                         f"folder): pass a checkpoint file, {hint}")
    if path.is_file():  # DeepSpeed checkpoints are folders; Lightning checks those itself
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as e:
            raise ValueError(f"ckpt_path {ckpt_path} is not a checkpoint torch can read "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
            raise ValueError(f"ckpt_path {ckpt_path} is not a Lightning checkpoint (no state_dict)")
        hp = ckpt.get("hyper_parameters", {})
        if hp.get("variant") not in (None, variant):
            raise ValueError(f"ckpt_path {ckpt_path} is a checkpoint of variant {hp['variant']!r}, "
                             f"not {variant!r}: resume a {variant} run, or train from models/base")
        for key, want, what in (("domain", domain, "data of domain"), ("init", init, "initial weights")):
            if want is not None and hp.get(key) not in (None, want):
                raise ValueError(f"ckpt_path {ckpt_path} was trained on {what} {hp[key]!r}, this run on {want!r} "
                                 f"(variant.{key}): a resume continues that run; resume it with its own variant")
        if lr is not None and hp.get("lr") not in (None, lr):
            raise ValueError(f"ckpt_path {ckpt_path} was trained at lr {hp['lr']:g}, this run asks for {lr:g}: a "
                             "resume keeps the checkpoint's optimizer and schedule; resume at its lr")
        for key, want in (schedule or {}).items():
            if hp.get(key) not in (None, want):
                raise ValueError(f"ckpt_path {ckpt_path} was trained with {key} {hp[key]!r}, this run asks for "
                                 f"{want!r} (variant.{key}): a resume keeps the checkpoint's optimizer and schedule; "
                                 f"resume with variant.{key}={hp[key]!r}")
        ranks = {int(t.shape[0]) for k, t in ckpt["state_dict"].items()
                 if ".lora_A." in k and isinstance(t, torch.Tensor) and t.dim() == 2}
        if ranks and lora_r is None:
            raise ValueError(f"ckpt_path {ckpt_path} is a LoRA run's (rank {max(ranks)}), this run a full fine-tune: "
                             f"resume it with variant.adapter=lora lora.r={max(ranks)}")
        if lora_r is not None and ckpt["state_dict"] and ranks != {lora_r}:
            got = f"LoRA adapters of rank {max(ranks)}" if ranks else "a full fine-tune, no LoRA adapters"
            fix = f"lora.r={max(ranks)}" if ranks else "variant.adapter=null"
            raise ValueError(f"ckpt_path {ckpt_path} holds {got}, this run asks for lora.r={lora_r}: resume it "
                             f"with {fix}")
        bad = next((k for k, t in ckpt["state_dict"].items() if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and not bool(torch.isfinite(t).all())), None)
        if bad is not None:  # a diverged run's: resuming would train NaNs to the end, then write nothing
            raise ValueError(f"ckpt_path {ckpt_path} holds NaN or inf weights ({bad}): its run diverged; train "
                             f"again at a lower learning rate")
        merging = next((state["merging"] for state in (ckpt.get("callbacks") or {}).values()
                        if isinstance(state, dict) and state.get("merging") is not None), None)
        if merging is not None:  # MonoSoupCallback.state_dict: saved while a merge wrote the weights
            raise ValueError(f"ckpt_path {ckpt_path} was saved while the merge at step {merging} was writing the "
                             f"weights (a checkpoint taken on an exception or a signal): some are merged, some not; "
                             f"resume from an earlier checkpoint")
        step = ckpt.get("global_step")
        if max_steps is not None and max_steps >= 0 and step is not None and step >= max_steps:
            raise ValueError(f"ckpt_path {ckpt_path} is at step {step}, at or past max_steps={max_steps}: "
                             "nothing would be trained; raise max_steps to train further")


def last_checkpoint(cfg: DictConfig) -> Path:
    """The newest ``checkpoints/last.ckpt`` of the variant's runs (``<output_dir>/train/<variant>/*/``):
    what ``ckpt_path=last`` resumes from. FileNotFoundError where no run of it has one."""
    runs = Path(cfg.paths.output_dir) / "train" / cfg.variant.name
    found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"ckpt_path=last: no run of variant {cfg.variant.name} under {runs} has a "
                                f"checkpoint (checkpoints/last.ckpt); train it first, or pass a checkpoint file")
    return found[-1]


def build_callbacks(cfg: DictConfig, run_dir: Path) -> list:
    """Periodic checkpoints (for ``ckpt_path`` resume; none with ``trainer.enable_checkpointing=false``)
    and the checkpoint-merging callback."""
    from deltafleet.train.callbacks import StepCheckpoint

    callbacks = []
    if cfg.trainer.get("enable_checkpointing", True) and not cfg.trainer.get("fast_dev_run"):  # (a smoke run: none)
        callbacks.append(StepCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step:06d}",
                                        every_n_train_steps=cfg.checkpoint.every_n_steps, save_top_k=1,
                                        save_last=True, auto_insert_metric_name=False))
    merge = cfg.get("merge")
    name = None if merge is None else merge.get("method", merge._target_.rsplit(".", 1)[-1])
    if name is None or name == "none":
        return callbacks
    if merge_callback_on(cfg):
        # the soups' W_base is the base's weights: a resume from a checkpoint without their state reads it there
        soup = str(merge.get("_target_", "")).endswith(".MonoSoupCallback")
        callbacks.append(hydra.utils.instantiate(merge, **({"base_dir": str(cfg.base_dir)} if soup else {})))
        every, steps = merge.get("every_n_steps"), cfg.trainer.get("max_steps")
        if isinstance(every, int) and isinstance(steps, int) and every > steps:
            print(f"[train] merge callback ({name}) merges every {every} steps: not once in this run of {steps} "
                  f"(merge.every_n_steps=N to merge)", flush=True)
    else:
        why = "the base trains from scratch" if cfg.variant.init == "scratch" else "LoRA trains adapters only"
        print(f"[train] merge callback ({name}) off: {why}", flush=True)
    return callbacks


def merge_callback_on(cfg: DictConfig) -> bool:
    """Whether the ``merge`` group's callback joins the run (:func:`build_callbacks`): for a full
    fine-tune of a base only (a base trained from scratch has no base for its task vectors; LoRA trains
    adapters only)."""
    return cfg.variant.init == "base" and cfg.variant.adapter is None


def trainer_settings(cfg: DictConfig) -> DictConfig:
    """``cfg.trainer`` as Lightning's Trainer takes it: without ``callbacks`` (:func:`user_callbacks`
    adds them to the job's own), and with an integer ``val_check_interval`` counted in optimizer
    steps, as the job's settings are, where Lightning counts training batches: times
    ``accumulate_grad_batches``."""
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer.pop("callbacks", None)
    interval, accumulate = trainer.get("val_check_interval"), trainer.get("accumulate_grad_batches") or 1
    if whole(interval) and accumulate > 1:
        trainer["val_check_interval"] = interval * accumulate
    return OmegaConf.create(trainer)


def user_callbacks(cfg: DictConfig) -> list:
    """The callbacks given as ``+trainer.callbacks=[{_target_: ...}, ...]``, instantiated, to run beside
    the job's own (checkpoints, the merge callback)."""
    return [hydra.utils.instantiate(c) for c in cfg.trainer.get("callbacks") or []]


def _check_numbers(cfg: DictConfig) -> None:
    """The optimizer's, the schedule's and LoRA's settings (:func:`check_config`): each of its kind and
    range, named, where a wrong one trained with it or failed inside Lightning or PEFT."""
    checks = [("variant.lr", lambda v: real(v) and v > 0, "a number > 0"),
              ("variant.weight_decay", lambda v: real(v) and v >= 0, "a number ≥ 0"),
              ("variant.warmup_steps", lambda v: whole(v) and v >= 0, "a whole number of steps ≥ 0"),
              ("variant.min_lr_ratio", lambda v: real(v) and 0 <= v <= 1, "a number in [0, 1]"),
              # Lightning's seed_everything (numpy's seeds) takes 0..2**32 - 1 and raises a ValueError for others
              ("seed", lambda v: whole(v) and 0 <= v < 2**32, f"an integer in [0, {2**32 - 1}]")]
    if cfg.model.get("finetune_lr") is not None:
        checks.append(("model.finetune_lr", lambda v: real(v) and v > 0, "null or a number > 0"))
    if cfg.variant.get("adapter") == "lora":
        checks += [("lora.r", lambda v: whole(v) and v >= 1, "a whole number ≥ 1"),
                   ("lora.alpha", lambda v: real(v) and v > 0, "a number > 0"),
                   ("lora.dropout", lambda v: real(v) and 0 <= v < 1, "a number in [0, 1)"),
                   ("lora.target_modules", lambda v: OmegaConf.is_list(v) and len(v) > 0
                    and all(isinstance(m, str) and m for m in v), "a list of module names, e.g. [q_proj, v_proj]")]
    for key, ok, what in checks:
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            raise ValueError(f"{key} must be {what}, got {value!r}")


# What Lightning 2's Trainer(precision=...) takes (lightning.fabric.connector._PRECISION_INPUT): such a
# value passes without importing Lightning; any other is checked against the installed Lightning's list.
LIGHTNING_PRECISIONS = (64, 32, 16, "64", "32", "16", "bf16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
                        "32-true", "64-true", "transformer-engine", "transformer-engine-float16")


def _check_trainer(cfg: DictConfig) -> None:
    """The Lightning settings that Lightning would refuse only once the data and the model are loaded
    (``precision``, ``callbacks`` that are no list), or fail on in its loop (``val_check_interval=0``,
    ``accumulate_grad_batches=0``: a ZeroDivisionError)."""
    import typing

    precision = cfg.trainer.get("precision")
    if any(type(precision) is type(v) and precision == v for v in LIGHTNING_PRECISIONS):  # (32.0, True: no)
        precision = None  # a value every Lightning 2 takes: no need to import Lightning (seconds) to ask
    _PRECISION_INPUT = None
    if precision is not None:
        try:
            from lightning.fabric.connector import _PRECISION_INPUT  # what Trainer(precision=...) takes
        except ImportError:  # another Lightning: it checks for itself
            pass
    if precision is not None and _PRECISION_INPUT is not None:
        def values(t) -> list:
            return [v for a in typing.get_args(t) for v in (values(a) if typing.get_args(a) else [a])]

        known = values(_PRECISION_INPUT)
        if not isinstance(precision, (int, str)) or isinstance(precision, bool) or precision not in known:
            raise ValueError(f"trainer.precision must be one of Lightning's {', '.join(str(v) for v in known)}; "
                             f"got {precision!r}")
    accumulate = cfg.trainer.get("accumulate_grad_batches")
    if accumulate is not None and not (whole(accumulate) and accumulate >= 1):
        raise ValueError(f"trainer.accumulate_grad_batches must be a whole number of batches ≥ 1, got {accumulate!r}")
    callbacks = cfg.trainer.get("callbacks")
    if callbacks is not None and not OmegaConf.is_list(callbacks):
        raise ValueError("trainer.callbacks must be a list of callbacks to instantiate ({_target_: ...}), "
                         f"got {callbacks!r}")
    interval = cfg.trainer.get("val_check_interval")
    timed = isinstance(interval, str) or OmegaConf.is_dict(interval)  # Lightning's time: "DD:HH:MM:SS", {seconds: 5}
    steps_or_share = whole(interval) and interval >= 1 or real(interval) and 0 < interval <= 1
    if interval is not None and not timed and not steps_or_share:
        raise ValueError(f"trainer.val_check_interval must be a whole number of steps ≥ 1, a fraction of an epoch "
                         f"in (0, 1] or a time (Lightning's \"DD:HH:MM:SS\" or {{seconds: ...}}), got {interval!r}")


def _check_merge(cfg: DictConfig) -> None:
    """The merge callback's settings (:func:`check_config`), named ``merge.<key>``, where the callback
    (the merge every N steps, or ``merge=ema``'s decay and interval) would refuse them only once the
    data and the model are loaded, in Hydra's words."""
    from deltafleet.merge.soup import check_soup_settings

    merge = cfg.get("merge")
    target = str(merge.get("_target_", "")) if merge is not None else ""
    if target.endswith(".EMAWeightAveraging"):  # merge=ema: torch's EMA takes a decay in [0, 1]
        decay, every = merge.get("decay", 0.999), merge.get("update_every_n_steps", 1)
        if not real(decay) or not 0 <= decay <= 1:
            raise ValueError(f"merge.decay must be a number in [0, 1] (the EMA's weight on its average), got {decay!r}")
        if not whole(every) or every < 1:
            raise ValueError(f"merge.update_every_n_steps must be a whole number ≥ 1, got {every!r}")
        return
    if not target.endswith(".MonoSoupCallback"):
        return
    settings = {k: v for k, v in merge.items() if k != "_target_"}
    known = set(inspect.signature(check_soup_settings).parameters) - {"prefix"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"merge.{unknown[0]} is not a setting of the merge every N steps "
                         f"(its settings: {', '.join(sorted(known))})")
    check_soup_settings(**settings, prefix="merge.")


def _check_weight_averaging(cfg: DictConfig) -> None:
    """Refuse two merges every N steps, two weight averagings, or the merge every N steps (a merging
    ``MonoSoupCallback``) beside a callback of Lightning's weight averaging (``WeightAveraging``:
    ``EMAWeightAveraging``, ``merge=ema``), naming both, wherever
    each comes from (the ``merge`` group where it joins the run, ``+trainer.callbacks``). Both rewrite
    the weights, and do not compose: the averaging swaps its average in for every validation and copies
    it over the weights when training ends, so the merge callback's best checkpoint would be the
    weights at the validation where the average scored best, and the run would end with the average,
    not with the merges' weights. Without ``trainer.callbacks`` the run has one of them at most, and
    Lightning is not imported."""
    extra = cfg.trainer.get("callbacks") or []
    if not extra:
        return
    from hydra.utils import get_class

    from deltafleet.train.callbacks import MonoSoupCallback, averaging_conflict, weight_averaging_classes

    merge = cfg.get("merge")
    nodes = [("merge", merge)] if merge is not None and merge_callback_on(cfg) else []
    nodes += [(f"trainer.callbacks[{i}]", c) for i, c in enumerate(extra)]
    soups, averages = [], []
    for where, node in nodes:
        try:
            cls = get_class(str(node.get("_target_"))) if OmegaConf.is_dict(node) else None
        except Exception:  # not a class: instantiating it names it
            cls = None
        if not isinstance(cls, type):
            continue
        if issubclass(cls, MonoSoupCallback) and node.get("method", "monosoup") != "none":
            soups.append(f"{where} ({cls.__name__}, method {node.get('method', 'monosoup')})")
        elif issubclass(cls, weight_averaging_classes()):
            averages.append(f"{where} ({cls.__name__})")
    if soups and averages:
        raise ValueError(averaging_conflict(soups[0], averages[0]))
    for kind, found in (("merges every N steps", soups), ("weight averagings", averages)):
        if len(found) > 1:  # Lightning would refuse the pair once the model is loaded (one state per class)
            raise ValueError(f"two {kind}: {found[0]} and {found[1]}; a run takes one (to compare methods, "
                             f"run each: train/compare_merges.py)")


def _sweep_job() -> dict:
    """Where a Hydra multirun job belongs: ``{"sweep_dir": <absolute>, "sweep_id": <this invocation's>,
    "job_num": n}``; {} outside one."""
    if not HydraConfig.initialized():
        return {}
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return {}
    return {"sweep_dir": str(Path(hc.sweep.dir).absolute()), "sweep_id": _SWEEP_ID, "job_num": int(hc.job.num)}


_SWEEP_ID = uuid.uuid4().hex  # one invocation's jobs share it (Hydra's basic launcher runs them in this process):
# a later sweep into the same hydra.sweep.dir is another sweep


def _check_sweep(cfg: DictConfig) -> None:
    """Refuse a multirun job whose ``out_dir`` another job of the same sweep wrote: the jobs of
    ``-m variant=coder variant.lr=1e-3,5e-4`` share ``variant.name``, and each would replace the fine-tune
    (and artifact) of the one before."""
    job = _sweep_job()
    if not job:
        return
    record = read_json(Path(cfg.out_dir) / "training.json") or {}
    if record.get("sweep_id") == job["sweep_id"] and record.get("job_num") != job["job_num"]:
        raise ValueError(f"job {record.get('job_num')} of this sweep wrote {cfg.out_dir}, and this job "
                         f"({job['job_num']}) would replace it: give each job its own variant.name, e.g. "
                         f"'variant.name={cfg.variant.name}-${{hydra:job.num}}'")


def check_config(cfg: DictConfig) -> None:
    """The job's checks of its config, inputs and machine, before any work (so a mistake costs no
    training): the base and the domain's data exist, the settings are valid, a resume point is not
    past the end, and a GPU trainer has a GPU.

    Raises:
        FileNotFoundError: a missing base checkpoint or data split (the message names the command
            that builds it).
        ValueError: an invalid setting, or a machine without the GPUs the trainer needs.
    """
    def count(value) -> bool:  # a whole number ≥ 1 (YAML's true is an int to Python)
        return whole(value) and value >= 1

    from deltafleet.compress.bitdelta import GRANULARITIES, check_variant_name

    check_variant_name(cfg.variant.name)  # it names the checkpoint and artifact folders, and the model id
    if cfg.variant.init not in ("scratch", "base"):
        raise ValueError(f"variant.init must be 'scratch' or 'base', got {cfg.variant.init!r}")
    steps = cfg.trainer.get("max_steps")
    if not count(steps):  # Lightning's -1 would never stop
        raise ValueError(f"trainer.max_steps must be a whole number of steps, at least 1, got {steps!r} "
                         f"(variant.max_steps=N or trainer.max_steps=N)")
    for key in ("batch_size", "seq_len", "val_check_interval"):
        if not count(cfg.variant.get(key)):
            raise ValueError(f"variant.{key} must be a whole number, at least 1, got {cfg.variant.get(key)!r}")
    for key, value in (("eval_batches", cfg.eval_batches), ("checkpoint.every_n_steps", cfg.checkpoint.every_n_steps)):
        if not count(value):
            raise ValueError(f"{key} must be a whole number, at least 1, got {value!r}")
    limit = cfg.variant.get("limit_val_batches")
    if not (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit >= 0
            and (isinstance(limit, int) or limit <= 1)):
        raise ValueError(f"variant.limit_val_batches must be a whole number of batches ≥ 0 or a fraction in [0, 1], "
                         f"got {limit!r}")
    _check_numbers(cfg)
    _check_trainer(cfg)
    _check_merge(cfg)
    _check_weight_averaging(cfg)
    if cfg.variant.init == "base":
        if not (Path(cfg.base_dir) / "config.json").is_file():
            raise FileNotFoundError(no_base(cfg))
        if Path(cfg.out_dir).resolve() == Path(cfg.base_dir).resolve():
            raise ValueError(f"variant.name={cfg.variant.name} writes its fine-tune to {cfg.out_dir}, the base it "
                             f"starts from, which every artifact is checked against: choose another variant.name")
    overwrite, export = flag(cfg, "overwrite"), flag(cfg, "export.enabled")
    _check_sweep(cfg)
    check_replaceable(cfg.out_dir, [cfg.base_dir] if cfg.variant.init == "base" else [], _not_training_output,
                      job="training", overwrite=overwrite)
    if cfg.variant.init == "base" and export:
        from deltafleet.compress.bitdelta import not_artifact

        check_replaceable(cfg.export.out_dir, [cfg.base_dir, cfg.out_dir], lambda f: not_artifact(f, cfg.variant.name),
                          job="export", key="export.out_dir", overwrite=overwrite)
    for split in SPLITS:
        split_file(cfg.paths.data_dir, cfg.variant.domain, split)
    if cfg.variant.adapter not in (None, "lora"):
        raise ValueError(f"variant.adapter must be null or 'lora', got {cfg.variant.adapter!r}")
    if cfg.export.granularity not in GRANULARITIES:  # fail before training, not after it
        raise ValueError(f"export.granularity must be one of {GRANULARITIES}, got {cfg.export.granularity!r}")
    if cfg.ckpt_path == "last":  # Lightning's word for the newest checkpoint: here, of this variant's runs
        cfg.ckpt_path = str(last_checkpoint(cfg))
        print(f"[train] ckpt_path=last: resuming from {cfg.ckpt_path}", flush=True)
    check_resume(cfg.ckpt_path, cfg.variant.name, cfg.trainer.get("max_steps"), learning_rate(cfg),
                 cfg.variant.domain, cfg.variant.init,
                 {k: cfg.variant.get(k) for k in ("weight_decay", "warmup_steps", "min_lr_ratio")},
                 cfg.lora.r if cfg.variant.adapter == "lora" else None)
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        choice = HydraConfig.get().runtime.choices.get("trainer") if HydraConfig.initialized() else "gpu"
        raise ValueError(f"trainer={choice} needs CUDA GPUs and this machine has none: "
                         f"use trainer=cpu (or trainer=ddp_cpu for data parallel on CPU processes)")


def train(cfg: DictConfig) -> dict:
    """Run one training job described by ``cfg`` (see module docstring), after :func:`check_config`;
    returns the final metrics.

    Every rank runs the fit; only rank 0 evaluates, writes and exports afterwards (the others
    return an empty dict).
    """
    import lightning as L

    from deltafleet.train.callbacks import step_progress_bar
    from deltafleet.train.datamodule import TextDataModule
    from deltafleet.train.distributed import ConsolidateOnTrainEnd
    from deltafleet.train.module import CausalLMModule, heldout_loss

    L.seed_everything(cfg.seed, workers=True)
    variant, domain = cfg.variant.name, cfg.variant.domain
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.paths.output_dir)
    tokenizer = load_tokenizer(cfg, run_dir)
    model = build_model(cfg, tokenizer)
    dm = TextDataModule(cfg.paths.data_dir, domain, tokenizer, cfg.variant.seq_len, cfg.variant.batch_size,
                        num_workers=cfg.num_workers, seed=cfg.seed)
    with user_errors("train"):  # data too small for the settings: one line, before any training
        dm.setup()
        if len(dm.blocks["train"]) < cfg.variant.batch_size:
            raise ValueError(f"the {domain} train split holds {len(dm.blocks['train'])} blocks of "
                             f"{cfg.variant.seq_len} tokens, fewer than one batch (variant.batch_size="
                             f"{cfg.variant.batch_size}): nothing to train on")
    test_blocks = dm.blocks["test"]
    n_params = sum(p.numel() for p in model.parameters())
    initial = heldout_loss(model, test_blocks, cfg.variant.batch_size, cfg.eval_batches) \
        if cfg.variant.init == "scratch" else None
    if cfg.variant.adapter == "lora":
        from deltafleet.train.lora import apply_lora

        model = apply_lora(model, **OmegaConf.to_container(cfg.lora))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"[train] variant={variant} domain={domain} params={n_params / 1e6:.2f}M trainable={trainable / 1e6:.2f}M "
          f"train_blocks={len(dm.blocks['train'])}x{cfg.variant.seq_len} steps={cfg.trainer.max_steps}", flush=True)

    logger = hydra.utils.instantiate(cfg.logger)
    logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    metrics: dict = {"variant": variant, "domain": domain, "parameters": n_params, "trainable_parameters": trainable,
                     "lr": learning_rate(cfg), **_sweep_job()}
    adapter_dir = None  # a LoRA run's staged adapter (finish_lora), until the save of out_dir moves it in
    stopped: BaseException | None = None
    try:
        module = CausalLMModule(model, lr=metrics["lr"], weight_decay=cfg.variant.weight_decay,
                                warmup_steps=cfg.variant.warmup_steps, max_steps=cfg.trainer.max_steps,
                                min_lr_ratio=cfg.variant.min_lr_ratio, variant=variant, domain=domain,
                                init=cfg.variant.init)
        consolidate = ConsolidateOnTrainEnd()
        callbacks = [*build_callbacks(cfg, run_dir), *user_callbacks(cfg), consolidate]
        bar = step_progress_bar(callbacks, cfg.trainer.get("enable_progress_bar"))
        trainer = hydra.utils.instantiate(trainer_settings(cfg), logger=logger,
                                          callbacks=[*callbacks, *([bar] if bar else [])],
                                          default_root_dir=str(run_dir))
        t0 = time.perf_counter()
        fit(trainer, module, datamodule=dm, ckpt_path=cfg.ckpt_path)  # Ctrl-C: KeyboardInterrupt
        # fit restored SIGTERM's default (the process dies at once); from here on the outputs are
        # written in staged folders, which a SIGTERM must remove as Ctrl-C does
        if threading.current_thread() is threading.main_thread():
            stop_on_sigterm()
        metrics["train_seconds"] = time.perf_counter() - t0
        metrics["global_step"] = trainer.global_step
        if trainer.fast_dev_run:  # Lightning's smoke run: a few batches, no checkpoints, and so no outputs
            print(f"[train] fast_dev_run: {trainer.global_step} step(s) ran; nothing written to {cfg.out_dir}"
                  + (" or export.out_dir" if cfg.variant.init == "base" and cfg.export.enabled else ""), flush=True)
            return metrics
        if cfg.variant.adapter == "lora":
            model = finish_lora(module.model, Path(cfg.out_dir), trainer)
            adapter_dir = getattr(model, "_deltafleet_adapter_dir", None)
        else:
            model = None
            if trainer.is_global_zero:  # a fresh, unsharded model holding the consolidated weights
                model = build_model(cfg, tokenizer)
                model.load_state_dict(consolidate.state)
        if not trainer.is_global_zero:
            return {}
        device = trainer.strategy.root_device
        metrics.update(evaluate_and_save(cfg, run_dir, model, tokenizer, test_blocks, initial, metrics, logger,
                                         device))
    except BaseException as e:
        stopped = e
        raise
    finally:
        # moved into out_dir by a successful save; a run that failed, diverged or was stopped leaves none
        if adapter_dir is not None:
            shutil.rmtree(adapter_dir, ignore_errors=True)
        finish_wandb(stopped)
    return metrics


def finish_lora(peft_model, out_dir: Path, trainer):
    """Save the PEFT adapter (rank 0) in a fresh staging folder beside ``out_dir``; return the
    model with the adapter merged in (the staging folder rides along as ``_deltafleet_adapter_dir``).
    The folder is removed here if this fails, and by :func:`train` after any later failure or stop;
    only :func:`save_checkpoint` moves it into ``out_dir``."""
    from deltafleet.train.lora import save_adapter_and_merge

    if not trainer.is_global_zero:
        return None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-adapter-"))
    try:
        model = save_adapter_and_merge(peft_model.float().cpu(), staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    model._deltafleet_adapter_dir = staging
    return model


def evaluate_and_save(cfg: DictConfig, run_dir: Path, model, tokenizer, test_blocks: torch.Tensor,
                      initial: float | None, metrics: dict, logger, device: torch.device) -> dict:
    """Rank 0 after fit: held-out losses, the HF checkpoint, and for a variant the BitDelta export."""
    from transformers import AutoModelForCausalLM

    from deltafleet.train.module import heldout_loss

    variant, domain = cfg.variant.name, cfg.variant.domain
    check_finite(model, cfg, metrics.get("global_step"))
    model = model.float().to(device).eval()
    out: dict = {}
    after = heldout_loss(model, test_blocks, cfg.variant.batch_size, cfg.eval_batches, device=device)
    model = model.cpu()
    out["heldout/loss"] = after
    if cfg.variant.init == "base":
        base = AutoModelForCausalLM.from_pretrained(cfg.base_dir, dtype=torch.float32).to(device)
        before = heldout_loss(base, test_blocks, cfg.variant.batch_size, cfg.eval_batches, device=device)
        del base
        out["base_dir"] = str(Path(cfg.base_dir).resolve())  # what summary groups a family's tables by
        out["heldout/base_loss"] = before
        out["heldout/gain"] = before - after
        print(f"[train] held-out loss on {domain}/test: base {before:.4f} -> {variant} {after:.4f} "
              f"(gain {before - after:+.4f} nats/token)", flush=True)
    else:
        out["heldout/initial_loss"] = initial
        print(f"[train] held-out loss on {domain}/test: initial {initial:.4f} -> {variant} {after:.4f}", flush=True)

    out_dir = Path(cfg.out_dir)
    adapter_dir = getattr(model, "_deltafleet_adapter_dir", None)
    with output_write("train", "the fine-tune", "out_dir", out_dir):  # a full disk: one line, not a traceback
        save_checkpoint(model, tokenizer, out_dir, {"run_id": run_dir.name, **metrics, **out}, adapter_dir)
    print(f"[train] wrote {out_dir}", flush=True)
    if cfg.variant.init == "base":
        retire_artifact(cfg)

    manifest = None
    if cfg.variant.init == "base" and cfg.export.enabled:
        manifest, bd = export_and_check(cfg, run_dir, test_blocks, out["heldout/base_loss"], after, device)
        out.update(bd)
    logger.log_metrics({k: v for k, v in out.items() if isinstance(v, float)}, step=metrics.get("global_step"))
    logger.save()  # the CSV logger buffers rows until save(); fit has already made its last call
    log_quality(logger, cfg, out, manifest)
    record = {**metrics, **out}
    write_text(run_dir / "metrics.json", json.dumps(record, indent=2) + "\n")
    files = json.loads((out_dir / "training.json").read_text())["files"]  # as save_checkpoint listed them
    write_text(out_dir / "training.json", json.dumps({"run_id": run_dir.name, **record, "files": files}, indent=2) + "\n")
    return out


def check_finite(model, cfg: DictConfig, steps: int | None) -> None:
    """Refuse to write a fine-tune that diverged: a weight holding NaN or inf ends the job (status 1,
    one line) with nothing written (:func:`train` removes a LoRA run's staged adapter); the run folder
    and its checkpoints stay (a resume from a diverged one is refused: :func:`check_resume`)."""
    bad = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is None:
        return
    what = "fine-tune" if cfg.variant.init == "base" else "model"
    raise SystemExit(f"train: the {what} diverged: {bad} holds NaN or inf after {steps} steps, so nothing was "
                     f"written to {cfg.out_dir}; lower the learning rate ({learning_rate(cfg):g}: variant.lr, or "
                     f"model.finetune_lr for a pretrained family) and train again (a resume from a checkpoint "
                     f"holding diverged weights is refused)")


def retire_artifact(cfg: DictConfig) -> None:
    """The variant's artifact (``export.out_dir``) was made from the fine-tune this run has just
    replaced. With the export on, it is removed before the export writes this run's, so a run stopped
    in between (Ctrl-C) leaves no artifact rather than the previous run's beside the new fine-tune;
    with the export off it is kept, and named as stale."""
    from deltafleet.compress.bitdelta import not_artifact

    out = Path(cfg.export.out_dir)
    if not out.is_dir() or not_artifact(out, cfg.variant.name) is not None:
        return
    if cfg.export.enabled:
        remove_dir(out)
        print(f"[train] removed {out}, the artifact of the fine-tune this run replaced", flush=True)
    else:
        print(f"[train] warning: {out} is the artifact of the fine-tune this run replaced, not of this one: "
              f"`make export VARIANT={cfg.variant.name}` exports this one", flush=True)


def export_and_check(cfg: DictConfig, run_dir: Path, test_blocks: torch.Tensor, base_loss: float,
                     ft_loss: float, device: torch.device | str = "cpu") -> tuple[dict, dict]:
    """Export ``artifacts/<variant>/`` and measure the held-out loss of the BitDelta model."""
    from transformers import AutoModelForCausalLM

    from deltafleet.compress.bitdelta import compress, load_artifact, materialize
    from deltafleet.train.module import heldout_loss

    out = Path(cfg.export.out_dir)
    with output_write("train", "the artifact", "export.out_dir", out):
        manifest = compress(cfg.base_dir, cfg.out_dir, out, variant=cfg.variant.name,
                            granularity=cfg.export.granularity,
                            provenance={"run_id": run_dir.name, "config": OmegaConf.to_container(cfg, resolve=True)})
    artifact = load_artifact(out)
    approx = AutoModelForCausalLM.from_pretrained(cfg.base_dir, dtype=torch.float32)
    approx.load_state_dict(materialize(cfg.base_dir, artifact), strict=False)
    bd_loss = heldout_loss(approx.to(device), test_blocks, cfg.variant.batch_size, cfg.eval_batches, device=device)
    gain = base_loss - ft_loss
    # undefined (null in training.json, "n/a") where the fine-tune gained nothing over the base
    recovered = (base_loss - bd_loss) / gain if gain > 0 else None
    stats = manifest["stats"]
    said = f"{recovered:.2f}" if recovered is not None else "n/a: the fine-tune is no better than the base"
    print(f"[export] {out}: {stats['bytes'] / 1e6:.2f} MB, {stats['bits_per_parameter']:.3f} bits/param; "
          f"held-out loss base {base_loss:.4f} | fine-tune {ft_loss:.4f} | BitDelta {bd_loss:.4f} "
          f"(gain recovered {said})", flush=True)
    return manifest, {"export/out_dir": str(out.resolve()), "heldout/bitdelta_loss": bd_loss,
                      "heldout/bitdelta_gain_recovered": recovered,
                      "export/bits_per_parameter": float(stats["bits_per_parameter"]),
                      "export/bytes": float(stats["bytes"])}


def log_quality(logger, cfg: DictConfig, out: dict, manifest: dict | None) -> None:
    """W&B only: a table of held-out quality (base, full fine-tune, BitDelta) and the artifact.

    The same numbers reach every logger as ``heldout/*`` metrics; this adds the table view and
    the artifact folder with its manifest (``config`` left out) as metadata.
    """
    from lightning.pytorch.loggers import WandbLogger

    if not isinstance(logger, WandbLogger) or "heldout/base_loss" not in out:
        return
    base = out["heldout/base_loss"]
    rows = [["base", base, math.exp(base), 0.0]]
    rows.append(["fine-tune", out["heldout/loss"], math.exp(out["heldout/loss"]), out["heldout/loss"] - base])
    if "heldout/bitdelta_loss" in out:
        bd = out["heldout/bitdelta_loss"]
        rows.append([f"bitdelta-{cfg.export.granularity}", bd, math.exp(bd), bd - base])
    logger.log_table(key="quality", columns=["model", "heldout_loss", "perplexity", "delta_vs_base"], data=rows)
    if manifest is not None:
        import wandb

        meta = {k: v for k, v in manifest.items() if k != "provenance"}
        meta["provenance"] = {k: v for k, v in manifest["provenance"].items() if k != "config"}
        art = wandb.Artifact(name=f"bitdelta-{cfg.variant.name}", type="bitdelta", metadata=meta)
        art.add_dir(str(cfg.export.out_dir))
        logger.experiment.log_artifact(art)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from deltafleet.threads import set_threads

    # a misspelt +key (+eval_batchs=1) would train with the default: `error: ...`, status 2, before any work
    refuse_unknown_settings(cfg, "train.yaml", ("checkpoint", "lora", "export"))
    with user_errors("train"):  # one line for a mistake; a failure during training keeps its traceback
        set_threads(cfg)
        check_config(cfg)
    with interruptible("train"):  # Ctrl-C anywhere, in fit too: `train: interrupted`, status 130
        metrics = train(cfg)
    return metrics.get("heldout/loss")


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
