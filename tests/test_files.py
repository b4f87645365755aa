"""Atomic writes: the target is the old content or the new one, never half; nothing is left behind."""

import json
import pathlib

import pytest

from tsrl_cli.files import (
    atomic_dir,
    atomic_path,
    file_sha256,
    tree_sha256,
    write_atomic,
    write_json_atomic,
    write_jsonl_atomic,
)


def test_write_replaces_whole_files(tmp_path):
    write_atomic(tmp_path / "a.txt", "one")
    write_atomic(tmp_path / "a.txt", b"two")
    write_json_atomic(tmp_path / "b.json", {"x": [1, 2]})
    write_jsonl_atomic(tmp_path / "c.jsonl", [{"a": 1}, {"b": 2}])
    assert (tmp_path / "a.txt").read_text() == "two" and json.loads((tmp_path / "b.json").read_text()) == {"x": [1, 2]}
    assert [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()] == [{"a": 1}, {"b": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json", "c.jsonl"]  # no temporaries


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    """A crash half way through the write (here: a full disk after the first bytes) loses nothing."""
    write_atomic(tmp_path / "a.json", "old")
    real = pathlib.Path.write_bytes

    def full_disk(self, data):
        real(self, data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_json_atomic(tmp_path / "a.json", {"new": "content"})
    assert (tmp_path / "a.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "a.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert (tmp_path / "a.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_dir_replaces_or_keeps_the_folder(tmp_path):
    with atomic_dir(tmp_path / "d") as d:
        (d / "f").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "d") as d:
        (d / "f").write_text("2")
        raise RuntimeError("crash while writing")
    assert (tmp_path / "d" / "f").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["d"]
    with atomic_dir(tmp_path / "d") as d:
        (d / "g").write_text("3")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["g"]


def test_hashes(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x").write_text("a")
    h = tree_sha256(tmp_path / "t")
    assert file_sha256(tmp_path / "t" / "x") == "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"
    (tmp_path / "t" / "x").write_text("b")
    assert tree_sha256(tmp_path / "t") != h
