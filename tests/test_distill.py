"""BitDelta scale distillation (arXiv:2402.10193 §3.2) on the tiny family of tests/conftest.py.

The losses a distillation reports are recomputed here independently: the artifact is materialised
with `compress.bitdelta.materialize` into a plain Hugging Face model and compared with the
fine-tuned model in float64, so a wrong student (signs, α shapes, full tensors) or a wrong loss
shows up as a mismatch. The artifact checks read the safetensors files directly.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import deltafleet.compress.distill as distill
from deltafleet.compress import FingerprintMismatchError, compress, fingerprint, load_artifact, materialize
from deltafleet.compress.distill import EVAL_BLOCKS, METHOD, build_student, calibration_blocks, distill_scales

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 32
DISTILLATION_KEYS = {"method", "source_artifact", "loss", "steps", "lr", "batch_size", "seq_len",
                     "calibration_blocks", "seed", "loss_before", "loss_after"}
CALIBRATION_FILES = ("json/encoder.py", "json/decoder.py", "csv.py", "pprint.py")


def _write_corpus(path: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": (stdlib / f).read_text()}) + "\n" for f in CALIBRATION_FILES))
    return path


@pytest.fixture(scope="module")
def calib(tiny_family, tmp_path_factory) -> torch.Tensor:
    from transformers import AutoTokenizer

    corpus = _write_corpus(tmp_path_factory.mktemp("calib") / "train.jsonl")
    return calibration_blocks(corpus, AutoTokenizer.from_pretrained(tiny_family.base_dir), SEQ_LEN, 16)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def distilled(tiny_family, calib, tmp_path_factory):
    """The `writer` artifact (signs + matrix α + two norms in full) distilled with the MSE loss."""
    out = tmp_path_factory.mktemp("distilled") / "writer-distilled"
    calls, records = [], _Records()
    logger = logging.getLogger("deltafleet.compress.distill")
    logger.addHandler(records)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        manifest = distill_scales(tiny_family.base_dir, tiny_family.variants["writer"],
                                  tiny_family.artifacts_dir / "writer", out, calib, steps=12, lr=1e-3,
                                  log_every=5, callback=lambda step, loss: calls.append((step, loss)))
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)
    return {"out": out, "manifest": manifest, "calls": calls, "messages": records.messages,
            "src": tiny_family.artifacts_dir / "writer", "ft": tiny_family.variants["writer"]}


def _hf_model(ft_dir: Path, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ft_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


@torch.no_grad()
def _reference_loss(base_dir: Path, ft_dir: Path, artifact_dir: Path, blocks: torch.Tensor, loss: str) -> float:
    """The loss of materialize(base, artifact) against the fine-tune, all blocks in one float64 batch."""
    student = _hf_model(ft_dir, materialize(base_dir, load_artifact(artifact_dir)))
    teacher = _hf_model(ft_dir)
    s = student(input_ids=blocks).logits.double()
    t = teacher(input_ids=blocks).logits.double()
    if loss == "mse":
        return float(((s - t) ** 2).mean())
    log_pt = torch.log_softmax(t, -1)
    kl = (log_pt.exp() * (log_pt - torch.log_softmax(s, -1))).sum(-1)
    return float(kl.mean())


def _tensors(artifact_dir: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """tensor name → (file, tensor) read straight from the safetensors files of an artifact."""
    out = {}
    for f in sorted(artifact_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: (f.name, h.get_tensor(k)) for k in h.keys()})
    return out


def _leftovers(parent: Path) -> list[str]:
    return sorted(p for p in os.listdir(parent) if p.startswith("."))


# --------------------------------------------------------------------------------------------
# the distillation itself
# --------------------------------------------------------------------------------------------


def test_mse_drops_and_reported_losses_match_an_independent_recomputation(tiny_family, calib, distilled):
    d = distilled["manifest"]["provenance"]["distillation"]
    eval_blocks = calib[:EVAL_BLOCKS]
    before = _reference_loss(tiny_family.base_dir, distilled["ft"], distilled["src"], eval_blocks, "mse")
    after = _reference_loss(tiny_family.base_dir, distilled["ft"], distilled["out"], eval_blocks, "mse")
    assert d["loss_before"] == pytest.approx(before, rel=1e-5)
    assert d["loss_after"] == pytest.approx(after, rel=1e-5)
    assert after < 0.97 * before  # 12 steps of Adam(1e-3) cut the logit MSE by a few percent at least
    with torch.no_grad():  # the base alone is further from the fine-tune than either: the signs carry Δ
        base_only = float(((_hf_model(tiny_family.base_dir)(input_ids=eval_blocks).logits.double()
                            - _hf_model(distilled["ft"])(input_ids=eval_blocks).logits.double()) ** 2).mean())
    assert base_only > 1.3 * before


def test_only_alpha_changes_and_alpha_stays_non_negative(distilled):
    src, out = _tensors(distilled["src"]), _tensors(distilled["out"])
    assert src.keys() == out.keys()
    changed = 0
    for name, (file, t) in src.items():
        file2, t2 = out[name]
        assert file2 == file and t2.dtype == t.dtype and t2.shape == t.shape
        if name.endswith(".alpha"):
            assert t2.dtype == torch.float32 and bool((t2 >= 0).all()) and bool(torch.isfinite(t2).all())
            changed += not torch.equal(t2, t)
        else:  # signs and full tensors byte for byte
            assert torch.equal(t2.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
    n_alpha = sum(n.endswith(".alpha") for n in src)
    assert n_alpha == 16 and changed == n_alpha
    assert any(not n.endswith((".alpha", ".sign")) for n in src)  # writer stores two norms in full


def test_manifest_and_provenance(tiny_family, calib, distilled):
    src_m = json.loads((distilled["src"] / "bitdelta.json").read_text())
    m = distilled["manifest"]
    assert json.loads((distilled["out"] / "bitdelta.json").read_text()) == m
    for key in ("format", "format_version", "variant", "base", "granularity"):
        assert m[key] == src_m[key]
    assert sorted(os.listdir(distilled["out"])) == sorted([*src_m["files"], "bitdelta.json"])
    assert m["stats"]["bytes"] == sum((distilled["out"] / f).stat().st_size for f in m["files"])
    bits = 8 * m["stats"]["bytes"] / src_m["stats"]["parameters"]
    assert m["stats"]["bits_per_parameter"] == pytest.approx(bits)
    assert m["stats"]["parameters"] == src_m["stats"]["parameters"]
    prov = m["provenance"]
    assert prov["run_id"] != src_m["provenance"]["run_id"] and len(prov["run_id"]) == 32
    assert prov["finetuned"] == src_m["provenance"]["finetuned"]
    d = prov["distillation"]
    assert set(d) == DISTILLATION_KEYS
    assert d["method"] == METHOD == "scale distillation (BitDelta arXiv:2402.10193 §3.2)"
    assert d["source_artifact"] == str(distilled["src"]) and d["loss"] == "mse"
    assert (d["steps"], d["lr"], d["batch_size"], d["seed"]) == (12, 1e-3, 4, 0)
    assert (d["calibration_blocks"], d["seq_len"]) == tuple(calib.shape) == (16, SEQ_LEN)
    # the distilled artifact loads with the base fingerprint enforced, and refuses another base
    art = load_artifact(distilled["out"], base_fingerprint=fingerprint(tiny_family.base_dir))
    assert art.variant == "writer" and len(art.alphas) == 16
    with pytest.raises(FingerprintMismatchError):
        load_artifact(distilled["out"], base_fingerprint=fingerprint(distilled["ft"]))


def test_callback_and_log(distilled):
    calls = distilled["calls"]
    assert [s for s, _ in calls] == [5, 10, 12]
    assert all(isinstance(v, float) and v > 0 for _, v in calls)
    d = distilled["manifest"]["provenance"]["distillation"]
    msgs = distilled["messages"]
    assert any(m.startswith("step 0:") and f"{d['loss_before']:.6g}" in m for m in msgs)
    assert any(m.startswith("after 12 steps:") and f"{d['loss_after']:.6g}" in m for m in msgs)


def test_gradient_reaches_alpha_only_and_the_student_is_base_plus_alpha_sign(tiny_family, calib):
    art = load_artifact(tiny_family.artifacts_dir / "writer")
    student, alphas, _ = build_student(tiny_family.base_dir, tiny_family.variants["writer"], art)
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert len(trainable) == len(alphas) == 16 and all(n.endswith(".alpha") for n in trainable)
    assert {id(p) for n, p in student.named_parameters() if p.requires_grad} == {id(a) for a in alphas.values()}
    for name, a in alphas.items():
        assert torch.equal(a.detach(), art.alphas[name]) and a.dtype == torch.float32
    ids = calib[:2]
    reference = _hf_model(tiny_family.variants["writer"], materialize(tiny_family.base_dir, art))
    logits = student(input_ids=ids).logits
    torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
    logits.square().mean().backward()
    for name, p in student.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and bool(p.grad.ne(0).any()), name
        else:
            assert p.grad is None, name


def test_tied_embeddings_share_one_alpha(tmp_path):
    """A tied lm_head has no tensor of its own: the α of embed_tokens must reach it too."""
    from tests.conftest import perturb, tiny_llama

    base = tiny_llama(96, seed=3, hidden_size=32, intermediate_size=64, tie_word_embeddings=True)
    base.save_pretrained(tmp_path / "base")
    ft = tiny_llama(96, seed=3, hidden_size=32, intermediate_size=64, tie_word_embeddings=True)
    ft.load_state_dict(perturb(base, seed=4))
    ft.save_pretrained(tmp_path / "ft")
    compress(tmp_path / "base", tmp_path / "ft", tmp_path / "art", variant="t")
    art = load_artifact(tmp_path / "art")
    assert "lm_head.weight" not in art.signs and "model.embed_tokens.weight" in art.signs
    student, alphas, _ = build_student(tmp_path / "base", tmp_path / "ft", art)
    assert student.lm_head.weight.data_ptr() != base.lm_head.weight.data_ptr()
    torch.testing.assert_close(student.lm_head.weight, student.model.embed_tokens.weight, rtol=0, atol=0)
    ids = torch.arange(24).view(2, 12)
    state = materialize(tmp_path / "base", art)
    reference = _hf_model(tmp_path / "ft")
    reference.load_state_dict(state, strict=False)  # lm_head follows embed_tokens
    torch.testing.assert_close(student(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_kl_option_lowers_the_kl(tiny_family, calib, tmp_path):
    base, ft, src = tiny_family.base_dir, tiny_family.variants["coder"], tiny_family.artifacts_dir / "coder"
    m = distill_scales(base, ft, src, tmp_path / "kl", calib, steps=12, lr=1e-3, loss="kl", seed=1)
    d = m["provenance"]["distillation"]
    assert d["loss"] == "kl" and d["seed"] == 1
    before = _reference_loss(base, ft, src, calib[:EVAL_BLOCKS], "kl")
    after = _reference_loss(base, ft, tmp_path / "kl", calib[:EVAL_BLOCKS], "kl")
    assert d["loss_before"] == pytest.approx(before, rel=1e-5)
    assert d["loss_after"] == pytest.approx(after, rel=1e-5)
    assert after < 0.97 * before


def test_row_granularity_keeps_the_sharding(tiny_family, calib, tmp_path):
    src = tmp_path / "src"
    compress(tiny_family.base_dir, tiny_family.variants["coder"], src, variant="coder", granularity="row",
             max_shard_bytes=8192)
    src_index = json.loads((src / "delta.safetensors.index.json").read_text())
    assert len(set(src_index["weight_map"].values())) > 2
    m = distill_scales(tiny_family.base_dir, tiny_family.variants["coder"], src, tmp_path / "out", calib[:6],
                       steps=3, lr=1e-3, batch_size=2)
    out = tmp_path / "out"
    index = json.loads((out / "delta.safetensors.index.json").read_text())
    assert index["weight_map"] == src_index["weight_map"]
    shards = set(index["weight_map"].values())
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in shards)
    assert sorted(m["files"]) == sorted(json.loads((src / "bitdelta.json").read_text())["files"])
    a, b = _tensors(src), _tensors(out)
    assert {k: f for k, (f, _) in a.items()} == {k: f for k, (f, _) in b.items()}
    art = load_artifact(out, base_fingerprint=fingerprint(tiny_family.base_dir))
    assert art.granularity == "row" and m["provenance"]["distillation"]["calibration_blocks"] == 6
    for name, alpha in art.alphas.items():
        assert alpha.shape == (art.signs[name].shape[0],) and bool((alpha >= 0).all())
        assert torch.equal(art.signs[name], a[name + ".sign"][1])


# --------------------------------------------------------------------------------------------
# errors and atomicity
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"loss": "l1"}, r"loss must be one of \('mse', 'kl'\), got 'l1'"),
    ({"steps": 0}, "steps must be an integer ≥ 1, got 0"),
    ({"batch_size": 0}, "batch_size must be an integer ≥ 1, got 0"),
    ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
    ({"lr": -1e-4}, "lr must be a finite number > 0"),
    ({"calibration": torch.zeros(2, 8, dtype=torch.int32)}, r"int64 tensor \[n_blocks, seq_len\].*torch.int32"),
    ({"calibration": torch.zeros(16, dtype=torch.int64)}, r"int64 tensor \[n_blocks, seq_len\].*\[16\]"),
    ({"calibration": [[1, 2, 3]]}, r"int64 tensor \[n_blocks, seq_len\].*list"),
    ({"calibration": torch.zeros(0, 8, dtype=torch.int64)}, r"calibration is empty: \[0, 8\]"),
    ({"calibration": torch.full((2, 8), 10_000, dtype=torch.int64)}, r"token ids must lie in \[0, 512\)"),
], ids=["loss", "steps", "batch", "lr0", "lr<0", "int32", "1d", "list", "empty", "vocab"])
def test_bad_arguments(tiny_family, calib, tmp_path, kwargs, match):
    args = {"calibration": calib, **kwargs}
    calibration = args.pop("calibration")
    with pytest.raises(ValueError, match=match):
        distill_scales(tiny_family.base_dir, tiny_family.variants["coder"], tiny_family.artifacts_dir / "coder",
                       tmp_path / "out", calibration, **args)
    assert os.listdir(tmp_path) == []


def test_another_base_is_refused(tiny_family, calib, tmp_path):
    # found by a fresh user: the message told distillation users to pass force=true, which it does not take
    with pytest.raises(FingerprintMismatchError, match=r"export it again against this base, or, in a job that "
                                                       r"takes it \(serve, export format=hf\), set force=true"):
        distill_scales(tiny_family.variants["writer"], tiny_family.variants["coder"],
                       tiny_family.artifacts_dir / "coder", tmp_path / "out", calib, steps=1)
    assert os.listdir(tmp_path) == []


def test_failure_mid_write_leaves_nothing_and_keeps_an_existing_one(tiny_family, calib, tmp_path, monkeypatch):
    src = tmp_path / "src"
    compress(tiny_family.base_dir, tiny_family.variants["coder"], src, variant="coder", max_shard_bytes=8192)
    args = (tiny_family.base_dir, tiny_family.variants["coder"], src)
    real_save, calls = distill.save_file, []

    def failing_save(*a, **kw):  # the second shard fails after the first one is written
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk on fire")
        return real_save(*a, **kw)

    monkeypatch.setattr(distill, "save_file", failing_save)
    with pytest.raises(OSError, match="disk on fire"):
        distill_scales(*args, tmp_path / "new", calib[:4], steps=1)
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []

    monkeypatch.setattr(distill, "save_file", real_save)
    old = tmp_path / "old"
    distill_scales(*args, old, calib[:4], steps=1)
    before = {f: (old / f).read_bytes() for f in os.listdir(old)}
    calls.clear()
    monkeypatch.setattr(distill, "save_file", failing_save)
    with pytest.raises(OSError, match="disk on fire"):
        distill_scales(*args, old, calib[:4], steps=2)
    assert {f: (old / f).read_bytes() for f in os.listdir(old)} == before
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# calibration blocks, config and CLI
# --------------------------------------------------------------------------------------------


def test_calibration_blocks_are_the_training_blocks(tiny_family, tmp_path):
    from transformers import AutoTokenizer

    from deltafleet.train.datamodule import load_blocks

    tok = AutoTokenizer.from_pretrained(tiny_family.base_dir)
    _write_corpus(tmp_path / "data" / "coder" / "train.jsonl")
    full = load_blocks(tmp_path / "data", "coder", "train", tok, 16)
    blocks = calibration_blocks(tmp_path / "data" / "coder" / "train.jsonl", tok, 16)
    assert blocks.dtype == torch.int64 and torch.equal(blocks, full)
    assert int((blocks == tok.eos_token_id).sum()) >= len(CALIBRATION_FILES) - 1  # one eos per document
    first = calibration_blocks(tmp_path / "data" / "coder" / "train.jsonl", tok, 16, max_blocks=5)
    assert torch.equal(first, full[:5])
    with pytest.raises(ValueError, match="fewer than one block of 100000"):
        calibration_blocks(tmp_path / "data" / "coder" / "train.jsonl", tok, 100_000)
    with pytest.raises(FileNotFoundError, match="make data"):
        calibration_blocks(tmp_path / "missing.jsonl", tok, 16)


def test_distill_config_composes():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("distill", overrides=["variant=math", "paths.root=/r"])
    c = OmegaConf.to_container(cfg, resolve=True)
    assert c["artifact_dir"] == "/r/artifacts/math" and c["out_dir"] == "/r/artifacts/math-distilled"
    assert c["base_dir"] == "/r/models/base" and c["finetuned_dir"] == "/r/models/math"
    assert (c["steps"], c["lr"], c["batch_size"], c["seq_len"], c["loss"]) == (800, 3e-4, 4, 128, "mse")
    assert c["granularity"] is None and c["split"] == "train" and c.get("logger") is None
    assert c["beta_lr"] == 1e-2 and c["max_calibration_blocks"] == 3200


@pytest.mark.slow
def test_distill_py_end_to_end(tiny_family, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(tiny_family.base_dir, root / "models" / "base")
    shutil.copytree(tiny_family.variants["coder"], root / "models" / "coder")
    shutil.copytree(tiny_family.artifacts_dir / "coder", root / "artifacts" / "coder")
    _write_corpus(root / "data" / "coder" / "train.jsonl")
    source_before = (root / "artifacts" / "coder" / "bitdelta.json").read_bytes()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # distill.py must find the repo itself
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    proc = subprocess.run(
        [sys.executable, "compress/distill.py", "variant=coder", f"paths.root={root}", "granularity=row",
         "steps=6", "lr=1e-3", "seq_len=32", "max_calibration_blocks=8", "log_every=3", "logger=csv"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("coder:")]
    assert len(summary) == 1 and "mse to the fine-tune" in summary[0] and "granularity row" in summary[0]
    out = root / "artifacts" / "coder-distilled"
    art = load_artifact(out, base_fingerprint=fingerprint(root / "models" / "base"))
    assert art.granularity == "row"  # re-exported with row α first, since artifacts/coder is matrix
    prov = art.manifest["provenance"]
    assert prov["run_id"].startswith("distill/coder/") and prov["config"]["out_dir"] == str(out)
    d = prov["distillation"]
    assert (d["steps"], d["seq_len"], d["calibration_blocks"]) == (6, 32, 8)
    assert d["loss_after"] < d["loss_before"]
    assert f"{d['loss_before']:.6g} → {d['loss_after']:.6g}" in summary[0]
    assert (root / "artifacts" / "coder" / "bitdelta.json").read_bytes() == source_before
    run_dirs = list((root / "outputs" / "distill" / "coder").iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / "source-row" / "bitdelta.json").is_file()
    metrics = list((root / "outputs" / "csv").rglob("metrics.csv"))
    assert len(metrics) == 1 and "distill/mse" in metrics[0].read_text()
    # found by a fresh user: a seq_len far past the model's context ran until the machine ran out of
    # memory; and SIGTERM ended the job with no message (-15), skipping its clean-up
    context = json.loads((root / "models" / "base" / "config.json").read_text())["max_position_embeddings"]
    long = subprocess.run([sys.executable, "compress/distill.py", "variant=coder", f"paths.root={root}",
                           f"seq_len={context + 1}", "logger=csv"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert long.returncode == 1 and "Traceback" not in long.stderr, long.stderr[-2000:]
    assert long.stderr.strip().splitlines()[-1] == (f"distill: ValueError: seq_len must be a positive integer up to "
                                                    f"the model's context ({context} tokens, max_position_embeddings), "
                                                    f"got {context + 1}")
    bogus = subprocess.run([sys.executable, "compress/distill.py", "variant=coder", f"paths.root={root}",
                            "granularity=bogus", "logger=csv"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=240)  # found by a fresh user: "exporting a 'bogus' one to …", then refused
    assert bogus.returncode == 1 and "exporting" not in bogus.stdout, bogus.stdout[-2000:]
    assert bogus.stderr.strip().splitlines()[-1] == ("distill: ValueError: granularity must be null (the artifact's "
                                                     "own) or one of ('matrix', 'row', 'rowcol'), got 'bogus'")
    stopped = subprocess.Popen([sys.executable, "compress/distill.py", "variant=coder", f"paths.root={root}",
                                "steps=100000", "seq_len=32", "max_calibration_blocks=8", "log_every=1", "logger=csv",
                                "out_dir=" + str(root / "artifacts" / "stopped")], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not list((root / "outputs" / "csv").rglob("metrics.csv"))[1:] and time.monotonic() < deadline:
        time.sleep(0.2)  # the second run's logger is up: it is training
    time.sleep(1.0)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(60) == 143, stopped.stderr.read()[-2000:]
    assert not (root / "artifacts" / "stopped").exists()
    assert not [p.name for p in (root / "artifacts").iterdir() if p.name.startswith(".")]


def test_rowcol_distillation_fits_alpha_and_beta_in_float16(tiny_family, calib, tmp_path):
    """Granularity rowcol: both scales train (β at ``beta_lr``), come back in the artifact's float16,
    the signs and everything else byte for byte; the KL to the fine-tune falls further than with the
    row α alone at the same steps, and the student is exactly base + diag(α)·S·diag(β)."""
    base, ft = tiny_family.base_dir, tiny_family.variants["coder"]
    for g in ("row", "rowcol"):
        compress(base, ft, tmp_path / g, variant="coder", granularity=g)
        distill_scales(base, ft, tmp_path / g, tmp_path / f"{g}-kl", calib, steps=16, lr=1e-3, loss="kl", seed=1)
    src, out = load_artifact(tmp_path / "rowcol"), load_artifact(tmp_path / "rowcol-kl")
    assert out.manifest["format_version"] == 2 and out.manifest["provenance"]["distillation"]["beta_lr"] == 1e-2
    assert all(out.alphas[k].dtype == out.betas[k].dtype == torch.float16 for k in out.signs)
    assert all(torch.equal(out.signs[k], src.signs[k]) for k in src.signs) and out.full.keys() == src.full.keys()
    moved = [k for k in out.betas if not bool((out.betas[k] == 1).all())]
    assert len(moved) == len(out.betas) and all(bool((b >= 0).all()) for b in out.betas.values())
    kl = {g: _reference_loss(base, ft, tmp_path / f"{g}-kl", calib[:EVAL_BLOCKS], "kl") for g in ("row", "rowcol")}
    before = _reference_loss(base, ft, tmp_path / "rowcol", calib[:EVAL_BLOCKS], "kl")
    assert kl["rowcol"] < kl["row"] < before
    student, alphas, betas = build_student(base, ft, out)
    assert betas.keys() == alphas.keys() == out.signs.keys()
    reference = _hf_model(ft)
    reference.load_state_dict(materialize(base, out), strict=False)
    ids = calib[:2]
    torch.testing.assert_close(student(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-4)


def test_a_loss_change_is_worded_by_its_direction():
    """A worsened loss reads as higher (it read "-1403.5% lower"), an improved one as lower."""
    assert distill.relative_change(2.0, 1.5) == "25.0% lower"
    assert distill.relative_change(0.02, 0.3007) == "1403.5% higher"
    assert distill.relative_change(0.5, 0.5) == "unchanged"
    assert distill.relative_change(0.0, 0.1) == "from 0"


# --------------------------------------------------------------------------------------------
# mutation sweep: batch order and the evaluation mean
# --------------------------------------------------------------------------------------------


def test_batches_walk_seeded_permutations_across_pass_boundaries():
    """Every pass over the blocks is a permutation of range(n), read batch_size at a time across the
    pass boundary (5 blocks in batches of 2: the first 5 batches hold each block exactly twice)."""
    batches = distill._batches(5, 2, seed=3)
    got = torch.cat([next(batches) for _ in range(5)])
    assert sorted(got[:5].tolist()) == [0, 1, 2, 3, 4] and sorted(got[5:].tolist()) == [0, 1, 2, 3, 4]
    again = distill._batches(5, 2, seed=3)
    assert torch.equal(torch.cat([next(again) for _ in range(5)]), got)  # seeded


class _Lookup(torch.nn.Module):
    """A stand-in causal LM: the logits of a token are a fixed row of a table."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.randn(11, 7, generator=torch.Generator().manual_seed(seed))

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table[input_ids])


