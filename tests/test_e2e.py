"""The whole spine on real text, through the real command lines, in a temporary root:

make data → train base (+ tokenizer) → fine-tune a variant (+ BitDelta export) → re-export →
serve → the official OpenAI client. Shrunk (tiny width, few steps) so it runs in about a minute.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
AUSTEN = REPO / "data/sources/janeaustenr/usr/lib/R/site-library/janeaustenr"
SMALL_MODEL = ["model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128",
               "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
               "model.max_position_embeddings=256"]
SMALL_RUN = ["variant.batch_size=8", "variant.seq_len=64", "variant.val_check_interval=10",
             "variant.limit_val_batches=2", "eval_batches=8"]

pytestmark = pytest.mark.slow


def run(args: list[str], root: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, *args, f"paths.root={root}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    if not AUSTEN.is_dir():
        pytest.fail(f"{AUSTEN} missing: run `make install` (it unpacks the Debian package r-cran-janeaustenr)")
    root = tmp_path_factory.mktemp("family")
    run(["-m", "deltafleet.train.data", f"data.sources.austen={AUSTEN}", "data.max_chars.coder=300000",
         "data.max_chars.math=150000", "data.max_chars.writer=300000", "data.max_chars.legal=300000",
         "data.math_problems=4000"], root)
    base = run(["train/run.py", "variant=base", "trainer.max_steps=40", "variant.warmup_steps=5",
                *SMALL_MODEL, *SMALL_RUN], root)
    coder = run(["train/run.py", "variant=coder", "trainer.max_steps=25", *SMALL_MODEL, *SMALL_RUN], root)
    return root, base, coder


def test_variant_beats_base_on_its_domain(family):
    root, _, coder = family
    rec = json.loads((root / "models/coder/training.json").read_text())
    assert rec["variant"] == "coder" and rec["domain"] == "coder"
    assert rec["files"] == sorted(p.name for p in (root / "models/coder").iterdir())  # what a rerun may replace
    assert rec["base_dir"] == str((root / "models/base").resolve())
    assert rec["heldout/loss"] < rec["heldout/base_loss"], rec
    # BitDelta keeps part of the fine-tune's gain: better than the base on the domain
    assert rec["heldout/bitdelta_loss"] < rec["heldout/base_loss"], rec
    assert f"base {rec['heldout/base_loss']:.4f} -> coder {rec['heldout/loss']:.4f}" in coder.stdout
    # the base and the variant are Hugging Face checkpoints with the tokenizer beside them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "models/base")
    model = AutoModelForCausalLM.from_pretrained(root / "models/coder")
    assert model.config.vocab_size == len(tok) and model.config.hidden_size == 64
    # the offline W&B run landed under outputs/
    assert list((root / "outputs/wandb").glob("offline-run-*")), "no offline W&B run written"


def test_export_cli_rewrites_the_same_artifact(family):
    root, _, _ = family
    art = root / "artifacts/coder"
    before = json.loads((art / "bitdelta.json").read_text())
    run(["compress/run.py", "variant=coder"], root)
    after = json.loads((art / "bitdelta.json").read_text())
    assert after["files"] == before["files"]  # deterministic: same bytes, same sha256
    assert after["base"]["fingerprint"] == before["base"]["fingerprint"]
    assert after["format"] == "bitdelta" and after["format_version"] == 1 and after["granularity"] == "matrix"
    assert not [p for p in art.parent.iterdir() if p.name.startswith(".")], "temp dirs left behind"


def test_export_hf_materialises_the_artifact_as_a_loadable_checkpoint(family):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltafleet.train.datamodule import load_blocks
    from deltafleet.train.module import heldout_loss

    root, _, _ = family
    run(["compress/run.py", "variant=coder", "format=hf"], root)
    out = root / "models/coder-bitdelta"
    model = AutoModelForCausalLM.from_pretrained(out)  # what any engine would do
    # its held-out loss is the BitDelta loss the training run measured from the artifact
    rec = json.loads((root / "models/coder/training.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    blocks = load_blocks(root / "data", "coder", "test", tok, seq_len=64)
    assert heldout_loss(model, blocks, batch_size=8, max_batches=8) == pytest.approx(
        rec["heldout/bitdelta_loss"], rel=1e-5)
    # and it differs from the fine-tune (1 bit per weight is an approximation)
    ft = AutoModelForCausalLM.from_pretrained(root / "models/coder")
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, ft.model.layers[0].mlp.down_proj.weight)


def test_served_by_the_openai_client(family):
    from openai import OpenAI

    root, _, _ = family
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "serve/run.py", f"paths.root={root}", f"port={port}"], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                pytest.fail(f"server exited:\n{server.stdout.read()}")
            time.sleep(0.5)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        ids = {m.id: m for m in client.models.list().data}
        assert set(ids) == {"tiny", "tiny-coder"}
        outs = {}
        for model in ("tiny", "tiny-coder"):
            r = client.completions.create(model=model, prompt="def main(", max_tokens=12, temperature=0)
            assert r.model == model and r.usage.completion_tokens >= 1
            outs[model] = r.choices[0].text
            chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                  max_tokens=5, temperature=0)
            assert chat.choices[0].message.role == "assistant" and chat.usage.total_tokens > 0
        curl = subprocess.run(["curl", "-s", f"{url}/v1/models"], capture_output=True, text=True, timeout=10)
        parents = {m["id"]: m.get("parent") for m in json.loads(curl.stdout)["data"]}
        assert parents["tiny-coder"] == "tiny"
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_lora_variant_saves_a_peft_adapter_and_a_merged_checkpoint(family):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _, _ = family
    proc = run(["train/run.py", "variant=math", "variant.adapter=lora", "lora.r=4", "trainer.max_steps=8",
                "logger=csv", *SMALL_MODEL, *SMALL_RUN], root)
    assert "trainable=0.0" in proc.stdout  # only the adapters train
    adapter = root / "models/math/adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(root / "models/base")
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(root / "models/math").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)
    # the merged checkpoint exported like any variant
    assert json.loads((root / "artifacts/math/bitdelta.json").read_text())["variant"] == "math"


def test_sigterm_while_a_run_saves_its_model_leaves_nothing(family):
    """Found by a fresh user: after training, a SIGTERM (a timeout, a scheduler) killed the run at once
    and left its staged model folder behind. It now unwinds as Ctrl-C does: status 143, no staged
    folder, no model written."""
    root, _, _ = family
    code = f"""
