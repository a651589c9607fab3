"""Offline merges of real checkpoints (merge/stream.py, merge/run.py): the streamed result equals
the method applied to whole state dicts, it loads in transformers, shards, failures leave nothing."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from deltafleet.merge.methods import get_method
from deltafleet.merge.stream import merge_checkpoints

REPO = Path(__file__).resolve().parents[1]


def _state(d: Path) -> dict:
    return load_file(d / "model.safetensors")


@pytest.mark.parametrize("method, params", [("ties", {"density": 0.3}), ("dare_ties", {"density": 0.5, "seed": 3}),
                                            ("opcm", {"alpha": 0.5}), ("linear", {"weights": [1, 3]}),
                                            ("slerp", {"t": 0.3})])


def test_streamed_merge_equals_the_method_on_whole_state_dicts(tiny_family, tmp_path, method, params):
    models = [tiny_family.base_dir.parent / v for v in ("coder", "writer")][:get_method(method, **params).n_models]
    out = tmp_path / "merged"
    summary = merge_checkpoints(tiny_family.base_dir, models, out, get_method(method, **params), max_shard_bytes=60_000)
    base, states = _state(tiny_family.base_dir), [_state(m) for m in models]
    ref = get_method(method, **params)
    if ref.two_pass:
        for k in sorted(base):
            ref.observe(k, base[k], [s[k] for s in states])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert summary["shards"] > 1 and len(set(index["weight_map"].values())) == summary["shards"]
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(out / f))
    assert set(got) == set(base)
    for k in sorted(base):
        torch.testing.assert_close(got[k], ref.merge(k, base[k], [s[k] for s in states]), rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(out)  # a loadable checkpoint with the base's config
    assert sum(p.numel() for p in hf.parameters()) > 0 and (out / "tokenizer.json").is_file()
    assert json.loads((out / "merge.json").read_text())["method"] == method


def test_bad_inputs_are_named_and_leave_nothing(tiny_family, tmp_path):
    models = [tiny_family.base_dir.parent / "coder"]
    with pytest.raises(ValueError, match="merge method 'ties' needs the base checkpoint"):
        merge_checkpoints(None, models, tmp_path / "m", get_method("ties"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        merge_checkpoints(tiny_family.base_dir, [tmp_path / "empty"], tmp_path / "m", get_method("ties"))
    with pytest.raises(ValueError, match="no models to merge"):
        merge_checkpoints(tiny_family.base_dir, [], tmp_path / "m", get_method("ties"))
    with pytest.raises(ValueError, match="merge method 'slerp' merges the base with 1 model, got 2 models"):
        merge_checkpoints(tiny_family.base_dir, models * 2, tmp_path / "m", get_method("slerp"))
    assert not (tmp_path / "m").exists() and not any(p.name.startswith(".m.tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "linear", "opcm"])
def test_a_model_listed_twice_is_refused_before_anything_is_written(tiny_family, tmp_path, method):
    """Found by a reviewer: ``models=[models/coder,models/coder]`` (a typo for another variant) merged
    the one fine-tune with itself, status 0: its task vector counted twice. The same folder, however
    written, is refused by name before any work; params.weights gives a model more weight."""
    coder = tiny_family.base_dir.parent / "coder"
    again = tiny_family.base_dir.parent / "writer" / ".." / "coder"
    with pytest.raises(ValueError) as err:
        merge_checkpoints(tiny_family.base_dir, [coder, tiny_family.base_dir.parent / "writer", again],
                          tmp_path / "m", get_method(method))
    assert str(err.value) == (f"models lists {coder.resolve()} twice (as {coder} and {again}): each model is merged "
                              f"once; to give a model more weight, set params.weights")
    with pytest.raises(ValueError, match=rf"^models lists {re.escape(str(coder.resolve()))} twice: each model"):
        merge_checkpoints(tiny_family.base_dir, [coder, coder], tmp_path / "m", get_method(method))
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_that_overlaps_an_input_is_refused_before_anything_is_written(tiny_family, tmp_path):
    """Found by a fresh user: out_dir = an input (or a folder above one) replaced the inputs."""
    import shutil

    models = tmp_path / "models"
    shutil.copytree(tiny_family.base_dir.parent, models)
    before = (models / "coder" / "model.safetensors").read_bytes()
    ms = [models / "coder", models / "writer"]
    for out in (models / "coder", models, models / "coder" / "merged", models / "base"):
        with pytest.raises(ValueError, match="overlaps the input"):
            merge_checkpoints(models / "base", ms, out, get_method("ties"))
    assert (models / "coder" / "model.safetensors").read_bytes() == before and (models / "writer").is_dir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        merge_checkpoints(models / "base", ms, tmp_path / "afile", get_method("ties"))
    with pytest.raises(ValueError, match="max_shard_bytes must be > 0, got 0"):
        merge_checkpoints(models / "base", ms, tmp_path / "m", get_method("ties"), max_shard_bytes=0)
    with pytest.raises(ValueError, match="3 weights for 2 models"):
        merge_checkpoints(models / "base", ms, tmp_path / "m", get_method("ties", weights=[1, 1, 1]))
    with pytest.raises(ValueError, match="seed must be an integer, got 1.5"):
        get_method("dare_ties", seed=1.5)
    assert not (tmp_path / "m").exists()


def test_merge_run_cli(tiny_family, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "merge/run.py", f"base={tiny_family.base_dir}",
                        f"models=[{tiny_family.base_dir.parent / 'coder'},{tiny_family.base_dir.parent / 'writer'}]",
                        "method=task_arithmetic", "params.scaling=0.5", f"out_dir={out}", "progress=false",
                        f"hydra.run.dir={tmp_path / 'h'}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and '"method": "task_arithmetic"' in r.stdout
    r = subprocess.run([sys.executable, "merge/run.py", "method=model_stock", f"out_dir={out}", "models=[x]",
                        f"hydra.run.dir={tmp_path / 'h2'}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "unknown merge method 'model_stock'" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "merge/run.py", "max_shard_gb=abc", f"out_dir={out}", "models=[x]",
                        f"hydra.run.dir={tmp_path / 'h3'}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: max_shard_gb must be a positive number of GB, got 'abc'"


def test_an_out_dir_holding_other_files_is_kept_unless_overwrite(tiny_family, tmp_path):
    """Found by a fresh user: out_dir = a folder of their own files was silently replaced. An empty
    folder or an earlier merge's output (merge.json) is replaced; anything else only with overwrite."""
    models = [tiny_family.base_dir.parent / "coder", tiny_family.base_dir.parent / "writer"]
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "data.txt").write_text("precious")
    with pytest.raises(ValueError, match=r"not an earlier merge's output \(no merge.json of a merge\)"):
        merge_checkpoints(tiny_family.base_dir, models, mine, get_method("linear"))
    assert (mine / "sub" / "data.txt").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    merge_checkpoints(tiny_family.base_dir, models, tmp_path / "empty", get_method("linear"))
    assert (tmp_path / "empty" / "merge.json").is_file()
    first = json.loads((tmp_path / "empty" / "merge.json").read_text())
    merge_checkpoints(tiny_family.base_dir, models, tmp_path / "empty", get_method("ties", density=0.5))
    assert first["method"] == "linear"
    assert json.loads((tmp_path / "empty" / "merge.json").read_text())["method"] == "ties"
    merge_checkpoints(tiny_family.base_dir, models, mine, get_method("linear"), overwrite=True)
    assert not (mine / "sub").exists() and (mine / "model.safetensors").is_file()
    # found by a second fresh user: any merge.json made a folder replaceable, and a file added to an
    # earlier merge's output was lost; an out_dir that is a link was replaced by a folder
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "merge.json").write_text('{"not": "a merge"}')
    (fake / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match="its merge.json was not written by this merge tool"):
        merge_checkpoints(tiny_family.base_dir, models, fake, get_method("linear"))
    (tmp_path / "empty" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="files the merge did not write: notes.txt"):
        merge_checkpoints(tiny_family.base_dir, models, tmp_path / "empty", get_method("linear"))
    assert (fake / "thesis.tex").is_file() and (tmp_path / "empty" / "notes.txt").is_file()
    (tmp_path / "empty" / "notes.txt").unlink()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    merge_checkpoints(tiny_family.base_dir, models, tmp_path / "link", get_method("dare_ties", density=0.5))
    assert (tmp_path / "link").is_symlink()
    assert json.loads((tmp_path / "empty" / "merge.json").read_text())["method"] == "dare_ties"


