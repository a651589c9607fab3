"""Every config in conf/ composes, and every `_target_` in it instantiates (STYLE.md habit 4)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_groups_are_the_documented_ones():
    assert group_options("variant") == ["base", "chat", "coder", "legal", "math", "writer"]
    assert set(group_options("trainer")) == {"cpu", "gpu", "ddp_cpu", "deepspeed_zero2", "deepspeed_zero3", "offload"}
    assert group_options("logger") == ["csv", "wandb"]
    assert "tiny" in group_options("model")


@pytest.mark.parametrize("variant", group_options("variant"))
def test_every_variant_resolves(variant, tmp_path):
    cfg = compose_cfg("train", [f"variant={variant}", f"paths.root={tmp_path}"])
    c = OmegaConf.to_container(cfg, resolve=True)  # raises on a missing or broken interpolation
    assert c["variant"]["name"] == variant
    assert c["out_dir"] == f"{tmp_path}/models/{variant}"
    assert c["export"]["out_dir"] == f"{tmp_path}/artifacts/{variant}"
    assert c["trainer"]["max_steps"] == c["variant"]["max_steps"]
    assert c["variant"]["init"] == ("scratch" if variant == "base" else "base")
    assert (Path(c["paths"]["data_dir"]) / c["variant"]["domain"]).name in {"general", "coder", "math", "writer", "legal", "chat"}


@pytest.mark.parametrize("trainer", group_options("trainer"))
def test_every_trainer_instantiates(trainer, tmp_path):
    import lightning as L

    cfg = compose_cfg("train", [f"trainer={trainer}", f"paths.root={tmp_path}"])
    resolved = OmegaConf.to_container(cfg.trainer, resolve=True)
    if "deepspeed" in trainer or trainer == "offload":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = instantiate(cfg.trainer.strategy)  # the strategy builds without a GPU
        assert isinstance(strategy, DeepSpeedStrategy)
        zero = strategy.config["zero_optimization"]
        assert zero["stage"] == (2 if trainer == "deepspeed_zero2" else 3)
        assert ("offload_optimizer" in zero) == (trainer == "offload")
    if cfg.trainer.accelerator == "gpu":
        import torch

        if not torch.cuda.is_available():
            assert resolved["accelerator"] == "gpu"
            pytest.skip("no CUDA device: building a GPU Trainer needs one")
    t = instantiate(cfg.trainer, default_root_dir=str(tmp_path), logger=False)
    assert isinstance(t, L.Trainer)
    assert t.max_steps == cfg.variant.max_steps


@pytest.mark.parametrize("logger", group_options("logger"))
def test_every_logger_instantiates_offline(logger, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_cfg("train", [f"logger={logger}", f"paths.root={tmp_path}", "variant=math"])
    lg = instantiate(cfg.logger)
    lg.log_metrics({"x": 1.0}, step=0)
    if logger == "wandb":
        import wandb

        try:
            assert wandb.run is not None and wandb.run.settings.mode in ("offline", "dryrun")
            assert Path(wandb.run.dir).is_relative_to(tmp_path)
        finally:
            wandb.finish()
    else:
        lg.save()
        assert (Path(lg.log_dir) / "metrics.csv").is_file()
        assert Path(lg.log_dir).is_relative_to(tmp_path)


def test_wandb_mode_decides_where_set(tmp_path, monkeypatch):
    """Found by a fresh user: WANDB_MODE=disabled still wrote an offline run (Lightning's ``offline``
    switch overwrites WANDB_MODE). Unset, the run is offline; set, wandb's own setting decides."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert compose_cfg("train", [f"paths.root={tmp_path}"]).logger.mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    lg = instantiate(compose_cfg("train", [f"paths.root={tmp_path}", "variant=math"]).logger)
    lg.log_metrics({"x": 1.0}, step=0)
    try:
        assert wandb.run is not None and wandb.run.disabled
    finally:
        wandb.finish()
    assert not (tmp_path / "outputs" / "wandb").exists()


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_job_config_composes(name, tmp_path):
    overrides = [f"paths.root={tmp_path}"]
    if name in ("export", "distill"):
        overrides.append("variant=coder")
    cfg = compose_cfg(name, overrides)
    OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("job", ["eval", "distill"])
def test_scale_distillation_takes_the_familys_lr(job, tmp_path):
    # Adam moves each α by about lr per step: the lr is the family's, since α's size is the model's
    need = ["variant=coder"] if job == "distill" else []
    lrs = {}
    for model in ("tiny", "smollm2"):
        cfg = compose_cfg(job, [f"paths.root={tmp_path}", f"model={model}", *need])
        c = OmegaConf.to_container(cfg, resolve=True)
        lrs[model] = c["distill"]["lr"] if job == "eval" else c["lr"]
        assert lrs[model] == c["model"]["distill_lr"]
    assert lrs == {"tiny": 3.0e-4, "smollm2": 1.5e-5}
    cfg = compose_cfg(job, [f"paths.root={tmp_path}", "model=smollm2", "model.distill_lr=1e-6", *need])
    assert (cfg.distill.lr if job == "eval" else cfg.lr) == 1e-6


