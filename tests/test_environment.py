"""Environment variables: one table, parsed the same way everywhere; a bad value is one error line before any
work."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megdiffusion import environment

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False),
                                         ("False", False), ("no", False), ("OFF", False)])
def test_booleans_take_the_usual_spellings(monkeypatch, text, value):
    monkeypatch.setenv("MEGDIFFUSION_NUMBA", text)
    assert environment.read("MEGDIFFUSION_NUMBA", None) is value
    environment.check()


def test_unset_and_auto_take_the_default(monkeypatch):
    monkeypatch.delenv("MEGDIFFUSION_ONEDNN", raising=False)
    assert environment.read("MEGDIFFUSION_ONEDNN", True) is True
    monkeypatch.setenv("MEGDIFFUSION_FAST_CONV", "auto")
    assert environment.read("MEGDIFFUSION_FAST_CONV", "unset") is None


@pytest.mark.parametrize("name, text, message", [
    ("MEGDIFFUSION_FAST_CONV", "maybe", "must be 1/0, true/false, yes/no, on/off or auto"),
    ("MEGDIFFUSION_NATIVE_STEP", "fast", "must be 1/0, true/false, yes/no or on/off"),
    ("MEGDIFFUSION_VERBOSE", "2", "must be 1/0, true/false, yes/no or on/off"),
    ("MGB_WORKER_MAX_SPIN", "lots", "must be a whole number >= 0"),
    ("MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE", "-1", "must be a whole number >= 0"),
    ("XDG_CACHE_HOME", "relative/cache", "must be an absolute path")])
def test_a_bad_value_is_one_error_line_in_every_command(tmp_path, name, text, message):
    env = {**os.environ, "PYTHONPATH": str(REPO), name: text}
    for script, args in (("sample", ["--ckpt=x", "--output=out", "--num_images=1"]), ("fid", ["a", "b"]),
                         ("prepare", ["a", "b"]), ("train", [f"--logdir={tmp_path / 'run'}"])):
        result = subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{script}", *args], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1, (script, result.stderr)
        assert lines[0].startswith(f"error: environment variable {name}={text!r} {message}"), lines[0]
        assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_every_variable_the_package_reads_is_in_the_table():
    """No ``os.environ`` read of a variable outside the table (writes, such as the demo's cache, are fine)."""
    read = set()
    for path in (REPO / "megdiffusion").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get)?\(\s*[\"']([A-Z_]+)[\"']", path.read_text()))
        read |= set(re.findall(r"[\"']([A-Z][A-Z_]+)[\"']\s+(?:not )?in os\.environ", path.read_text()))
    assert read <= set(environment.VARIABLES) | {"PYTHONPATH"}, read - set(environment.VARIABLES)


def documented_variables():
    """The variable names in the first column of docs/development.md's table of environment variables."""
    section = (REPO / "docs" / "development.md").read_text().split("## Environment variables")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)", cell)}


def test_every_variable_named_in_the_code_is_in_the_table_and_the_docs():
    """A ``MEGDIFFUSION_*`` name in the package is in ``VARIABLES``; that table, and every such name the tests,
    benchmarks and scripts use, has a row in docs/development.md."""
    def named(folder, pattern="*.py"):
        return {name for path in (REPO / folder).rglob(pattern)
                for name in re.findall(r"MEGDIFFUSION_[A-Z0-9_]*[A-Z0-9]", path.read_text())}

    in_package = named("megdiffusion")
    assert in_package <= set(environment.VARIABLES), in_package - set(environment.VARIABLES)
    elsewhere = named("tests") | named("benchmarks") | named("scripts", "*.sh")
    missing = (set(environment.VARIABLES) | in_package | elsewhere) - documented_variables()
    assert not missing, f"not in docs/development.md's table of environment variables: {sorted(missing)}"
