"""Pieces of the K-Merge experiment (merge/kmerge_eval.py) on tiny models: PEFT adapters read as
LoRA factors reproduce PEFT's own merged weights; the arrival-order baselines."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafleet.merge.kmerge_eval import baseline_pool, load_factors
from tests.conftest import tiny_llama


@pytest.mark.parametrize("extra", [{}, {"use_rslora": True},  # rsLoRA: found by a reviewer (scaled by alpha / r)
                                   {"rank_pattern": {"down_proj": 2},
                                    "alpha_pattern": {"layers.1.self_attn.q_proj": 3}}])
def test_peft_adapter_factors_give_peft_merged_weights(tmp_path, extra):
    """PEFT's own scale, per module: lora_alpha / r, or / √r for rsLoRA, with rank_pattern and
    alpha_pattern's per-module ranks and alphas."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(64, seed=1)
    w0 = {k: v.clone() for k, v in base.state_dict().items()}
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], **extra))
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


def test_a_dora_adapter_is_refused(tmp_path):
    """A DoRA adapter's update is not B·A (its magnitude vector rescales each column): refused, named."""
    from peft import LoraConfig, get_peft_model

    get_peft_model(tiny_llama(64, seed=1), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"is a DoRA adapter \(use_dora\), whose update is not B·A"):
        load_factors(tmp_path / "adapter")


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


def test_a_ties_baseline_slot_is_padded_to_the_pool_rank():
    """As every pool slot: a 5 × 3 module's TIES merge at rank 4 has 3 directions, zero-padded to 4."""
    g = torch.Generator().manual_seed(1)
    ad = {n: {"m": (torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g,
                                                                                      dtype=torch.float64))}
          for n in ("a", "b")}
    slots, _ = baseline_pool("ties", 1, ad, rank=4, density=1.0)
    a, b = slots[0]["m"]
    assert a.shape == (4, 3) and b.shape == (5, 4) and not a[3:].any() and not b[:, 3:].any()


def _cfg(tmp_path, *overrides):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="kmerge_eval", overrides=[f"paths.root={tmp_path}", *overrides])


@pytest.mark.parametrize("override, message", [
    ("domains=[coder,nosuch]", "domains: each must be a variant config (base, chat, coder, legal, math, writer), "
                               "got 'nosuch'"),
    ("seeds=[1,-1]", "seeds: each must be a whole number ≥ 0, got -1"),
    ("seeds=[1,1]", "seeds lists 1 twice"),
    ("ks=[]", "ks must be a non-empty list, got []"),
    ("ks=[0,1]", "ks: each must be a whole number ≥ 1, got 0"),
    ("policies=[kmerge,opcm]", "policies: each must be one of kmerge, kmerge++, budget_opcm, linear, ties, "
                               "got 'opcm'"),
    ("order=random", "order must be interleaved or grouped, got 'random'"),
    ("gate=1.5", "gate must be a number above 0, at most 1, got 1.5"),
    # the pool refuses these too, but only after every adapter has been trained
    ("gate=0", "gate must be a number above 0, at most 1, got 0"),
    ("alpha=1", "alpha must be a number above 0, below 1, got 1"),
    ("alpha=0", "alpha must be a number above 0, below 1, got 0"),
    ("ties_density=0", "ties_density must be a number above 0, at most 1, got 0"),
    ("eval_batches=0", "eval_batches must be a whole number ≥ 1, got 0"),
    ("report_name=a/b", "report_name must be a file name (no folder) for reports/<report_name>.json, got 'a/b'"),
    ("+polices=[kmerge]", "polices is not a setting of conf/kmerge_eval.yaml; its settings: adapters_dir, alpha, "
                          "base_dir, batch_size, domains, eval_batches, evicted_to, gate, gate_batches, ks, "
                          "machine, order, paths, policies, rank, report_name, seeds, seq_len, threads, "
                          "threshold, ties_density"),
])
def test_a_bad_setting_is_refused_before_any_adapter_is_trained(tmp_path, override, message):
    """Found by a fresh user: a domain with no variant config was found only when its adapter's training
    failed, after the others trained, leaving their run folders; the other settings were never checked."""
    from deltafleet.merge.kmerge_eval import check_config

    with pytest.raises(ValueError) as e:
        check_config(_cfg(tmp_path, override))
    assert str(e.value) == message


def test_a_refused_run_is_one_line_and_leaves_nothing(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "merge/kmerge_eval.py", f"paths.root={tmp_path}", "domains=[nosuch]",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "kmerge-eval: ValueError: domains: each must be a variant config"), r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # no run folder, no adapter trained


