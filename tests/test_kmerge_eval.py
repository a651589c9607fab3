"""Pieces of the K-Merge experiment (merge/kmerge_eval.py) on tiny models: PEFT adapters read as
LoRA factors reproduce PEFT's own merged weights; the arrival-order baselines."""
from __future__ import annotations

import torch

from deltafleet.merge.kmerge_eval import baseline_pool, load_factors
from tests.conftest import tiny_llama


def test_peft_adapter_factors_give_peft_merged_weights(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(64, seed=1)
    w0 = {k: v.clone() for k, v in base.state_dict().items()}
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # PEFT starts B at 0: give the adapter an update
    peft.save_pretrained(tmp_path / "adapter")
    merged = peft.merge_and_unload().state_dict()
    f = load_factors(tmp_path / "adapter")
    assert sorted(f) == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj"))
    for mod, (a, b) in f.items():
        torch.testing.assert_close((w0[f"{mod}.weight"].double() + b @ a).float(), merged[f"{mod}.weight"],
                                   rtol=1e-5, atol=1e-6)


def test_arrival_order_baselines():
    g = torch.Generator().manual_seed(0)
    ad = {n: {"m": (torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g,
                                                                                      dtype=torch.float64))}
          for n in ("a", "b", "c")}
    slots, t2s = baseline_pool("linear", 2, ad, rank=4, density=0.5)
    assert t2s == {"a": 0, "b": 1, "c": 0}
    a, b = slots[0]["m"]
    want = (ad["a"]["m"][1] @ ad["a"]["m"][0] + ad["c"]["m"][1] @ ad["c"]["m"][0]) / 2
    torch.testing.assert_close(b @ a, want, rtol=1e-9, atol=1e-9)
    slots, _ = baseline_pool("ties", 1, ad, rank=5, density=1.0)
    a, b = slots[0]["m"]
    from deltafleet.merge.methods import disjoint_merge

    dense = [x["m"][1] @ x["m"][0] for x in ad.values()]
    torch.testing.assert_close(b @ a, disjoint_merge(dense, [1, 1, 1]), rtol=1e-5, atol=1e-6)  # TIES runs in fp32
