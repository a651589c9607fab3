"""Ctrl-C in a job (deltafleet/cli.py): one line and exit status 130, also inside Lightning's fit; a user's
mistake is one line too, a bug keeps its traceback."""
from __future__ import annotations

import contextlib
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


def test_ctrl_c_once_the_output_is_in_place_is_status_0(tmp_path, capsys):
    """Found by a reviewer: Ctrl-C right after an export had renamed its artifact into place ended it
    with ``export: interrupted`` and status 130, though the artifact was complete. Status 130 is for an
    interrupt before that commit (the output as it was); after it, in the job's block or in Hydra's
    return path (:func:`~deltafleet.cli.run_script`), the job ends with status 0 and says so."""
    from deltafleet.atomic import staged_dir
    from deltafleet.cli import run_script

    out = tmp_path / "art"
    with pytest.raises(SystemExit) as before, interruptible("export", output=out):
        with staged_dir(out) as tmp:
            (tmp / "a").write_text("1")
            raise KeyboardInterrupt
    assert before.value.code == 130 and not out.exists()
    assert capsys.readouterr().err == "\nexport: interrupted\n"
    with pytest.raises(SystemExit) as after, interruptible("export", output=out):
        with staged_dir(out) as tmp:
            (tmp / "a").write_text("1")
        raise KeyboardInterrupt  # while the job reports
    assert after.value.code == 0 and (out / "a").read_text() == "1"
    assert capsys.readouterr().err == f"\nexport: interrupted after its output was written: {out} is complete\n"

    def returning():  # the job's block is done: Hydra returns
        with interruptible("export", output=out):
            with staged_dir(out) as tmp:
                (tmp / "a").write_text("2")
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as late:
        run_script(returning, argv=[])
    assert late.value.code == 0 and (out / "a").read_text() == "2"
    assert capsys.readouterr().err.endswith(f"{out} is complete\n")

    def unfinished():  # nothing put in place: the interrupt is Python's, as before
        with interruptible("export", output=tmp_path / "never"):
            pass
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_script(unfinished, argv=[])


def test_ctrl_c_right_after_an_export_is_written_is_status_0(tmp_path):
    """The export (compress/run.py) with a SIGINT sent to itself the moment its artifact is renamed into
    place: status 0, a line saying the artifact is complete, and the artifact loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from deltafleet.compress.bitdelta import load_artifact

    repo = Path(__file__).resolve().parents[1]
    _ft_pair(tmp_path)
    args = ["variant=coder", f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"]
    code = ("import os, runpy, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as from a shell (it may be ignored here)
            "import deltafleet.atomic as atomic\n"
            "replace_dir = atomic.replace_dir\n"
            "def committed(src, dst):\n"
            "    replace_dir(src, dst)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "atomic.replace_dir = committed\n"
            f"sys.argv = ['compress/run.py', *{args!r}]\n"
            "runpy.run_path('compress/run.py', run_name='__main__')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    out = tmp_path / "artifacts" / "coder"
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"export: interrupted after its output was written: {out} is complete", proc.stderr[-3000:]
    assert sorted(p.name for p in out.parent.iterdir()) == ["coder"]
    assert load_artifact(out).variant == "coder"


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


def test_a_write_the_file_system_refuses_is_one_line_and_other_errors_keep_their_traceback():
    """:func:`output_write`: a full disk, a quota or a file-size limit, as ``OSError`` (the manifest's
    write) or as safetensors' ``SafetensorError`` (a shard's), is one line naming the output folder and
    the cause, status 1; another error, even an ``OSError`` of another kind, keeps its traceback."""
    import errno

    from safetensors import SafetensorError

    from deltafleet.cli import output_write

    full = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                            'left on device" })')]
    for e in full:
        with pytest.raises(SystemExit) as exit_info, output_write("export", "the artifact", "out_dir", "/big/art"):
            raise e
        cause = "Disk quota exceeded" if e.args[0] == errno.EDQUOT else "No space left on device"
        assert exit_info.value.code == f"export: cannot write the artifact to out_dir /big/art: {cause}"
    bugs = [OSError(errno.EIO, "Input/output error"), FileNotFoundError(errno.ENOENT, "gone"),
            SafetensorError("Error while deserializing header: HeaderTooLarge"), RuntimeError("a bug")]
    for e in bugs:
        with pytest.raises(type(e)), output_write("export", "the artifact", "out_dir", "/big/art"):
            raise e


def _ft_pair(root):
    """models/base and models/coder (a perturbed copy) under ``root``: a tiny pair whose export's
    delta file is some 60 kB."""
    from tests.conftest import perturb, tiny_llama

    base = tiny_llama(512, hidden_size=128, intermediate_size=256)
    base.save_pretrained(root / "models" / "base")
    ft = tiny_llama(512, hidden_size=128, intermediate_size=256)
    ft.load_state_dict(perturb(base, seed=1))
    ft.save_pretrained(root / "models" / "coder")


FSIZE = 16 * 1024  # bytes: Hydra's own files (~4 kB) fit, the export's shard (~60 kB) and checkpoint do not


def _limited_file_size():
    """A subprocess's ``preexec_fn``: no file it writes may grow past :data:`FSIZE` (``ulimit -f``), a
    full disk as a process sees it, without root; SIGXFSZ ignored (as Python does anyway), so a write
    that goes past fails with EFBIG rather than killing the process."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))


