"""`make bench-compress` end to end on a small Llama-shaped pair (the 7B run is in reports/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltafleet.compress.bench import llama_tensors

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"name": "small", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_llama_tensor_list_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in SHAPE.items() if k != "name"}, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert dict(llama_tensors(SHAPE)) == expected
    # Llama-2-7B: 6.74 B parameters
    seven_b = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}
    assert sum(torch.Size(s).numel() for _, s in llama_tensors(seven_b)) == 6_738_415_616


@pytest.mark.slow
def test_bench_runs_both_paths_and_they_agree(tmp_path):
    overrides = [f"shape.{k}={v}" for k, v in SHAPE.items()] + [
        f"paths.root={tmp_path}", "machine=test", "naive=true", "report_name=bench", "sample_every_s=0.05",
        f"hydra.run.dir={tmp_path}/run"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "compress/bench.py"), *overrides], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "reports/bench.json").read_text())
    assert (tmp_path / "reports/bench.png").stat().st_size > 10_000
    pair = report["pair"]
    assert pair["parameters"] == sum(torch.Size(s).numel() for _, s in llama_tensors(SHAPE))
    # the generated pair is a sharded HF checkpoint whose fine-tune differs from its base
    base_dir = tmp_path / "outputs/bench/pair-small-2L-bfloat16/base"
    index = json.loads((base_dir / "model.safetensors.index.json").read_text())
    base = {}
    for f in sorted(set(index["weight_map"].values())):
        base.update(load_file(base_dir / f))
    assert set(base) == {n for n, _ in llama_tensors(SHAPE)}
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    s, n = report["paths"]["streaming"], report["paths"]["naive"]
    for r in (s, n):
        assert r["returncode"] == 0
        assert r["peak_rss_bytes"] >= max(b for _, b in r["rss"]) * 0.99  # VmHWM bounds every sample
        assert r["gb_per_s"] == pytest.approx(2 * pair["checkpoint_bytes"] / 1e9 / r["wall_s"])
    a = report["agreement"]
    n_matrices = sum(1 for _, shape in llama_tensors(SHAPE) if len(shape) == 2)
    assert a["matrices"] == n_matrices and a["sign_mismatches"] == [] and a["full_tensors_equal"]
    assert a["alpha_max_relative_difference"] < 1e-5
    assert "streaming" in proc.stdout and "agreement" in proc.stdout