import contextlib, os, runpy, signal, sys
import deltafleet.atomic as atomic
staged = atomic.staged_dir
@contextlib.contextmanager
def stopped(dst):
    with staged(dst) as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGTERM)
        yield tmp
atomic.staged_dir = stopped  # before train/run.py imports it: the run's first save is stopped
sys.argv = {["train/run.py", "variant=math", "variant.name=stopped", "logger=csv", "trainer.max_steps=2",
             "hydra.run.dir=" + str(root / "outputs/stopped"), *SMALL_MODEL, *SMALL_RUN, f"paths.root={root}"]!r}
runpy.run_path("train/run.py", run_name="__main__")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert not (root / "models" / "stopped").exists()
    assert not [p.name for p in (root / "models").iterdir() if p.name.startswith(".stopped.")]


@pytest.mark.parametrize("what", ["fine-tune", "artifact"])
def test_a_run_whose_disk_is_full_ends_in_one_line(family, what):
    """Found by a fresh user: a run whose disk filled up as it saved its fine-tune, or as it exported its
    artifact, ended in Hydra's traceback. It ends as an export does: ``train: cannot write ... to <key>
    <folder>: <cause>``, status 1, and that folder is not written (the fine-tune saved before stays)."""
    root, _, _ = family
    name = f"full-{what}"
    model, artifact = root / "models" / name, root / "artifacts" / name
    if what == "fine-tune":  # the staged write of the model folder finds the disk full
        patch, out, key = "atomic.staged_dir", model, "out_dir"
    else:  # the fine-tune is saved; the artifact's manifest finds the disk full
        patch, out, key = "bitdelta.write_manifest", artifact, "export.out_dir"
    code = f"""
import errno, runpy, sys
import deltafleet.atomic as atomic, deltafleet.compress.bitdelta as bitdelta
def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
{patch} = full
sys.argv = {["train/run.py", "variant=math", f"variant.name={name}", "logger=csv", "trainer.max_steps=2",
             "hydra.run.dir=" + str(root / "outputs" / name), *SMALL_MODEL, *SMALL_RUN, f"paths.root={root}"]!r}
runpy.run_path("train/run.py", run_name="__main__")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"train: cannot write the {what} to {key} {out}: No space left on device", proc.stderr[-2000:]
    assert not out.exists() and model.exists() == (what == "artifact")


@pytest.mark.parametrize("stop", ["disk full", "SIGTERM"])
def test_a_lora_run_that_cannot_save_leaves_no_adapter_staging_folder(family, stop):
    """Found by a reviewer: a LoRA run stages its PEFT adapter in ``models/.<name>-adapter-XXXX`` before
    the held-out evaluation and the save of ``out_dir``, and only a diverged run removed it: a run whose
    disk was full at the save, or that was stopped then, left it behind in ``models/``. Any run that ends
    without saving now removes it: status 1 (or 143), no fine-tune, no staging folder."""
    root, _, _ = family
    name = "lora-" + stop.split()[0].lower()
    code = f"""