def test_multirun_sweep_dir_resolves_before_any_job_runs():
    # Hydra resolves hydra.sweep.* in the launcher, before HydraConfig (and so ${hydra:runtime.cwd},
    # which paths.root uses) exists: `train/run.py -m variant=a,b` failed at once when it did.
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    cfg.hydra.job.num = 0  # what the launcher sets for the first job
    sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=True)
    assert sweep["dir"].startswith("outputs/multirun/")
    assert sweep["subdir"] == "0_coder"


# the CPU jobs (the server has its own default, serve/run.py), each with a `threads` setting
JOBS = ("train", "export", "distill", "eval", "merge_models", "kmerge_eval", "prepare", "bench_merge", "real_base",
        "serve")


@pytest.mark.parametrize("job", JOBS)
def test_every_job_takes_a_thread_setting(job, tmp_path):
    import torch

    from deltafleet.threads import set_threads

    need = ["variant=coder"] if job in ("export", "distill") else []
    cfg = compose_cfg(job, [f"paths.root={tmp_path}", "threads=1", *need])
    before = torch.get_num_threads()
    try:
        assert set_threads(cfg) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert compose_cfg(job, [f"paths.root={tmp_path}", *need]).threads is None  # torch's own default unless set


def test_a_bad_thread_setting_is_refused_by_name():
    from deltafleet.threads import set_threads

    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"threads must be null or a positive integer"):
            set_threads(OmegaConf.create({"threads": bad}))
    assert set_threads(OmegaConf.create({})) is None and set_threads(OmegaConf.create({"threads": None})) is None
    # found by a fresh user: threads=100000 crashed torch's thread pool (a segmentation fault)
    cores = os.cpu_count() or 1
    with pytest.raises(ValueError, match=rf"^threads=100000 is more than 4 per core of this machine's {cores}: "
                                         rf"at most {4 * cores}$"):
        set_threads(OmegaConf.create({"threads": 100000}))


def test_a_job_started_with_a_bad_thread_setting_says_so(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "compress/run.py", "variant=coder", f"paths.root={tmp_path}", "threads=0"],
                       cwd=CONF.parent, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0 and "threads must be null or a positive integer, got 0" in r.stderr


def test_a_fine_tune_named_after_its_base_is_refused(tmp_path):
    """``variant.name=base`` on a fine-tune would write over the base every artifact is checked
    against: refused before training, the base untouched."""
    from deltafleet.train.run import check_config

    cfg = compose_cfg("train", ["variant=coder", "variant.name=base", f"paths.root={tmp_path}"])
    (tmp_path / "models" / "base").mkdir(parents=True)
    (tmp_path / "models" / "base" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"variant.name=base writes its fine-tune to .*models/base, the base it starts from"):
        check_config(cfg)
    assert [p.name for p in (tmp_path / "models" / "base").iterdir()] == ["config.json"]


def test_a_variant_name_that_is_no_folder_name_is_refused_before_training(tmp_path):
    """``variant.name`` names the checkpoint and artifact folders and the model id: ``a/b`` or
    ``../x`` is refused before any training, not by the export at its end."""
    from deltafleet.train.run import check_config

    for bad in ("a/b", "../x"):
        cfg = compose_cfg("train", ["variant=coder", f"variant.name={bad}", f"paths.root={tmp_path}"])
        with pytest.raises(ValueError, match=re.escape(f"variant must be a name of 1 to 64 letters, digits, '.', '_' "
                                                       f"or '-' that starts with a letter or digit, got {bad!r}")):
            check_config(cfg)


