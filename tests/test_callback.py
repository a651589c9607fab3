"""MonoSoupCallback on a tiny Llama: merge steps, merged weights against references computed here,
logged records (CSVLogger), resume from a checkpoint, 2-process DDP on CPU, and the merge/ configs."""
from __future__ import annotations

import copy
import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from deltafleet.merge.soup import merge_param
from test_soup import ref_monosoup, ref_rank_energy, ref_rank_effective, ref_truncate
from deltafleet.train.callbacks import MonoSoupCallback
from deltafleet.train.module import CausalLMModule

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from soup_fixtures import BlocksDataModule, tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny SVDs: one thread is fastest, and it leaves the machine's other cores alone."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Capture(L.Callback):
    """Weights (and the soup's best snapshot) at every merge step, before or after the soup runs."""

    def __init__(self, soup: MonoSoupCallback, every: int):
        self.soup, self.every = soup, every
        self.weights: dict[int, dict] = {}
        self.best: dict[int, dict | None] = {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        step = trainer.global_step
        if step % self.every == 0 and step not in self.weights:
            self.weights[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.best[step] = None if self.soup.best is None else {n: t.clone() for n, t in self.soup.best.items()}


def make_trainer(tmp_path: Path, max_steps: int, callbacks: list, val_every: int = 2, **kw) -> L.Trainer:
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=val_every,
                     check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     default_root_dir=str(tmp_path), **kw)


def make_module(seed: int = 0, max_steps: int = 9) -> CausalLMModule:
    return CausalLMModule(tiny_llama(seed), lr=1e-2, weight_decay=0.0, warmup_steps=1, max_steps=max_steps)


def reference_merge(method: str, base: torch.Tensor, ws: list[torch.Tensor], **kw) -> torch.Tensor:
    """Plain-torch merge of one parameter (full SVDs and explicit sums; see tests/test_soup.py)."""
    ws64 = [w.double() for w in ws]
    if base.dim() < 2 or method == "average":
        return sum(ws64) / len(ws64)
    b = base.double()
    if method == "svd_soup":
        return b + sum(ref_truncate(w - b, kw["rank"]) for w in ws64) / len(ws64)
    delta = sum(ws64) / len(ws64) - b
    s = torch.linalg.svd(delta.reshape(delta.shape[0], -1)).S.tolist()
    k = ref_rank_energy(s, kw["energy_ratio"]) if kw["rank_mode"] == "energy" else ref_rank_effective(s)
    return b + ref_monosoup(delta, k)


def val_ce(model, dm: BlocksDataModule, weights: dict, batches: int) -> float:
    """Token CE of ``model`` with ``weights`` (named as in the LightningModule) on the first val batches."""
    m = copy.deepcopy(model)
    m.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()}, strict=False)
    m.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(dm.val_dataloader()):
            if i == batches:
                break
            out = m(input_ids=batch, labels=batch)
            total += out.loss.item() * batch[:, 1:].numel()
            count += batch[:, 1:].numel()
    return total / count


KW = dict(energy_ratio=0.8, rank_mode="energy", rank=4)


@pytest.mark.parametrize("method, rank_mode", [("monosoup", "energy"), ("monosoup", "effective_rank"),
                                               ("svd_soup", "energy"), ("average", "energy")])
