"""Training callbacks. ``MonoSoupCallback``: merge the weights with the best checkpoint every N steps;
``StepCheckpoint``: periodic checkpoints that follow their step's validation; ``StepProgressBar``:
Lightning's rich bar with a step-bounded run's epoch label.

    python train/run.py variant=coder merge=monosoup merge.every_n_steps=40
    python train/run.py variant=coder merge=svd_soup merge.rank=4
    python train/run.py variant=coder merge=none

The merge math lives in :mod:`deltafleet.merge.soup` (plain tensor functions); this file only decides when
to merge, moves one parameter at a time between ranks, and logs what happened.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from deltafleet.merge.soup import check_soup_settings, merge_param, summarize
from deltafleet.train.distributed import deepspeed_module, full_shape, read_full_param, world_size, write_full_param


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint(every_n_train_steps=N)``, but a step whose validation runs right
    after it is saved once that validation has ended (Lightning's own deferred save), not before: the
    checkpoint then holds what the validation changed (the merge callback's best checkpoint), which a
    resume from it would not see again, since Lightning does not rerun a validation its checkpoint
    says came due."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        due = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if due and not self._should_skip_saving_checkpoint(trainer) and self._validates_next(trainer):
            self._defer_save_until_validation = True  # saved by ModelCheckpoint.on_validation_end
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning saves a deferred checkpoint here only where it saves at validation end; with validation
        # at each epoch's end it saves at the train epoch's end, where a step checkpoint is not due: save it now
        if (self._defer_save_until_validation and self._should_save_on_train_epoch_end(trainer)
                and not self._should_skip_saving_checkpoint(trainer)):
            self._save_deferred(trainer)
            return
        super().on_validation_end(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A run stopped during the validation its step checkpoint waits for (SIGTERM, a preemption's
        signal, raises there: ``deltafleet.cli.stop_on_sigterm``) saves that checkpoint now, as plain
        Lightning would have before the validation, without what the validation would have changed;
        not for Ctrl-C (no checkpoint, as at any other point), nor with several processes, whose save
        is collective and whose ranks need not all be stopping here."""
        if (self._defer_save_until_validation and isinstance(exception, SystemExit) and trainer.world_size == 1
                and not self._should_skip_saving_checkpoint(trainer)):
            self._save_deferred(trainer)
        super().on_exception(trainer, pl_module, exception)

    def _save_deferred(self, trainer: L.Trainer) -> None:
        """Save the step checkpoint that waited for its validation, as Lightning saves one."""
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._defer_save_until_validation = False

    @staticmethod
    def _validates_next(trainer: L.Trainer) -> bool:
        """Whether the fit loop runs a validation after this batch (its own test, as it makes it next)."""
        loop = trainer.fit_loop
        fetcher, should = getattr(loop, "_data_fetcher", None), getattr(loop.epoch_loop, "_should_check_val_fx", None)
        return fetcher is not None and should is not None and bool(should(fetcher))


def step_progress_bar(callbacks: list, enabled: bool | None = True):
    """The progress bar for a run of ``callbacks`` (None: Lightning's own, or none): where Lightning
    would pick its rich bar (``rich`` installed, progress bar on, no progress bar among
    ``callbacks``), :class:`StepProgressBar`. ``enabled``: the Trainer's ``enable_progress_bar``, read
    as Lightning reads it (None: on; otherwise on where true, so ``0`` is off)."""
    from lightning.pytorch.callbacks.progress import ProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE  # what Lightning reads to pick its bar

    on = enabled is None or bool(enabled)
    if not on or not _RICH_AVAILABLE or any(isinstance(c, ProgressBar) for c in callbacks):
        return None
    return StepProgressBar()


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, whose label in a run bounded by ``max_steps`` alone (Lightning's
    fit sets ``max_epochs`` to −1) reads "Epoch 0", not "Epoch 0/-2"."""

    def _get_train_description(self, current_epoch: int) -> str:
        text = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            text = text.replace(f"Epoch {current_epoch}/{self.trainer.max_epochs - 1}", f"Epoch {current_epoch}", 1)
            text = f"{text:{len(self.validation_description)}}"  # padded as Lightning pads it (no flicker)
        return text


def averaging_conflict(merge: str, averaging: str) -> str:
    """Why the merge every N steps (``merge``, e.g. "MonoSoupCallback (method monosoup)") and a
    callback of Lightning's weight averaging (``averaging``) cannot run together: the error message,
    whether train/run.py reads it in the settings or :class:`MonoSoupCallback` finds it in a Trainer."""
    return (f"{merge} and {averaging} both rewrite the model's weights, and do not compose: the weight averaging "
            "swaps its average in for every validation and copies it over the weights when training ends, so the "
            "merges' best checkpoint and their result would be undefined; use one of them (merge=ema is the EMA "
            "alone, merge=none leaves the averaging alone)")


def weight_averaging_classes() -> tuple[type, ...]:
    """Lightning's weight-averaging callbacks (``WeightAveraging``, which ``EMAWeightAveraging``
    extends); () in a Lightning without them."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:
        return ()
    return (WeightAveraging,)