def test_a_training_keeps_an_out_dir_it_did_not_write(tmp_path):
    """Found by a fresh user: ``out_dir`` was replaced whatever it held (a folder of their own files
    went, a file became a folder), where export and merge refuse. An earlier run's checkpoint
    (``training.json``) or an empty folder is replaced; anything else needs ``overwrite=true``."""
    from deltafleet.train.run import check_config

    (tmp_path / "models" / "base").mkdir(parents=True)
    (tmp_path / "models" / "base" / "config.json").write_text("{}")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    (tmp_path / "afile").write_text("hi")
    for out, why in ((mine, r"holds files that are not an earlier training's output \(no readable training.json"),
                     (tmp_path / "afile", "exists and is not a folder"),
                     (tmp_path / "afile" / "sub", r"cannot be made: .*afile is a file, not a folder")):
        cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"out_dir={out}"])
        with pytest.raises(ValueError, match=why):
            check_config(cfg)
    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"export.out_dir={mine}"])
    with pytest.raises(ValueError, match=r"export.out_dir .*mine exists and holds files that are not an earlier "):
        check_config(cfg)
    assert (mine / "notes.txt").read_text() == "precious" and (tmp_path / "afile").read_text() == "hi"
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "training.json").write_text("{}")
    # found by a fresh user: Hydra keeps "no" as text, which bool() took for true: mine was replaced
    for extra, key in ((["overwrite=no"], "overwrite"), (["export.enabled=off"], "export.enabled")):
        cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"out_dir={mine}", *extra])
        with pytest.raises(ValueError, match=f"^{re.escape(key)} must be true or false, got '(no|off)'$"):
            check_config(cfg)
    assert (mine / "notes.txt").read_text() == "precious"
    for out, extra in ((tmp_path / "earlier", []), (mine, ["overwrite=true"])):
        cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"out_dir={out}", *extra])
        with pytest.raises(FileNotFoundError, match="make data"):  # past the out_dir check: the data is next
            check_config(cfg)
    # found by a fresh user: a file of theirs beside an earlier run's checkpoint went with it; runs
    # record their files (older records, like the one above, list none)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "training.json").write_text('{"files": ["config.json", "training.json"]}')
    (listed / "config.json").write_text("{}")
    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"out_dir={listed}"])
    with pytest.raises(FileNotFoundError, match="make data"):
        check_config(cfg)
    (listed / "mynotes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"listed exists and holds files that are not an earlier training's output "
                                         r"\(files the training did not write: mynotes.txt\)"):
        check_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("eval_batches=0", "eval_batches must be a whole number, at least 1, got 0"),
    ("variant.val_check_interval=0", "variant.val_check_interval must be a whole number, at least 1, got 0"),
    ("checkpoint.every_n_steps=abc", "checkpoint.every_n_steps must be a whole number, at least 1, got 'abc'"),
])
def test_counts_that_failed_after_training_are_refused_before_it(tmp_path, override, message):
    """Found by a fresh user: each of these trained in full (or started to), then failed with a
    traceback (ZeroDivisionError, TypeError)."""
    from deltafleet.train.run import check_config

    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", override])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("variant.warmup_steps=-3", "variant.warmup_steps must be a whole number of steps ≥ 0, got -3"),
    ("variant.min_lr_ratio=2", "variant.min_lr_ratio must be a number in [0, 1], got 2"),
    ("variant.lr=abc", "variant.lr must be a number > 0, got 'abc'"),
    ("variant.lr=0", "variant.lr must be a number > 0, got 0"),
    ("variant.weight_decay=nan", "variant.weight_decay must be a number ≥ 0, got nan"),
    ("seed=abc", "seed must be an integer in [0, 4294967295], got 'abc'"),
    ("variant.adapter=lora lora.r=0", "lora.r must be a whole number ≥ 1, got 0"),
    ("variant.adapter=lora lora.dropout=1", "lora.dropout must be a number in [0, 1), got 1"),
    ("variant.adapter=lora lora.target_modules=[]", "lora.target_modules must be a list of module names"),
])
def test_optimizer_schedule_and_lora_settings_are_checked_by_name(tmp_path, override, message):
    """Found by a fresh user: a negative warmup or a min_lr_ratio of 2 trained with it (and changed the
    result), ``variant.lr=abc`` said "could not convert string to float" without the key, and
    ``seed=abc`` or ``lora.r=0`` failed with a traceback inside Lightning or PEFT."""
    from deltafleet.train.run import check_config

    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", *override.split()])
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_config(cfg)


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_lightning_cannot_take_is_refused_by_name(tmp_path, seed):
    """Found by a reviewer: ``seed`` was checked only as an integer, so ``seed=-1`` or ``seed=4294967296``
    passed and then failed in Lightning's ``seed_everything`` (numpy's seeds: 0 to 2**32 - 1) with a
    traceback. Refused by name with the other settings, before any work; the last seed numpy takes is
    taken (the check goes on to the missing base)."""
    from deltafleet.train.run import check_config

    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"seed={seed}"])
    message = f"seed must be an integer in [0, 4294967295], got {seed}"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_config(cfg)
    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"seed={2**32 - 1}"])
    with pytest.raises(FileNotFoundError, match="no base model at "):
        check_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("variant.init=foo", "variant.init must be 'scratch' or 'base', got 'foo'"),
    ("merge=monosoup merge.every_n_steps=0", "merge.every_n_steps must be a whole number ≥ 1, got 0"),
    ("merge=monosoup merge.every_n_steps=abc", "merge.every_n_steps must be a whole number ≥ 1, got 'abc'"),
    ("merge=monosoup merge.energy_ratio=2", "merge.energy_ratio must be a number in (0, 1], got 2"),
    ("merge=monosoup merge.rank_mode=foo", "merge.rank_mode must be one of energy, effective_rank, got 'foo'"),
    ("merge=svd_soup merge.rank=0", "merge.rank must be a whole number ≥ 1, got 0"),
    ("merge=average merge.method=bogus", "merge.method must be one of monosoup, svd_soup, average, none, got 'bogus'"),
    ("merge=average +merge.rnk=4", "merge.rnk is not a setting of the merge every N steps (its settings: "),
    # found by a fresh reviewer: Hydra's instantiate error once the data and the model were loaded
    ("merge=ema merge.decay=2", "merge.decay must be a number in [0, 1] (the EMA's weight on its average), got 2"),
    ("merge=ema +merge.update_every_n_steps=0", "merge.update_every_n_steps must be a whole number ≥ 1, got 0"),
    ("variant.limit_val_batches=-1", "variant.limit_val_batches must be a whole number of batches ≥ 0 or a fraction "
                                     "in [0, 1], got -1"),
    ("variant.limit_val_batches=1.5", "variant.limit_val_batches must be a whole number of batches ≥ 0 or a "
                                      "fraction in [0, 1], got 1.5"),
])
def test_init_merge_and_validation_settings_are_refused_before_loading(tmp_path, override, message):
    """Found by a fresh user: these were refused only once the data and the model had loaded, by a
    traceback (``variant.init``), Hydra's several-line instantiation error (the merge settings; ``'abc'``
    as a TypeError naming no key) or Lightning's (``limit_val_batches``)."""
    from deltafleet.train.run import check_config

    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", *override.split()])
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_config(cfg)