import contextlib, errno, os, runpy, signal, sys
import deltafleet.atomic as atomic
staged = atomic.staged_dir
def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
@contextlib.contextmanager
def stopped(dst):
    with staged(dst) as tmp:
        os.kill(os.getpid(), signal.SIGTERM)
        yield tmp
atomic.staged_dir = {"full" if stop == "disk full" else "stopped"}  # the save of out_dir fails or is stopped
sys.argv = {["train/run.py", "variant=math", f"variant.name={name}", "logger=csv", "trainer.max_steps=2",
             "variant.adapter=lora", "lora.r=4", "export.enabled=false",
             "hydra.run.dir=" + str(root / "outputs" / name), *SMALL_MODEL, *SMALL_RUN, f"paths.root={root}"]!r}
runpy.run_path("train/run.py", run_name="__main__")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == (1 if stop == "disk full" else 143), proc.stderr[-3000:]
    if stop == "disk full":
        assert proc.stderr.strip().splitlines()[-1] == \
            f"train: cannot write the fine-tune to out_dir {root / 'models' / name}: No space left on device"
    assert not (root / "models" / name).exists()
    assert not [p.name for p in (root / "models").iterdir() if p.name.startswith(f".{name}")]


@pytest.mark.parametrize("adapter", [[], ["variant.adapter=lora", "lora.r=4"]])
def test_a_diverged_run_writes_nothing(family, adapter):
    """Found by a fresh user: a run whose weights went to NaN (too high a learning rate) wrote its
    fine-tune, all NaN, exited 0 with the export off and in a traceback with it on. It now ends in one
    line naming the tensor, status 1, with no fine-tune, no artifact and no adapter staging folder."""
    root, _, _ = family
    name = "diverged" + ("-lora" if adapter else "")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "train/run.py", "variant=math", f"variant.name={name}", "logger=csv",
                           "trainer.max_steps=3", "variant.lr=1e30", *adapter, *SMALL_MODEL, *SMALL_RUN,
                           f"paths.root={root}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train: the fine-tune diverged: ") and " holds NaN or inf after 3 steps, so nothing " \
        f"was written to {root / 'models' / name}; lower the learning rate (1e+30: " in last, last
    assert not (root / "models" / name).exists() and not (root / "artifacts" / name).exists()
    assert not [p.name for p in (root / "models").iterdir() if p.name.startswith(f".{name}")]


def test_fast_dev_run_writes_no_fine_tune_and_no_artifact(family):
    """Lightning's ``fast_dev_run`` is a smoke run (a batch or a few, no checkpoints, no loggers); found by
    a fresh user, it wrote a real ``models/<v>`` and ``artifacts/<v>`` of one step's training."""
    root, _, _ = family
    proc = run(["train/run.py", "variant=math", "variant.name=smoke", "logger=csv", "+trainer.fast_dev_run=2",
                *SMALL_MODEL, *SMALL_RUN], root)
    assert f"[train] fast_dev_run: 2 step(s) ran; nothing written to {root / 'models' / 'smoke'} or " \
        "export.out_dir" in proc.stdout, proc.stdout[-2000:]
    assert not (root / "models" / "smoke").exists() and not (root / "artifacts" / "smoke").exists()
    assert not list((root / "outputs" / "train" / "smoke").glob("*/checkpoints/*"))  # nor a checkpoint for
    # ckpt_path=last to take (found by a fresh user)


