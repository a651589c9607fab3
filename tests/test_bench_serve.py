"""The serving benchmark (serve/bench.py): its arithmetic on hand-made numbers, and a real CPU run
(the tiny shape, 3 variants) through the server on loopback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltafleet.serve.bench import parse_load_seconds, summarize

REPO = Path(__file__).resolve().parents[1]


def test_load_seconds_are_read_per_tier_from_metrics():
    text = "\n".join([
        'deltafleet:delta_load_seconds_sum{model_name="b-v1",tier="disk"} 0.5',
        'deltafleet:delta_load_seconds_count{model_name="b-v1",tier="disk"} 1.0',
        'deltafleet:delta_load_seconds_sum{model_name="b-v2",tier="disk"} 1.5',
        'deltafleet:delta_load_seconds_count{model_name="b-v2",tier="disk"} 1.0',
        'deltafleet:delta_load_seconds_sum{model_name="b-v1",tier="host"} 0.03',
        'deltafleet:delta_load_seconds_count{model_name="b-v1",tier="host"} 3.0',
        'deltafleet:delta_load_seconds_sum{model_name="b-v2",tier="host"} 0.0',
        'deltafleet:delta_load_seconds_count{model_name="b-v2",tier="host"} 0.0',
    ])
    out = parse_load_seconds(text)
    assert out["disk"]["count"] == 2 and out["disk"]["mean_s"] == pytest.approx(1.0)
    assert out["host"]["count"] == 3 and out["host"]["mean_s"] == pytest.approx(0.01)
    assert out["host"]["per_model"] == {"b-v1": pytest.approx(0.01)}


def test_summary_ratios():
    pm = lambda t, i: {"ttft_p50_s": t, "itl_p50_s": i, "ttft_p99_s": t, "itl_p99_s": i, "requests": 1}  # noqa: E731
    report = {"base_id": "b", "phases": {
        "base_only": {"tokens_per_s": 200.0, "per_model": {"b": pm(0.1, 0.02)}},
        "mixed": {"tokens_per_s": 150.0, "per_model": {"b": pm(0.2, 0.04), "b-v1": pm(0.21, 0.04),
                                                       "b-v2": pm(0.25, 0.05), "b-v3": pm(0.22, 0.041)}}}}
    s = summarize(report)
    assert s["throughput_mixed_over_base_only"] == pytest.approx(0.75)
    assert s["variant_over_base_ttft_p50"] == pytest.approx(0.22 / 0.2)  # median of the variants' P50s
    assert s["variant_over_base_itl_p50"] == pytest.approx(0.041 / 0.04)
    assert s["variant_mixed_over_base_only_itl_p50"] == pytest.approx(0.041 / 0.02)
    assert s["targets"] == {"variant_over_base_ttft_p50 <= 1.05": False, "variant_over_base_itl_p50 <= 1.08": True,
                            "throughput_mixed_over_base_only >= 0.6": True}


def test_a_cpu_run_through_the_real_server(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "serve/bench.py", "shape=tiny", "device=cpu", "dtype=float32", "variants=3",
            "requests=8", "concurrency=4", "prompt_tokens=16", "max_tokens=8", "max_batch=4",
            "extra_for_host_tier=1", "max_position_embeddings=128", f"family_dir={tmp_path / 'fam'}",
            f"paths.root={tmp_path}", "port=8139", "machine=test", f"hydra.run.dir={tmp_path / 'run'}"]
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reports = list((tmp_path / "reports").glob("bench-serve-*-test-tiny-3v.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".png").is_file()
    d = json.loads(reports[0].read_text())
    assert d["base_id"] == "bench" and d["variant_ids"] == ["bench-v00", "bench-v01", "bench-v02"]
    for phase in ("base_only", "mixed"):
        p = d["phases"][phase]
        assert p["errors"] == [] and p["completion_tokens"] == 8 * 8  # every request ran to max_tokens
        assert p["tokens_per_s"] == pytest.approx(p["completion_tokens"] / p["wall_s"])
    assert set(d["phases"]["base_only"]["per_model"]) == {"bench"}
    assert sum(v["requests"] for v in d["phases"]["mixed"]["per_model"].values()) == 8
    loads = d["cold_load_seconds_by_tier"]
    assert loads["disk"]["count"] == 4  # the three variants + the hot-loaded extra
    assert loads["host"]["count"] == len(d["evicted_to_host"]) == 1
    again = summarize(d)
    assert d["summary"]["targets"] == again["targets"]
    for k, v in again.items():
        if k != "targets":
            assert d["summary"][k] == pytest.approx(v, rel=1e-12), k
    assert d["memory"]["server_rss_bytes"] > 0
    assert (tmp_path / "run" / "server.log").is_file() and not (REPO / "server.log").exists()  # the run's folder


def test_the_70b_benchmark_path_on_cpu_with_a_tiny_synthetic_family(tmp_path):
    """``--config-name bench_serve_70b`` shrunk to the tiny shape: the server (2 gloo ranks) generates the
    family, every variant answers in the balanced mixed load, memory is predicted per rank."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    args = [sys.executable, "serve/bench.py", "--config-name", "bench_serve_70b", "shape=tiny", "device=cpu",
            "shapes.tiny.intermediate_size=352",  # 344 / 2 ranks is not a whole number of sign bytes
            "dtype=float32", "variants=3", "requests=8", "concurrency=4", "prompt_tokens=16", "max_tokens=8",
            "max_batch=4", "max_position_embeddings=128", f"paths.root={tmp_path}", "port=8141", "machine=test",
            f"hydra.run.dir={tmp_path / 'run'}"]
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + (tmp_path / "run" / "server.log").read_text()[-3000:]
    reports = list((tmp_path / "reports").glob("bench-serve-*-test-tiny-synthetic-tp2-3v.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".png").is_file()
    d = json.loads(reports[0].read_text())
    assert not (tmp_path / "outputs" / "bench" / "serve-synthetic-tiny" / "base").exists()  # only a tokenizer
    assert d["models"] == [{"id": "bench", "parent": None}] + [{"id": f"bench-v0{i}", "parent": "bench"} for i in range(3)]
    mixed = d["phases"]["mixed"]
    assert mixed["errors"] == [] and mixed["completion_tokens"] == 8 * 8
    assert d["answered_mixed"] == {"bench": 2, "bench-v00": 2, "bench-v01": 2, "bench-v02": 2}  # balanced: 8 over 4
    assert d["all_variants_answered"] is True
    assert {m: v["tier"] for m, v in d["delta_cache"]["variants"].items()} == {f"bench-v0{i}": "device" for i in range(3)}
    assert d["startup_s"] > 0 and d["synthetic"]["variants"] == 3 and d["config"]["tp"] == 2
    pred = d["memory"]["predicted_bytes_per_rank"]
    assert len(pred) == 2 and pred[0]["base_bytes"] == 4 * pred[0]["params"]  # float32
    assert pred[0]["kv_cache_bytes"] == 2 * 2 * 4 * 1 * 128 * 32 * 4  # K, V · 2 layers · 4 rows · 1 of 2 KV heads
