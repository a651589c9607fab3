"""Atomic writes: a folder or a file appears complete under its final name, or not at all.

Used by every job that writes something another job reads (checkpoints, artifacts, data splits):
the content is written under a temporary name next to the destination, fsynced, then renamed.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories where the OS allows it)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:  # e.g. directories on Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# (folder, device, inode) of every folder replace_dir was asked to put in place in this process, in
# order: whether one is in place is the file system's answer (committed_since), not a flag that a
# signal could land before or after
_PLACED: list[tuple[Path, int, int]] = []


def commit_mark() -> int:
    """A mark for :func:`committed_since`: the folders :func:`replace_dir` was asked to put in place so far."""
    return len(_PLACED)


def committed_since(mark: int, folder: str | Path) -> bool:
    """Whether :func:`replace_dir` (so :func:`staged_dir`) has put a folder in place at ``folder``
    (resolved) since ``mark`` (:func:`commit_mark`) and it is there now: the rename that commits it has
    happened, whatever came after it (the replaced folder's deletion, an interrupt)."""
    folder = Path(folder).resolve()
    for dst, dev, ino in _PLACED[mark:]:
        if dst == folder:
            try:
                st = os.stat(dst)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (dev, ino):  # (a rename keeps the inode)
                return True
    return False


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished folder ``src`` to ``dst``, replacing (then deleting) an existing one.

    If the final rename fails, a previous ``dst`` is put back. The previous one is first renamed to
    ``.<name>.old-<host>.<pid>.<random>``: if the process is killed outright while deleting it (a
    large checkpoint takes a while), the next :func:`staged_dir` of ``dst`` on this host removes it.
    The rename of ``src`` is the commit: :func:`committed_since` tells whether it happened.
    """
    st = os.stat(src)
    _PLACED.append((Path(os.path.abspath(dst)), st.st_dev, st.st_ino))
    old = None
    if dst.exists() or dst.is_symlink():
        old = dst.parent / f".{dst.name}.old-{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)  # put the previous folder back
        raise
    fsync_path(dst.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def remove_dir(path: Path) -> None:
    """Remove the folder ``path`` at once (renamed to a staging name first, then deleted): a process
    killed while deleting leaves no part of it under ``path``, and the next :func:`staged_dir` of
    ``path`` on this host removes what is left."""
    gone = path.parent / f".{path.name}.tmp-{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    os.replace(path, gone)
    fsync_path(path.parent)
    shutil.rmtree(gone, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_orphans(dst: Path) -> None:
    """Remove what a process killed outright (SIGKILL, out of memory) left of ``dst``: its staging
    folders ``.<name>.tmp-<host>.<pid>.<random>`` and the replaced folders it was deleting,
    ``.<name>.old-<host>.<pid>.<random>``, of this host and a process that is gone. Another host's (a
    shared file system) and those of a live process are left alone. A replaced folder whose
    replacement never arrived (killed between :func:`replace_dir`'s two renames) is put back as ``dst``."""
    host = socket.gethostname()
    for kind in ("old", "tmp"):
        for stale in dst.parent.glob(f".{dst.name}.{kind}-*"):
            who = stale.name[len(f".{dst.name}.{kind}-"):].rsplit(".", 2)
            if not (len(who) == 3 and who[0] == host and who[1].isdigit() and not _alive(int(who[1]))):
                continue
            if kind == "old" and not (dst.exists() or dst.is_symlink()):
                os.replace(stale, dst)
            elif stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def not_recorded_output(folder: Path, record: str, written_by: str, job: str) -> str | None:
    """Why ``folder`` is not (only) an earlier output of ``job``, or None if it is: its ``record`` (a JSON
    file the job writes last into its staged folder) must carry ``written_by`` and list every file the
    folder holds. For :func:`check_replaceable`'s ``foreign``."""
    try:
        meta = json.loads((folder / record).read_text())
    except (OSError, ValueError):
        return f"no {record} of {'an' if job[0] in 'aeiou' else 'a'} {job}"
    if not isinstance(meta, dict) or meta.get("written_by") != written_by or not isinstance(meta.get("files"), list):
        return f"its {record} was not written by this {job} tool"
    return unlisted_files(folder, meta["files"], job)


def unlisted_files(folder: Path, listed, job: str) -> str | None:
    """Why ``folder`` holds more than a ``job``'s output that listed its files as ``listed`` (names),
    or None: the first few other files, by name. For a ``foreign`` of :func:`check_replaceable`."""
    extra = sorted({p.name for p in folder.iterdir()} - set(listed))
    return f"files the {job} did not write: {', '.join(extra[:3])}" if extra else None


def _check_writable(out: Path, key: str) -> None:
    """Refuse an ``out`` whose staging folder could not be made (:func:`staged_dir` makes it beside
    ``out``): a folder is made and removed in the nearest existing folder on the way to ``out``, since
    permission bits say nothing for root and nothing of a file system such as /proc."""
    parent = next((p for p in out.parents if p.exists()), out)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.check-", dir=parent))
    except OSError as e:
        raise ValueError(f"{key} {out} cannot be written: a folder cannot be made in {parent} "
                         f"({e.strerror or e})") from None


def check_replaceable(out: str | Path, inputs: Iterable[str | Path], foreign: Callable[[Path], str | None], *,
                      job: str, key: str = "out_dir", overwrite: bool = False) -> None:
    """Refuse, before any work, an output folder whose replacement would lose data: one that is, holds
    or lies inside an input of the job, the current directory or a folder holding it, a file, or a
    folder holding what the job did not write earlier (``foreign(folder)`` says why, or returns None for
    the job's own output) unless ``overwrite``, which deletes those files with the folder it replaces.

    Raises:
        ValueError: naming ``key`` (the config key) and the reason.
    """
    out = Path(out).resolve()
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"{key} {out} cannot be made: {blocked} is a file, not a folder")
    for d in inputs:
        d = Path(d).resolve()
        if out == d or d.is_relative_to(out) or out.is_relative_to(d):
            raise ValueError(f"{key} {out} overlaps the input {d}: the {job} would replace or write into it")
    if Path.cwd().resolve().is_relative_to(out):
        raise ValueError(f"{key} {out} is the current directory or holds it: the {job} replaces its whole {key} "
                         f"(deleting what else is there); choose a new folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{key} {out} exists and is not a folder")
    _check_writable(out, key)
    if out.is_dir() and not overwrite and any(out.iterdir()):
        why = foreign(out)
        if why:
            raise ValueError(f"{key} {out} exists and holds files that are not an earlier {job}'s output ({why}): "
                             f"the {job} replaces the whole folder, which would delete them; choose another {key}, "
                             f"or set overwrite=true to delete them")