def test_merge_steps_weights_and_csv_records(tmp_path, method, rank_mode, caplog):
    caplog.set_level("INFO")
    kw = {**KW, "rank_mode": rank_mode}
    module, dm = make_module(), BlocksDataModule()
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    soup = MonoSoupCallback(method=method, every_n_steps=3, val_batches=2, **kw)
    pre, post = Capture(soup, 3), Capture(soup, 3)
    logger = CSVLogger(tmp_path, name="csv")
    trainer = make_trainer(tmp_path, 9, [pre, soup, post], logger=logger, log_every_n_steps=1)
    trainer.fit(module, datamodule=dm)

    # merges at steps 3, 6, 9 (validation every 2 steps: a best checkpoint exists from step 2 on)
    assert [r["step"] for r in soup.records] == [3, 6, 9]
    assert all(r["skipped"] == 0 and r["method"] == method for r in soup.records)
    assert all(torch.equal(soup.base[n], initial[n]) for n in initial)  # W_base = weights at the start
    assert sorted(pre.weights) == [3, 6, 9]
    for step in (3, 6, 9):
        best = pre.best[step]
        assert best is not None
        for name, merged in post.weights[step].items():
            ref = reference_merge(method, initial[name], [pre.weights[step][name], best[name]], **kw)
            torch.testing.assert_close(merged.double(), ref, atol=2e-5, rtol=1e-4, msg=f"{name} @ step {step}")
        assert any(not torch.equal(post.weights[step][n], pre.weights[step][n]) for n in initial)

    # validation loss before/after: the first val_batches batches, recomputed here
    first = soup.records[0]
    assert first["val_loss_before"] == pytest.approx(val_ce(module.model, dm, pre.weights[3], 2), rel=1e-5)
    assert first["val_loss_after"] == pytest.approx(val_ce(module.model, dm, post.weights[3], 2), rel=1e-5)
    if method == "monosoup":
        assert 1 <= first["mean_rank"] and 0.0 < first["mean_energy_kept"] <= 1.0
        assert 0.0 <= first["mean_lambda_low"] <= 1.0
    if method == "svd_soup":
        assert first["mean_rank"] <= 4
    # the log line gives a rank and an energy kept for the SVD methods only (a plain mean has neither)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[merge] step ")]
    assert len(lines) == 3 and all((", mean rank " in line) == (method != "average") for line in lines), lines

    # the same numbers reach the CSV logger
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    merge_rows = [r for r in rows if r.get("merge/step")]
    spectral = ("merge/mean_rank", "merge/mean_energy_kept")
    for key in ("merge/step", "merge/val_loss_before", "merge/val_loss_after", *spectral, "merge/seconds"):
        if method == "average" and key in spectral:  # found by a fresh reviewer: logged as full rank, 1.0
            assert key not in rows[0], key
            continue
        assert key in rows[0], key
        assert all(math.isfinite(float(r[key])) for r in merge_rows), key
    assert [int(float(r["merge/step"])) for r in merge_rows] == [3, 6, 9]
    for r, rec in zip(merge_rows, soup.records):
        assert float(r["merge/val_loss_after"]) == pytest.approx(rec["val_loss_after"])
        if method != "average":
            assert float(r["merge/mean_rank"]) == pytest.approx(rec["mean_rank"])


def test_a_merge_is_logged_at_the_step_lightning_logs_that_steps_metrics_at(tmp_path):
    """Found by a reviewer: the merge after optimizer step 2 was logged at step 2 and that step's
    train/loss and validation at Lightning's index of it, 1, so W&B drew the merge a step late. The
    record's merge/step still counts the optimizer steps done."""
    logger = CSVLogger(tmp_path, name="csv")
    soup = MonoSoupCallback(every_n_steps=2, val_batches=1)
    make_trainer(tmp_path, 2, [soup], val_every=1, logger=logger, log_every_n_steps=1).fit(
        make_module(), datamodule=BlocksDataModule())
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    at = {key: [int(r["step"]) for r in rows if r.get(key)] for key in ("train/loss", "val/loss", "merge/step")}
    assert at == {"train/loss": [0, 1], "val/loss": [0, 1], "merge/step": [1]}
    assert [float(r["merge/step"]) for r in rows if r.get("merge/step")] == [2.0]


