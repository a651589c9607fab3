"""Command-line plumbing shared by the compress/ and train/ entry points."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

from compress.stream import CheckpointError

# What a user can cause with a bad path, file or value: reported as one line, not a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, CheckpointError)


@contextlib.contextmanager
def user_errors(job: str) -> Iterator[None]:
    """Turn a user-caused error (:data:`USER_ERRORS`, which includes ``ArtifactError``) into
    ``SystemExit("<job>: <message>")``: exit status 1 and one line on stderr, where Hydra would
    print a traceback. Anything else (a bug) keeps its traceback."""
    try:
        yield
    except USER_ERRORS as e:
        raise SystemExit(f"{job}: {type(e).__name__}: {e}") from None


def stop_on_sigterm() -> None:
    """Make SIGTERM (what ``timeout``, ``kill`` and job schedulers send) end the process the way
    Ctrl-C does, by raising ``SystemExit(143)`` in the main thread: the ``finally``/``except`` blocks
    run, so a staged output folder (``compress.atomic.staged_dir``) is removed rather than left
    behind half written. Call it from the main thread of an entry point."""
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
