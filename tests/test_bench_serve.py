"""The serving benchmark (serve/bench.py): the workload's lengths and model picks, the load's and the
summary's arithmetic on hand-made numbers, the engine-step hook, the transformers peers on a tiny
model, and real CPU runs through the server on loopback (the tiny shape: a built family with its
host tier, and the 70B config's synthetic family over 2 gloo ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from deltafleet.serve import bench
from deltafleet.serve.bench import (
    fit_context,
    lognormal_lengths,
    phase_stats,
    ratios_and_goals,
    summarize,
    zipf_models,
    zipf_probabilities,
)
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
# the CPU workload of the end-to-end run (Hydra overrides); the tests below recompute its requests
TINY = ["shape=tiny", "device=cpu", "dtype=float32", "variants=3", "concurrency=[1,4]", "summary_concurrency=4",
        "max_position_embeddings=128", "lengths={prompt_median:16,output_median:8,sigma:0.8,min:2,max:96}",
        "requests={min:4,per_concurrency:2,max:8}", "ttft={concurrency:4,requests:8,prompt_tokens:16,max_tokens:8}",
        "burst={requests:8,max_tokens:4}", "server={max_batch:4}", "client_processes=2", "warmup={max_tokens:2}",
        "hf.cb_config={block_size:16,num_blocks:64,max_batch_tokens:128}", "hf.static_batch=4"]


def compose_cfg(name: str = "bench_serve", overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


def test_lognormal_lengths_are_seeded_bounded_and_centred():
    draw = lambda seed, n=20000: lognormal_lengths(np.random.default_rng(seed), n, 256, 0.8, 8, 4096)
    a, b, c = draw(3), draw(3), draw(4)
    assert a.dtype == np.int64 and np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 8 and a.max() <= 4096
    assert abs(np.median(a) / 256 - 1) < 0.03  # the median is the configured one
    assert 300 < a.mean() < 380  # long-tailed: mean = median · exp(σ²/2) ≈ 353
    wide = lognormal_lengths(np.random.default_rng(0), 5000, 256, 3.0, 8, 4096)
    assert wide.min() == 8 and wide.max() == 4096  # clipped on both sides
    assert np.array_equal(lognormal_lengths(np.random.default_rng(0), 4, 100, 0.0, 8, 50), [50] * 4)
    with pytest.raises(ValueError):
        lognormal_lengths(np.random.default_rng(0), 4, 100, 0.5, 10, 5)


def test_lengths_are_cut_to_fit_the_context():
    p, o = fit_context(np.array([100, 4000, 4096, 8]), np.array([50, 200, 4096, 8]), 4096, 8)
    assert p.tolist() == [100, 3896, 8, 8] and o.tolist() == [50, 200, 4088, 8]
    assert (p + o <= 4096).all() and (p >= 8).all()
    with pytest.raises(ValueError):
        fit_context(np.array([4]), np.array([4]), 7, 4)


def test_load_requests_are_deterministic_and_fit(tmp_path):
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}"])  # the GPU defaults: 4096 context, medians 256 / 128
    assert [bench.requests_for(cfg, c) for c in (1, 16, 64, 256, 1000)] == [32, 64, 256, 512, 512]
    r1, r2 = bench.load_requests(cfg, 64, 32000), bench.load_requests(cfg, 64, 32000)
    assert r1 == r2 and len(r1) == 256
    assert r1 != bench.load_requests(cfg, 16, 32000)[:256]  # each level has its own requests
    prompt = np.array([len(p) for p, _ in r1])
    out = np.array([n for _, n in r1])
    assert (prompt + out <= 4096).all() and prompt.min() >= 8 and out.min() >= 8
    assert 200 < np.median(prompt) < 320 and 100 < np.median(out) < 160
    assert min(min(p) for p, _ in r1) >= bench.FIRST_PROMPT_ID and max(max(p) for p, _ in r1) < 32000
    fixed = bench.fixed_requests(5, 128, 64, 32000, [0, 1])
    assert fixed == bench.fixed_requests(5, 128, 64, 32000, [0, 1])
    assert [(len(p), n) for p, n in fixed] == [(128, 64)] * 5
    assert bench.burst_prompt_tokens(cfg) == 4096 - 8


def test_zipf_popularity_follows_the_rank_order():
    p = zipf_probabilities(15, 1.0)
    assert p.sum() == pytest.approx(1.0) and p[0] / p[1] == pytest.approx(2.0) and p[0] / p[14] == pytest.approx(15)
    models = ["bench"] + [f"bench-v{i:02d}" for i in range(14)]
    picks = zipf_models(models, 200_000, 1.0, [0, 1, 64])
    assert picks == zipf_models(models, 200_000, 1.0, [0, 1, 64])  # seeded
    freq = np.array([Counter(picks)[m] for m in models]) / len(picks)
    assert np.abs(freq - p).max() < 0.004
    assert freq[0] > freq[1] > freq[2] > freq[3] > freq[5] > freq[8] > freq[14]  # the base first, then v00, ...
    assert freq[0] == pytest.approx(0.302, abs=0.005)  # 1 / H(15)
    assert Counter(zipf_models(["a", "b"], 100_000, 2.0, [1]))["a"] / 100_000 == pytest.approx(0.8, abs=0.01)


@pytest.mark.parametrize("shape, layout, col_scales", [
    ({"vocab_size": 300, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}, "tiled", False),  # widths that pad the tiles
    ({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
      "num_attention_heads": 4, "tie_word_embeddings": True, "model_type": "qwen2"}, "tiled", True),
    ({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
      "num_attention_heads": 2, "attention_bias": True, "mlp_bias": True}, "rows", False)])
def test_decode_bytes_from_the_shape_are_what_a_built_model_holds(shape, layout, col_scales):
    import torch
    from deltafleet.serve.batch import DeltaSlots
    from deltafleet.serve.bench_step import decode_bytes, step_bytes
    from deltafleet.serve.synthetic import SyntheticFamily

    model = SyntheticFamily({**shape, "max_position_embeddings": 64}, variants=1).build_base("cpu", torch.bfloat16)
    slots = DeltaSlots(model, 2, sign_layout=layout, col_scales=col_scales)
    built = step_bytes(model, slots, rows=3, distinct_variants=2, context=10)
    b = decode_bytes(shape, 2, layout, col_scales)
    assert (b["weights"], 2 * b["signs"], 3 * 11 * b["kv_per_token"]) == (built["weights"], built["signs"], built["kv"])


def test_the_decode_floor_ratio_of_a_hand_computed_load():
    """A request of n new tokens decodes n − 1 (the prefill samples the first; found by a reviewer: every
    request took one decode step too many), the first of them reading its prompt and that token."""
    nbytes = {"weights": 100, "signs": 10, "kv_per_token": 1}
    # two at once: step 1 holds requests 0 (variant 0, context 2) and 1 (the base, context 1): 100 + 3 + 2
    # bytes, and variant 0's signs; request 1 ends, 2 (variant 1, context 3) joins request 0 (now at 3):
    # 100 + 4 + 4, and the signs of variants 0 and 1
    out = bench.decode_floor_ratio([(2, 3), (1, 2), (3, 2)], [0, -1, 1], 2, nbytes)
    assert out == {"mixed_over_base": pytest.approx((105 + 108) / (115 + 128)), "steps": 2, "mean_rows": 2.0,
                   "mean_variants": 1.5}
    assert bench.decode_floor_ratio([(4, 3)] * 3, [-1] * 3, 8, nbytes)["mixed_over_base"] == 1.0  # base only
    assert bench.decode_floor_ratio([], [], 4, nbytes) == {"mixed_over_base": None, "steps": 0, "mean_rows": None,
                                                           "mean_variants": None}
    assert bench.decode_floor_ratio([(4, 1)] * 3, [0, 1, 2], 8, nbytes)["steps"] == 0  # the prefill's token alone
    out = bench.decode_floor_ratio([(2, 3)], [0], 1, nbytes)  # decode steps at positions 2 and 3
    assert out["steps"] == 2 and out["mixed_over_base"] == pytest.approx((103 + 104) / (113 + 114))


def test_server_overrides_forward_the_server_dict_and_never_limit_waiting(tmp_path):
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", "server.max_num_batched_tokens=4096",
                                 "+server.kv_cache={block_size:64,max_tokens:null}", "+server.max_waiting=8"])
    out = bench.server_overrides(cfg, tmp_path / "tok", 1234)
    assert "max_batch=256" in out and "max_num_batched_tokens=4096" in out
    assert "kv_cache={block_size:64,max_tokens:null}" in out
    assert out[-1] == "max_waiting=null" and out.index("max_waiting=8") < len(out) - 1  # null wins: it comes last
    assert any(o.startswith("synthetic={shape:{vocab_size:32000,") and "max_position_embeddings:4096" in o for o in out)
    assert "tp=1" in out and "tp_port=1234" in out and "delta_cache.device_slots=14" in out


def test_the_report_names_the_event_loop_and_parser_the_server_runs(tmp_path, monkeypatch):
    import importlib.util

    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}"])
    assert bench.http_stack(cfg) == {"event_loop": "uvloop", "http_parser": "httptools"}  # pyproject's
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", "+server.http_parser=h11"])
    assert bench.http_stack(cfg) == {"event_loop": "uvloop", "http_parser": "h11"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in ("uvloop", "httptools") else real(name))
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}"])
    assert bench.http_stack(cfg) == {"event_loop": "asyncio", "http_parser": "h11"}  # uvicorn's fallbacks


def test_a_forwarded_value_reads_back_as_itself_in_hydras_grammar():
    """Found by a reviewer: every backslash was doubled, where Hydra's quoted strings take a backslash
    as itself except before a quote, so ``a\\b`` reached the server as ``a\\\\b``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for v in ["a\\b", "x'y", "x\\'y", "end\\", "end\\\\", "\\\\share\\d", "/tmp/a b,c", "",
              {"dir": "C:\\x\\", "n": [1, 2.5, None, True, "q'\\"]}]:
        assert parser.parse_override(f"k={bench.hydra_value(v)}").value() == v, v
    assert bench.hydra_value({"a": {"b": 1}, "c": "/x"}) == "{a:{b:1},c:'/x'}"


