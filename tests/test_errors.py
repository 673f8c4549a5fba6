"""One base class under every error megdiffusion reports, and the scripts' one-line handler."""
import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import megdiffusion
from megdiffusion.scripts.cli import Terminated, UsageError, one_line_errors
from megdiffusion.errors import MegdiffusionError


def library_modules():
    """Every module of the package but the scripts (each defines absl flags on the global FLAGS)."""
    for info in pkgutil.walk_packages(megdiffusion.__path__, "megdiffusion."):
        if not info.name.startswith("megdiffusion.scripts"):
            yield importlib.import_module(info.name)


def test_every_error_class_derives_from_the_base():
    errors = [obj for module in library_modules() for obj in vars(module).values()
              if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__]
    assert len(errors) >= 10, errors
    assert [error for error in errors if not issubclass(error, MegdiffusionError)] == []


def test_the_base_and_the_handler_import_without_megengine():
    code = "import sys, megdiffusion.errors, megdiffusion.scripts.cli; assert 'megengine' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_line_errors_print_one_line_and_exit_with_the_error_code(capsys):
    """megdiffusion's errors with their codes; paths that cannot be read or written (2), Ctrl-C (130), SIGTERM
    (143)."""
    from megdiffusion.training.trainer import NonFiniteLossError

    cases = ((UsageError("bad flag"), 2, "bad flag"), (NonFiniteLossError("loss is nan"), 1, "loss is nan"),
             (PermissionError(13, "Permission denied", "/out/x.png"), 2, "/out/x.png: Permission denied"),
             (OSError("image file is truncated"), 2, "image file is truncated"),
             (KeyboardInterrupt(), 130, "stopped by SIGINT; every file written so far is complete"),
             (Terminated(), 143, "stopped by SIGTERM; every file written so far is complete"))
    for error, code, line in cases:
        with pytest.raises(SystemExit) as exit_info:
            with one_line_errors():
                raise error
        assert exit_info.value.code == code
        assert capsys.readouterr().err == f"error: {line}\n"
    with pytest.raises(KeyError):  # anything else is a bug: its traceback is kept
        with one_line_errors():
            raise KeyError("x")


def test_the_error_line_is_one_line_after_the_progress_bars_are_erased(capsys):
    """A line break in a path is escaped as repr writes it; a bar still drawn is erased first (with carriage returns
    and blanks: a terminal then shows the error line alone)."""
    from tqdm import tqdm

    from megdiffusion.scripts.cli import error_line, fail

    assert error_line("no checkpoint file at a\nb\t.pkl") == "error: no checkpoint file at a\\nb\\t.pkl"
    assert error_line(UsageError("--seed must be >= 0, got -1")) == "error: --seed must be >= 0, got -1"
    bar = tqdm(total=4, desc="inception")
    bar.update(2)
    with pytest.raises(SystemExit):
        fail("cannot read image x.png")
    shown = capsys.readouterr().err.split("\n")
    assert [line.rpartition("\r")[2] for line in shown if line.rpartition("\r")[2].strip()] == [
        "error: cannot read image x.png"]
    assert "inception" in shown[0]  # the bar was drawn, then erased
