"""Whole-parameter access under DDP and DeepSpeed ZeRO, one parameter at a time.

Plain and DDP training hold every parameter in full on every rank. DeepSpeed ZeRO-1/2 keeps the
fp32 master weights partitioned inside the optimizer (the module may hold bf16 copies), and
ZeRO-3 also partitions the module's parameters. The helpers here give a full fp32 view of one
parameter at a time (a collective: every rank must call them in the same order), so that
consolidating a checkpoint or merging weights never needs the whole model gathered at once.
"""
from __future__ import annotations

import sys

import lightning as L
import torch


def deepspeed_stage(trainer) -> int:
    """The ZeRO stage of ``trainer``'s strategy, or 0 when it is not DeepSpeed."""
    if "deepspeed" not in sys.modules:  # a DeepSpeed strategy has imported it; don't pay the import
        return 0
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(trainer.strategy, DeepSpeedStrategy):
        return 0
    return int(trainer.strategy.config.get("zero_optimization", {}).get("stage", 0))


def full_fp32_param(param: torch.nn.Parameter, stage: int) -> torch.Tensor:
    """The whole parameter in float32 (a new tensor on the parameter's device).

    Under DeepSpeed this is the optimizer's fp32 master copy when the parameter trains
    (``deepspeed.utils.safe_get_full_fp32_param``), else the gathered module parameter. It is a
    collective under DeepSpeed: call it on every rank.
    """
    if stage:
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
        if full is not None:
            return full.detach().float().clone()
        if stage == 3:  # frozen ZeRO-3 parameter: gather the module's own partitions
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                return param.detach().float().clone()
    return param.detach().float().clone()


def consolidated_state_dict(trainer, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Every parameter of ``model`` in full fp32 on the CPU of rank 0 (``None`` on other ranks).

    Gathers one parameter at a time, so peak extra memory is one parameter per GPU plus the
    CPU copy on rank 0. Persistent buffers are copied as they are (they are not sharded).
    """
    stage = deepspeed_stage(trainer)
    rank0 = trainer.is_global_zero
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        full = full_fp32_param(param, stage)
        if rank0:
            state[name] = full.cpu()
        del full
    if not rank0:
        return None
    for mod_name, mod in model.named_modules():
        for buf_name, buf in mod._buffers.items():
            if buf is not None and buf_name not in mod._non_persistent_buffers_set:
                state[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf.detach().cpu().clone()
    return state


class ConsolidateOnTrainEnd(L.Callback):
    """Gather the trained weights to rank 0's CPU when training ends (:func:`consolidated_state_dict`).

    It must run inside the fit: once ``Trainer.fit`` returns, the strategy has torn down and
    DeepSpeed's partitions sit on the CPU, where NCCL cannot gather them. Put it after any
    callback that swaps weights in ``on_train_end`` (e.g. EMA) so it sees the final weights.
    ``state`` is the full state dict on rank 0 and ``None`` elsewhere.
    """

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.state = consolidated_state_dict(trainer, pl_module.model)