@contextlib.contextmanager
def staged_dir(dst: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``dst``; on success it replaces ``dst``. ``dst`` is
    resolved: where it is a symbolic link, its target is replaced and the link kept (the folder
    :func:`check_replaceable` checks).

    On any exception the temporary folder, and the parent folders it made, are removed and an
    existing ``dst`` is left untouched.
    A process killed outright cannot remove its folder; the next ``staged_dir`` of the same ``dst``
    on the same host does (the folder's name holds the host and the process id).
    """
    dst = Path(dst).resolve()
    made = [p for p in dst.parents if not p.exists()]  # deepest first: removed again on failure
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(dst)
        tmp = dst.parent / f".{dst.name}.tmp-{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            tmp.mkdir()  # inside: a signal that lands right after it (SIGTERM as an exception) still removes it
            yield tmp
            for f in tmp.rglob("*"):  # some writers (safetensors) create 0600 files: make them readable
                f.chmod(0o755 if f.is_dir() else 0o644)
            tmp.chmod(0o755)
            fsync_path(tmp)
            replace_dir(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except BaseException:
        for p in made:  # the parents it made, unless something else was written there meanwhile
            try:
                p.rmdir()
            except OSError:
                break
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder, fsync and ``os.replace``.

    Readers see the old file or the complete new one, never a partial write; the temporary file
    (``.<name>.tmp-<random>``) is removed if anything fails. Parent folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` encoded as UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def write_figure(fig, path: str | Path, **savefig) -> None:
    """A matplotlib figure as PNG at ``path``, written as :func:`write_bytes` writes (``savefig``:
    ``Figure.savefig``'s options, e.g. ``dpi``): a run stopped while it draws leaves the old picture
    or none, never a truncated one beside a new report."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig)
    write_bytes(path, buf.getvalue())
