"""The training job's steps as Lightning runs them (train/run.py, train/callbacks.py): which step a
checkpoint, a validation and a merge belong to, across resumes, gradient accumulation and the
callbacks a user adds. Each case was found by a reviewer; every run is a few steps of a tiny model."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMALL_RUN = ["variant.batch_size=4", "variant.seq_len=32", "variant.limit_val_batches=2", "eval_batches=2",
             "logger=csv", "export.enabled=false", "variant.warmup_steps=1", "threads=1", "overwrite=true"]

pytestmark = pytest.mark.slow


def train(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train/run.py", "variant=coder", *SMALL_RUN, *args, f"paths.root={root}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny base (models/base and its tokenizer) and a coder domain of Python's own sources."""
    from tests.conftest import build_tiny_family

    root = tmp_path_factory.mktemp("steps")
    build_tiny_family(root, variants=())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    splits = {"train": ["textwrap.py", "string.py", "fnmatch.py", "shlex.py"], "val": ["glob.py"],
              "test": ["bisect.py", "keyword.py"]}
    (root / "data" / "coder").mkdir(parents=True)
    for split, files in splits.items():
        (root / "data" / "coder" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": (stdlib / f).read_text()[:20000]}) + "\n" for f in files))
    return root


def merges(root: Path, name: str) -> list[tuple]:
    """``(step, skipped, best_step)`` of each merge the CSV logs of variant ``name`` record, in order."""
    rows = []
    for f in sorted((root / "outputs/csv" / name).glob("version_*/metrics.csv")):
        rows += [(float(r["merge/step"]), float(r["merge/skipped"]), float(r.get("merge/best_step") or -1))
                 for r in csv.DictReader(f.open()) if r.get("merge/step")]
    return rows


def test_a_resumed_run_merges_with_the_validation_of_its_resume_step(root):
    """The checkpoint of step 2 was written before step 2's validation, and a resume does not run that
    validation again: the resumed run had lost it, and skipped its merge at step 4 ("no best
    checkpoint yet") where the unbroken run merged with best@2. A step's checkpoint now follows its
    validation (``StepCheckpoint``)."""
    common = ["variant.val_check_interval=2", "checkpoint.every_n_steps=2", "merge.every_n_steps=4",
              "merge.val_batches=1"]
    train(root, *common, "variant.name=unbroken", "trainer.max_steps=4")
    train(root, *common, "variant.name=resumed", "trainer.max_steps=2")
    train(root, *common, "variant.name=resumed", "trainer.max_steps=4", "ckpt_path=last")
    assert merges(root, "unbroken") == merges(root, "resumed") == [(4, 0, 2)]


def test_val_check_interval_counts_optimizer_steps_under_gradient_accumulation(root):
    """docs/training.md counts ``variant.val_check_interval`` in optimizer steps, and Lightning counts it
    in training batches: with ``accumulate_grad_batches=2`` validation ran every step, and the merge at
    step 2 went ahead with best@1 where docs/training.md says the first merge finds no validation."""
    train(root, "variant.name=accum", "trainer.max_steps=2", "+trainer.accumulate_grad_batches=2",
          "variant.val_check_interval=2", "merge.every_n_steps=2", "merge.val_batches=1")
    assert merges(root, "accum") == [(2, 1, -1)]


def test_the_compare_merges_report_puts_validations_at_the_steps_they_followed(root):
    """compare_merges read Lightning's CSV ``step`` column, a step's index, so validation every 2 steps
    came back at steps 1 and 3, beside merges at step 4."""
    from deltafleet.train.compare_merges import collect

    run_dir = root / "outputs" / "cmp" / "coder-average"
    train(root, "variant.name=cmp", "trainer.max_steps=4", "merge=average", "merge.every_n_steps=4",
          "merge.val_batches=1", "variant.val_check_interval=2", f"hydra.run.dir={run_dir}",
          f"logger.save_dir={run_dir}/csv", "trainer.log_every_n_steps=1")
    result = collect("coder", "average", run_dir, None)
    assert [m["step"] for m in result["merges"]] == [4]
    assert [step for step, _ in result["val_curve"]] == [2, 4]


def test_a_merge_ema_checkpoint_resumed_with_another_merge_continues_from_the_runs_weights(root):
    """Lightning's EMA callback writes the average into a checkpoint's ``state_dict`` and the run's own
    weights beside it (``current_model_state``); resumed without that callback, the run continued from
    the average. One more step lands next to the run's own weights, not next to the average."""
    from safetensors.torch import load_file

    common = ["variant.val_check_interval=100", "checkpoint.every_n_steps=10", "variant.name=emares"]
    train(root, *common, "trainer.max_steps=10", "merge=ema")
    last = sorted((root / "outputs/train/emares").glob("*/checkpoints/last.ckpt"))[-1]
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    current = {k.removeprefix("model."): v for k, v in ckpt["current_model_state"].items()}
    average = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    train(root, *common, "trainer.max_steps=11", "merge=none", f"ckpt_path={last}")
    w = load_file(str(root / "models/emares/model.safetensors"))

    def distance(ref: dict) -> float:
        return max((w[k] - ref[k]).abs().max().item() for k in w)

    assert distance(current) < distance(average) / 10, (distance(current), distance(average))


def test_callbacks_given_on_the_command_line_run_beside_the_jobs_own(root):
    """``+trainer.callbacks=[...]`` passed the settings check and was then replaced by the job's own
    callbacks: an EarlyStopping that stops at the first validation ran all 6 steps."""
    es = "{_target_:lightning.pytorch.callbacks.EarlyStopping,monitor:val/loss,stopping_threshold:100}"
    train(root, "variant.name=early", "trainer.max_steps=6", "variant.val_check_interval=2",
          f"+trainer.callbacks=[{es}]")
    assert json.loads((root / "models/early/training.json").read_text())["global_step"] == 2
