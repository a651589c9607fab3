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


def deepspeed_module(trainer):
    """The ``deepspeed`` module when ``trainer`` runs a DeepSpeed strategy, else ``None``."""
    if "deepspeed" not in sys.modules:  # a DeepSpeed strategy has imported it; don't pay the import
        return None
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return sys.modules["deepspeed"] if isinstance(trainer.strategy, DeepSpeedStrategy) else None


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def read_full_param(p: torch.nn.Parameter, ds) -> torch.Tensor:
    """The full float32 value of ``p`` on every rank, on ``p``'s device; collective under DeepSpeed.

    Under DeepSpeed the optimizer's fp32 master copy is read when there is one (ZeRO-1/2/3 and the
    bf16 optimizer), since the low-precision model weights are a rounded copy of it.
    """
    if ds is not None:
        full = ds.utils.safe_get_full_fp32_param(p)
        if full is not None:
            return full.detach().float().reshape(full_shape(p))
        if hasattr(p, "ds_id"):  # ZeRO-3 parameter without an fp32 master (frozen)
            with ds.zero.GatheredParameters([p]):
                return p.data.detach().float().clone()
    return p.detach().float()


def write_full_param(p: torch.nn.Parameter, value: torch.Tensor, ds, rank0: bool) -> None:
    """Write the full float32 ``value`` (identical on every rank) into ``p``; collective under ZeRO-3."""
    if ds is not None and hasattr(p, "ds_id"):  # ZeRO-3: partitioned model weights and fp32 master
        if p.requires_grad and hasattr(p, "_z3_optimizer"):
            # the local slice of the padded flat value: ``safe_set_full_fp32_param`` slices without
            # padding, which fails on the last rank when numel is not a multiple of the world size
            part = p.ds_tensor.numel()
            rank = torch.distributed.get_rank(group=p.ds_process_group)
            flat = torch.nn.functional.pad(value.flatten(), (0, part * torch.distributed.get_world_size(
                group=p.ds_process_group) - value.numel()))
            ds.utils.safe_set_local_fp32_param(p, flat[rank * part:(rank + 1) * part])
        with ds.zero.GatheredParameters([p], modifier_rank=0):
            if rank0:
                p.data.copy_(value.reshape(p.data.shape).to(p.dtype))
        return
    if ds is not None:  # ZeRO-1/2 (and the bf16 optimizer): replicated model weights, partitioned fp32 master
        ds.utils.safe_set_full_fp32_param(p, value)
    p.data.copy_(value.reshape(p.shape).to(p.dtype))


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def consolidated_state_dict(trainer, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Every parameter of ``model`` in full fp32 on the CPU of rank 0 (``None`` on other ranks), a
    tied one under each of its names (as ``state_dict`` has them), so ``load_state_dict`` takes it.

    Gathers one parameter at a time, so peak extra memory is one parameter per GPU plus the
    CPU copy on rank 0. Persistent buffers are copied as they are (they are not sharded).
    """
    ds = deepspeed_module(trainer)
    rank0 = trainer.is_global_zero
    state: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}  # a tied parameter (tie_word_embeddings) is gathered once, under every name
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            if rank0:
                state[name] = state[first[id(param)]]
            continue
        first[id(param)] = name
        full = read_full_param(param, ds)
        if rank0:
            state[name] = full.to("cpu", copy=True)
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