def test_the_predicted_kv_cache_is_the_whole_blocks_the_server_allocates(tmp_path):
    """Found by a reviewer: the prediction counted ``max_batch`` contexts of tokens, or ``max_tokens``,
    where the server (Engine._kv_blocks) allocates whole blocks: ``max_batch`` contexts each rounded up
    to whole blocks, and ``max_tokens`` rounded down to whole blocks, at most that many."""
    base = [f"paths.root={tmp_path}", *TINY, "max_position_embeddings=96"]  # tiny: 2 layers, 2 KV heads of 32
    per_token = 2 * 2 * 2 * 32 * 4  # K and V · layers · KV heads · head dim · float32

    def kv(*overrides):
        (one,) = bench.predicted_memory(compose_cfg(overrides=[*base, *overrides]))
        assert one["kv_cache_bytes"] == one["kv_cache_tokens"] * per_token
        assert one["total_bytes"] == one["base_bytes"] + one["slots_bytes"] + one["kv_cache_bytes"]
        return one["kv_cache_tokens"]

    assert kv() == 4 * 128  # 4 sequences of 96 tokens: one 128-token block each
    assert kv("+server.kv_cache={block_size:64}") == 4 * 2 * 64
    assert kv("+server.kv_cache={block_size:64,max_tokens:300}") == 4 * 64  # whole blocks within the cap
    assert kv("+server.kv_cache={block_size:16,max_tokens:100000}") == 4 * 96  # at most max_batch contexts
    (cuda,) = bench.predicted_memory(compose_cfg(overrides=[*base, "device=cuda"]))
    assert cuda["kv_cache_tokens"] is None and cuda["total_bytes"] == cuda["base_bytes"] + cuda["slots_bytes"]


# --------------------------------------------------------------------------------------------
# A load's figures, the summary, the goals
# --------------------------------------------------------------------------------------------


def result(model, sent, chunks, n, status=200, done=True, error=None, tokens=None):
    return {"model": model, "prompt_tokens": 10, "max_tokens": n, "status": status, "chunks": chunks, "sent": sent,
            "end": (chunks[-1] if chunks else sent) + 0.01, "completion_tokens": n if tokens is None else tokens,
            "done": done, "error": error}


def test_phase_stats_count_tokens_errors_and_latencies():
    rs = [result("b", 0.0, [0.1, 0.2, 0.3], 3), result("b-v00", 0.0, [0.3, 0.5], 2),
          result("b-v01", 0.1, [0.2, 0.25, 0.3, 0.35], 4, tokens=3),  # ended early (eos): a mismatch
          result("b", 0.0, [], 5, status=503, done=False, error="busy"),
          result("b-v00", 0.0, [0.4], 5, error='{"message": "boom"}'),  # an in-band error after the first token
          result("b", 0.0, [], 5, status=None, done=False, error="ConnectError: refused")]
    s = phase_stats(rs, base_id="b")
    assert s["requests"] == 6 and s["answered"] == 3 and s["all_answered"] is False and s["no_5xx"] is False
    assert s["status_codes"] == {"200": 4, "503": 1, "none": 1}
    assert [e["status"] for e in s["errors"]] == [503, 200, None]
    assert s["completion_tokens"] == 3 + 2 + 3 and s["token_mismatches"] == 1
    assert s["wall_s"] == pytest.approx(0.51)  # first send → last byte
    assert s["tokens_per_s"] == pytest.approx(8 / 0.51)
    assert s["ttft_p50_s"] == pytest.approx(0.1)  # TTFTs 0.1, 0.3, 0.1
    assert s["base"]["ttft_p50_s"] == pytest.approx(0.1) and s["variants"]["ttft_p50_s"] == pytest.approx(0.2)
    assert s["itl_p50_s"] == pytest.approx(0.075)  # gaps 0.1, 0.1, 0.2, 0.05, 0.05, 0.05
    assert s["per_model"]["b"]["requests"] == 1 and set(s["per_model"]) == {"b", "b-v00", "b-v01"}
    ok = phase_stats([result("b", 0.0, [0.1], 1)], base_id="b")
    assert ok["all_answered"] and ok["no_5xx"] and ok["itl_p50_s"] is None and ok["variants"]["ttft_p50_s"] is None


