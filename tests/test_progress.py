"""Progress bars: redrawn in place on a terminal, a line every few seconds in a file or pipe, all through one helper."""
import ast
import io
import sys
from pathlib import Path

from megdiffusion import progress

PACKAGE = Path(__file__).resolve().parents[1] / "megdiffusion"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_to_a_file_each_report_is_a_whole_line(monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_SECONDS", 0)
    with progress.progress_bar(total=3, desc="step", unit="step") as bar:
        for _ in range(3):
            bar.update()
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert lines[0].startswith("step 0/3 step [") and lines[-1].startswith("step 3/3 step [")
    assert all("step/s" in line for line in lines[1:])


def test_to_a_file_a_bar_done_within_the_interval_writes_nothing(capsys):
    with progress.progress_bar(total=3, desc="step") as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


def test_on_a_terminal_the_bar_is_redrawn_in_place(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress.progress_bar(total=3, desc="step") as bar:
        bar.update(3)
    assert sys.stderr.getvalue().count("\r") >= 2 and "3/3" in sys.stderr.getvalue()


def test_every_bar_of_the_package_goes_through_the_helper():
    importers = sorted(path.name for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, (ast.Import, ast.ImportFrom))
                       and any(name.split(".")[0] == "tqdm" for name in
                               ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                                [alias.name for alias in node.names])))
    assert importers == ["progress.py"]