def test_sigterm_removes_the_staged_folder(tmp_path):
    """Found by a fresh user: a merge stopped by SIGTERM (``timeout``, a scheduler) left its hidden
    staged folder behind; with ``stop_on_sigterm`` it ends as Ctrl-C does: status 143, nothing left,
    an existing output untouched."""
    code = f"""
import os, signal
from pathlib import Path
from deltafleet.atomic import staged_dir
from deltafleet.cli import stop_on_sigterm
stop_on_sigterm()
dst = Path({str(tmp_path / 'out')!r})
with staged_dir(dst) as tmp:
    (tmp / "half.bin").write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGTERM)
    (tmp / "never.bin").write_bytes(b"y")
"""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.bin").write_bytes(b"old")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 143, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.bin"]


def test_ctrl_c_ends_a_merge_with_one_line_and_nothing_left(tiny_family, tmp_path):
    """Found by a fresh user: Ctrl-C during a merge printed a 30-line KeyboardInterrupt traceback. A
    real SIGINT delivered while the staged folder is being written: status 130 (as a shell reports
    it), one line on stderr, no staged folder, an earlier output untouched."""
    out = tmp_path / "out"
    code = f"""
import contextlib, os, runpy, signal, sys, time
import deltafleet.atomic as atomic
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a shell (pytest's may have been ignored)
real = atomic.staged_dir

@contextlib.contextmanager


def interrupted(dst, *a, **k):
    with real(dst, *a, **k) as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        yield tmp

atomic.staged_dir = interrupted
sys.argv = ["merge/run.py", "base={tiny_family.base_dir}", "models=[{tiny_family.variants['coder']},{tiny_family.variants['writer']}]",
            "method=task_arithmetic", "out_dir={out}", "progress=false", "overwrite=true", "hydra.run.dir={tmp_path / 'h'}"]
runpy.run_path("merge/run.py", run_name="__main__")
"""
    out.mkdir()
    (out / "old.bin").write_bytes(b"old")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 130, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "merge: interrupted" and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h", "out"]
    assert [p.name for p in out.iterdir()] == ["old.bin"]