def hand_report(engine_steps, peers, burst_ok=True):
    def load(tps, ttft, vttft=None):
        return {"tokens_per_s": tps, "ttft_p50_s": ttft, "all_answered": True, "token_mismatches": 0,
                "base": {"ttft_p50_s": ttft}, "variants": {"ttft_p50_s": vttft}}

    return {"engine_steps": engine_steps, "summary_concurrency": 64, "peers": peers, "commit": "c0ffee",
            "machine": {"name": "h200: NVIDIA H200"},
            "loads": {"16": {"base": load(900.0, 0.05), "mixed": load(850.0, 0.05)},
                      "64": {"base": load(2000.0, 0.08), "mixed": load(1800.0, 0.09)}},
            "ttft": {"base": load(500.0, 0.04, None), "mixed": load(480.0, 0.05, 0.0515)},
            "burst": {"all_answered": burst_ok, "no_5xx": burst_ok, "token_mismatches": 0}}


def test_summary_ratios_and_goals():
    steps = {"step_over_floor": {1: {"base": 1.05, "mixed": 1.1}, "16": {"base": 1.1, "mixed": 1.2},
                                 64: {"base": 1.15, "mixed": 1.25}, "256": {"base": 1.2, "mixed": 1.35}}, "x": 1}
    peers = {"hf_continuous_batching": {"tokens_per_s": 400.0}, "hf_static": {"error": "OOM"}}
    r = hand_report(steps, peers)
    r["summary"] = s = summarize(r)
    assert set(s) == {"step_over_floor", "tokens_per_s", "ttft_p50_s", "machine", "commit"}
    assert s["step_over_floor"] == {"16": {"base": 1.1, "mixed": 1.2}, "64": {"base": 1.15, "mixed": 1.25},
                                    "256": {"base": 1.2, "mixed": 1.35}}  # string or int keys; rows 16-256 only
    assert s["tokens_per_s"] == {"base": 2000.0, "mixed": 1800.0, "hf_continuous_batching": 400.0, "hf_static": None}
    assert s["ttft_p50_s"] == {"base": 0.04, "mixed": 0.05} and s["machine"] == "h200: NVIDIA H200"
    ratios, goals = ratios_and_goals(r)
    assert ratios["base_over_hf_continuous_batching"] == pytest.approx(5.0) and ratios["base_over_hf_static"] is None
    assert ratios["mixed_over_base_tokens_per_s"] == pytest.approx(0.9)
    assert ratios["mixed_over_base_at_decode_floor"] is None  # no decode_floor in this report
    r["decode_floor"] = {"mixed_over_base": 0.78}
    assert ratios_and_goals(r)[0]["mixed_over_base_at_decode_floor"] == 0.78
    assert ratios["ttft_variant_over_base_p50"] == pytest.approx(1.03) and ratios["step_over_floor_max"] == 1.35
    assert goals == {"step_over_floor <= 1.3": False, "base >= 4x hf_continuous_batching": True,
                     "base >= 2x hf_static": None, "mixed/base >= 0.85": True, "ttft_p50 <= 0.1 s": True,
                     "variant/base ttft <= 1.05": True, "burst answered, no 5xx": True,
                     "every request answered": True, "every completion max_tokens long": True,
                     "structured decode step <= 1.05x": None}  # no structured load in this report
    # the structured load's decode steps against the base load's, at the summary concurrency
    for load, mean in (("base", 0.010), ("structured", 0.0106)):
        r["loads"]["64"].setdefault(load, {"all_answered": True, "token_mismatches": 0})["engine_steps"] = {
            "decode": {"steps": 100, "mean_s": mean}}
    ratios, goals = ratios_and_goals(r)
    assert ratios["structured_over_base_decode_step"] == pytest.approx(1.06)
    assert goals["structured decode step <= 1.05x"] is False
    r = hand_report({"error": "ImportError: no bench_step"}, None, burst_ok=False)
    r["summary"] = s = summarize(r)
    assert s["step_over_floor"]["64"] == {"base": None, "mixed": None}
    assert s["tokens_per_s"]["hf_static"] is None and s["tokens_per_s"]["hf_continuous_batching"] is None
    _, goals = ratios_and_goals(r)
    assert goals["step_over_floor <= 1.3"] is None and goals["base >= 4x hf_continuous_batching"] is None
    assert goals["burst answered, no 5xx"] is False and goals["every request answered"] is False


def test_a_goal_is_not_met_on_partial_figures_nor_at_other_settings():
    """Found by a reviewer: goals read true where an input was missing (step rows 64 and 256 not
    measured), partial (a mixed load whose variant requests failed ran its base share at full speed; a
    peer that finished 56 of its 256 requests), or of other settings (16 clients where the issue says
    64; a TTFT setting of other prompts). Each is null now, and the summary's figure of a load or peer
    not wholly answered is null too."""
    steps = {"step_over_floor": {k: {"base": 1.1, "mixed": 1.2} for k in ("16", "64", "256")}}
    peers = {"hf_continuous_batching": {"tokens_per_s": 400.0, "failed": 0, "short": 0},
             "hf_static": {"tokens_per_s": 900.0, "failed": 0, "short": 0}}

    def goals_of(r):
        r["summary"] = summarize(r)
        return ratios_and_goals(r)[1]

    assert all(goals_of(hand_report(steps, peers))[k] is True for k in (
        "step_over_floor <= 1.3", "base >= 4x hf_continuous_batching", "base >= 2x hf_static", "mixed/base >= 0.85",
        "ttft_p50 <= 0.1 s", "variant/base ttft <= 1.05"))
    r = hand_report({"step_over_floor": {"16": {"base": 1.1, "mixed": 1.2}}}, peers)
    assert goals_of(r)["step_over_floor <= 1.3"] is None
    r = hand_report(steps, peers)
    r["loads"]["64"]["mixed"]["all_answered"] = False
    goals = goals_of(r)
    assert r["summary"]["tokens_per_s"]["mixed"] is None and goals["mixed/base >= 0.85"] is None
    r = hand_report(steps, {**peers, "hf_continuous_batching": {"tokens_per_s": 400.0, "failed": 200, "short": 0}})
    goals = goals_of(r)
    assert r["summary"]["tokens_per_s"]["hf_continuous_batching"] is None
    assert goals["base >= 4x hf_continuous_batching"] is None and goals["base >= 2x hf_static"] is True
    r = hand_report(steps, {**peers, "hf_static": {"tokens_per_s": 900.0, "failed": 0, "short": 3}})
    assert goals_of(r)["base >= 2x hf_static"] is None
    r = hand_report(steps, peers)
    r["ttft"]["mixed"]["all_answered"] = False
    goals = goals_of(r)
    assert goals["ttft_p50 <= 0.1 s"] is None and goals["variant/base ttft <= 1.05"] is None
    r = hand_report(steps, peers)
    r["summary_concurrency"] = 16
    goals = goals_of(r)
    assert r["summary"]["tokens_per_s"]["base"] == 900.0  # the load at 16, as the summary says
    assert [goals[k] for k in ("base >= 4x hf_continuous_batching", "base >= 2x hf_static",
                               "mixed/base >= 0.85")] == [None, None, None]
    r = hand_report(steps, peers)
    r["config"] = {"ttft": {"concurrency": 16, "requests": 64, "prompt_tokens": 32, "max_tokens": 64}}
    goals = goals_of(r)
    assert goals["ttft_p50 <= 0.1 s"] is None and goals["variant/base ttft <= 1.05"] is None
    r["config"]["ttft"]["prompt_tokens"] = 128
    assert goals_of(r)["ttft_p50 <= 0.1 s"] is True