@pytest.mark.parametrize("loss", ["mse", "kl"])
def test_evaluate_is_the_token_weighted_mean_over_uneven_batches(loss):
    """3 blocks in batches of 2 (the last one short): the result is the loss of all blocks as one
    batch, not the plain mean of the two batches' losses."""
    student, teacher = _Lookup(0), _Lookup(1)
    blocks = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 1]])
    s, t = student.table[blocks].double(), teacher.table[blocks].double()
    if loss == "mse":
        want = float(((s - t) ** 2).mean())
    else:
        log_pt = torch.log_softmax(t, -1)
        want = float((log_pt.exp() * (log_pt - torch.log_softmax(s, -1))).sum(-1).mean())
    got = distill.evaluate(student, teacher, blocks, loss=loss, batch_size=2)
    assert got == pytest.approx(want, rel=1e-5)


# --------------------------------------------------------------------------------------------
# mutation sweep: one optimiser step on a tiny pair (Adam's first step is ±lr, Kingma & Ba Alg. 1)
# --------------------------------------------------------------------------------------------

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _tiny_artifact(tmp_path: Path, granularity: str) -> tuple[Path, Path, Path, torch.Tensor]:
    """(base, fine-tune, artifact, calibration) of a 1-layer, 16-wide model: a step costs milliseconds."""
    from tests.conftest import perturb, tiny_llama

    base = tiny_llama(64, seed=3, **TINY)
    base.save_pretrained(tmp_path / "base")
    ft = tiny_llama(64, seed=3, **TINY)
    ft.load_state_dict(perturb(base, seed=4))
    ft.save_pretrained(tmp_path / "ft")
    compress(tmp_path / "base", tmp_path / "ft", tmp_path / "art", variant="t", granularity=granularity)
    calib = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return tmp_path / "base", tmp_path / "ft", tmp_path / "art", calib


