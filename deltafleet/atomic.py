"""Atomic writes: a folder or a file appears complete under its final name, or not at all.

Used by every job that writes something another job reads (checkpoints, artifacts, data splits):
the content is written under a temporary name next to the destination, fsynced, then renamed.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterator


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


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished folder ``src`` to ``dst``, replacing (then deleting) an existing one.

    If the final rename fails, a previous ``dst`` is put back.
    """
    old = None
    if dst.exists() or dst.is_symlink():
        old = dst.parent / f".{dst.name}.old-{secrets.token_hex(4)}"
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


@contextlib.contextmanager
def staged_dir(dst: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``dst``; on success it replaces ``dst``.

    On any exception the temporary folder is removed and an existing ``dst`` is left untouched.
    """
    dst = Path(dst).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):  # some writers (safetensors) create 0600 files: make them readable
            f.chmod(0o755 if f.is_dir() else 0o644)
        tmp.chmod(0o755)
        fsync_path(tmp)
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