def test_load_seconds_are_read_per_tier_from_metrics():
    rows = [("sum", "b-v1", "disk", 0.5), ("count", "b-v1", "disk", 1.0), ("sum", "b-v2", "disk", 1.5),
            ("count", "b-v2", "disk", 1.0), ("sum", "b-v1", "host", 0.03), ("count", "b-v1", "host", 3.0),
            ("sum", "b-v2", "host", 0.0), ("count", "b-v2", "host", 0.0)]
    text = "".join(f'deltafleet:delta_load_seconds_{k}{{model_name="{m}",tier="{t}"}} {v}\n' for k, m, t, v in rows)
    out = bench.parse_load_seconds(text)
    assert out["disk"]["count"] == 2 and out["disk"]["mean_s"] == pytest.approx(1.0)
    assert out["host"]["count"] == 3 and out["host"]["mean_s"] == pytest.approx(0.01)
    assert out["host"]["per_model"] == {"b-v1": pytest.approx(0.01)}


def test_engine_step_stats_are_the_difference_of_two_scrapes():
    def text(decode, prefill, tokens):
        lines = [f"deltafleet:iteration_tokens_total_sum {tokens[0]}", f"deltafleet:iteration_tokens_total_count {tokens[1]}"]
        for kind, (n, s, launch) in (("decode", decode), ("prefill", prefill)):
            lines += [f'deltafleet:engine_step_seconds_count{{kind="{kind}"}} {n}',
                      f'deltafleet:engine_step_seconds_sum{{kind="{kind}"}} {s}',
                      f'deltafleet:engine_step_launch_seconds_sum{{kind="{kind}"}} {launch}',
                      f'deltafleet:engine_step_seconds_bucket{{kind="{kind}",le="0.01"}} {n}']
        return "\n".join(lines) + "\n"

    before = text((10, 0.1, 0.01), (2, 0.1, 0.02), (100, 12))
    after = text((30, 0.5, 0.11), (2, 0.1, 0.02), (1100, 32))
    out = bench.step_stats(before, after)
    assert set(out) == {"decode", "mean_tokens"}  # no prefill step in between, no late planning
    waited = "deltafleet:late_planning_wait_seconds_total {}\n"
    assert "late_planning_wait_s" not in bench.step_stats(before + waited.format(0.0), after + waited.format(0.0))
    late = bench.step_stats(before + waited.format(0.5), after + waited.format(0.75))
    assert late["late_planning_wait_s"] == pytest.approx(0.25)
    assert out["decode"]["steps"] == 20 and out["decode"]["mean_s"] == pytest.approx(0.02)
    assert out["decode"]["mean_launch_s"] == pytest.approx(0.005) and out["decode"]["launch_share"] == pytest.approx(0.25)
    assert out["mean_tokens"] == pytest.approx(50.0)
    assert bench.step_stats("", "") == {}


def test_the_servers_ttft_is_the_difference_of_two_scrapes_over_every_model():
    def text(ttft: dict, queue: dict) -> str:
        lines = []
        for name, per in (("time_to_first_token_seconds", ttft), ("request_queue_time_seconds", queue)):
            for model, (n, total) in per.items():
                lines += [f'deltafleet:{name}_count{{model_name="{model}"}} {n}',
                          f'deltafleet:{name}_sum{{model_name="{model}"}} {total}',
                          f'deltafleet:{name}_bucket{{le="0.1",model_name="{model}"}} {n}']
        return "\n".join(lines) + "\n"

    before = text({"b": (2, 0.2), "b-v00": (1, 0.5)}, {"b": (2, 0.02), "b-v00": (1, 0.1)})
    after = text({"b": (5, 0.5), "b-v00": (2, 0.7), "b-v01": (2, 0.4)},
                 {"b": (5, 0.05), "b-v00": (2, 0.13), "b-v01": (2, 0.08)})
    out = bench.server_ttft(before, after)  # 3 + 1 + 2 first tokens since: 0.3 + 0.2 + 0.4 s, queued 0.14 s
    assert out == {"requests": 6, "ttft_mean_s": pytest.approx(0.9 / 6), "queue_mean_s": pytest.approx(0.14 / 6)}
    assert bench.server_ttft(after, after) == {} and bench.server_ttft("", "") == {}


def test_engine_steps_hook(monkeypatch, tmp_path):
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}"])
    monkeypatch.setitem(sys.modules, "deltafleet.serve.bench_step", None)  # the module missing: recorded
    assert bench.run_engine_steps(cfg)["error"].startswith(("ImportError", "ModuleNotFoundError"))
    seen = []
    fake = types.ModuleType("deltafleet.serve.bench_step")
    fake.engine_steps = lambda c: seen.append(c) or {"step_over_floor": {"16": {"base": 1.1, "mixed": 1.2}}, "n": 3}
    monkeypatch.setitem(sys.modules, "deltafleet.serve.bench_step", fake)
    assert bench.run_engine_steps(cfg) == {"step_over_floor": {"16": {"base": 1.1, "mixed": 1.2}}, "n": 3}
    assert seen == [cfg]  # called with the benchmark's own config
    fake.engine_steps = lambda c: 1 / 0
    out = bench.run_engine_steps(cfg)
    assert out["error"] == "ZeroDivisionError: division by zero" and "Traceback" in out["traceback"]
    cfg.engine_steps = False
    assert bench.run_engine_steps(cfg) is None


def test_a_run_stopped_midway_keeps_what_it_measured(monkeypatch, tmp_path):
    """Each phase rewrites ``<report_name>.partial.json``: a run stopped after its first load leaves the
    engine steps and that load there, and no report."""
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY, "report_name=stopped"])
    monkeypatch.setattr(bench, "run_engine_steps", lambda c: {"step_over_floor": {"16": {"base": 1.4, "mixed": 3.0}}})
    monkeypatch.setattr(bench, "build_tokenizer", lambda c: tmp_path / "tok")

    def stopped(cfg, report, family, out_dir, vocab, loads, checkpoint, done):
        report["loads"] = {"1": {"base": {"tokens_per_s": 12.5}}}
        checkpoint("loads at 1")
        raise KeyboardInterrupt  # the device call's time limit

    monkeypatch.setattr(bench, "serve_and_load", stopped)
    with pytest.raises(KeyboardInterrupt):
        bench.main(cfg)
    reports = Path(cfg.paths.reports_dir)
    d = json.loads((reports / "stopped.partial.json").read_text())
    assert d["phases_done"] == ["engine steps", "loads at 1"]
    assert d["engine_steps"]["step_over_floor"]["16"]["base"] == 1.4 and d["loads"]["1"]["base"]["tokens_per_s"] == 12.5
    assert not (reports / "stopped.json").exists()
    with pytest.raises(KeyboardInterrupt):  # a whole run again: the earlier partial report is moved aside
        bench.main(cfg)
    assert json.loads((reports / "stopped.partial.json.prev").read_text()) == d


