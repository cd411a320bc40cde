"""Atomic writes, file modes from the umask, and directories that are never followed through a symlink."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from shardgen.base.io import Dir, UnsafePath, atomic_write, atomic_write_text, current_umask, replace_dir


def test_an_atomic_write_replaces_the_file_whole_and_a_failed_one_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_text(target, "old")

    def half_then_fail(f):
        f.write(b"ne")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"], "no temporary file is left behind"
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


def test_files_get_the_umask_s_mode_and_writing_never_changes_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        assert current_umask() == 0o027
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o640


def test_the_cli_umask_leaves_other_users_no_permission_unless_world_readable(tmp_path):
    path = str(tmp_path / "f")
    code = (
        "import os; from shardgen.base.io import restrict_umask, atomic_write_text; os.umask(0o022); "
        f"restrict_umask({{}}); atomic_write_text({path!r}, 'x'); print(oct(os.stat({path!r}).st_mode & 0o777))"
    )
    private = subprocess.run([sys.executable, "-c", code.format("False")], capture_output=True, text=True, check=True)
    shared = subprocess.run([sys.executable, "-c", code.format("True")], capture_output=True, text=True, check=True)
    assert private.stdout.strip() == "0o640" and shared.stdout.strip() == "0o644"


def test_a_symlink_below_the_root_is_refused_and_nothing_is_written_through_it(tmp_path):
    root, elsewhere = tmp_path / "results", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match=r"checkpoints' is a symlink or not a directory.*point output.dir itself"):
        Dir.open(root / "checkpoints" / "00000", below=root)
    with pytest.raises(UnsafePath):
        atomic_write_text(root / "checkpoints" / "x.json", "{}", below=root)
    assert list(elsewhere.iterdir()) == []


def test_the_root_itself_may_be_a_symlink(tmp_path):
    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "results").symlink_to(real)
    atomic_write_text(tmp_path / "results" / "shards" / "a.json", "{}", below=tmp_path / "results")
    assert (real / "shards" / "a.json").read_text() == "{}"


def test_replace_dir_swaps_a_directory_in_whole(tmp_path):
    old, new = tmp_path / "output", tmp_path / ".new"
    old.mkdir()
    (old / "data-old.arrow").write_text("old")
    new.mkdir()
    (new / "data-new.arrow").write_text("new")
    replace_dir(new, old)
    assert [p.name for p in old.iterdir()] == ["data-new.arrow"] and not new.exists()


def short_writes(monkeypatch, fail_after_short: bool):
    """os.write that writes half of what it is given the first time, then (``fail_after_short``)
    fails as a full disk does, or writes the rest."""
    real = os.write
    calls = []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[: len(data) // 2]))
        if fail_after_short:
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return calls


def test_a_short_append_is_completed_and_a_failed_one_cuts_only_its_own_line(tmp_path, monkeypatch):
    with Dir.open(tmp_path) as d:
        d.append_line("log.jsonl", '{"event": "start"}')
        calls = short_writes(monkeypatch, fail_after_short=False)
        d.append_line("log.jsonl", '{"event": "end", "outcome": "committed"}')
        assert len(calls) == 2, "the rest was written"
        calls = short_writes(monkeypatch, fail_after_short=True)
        with pytest.raises(OSError, match="No space left"):
            d.append_line("log.jsonl", '{"event": "start", "attempt": 2}')
        monkeypatch.undo()
        d.append_line("log.jsonl", '{"event": "end", "outcome": "failed"}')
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert lines[:2] == ['{"event": "start"}', '{"event": "end", "outcome": "committed"}']
    assert '{"event": "start", "attempt": 2}'.startswith(lines[2]) and len(lines[2]) < 20, "the cut line stays alone"
    assert lines[3] == '{"event": "end", "outcome": "failed"}', "the next line is whole"


def test_a_file_created_exclusively_is_whole_or_absent(tmp_path, monkeypatch):
    with Dir.open(tmp_path) as d:
        short_writes(monkeypatch, fail_after_short=True)
        with pytest.raises(OSError):
            d.create_exclusive("claim", b'{"worker": 3, "token": "abc"}')
        monkeypatch.undo()
        assert not d.exists("claim"), "a cut claim would read as another holder's"
        assert d.create_exclusive("claim", b'{"worker": 3, "token": "abc"}')
    assert (tmp_path / "claim").read_bytes() == b'{"worker": 3, "token": "abc"}'
