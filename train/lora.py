"""LoRA fine-tuning through ``peft`` (``variant.adapter=lora``).

Only the low-rank factors train (LoRA, Hu et al., arXiv:2106.09685, §4: ΔW = B·A scaled by
α/r). At the end of the run the adapter is saved in PEFT format (for the K-Merge pool and for
engines that serve adapters) and also merged into the weights, so the same BitDelta export and
server path handle LoRA and full fine-tunes alike.
"""
from __future__ import annotations

from pathlib import Path

import torch


def apply_lora(model: torch.nn.Module, r: int, alpha: float, dropout: float,
               target_modules: list[str]) -> torch.nn.Module:
    """Wrap a ``transformers`` causal LM with LoRA adapters on ``target_modules``.

    Args:
        model: e.g. a ``LlamaForCausalLM``; its own weights are frozen.
        r: adapter rank.
        alpha: LoRA scaling numerator (the update is ``(alpha / r) · B·A``).
        dropout: dropout on the adapter input.
        target_modules: linear-layer names to adapt (``q_proj``, ``down_proj``, ...).

    Returns:
        a ``peft.PeftModel`` whose ``forward`` matches the wrapped model's.

    Raises:
        ValueError: if ``r < 1`` or no module matches ``target_modules``.
    """
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ValueError(f"LoRA rank must be ≥ 1, got {r}")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        task_type="CAUSAL_LM", bias="none")
    return get_peft_model(model, config)


def save_adapter_and_merge(peft_model, adapter_dir: str | Path) -> torch.nn.Module:
    """Save the adapter in PEFT format to ``adapter_dir``; return the base model with it merged in.

    The saved folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` and loads
    with ``peft.PeftModel.from_pretrained(base, adapter_dir)``.
    """
    peft_model.save_pretrained(str(adapter_dir), safe_serialization=True)
    return peft_model.merge_and_unload()
