"""compress/bench.py and merge/bench.py refuse what would lose a user's files, check their settings
before any work (``error: ...``, exit status 2), regenerate cached inputs of another shape, and exit
with status 1 when a measured job failed. Found by a fresh user; run on tiny shapes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltafleet.compress.bench import generate_pair, llama_tensors

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"name": "tiny", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SHAPE_ARGS = [f"shape.{k}={v}" for k, v in SHAPE.items()]
# every benchmark's report_name: a file name under reports/ ({tmp}: the test's folder)
REPORT_NAME_CASES = [
    ("report_name=", "report_name must be a file name (no folder) for reports/<report_name>.json, got ''"),
    ("report_name={tmp}/x/y", "report_name must be a file name (no folder) for reports/<report_name>.json, "
                              "got '{tmp}/x/y'"),
]


def bench(script: str, args: list[str], root: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python <script> <shape> paths.root=<root> <args>``, Hydra's run folder under ``root/run``
    unless ``args`` sets it."""
    run_dir = [] if any(a.startswith("hydra.run.dir=") for a in args) else [f"hydra.run.dir={root / 'run'}"]
    return subprocess.run([sys.executable, str(REPO / script), *SHAPE_ARGS, f"paths.root={root}", "machine=test",
                           *run_dir, *args], cwd=cwd or root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                               "HF_DATASETS_OFFLINE": "1"})


def assert_refused(r: subprocess.CompletedProcess, error: str) -> None:
    """Exit status 2 and ``error: <error>`` as the one line on stderr (no traceback)."""
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [f"error: {error}"], r.stderr[-3000:]


def make_pair(pair_dir: Path, shape: dict, seed: int = 0) -> None:
    """A generated pair as the benchmarks cache it (compress's generator, in this process)."""
    generate_pair(pair_dir, shape, torch.bfloat16, 1e-3, seed, 2_000_000_000)