def test_resume_refuses_a_partial_report_measured_otherwise(tmp_path):
    """``resumed_report`` goes on only from the same configuration (where files go and the pacing
    aside) and the same commit, and names what differs."""
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY])
    config = bench.OmegaConf.to_container(cfg, resolve=True)
    first = {"date": "2026-12-05", "machine": {"name": "a"}, "commit": "abc", "config": config,
             "phases_done": ["engine steps", "loads at 1"], "loads": {"1": {"base": {"tokens_per_s": 3.0}}}}
    partial = tmp_path / "r.partial.json"
    partial.write_text(json.dumps(first))
    moved = {**config, "paths": {**config["paths"], "reports_dir": "/elsewhere"}, "stop_after_s": 100, "resume": True}
    again = {"date": "2026-12-06", "machine": {"name": "b"}, "commit": "abc", "config": moved}
    out = bench.resumed_report(partial, again)
    assert out["loads"] == first["loads"] and out["phases_done"] == first["phases_done"]
    assert out["date"] == "2026-12-05" and out["machine"] == {"name": "a"}  # the first start's
    assert out["resumed"] == [{"date": "2026-12-06", "machine": {"name": "b"}, "after": ["engine steps", "loads at 1"]}]
    with pytest.raises(ValueError, match=r"other values of \['seed', 'variants'\]"):
        bench.resumed_report(partial, {**again, "config": {**moved, "seed": 1, "variants": 4}})
    with pytest.raises(ValueError, match="measured at commit abc, this checkout is def"):
        bench.resumed_report(partial, {**again, "commit": "def"})
    assert bench.resumed_report(partial, {**again, "commit": None})["phases_done"] == first["phases_done"]
    h200, h100 = {"name": "a", "device": "NVIDIA H200", "gpus": 1}, {"name": "b", "device": "NVIDIA H100", "gpus": 1}
    partial.write_text(json.dumps({**first, "machine": h200}))
    with pytest.raises(ValueError, match=r"measured on \{'device': 'NVIDIA H200', 'gpus': 1\}, this machine is "
                                         r"\{'device': 'NVIDIA H100', 'gpus': 1\}"):
        bench.resumed_report(partial, {**again, "machine": h100})
    failed = {**first, "engine_steps": {"error": "RuntimeError: out of memory"}}
    partial.write_text(json.dumps(failed))  # a failed phase stays done: its error is the result
    assert bench.resumed_report(partial, again)["phases_done"] == ["engine steps", "loads at 1"]
    for bad in ({"config": config}, {**first, "config": None}):
        partial.write_text(json.dumps(bad))
        with pytest.raises(bench.SettingError, match="not a partial report"):
            bench.resumed_report(partial, again)
    partial.write_text("{")
    with pytest.raises(ValueError, match="cannot resume from"):
        bench.resumed_report(partial, again)


# --------------------------------------------------------------------------------------------
# The peers: transformers on a tiny model
# --------------------------------------------------------------------------------------------


def test_the_transformers_peers_count_only_the_requested_tokens(tmp_path):
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY])
    reqs = [([5 + i] * (3 + 4 * i), n) for i, n in enumerate([3, 9, 5, 12, 2])]
    out = bench.run_peers(cfg, reqs, 4)
    assert out["requests"] == 5 and out["requested_tokens"] == 31 and out["transformers"]
    cb, st = out["hf_continuous_batching"], out["hf_static"]
    assert "error" not in cb, cb.get("traceback")
    assert "error" not in st, st.get("traceback")
    assert cb["api"] == "manager" and cb["failed"] == cb["short"] == 0
    assert cb["counted_tokens"] == cb["generated_tokens"] == 31  # each request exactly its own length
    assert cb["tokens_per_s"] == pytest.approx(31 / cb["wall_s"]) and cb["tokens_per_s"] > 0
    assert st["batches"] == 2 and st["counted_tokens"] == 31 and st["short"] == 0
    assert st["generated_tokens"] == 4 * 12 + 1 * 2  # each batch runs to its longest request
    assert st["max_cache_len"] == max(15 + 12, 19 + 2) and st["tokens_per_s"] > 0
    cfg.hf.cb_api = "generate_batch"
    cfg.hf.static_batch = 0  # a broken peer is recorded, not raised
    out = bench.run_peers(cfg, reqs, 4)
    cb = out["hf_continuous_batching"]
    assert "error" not in cb, cb.get("traceback")
    assert cb["api"] == "generate_batch" and cb["generated_tokens"] == 5 * 12 and cb["counted_tokens"] == 31
    assert out["hf_static"]["error"].startswith("ValueError") and out["hf_static"]["seconds_with_warmup"] >= 0


# --------------------------------------------------------------------------------------------
# Real runs through the server on loopback
# --------------------------------------------------------------------------------------------