def test_merge_cli_names_a_bad_setting_in_one_line(tiny_family, tmp_path):
    """Found by a fresh user: ``params.density=abc`` failed with "'<' not supported between ...",
    and ``models=models/coder`` (a string) merged the "models" a, b, c, ... one letter each."""
    base = [sys.executable, "merge/run.py", f"base={tiny_family.base_dir}", "method=ties", "progress=false",
            f"out_dir={tmp_path / 'out'}"]
    models = f"models=[{tiny_family.variants['coder']},{tiny_family.variants['writer']}]"
    cases = [([models, "params.density=abc"], "error: merge method 'ties': density must be a finite number, got 'abc'"),
             # found by a fresh user: a merge of NaNs was written (scaling=nan), and overwrite=no replaced the
             # folder (Hydra keeps "no" as text, which bool() took for true)
             ([models, "params.scaling=nan"], "error: merge method 'ties': scaling must be a finite number, got nan"),
             ([models, "params.scaling=inf"], "error: merge method 'ties': scaling must be a finite number, got inf"),
             ([models, "overwrite=no"], "error: overwrite must be true or false, got 'no'"),
             ([f"models={tiny_family.variants['coder']}"], "error: models must be a list of checkpoint folders, "
                                                           "e.g. models=[models/coder,models/writer]; got '"),
             # found by a fresh user: tracebacks (a ValueError outside the handler, Path(None)'s TypeError)
             ([models, "threads=0"], "error: threads must be null or a positive integer, got 0"),
             ([f"models=[null,{tiny_family.variants['coder']}]"], "error: models[0] must be a folder path, got None"),
             (["models=[5]"], "error: models[0] must be a folder path, got 5"),
             # found by a fresh user: a misspelt +key, or a training config group, merged as if not given
             ([models, "+overwite=true"], "error: overwite is not a setting of conf/merge_models.yaml; its settings: "
                                          "base, max_shard_gb, method, models, out_dir, overwrite, params, paths, "
                                          "progress, threads"),
             ([models, "+params.densty=0.3"], "error: params.densty is not a setting of conf/merge_models.yaml; its "
                                              "settings under params: alpha, density,")]
    for i, (args, message) in enumerate(cases):
        r = subprocess.run(base + args + [f"hydra.run.dir={tmp_path / str(i)}"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 2 and r.stderr.strip().startswith(message), r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    r = subprocess.run(base[:-1] + [models, "out_dir=null", f"hydra.run.dir={tmp_path / 'n'}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and r.stderr.strip() == "error: out_dir must be a folder path, got None", r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_params_that_are_no_mapping_are_refused_by_name_and_null_takes_the_defaults(tiny_family, tmp_path, capsys):
    """Found by a reviewer: ``params=5`` was refused as "Input cfg is not an OmegaConf config object
    (int)", a message without the setting, and ``params=null`` (meaning: the method's defaults) the same.
    ``params`` that is no mapping is refused by name; null merges with the method's defaults."""
    import signal

    from hydra import compose, initialize_config_dir

    from deltafleet.merge.run import main

    def run(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="merge_models", overrides=[
                f"paths.root={tmp_path}", f"base={tiny_family.base_dir}", "progress=false",
                f"models=[{tiny_family.variants['coder']},{tiny_family.variants['writer']}]", *overrides])
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            main(cfg)
        finally:
            signal.signal(signal.SIGTERM, sigterm)  # (main makes SIGTERM end the job)

    with pytest.raises(SystemExit) as exit_:
        run("params=5")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: params must be the method's parameters by name, e.g. "
                                       "params.density=0.3 (null: the method's defaults), got 5\n")
    assert list(tmp_path.iterdir()) == []
    run("params=null", "method=ties")
    meta = json.loads((tmp_path / "models" / "merged-ties" / "merge.json").read_text())
    assert (meta["method"], meta["params"]) == ("ties", {"density": 0.2, "scaling": 1.0})


# ------------------------------------------------------------------ mutation sweep: small hand-made checkpoints


def _ckpt(folder: Path, tensors: dict, config: str | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


def test_shards_fill_up_to_the_limit_and_follow_the_hugging_face_names(tmp_path):
    """Three 64-byte tensors, 128 bytes a shard: a shard takes tensors while it stays ≤ the limit
    ([a, b], [c]); the files are named model-0000i-of-00002.safetensors, and the index's
    total_size, like the summary's bytes, is the sum of all tensors' bytes (192)."""
    t = {n: torch.full((4, 4), float(i)) for i, n in enumerate("abc")}
    base = _ckpt(tmp_path / "base", {n: torch.zeros(4, 4) for n in "abc"})
    m1, m2 = _ckpt(tmp_path / "m1", t), _ckpt(tmp_path / "m2", {n: 3 * v for n, v in t.items()})
    summary = merge_checkpoints(base, [m1, m2], tmp_path / "out", get_method("task_arithmetic", scaling=0.5),
                                max_shard_bytes=128)
    assert summary["shards"] == 2 and summary["bytes"] == 192 and summary["tensors"] == 3
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 192}, "weight_map": {"a": files[0], "b": files[0], "c": files[1]}}
    assert set(load_file(tmp_path / "out" / files[0])) == {"a", "b"}
    torch.testing.assert_close(load_file(tmp_path / "out" / files[1])["c"], torch.full((4, 4), 4.0))  # 0.5·(2 + 6)
    one = merge_checkpoints(base, [m1, m2], tmp_path / "one", get_method("linear"), max_shard_bytes=192)
    assert one["shards"] == 1 and sorted(p.name for p in (tmp_path / "one").iterdir()) == ["merge.json",
                                                                                            "model.safetensors"]


def test_inputs_that_differ_from_each_other_or_from_the_base_are_named(tmp_path):
    """Every model and the base must hold the same tensor names and shapes; the message names the
    first difference."""
    z = {"a": torch.zeros(2, 3), "b": torch.zeros(3)}
    base = _ckpt(tmp_path / "base", z)
    m = _ckpt(tmp_path / "m", z)
    other_name = _ckpt(tmp_path / "n", {"a": torch.zeros(2, 3), "c": torch.zeros(3)})
    other_shape = _ckpt(tmp_path / "s", {"a": torch.zeros(3, 2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"hold different tensors, e.g. 'b'"):
        merge_checkpoints(base, [m, other_name], tmp_path / "out", get_method("ties"))
    with pytest.raises(ValueError, match=r"a: shape \(3, 2\) in .*/s, \(2, 3\) in .*/m"):
        merge_checkpoints(base, [m, other_shape], tmp_path / "out", get_method("ties"))
    with pytest.raises(ValueError, match=r"a: shape \(3, 2\) in .*/s, \(2, 3\) in .*/m"):
        merge_checkpoints(other_shape, [m], tmp_path / "out", get_method("ties"))
    assert not (tmp_path / "out").exists()


def test_the_output_takes_the_base_dtype_and_config(tmp_path):
    """Fine-tunes saved in bfloat16 over a float32 base: the merge is written in float32 (the base's
    dtype) and carries the base's config.json, not the first model's."""
    base = _ckpt(tmp_path / "base", {"w": torch.ones(4, 4)}, config='{"from": "base"}')
    ms = [_ckpt(tmp_path / f"m{i}", {"w": torch.full((4, 4), 1.0 + i).bfloat16()}, config='{"from": "model"}')
          for i in (1, 2)]
    merge_checkpoints(base, ms, tmp_path / "out", get_method("task_arithmetic", scaling=0.5))
    got = load_file(tmp_path / "out" / "model.safetensors")["w"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.full((4, 4), 2.5))  # 1 + 0.5·(1 + 2)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"from": "base"}


def test_a_merge_that_would_write_non_finite_values_is_refused_and_names_the_source(tmp_path):
    """A NaN in one input (which TIES's sign election would drop without a word), or weights that
    overflow float32, give no checkpoint: a ValueError names the tensor and the input holding such
    values, or the method's arithmetic, and nothing is written."""
    z = {"a": torch.zeros(2, 3), "b": torch.ones(3)}
    base = _ckpt(tmp_path / "base", z)
    good = _ckpt(tmp_path / "good", {"a": torch.ones(2, 3), "b": torch.ones(3)})
    bad_b = torch.ones(3)
    bad_b[1] = float("nan")
    bad = _ckpt(tmp_path / "bad", {"a": torch.ones(2, 3), "b": bad_b})
    twin = _ckpt(tmp_path / "twin", {"a": torch.ones(2, 3), "b": torch.ones(3)})  # good's values, another folder
    for method in ("task_arithmetic", "ties"):  # TIES would drop the NaN silently
        with pytest.raises(ValueError, match=r"^b: .*/bad holds non-finite values \(NaN or infinity\)$"):
            merge_checkpoints(base, [good, bad], tmp_path / "out", get_method(method))
    with pytest.raises(ValueError, match=r"^a: the merge gives non-finite values \(NaN or infinity\) from finite "
                                         r"inputs: the method's weights or scaling overflow the dtype$"):
        merge_checkpoints(None, [good, twin], tmp_path / "out", get_method("linear", weights=[1e300, 1e300]))
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad", "base", "good",
                                                                                            "twin"]


def test_checkpoints_of_different_architectures_are_refused_and_doubtful_families_warned(tmp_path):
    """Inputs whose config.json disagree on model_type or architectures are refused before any work
    (mergekit's rule); a base without config.json (the output would have none) and a model whose
    training.json names another base are merged with a warning that says so."""
    z = {"a": torch.zeros(2, 3)}
    llama = '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    base = _ckpt(tmp_path / "base", z, llama)
    m = _ckpt(tmp_path / "m", {"a": torch.ones(2, 3)}, llama)
    qwen = _ckpt(tmp_path / "q", {"a": torch.ones(2, 3)}, '{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    with pytest.raises(ValueError, match=r'^the checkpoints are of different architectures: model_type "llama" in '
                                         r'.*/base/config.json, "qwen2" in .*/q/config.json$'):
        merge_checkpoints(base, [m, qwen], tmp_path / "out", get_method("ties"))
    assert not (tmp_path / "out").exists()
    bare = _ckpt(tmp_path / "bare", z)
    with pytest.warns(UserWarning, match=r"bare has no readable config.json, so the merged checkpoint has none"):
        merge_checkpoints(bare, [m], tmp_path / "out", get_method("task_arithmetic"))
    (m / "training.json").write_text(json.dumps({"base_dir": str(tmp_path / "elsewhere")}))
    with pytest.warns(UserWarning, match=r"m was fine-tuned from .*/elsewhere \(its training.json\), not from the base "
                                         r".*/base \(that folder is gone, so its weights could not be compared"):
        merge_checkpoints(base, [m], tmp_path / "out2", get_method("task_arithmetic"))
    (m / "training.json").write_text(json.dumps({"base_dir": str(base)}))
    import shutil
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        merge_checkpoints(base, [m], tmp_path / "out3", get_method("task_arithmetic"))
        # found by a fresh user: a copy of the base named as the base warned that m was fine-tuned from
        # another one; the weights are the same (the export's fingerprint), so it does not
        shutil.copytree(base, tmp_path / "copy")
        merge_checkpoints(tmp_path / "copy", [m], tmp_path / "out4", get_method("task_arithmetic"))
    _ckpt(tmp_path / "other", {"a": torch.full((2, 3), 0.5)}, llama)  # another base: still warned
    with pytest.warns(UserWarning, match=r"m was fine-tuned from .*/base \(its training.json\), not from the base"):
        merge_checkpoints(tmp_path / "other", [m], tmp_path / "out5", get_method("task_arithmetic"))


def test_a_slerp_or_linear_base_is_no_task_vector_origin_so_its_lineage_is_not_warned(tmp_path):
    """Found by a fresh user: docs/merging.md's slerp between two fine-tunes (one given as the base)
    warned that the model was fine-tuned from another base, "its task vector against this base is not
    its fine-tune's"; slerp and linear merge weights, not task vectors, so nothing is warned. The
    architecture check still runs first for them, and task_arithmetic still warns."""
    llama = '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    coder = _ckpt(tmp_path / "coder", {"a": torch.ones(2, 3)}, llama)
    writer = _ckpt(tmp_path / "writer", {"a": torch.full((2, 3), 2.0)}, llama)
    (writer / "training.json").write_text(json.dumps({"base_dir": str(tmp_path / "base")}))
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        merge_checkpoints(coder, [writer], tmp_path / "slerp", get_method("slerp", t=0.3))
        merge_checkpoints(coder, [writer], tmp_path / "linear", get_method("linear"))
    # parallel vectors: slerp is linear, 0.7·1 + 0.3·2
    torch.testing.assert_close(load_file(tmp_path / "slerp" / "model.safetensors")["a"], torch.full((2, 3), 1.3))
    with pytest.warns(UserWarning, match=r"writer was fine-tuned from .*/base \(its training.json\)"):
        merge_checkpoints(coder, [writer], tmp_path / "ta", get_method("task_arithmetic"))


def test_architectures_are_compared_before_tensor_names(tmp_path):
    """Found by a fresh user: a Qwen2 model (q/k/v biases) beside Llama ones was refused as holding
    "different tensors, e.g. ...bias", not as another architecture; the architecture is named first."""
    llama = '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    base = _ckpt(tmp_path / "base", {"a": torch.zeros(2, 3)}, llama)
    m = _ckpt(tmp_path / "m", {"a": torch.ones(2, 3)}, llama)
    qwen = _ckpt(tmp_path / "q", {"a": torch.ones(2, 3), "a.bias": torch.ones(2)},
                 '{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    with pytest.raises(ValueError, match=r"^the checkpoints are of different architectures: model_type"):
        merge_checkpoints(base, [m, qwen], tmp_path / "out", get_method("ties"))


def test_a_tied_head_stored_anyway_merges_as_the_tie_it_runs_with(tmp_path):
    """Found by a fresh user: a checkpoint whose config ties the head (tie_word_embeddings) but which
    stores lm_head.weight anyway (some tools save it; transformers ignores it and ties) was refused
    beside ones that do not store it. Such a stored head is dropped, as the export drops it; the
    merged checkpoint holds no head and transformers ties it. A model with a head of its own beside
    tied ones is refused with a message that says so."""
    tied = '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": true}'
    untied = tied.replace("true", "false")
    emb = "model.embed_tokens.weight"
    base = _ckpt(tmp_path / "base", {emb: torch.zeros(4, 2)}, tied)
    m1 = _ckpt(tmp_path / "m1", {emb: torch.ones(4, 2)}, tied)
    m2 = _ckpt(tmp_path / "m2", {emb: torch.full((4, 2), 3.0), "lm_head.weight": torch.full((4, 2), 3.0)}, tied)
    merge_checkpoints(base, [m1, m2], tmp_path / "out", get_method("task_arithmetic", scaling=0.5))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {emb}
    torch.testing.assert_close(got[emb], torch.full((4, 2), 2.0))  # 0.5·(1 + 3)
    base2 = _ckpt(tmp_path / "base2", {emb: torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2)}, tied)
    merge_checkpoints(base2, [m1, m2], tmp_path / "out2", get_method("ties"))  # the base stores its tied head too
    own = _ckpt(tmp_path / "own", {emb: torch.ones(4, 2), "lm_head.weight": torch.ones(4, 2)}, untied)
    with pytest.raises(ValueError, match=r"own has an LM head of its own \(lm_head.weight\), while .*/m1 ties its "
                                         r"head to the embedding"):
        merge_checkpoints(base, [m1, own], tmp_path / "out3", get_method("ties"))


@pytest.mark.parametrize("name, params", [("monosoup", {"energy_ratio": 0.9}), ("ties", {"density": 0.5}),
                                          ("linear", {}), ("dare_ties", {"density": 0.7, "seed": 3})])


def test_merge_json_records_the_params_that_make_the_method_again(name, params, tmp_path):
    """Found by a fresh user: monosoup's merge.json held {"weights": null, "kw": {...}}, which
    get_method refuses. The params recorded are the method's own (defaults filled in, nulls left
    out), and get_method of them makes a method that merges to the same bytes."""
    base = _ckpt(tmp_path / "base", {"a": torch.zeros(4, 4)})
    ms = [_ckpt(tmp_path / f"m{i}", {"a": torch.randn(4, 4, generator=torch.Generator().manual_seed(i))})
          for i in range(2)]
    summary = merge_checkpoints(None if name == "linear" else base, ms, tmp_path / "out", get_method(name, **params))
    recorded = json.loads((tmp_path / "out" / "merge.json").read_text())["params"]
    assert recorded == summary["params"] and all(v is not None for v in recorded.values())
    assert params.items() <= recorded.items()
    merge_checkpoints(None if name == "linear" else base, ms, tmp_path / "again", get_method(name, **recorded))
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tmp_path / "out" / "model.safetensors").read_bytes()


def test_an_exported_merge_says_how_it_was_made(tmp_path):
    """Found by a fresh user: a merge exported as a BitDelta artifact recorded only the folder it came
    from. Its manifest's provenance now carries the merge's method, parameters and inputs
    (``finetuned.merge``, from merge.json); an ordinary fine-tune's has no ``merge``."""
    from deltafleet.compress.bitdelta import compress

    llama = '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    base = _ckpt(tmp_path / "base", {"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 16)}, llama)
    a = _ckpt(tmp_path / "a", {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 16)}, llama)
    b = _ckpt(tmp_path / "b", {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 16)}, llama)
    merge_checkpoints(base, [a, b], tmp_path / "merged", get_method("ties", density=0.5), show_progress=False)
    merged = compress(base, tmp_path / "merged", tmp_path / "art", variant="merged")
    assert merged["provenance"]["finetuned"]["merge"] == {
        "method": "ties", "params": {"density": 0.5, "scaling": 1.0}, "base": str(base), "models": [str(a), str(b)]}
    assert "merge" not in compress(base, a, tmp_path / "art-a", variant="a")["provenance"]["finetuned"]
    # found by a fresh user: weights written over the merge's (a further fine-tune saved in its folder)
    # kept its record; merge.json has the fingerprint of what the merge wrote, and only those weights match
    shutil.copyfile(a / "model.safetensors", tmp_path / "merged" / "model.safetensors")
    again = compress(base, tmp_path / "merged", tmp_path / "art2", variant="merged")
    assert "merge" not in again["provenance"]["finetuned"]


