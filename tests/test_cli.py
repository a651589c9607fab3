"""Ctrl-C in a job (deltafleet/cli.py): one line and exit status 130, also inside Lightning's fit; a user's
mistake is one line too, a bug keeps its traceback."""
from __future__ import annotations

import signal

import lightning as L
import pytest
import torch

from deltafleet.cli import fit, interruptible, user_errors


class _Interrupted(L.LightningModule):
    """Ctrl-C at the first training step."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        raise KeyboardInterrupt

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(autouse=True)
def _sigint_kept():
    """Lightning ignores SIGINT once it has caught a Ctrl-C; later tests (and the subprocesses they
    start, which inherit an ignored signal) get the handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def _trainer(tmp_path) -> L.Trainer:
    return L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)


def test_ctrl_c_during_fit_ends_the_job_with_status_130(tmp_path, capsys):
    """Lightning turns Ctrl-C into its own shutdown and ``sys.exit(1)``; :func:`fit` raises it again."""
    trainer = _trainer(tmp_path)
    with pytest.raises(SystemExit) as exit_info, interruptible("train"):
        fit(trainer, _Interrupted())
    assert exit_info.value.code == 130 and trainer.interrupted
    assert capsys.readouterr().err.endswith("\ntrain: interrupted\n")


def test_fit_leaves_other_exits_alone(tmp_path):
    """A ``sys.exit`` that is not an interrupted run passes unchanged."""

    class _Exits(_Interrupted):
        def training_step(self, batch, batch_idx):
            raise SystemExit(3)

    trainer = _trainer(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        fit(trainer, _Exits())
    assert exit_info.value.code == 3


def test_a_user_error_is_one_line_and_a_bug_keeps_its_traceback():
    """Found by a fresh user: an output folder they may not write printed a traceback through
    deltafleet/atomic.py. PermissionError is the user's (as ValueError, FileNotFoundError, ...)."""
    with pytest.raises(SystemExit) as exit_info, user_errors("export"):
        raise PermissionError(1, "Operation not permitted", "/ro/.art.tmp")
    assert exit_info.value.code == "export: PermissionError: [Errno 1] Operation not permitted: '/ro/.art.tmp'"
    with pytest.raises(RuntimeError, match="a bug"), user_errors("export"):
        raise RuntimeError("a bug")


def test_sigterm_during_fit_ends_the_job_with_status_143(tmp_path):
    """Found by a fresh user: Lightning stops at the step after a SIGTERM with a ``SystemExit`` of
    status 0, so a run killed by ``timeout`` or a scheduler looked finished. :func:`fit` makes it 143."""
    import os

    class _Terminated(_Interrupted):
        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            return (self.w * batch).sum()

    handler = signal.getsignal(signal.SIGTERM)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            fit(trainer, _Terminated())
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert exit_info.value.code == 143 and trainer.received_sigterm and trainer.global_step < 3