def run_bench(args: list[str], tmp_path: Path, env: dict = ENV) -> dict:
    r = subprocess.run([sys.executable, "serve/bench.py", *args, f"paths.root={tmp_path}", "machine=test",
                        f"hydra.run.dir={tmp_path / 'run'}"], check=False, cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    log = tmp_path / "run" / "server.log"
    assert r.returncode == 0, r.stderr[-3000:] + (log.read_text()[-3000:] if log.is_file() else "")
    reports = list((tmp_path / "reports").glob("bench-serve-*-test-tiny-*.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".png").stat().st_size > 10_000
    d = json.loads(reports[0].read_text())
    assert json.loads(r.stdout[r.stdout.index("{\n"):r.stdout.index("\n}\n") + 2]) == d["summary"]  # printed
    return d


def check_load(stats: dict, requests: list, models: list[str]) -> None:
    """Every request answered with exactly its tokens; the figures those of ``requests`` sent to ``models``."""
    n = len(requests)
    assert stats["requests"] == stats["answered"] == n and stats["all_answered"] and stats["errors"] == []
    assert stats["status_codes"] == {"200": n} and stats["no_5xx"] and stats["token_mismatches"] == 0
    assert stats["completion_tokens"] == stats["requested_tokens"] == sum(k for _, k in requests)
    assert stats["prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert stats["tokens_per_s"] == pytest.approx(stats["completion_tokens"] / stats["wall_s"]) and stats["wall_s"] > 0
    assert {m: v["requests"] for m, v in stats["per_model"].items()} == dict(Counter(models))
    assert 0 < stats["ttft_p50_s"] <= stats["ttft_p99_s"] < stats["wall_s"] + 1e-9


def test_a_cpu_run_of_a_built_family_through_the_real_server(tmp_path):
    args = [*TINY, "synthetic=false", "extra_for_host_tier=1", "engine_steps=false", "port=8139",
            f"family_dir={tmp_path / 'fam'}"]
    # a proxy in the environment is not used (found by a fresh user: the loopback traffic went through it)
    dead = "http://127.0.0.1:9"  # nothing listens: a request sent there fails
    d = run_bench(args, tmp_path, {**ENV, **{k: dead for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")},
                                   "NO_PROXY": "", "no_proxy": ""})
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *args])
    s = d["summary"]
    assert set(s) == {"step_over_floor", "tokens_per_s", "ttft_p50_s", "machine", "commit"}
    assert s["step_over_floor"] == {k: {"base": None, "mixed": None} for k in ("16", "64", "256")}  # not run
    assert d["engine_steps"] is None
    assert all(isinstance(v, float) and v > 0 for v in s["tokens_per_s"].values()), s
    assert all(isinstance(v, float) and 0 < v < 60 for v in s["ttft_p50_s"].values()), s
    assert s["machine"].startswith("test: ")
    head = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=REPO, capture_output=True, text=True)
    assert s["commit"] == (head.stdout.strip() if head.returncode == 0 else None)

    ranked = ["bench", "bench-v00", "bench-v01", "bench-v02"]
    assert d["server"]["variant_ids"] == ranked[1:] and d["warmup"]["all_variants_answered"]
    assert d["server"]["overrides"][-3:] == ["max_batch=4", "max_num_batched_tokens=1024", "max_waiting=null"]
    assert d["server"]["client_processes"] == 2  # two client processes shared the load
    assert (d["server"]["event_loop"], d["server"]["http_parser"]) == ("uvloop", "httptools")
    assert sorted(d["loads"]) == ["1", "4"]
    for c in (1, 4):
        reqs = bench.load_requests(cfg, c, 1024)  # the same requests, recomputed from the seed
        assert len(reqs) == {1: 4, 4: 8}[c]
        check_load(d["loads"][str(c)]["base"], reqs, ["bench"] * len(reqs))
        check_load(d["loads"][str(c)]["mixed"], reqs, zipf_models(ranked, len(reqs), 1.0, [0, bench._ZIPF, c]))
    assert s["tokens_per_s"]["base"] == d["loads"]["4"]["base"]["tokens_per_s"]
    ttft = bench.fixed_requests(8, 16, 8, 1024, [0, bench._TTFT, 0])
    check_load(d["ttft"]["base"], ttft, ["bench"] * 8)
    check_load(d["ttft"]["mixed"], ttft, zipf_models(ranked, 8, 1.0, [0, bench._TTFT_ZIPF, 0]))
    assert s["ttft_p50_s"] == {k: d["ttft"][k]["ttft_p50_s"] for k in ("base", "mixed")}
    burst = d["burst"]
    assert burst["prompt_tokens_each"] == 128 - 4 and burst["concurrency"] == 8
    check_load(burst, bench.fixed_requests(8, 124, 4, 1024, [0, bench._BURST, 0]),
               zipf_models(ranked, 8, 1.0, [0, bench._BURST, 1]))

    peers = d["peers"]
    assert peers["concurrency"] == 4 and peers["requested_tokens"] == d["loads"]["4"]["base"]["requested_tokens"]
    for name in ("hf_continuous_batching", "hf_static"):
        p = peers[name]
        assert "error" not in p, p.get("traceback")
        assert p["counted_tokens"] == p["requested_tokens"] == peers["requested_tokens"] and p["failed"] == 0
        assert s["tokens_per_s"][name] == p["tokens_per_s"]
    tps = s["tokens_per_s"]
    assert d["ratios"]["base_over_hf_static"] == pytest.approx(tps["base"] / tps["hf_static"])
    floor = bench.mixed_floor(cfg, bench.load_requests(cfg, 4, 1024), 4)
    assert d["decode_floor"] == floor and 0 < floor["mixed_over_base"] < 1
    assert d["ratios"]["mixed_over_base_at_decode_floor"] == floor["mixed_over_base"]
    g = d["goals"]
    assert g["burst answered, no 5xx"] is True and g["every request answered"] is True
    assert g["every completion max_tokens long"] is True and g["step_over_floor <= 1.3"] is None
    # not the issue's settings (64 clients; 16 clients of 128-token prompts): those goals are not evaluated
    issue = ("base >= 4x hf_continuous_batching", "base >= 2x hf_static", "mixed/base >= 0.85", "ttft_p50 <= 0.1 s",
             "variant/base ttft <= 1.05")
    assert all(g[k] is None for k in issue)
    # (on this CPU every step of a load may carry a prompt chunk: no decode-only step to compare)
    assert all(isinstance(v, bool) for k, v in g.items()
               if k not in (*issue, "step_over_floor <= 1.3", "structured decode step <= 1.05x"))
    srv = d["ttft"]["mixed"]["server_ttft"]  # the server saw each request's first token, sooner than its client
    assert srv["requests"] == 8 and 0 < srv["queue_mean_s"] < srv["ttft_mean_s"] < d["ttft"]["mixed"]["ttft_mean_s"]
    structured = d["loads"]["4"]["structured"]  # the base load again, each request held to the grammar
    check_load(structured, bench.load_requests(cfg, 4, 1024), ["bench"] * 8)
    assert structured["engine_steps"]["mean_tokens"] > 0 and d["loads"]["4"]["base"]["engine_steps"]["mean_tokens"] > 0

    assert d["host_tier"]["evicted_to_host"] and d["host_tier"]["requests"]["all_answered"]
    loads = d["cold_load_seconds_by_tier"]
    assert loads["disk"]["count"] == 4  # the three variants + the hot-loaded extra
    assert loads["host"]["count"] == len(d["host_tier"]["evicted_to_host"]) == 1
    assert d["memory"]["server_rss_bytes"] > 0
    assert (tmp_path / "run" / "server.log").is_file() and not (REPO / "server.log").exists()  # the run's folder
    assert "phases_done" not in d and not list((tmp_path / "reports").glob("*.partial.json"))  # complete: no partial


def test_the_70b_config_on_cpu_with_a_tiny_synthetic_family(tmp_path):
    """``--config-name bench_serve_70b`` shrunk to the tiny shape: the server (2 gloo ranks) generates the
    family; its loads, TTFT setting and burst are answered; no engine steps, no peers."""
    d = run_bench(["--config-name", "bench_serve_70b", "shape=tiny", "device=cpu", "dtype=float32", "variants=3",
                   "shapes.tiny.intermediate_size=352",  # 344 / 2 ranks is not a whole number of sign bytes
                   "max_position_embeddings=64", "concurrency=[2]", "summary_concurrency=2",
                   "lengths={prompt_median:8,output_median:4,min:2,max:32}", "requests={min:4,per_concurrency:2,max:4}",
                   "ttft={concurrency:2,requests:4,prompt_tokens:8,max_tokens:4}", "burst={requests:4,max_tokens:2}",
                   "client_processes=1", "warmup={max_tokens:2}", "port=8141"], tmp_path)
    assert not (tmp_path / "outputs" / "bench" / "serve-synthetic-tiny" / "base").exists()  # only a tokenizer
    assert d["server"]["models"] == [{"id": "bench", "parent": None}] + [
        {"id": f"bench-v0{i}", "parent": "bench"} for i in range(3)]
    assert d["config"]["tp"] == 2 and d["synthetic"]["variants"] == 3 and d["server"]["startup_s"] > 0
    assert d["engine_steps"] is None and d["peers"] is None and d["warmup"]["all_variants_answered"]
    for stats in [*d["loads"]["2"].values(), *d["ttft"].values(), d["burst"]]:
        assert stats["all_answered"] and stats["token_mismatches"] == 0 and stats["completion_tokens"] > 0
    assert d["burst"]["prompt_tokens_each"] == 62 and d["goals"]["burst answered, no 5xx"] is True
    s = d["summary"]
    assert s["tokens_per_s"]["base"] > 0 and s["tokens_per_s"]["hf_static"] is None
    tiers = {m: v["tier"] for m, v in d["delta_cache"]["variants"].items()}
    assert tiers == {f"bench-v0{i}": "device" for i in range(3)}
    assert d["host_tier"] == {"evicted_to_host": [], "requests": None}
    pred = d["memory"]["predicted_bytes_per_rank"]
    assert len(pred) == 2 and pred[0]["base_bytes"] == 4 * pred[0]["params"]  # float32
    # the config's max_batch full contexts (the CPU's default), each in one 128-token block
    assert pred[0]["kv_cache_tokens"] == 16 * 128
    assert pred[0]["kv_cache_bytes"] == 2 * 2 * 1 * 32 * 4 * 16 * 128  # K, V · 2 layers · 1 of 2 KV heads · 32 dims


@pytest.mark.parametrize("override, message", [
    ("peers=no", "peers must be true or false, got 'no'"),
    ("engine_steps=off", "engine_steps must be true or false, got 'off'"),
    ("structured.enabled=maybe", "structured.enabled must be true or false, got 'maybe'"),
    ("concurrency=[4,0]", "concurrency[1] must be a whole number ≥ 1, got 0"),
    ("ttft.requests=0", "ttft.requests must be a whole number ≥ 1, got 0"),
    ("burst.requests=0", "burst.requests must be a whole number ≥ 1, got 0"),
    ("requests.max=0", "requests.max must be a whole number ≥ 1, got 0"),
    ("client_processes=0", "client_processes must be a whole number ≥ 1, got 0"),
    ("variants=-2", "variants must be a whole number ≥ 1, got -2"),
    ("port=99999", "port must be a port number from 1 to 65535, got 99999"),
    ("port=abc", "port must be a port number from 1 to 65535, got 'abc'"),
    ("shape=nosuch", "shape must be one of ['llama2-7b', 'tiny'] (or a new entry under shapes), got 'nosuch'"),
    ("dtype=float64x", "dtype must be one of bfloat16, float16, float32, got 'float64x'"),
    ("lengths.sigma=-1", "lengths.sigma must be a number > 0, got -1"),
    ("startup_timeout_s=0", "startup_timeout_s must be a number > 0, got 0"),
    ("zipf_s=-1", "zipf_s must be a number ≥ 0, got -1"),
    ("warmup.max_tokens=0", "warmup.max_tokens must be a whole number ≥ 1, got 0"),
    ("extra_for_host_tier=-1", "extra_for_host_tier must be a whole number ≥ 0, got -1"),
    ("requests.max=3", "requests: the load at concurrency 4 has 3 requests, fewer than its clients: raise "
                       "requests.max (or min)"),
    ("ttft.requests=2", "ttft: 2 requests for 4 clients: the load would run below its concurrency"),
    ("max_position_embeddings=3", "max_position_embeddings: a context of 3 cannot hold a prompt and an output of "
                                  "lengths.min (2) tokens each"),
    ("shapes.tiny.hidden_size=0", "shapes.tiny.hidden_size must be a whole number ≥ 1, got 0"),
    ("shapes.tiny.num_attention_heads=3", "shapes.tiny: hidden_size 128 must be num_attention_heads 3 × an even head "
                                          "size, and num_attention_heads a multiple of num_key_value_heads 2"),
    ("report_name=", "report_name must be a file name (no folder) for reports/<report_name>.json, got ''"),
    ("report_name=/tmp/x/y", "report_name must be a file name (no folder) for reports/<report_name>.json, "
                             "got '/tmp/x/y'"),
    # found by a reviewer: these passed the checks and failed only after the engine steps (a seed the
    # workload's generators refuse), or as a traceback (a count that is not a number)
    ("seed=-1", "seed must be a whole number ≥ 0, got -1"),
    ("tp=0", "tp must be a whole number ≥ 1, got 0"),
    ("ttft.max_tokens=abc", "ttft.max_tokens must be a whole number ≥ 1, got 'abc'"),
    ("ttft.prompt_tokens=1.5", "ttft.prompt_tokens must be a whole number ≥ 1, got 1.5"),
    ("burst.max_tokens=true", "burst.max_tokens must be a whole number ≥ 1, got True"),
    ("burst.prompt_tokens=abc", "burst.prompt_tokens must be null or a whole number ≥ 1, got 'abc'"),
    # the warm-up's requests were sent uncut and refused by the server
    ("warmup.max_tokens=127", "warmup: 2 prompt + 127 new tokens do not fit a context of 128"),
])
def test_a_bad_setting_is_refused_by_name_before_any_work(tmp_path, override, message):
    """Found by a fresh user: ``peers=no`` ran the peers (text, to Hydra), a load of no requests met
    its goals with nothing sent, ``report_name`` wrote outside reports/, and the rest were tracebacks."""
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY, override])
    with pytest.raises(bench.SettingError) as e:
        bench.main(cfg)
    assert str(e.value) == message
    assert not (tmp_path / "reports").exists()