def test_opcm_refuses_a_nan_in_the_first_model_with_the_documented_error(tmp_path):
    """Found by a reviewer: a NaN reached OPCM's first pass (its SVD) unchecked and escaped as
    torch.linalg.LinAlgError, a traceback. Two-pass methods check their inputs in the first pass too:
    the same ValueError naming the tensor and folder as every other method."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=g)
    m1 = w + torch.randn(6, 8, generator=g)
    m1[0, 0] = float("nan")
    base = _ckpt(tmp_path / "base", {"w": w})
    a = _ckpt(tmp_path / "a", {"w": m1})
    b = _ckpt(tmp_path / "b", {"w": w + torch.randn(6, 8, generator=g)})
    with pytest.raises(ValueError, match="holds non-finite values"):
        merge_checkpoints(base, [a, b], tmp_path / "out", get_method("opcm"))
    assert not (tmp_path / "out").exists()


def _opcm_reference(base: torch.Tensor, models: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """OPCM for a one-matrix model, from the full-SVD definition (arXiv:2501.09522 §3):
    R_1 = τ_1, R_t = R_{t-1} + U P V^T with P = U^T τ_t V, its top-left k×k block and its diagonal
    zeroed (k: first index where the cumulative share of singular values of R_{t-1} exceeds alpha);
    merged = W_0 + R_n · mean_i ‖τ_i‖ / ‖R_n‖."""
    b = base.double()
    taus = [m.double() - b for m in models]
    r = taus[0].clone()
    for t in taus[1:]:
        u, s, vh = torch.linalg.svd(r, full_matrices=True)
        k = int(((s.cumsum(0) / s.sum()) > alpha).double().argmax())
        p = u.T @ t @ vh.T
        p[:k, :k] = 0
        p.diagonal().zero_()
        r = r + u @ p @ vh
    scale = sum(float(t.norm()) for t in taus) / len(taus) / float(r.norm())
    return (b + r * scale).float()


def test_an_opcm_method_object_used_for_a_second_merge_gives_that_merges_result(tmp_path):
    """Found by a reviewer: OPCM's whole-model norms stayed in the method object, so a second merge
    with it was rescaled with the first one's statistics added in. Each merge's first pass starts
    afresh (``MergeMethod.reset``): both merges equal the full-SVD definition."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=g)
    base = _ckpt(tmp_path / "base", {"w": w})
    states = [w + (i + 1) * torch.randn(6, 8, generator=g) for i in range(4)]
    ms = [_ckpt(tmp_path / f"m{i}", {"w": s}) for i, s in enumerate(states)]
    method = get_method("opcm", alpha=0.5)
    merge_checkpoints(base, ms[:2], tmp_path / "first", method)
    first = load_file(tmp_path / "first" / "model.safetensors")["w"]
    torch.testing.assert_close(first, _opcm_reference(w, states[:2], 0.5), rtol=1e-5, atol=1e-5)
    merge_checkpoints(base, ms[2:], tmp_path / "second", method)  # the same object, other models
    second = load_file(tmp_path / "second" / "model.safetensors")["w"]
    torch.testing.assert_close(second, _opcm_reference(w, states[2:], 0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*config.json")
def test_a_float8_checkpoint_merges_in_float32_and_keeps_its_dtype(tmp_path):
    """Found by a reviewer: the non-finite check called torch.isfinite on float8 rows, which it does
    not implement, so every merge of an FP8 checkpoint failed. It merges in float32 and keeps the
    base's dtype, as docs/merging.md says."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(6, 8, generator=g).to(torch.float8_e4m3fn)
    m1 = (b.float() + 0.3 * torch.randn(6, 8, generator=g)).to(torch.float8_e4m3fn)
    m2 = (b.float() + 0.3 * torch.randn(6, 8, generator=g)).to(torch.float8_e4m3fn)
    base = _ckpt(tmp_path / "base", {"w": b})
    a, c = _ckpt(tmp_path / "a", {"w": m1}), _ckpt(tmp_path / "c", {"w": m2})
    merge_checkpoints(base, [a, c], tmp_path / "out", get_method("linear"))
    got = load_file(tmp_path / "out" / "model.safetensors")["w"]
    assert got.dtype == torch.float8_e4m3fn
    ref = ((m1.float() + m2.float()) / 2).to(torch.float8_e4m3fn)
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["monosoup", "svd_soup"])
def test_monosoup_and_svd_soup_merge_a_tensor_with_an_empty_first_dimension(tmp_path, method):
    """Found by a reviewer: a [0, 4] tensor, which every other method merges, made monosoup and
    svd_soup fail to reshape it for the SVD. An empty matrix is merged as the mean (empty too)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 4, generator=g)
    base = _ckpt(tmp_path / "base", {"w": w, "e": torch.zeros(0, 4)})
    ms = [_ckpt(tmp_path / f"m{i}", {"w": w + 0.1 * torch.randn(5, 4, generator=g), "e": torch.zeros(0, 4)})
          for i in range(2)]
    merge_checkpoints(base, ms, tmp_path / "out", get_method(method))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got["e"].shape == (0, 4) and got["w"].shape == (5, 4)


def test_a_failed_merge_into_a_new_nested_out_dir_leaves_no_folders(tmp_path):
    """docs/merging.md: "a failed or stopped merge leaves nothing", which includes the missing parent
    folders of out_dir that the merge made (staged_dir removes them again)."""
    w = torch.randn(4, 4)
    base = _ckpt(tmp_path / "base", {"w": w})
    bad = _ckpt(tmp_path / "bad", {"w": torch.full((4, 4), float("nan"))})
    with pytest.raises(ValueError, match="non-finite"):
        merge_checkpoints(base, [bad], tmp_path / "new" / "sub" / "out", get_method("linear"))
    assert not (tmp_path / "new").exists(), sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "new").rglob("*"))
