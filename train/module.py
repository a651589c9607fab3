"""The LightningModule: a Hugging Face causal LM, AdamW, warmup + cosine schedule.

Kept short on purpose, as nanoGPT's training loop is: everything that is not the training step
itself — checkpoint merging, export — lives in callbacks or in ``train/run.py``.
"""
from __future__ import annotations

import math

import lightning as L
import torch


class CausalLMModule(L.LightningModule):
    """Next-token training of ``model`` (a ``transformers`` ``*ForCausalLM``).

    Args:
        model: the network; its ``forward(input_ids, labels)`` returns the mean token cross-entropy.
        lr: peak learning rate.
        weight_decay: AdamW decoupled weight decay, applied to ≥2-D parameters only.
        warmup_steps: linear warmup from 0 to ``lr``.
        max_steps: length of the cosine decay; the schedule ends at ``lr * min_lr_ratio``.
        min_lr_ratio: floor of the cosine schedule as a fraction of ``lr``.
        variant, domain, init: the variant's name, its data's domain and how its weights started
            (``base``: the base's; ``scratch``), recorded in the checkpoints' hyper-parameters, so a
            resume can check that a checkpoint belongs to the run being resumed.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, warmup_steps: int,
                 max_steps: int, min_lr_ratio: float = 0.1, variant: str | None = None,
                 domain: str | None = None, init: str | None = None):
        super().__init__()
        self.model = model
        self.save_hyperparameters(ignore=["model"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint of a run with Lightning's weight averaging (``merge=ema``) holds the average in
        ``state_dict`` and the run's own weights in ``current_model_state``: a resume continues from
        the run's weights. With the averaging callback on, it restores both itself (after this hook,
        reading the average from ``state_dict``); without it, the run's weights go in here."""
        try:
            from lightning.pytorch.callbacks import WeightAveraging
        except ImportError:  # a Lightning before weight averaging: no checkpoint holds it
            return
        averaging = any(isinstance(c, WeightAveraging) for c in self.trainer.callbacks)
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint and not averaging:
            checkpoint["state_dict"] = checkpoint["current_model_state"]

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=(0.9, 0.95),
        )

        def lr_lambda(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int, max_batches: int | None = None,
                 device: torch.device | str = "cpu") -> float:
    """Token-weighted mean next-token cross-entropy (nats/token) of ``model`` on ``blocks``.

    Args:
        model: causal LM returning ``.logits`` ``[B, T, V]``.
        blocks: int64 ``[num_blocks, T]`` from :func:`deltafleet.train.datamodule.load_blocks`.
        batch_size: blocks per forward pass.
        max_batches: evaluate only the first ``max_batches`` batches (all when ``None``).
        device: where to run.

    Returns:
        mean loss in nats per predicted token (``T − 1`` predictions per block).
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i, start in enumerate(range(0, blocks.shape[0], batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        batch = blocks[start:start + batch_size].to(device)
        logits = model(input_ids=batch).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count