def _scales(artifact_dir: Path, suffix: str) -> dict[str, torch.Tensor]:
    return {k: t.double() for k, (_, t) in _tensors(artifact_dir).items() if k.endswith(suffix)}


def _one_step(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], lr: float, lo: float, hi: float,
              atol: float) -> tuple[int, int, int]:
    """Check every scale after one Adam step: it moved by at most ``lr`` (by exactly ±lr where its
    gradient is well above Adam's eps), or stopped at a bound ``lo`` / ``hi``. Returns how many moved
    by a full ±lr, and how many ended at ``lo`` and at ``hi``."""
    full = at_lo = at_hi = 0
    assert new.keys() == old.keys() and old
    for k, o in old.items():
        n, step = new[k], (new[k] - old[k]).abs()
        assert bool(torch.isfinite(n).all()) and bool((n >= lo).all()) and bool((n <= hi).all()), (k, n)
        assert bool(((step <= lr + atol) | (n == lo) | (n == hi)).all()), (k, o, n)
        full += int(((step - lr).abs() <= atol).sum())
        at_lo += int(((n == lo) & (o != lo)).sum())
        at_hi += int(((n == hi) & (o != hi)).sum())
    return full, at_lo, at_hi


def test_a_step_past_zero_leaves_the_scale_at_zero(tmp_path):
    """Row α (float32, ≈0.04): one step of Adam(lr=1) moves each α by (at most, and mostly exactly) ±1;
    the ones that would go negative are clamped to exactly 0 right after the step."""
    base, ft, art, calib = _tiny_artifact(tmp_path, "row")
    distill_scales(base, ft, art, tmp_path / "out", calib, steps=1, lr=1.0, batch_size=2)
    old, new = _scales(art, ".alpha"), _scales(tmp_path / "out", ".alpha")
    assert all(bool((o > 0).all() and (o < 0.5).all()) for o in old.values())
    full, at_zero, _ = _one_step(old, new, 1.0, 0.0, float("inf"), atol=1e-3)
    n = sum(o.numel() for o in old.values())
    assert at_zero > 0 and full > 0 and full + at_zero > n // 2


