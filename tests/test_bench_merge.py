"""The merge memory benchmark (merge/bench.py) end to end on a small shape: it generates its
inputs, merges each method in a child process and reports peak RSS next to the checkpoint size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_merge_small(tmp_path):
    r = subprocess.run([sys.executable, "merge/bench.py", "shape.num_hidden_layers=1", "shape.hidden_size=128",
                        "shape.intermediate_size=344", "shape.vocab_size=512", "shape.num_attention_heads=4",
                        "shape.num_key_value_heads=4", "shape.name=t", f"paths.root={tmp_path}", "machine=test",
                        f"hydra.run.dir={tmp_path / 'h'}", "keep_inputs=false"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(next((tmp_path / "reports").glob("bench-merge-*-test-t-1L.json")).read_text())
    assert [x["method"] for x in rep["runs"]] == ["linear", "ties", "dare_ties"]
    for x in rep["runs"]:
        assert "error" not in x and x["tensors"] > 0 and 0 < x["peak_rss_bytes"] < 4e9 and x["within_rss_limit"]
    assert rep["checkpoint_bytes"] > 0 and not (tmp_path / "outputs" / "bench" / "merge-t-1L").exists()
    assert next((tmp_path / "reports").glob("*.png")).stat().st_size > 1000