def test_adapters_are_trained_on_the_base_they_are_scored_on(tmp_path, monkeypatch):
    """Found by a fresh user: ``base_dir`` was checked and scored against, while the adapters' training
    used ``paths.root``'s base (another base, or none)."""
    import subprocess
    import types

    from deltafleet.merge import kmerge_eval

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: seen.append(args) or types.SimpleNamespace(returncode=0))
    cfg = _cfg(tmp_path, f"base_dir={tmp_path / 'elsewhere' / 'base'}")
    kmerge_eval.train_adapter(cfg, "coder", 1, tmp_path / "out")
    assert f"base_dir={tmp_path / 'elsewhere' / 'base'}" in seen[0]


def test_a_trained_adapter_is_reused_only_for_the_base_it_was_trained_on(tmp_path, monkeypatch):
    """An adapter under adapters_dir that training.json says was trained on another base (base_dir
    changed since) is trained again, not scored as a fine-tune of this base; one of this base is reused."""
    import json
    import subprocess
    import types

    from deltafleet.merge import kmerge_eval

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: seen.append(args) or types.SimpleNamespace(returncode=0))
    base = tmp_path / "models" / "base"
    cfg = _cfg(tmp_path, f"base_dir={base}")
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    (out / "training.json").write_text(json.dumps({"base_dir": str(tmp_path / "old" / "base")}))
    kmerge_eval.train_adapter(cfg, "coder", 1, out)
    assert len(seen) == 1 and f"base_dir={base}" in seen[0]
    (out / "training.json").write_text(json.dumps({"base_dir": str(base.resolve())}))
    kmerge_eval.train_adapter(cfg, "coder", 1, out)
    assert len(seen) == 1


def test_relative_paths_reach_the_training_as_this_job_reads_them(tmp_path, monkeypatch):
    """The training runs in the repository: a relative base_dir, paths.root or adapters_dir given from
    another folder must name the same folders there as in this job."""
    import subprocess
    import types

    from deltafleet.merge import kmerge_eval

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: seen.append(args) or types.SimpleNamespace(returncode=0))
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, "base_dir=rel/base", "paths.root=demo")
    kmerge_eval.train_adapter(cfg, "coder", 1, Path("ads") / "coder-s1")
    assert f"base_dir={tmp_path / 'rel' / 'base'}" in seen[0] and f"paths.root={tmp_path / 'demo'}" in seen[0]
    assert f"out_dir={tmp_path / 'ads' / 'coder-s1'}" in seen[0]


def test_an_adapter_with_no_own_gain_has_an_undefined_ratio_not_a_crash(tmp_path, monkeypatch):
    """Found by a reviewer: S divided each adapter's served gain by its own, and an adapter whose own
    gain is 0 (no better than the base) ended the run in a ZeroDivisionError. Its ratio is now
    undefined (null in the JSON), S the mean over the others, and the Markdown names who is left out.
    Stand-ins for the training and the scorer: an update's gain is the L1 norm of its ΔW."""
    import json

    from deltafleet.merge import kmerge_eval

    g = torch.Generator().manual_seed(0)
    coder = {"m": (torch.randn(2, 6, generator=g, dtype=torch.float64),
                   torch.randn(5, 2, generator=g, dtype=torch.float64))}
    zero = {"m": (torch.randn(2, 6, generator=g, dtype=torch.float64), torch.zeros(5, 2, dtype=torch.float64))}

    class Scorer:
        def __init__(self, cfg):
            self.calls = 0

        def loss(self, factors, domain, split="test"):
            self.calls += 1
            return 3.0 - sum(float((b @ a).abs().sum()) for a, b in (factors or {}).values())

    monkeypatch.setattr(kmerge_eval, "train_adapter", lambda cfg, d, s, out: None)
    monkeypatch.setattr(kmerge_eval, "load_factors", lambda path: coder if "coder" in str(path) else zero)
    monkeypatch.setattr(kmerge_eval, "Scorer", Scorer)
    cfg = _cfg(tmp_path, "domains=[coder,math]", "seeds=[1]", "ks=[1,2]", "policies=[kmerge,linear]",
               "report_name=r")
    report = kmerge_eval.main(cfg)
    assert report["own_gain_nats"]["math-s1"] == 0.0 and report["undefined_ratio"] == ["math-s1"]
    for policy in ("kmerge", "linear"):
        got = report["results"][policy]
        assert got[1]["per_adapter"] == {"coder-s1": pytest.approx(0.5, abs=1e-9), "math-s1": None}  # half of ΔW
        assert got[1]["S"] == pytest.approx(0.5, abs=1e-9) and got[2]["S"] == pytest.approx(1.0, abs=1e-9)
    saved = json.loads((tmp_path / "reports" / "r.json").read_text())
    assert saved["results"]["kmerge"]["1"]["per_adapter"]["math-s1"] is None
    md = (tmp_path / "reports" / "r.md").read_text().splitlines()
    assert md[2] == "| kmerge | 0.500 | 1.000 |"
    assert md[-1].startswith("S leaves out math-s1: own gain ≤ 0")
    assert kmerge_eval.gain_ratio(0.02, -0.01) is None and kmerge_eval.mean_ratio({"a": None}) is None