def test_beta_trains_at_beta_lr_and_alpha_at_lr(tmp_path):
    """Rowcol: the first Adam step moves each α by ±lr and each β by ±beta_lr (β at its own learning
    rate: at lr=1e-4 a β of 1 would not even leave 1 in float16)."""
    base, ft, art, calib = _tiny_artifact(tmp_path, "rowcol")
    m = distill_scales(base, ft, art, tmp_path / "out", calib, steps=1, lr=1e-4, beta_lr=0.05, batch_size=2)
    assert m["provenance"]["distillation"]["lr"] == 1e-4
    assert m["provenance"]["distillation"]["beta_lr"] == 0.05
    old, new = _scales(art, ".beta"), _scales(tmp_path / "out", ".beta")
    assert all(bool((b == 1).all()) for b in old.values())
    full, _, _ = _one_step(old, new, 0.05, 0.0, distill.FP16_MAX, atol=1e-3)  # float16 near 1
    assert full > sum(b.numel() for b in old.values()) // 2
    old, new = _scales(art, ".alpha"), _scales(tmp_path / "out", ".alpha")
    full, _, _ = _one_step(old, new, 1e-4, 0.0, distill.FP16_MAX, atol=2e-5)  # float16 near 0.04
    assert full > sum(a.numel() for a in old.values()) // 2