@pytest.mark.parametrize("own_loader", [False, True], ids=["module-without-val-loader", "module-with-another"])
def test_merge_losses_are_measured_on_the_val_dataloaders_passed_to_fit(tmp_path, own_loader):
    """Found by a reviewer: the callback asked the datamodule, else the module, for a val_dataloader()
    of its own, so with ``fit(val_dataloaders=...)`` it measured the merge on the module's other
    validation data, or, where the module has none, on nothing (NaN). It now reads the trainer's."""
    from torch.utils.data import DataLoader

    from soup_fixtures import arithmetic_blocks

    class OwnVal(CausalLMModule):
        def val_dataloader(self):  # data the trainer does not validate on
            return DataLoader(arithmetic_blocks(8, 16, seed=3), batch_size=4)

    cls = OwnVal if own_loader else CausalLMModule
    module = cls(tiny_llama(0), lr=1e-2, weight_decay=0.0, warmup_steps=1, max_steps=9)
    dm = BlocksDataModule()
    soup = MonoSoupCallback(every_n_steps=2, val_batches=1)
    pre = Capture(soup, 2)
    make_trainer(tmp_path, 2, [pre, soup], val_every=1).fit(module, train_dataloaders=dm.train_dataloader(),
                                                             val_dataloaders=dm.val_dataloader())
    assert soup.records[0]["val_loss_before"] == pytest.approx(val_ce(module.model, dm, pre.weights[2], 1), rel=1e-5)


def test_merge_without_a_best_checkpoint_is_skipped_and_recorded(tmp_path):
    module = make_module()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    soup = MonoSoupCallback(every_n_steps=2, val_batches=1)
    pre, post = Capture(soup, 2), Capture(soup, 2)
    make_trainer(tmp_path, 4, [pre, soup, post], val_every=3).fit(module, datamodule=BlocksDataModule())
    assert soup.records[0]["step"] == 2 and soup.records[0]["skipped"] == 1
    assert "no best checkpoint" in soup.records[0]["reason"]
    assert all(torch.equal(pre.weights[2][n], post.weights[2][n]) for n in before)  # untouched at step 2
    assert soup.records[1]["step"] == 4 and soup.records[1]["skipped"] == 0 and soup.best_step == 3