class MonoSoupCallback(L.Callback):
    """Every ``every_n_steps`` optimizer steps, merge the current weights with the best checkpoint.

    The *base* ``W_base`` is the model's weights when training first starts (for a variant: the
    weights of ``models/base``, read from ``base_dir`` where a resumed run has no state of this
    callback to restore it from); the *best checkpoint* is a snapshot of the weights at the lowest
    ``monitor`` value seen at a validation end. At each merge step, for every parameter in turn,
    :func:`deltafleet.merge.soup.merge_param` combines ``[current, best]`` over ``W_base`` and the result is
    written back into the training model (and, under DeepSpeed, into the optimizer's fp32 master
    copy); training then continues with the optimizer state as it was.

    Distributed: parameters are handled one at a time. Each one is gathered in full on every rank
    (DDP: already replicated; DeepSpeed ZeRO-1/2/3: ``deepspeed.utils.safe_get_full_fp32_param``,
    or ``GatheredParameters`` for a ZeRO-3 parameter without an fp32 master), merged on rank 0,
    broadcast from rank 0, and written back on every rank. ``W_base`` and the best snapshot are
    float32 CPU copies held by rank 0 only (each costs 4 bytes per parameter of host memory).

    Each merge measures the validation loss before and after: the token-weighted mean cross-entropy
    over the first ``val_batches`` batches of the trainer's validation data (``trainer.val_dataloaders``,
    the first loader where there are several: the ``val_dataloaders`` passed to ``fit``, else the
    datamodule's or the module's ``val_dataloader()``, as Lightning prepared them), taken on every
    rank from its own share of them (Lightning's distributed sampler) and summed over the ranks, so
    every rank records the same loss. It appends a record to :attr:`records` and logs it to every logger of the trainer at
    the step at which Lightning logs that optimizer step's own metrics (``train/loss``, and ``val/loss``
    of a validation that follows it): Lightning's index of the step, one less than ``merge/step``, the
    optimizer steps done. The record: ``merge/step``, ``merge/val_loss_before``, ``merge/val_loss_after``,
    ``merge/mean_rank`` and ``merge/mean_energy_kept`` (the SVD methods: not ``average``),
    ``merge/seconds`` (plus ``merge/best_step``,
    ``merge/best_val_loss``, ``merge/matrices`` and, for MonoSoup, ``merge/mean_lambda_high`` and
    ``merge/mean_lambda_low``). A merge step with no best checkpoint yet logs ``merge/skipped = 1``.

    Resume: :meth:`state_dict` carries the best loss, step and weights, the base weights and the
    records, so ``Trainer.fit(ckpt_path=...)`` continues with the same best checkpoint. A checkpoint
    written without this callback's state (``merge=none`` or ``ema``) holds a fine-tune's weights, not
    the base's: ``W_base`` is then read from ``base_dir`` (without one, the resumed weights are taken,
    with a warning).

    Args:
        method: ``"monosoup"``, ``"svd_soup"``, ``"average"`` or ``"none"`` (the callback does nothing).
        every_n_steps: merge when ``trainer.global_step`` is a positive multiple of this.
        energy_ratio: MonoSoup's energy threshold ``R`` (``rank_mode="energy"``).
        rank_mode: MonoSoup's rank rule, ``"energy"`` or ``"effective_rank"``.
        rank: SVD soup's truncation rank.
        val_batches: validation batches for the before/after loss (0: not measured, logged as NaN).
        min_rel_update: MonoSoup's relative-update threshold ``τ``.
        monitor: the logged metric that ranks checkpoints (lower is better).
        base_dir: the Hugging Face checkpoint the model was first trained from (``train/run.py`` passes
            the variant's ``base_dir``), read only by a resumed run without this callback's state; its
            parameters must be those of the trained model (``pl_module.model``, or ``pl_module``).

    Not beside Lightning's weight averaging (``WeightAveraging``, e.g. ``EMAWeightAveraging``): it
    swaps its average in for every validation, which then ranks the average while this callback keeps
    the weights as the best checkpoint, and it copies the average over the weights at the end, over
    the merges' result. The two do not compose, and the pair is refused at setup.

    Raises:
        ValueError: a setting of the wrong kind or range (``merge.soup.check_soup_settings``), a
            ``base_dir`` whose parameters are not the model's, or (at setup) a weight-averaging
            callback in the same trainer.
        NotImplementedError: at setup, for strategies other than single-device, DDP and DeepSpeed.
    """

    def __init__(self, method: str = "monosoup", every_n_steps: int = 1000, energy_ratio: float = 0.8,
                 rank_mode: str = "energy", rank: int = 8, val_batches: int = 8, min_rel_update: float = 1e-6,
                 monitor: str = "val/loss", base_dir: str | None = None):
        check_soup_settings(method, every_n_steps, energy_ratio, rank_mode, rank, val_batches, min_rel_update, monitor)
        self.method, self.every_n_steps, self.val_batches, self.monitor = method, every_n_steps, val_batches, monitor
        self.base_dir = base_dir
        self.merge_kwargs = dict(energy_ratio=energy_ratio, rank_mode=rank_mode, rank=rank,
                                 min_rel_update=min_rel_update)
        self.best_val_loss = math.inf
        self.best_step = -1  # the same on every rank; -1: no best checkpoint yet
        self.best: dict[str, torch.Tensor] | None = None  # rank 0: name -> float32 CPU tensor
        self.base: dict[str, torch.Tensor] | None = None  # rank 0: name -> float32 CPU tensor
        self.records: list[dict[str, Any]] = []
        self._last_merge_step = -1
        self._merging: int | None = None  # the step of a merge writing the weights (None: none is)
        self._ds = None  # the deepspeed module, under DeepSpeedStrategy
        self._val_cache: list | None = None

    @property
    def state_key(self) -> str:
        # one key whatever the method, so resuming with another method keeps base, best and records
        return type(self).__name__

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    # ---------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled:
            return
        averaging = next((c for c in trainer.callbacks if isinstance(c, weight_averaging_classes())), None)
        if averaging is not None:
            raise ValueError(averaging_conflict(f"MonoSoupCallback (method {self.method})", type(averaging).__name__))
        strategy = trainer.strategy
        self._ds = deepspeed_module(trainer)
        if self._ds is not None:
            stage_ = (strategy.config or {}).get("zero_optimization", {}).get("stage", 0)
            rank_zero_info(f"[merge] {self.method}: DeepSpeed ZeRO stage {stage_}, one parameter at a time")
        elif type(strategy).__name__ in ("FSDPStrategy", "ModelParallelStrategy"):
            raise NotImplementedError(f"MonoSoupCallback supports single-device, DDP and DeepSpeed strategies, "
                                      f"not {type(strategy).__name__}")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After any checkpoint restore (DDP restores before on_fit_start, DeepSpeed after it), so a
        # restored base is kept and a fresh run snapshots the weights it starts from. A resume that
        # restored no base starts from a fine-tune's weights: the base is read from base_dir.
        if not self.enabled:
            return
        if self.base is None and trainer.ckpt_path and self.base_dir is not None:
            self.base = self._read_base(trainer, pl_module)
        elif self.base is None:
            if trainer.ckpt_path:
                rank_zero_warn("MonoSoupCallback: the checkpoint holds no merge state and no base_dir was given; "
                               "the resumed weights are taken as W_base")
            self.base = self._snapshot(trainer, pl_module)
        if not trainer.is_global_zero:  # a restored checkpoint gave every rank a copy: keep rank 0's
            self.base = self.best = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            rank_zero_warn(f"MonoSoupCallback: {self.monitor!r} was not logged; no best checkpoint tracked")
            return
        value = float(value)
        better = trainer.strategy.broadcast(value < self.best_val_loss, src=0)
        if better:
            self.best = self._snapshot(trainer, pl_module)
            self.best_val_loss, self.best_step = value, trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if not self.enabled or step == 0 or step % self.every_n_steps or step == self._last_merge_step:
            return  # the last test: with gradient accumulation this hook runs several times per step
        self._last_merge_step = step
        if self.best_step < 0:
            record = {"step": step, "method": self.method, "skipped": 1,
                      "reason": "no best checkpoint yet (no validation has run with this merge callback; "
                                "a resume of a run without it starts with none)"}
            rank_zero_info(f"[merge] step {step}: skipped, {record['reason']}")
            self._log(trainer, record)
            return
        # a checkpoint taken before the merge ends (on an exception, or in a signal handler: Lightning's
        # SLURM requeue) holds weights part merged: its state says so, and check_resume refuses it
        self._merging = step
        record = self.merge(trainer, pl_module)
        self._merging = None
        # a rank and an energy kept describe the SVD methods only; a plain mean has neither
        spectral = (f"mean rank {record['mean_rank']:.1f}, energy kept {record['mean_energy_kept']:.3f}, "
                    if self.method != "average" else "")
        rank_zero_info(f"[merge] step {step}: {self.method} with best@{self.best_step} "
                       f"(val {self.best_val_loss:.4f}); val loss {record['val_loss_before']:.4f} -> "
                       f"{record['val_loss_after']:.4f}, {spectral}{record['seconds']:.2f}s")
        self._log(trainer, record)

    # --------------------------------------------------------------- merging
    @torch.no_grad()
    def merge(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Merge the current weights with the best snapshot now (every rank must call this)."""
        t0 = time.perf_counter()
        before = self._val_loss(trainer, pl_module)
        rank0 = trainer.is_global_zero
        infos = []
        for name, p in pl_module.named_parameters():
            full = read_full_param(p, self._ds)
            if rank0:
                merged, info = merge_param(self.method, self.base[name], [full, self.best[name].to(full.device)],
                                           **self.merge_kwargs)
                merged = merged.to(torch.float32)
                infos.append(info)
            else:
                merged = torch.empty(full.shape, dtype=torch.float32, device=full.device)
            if world_size() > 1:
                torch.distributed.broadcast(merged, src=0)
            write_full_param(p, merged, self._ds, rank0)
        summary = trainer.strategy.broadcast(summarize(infos) if rank0 else None, src=0)
        if self.method == "average":  # a plain mean has no rank or energy kept (they would read full, 1.0)
            summary = {k: v for k, v in summary.items() if k not in ("mean_rank", "mean_energy_kept")}
        after = self._val_loss(trainer, pl_module)
        record = {"step": trainer.global_step, "method": self.method, "skipped": 0, "val_loss_before": before,
                  "val_loss_after": after, **summary, "best_step": self.best_step,
                  "best_val_loss": self.best_val_loss, "seconds": time.perf_counter() - t0}
        return record

    def _snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.Tensor] | None:
        """Float32 CPU copies of all parameters on rank 0 (``None`` elsewhere); collective."""
        out = {}
        for name, p in pl_module.named_parameters():
            full = read_full_param(p, self._ds)
            if trainer.is_global_zero:
                out[name] = full.detach().to("cpu", torch.float32, copy=True)
        return out if trainer.is_global_zero else None

    def _read_base(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.Tensor] | None:
        """``base_dir``'s weights as float32 CPU tensors named as ``pl_module``'s parameters, on rank 0
        (``None`` elsewhere); ValueError where its parameters are not the model's."""
        if not trainer.is_global_zero:
            return None
        from transformers import AutoModelForCausalLM

        inner = getattr(pl_module, "model", pl_module)
        prefix = next(name for name, m in pl_module.named_modules() if m is inner)
        prefix = f"{prefix}." if prefix else ""
        base = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        out = {prefix + name: p.detach() for name, p in base.named_parameters()}
        want = {name: tuple(full_shape(p)) for name, p in pl_module.named_parameters()}
        if {name: tuple(t.shape) for name, t in out.items()} != want:
            raise ValueError(f"MonoSoupCallback: the parameters of base_dir {self.base_dir} are not those of the "
                             f"model trained")
        return out

    @torch.no_grad()
    def _val_loss(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        """Mean next-token cross-entropy (nats/token) over the first ``val_batches`` batches of every
        rank's share of the validation data (:meth:`_val_batches`), token-weighted over all ranks;
        collective under DDP and DeepSpeed. NaN without validation data."""
        batches = self._val_batches(trainer, pl_module)
        if not batches:
            return float("nan")
        model = getattr(pl_module, "model", pl_module)
        modes = {m: m.training for m in pl_module.modules()}
        pl_module.eval()
        total = torch.zeros((), dtype=torch.float64, device=pl_module.device)
        count = 0
        try:
            with trainer.precision_plugin.val_step_context():
                for batch in batches:
                    ids = batch["input_ids"] if isinstance(batch, dict) else batch
                    labels = batch.get("labels", ids) if isinstance(batch, dict) else ids
                    ids, labels = ids.to(pl_module.device), labels.to(pl_module.device)
                    logits = model(input_ids=ids).logits.float()
                    targets = labels[:, 1:].reshape(-1)
                    total += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets,
                                                               ignore_index=-100, reduction="sum").double()
                    count += int((targets != -100).sum())
        finally:
            for m, mode in modes.items():
                m.train(mode)
        sums = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=total.device)])
        if world_size() > 1:  # each rank measured its own share: the loss of all of them, on every rank
            torch.distributed.all_reduce(sums)
        return sums[0].item() / max(sums[1].item(), 1.0)

    def _val_batches(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list:
        """The first ``val_batches`` batches of ``trainer.val_dataloaders`` (its first loader where it
        holds several), kept for every later merge; [] where the trainer has no validation data (no
        ``val_dataloaders``, ``limit_val_batches=0`` or no ``validation_step``: the losses are NaN)."""
        if self._val_cache is None and self.val_batches > 0:
            loader = trainer.val_dataloaders
            if isinstance(loader, dict):
                loader = next(iter(loader.values()), None)
            elif isinstance(loader, (list, tuple)):
                loader = loader[0] if loader else None
            if loader is None:
                rank_zero_warn("MonoSoupCallback: the trainer has no validation data; merge losses not measured")
                return []
            self._val_cache = list(itertools.islice(loader, self.val_batches))
        return self._val_cache or []

    def _log(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        self.records.append(record)
        metrics = {f"merge/{k}": float(v) for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if trainer.is_global_zero:
            # the step Lightning's logger connector gives this optimizer step's metrics: its count of the
            # batches that stepped before this one (global_step - 1 in this hook), so that a chart of
            # merge/* lines up with train/loss and val/loss of the same step
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return {"best_val_loss": self.best_val_loss, "best_step": self.best_step, "best": self.best,
                "base": self.base, "records": self.records, "last_merge_step": self._last_merge_step,
                "method": self.method, "merging": self._merging}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("method", self.method) != self.method:
            rank_zero_warn(f"MonoSoupCallback: resuming a {state_dict['method']!r} run with method "
                           f"{self.method!r}; keeping its base, best checkpoint and merge records")
        self.best_val_loss = float(state_dict["best_val_loss"])
        self.best_step = int(state_dict["best_step"])
        self.best, self.base = state_dict["best"], state_dict["base"]
        self.records = list(state_dict["records"])
        self._last_merge_step = int(state_dict.get("last_merge_step", -1))