def test_rowcol_scales_are_clamped_to_the_float16_range(tmp_path):
    """Rowcol scales are stored in float16: a step of ±1e5 ends a scale at 0 or at float16's largest
    finite value 65504, never at inf, and the result loads as a valid artifact."""
    base, ft, art, calib = _tiny_artifact(tmp_path, "rowcol")
    distill_scales(base, ft, art, tmp_path / "out", calib, steps=1, lr=1e5, beta_lr=1e5, batch_size=2)
    for suffix in (".alpha", ".beta"):
        old, new = _scales(art, suffix), _scales(tmp_path / "out", suffix)
        _, at_zero, at_max = _one_step(old, new, 1e5, 0.0, 65504.0, atol=0)
        assert at_zero > 0 and at_max > 0, suffix
    load_artifact(tmp_path / "out")


def test_a_diverged_distillation_or_a_wrong_out_dir_writes_nothing(tiny_family, calib, tmp_path):
    """Found by a fresh user: lr=1e4 made every scale NaN and the job wrote the unloadable artifact
    (over a good one) with status 0; out_dir set to the source artifact, or to another variant's,
    replaced it. Now a diverged run raises before writing, and both out_dirs are refused before any
    work, each leaving what was there."""
    src = tiny_family.artifacts_dir / "coder"
    args = (tiny_family.base_dir, tiny_family.variants["coder"], src)
    good = tmp_path / "coder-distilled"
    distill_scales(*args, good, calib[:4], steps=1)
    before = {f: (good / f).read_bytes() for f in os.listdir(good)}
    with pytest.raises(ValueError, match=r"^the distillation diverged \(mse .* → nan.*\) at lr=1e\+30: nothing was "
                                         r"written; .*coder-distilled is as it was. Try a smaller lr$"):
        distill_scales(*args, good, calib[:4], steps=3, lr=1e30)
    assert {f: (good / f).read_bytes() for f in os.listdir(good)} == before
    with pytest.raises(ValueError, match=r"overlaps the input .*/coder: the distillation would replace or write into it"):
        distill_scales(*args, src, calib[:4], steps=1)
    other = tmp_path / "writer"
    shutil.copytree(tiny_family.artifacts_dir / "writer", other)
    with pytest.raises(ValueError, match=r"it is the artifact of variant 'writer', not of 'coder'"):
        distill_scales(*args, other, calib[:4], steps=1)
    assert load_artifact(other).manifest["variant"] == "writer" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("beta_lr", ["0.05", math.inf, 0.0], ids=["text", "inf", "zero"])