def test_killed_run_resumes_from_its_last_checkpoint(family):
    import signal

    import torch

    root, _, _ = family
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["train/run.py", "variant=writer", "logger=csv", "trainer.max_steps=400", "checkpoint.every_n_steps=5",
            "hydra.run.dir=" + str(root / "outputs/killed"), *SMALL_MODEL, *SMALL_RUN, f"paths.root={root}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ckpt_dir = root / "outputs/killed/checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not list(ckpt_dir.glob("step0000[1-9]*.ckpt")):
        assert proc.poll() is None, "training ended before it could be killed"
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
    proc.wait(timeout=30)
    last = ckpt_dir / "last.ckpt"
    saved_step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert saved_step >= 10 and saved_step % 5 == 0
    assert not (root / "models/writer").exists(), "a killed run must not leave a checkpoint folder"
    resumed = run(["train/run.py", "variant=writer", "logger=csv", f"trainer.max_steps={saved_step + 5}",
                   f"ckpt_path={last}", *SMALL_MODEL, *SMALL_RUN], root)
    rec = json.loads((root / "models/writer/training.json").read_text())
    assert rec["global_step"] == saved_step + 5
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    # another variant's checkpoint is refused before anything trains or is written
    wrong = subprocess.run([sys.executable, "train/run.py", "variant=legal", "logger=csv", f"ckpt_path={last}",
                            *SMALL_MODEL, *SMALL_RUN, f"paths.root={root}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode != 0
    assert "is a checkpoint of variant 'writer', not 'legal'" in wrong.stderr


def test_multirun_trains_variants_one_after_another(family):
    root, _, _ = family
    run(["train/run.py", "-m", "variant=legal,coder", "trainer.max_steps=3", "logger=csv", "export.enabled=false",
         f"hydra.sweep.dir={root}/outputs/multirun/sweep",
         "variant.warmup_steps=1", *SMALL_MODEL, *SMALL_RUN], root)
    for v in ("legal", "coder"):
        rec = json.loads((root / f"models/{v}/training.json").read_text())
        assert rec["variant"] == v and rec["global_step"] == 3
    assert len(list((root / "outputs/multirun").glob("*/*/metrics.json"))) == 2
    # logger=csv records the same final numbers the W&B logger gets
    for v in ("legal", "coder"):
        rec = json.loads((root / f"models/{v}/training.json").read_text())
        rows = list(csv.DictReader(open(next((root / f"outputs/csv/{v}").glob("version_*/metrics.csv")))))
        logged = [float(r["heldout/base_loss"]) for r in rows if r.get("heldout/base_loss")]
        assert logged == [pytest.approx(rec["heldout/base_loss"])]


def test_a_sweep_never_replaces_the_fine_tune_of_its_own_earlier_job(family):
    """Found by a fresh user: ``-m variant=coder variant.lr=1e-3,5e-4`` trained both jobs into
    ``models/coder``, and only the last was left. The second job is refused before it trains, naming the
    job that wrote the folder; a name per job (``variant.name=...-${hydra:job.num}``) keeps both."""
    root, _, _ = family
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    common = ["train/run.py", "-m", "variant=legal", "variant.lr=1e-3,5e-4", "trainer.max_steps=2", "logger=csv",
              "export.enabled=false", "variant.warmup_steps=1", *SMALL_MODEL, *SMALL_RUN, f"paths.root={root}"]
    proc = subprocess.run([sys.executable, *common, "variant.name=swept", f"hydra.sweep.dir={root}/outputs/sweep1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train: ValueError: job 0 of this sweep wrote {root}/models/swept, and this job (1) would replace it: give "
        "each job its own variant.name, e.g. 'variant.name=swept-${hydra:job.num}'"), proc.stderr[-2000:]
    assert json.loads((root / "models/swept/training.json").read_text())["lr"] == 1e-3
    run([*common[:-1], "variant.name=swept-${hydra:job.num}", f"hydra.sweep.dir={root}/outputs/sweep2"], root)
    assert [json.loads((root / f"models/swept-{i}/training.json").read_text())["lr"] for i in (0, 1)] == [1e-3, 5e-4]
    # another sweep into the same folder is another sweep: its job 0 may replace the last one's job 1
    run([*(c for c in common[:-1] if not c.startswith("variant.lr=")), "variant.name=swept-1,swept-0",
         f"hydra.sweep.dir={root}/outputs/sweep2"], root)
    assert [json.loads((root / f"models/swept-{i}/training.json").read_text())["job_num"] for i in (0, 1)] == [1, 0]


def test_summary_prints_a_table_per_base(family, tmp_path):
    """``make summary`` (python -m deltafleet.train.summary): the trained family's held-out losses,
    and a fine-tune of another base (the real base's ``smollm2-coder``) in a table of its own rather
    than a second "coder" row among the tiny family's."""
    root, _, _ = family
    models = tmp_path / "models"
    shutil.copytree(root / "models/coder", models / "coder", ignore=lambda d, names: [n for n in names
                                                                                     if n != "training.json"])
    rec = json.loads((models / "coder/training.json").read_text())
    (models / "smollm2-coder").mkdir()
    (models / "smollm2-coder/training.json").write_text(json.dumps(
        rec | {"base_dir": "/elsewhere/smollm2-base", "heldout/base_loss": 2.5, "heldout/loss": 2.6,
               "heldout/bitdelta_gain_recovered": None}))  # no gain over the base: null, not NaN (invalid JSON)
    (models / "base").mkdir()
    (models / "base/training.json").write_text(json.dumps({"variant": "base", "heldout/loss": 3.0}))
    r = subprocess.run([sys.executable, "-m", "deltafleet.train.summary", str(models)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"base: {root.resolve() / 'models/base'}"
    bitdelta = f"{rec['heldout/bitdelta_loss']:.4f}" if "heldout/bitdelta_loss" in rec else "—"  # export off
    assert lines[3].startswith(f"| coder | coder | {rec['heldout/base_loss']:.4f} | {rec['heldout/loss']:.4f} | "
                               f"{bitdelta} | ")
    assert lines[5] == "base: /elsewhere/smollm2-base"
    assert lines[8].startswith("| smollm2-coder | coder | 2.5000 | 2.6000 | ") and " | n/a | " in lines[8]
    assert lines[9] == "WARNING: fine-tune no better than the base on its own domain: smollm2-coder"
    assert len([x for x in lines if x.startswith("| ") and "| model |" not in x]) == 2  # not the base itself
    empty = subprocess.run([sys.executable, "-m", "deltafleet.train.summary", str(tmp_path / "none")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and "no trained variants under" in empty.stdout


def test_summary_shows_the_artifact_on_disk_not_the_one_trained(tmp_path):
    """Found by a fresh user: after ``compress/run.py variant=coder granularity=row`` the summary still
    showed the training run's artifact (its loss and bits/param) under "what the server answers with",
    and it listed an artifact that had been removed. The BitDelta columns follow the artifact on disk:
    exported again, its own bits/param and no loss; gone, nothing."""
    models, arts = tmp_path / "models", tmp_path / "artifacts"
    rec = {"variant": "coder", "domain": "coder", "base_dir": "/b", "heldout/base_loss": 3.0, "heldout/loss": 2.0,
           "heldout/bitdelta_loss": 2.2, "heldout/bitdelta_gain_recovered": 0.8, "export/bits_per_parameter": 1.078}
    for name, run_id in (("a", "r1"), ("b", "export/b/later"), ("c", None)):
        (models / name).mkdir(parents=True)
        (models / name / "training.json").write_text(json.dumps(
            rec | {"run_id": "r1" if name == "a" else "r0", "export/out_dir": str(arts / name)}))
        if run_id is not None:
            (arts / name).mkdir(parents=True)
            (arts / name / "bitdelta.json").write_text(json.dumps(
                {"provenance": {"run_id": run_id}, "stats": {"bits_per_parameter": 1.14}}))
    r = subprocess.run([sys.executable, "-m", "deltafleet.train.summary", str(models)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2:5] == ["| a | coder | 3.0000 | 2.0000 | 2.2000 | 0.80 | 1.078 |",
                          "| b | coder | 3.0000 | 2.0000 | — | — | 1.140* |",
                          "| c | coder | 3.0000 | 2.0000 | — | — | gone |"]
    assert lines[5:7] == [f"b: its artifact ({arts / 'b'}) was exported again after training: * its own "
                          "bits/param; `make eval` scores its loss",
                          f"c: its artifact ({arts / 'c'}) is gone: nothing of it is served"]


def test_exporting_the_base_is_refused(family):
    root, _, _ = family
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "compress/run.py", "variant=base", f"paths.root={root}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "variant=base is the base itself" in proc.stderr + proc.stdout
    assert not (root / "artifacts/base").exists()


@pytest.mark.parametrize("override, message", [
    ("trainer=deepspeed_zero3", "trainer=deepspeed_zero3 needs CUDA GPUs and this machine has none"),
    ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps must be a whole number, at least 1, got 0"),
    ("export.granularity=bogus", "export.granularity must be one of ('matrix', 'row', 'rowcol'), got 'bogus'"),
    # found by a fresh user: fit found no batch, then saving failed with a TypeError traceback
    ("variant.batch_size=100000", "the legal train split holds "),
    # found by a fresh user: Lightning refused these only after the data and the model loaded
    ("trainer.precision=banana", "trainer.precision must be one of Lightning's 64, 32, 16, transformer-engine, "),
    ("trainer.val_check_interval=0", "trainer.val_check_interval must be a whole number of steps ≥ 1, a fraction "
                                     "of an epoch in (0, 1] or a time (Lightning's \"DD:HH:MM:SS\" or {seconds: ...}), "
                                     "got 0"),
    # found by a reviewer: Lightning's loop failed on it with a ZeroDivisionError traceback
    ("+trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches must be a whole number of batches ≥ 1, "
                                           "got 0"),
])
def test_bad_settings_fail_before_training(family, override, message):
    root, _, _ = family
    if override.startswith("trainer=") and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    before = sorted(p.name for p in (root / "models").iterdir())
    proc = subprocess.run([sys.executable, "train/run.py", "variant=legal", f"paths.root={root}",
                           *SMALL_MODEL, *SMALL_RUN, override], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and f"train: ValueError: {message}" in proc.stderr
    if "batch_size" in override:
        assert "blocks of 64 tokens, fewer than one batch (variant.batch_size=100000): nothing to train on" in proc.stderr
    assert "Traceback" not in proc.stderr and "Trainer.fit" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in (root / "models").iterdir()) == before


def test_summary_names_the_records_it_cannot_use(tmp_path, capsys):
    """Found by a fresh user: a truncated ``training.json`` ended ``make summary`` in a JSONDecodeError
    traceback, and a record missing its held-out losses was dropped from the table without a word.
    Each is now left out with a line naming it; the readable records are still tabled."""
    from deltafleet.train.summary import collect

    good = {"variant": "coder", "domain": "coder", "heldout/base_loss": 5.0, "heldout/loss": 4.0}
    for name, text in [("coder", json.dumps(good)), ("math", '{"variant": "math", "heldout/base'),
                       ("writer", json.dumps({"variant": "writer", "heldout/loss": 4.0})),
                       ("base", json.dumps({"variant": "base", "heldout/loss": 3.0}))]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "training.json").write_text(text)
    rows = collect(tmp_path)
    assert [r["model"] for r in rows] == ["coder"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"skipped {tmp_path / 'math' / 'training.json'}: not a readable JSON")
    assert err[1] == (f"skipped {tmp_path / 'writer' / 'training.json'}: it records no heldout/base_loss "
                      "(a run stopped before its evaluation?)")


def test_summary_leaves_out_a_base_trained_under_another_name(tmp_path, capsys):
    """Found by a reviewer: a base trained under another name (``variant=base variant.name=base2``)
    was not left out as a base, but named on stderr as a fine-tune whose run stopped before its
    evaluation. A record of a model trained from scratch (``heldout/initial_loss``) is a base."""
    from deltafleet.train.summary import collect

    good = {"variant": "coder", "domain": "coder", "heldout/base_loss": 5.0, "heldout/loss": 4.0}
    for name, rec in [("coder", good), ("base2", {"variant": "base2", "domain": "general",
                                                  "heldout/initial_loss": 8.3, "heldout/loss": 3.0})]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "training.json").write_text(json.dumps(rec))
    assert [r["model"] for r in collect(tmp_path)] == ["coder"]
    assert capsys.readouterr().err == ""