@pytest.mark.parametrize("how", ["bitdelta", "hf", "manifest"])
def test_an_export_the_disk_cannot_take_is_one_line_and_leaves_nothing(tmp_path, how):
    """Found by a fresh user: an export onto a full disk printed Hydra's traceback of a
    ``SafetensorError ... No space left on device`` (or of the manifest's ``OSError``). Now one line,
    ``export: cannot write ... to <key> <folder>: <cause>``, status 1 (a failure at run time, not a
    refused setting), and nothing left: no output, no staging folder, no run folder."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    _ft_pair(tmp_path)
    args = ["variant=coder", f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    out, key, what, cause = tmp_path / "artifacts" / "coder", "out_dir", "the artifact", "File too large"
    if how == "hf":
        from deltafleet.compress.bitdelta import compress

        compress(tmp_path / "models" / "base", tmp_path / "models" / "coder", out, variant="coder")
        out, key, what = tmp_path / "models" / "coder-bitdelta", "hf_out_dir", "the Hugging Face checkpoint"
        args.append("format=hf")
    if how == "manifest":  # the shard is written; the manifest's write finds the disk full
        code = ("import errno, runpy, sys\n"
                "import deltafleet.compress.bitdelta as bd\n"
                "def full(folder, manifest):\n"
                "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
                "bd.write_manifest = full\n"
                f"sys.argv = ['compress/run.py', *{args!r}]\n"
                "runpy.run_path('compress/run.py', run_name='__main__')\n")
        cmd, preexec, cause = [sys.executable, "-c", code], None, "No space left on device"
    else:
        cmd, preexec = [sys.executable, "compress/run.py", *args], _limited_file_size
    def listed():  # None where the folder is not there: a parent the export made is removed again
        return sorted(p.name for p in out.parent.iterdir()) if out.parent.is_dir() else None

    before = listed()
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300, preexec_fn=preexec)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"export: cannot write {what} to {key} {out}: {cause}", \
        proc.stderr[-3000:]
    assert listed() == before  # no output, no .<name>.tmp-* folder, no parent made for it
    assert not (tmp_path / "run").exists()


def test_the_commands_help_for_a_misspelt_choice_is_one_line():
    """``deltafleet export variant=codr --help`` (a choice that does not exist) ended in a traceback of
    Hydra's MissingConfigException, where ``python compress/run.py variant=codr --help`` says Hydra's one
    line with status 2: the command says it so too, in its own name."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for job in ("export", "train"):
        proc = subprocess.run([sys.executable, "-m", "deltafleet", job, "variant=codr", "--help"], cwd=repo,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip() == f"deltafleet {job}: In '{job}': Could not find 'variant/codr'", proc.stderr



def test_the_summary_commands_help_is_its_usage_with_status_0(capsys):
    """``deltafleet summary --help`` printed its usage on stderr with status 2, as for a wrong argument,
    and named a module that is not there (``python -m train.summary``)."""
    from deltafleet.train.summary import main

    assert main(["--help"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: python -m deltafleet.train.summary [models_dir]") and out.err == ""
    assert main(["-x"]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m deltafleet.train.summary [models_dir]")


def test_every_hydra_script_says_a_help_it_cannot_compose_in_one_line():
    """Found by a reviewer: serve/run.py, the benchmarks, train/data.py, train/eval.py,
    train/real_base.py and merge/run.py called their Hydra main directly, so ``python serve/run.py
    port=a=1 --help`` ended in a traceback. Every script with a Hydra main runs it through
    :func:`~deltafleet.cli.run_script`; serve/run.py, the one a user runs most, is run."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    scripts = sorted(p for d in ("train", "merge", "compress", "serve", "kernels") for p in (repo / d).glob("*.py")
                     if "hydra.main(" in p.read_text())
    assert len(scripts) >= 13, scripts
    for path in scripts:
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert mains and "run_script(" in ast.unparse(mains[-1]), f"{path.relative_to(repo)}: its __main__ " \
                                                                   "does not go through run_script"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "serve/run.py", "port=a=1", "--help"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("serve/run.py: mismatched input '='"), r.stderr


def test_the_commands_help_for_an_override_it_cannot_take_is_one_line_without_a_wrong_example():
    """``deltafleet serve variant=coder --help`` (a group serve has not) answered Hydra's refusal
    followed by "e.g. `deltafleet serve variant=coder --help`", the very command typed; and an
    override Hydra cannot parse (``port=abc=1``) ended ``--help`` in a traceback, for the command and
    for a script run through :func:`~deltafleet.cli.run_script` alike. Both are Hydra's message, status 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def run(*args):
        return subprocess.run([sys.executable, *args, "--help"], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=300)

    group = run("-m", "deltafleet", "serve", "variant=coder")
    assert group.returncode == 2 and "Traceback" not in group.stderr, group.stderr[-2000:]
    assert group.stderr.startswith("deltafleet serve: Could not override 'variant'"), group.stderr
    assert "e.g." not in group.stderr, group.stderr
    for cmd, name in ((("-m", "deltafleet", "export", "variant=coder"), "deltafleet export"),
                      (("compress/run.py", "variant=coder"), "compress/run.py")):
        bad = run(*cmd, "granularity=row=1")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
        assert bad.stderr.startswith(f"{name}: mismatched input '='"), bad.stderr


def test_the_serve_commands_help_lists_only_the_groups_serve_takes():
    """Found by a reviewer: ``deltafleet serve --help`` listed every config group under conf/ (Hydra's
    default help), training's ``trainer``, ``variant``, ``logger``, ``merge`` and ``data`` included, none
    of which the server takes. It lists serve's own groups, ``model`` and ``paths``, each with the
    options conf/ has, then serve's settings."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "deltafleet", "serve", "--help"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "deltafleet serve is powered by Hydra."
    for foreign in ("data", "logger", "merge", "trainer", "variant"):  # neither as a group nor a setting
        assert not any(line.startswith(f"{foreign}:") for line in lines), foreign
    start = lines.index("Configuration groups (group=option):")
    groups = lines[start + 1:lines.index("", start)]
    options = {g: ", ".join(sorted(p.stem for p in (repo / "conf" / g).glob("*.yaml"))) for g in ("model", "paths")}
    assert groups == [f"  model: {options['model']}", f"  paths: {options['paths']}"]
    assert options["model"] == "smollm2, tiny"
    assert "\nport: 8000\n" in proc.stdout and "\ndelta_cache:\n" in proc.stdout  # its settings, as composed



def _run_start(tmp_path, output_dir):
    """:class:`deltafleet.cli.RunFolders` before an export's run with ``paths.output_dir=output_dir``."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from deltafleet.cli import RunFolders

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="export", overrides=["variant=coder", f"paths.root={tmp_path}",
                                                        f"paths.output_dir={output_dir}"], return_hydra_config=True)
    before = HydraConfig.instance().cfg
    try:
        RunFolders().on_run_start(cfg)
    finally:
        HydraConfig.instance().cfg = before


@pytest.mark.parametrize("under, cause", [("file", "Not a directory"), ("new/" + "x" * 300, "File name too long")])
def test_a_run_folder_that_cannot_be_made_is_one_line_and_leaves_nothing(tmp_path, capsys, under, cause):
    """Found by a reviewer: a job whose Hydra run folder could not be made (``paths.output_dir`` on a
    read-only file system, as under a read-only working folder, or under a file) ended with the
    chained traceback of Hydra's ``mkdir``. The run's ``RunFolders`` callback refuses it before any
    work, ``error: cannot make the run folder ...`` and status 2, and removes the folders it made on
    the way (``new/`` here)."""
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SystemExit) as exit_:
        _run_start(tmp_path, tmp_path / under / "out")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: cannot make the run folder {tmp_path / under / 'out' / 'export' / 'coder'}/"), err
    assert err.endswith(f" (hydra.run.dir): {cause}; set paths.output_dir to a folder that can be written\n"), err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_run_folder_that_can_be_made_is_made_before_the_run(tmp_path):
    """The folders of the run that can be made are made by ``RunFolders``, before Hydra's run."""
    _run_start(tmp_path, tmp_path / "a" / "b")
    assert len(list((tmp_path / "a" / "b" / "export" / "coder").iterdir())) == 1  # <date>_<time>/, empty


def test_every_jobs_help_lists_the_config_groups_it_takes_and_no_other():
    """Found by a reviewer (as for serve): ``deltafleet data --help``, ``real-base``, ``eval``, ``export
    variant=coder`` and ``distill variant=coder --help`` printed Hydra's default help, whose groups are
    every group under conf/ (``trainer``, ``merge``, ... which those jobs refuse). A job's help lists
    the groups its config composes, each with the options conf/ has; only a
    job that composes every group (train) keeps Hydra's default."""
    from pathlib import Path

    import yaml

    conf = Path(__file__).resolve().parents[1] / "conf"
    every = sorted(p.name for p in conf.iterdir() if p.is_dir())

    def options(group):
        return ", ".join(sorted(p.stem for p in (conf / group).glob("*.yaml")))

    for path in sorted(conf.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        groups = [g if isinstance(g, str) else next(iter(g)) for g in config.get("defaults", [])]
        groups = [g for g in groups if (conf / g).is_dir()]
        template = config.get("hydra", {}).get("help", {}).get("template")
        if template is None:
            assert sorted(groups) == every, path.name  # Hydra's default help: every group
            continue
        if "Configuration groups (group=option):" not in template:
            assert set(groups) <= {"paths"}, path.name  # nothing to choose but the paths
            continue
        lines = template.split("Configuration groups (group=option):\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert sorted(line.split(" (", 1)[0] for line in lines) == sorted(f"  {g}: {options(g)}" for g in groups), \
            path.name


@contextlib.contextmanager
def _stdout_to_a_pipe_left_by_its_reader(monkeypatch):
    """``sys.stdout`` writing into a pipe whose read end is closed (``| head`` that has its lines). Set
    inside the test, as pytest's capture sets ``sys.stdout`` again when the test starts."""
    import io
    import os
    import sys

    r, w = os.pipe()
    os.close(r)
    out = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w")), encoding="utf-8")
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", out)
        yield
    try:
        out.close()
    except BrokenPipeError:  # (without the fix, the text is still in the buffer)
        pass


@pytest.mark.parametrize("args", [["--help"], ["summary", "--help"], ["bench", "--help"]])
def test_help_read_by_a_reader_that_leaves_early_ends_quietly(monkeypatch, capsys, args):
    """Found by a reviewer: ``deltafleet train --help | head`` (or a pager quit before the end) ended
    with the traceback of a BrokenPipeError, or with Python's "Exception ignored ... BrokenPipeError"
    at exit. The command ends with status 141 (128 + SIGPIPE) and nothing on stderr."""
    from deltafleet.cli import main

    with _stdout_to_a_pipe_left_by_its_reader(monkeypatch), pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 141
    assert capsys.readouterr().err == ""


def test_a_scripts_output_read_by_a_reader_that_leaves_early_ends_quietly(monkeypatch, capsys):
    """A script's entry (``run_script``): what it prints past a reader that left ends it with 141."""
    from deltafleet.cli import run_script

    with _stdout_to_a_pipe_left_by_its_reader(monkeypatch), pytest.raises(SystemExit) as exit_:
        run_script(lambda: print("setting: value\n" * 10_000), argv=[])
    assert exit_.value.code == 141
    assert capsys.readouterr().err == ""


def test_a_broken_pipe_that_is_not_stdouts_keeps_its_traceback():
    from deltafleet.cli import run_script

    def send():
        raise BrokenPipeError(32, "Broken pipe")  # a socket's: stdout is fine

    with pytest.raises(BrokenPipeError):
        run_script(send, argv=[])