EMA = "{_target_:lightning.pytorch.callbacks.EMAWeightAveraging}"


@pytest.mark.parametrize("overrides, message", [
    ([f"+trainer.callbacks=[{EMA}]"], "merge (MonoSoupCallback, method average) and trainer.callbacks[0] "
                                      "(EMAWeightAveraging) both rewrite the model's weights, and do not compose"),
    (["merge=ema", "+trainer.callbacks=[{_target_:deltafleet.train.callbacks.MonoSoupCallback,method:svd_soup}]"],
     "trainer.callbacks[0] (MonoSoupCallback, method svd_soup) and merge (EMAWeightAveraging) both rewrite"),
    (["merge=none", f"+trainer.callbacks=[{EMA}]"], None),  # the merge callback is inert
    # found by a fresh reviewer: two of one kind failed in Lightning once the model was loaded
    (["merge=monosoup", "+trainer.callbacks=[{_target_:deltafleet.train.callbacks.MonoSoupCallback,method:average}]"],
     "two merges every N steps: merge (MonoSoupCallback, method monosoup) and trainer.callbacks[0] "
     "(MonoSoupCallback, method average); a run takes one"),
    (["merge=ema", f"+trainer.callbacks=[{EMA}]"],
     "two weight averagings: merge (EMAWeightAveraging) and trainer.callbacks[0] (EMAWeightAveraging); a run takes one"),
    (["variant.adapter=lora", f"+trainer.callbacks=[{EMA}]"], None),  # no merge callback for LoRA
])
def test_merges_beside_an_ema_callback_are_refused_naming_both(tmp_path, overrides, message):
    """Found by a reviewer: the merge callback and Lightning's EMA (``+trainer.callbacks``) both rewrite the
    weights: every validation ranked the EMA's average while the merges took the weights as their best
    checkpoint, and the run ended with the average over the merges' result. The pair is refused before any
    work; a run with one of them goes on (to the missing base, here)."""
    from deltafleet.train.run import check_config

    cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", *overrides])
    with pytest.raises(ValueError if message else FileNotFoundError, match="^" + re.escape(message or "no base")):
        check_config(cfg)


def test_a_resume_from_a_run_folder_names_its_checkpoint(tmp_path):
    """Found by a fresh user: ``ckpt_path=outputs/train/<variant>`` (the run's folder) failed inside
    Lightning with a 40-line IsADirectoryError once the model had loaded; a DeepSpeed checkpoint,
    which is a folder, is still taken."""
    from deltafleet.train.run import check_resume

    run = tmp_path / "train" / "coder"
    with pytest.raises(ValueError, match=r"ckpt_path .*coder is a folder, not a checkpoint .*: pass a checkpoint "
                                         r"file, a run's checkpoints/last.ckpt$"):
        run.mkdir(parents=True)
        check_resume(str(run), "coder")
    for stamp in ("2026-12-01_10-00-00", "2026-12-02_10-00-00"):
        (run / stamp / "checkpoints").mkdir(parents=True)
        (run / stamp / "checkpoints" / "last.ckpt").write_text("x")
    newest = run / "2026-12-02_10-00-00" / "checkpoints" / "last.ckpt"
    os.utime(newest, (2e9, 2e9))
    with pytest.raises(ValueError, match=f"e.g. ckpt_path={re.escape(str(newest))}, its newest$"):
        check_resume(str(run), "coder")
    (run / "latest").write_text("checkpoint")  # DeepSpeed's layout: Lightning reads it
    check_resume(str(run), "coder")


def test_a_resume_from_a_file_that_is_no_checkpoint_is_named(tmp_path):
    from deltafleet.train.run import check_resume

    (tmp_path / "afile").write_text("hi")
    with pytest.raises(ValueError, match=r"ckpt_path .*afile is not a checkpoint torch can read"):
        check_resume(str(tmp_path / "afile"), "coder")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"ckpt_path .*other.pt is not a Lightning checkpoint \(no state_dict\)"):
        check_resume(str(tmp_path / "other.pt"), "coder")


def test_a_bad_step_count_is_refused_by_name(tmp_path):
    """Found by a fresh user: ``trainer.max_steps=abc`` failed inside Lightning ("'<' not supported
    between instances of 'str' and 'int'") and ``trainer.max_steps=0`` only after building the model
    ("Expected state_dict to be dict-like")."""
    from deltafleet.train.run import check_config

    for bad in ("abc", 0, -1, 2.5, True):
        cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"trainer.max_steps={bad}"])
        with pytest.raises(ValueError, match=re.escape(f"trainer.max_steps must be a whole number of steps, at least "
                                                       f"1, got {cfg.trainer.max_steps!r}")):
            check_config(cfg)