def test_a_server_setting_the_server_does_not_have_is_refused_first(tmp_path):
    """Found by a fresh user: ``+server.bogus=1`` was forwarded as ``bogus=1``, and the server's Hydra
    refused it after the family was built, as "the server exited with 1"."""
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY, "+server.bogus=1"])
    with pytest.raises(bench.SettingError, match=r"^server\.bogus is not a setting of conf/serve\.yaml \(the "
                                                 r"server's\); its settings: .*\bmax_batch\b"):
        bench.main(cfg)
    assert not (tmp_path / "reports").exists()


def test_a_server_that_refuses_its_settings_is_named_with_its_error(tmp_path):
    """The server's own checks (``device``, ``server.*``) stop it with exit status 2 and one line; the
    benchmark's error carries that line, not only "see server.log"."""
    cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY, "server={max_batch:0}", "port=8140"])
    (tmp_path / "fam").mkdir()
    with pytest.raises(bench.ServerStartError, match=r"^the server exited with 2: error: max_batch must be .*; see "):
        bench.Server(cfg, tmp_path / "fam", tmp_path / "server.log")


def test_the_pacing_flags_of_a_run_are_checked_first(tmp_path):
    for override, message in (("resume=no", "resume must be true or false, got 'no'"),
                               ("stop_after_s=abc", "stop_after_s must be null or a number of seconds ≥ 0, got 'abc'")):
        cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY, override])
        with pytest.raises(ValueError, match=f"^{message}$"):
            bench.main(cfg)
    assert not (tmp_path / "reports").exists()  # nothing measured, nothing written


