"""Output directories: checked before anything is written, locked while a command writes in them."""
import os
from pathlib import Path

import pytest

from megdiffusion.files.disk import OutputError, atomic_write, check_writable, output_directory, write_text


def test_a_locked_directory_refuses_a_second_holder_until_released(tmp_path):
    out = tmp_path / "run"
    with output_directory(str(out), "--logdir", "flags.cfg"):
        with pytest.raises(OutputError, match=f"^--logdir {out} is in use by another megdiffusion command"):
            with output_directory(str(out), "--logdir", "flags.cfg"):
                pass
        (out / "flags.cfg").write_text("mine")
    with output_directory(str(out), "--logdir", "flags.cfg"):  # released, and the marker says it is ours
        pass
    assert [p.name for p in out.iterdir()] == ["flags.cfg"]


def test_directories_made_for_a_command_that_fails_before_writing_are_removed(tmp_path):
    with pytest.raises(ValueError):
        with output_directory(str(tmp_path / "new" / "deeper" / "run"), "--logdir", "flags.cfg"):
            raise ValueError("a check under the lock failed")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        with output_directory(str(tmp_path / "run"), "--logdir", "flags.cfg"):
            (tmp_path / "run" / "flags.cfg").write_text("written")
            raise ValueError("a later failure")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["flags.cfg"]  # what was written stays


def test_a_directory_of_other_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "thesis.tex").write_text("keep")
    with pytest.raises(OutputError, match="holds files that megdiffusion did not write \\(no demo.json\\)"):
        with output_directory(str(tmp_path), "--output", "demo.json"):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.tex"]


def test_check_writable_probes_without_leaving_anything(tmp_path):
    (tmp_path / "afile").write_text("x")
    check_writable(str(tmp_path / "new" / "deeper"), "--output")
    check_writable(str(tmp_path / "new" / "stats.npz"), "OUT", directory=False)
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
    for path, directory, message in ((tmp_path / "afile", True, "is a file; give a directory"),
                                     (tmp_path, False, "is a directory; give a file name"),
                                     (tmp_path / "afile" / "sub", True, "cannot be made: .*afile is a file"),
                                     ("/proc/new", True, "cannot be written \\(.* in /proc\\)")):
        with pytest.raises(OutputError, match=message):
            check_writable(str(path), "--output", directory)


def test_a_failed_atomic_write_names_its_target_and_leaves_nothing(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError) as info:
        write_text(str(tmp_path / "afile" / "out.json"), "{}")  # a directory that cannot be made
    assert info.value.filename == str(tmp_path / "afile" / "out.json") and "cannot write" in info.value.strerror
    with pytest.raises(OSError) as info:
        with atomic_write(str(tmp_path / "out.bin")) as f:
            f.write(b"half")
            raise OSError(28, "No space left on device")
    assert info.value.filename == str(tmp_path / "out.bin") and info.value.strerror.endswith("No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_leftovers_of_killed_writes_are_removed_and_writes_in_progress_kept(tmp_path):
    """A temporary file or directory that no process holds locked is a killed command's: the next atomic write in
    that directory removes it; one still being written (locked) stays, and so do other files."""
    import fcntl

    from megdiffusion.files import disk as fileio

    (tmp_path / f"{fileio.TEMPORARY}dead").write_bytes(b"x" * 100)
    (tmp_path / f"{fileio.TEMPORARY}dead_dir").mkdir()
    (tmp_path / f"{fileio.TEMPORARY}dead_dir" / "a").write_text("a")
    (tmp_path / f"{fileio.TEMPORARY}alive").write_bytes(b"y")
    (tmp_path / ".tmp-not-ours").write_bytes(b"z")
    with open(tmp_path / f"{fileio.TEMPORARY}alive", "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        fileio.write_text(tmp_path / "out.txt", "done")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{fileio.TEMPORARY}alive", ".tmp-not-ours", "out.txt"])


def test_an_interrupt_between_the_renames_of_a_directory_puts_the_original_back(tmp_path, monkeypatch):
    """``atomic_directory`` over an existing directory moves it aside, then renames the new one in: an interrupt
    (SIGTERM raises in the main thread) between the two leaves the original where it was, and no temporary."""
    from megdiffusion.files import disk

    target = tmp_path / "out"
    target.mkdir()
    (target / "kept.txt").write_text("original")
    real_replace = os.replace
    calls = []

    def interrupted_second_rename(source, destination):
        calls.append(destination)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(source, destination)

    monkeypatch.setattr(disk.os, "replace", interrupted_second_rename)
    with pytest.raises(KeyboardInterrupt):
        with disk.atomic_directory(target) as new:
            (Path(new) / "new.txt").write_text("new")
    monkeypatch.setattr(disk.os, "replace", real_replace)
    assert (target / "kept.txt").read_text() == "original" and not (target / "new.txt").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(disk.TEMPORARY)]