def test_beta_lr_is_checked_as_lr_is(tmp_path, beta_lr):
    """Found by a reviewer: ``beta_lr`` was only compared with 0, after the models were loaded, so a
    text value (``beta_lr=1e-2x`` on the command line) raised TypeError and ``inf`` wrote β of 0 or
    65504. It must be a finite number > 0, as ``lr`` must, checked before any work."""
    base, ft, art, calib = _tiny_artifact(tmp_path, "rowcol")
    with pytest.raises(ValueError, match=r"^beta_lr must be a finite number > 0, got "):
        distill_scales(base, ft, art, tmp_path / "out", calib, steps=1, lr=1e-4, beta_lr=beta_lr, batch_size=2)
    assert not (tmp_path / "out").exists()


def test_a_source_whose_provenance_and_stats_are_no_objects_is_distilled(tiny_family, calib, tmp_path):
    """Found by a reviewer: ``provenance`` and ``stats`` are informational (the reader does not check
    them), but distillation read them as objects: a string or a list there raised AttributeError or
    ValueError after the artifact had loaded. They are taken as empty, and the output's are objects."""
    src = tmp_path / "src"
    shutil.copytree(tiny_family.artifacts_dir / "coder", src)
    manifest = json.loads((src / "bitdelta.json").read_text())
    (src / "bitdelta.json").write_text(json.dumps({**manifest, "provenance": "exported by hand", "stats": []}))
    out = distill_scales(tiny_family.base_dir, tiny_family.variants["coder"], src, tmp_path / "out", calib[:2],
                         steps=1, lr=1e-3)
    assert out["provenance"]["distillation"]["steps"] == 1 and "finetuned" not in out["provenance"]
    assert out["stats"] == {"bytes": sum(f.stat().st_size for f in (tmp_path / "out").iterdir()
                                         if f.name != "bitdelta.json"), "bits_per_parameter": 0.0}
    assert json.loads((tmp_path / "out" / "bitdelta.json").read_text()) == out
    load_artifact(tmp_path / "out")