def test_merges_beside_lightnings_weight_averaging_are_refused_at_setup(tmp_path):
    """The merges and Lightning's EMA both rewrite the weights and do not compose (train/run.py refuses
    the pair in the config; here for a Trainer built in Python): refused, both named, before step 1."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    with pytest.raises(ValueError, match=r"^MonoSoupCallback \(method average\) and EMAWeightAveraging both rewrite "):
        make_trainer(tmp_path, 2, [MonoSoupCallback(method="average", every_n_steps=1), EMAWeightAveraging()]).fit(
            make_module(), datamodule=BlocksDataModule())
    trainer = make_trainer(tmp_path, 1, [MonoSoupCallback(method="none"), EMAWeightAveraging()])
    trainer.fit(make_module(), datamodule=BlocksDataModule())  # an inert merge callback: the EMA alone
    assert trainer.global_step == 1


def test_a_checkpoint_saved_while_a_merge_writes_the_weights_is_refused_on_resume(tmp_path):
    """Found by a fresh reviewer: a checkpoint taken on an exception in the middle of a merge (Ctrl-C
    beside Lightning's ``OnExceptionCheckpoint``, or SLURM's requeue in a signal handler) held weights
    part merged, and a resume went on from them without a word. The callback's state names the merge
    under way (None once it ends); ``check_resume`` refuses such a checkpoint."""
    from types import SimpleNamespace

    from deltafleet.train.run import check_resume

    soup = MonoSoupCallback(every_n_steps=2, val_batches=1)
    soup.best_step = 1

    def interrupted(trainer, pl_module):
        raise KeyboardInterrupt

    soup.merge = interrupted
    trainer = SimpleNamespace(global_step=4)
    with pytest.raises(KeyboardInterrupt):
        soup.on_train_batch_end(trainer, None, None, None, 0)
    state = soup.state_dict()
    assert state["merging"] == 4
    path = tmp_path / "on_exception.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 4, "callbacks": {"MonoSoupCallback": state}}, path)
    with pytest.raises(ValueError, match=r"was saved while the merge at step 4 was writing the weights .*: some are "
                                         r"merged, some not; resume from an earlier checkpoint$"):
        check_resume(str(path), "coder")
    soup.merge = lambda trainer, pl_module: {"val_loss_before": 1.0, "val_loss_after": 1.0, "seconds": 0.0,
                                             "mean_rank": 1.0, "mean_energy_kept": 1.0}
    soup._log = lambda trainer, record: None
    trainer.global_step = 6
    soup.on_train_batch_end(trainer, None, None, None, 0)
    assert soup.state_dict()["merging"] is None  # a merge that ended
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 6, "callbacks": {"MonoSoupCallback": soup.state_dict()}},
               path)
    check_resume(str(path), "coder")


def test_method_none_does_nothing(tmp_path):
    soup = MonoSoupCallback(method="none", every_n_steps=1)
    make_trainer(tmp_path, 3, [soup]).fit(make_module(), datamodule=BlocksDataModule())
    assert soup.records == [] and soup.base is None and soup.best is None and soup.best_step == -1


def test_resume_restores_best_checkpoint(tmp_path):
    soup1 = MonoSoupCallback(every_n_steps=3, val_batches=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(tmp_path, 6, [soup1, ckpt], enable_checkpointing=True).fit(make_module(max_steps=12),
                                                                             datamodule=BlocksDataModule())
    assert soup1.best_step > 0 and [r["step"] for r in soup1.records] == [3, 6]
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_file()

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = copy.deepcopy(soup2.state_dict())

    soup2, probe = MonoSoupCallback(every_n_steps=3, val_batches=2), Probe()
    # a fresh module with other random weights: everything must come from the checkpoint
    make_trainer(tmp_path, 9, [soup2, probe]).fit(make_module(seed=1, max_steps=12), datamodule=BlocksDataModule(),
                                                  ckpt_path=str(last))
    s = probe.state
    assert s["best_val_loss"] == soup1.best_val_loss and s["best_step"] == soup1.best_step
    assert s["best"].keys() == soup1.best.keys() and s["base"].keys() == soup1.base.keys()
    assert all(torch.equal(s["best"][n], soup1.best[n]) for n in soup1.best)
    assert all(torch.equal(s["base"][n], soup1.base[n]) for n in soup1.base)
    assert s["records"] == soup1.records
    # training went on from step 6 and merged again at 9 with the restored base
    assert [r["step"] for r in soup2.records] == [3, 6, 9]
    assert all(torch.equal(soup2.base[n], soup1.base[n]) for n in soup1.base)


def test_a_resume_without_merge_state_takes_w_base_from_the_base(tmp_path):
    """Found by a reviewer: resuming with a soup (``merge=monosoup``) from a checkpoint written with
    ``merge=none`` or ``merge=ema``, which holds no state of this callback, took the resumed fine-tuned
    weights as ``W_base``, so every later merge worked on task vectors from step N, not from the base.
    W_base is now read from ``base_dir``, which train/run.py passes to the soups; a fresh run, and a
    resume with the callback's state, keep theirs (test_resume_restores_best_checkpoint)."""
    from hydra import compose, initialize_config_dir

    from deltafleet.train.run import build_callbacks

    base_dir = tmp_path / "base"
    tiny_llama(0).save_pretrained(base_dir)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(tmp_path, 4, [ckpt], enable_checkpointing=True).fit(make_module(max_steps=12),
                                                                      datamodule=BlocksDataModule())
    last = tmp_path / "ckpt" / "last.ckpt"
    resumed = torch.load(last, map_location="cpu", weights_only=False)
    assert "MonoSoupCallback" not in resumed["callbacks"]

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.base = {n: t.clone() for n, t in soup.base.items()}

    soup, probe = MonoSoupCallback(every_n_steps=4, val_batches=2, base_dir=str(base_dir)), Probe()
    make_trainer(tmp_path, 8, [soup, probe]).fit(make_module(seed=1, max_steps=12), datamodule=BlocksDataModule(),
                                                 ckpt_path=str(last))
    base = {f"model.{n}": p for n, p in tiny_llama(0).named_parameters()}
    assert probe.base.keys() == base.keys()
    assert all(torch.equal(probe.base[n], base[n]) for n in base)
    assert any(not torch.equal(resumed["state_dict"][n], base[n]) for n in base)  # not the resumed weights
    assert [(r["step"], r["skipped"]) for r in soup.records] == [(8, 0)]  # a merge over that base ran

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):  # what train/run.py passes
        for merge, want in (("monosoup", f"{tmp_path}/models/base"), ("svd_soup", f"{tmp_path}/models/base"),
                            ("ema", None)):
            cfg = compose("train", ["variant=coder", f"paths.root={tmp_path}", f"merge={merge}"])
            (cb,) = [c for c in build_callbacks(cfg, tmp_path) if not isinstance(c, ModelCheckpoint)]
            assert getattr(cb, "base_dir", None) == want