def corrupt(checkpoint: Path) -> None:
    """Cut a checkpoint's first shard short: every reader fails on it."""
    shard = sorted(checkpoint.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(1000)


# --------------------------------------------------------------------------------------------
# compress/bench.py
# --------------------------------------------------------------------------------------------


def test_compress_bench_keeps_a_work_dir_it_did_not_make(tmp_path):
    work = tmp_path / "D"
    (work / "naive").mkdir(parents=True)
    (work / "naive" / "important.txt").write_text("x\n")
    r = bench("compress/bench.py", ["naive=true", f"work_dir={work}", f"pair_dir={tmp_path / 'pair'}"], tmp_path)
    assert_refused(r, f"work_dir {work.resolve()} exists and holds files that are not an earlier benchmark's output "
                      f"(in naive/: files the benchmark did not write: important.txt): the benchmark replaces and "
                      f"deletes what it writes there; choose a new work_dir or one an earlier run made")
    assert (work / "naive" / "important.txt").read_text() == "x\n"
    # refused before any work: no pair generated, no report, no Hydra run folder
    assert [p.name for p in tmp_path.iterdir()] == ["D"]


def test_compress_bench_keeps_a_pair_dir_it_did_not_make(tmp_path):
    pair = tmp_path / "D"
    pair.mkdir()
    (pair / "notes.txt").write_text("mine")
    r = bench("compress/bench.py", ["naive=false", f"pair_dir={pair}", f"work_dir={tmp_path / 'work'}"], tmp_path)
    assert_refused(r, f"pair_dir {pair.resolve()} exists and holds files that are not an earlier benchmark's output "
                      f"(no readable pair.json; it holds notes.txt): the benchmark replaces and deletes what it "
                      f"writes there; choose a new pair_dir or one an earlier run made")
    assert [p.name for p in pair.iterdir()] == ["notes.txt"] and (pair / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["D"]


def test_compress_bench_never_writes_into_the_root_or_the_current_directory(tmp_path):
    from hydra import compose, initialize_config_dir

    from deltafleet.compress.bench import check_config

    # the root, checked in this process: a regression must not write /naive and /streaming
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[*SHAPE_ARGS, f"paths.root={tmp_path}", "work_dir=/",
                                                      f"pair_dir={tmp_path / 'pair'}"])
    with pytest.raises(ValueError, match=re.escape(f"work_dir / overlaps the input {(tmp_path / 'pair').resolve()}: "
                                                   f"the benchmark would replace or write into it")):
        check_config(cfg)
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    r = bench("compress/bench.py", ["naive=true", "work_dir=.", f"pair_dir={tmp_path / 'pair'}"], tmp_path, cwd=here)
    assert_refused(r, f"work_dir {here.resolve()} is the current directory or holds it: the benchmark replaces its "
                      f"whole work_dir (deleting what else is there); choose a new folder")
    assert [p.name for p in here.iterdir()] == ["notes.txt"] and not (tmp_path / "pair").exists()


@pytest.mark.parametrize("override, error", [
    ("naive=no", "naive must be true, false or auto, got 'no'"),
    ("naive=maybe", "naive must be true, false or auto, got 'maybe'"),
    ("keep_pair=no", "keep_pair must be true or false, got 'no'"),
    ("dtype=float8", "dtype must be one of float32, float16, bfloat16, got 'float8'"),
    ("shape.hidden_size=66", "shape.hidden_size 66 is not a multiple of shape.num_attention_heads 4"),
    ("shape.hidden_size=100", "shape.hidden_size 100 / shape.num_attention_heads 4 is 25: the head dimension must "
                              "be even (RoPE)"),
    ("shape.num_hidden_layers=0", "shape.num_hidden_layers must be a whole number, at least 1, got 0"),
    ("shape.num_hidden_layers=-1", "shape.num_hidden_layers must be a whole number, at least 1, got -1"),
    ("delta_std=-1", "delta_std must be a positive number, got -1"),
    ("granularity=foo", "granularity must be one of matrix, row (the naive path's), got 'foo'"),
    ("max_shard_bytes=0", "max_shard_bytes must be a whole number of bytes, at least 1 (or null: one shard), got 0"),
    ("pair_dir=/proc/x", "pair_dir /proc/x cannot be written: a folder cannot be made in /proc (No such file or "
                         "directory)"),
    *REPORT_NAME_CASES,
])
def test_compress_bench_refuses_a_bad_setting_before_any_work(tmp_path, override, error):
    tmp = str(tmp_path)
    r = bench("compress/bench.py", [override.replace("{tmp}", tmp), f"pair_dir={tmp_path / 'pair'}"]
              if not override.startswith("pair_dir=") else [override], tmp_path)
    assert_refused(r, error.replace("{tmp}", tmp))
    assert list(tmp_path.iterdir()) == []


def test_compress_bench_regenerates_a_cached_pair_of_another_shape(tmp_path):
    from deltafleet.compress.bench import not_pair, not_work_dir

    pair = tmp_path / "pair"
    make_pair(pair, {**SHAPE, "hidden_size": 32})  # an earlier run's, at another width
    r = bench("compress/bench.py", ["naive=false", f"pair_dir={pair}", f"work_dir={tmp_path / 'work'}",
                                    "report_name=r"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[bench] {pair.resolve()} holds a pair of other settings (shape.hidden_size 32, not 64): " \
           f"generating it again" in r.stdout.splitlines()
    report = json.loads((tmp_path / "reports" / "r.json").read_text())
    assert report["pair"]["shape"] == SHAPE and report["failed"] == []
    assert report["pair"]["parameters"] == sum(torch.Size(s).numel() for _, s in llama_tensors(SHAPE))
    for which in ("base", "ft"):
        assert json.loads((pair / which / "config.json").read_text())["hidden_size"] == 64
    assert json.loads((pair / "pair.json").read_text())["shape"] == SHAPE
    # what the run wrote is the benchmark's own: the next run reuses and replaces it
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["streaming"]
    assert not_work_dir(tmp_path / "work") is None and not_pair(pair) is None


def test_compress_bench_exits_1_when_an_export_failed(tmp_path):
    pair = tmp_path / "pair"
    make_pair(pair, SHAPE)
    corrupt(pair / "ft")
    r = bench("compress/bench.py", ["naive=true", f"pair_dir={pair}", f"work_dir={tmp_path / 'work'}",
                                    "report_name=r"], tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "[bench] FAILED: streaming export, naive export"
    report = json.loads((tmp_path / "reports" / "r.json").read_text())  # what it measured is kept
    assert report["failed"] == ["streaming export", "naive export"]
    assert [report["paths"][p]["returncode"] for p in ("streaming", "naive")] == [1, 1]
    assert "agreement" not in report and (tmp_path / "reports" / "r.png").is_file()


# --------------------------------------------------------------------------------------------
# merge/bench.py
# --------------------------------------------------------------------------------------------

LINEAR = "methods=[{method: linear, base: false, params: {}}]"


def test_merge_bench_keeps_a_work_dir_it_did_not_make(tmp_path):
    work = tmp_path / "D"
    work.mkdir()
    (work / "user.txt").write_text("mine")
    r = bench("merge/bench.py", [LINEAR, "keep_inputs=false", f"work_dir={work}"], tmp_path)
    assert_refused(r, f"work_dir {work.resolve()} exists and holds files that are not an earlier benchmark's output "
                      f"(files the benchmark did not write: user.txt): the benchmark replaces and deletes what it "
                      f"writes there; choose a new work_dir or one an earlier run made")
    assert [p.name for p in work.iterdir()] == ["user.txt"] and (work / "user.txt").read_text() == "mine"
    assert not (tmp_path / "run").exists()
    r = bench("merge/bench.py", [LINEAR, "keep_inputs=false", "work_dir=."], tmp_path, cwd=work)
    assert_refused(r, f"work_dir {work.resolve()} is the current directory or holds it: the benchmark replaces its "
                      f"whole work_dir (deleting what else is there); choose a new folder")
    assert [p.name for p in work.iterdir()] == ["user.txt"]


@pytest.mark.parametrize("override, error", [
    ("keep_inputs=maybe", "keep_inputs must be true or false, got 'maybe'"),
    ("threads=0", "threads must be null or a positive integer, got 0"),
    ("dtype=float8", "dtype must be one of float32, float16, bfloat16, got 'float8'"),
    ("shape.num_hidden_layers=0", "shape.num_hidden_layers must be a whole number, at least 1, got 0"),
    ("shape.hidden_size=66", "shape.hidden_size 66 is not a multiple of shape.num_attention_heads 4"),
    ("shape.hidden_size=100", "shape.hidden_size 100 / shape.num_attention_heads 4 is 25: the head dimension must "
                              "be even (RoPE)"),
    ("methods=[{method: foo, base: true, params: {}}]",
     "methods[0]: unknown merge method 'foo'; known: dare_linear, dare_ties, linear, monosoup, opcm, slerp, "
     "svd_soup, task_arithmetic, ties"),
    ("methods=[{method: slerp, base: true, params: {}}]",
     "methods[0]: merge method 'slerp' merges the base with 1 model(s); the benchmark merges 2"),
    ("methods=[{method: ties, base: false, params: {}}]",
     "methods[0]: merge method 'ties' needs the base (task vectors are W − W_base): base: true"),
    ("methods=[{method: ties, base: yes, params: {}}]", "methods[0].base must be true or false, got 'yes'"),
    ("work_dir=/proc/x", "work_dir /proc/x cannot be written: a folder cannot be made in /proc (No such file or "
                         "directory)"),
    *REPORT_NAME_CASES,
])
def test_merge_bench_refuses_a_bad_setting_before_any_work(tmp_path, override, error):
    tmp = str(tmp_path)
    r = bench("merge/bench.py", [override.replace("{tmp}", tmp)], tmp_path)
    assert_refused(r, error.replace("{tmp}", tmp))
    # no inputs generated, no report, no Hydra run folder
    assert list(tmp_path.iterdir()) == []


def test_merge_bench_regenerates_inputs_of_another_shape_in_its_own_run_folder(tmp_path):
    """Also: with no ``hydra.run.dir`` given, Hydra's run folder is ``outputs/bench-merge/<time>``
    (the merges' logs inside it), as the other benchmarks', not ``outputs/<date>/<time>``."""
    work = tmp_path / "outputs" / "bench" / "merge-tiny-2L"  # the configured work_dir
    make_pair(work / "a", {**SHAPE, "hidden_size": 32})
    make_pair(work / "b", {**SHAPE, "hidden_size": 32}, seed=1)
    r = subprocess.run([sys.executable, str(REPO / "merge/bench.py"), *SHAPE_ARGS, "machine=test", LINEAR,
                        "report_name=r"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for which in ("a", "b"):
        assert (f"{work.resolve() / which} holds a model of other settings (shape.hidden_size 32, not 64): "
                f"generating it again") in r.stdout.splitlines()
        assert json.loads((work / which / "pair.json").read_text())["shape"] == SHAPE
        assert json.loads((work / which / "ft" / "config.json").read_text())["hidden_size"] == 64
    report = json.loads((tmp_path / "reports" / "r.json").read_text())
    n_params = sum(torch.Size(s).numel() for _, s in llama_tensors(SHAPE))
    assert report["checkpoint_bytes"] == 2 * n_params and report["failed"] == []
    assert report["runs"][0]["tensors"] == len(llama_tensors(SHAPE))
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["bench", "bench-merge"]
    (run,) = (tmp_path / "outputs" / "bench-merge").iterdir()
    assert len(run.name) == len("2026-01-01_00-00-00") and (run / ".hydra" / "config.yaml").is_file()
    assert (run / "linear" / ".hydra").is_dir()


def test_merge_bench_exits_1_when_a_merge_failed(tmp_path):
    work = tmp_path / "work"
    make_pair(work / "a", SHAPE)
    make_pair(work / "b", SHAPE, seed=1)
    corrupt(work / "b" / "ft")
    r = bench("merge/bench.py", [LINEAR, f"work_dir={work}", "report_name=r", "keep_inputs=false"], tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("linear       ERROR: error: ") and "does not fit the file (1000 bytes)" in lines[0]
    assert lines[-1] == "FAILED: linear"
    report = json.loads((tmp_path / "reports" / "r.json").read_text())  # what it measured is kept
    assert report["failed"] == ["linear"] and "error" in report["runs"][0]
    assert not report["runs"][0]["within_rss_limit"]
    assert work.is_dir() and not any(work.iterdir())  # keep_inputs=false: its inputs; the folder was there before


def test_merge_bench_keeps_a_users_merge_and_its_reports(tmp_path):
    """Found by a fresh user: a merge of the user's own (``merge/run.py``'s ``merged-mine``) passed as the
    benchmark's, and keep_inputs=false deleted it with the work_dir; a reports_dir inside work_dir (or
    compress's pair_dir) was deleted with it, right after the report was written there."""
    work = tmp_path / "mw"
    (work / "merged-mine").mkdir(parents=True)
    (work / "merged-mine" / "merge.json").write_text(json.dumps({"written_by": "deltafleet merge",
                                                                "files": ["merge.json"]}))
    r = bench("merge/bench.py", [LINEAR, f"work_dir={work}", "keep_inputs=false"], tmp_path)
    assert r.returncode == 2 and "files the benchmark did not write: merged-mine" in r.stderr, r.stderr[-2000:]
    assert (work / "merged-mine" / "merge.json").is_file()
    for script, key in (("merge/bench.py", "work_dir"), ("compress/bench.py", "pair_dir")):
        r = bench(script, [LINEAR] * (script == "merge/bench.py") + [f"{key}={tmp_path / 'x'}",
                                                                     f"paths.reports_dir={tmp_path / 'x' / 'r'}"],
                  tmp_path)
        assert r.returncode == 2 and f"{key} {(tmp_path / 'x').resolve()} overlaps the input " in r.stderr, \
            r.stderr[-2000:]


def test_compress_bench_keeps_an_empty_pair_dir_the_user_made(tmp_path):
    pair = tmp_path / "mine"
    pair.mkdir()
    r = bench("compress/bench.py", ["naive=false", f"pair_dir={pair}", f"work_dir={tmp_path / 'w'}", "keep_pair=false",
                                    "report_name=r"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert pair.is_dir() and not any(pair.iterdir())  # what it generated there is gone, the folder stays


def test_compress_bench_checks_the_disk_before_generating_its_pair(tmp_path, monkeypatch):
    """Found by a fresh user: a default run writes 2 × 13.5 GB of pair with no check of the free space
    (a full disk stops it half way, and whatever else shares the disk)."""
    import shutil
    from collections import namedtuple

    from hydra import compose, initialize_config_dir

    from deltafleet.compress import bench as cb

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[*SHAPE_ARGS, f"paths.root={tmp_path}", "naive=false",
                                                      f"pair_dir={tmp_path / 'pair'}", f"work_dir={tmp_path / 'w'}"])
    need = 2 * cb.pair_parameters(SHAPE) * 2  # bf16
    assert need == 2 * 2 * sum(torch.Size(s).numel() for _, s in llama_tensors(SHAPE))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - need, need))  # no margin left
    with pytest.raises(SystemExit) as e:
        cb.main(cfg)
    assert str(e.value) == (f"error: the pair needs {need / 1e9:.1f} GB in {(tmp_path / 'pair').resolve()}, and its "
                            f"disk has {need / 1e9:.1f} GB free: free some, choose pair_dir on another disk, or a "
                            f"smaller shape (shape.num_hidden_layers=2)")
    assert not (tmp_path / "pair").exists()
    cb.check_free_disk(tmp_path / "pair" / "deeper", int(need / 1.06))  # the same free space holds less