def test_the_server_is_not_started_on_a_port_in_use_nor_left_when_its_start_is_stopped(tmp_path, monkeypatch):
    """Found by a fresh user: with the port taken, the benchmark measured whatever answered /health
    there; and a Ctrl-C while the server started left it running (its own session)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = compose_cfg(overrides=[f"paths.root={tmp_path}", *TINY, f"port={port}"])
        started = []
        monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: started.append(a))
        with pytest.raises(RuntimeError, match=rf"^port {port} on 127\.0\.0\.1 is in use .*choose another port=N$"):
            bench.Server(cfg, tmp_path / "fam", tmp_path / "server.log")
        assert started == []
    monkeypatch.undo()
    procs = []
    real_popen = bench.subprocess.Popen
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: procs.append(real_popen(*a, **k)) or procs[-1])
    import httpx

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(httpx, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.Server(cfg, tmp_path / "fam", tmp_path / "server.log")
    assert len(procs) == 1 and procs[0].poll() is not None  # stopped with the wait


def test_a_bad_setting_of_a_run_is_one_line_and_exit_status_2(tmp_path):
    r = subprocess.run([sys.executable, "serve/bench.py", *TINY, "resume=maybe", f"paths.root={tmp_path}",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: resume must be true or false, got 'maybe'"
    assert "Traceback" not in r.stderr


def test_a_run_stopped_for_time_goes_on_where_it_stopped(tmp_path):
    """``stop_after_s=0`` stops a run after each phase (exit status 3, the partial report kept);
    ``resume=true`` measures only what it lacks, and the last call writes the whole report."""
    args = [*TINY, "engine_steps=false", "peers=false", "structured.enabled=false", "concurrency=[4]",
            "port=8143", "report_name=resumed", f"paths.root={tmp_path}", "machine=test",
            f"hydra.run.dir={tmp_path / 'run'}"]
    partial, final = tmp_path / "reports" / "resumed.partial.json", tmp_path / "reports" / "resumed.json"

    def call(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "serve/bench.py", *args, *extra], check=False, cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=600)

    r = call("stop_after_s=0")
    assert r.returncode == bench.STOPPED_EXIT, r.stderr[-3000:]
    assert "stopped after 'engine steps'" in r.stdout and "resume=true" in r.stdout
    assert json.loads(partial.read_text())["phases_done"] == ["engine steps"] and not final.exists()
    r = call("stop_after_s=0", "resume=true")
    assert r.returncode == bench.STOPPED_EXIT, r.stderr[-3000:]
    mid = json.loads(partial.read_text())
    assert mid["phases_done"] == ["engine steps", "loads at 4"] and "ttft" not in mid
    r = call("resume=true")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(final.read_text())
    assert not partial.exists() and "phases_done" not in d
    assert d["loads"] == mid["loads"]  # measured once, in the second call
    check_load(d["ttft"]["base"], bench.fixed_requests(8, 16, 8, 1024, [0, bench._TTFT, 0]), ["bench"] * 8)
    assert d["burst"]["all_answered"] and d["summary"]["tokens_per_s"]["base"] == d["loads"]["4"]["base"]["tokens_per_s"]
    assert [x["after"] for x in d["resumed"]] == [["engine steps"], ["engine steps", "loads at 4"]]
    assert list(d["phase_gpus"]) == ["engine steps", "loads at 4", "ttft", "burst"]  # no GPU here: None each
    assert set(d["phase_gpus"].values()) == {None}


def test_the_report_names_the_commit_it_is_told_before_the_checkouts(monkeypatch):
    """A copy of the code whose git metadata is stale (a device's copy) names its commit through
    DELTAFLEET_COMMIT; without it, the checkout's HEAD."""
    from deltafleet.serve import bench

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench.REPO, capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("DELTAFLEET_COMMIT", raising=False)
    assert bench.git_commit() == (head or None)
    monkeypatch.setenv("DELTAFLEET_COMMIT", "6977b21")
    assert bench.git_commit() == "6977b21"


@pytest.mark.gpu
def test_engine_steps_time_a_step_beside_each_prompt_length():
    """``engine_steps`` on a tiny synthetic family: every row count and mix gets a step for each of
    ``prompts`` (keyed by length), the eager prompt step of the first length, and a floor."""
    from deltafleet.serve.bench_step import engine_steps

    tiny = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2}
    out = engine_steps({"device": "cuda", "dtype": "bfloat16", "shape_config": tiny, "variants": 3,
                        "engine_steps_options": {"rows": [2, 16], "context": 40, "iters": 2, "prompts": [8, 300],
                                                 "profile": 2}})
    assert [(r["rows"], r["mix"]) for r in out["rows"]] == [(2, "base"), (2, "mixed"), (16, "base"), (16, "mixed")]
    for r in out["rows"]:
        assert set(r["with_prompt_step_ms"]) == {"8", "300"} and all(v > 0 for v in r["with_prompt_step_ms"].values())
        assert r["with_prompt_ms"] > 0 and r["floor_ms"] > 0
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        kernels = r["profile"]["kernels"]  # each layer's GEMMs at least: several launches of one kernel a step
        assert kernels and max(k["calls"] for k in kernels) >= 2 and 0 < r["profile"]["kernel_ms"]
        assert sum(k["ms"] for k in kernels) <= r["profile"]["kernel_ms"] + 1e-9


def test_a_step_profile_sums_each_kernel_per_step():
    """``kernel_table``: each kernel's time and launches a step (names cut at 120 characters, the cut
    names pooled), the longest first, only the ``top`` ones listed while the step's kernel time counts
    them all."""
    from deltafleet.serve.bench_step import kernel_table

    long = "gemm_" + "x" * 130
    events = [("norm", 10.0), (long + "a", 300.0), ("norm", 12.0), ("attn", 150.0), (long + "b", 298.0),
              ("rope", 4.0)]
    t = kernel_table(events, steps=2, top=3)
    assert t["kernel_ms"] == pytest.approx((10 + 300 + 12 + 150 + 298 + 4) / 2 / 1e3)
    assert [(k["name"], k["calls"]) for k in t["kernels"]] == [(long[:120], 1.0), ("attn", 0.5), ("norm", 1.0)]
    assert [k["ms"] for k in t["kernels"]] == pytest.approx([0.299, 0.075, 0.011])


def test_the_engine_step_command_refuses_what_it_cannot_run(capsys):
    """Counts below one, and (on a machine without CUDA) the run itself: exit status 2, one line."""
    import torch

    from deltafleet.serve import bench_step

    with pytest.raises(SystemExit) as e:
        bench_step.main(["--rows", "16", "--prompts", "128", "0"])
    assert e.value.code == 2 and "error: --prompts must be ≥ 1, got [128, 0]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_step.main(["--rows", "16", "--profile", "-1"])
    assert e.value.code == 2 and "error: --profile must be ≥ 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # found by a fresh user: never checked
        bench_step.main(["--rows", "16", "--context", "-5"])
    assert e.value.code == 2 and "error: --context must be ≥ 0, got -5" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as e:
        bench_step.main(["--rows", "16"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: the engine-step benchmark needs a CUDA device (the floor is a GPU's bandwidth)\n"