def test_step_checkpoint_with_epoch_end_validation_saves_after_it(tmp_path):
    """Found by a reviewer: with validation at each epoch's end (``check_val_every_n_epoch=1``,
    ``val_check_interval=1.0``) a step checkpoint due at an epoch's last batch was deferred to the
    validation's end, where Lightning saves only for validation run within the epoch: none was written.
    It is now written once that validation has ended, holding the best checkpoint it found."""
    from deltafleet.train.callbacks import StepCheckpoint

    soup = MonoSoupCallback(every_n_steps=100, val_batches=1)
    ckpt = StepCheckpoint(dirpath=tmp_path / "ckpt", filename="step{step:06d}", every_n_train_steps=4,
                          save_top_k=-1, save_last=True, auto_insert_metric_name=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, limit_train_batches=4, check_val_every_n_epoch=1,
                        val_check_interval=1.0, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[soup, ckpt],
                        default_root_dir=str(tmp_path))
    trainer.fit(make_module(), datamodule=BlocksDataModule())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt", "step000004.ckpt",
                                                                     "step000008.ckpt"]
    state = torch.load(tmp_path / "ckpt" / "step000004.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 4 and state["callbacks"]["MonoSoupCallback"]["best_step"] == 4


def test_a_sigterm_during_the_validation_a_step_checkpoint_waits_for_saves_it(tmp_path):
    """Found by a fresh reviewer: a step checkpoint deferred to the end of the validation right after
    its step was lost when SIGTERM (a preemption) stopped that validation: only the one before was
    left, where plain Lightning saves the step before validating. It is saved as the run stops."""
    from deltafleet.train.callbacks import StepCheckpoint

    class Preempted(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            if trainer.global_step == 6:
                raise SystemExit(143)  # what deltafleet.cli.stop_on_sigterm raises on SIGTERM

    ckpt = StepCheckpoint(dirpath=tmp_path / "ckpt", filename="step{step:06d}", every_n_train_steps=3,
                          save_top_k=-1, save_last=True, auto_insert_metric_name=False)
    trainer = make_trainer(tmp_path, 9, [MonoSoupCallback(every_n_steps=100, val_batches=1), ckpt, Preempted()],
                           val_every=3, enable_checkpointing=True)
    with pytest.raises(SystemExit):
        trainer.fit(make_module(), datamodule=BlocksDataModule())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt", "step000003.ckpt",
                                                                     "step000006.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 6


def test_ddp_two_ranks_merge_identically(tmp_path, method="monosoup"):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ddp_soup.py"), str(tmp_path), method], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["pre"].keys() == r1["pre"].keys()
    assert all(torch.equal(r0["pre"][n], r1["pre"][n]) for n in r0["pre"])  # DDP kept the replicas equal
    assert all(torch.equal(r0["post"][n], r1["post"][n]) for n in r0["post"])  # both ranks: the same merge
    assert any(not torch.equal(r0["post"][n], r0["pre"][n]) for n in r0["pre"])
    assert r0["best_step"] == 2 and [r["step"] for r in r0["records"]] == [3]
    drop = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]  # noqa: E731
    assert drop(r0["records"]) == drop(r1["records"])  # the same record on both ranks (timings aside)
    kw = dict(energy_ratio=0.8, rank_mode="energy", rank=8)
    for name, merged in r0["post"].items():
        single, _ = merge_param(method, r0["base"][name], [r0["pre"][name], r0["best"][name]], **kw)
        torch.testing.assert_close(merged, single, atol=1e-6, rtol=1e-6, msg=name)
        ref = reference_merge(method, r0["base"][name], [r0["pre"][name], r0["best"][name]], **kw)
        torch.testing.assert_close(merged.double(), ref, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_deepspeed_zero2_zero3_read_write_full_parameters(tmp_path):
    """ZeRO-2/3 on 2 CPU processes (gloo): full fp32 reads, and writes that reach the fp32 master."""
    pytest.importorskip("deepspeed")
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "deepspeed_params.py"), str(tmp_path)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    for r in (0, 1):
        result = json.loads((tmp_path / f"ds_rank{r}.json").read_text())
        assert result == {f"zero{s}": {"read": True, "master": True, "model_after_step": True} for s in (2, 3)}


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "merge").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_merge_config_instantiates(path):
    cb = instantiate(OmegaConf.load(path))
    if path.stem == "ema":  # the reference the comparison measures against
        from lightning.pytorch.callbacks import EMAWeightAveraging

        assert isinstance(cb, EMAWeightAveraging)
        return
    assert isinstance(cb, MonoSoupCallback)
    assert cb.method == path.stem and cb.every_n_steps == 1000
    if path.stem == "monosoup":
        assert cb.merge_kwargs["energy_ratio"] == 0.8 and cb.merge_kwargs["rank_mode"] == "energy"
    if path.stem == "svd_soup":
        assert cb.merge_kwargs["rank"] == 8


