"""Atomic writes leave the old content or the complete new one, and no temporary files."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltafleet import atomic


def test_write_bytes_keeps_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "x.jsonl"
    atomic.write_text(target, "old é\n")
    assert target.read_bytes() == "old é\n".encode("utf-8")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_bytes(target, b"new\n")
    assert target.read_bytes() == "old é\n".encode("utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]


def test_staged_dir_replaces_only_on_success(tmp_path):
    dst = tmp_path / "ckpt"
    with atomic.staged_dir(dst) as tmp:
        (tmp / "a").write_text("1")
    assert (dst / "a").read_text() == "1"
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic.staged_dir(dst) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("interrupted")
    assert (dst / "a").read_text() == "1"
    with atomic.staged_dir(dst) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in dst.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_committed_since_is_the_rename_into_place(tmp_path, monkeypatch):
    """What ``deltafleet.cli.interruptible`` asks of a Ctrl-C (status 0 once an export's output is in
    place): whether :func:`staged_dir` has renamed the folder into place since a mark, also where the
    interrupt lands right after that rename, while the replaced folder is deleted; not where it lands
    before, nor for another folder, nor for a commit before the mark."""
    dst = tmp_path / "art"
    mark = atomic.commit_mark()
    with pytest.raises(KeyboardInterrupt), atomic.staged_dir(dst) as tmp:
        (tmp / "a").write_text("1")
        raise KeyboardInterrupt
    assert not atomic.committed_since(mark, dst) and not dst.exists()
    with atomic.staged_dir(dst) as tmp:
        (tmp / "a").write_text("1")
    assert atomic.committed_since(mark, dst) and not atomic.committed_since(mark, tmp_path / "other")
    mark = atomic.commit_mark()
    assert not atomic.committed_since(mark, dst)
    rmtree = atomic.shutil.rmtree

    def interrupted(path, *args, **kwargs):  # Ctrl-C while the folder it replaced is deleted
        if Path(path).name.startswith(".art.old-"):
            raise KeyboardInterrupt
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(atomic.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt), atomic.staged_dir(dst) as tmp:
        (tmp / "a").write_text("2")
    assert atomic.committed_since(mark, dst) and (dst / "a").read_text() == "2"


def test_staged_dir_through_a_link_replaces_the_links_target(tmp_path):
    """Found by a fresh user: an export to an out_dir that is a symbolic link replaced the link with a
    folder, leaving its target (which check_replaceable had checked) stale. Every writer now does what
    merges did: the target is replaced and the link kept."""
    target = tmp_path / "store" / "coder"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("old")
    link = tmp_path / "coder"
    link.symlink_to(target, target_is_directory=True)
    with atomic.staged_dir(link) as tmp:
        (tmp / "new.txt").write_text("new")
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["coder"]  # no staging folder left


def test_a_killed_writers_staging_folder_goes_at_the_next_write(tmp_path):
    """SIGKILL leaves ``.ckpt.tmp-<host>.<pid>.<random>`` behind; the next ``staged_dir`` of the same
    destination removes it, and keeps the folders of a live process, of another host, and any other
    name."""
    dst = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nfrom deltafleet import atomic\n"
         f"with atomic.staged_dir({str(dst)!r}) as tmp:\n    (tmp / 'w').write_text('x')\n"
         "    print(tmp, flush=True)\n    time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    orphan = Path(proc.stdout.readline().strip())
    assert orphan.name.startswith(f".ckpt.tmp-{socket.gethostname()}.{proc.pid}.") and orphan.is_dir()
    with atomic.staged_dir(dst) as tmp:  # its writer is alive: kept
        (tmp / "a").write_text("1")
    assert orphan.is_dir()
    proc.kill()
    proc.wait()
    live = tmp_path / f".ckpt.tmp-{socket.gethostname()}.{os.getpid()}.00000000"
    elsewhere = tmp_path / f".ckpt.tmp-another-host.{proc.pid}.00000000"
    other = tmp_path / ".ckpt.tmp-handmade"
    for d in (live, elsewhere, other):
        d.mkdir()
    with atomic.staged_dir(dst) as tmp:
        (tmp / "a").write_text("2")
    assert not orphan.exists() and (dst / "a").read_text() == "2"
    assert live.is_dir() and elsewhere.is_dir() and other.is_dir()


def test_a_replaced_folder_left_by_a_killed_writer_goes_or_comes_back(tmp_path):
    """Killed while deleting the folder it replaced (slow for a large checkpoint), a writer left
    ``.ckpt.old-<random>`` for good; it is now ``.ckpt.old-<host>.<pid>.<random>`` and the next
    ``staged_dir`` removes it. Killed between the two renames (no ``ckpt`` at all), the old folder is
    put back, so a write that then fails leaves the previous checkpoint in place."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "v").write_text("1")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import shutil, sys, time\nfrom deltafleet import atomic\n"
         "def slow(path, **kw):\n    print(path, flush=True)\n    time.sleep(600)\n"
         "shutil.rmtree = slow\n"
         f"with atomic.staged_dir({str(dst)!r}) as tmp:\n    (tmp / 'v').write_text('2')\n"],
        stdout=subprocess.PIPE, text=True)
    old = Path(proc.stdout.readline().strip())
    proc.kill()
    proc.wait()
    assert old.name.startswith(f".ckpt.old-{socket.gethostname()}.{proc.pid}.") and (old / "v").read_text() == "1"
    assert (dst / "v").read_text() == "2"
    with atomic.staged_dir(dst) as tmp:
        (tmp / "v").write_text("3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and (dst / "v").read_text() == "3"

    # killed between the renames: the previous folder is aside and there is no ckpt
    aside = tmp_path / f".ckpt.old-{socket.gethostname()}.{proc.pid}.00000000"
    dst.rename(aside)
    with pytest.raises(RuntimeError, match="failed"):
        with atomic.staged_dir(dst) as tmp:
            raise RuntimeError("failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and (dst / "v").read_text() == "3"


def test_check_replaceable_never_takes_the_current_directory_and_says_what_overwrite_deletes(tmp_path, monkeypatch):
    """The job replaces its whole output folder, so the current directory or one holding it is refused
    even with ``overwrite`` (a user's ``out_dir=.`` would delete everything beside the output); a folder
    of foreign files is refused without ``overwrite`` by a message that says they would be deleted and
    names them, and taken with it; an earlier output of the job (``foreign`` None) is taken as is."""
    from deltafleet.atomic import check_replaceable

    work = tmp_path / "proj" / "work"
    work.mkdir(parents=True)
    (work / "precious.txt").write_text("x")
    monkeypatch.chdir(work)

    def foreign(folder):
        return "files the merge did not write: precious.txt" if (folder / "precious.txt").exists() else None

    for out in (".", "..", str(tmp_path), ""):
        with pytest.raises(ValueError, match="is the current directory or holds it") as e:
            check_replaceable(out, [], foreign, job="merge", overwrite=True)
        assert str(Path(out).resolve()) in str(e.value)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("x")
    with pytest.raises(ValueError, match=r"\(files the merge did not write: precious.txt\).*would delete them.*"
                                         r"set overwrite=true to delete them"):
        check_replaceable(mine, [], foreign, job="merge")
    check_replaceable(mine, [], foreign, job="merge", overwrite=True)
    (mine / "precious.txt").unlink()
    (mine / "merge.json").write_text("{}")
    check_replaceable(mine, [], foreign, job="merge")
    check_replaceable(tmp_path / "new" / "out", [], foreign, job="merge")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_check_replaceable_refuses_a_folder_that_cannot_be_made(tmp_path):
    """An output folder whose staging folder cannot be made is refused before any work, naming the
    folder (found by a fresh user: ``out_dir=/proc/x`` trained for the whole run, then failed with a
    traceback), whatever the permission bits say to root; a writable one leaves nothing behind."""
    from deltafleet.atomic import check_replaceable

    with pytest.raises(ValueError, match=r"^out_dir /proc/deltafleet-x/out cannot be written: a folder cannot be "
                                         r"made in /proc \("):
        check_replaceable("/proc/deltafleet-x/out", [], lambda f: None, job="training")
    check_replaceable(tmp_path / "a" / "out", [], lambda f: None, job="training")
    assert list(tmp_path.iterdir()) == []
