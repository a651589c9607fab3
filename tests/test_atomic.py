"""Atomic writes leave the old content or the complete new one, and no temporary files."""
from __future__ import annotations

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