def test_merge_config_group_is_complete():
    assert sorted(p.stem for p in (ROOT / "conf" / "merge").glob("*.yaml")) == ["average", "ema", "monosoup",
                                                                               "none", "svd_soup"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="^method must be one of monosoup, svd_soup, average, none, got 'ties'$"):
        MonoSoupCallback(method="ties")
    with pytest.raises(ValueError, match=r"^energy_ratio must be a number in \(0, 1\], got 1.5$"):
        MonoSoupCallback(energy_ratio=1.5)
    with pytest.raises(ValueError, match="^rank must be a whole number ≥ 1, got 0$"):
        MonoSoupCallback(method="svd_soup", rank=0)
    # of the wrong kind: named, where `'abc' < 1` was a TypeError naming nothing (found by a fresh user)
    with pytest.raises(ValueError, match="^every_n_steps must be a whole number ≥ 1, got 'abc'$"):
        MonoSoupCallback(every_n_steps="abc")
    with pytest.raises(ValueError, match="^val_batches must be a whole number ≥ 0, got 2.5$"):
        MonoSoupCallback(val_batches=2.5)
    with pytest.raises(ValueError, match="rank_mode"):
        MonoSoupCallback(rank_mode="variance")
    with pytest.raises(ValueError, match="every_n_steps"):
        MonoSoupCallback(every_n_steps=0)


def test_step_progress_bar_labels_a_step_bounded_run_without_the_minus_two(tmp_path):
    """Found by a fresh user: ``max_steps`` alone (Lightning's fit sets ``max_epochs`` −1) labelled the
    bar "Epoch 0/-2"."""
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.demos.boring_classes import BoringModel

    from deltafleet.train.callbacks import StepProgressBar, step_progress_bar

    for max_epochs, label in ((None, "Epoch 0"), (3, "Epoch 0/2")):
        bar = step_progress_bar([])
        assert isinstance(bar, StepProgressBar)
        trainer = L.Trainer(max_steps=2, max_epochs=max_epochs, callbacks=[bar], logger=False, limit_val_batches=0,
                            enable_checkpointing=False, accelerator="cpu", default_root_dir=tmp_path)
        trainer.fit(BoringModel())
        assert trainer.max_epochs == (-1 if max_epochs is None else max_epochs)
        assert bar._get_train_description(0).rstrip() == label, max_epochs
    assert step_progress_bar([], enabled=False) is None
    # as Lightning reads enable_progress_bar (found by a reviewer: +trainer.enable_progress_bar=0 added the bar
    # to a Trainer whose bar was off, a MisconfigurationException)
    assert step_progress_bar([], enabled=0) is None and isinstance(step_progress_bar([], enabled=None), StepProgressBar)
    assert step_progress_bar([TQDMProgressBar()]) is None  # a bar of the user's own: Lightning takes it