def test_a_bad_batch_size_or_sequence_length_is_refused_by_name(tmp_path):
    """Found by a fresh user: ``variant.batch_size=0`` failed in torch's DataLoader with a traceback,
    after the model had loaded."""
    from deltafleet.train.run import check_config

    for key, bad in (("batch_size", 0), ("batch_size", -4), ("batch_size", "abc"), ("seq_len", 0), ("seq_len", 2.5)):
        cfg = compose_cfg("train", ["variant=coder", f"paths.root={tmp_path}", f"variant.{key}={bad}"])
        with pytest.raises(ValueError, match=re.escape(f"variant.{key} must be a whole number, at least 1, got "
                                                       f"{cfg.variant[key]!r}")):
            check_config(cfg)


@pytest.mark.parametrize("script", ["train/run.py", "train/real_base.py"])
def test_a_bad_thread_count_is_one_line(tmp_path, script):
    """Found by a fresh user: ``threads=0`` printed a traceback from train/run.py and train/real_base.py
    (the other jobs already said it in one line)."""
    out = subprocess.run([sys.executable, script, "threads=0", f"paths.root={tmp_path}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    job = "train" if script == "train/run.py" else "real-base"
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == f"{job}: ValueError: threads must be null or a positive integer, got 0"
    # the run folder Hydra made holds only its own files: removed (found by a fresh user: twenty left
    # under outputs/train/<variant>/ by refused runs)
    assert not (tmp_path / "run").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    subprocess.run([sys.executable, script, "threads=0", f"paths.root={tmp_path}", f"hydra.run.dir={kept}"],
                   cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert sorted(p.name for p in kept.iterdir()) == [".hydra", "notes.txt", f"{script[6:-3]}.log"]


def test_the_jobs_check_their_settings_before_importing_the_training_stack():
    """train/run.py and train/eval.py import Lightning, datasets and transformers only once a run
    starts, after their settings are checked: a refused setting is a few seconds, not the ten those
    imports take on two cores."""
    code = ("import sys, deltafleet.train.run, deltafleet.train.eval; "
            "print(sorted(m for m in ('lightning', 'datasets', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# merge/bench.py says it as `error: ...` with status 2, as its other settings (tests/test_bench_safety.py)
@pytest.mark.parametrize("script, job", [("train/data.py", "data"), ("merge/kmerge_eval.py", "kmerge-eval")])
def test_a_bad_thread_setting_is_one_line_in_every_job(script, job, tmp_path):
    """Found by a fresh user: ``threads=0`` gave a traceback where these jobs checked it outside their
    one-line error handling; now status 1 and one line naming the job and the setting."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, script, "threads=0", f"hydra.run.dir={tmp_path / 'h'}"], cwd=root,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == f"{job}: ValueError: threads must be null or a positive integer, got 0"


@pytest.mark.parametrize("export", [True, False])
def test_the_replaced_fine_tunes_artifact_is_retired(tmp_path, capsys, export):
    """Found by a fresh user: Ctrl-C after a run had written its fine-tune but before its export left
    the previous run's artifact beside the new fine-tune, unmarked. With the export on it is removed
    (the export writes the new one next); with it off it is kept and named as stale. Another
    variant's artifact, or a folder that is no artifact, is left alone."""
    from safetensors.torch import save_file

    from deltafleet.compress.bitdelta import compress
    from deltafleet.train.run import retire_artifact

    for name, w in (("b", torch.zeros(4, 8)), ("f", torch.ones(4, 8))):
        (tmp_path / name).mkdir()
        save_file({"lin.weight": w}, tmp_path / name / "model.safetensors")
    art = tmp_path / "artifacts" / "coder"
    compress(tmp_path / "b", tmp_path / "f", art, variant="coder")
    other = OmegaConf.create({"variant": {"name": "math"}, "export": {"out_dir": str(art), "enabled": export}})
    retire_artifact(other)
    assert (art / "bitdelta.json").is_file() and capsys.readouterr().out == ""
    cfg = OmegaConf.create({"variant": {"name": "coder"}, "export": {"out_dir": str(art), "enabled": export}})
    retire_artifact(cfg)
    out = capsys.readouterr().out
    if export:
        assert not art.exists() and list((tmp_path / "artifacts").iterdir()) == []
        assert out == f"[train] removed {art}, the artifact of the fine-tune this run replaced\n"
    else:
        assert (art / "bitdelta.json").is_file()
        assert out == (f"[train] warning: {art} is the artifact of the fine-tune this run replaced, not of this one: "
                       "`make export VARIANT=coder` exports this one\n")
    retire_artifact(cfg)  # nothing there now (export on), or the same stale one again: no error


@pytest.mark.parametrize("script, override, message", [
    ("compress/run.py", "+granulariti=row", "granulariti is not a setting of conf/export.yaml; its settings: base_dir, "
                                            "finetuned_dir, force, format, granularity, hf_out_dir, max_shard_bytes, "
                                            "model, out_dir, overwrite, paths, threads, variant"),
    ("compress/run.py", "+model.nmae=x", "model.nmae is not a setting of conf/export.yaml; its settings under model: "),
    ("train/run.py", "+eval_batchs=1", "eval_batchs is not a setting of conf/train.yaml; its settings: base_dir, "
                                       "checkpoint, ckpt_path, data, eval_batches, export, logger, lora, merge, model, "
                                       "num_workers, out_dir, overwrite, paths, seed, threads, trainer, variant"),
    ("train/run.py", "+export.granulariti=row", "export.granulariti is not a setting of conf/train.yaml; its settings "
                                                "under export: enabled, granularity, out_dir"),
    ("train/run.py", "+lora.rank=4", "lora.rank is not a setting of conf/train.yaml; its settings under lora: alpha, "
                                     "dropout, r, target_modules"),
    ("train/run.py", "+trainer.accumulate_grad_batchs=2", "trainer.accumulate_grad_batchs is not a setting of "
                                                          "conf/train.yaml; its settings under trainer: _target_, "),
])
def test_a_misspelt_setting_is_refused_before_any_work(tmp_path, script, override, message):
    """Found by a fresh user: ``compress/run.py variant=coder +granulariti=row`` exported the default
    (matrix) artifact with status 0, and ``train/run.py variant=coder +eval_batchs=1`` trained with the
    default: Hydra takes ``+name=value`` for any name. Refused as serve/run.py and merge/run.py refuse
    one, ``error: ...`` and status 2, before the inputs are even looked at, the run folder removed;
    without Hydra's ERROR line about importing ``None`` before it (found by a reviewer)."""
    out = subprocess.run([sys.executable, script, "variant=coder", override, f"paths.root={tmp_path}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=CONF.parent, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, no output


@pytest.mark.parametrize("script, args, message", [
    ("compress/run.py", ["variant=coder"],
     "export: FileNotFoundError: no base model at {root}/models/base: run `make base` first"),
    ("merge/run.py", ["method=nope", "models=[a,b]"], "error: "),
    ("serve/run.py", ["+bogus=1"], "error: bogus is not a setting of conf/serve.yaml"),
    ("serve/run.py", [], "error: no base checkpoint at {root}/models/base (config.json missing)"),
])
def test_a_refused_job_removes_the_folders_made_for_its_run_and_no_other(tmp_path, script, args, message):
    """Found by fresh users: an export refused for a missing base removed its run folder but left
    ``outputs/export/<variant>/`` behind, empty, and a refused merge left its whole run folder. The
    folders Hydra made for the run go (``outputs/`` too); a folder that was there before stays, even
    empty: one of the user's next to it or above it, or a run folder given as ``hydra.run.dir``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def refused(*more):
        out = subprocess.run([sys.executable, script, *args, f"paths.root={tmp_path}", *more], cwd=CONF.parent,
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1].startswith(message.format(root=tmp_path)), out.stderr[-2000:]

    refused()
    assert list(tmp_path.iterdir()) == []
    job = {"compress/run.py": "export/coder", "merge/run.py": "merge", "serve/run.py": "serve"}[script]
    mine = [tmp_path / "outputs" / job, tmp_path / "outputs" / "other", tmp_path / "here"]
    for folder in mine:
        folder.mkdir(parents=True)
    refused()  # its run folder in outputs/<job>/, which was there
    refused(f"hydra.run.dir={tmp_path / 'here'}")  # the run folder itself was there: it stays, emptied
    assert sorted(p for p in tmp_path.rglob("*")) == sorted({*mine, *(f.parent for f in mine if f.parent != tmp_path)})
    assert all(not any(f.iterdir()) for f in mine)


@pytest.mark.parametrize("script, args", [("compress/run.py", ["variant=coder"]),
                                          ("train/run.py", ["variant=coder", "variant.lr=-1"]),
                                          ("merge/run.py", ["method=nope", "models=[a,b]"]),
                                          ("compress/run.py", ["variant=coder", "variant.name=../evil"]),
                                          ("train/run.py", ["variant=coder", "variant.name=../../x"])])
def test_a_refused_job_in_the_default_folders_leaves_nothing(tmp_path, script, args):
    """Found by a fresh user: with ``paths.root`` left at its default (``${hydra:runtime.cwd}``),
    ``RunFolders`` could not resolve the run folder before the run ("HydraConfig was not set"), warned
    on every job, and every refused job left its empty run folder under ``outputs/``. Found by another:
    a variant name with ``..`` (refused) left ``outputs/train/`` and a run folder outside ``outputs/``."""
    out = subprocess.run([sys.executable, str(CONF.parent / script), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "RunFolders" not in out.stderr and "HydraConfig was not set" not in out.stderr, out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, config", [("train/data.py", "prepare"), ("train/real_base.py", "real_base"),
                                            ("kernels/bench.py", "bench_kernels"), ("serve/bench.py", "bench_serve")])
def test_the_other_jobs_refuse_a_misspelt_setting_too(tmp_path, script, config):
    """Found by a fresh user: ``train/real_base.py +x=1`` ran (and wrote the model), as did ``make data``,
    the kernel and the serving benchmarks with a setting their config does not have. Refused as the
    other jobs refuse one: ``error: ...``, status 2, before any work, nothing left."""
    out = subprocess.run([sys.executable, script, "+bogus=1", f"paths.root={tmp_path}"], cwd=CONF.parent,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: bogus is not a setting of conf/{config}.yaml; "), \
        out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_settings_added_on_purpose_are_taken():
    """What a ``+key`` may add to train/run.py's config groups: a keyword argument of the class a group
    instantiates (``trainer``: Lightning's ``Trainer``; ``merge=ema``: its callback), anything for a
    class taking ``**kwargs``; for ``WandbLogger``, whose ``**kwargs`` go to ``wandb.init``, an argument of
    either (found by a fresh user: ``+logger.<typo>`` passed the check and failed in ``wandb.init`` with a
    traceback after the data was loaded); CSVLogger's unknown ones are refused."""
    from deltafleet.cli import check_settings

    sections = ("checkpoint", "lora", "export")
    for overrides in (["+trainer.accumulate_grad_batches=2", "+trainer.deterministic=true"],
                      ["logger=wandb", "+logger.tags=[a,b]"],
                      ["merge=ema", "+merge.update_every_n_steps=5"],
                      ["model=smollm2", "trainer=ddp_cpu", "variant=base"],
                      ["~logger"]):
        check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", *overrides]), "train.yaml", sections)
    with pytest.raises(ValueError, match=r"^logger\.flush is not a setting of conf/train\.yaml; its settings under "
                                         r"logger: .* \(or an argument of lightning\.pytorch\.loggers\.CSVLogger\)$"):
        check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", "logger=csv", "+logger.flush=2"]),
                       "train.yaml", sections)
    with pytest.raises(ValueError, match=r"^logger\.flush is not a setting of conf/train\.yaml; its settings under "
                                         r"logger: .* \(or an argument of lightning\.pytorch\.loggers\.WandbLogger "
                                         r"or wandb\.init\)$"):  # WandbLogger's **kwargs go to wandb.init: checked there
        check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", "logger=wandb", "+logger.flush=2"]),
                       "train.yaml", sections)
    with pytest.raises(ValueError, match=r"^logger\.tagz is not .* or wandb\.init\)$"):  # the class by another path
        check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", "logger=wandb", "+logger.tagz=1",
                                             "logger._target_=lightning.pytorch.loggers.wandb.WandbLogger"]),
                       "train.yaml", sections)
    for group in ("variant", "paths", "data", "checkpoint"):  # a group or section without a class: its files' keys
        with pytest.raises(ValueError, match=rf"^{group}\.bogus is not a setting of conf/train\.yaml"):
            check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", f"+{group}.bogus=1"]),
                           "train.yaml", sections)


def test_a_setting_of_another_class_of_the_group_is_refused_before_any_work(tmp_path):
    """Found by a reviewer: ``merge=ema +merge.every_n_steps=5`` passed the check of settings, as
    ``every_n_steps`` is a key of conf/merge's other files (MonoSoupCallback's), and the run loaded the
    data and the model, then failed in Lightning's setup with a TypeError traceback (EMAWeightAveraging
    passes keywords it does not take on to AveragedModel). A group's key is now one of the files that
    build the same class, or an argument of that class (EMA's own, or AveragedModel's): ``error: ...``
    and status 2, before any work; the same holds for ``logger=csv`` and WandbLogger's ``project``."""
    out = subprocess.run([sys.executable, "train/run.py", "variant=coder", "merge=ema", "+merge.every_n_steps=5",
                          f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=CONF.parent,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: merge.every_n_steps is not a setting of conf/train.yaml; its settings under merge: _target_, "
        "decay (or an argument of lightning.pytorch.callbacks.EMAWeightAveraging or "
        "torch.optim.swa_utils.AveragedModel)"), out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []

    from deltafleet.cli import check_settings

    sections = ("checkpoint", "lora", "export")
    with pytest.raises(ValueError, match=r"^logger\.project is not a setting of conf/train\.yaml; its settings under "
                                         r"logger: _target_, name, save_dir \(or an argument of "):
        check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", "logger=csv", "+logger.project=x"]),
                       "train.yaml", sections)
    for overrides in (["merge=ema", "+merge.use_buffers=false"], ["merge=average", "+merge.rank=4"]):
        check_settings(compose_cfg("train", ["variant=coder", "paths.root=/r", *overrides]), "train.yaml", sections)


@pytest.mark.parametrize("script", ["compress/run.py", "compress/distill.py"])
def test_a_scripts_help_before_its_variant_is_chosen_is_one_line(script):
    """Found by a fresh user: ``python compress/run.py --help`` ended in Hydra's traceback (its config
    cannot be composed until ``variant`` is chosen); ``deltafleet export --help`` already said so in one
    line. The script now says it as the command does; with the variant chosen, Hydra's help."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, script, "--help"], cwd=CONF.parent, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith(f"{script}: You must specify 'variant'"), out.stderr[-2000:]
    assert out.stderr.rstrip().endswith(f"e.g. `python {script} variant=coder --help`"), out.stderr[-2000:]
    chosen = subprocess.run([sys.executable, script, "variant=coder", "--help"], cwd=CONF.parent,
                            capture_output=True, text=True, timeout=300, env=env)
    assert chosen.returncode == 0 and "powered by Hydra" in chosen.stdout, chosen.stderr[-2000:]
    for script in (script, "train/run.py"):  # a misspelt choice: Hydra's one line, found by a fresh user
        typo = subprocess.run([sys.executable, script, "variant=codr", "--help"], cwd=CONF.parent,
                              capture_output=True, text=True, timeout=300, env=env)
        assert typo.returncode == 2 and typo.stderr.strip().endswith("Could not find 'variant/codr'"), \
            typo.stderr[-2000:]
        assert typo.stderr.startswith(f"{script}: In '") and len(typo.stderr.strip().splitlines()) == 1


def test_make_export_takes_a_variant_trained_under_its_own_name():
    """Found by a fresh user: ``make export VARIANT=c1`` for a fine-tune trained as
    ``variant=coder variant.name=c1`` failed in Hydra ("Could not find 'variant/c1'"). A name with no
    preset is exported under the coder preset's other settings; a preset's name is its preset."""
    def command(variant: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")}
        out = subprocess.run(["make", "-n", "export", f"VARIANT={variant}"], cwd=CONF.parent, capture_output=True,
                             text=True, timeout=60, env=env)  # not `make test ARGS=...`'s own variables
        assert out.returncode == 0, out.stderr
        return next(line.rstrip() for line in out.stdout.splitlines() if "compress/run.py" in line)

    assert command("c1").endswith("compress/run.py variant=coder variant.name=c1 format=bitdelta")
    assert command("math").endswith("compress/run.py variant=math format=bitdelta")


def test_make_distill_takes_a_variant_trained_under_its_own_name(tmp_path):
    """Found by a fresh user: ``make distill VARIANT=math50`` for the README's ``variant=math
    variant.name=math50`` failed in Hydra as ``make export`` once did. A name with no preset is distilled
    under the coder preset's settings, on the text of the domain its training.json records."""
    for name in ("conf", "pyproject.toml"):  # the presets, and what `install` depends on
        (tmp_path / name).symlink_to(CONF.parent / name)
    (tmp_path / "models" / "math50").mkdir(parents=True)
    (tmp_path / "models" / "math50" / "training.json").write_text(json.dumps(
        {"run_id": "r", "variant": "math50", "domain": "math", "files": []}, indent=2) + "\n")

    def command(variant: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")}
        out = subprocess.run(["make", "-n", "-f", str(CONF.parent / "Makefile"), "distill", f"VARIANT={variant}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        return next(line.rstrip() for line in out.stdout.splitlines() if "compress/distill.py" in line)

    assert command("math50").endswith("compress/distill.py variant=coder variant.name=math50 variant.domain=math")
    assert command("c1").endswith("compress/distill.py variant=coder variant.name=c1")  # no record: coder's text
    assert command("math").endswith("compress/distill.py variant=math")


def test_make_targets_that_read_no_corpus_do_not_fetch_it(tmp_path):
    """Found by a fresh reviewer: ``make merge`` and ``make export`` depended on ``install``, which
    downloads the Austen corpus with apt-get, so they failed offline or on a machine without apt,
    though neither reads it. They need the package alone; ``make data`` still fetches the corpus."""
    (tmp_path / "pyproject.toml").symlink_to(CONF.parent / "pyproject.toml")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")}

    def dry(target: str) -> str:
        out = subprocess.run(["make", "-n", "-f", str(CONF.parent / "Makefile"), target], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout

    for target in ("merge", "export", "serve", "kmerge-eval", "bench-merge"):
        steps = dry(target)
        assert "pip install" in steps and "apt-get" not in steps, (target, steps)
    assert "apt-get download r-cran-janeaustenr" in dry("data")


def test_a_peft_adapter_as_the_fine_tune_is_named_as_one(tmp_path):
    """Found by a fresh reviewer: ``finetuned_dir`` pointing at a PEFT (LoRA) adapter folder was told
    "no fine-tuned checkpoint ... train it first"; the folder exists and holds an adapter, which the
    export cannot read: the message says so and how to merge it into a full checkpoint."""
    from omegaconf import OmegaConf

    from deltafleet.cli import require_checkpoints

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    cfg = OmegaConf.create({"base_dir": str(tmp_path / "base"), "finetuned_dir": str(tmp_path / "lora")})
    with pytest.raises(FileNotFoundError, match=r"^.*/lora holds a PEFT adapter \(adapter_config.json\), not a full "
                                                r"checkpoint: merge it into its base first \(peft's .*merge_and_unload"):
        require_checkpoints(cfg, "lora")


def test_a_run_that_fails_or_is_stopped_is_closed_failed_in_wandb(monkeypatch):
    """Found by a fresh reviewer: train/run.py and train/eval.py closed their W&B run with
    ``wandb.finish()`` in a ``finally``, which records exit code 0 (success) before wandb's own
    handler sees the exception: a crashed, interrupted or preempted run looked finished. The run is
    closed with the job's exit status: 130 for Ctrl-C, SIGTERM's 143, 1 for an error."""
    import types

    from deltafleet.cli import finish_wandb

    codes = []
    fake = types.SimpleNamespace(run=object(), finish=lambda exit_code=None: codes.append(exit_code))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for stopped in (None, KeyboardInterrupt(), SystemExit(143), RuntimeError("diverged"), SystemExit(None)):
        finish_wandb(stopped)
    assert codes == [0, 130, 143, 1, 0]
    fake.run = None  # no run started: nothing to close
    finish_wandb(RuntimeError())
    assert len(codes) == 5
