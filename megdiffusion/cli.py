"""What the command-line scripts share: one-line errors with exit code 2 for bad input (flags too), and
exit code 1 for a failure of MegEngine itself."""
import contextlib
import sys

from absl import flags

from megdiffusion.errors import MegdiffusionError


class UsageError(MegdiffusionError):
    """Bad command-line input; the message is one line that says what to fix."""


def fail(message, code=2):
    """Print ``error: message`` to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@contextlib.contextmanager
def one_line_errors():
    """Report a ``MegdiffusionError`` raised in the block as one ``error:`` line and exit with its code."""
    try:
        yield
    except MegdiffusionError as err:
        fail(err, err.exit_code)


@contextlib.contextmanager
def megengine_failures(how_to_continue):
    """Turn an error MegEngine raised into one ``error:`` line (its first cause, what was kept, then
    ``how_to_continue``) and exit code 1, instead of a C++ backtrace."""
    from megdiffusion.compat import EngineFailure, is_megengine_error, megengine_error_cause

    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, EngineFailure):
            fail(f"{exc}; {how_to_continue}", code=1)
        if not is_megengine_error(exc):
            raise
        fail(f"MegEngine failed: {megengine_error_cause(exc)}; {how_to_continue}", code=1)


def parse_flags(argv):
    """absl's flag parsing for ``app.run(..., flags_parser=parse_flags)``: a bad flag is one line, exit 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        fail(err)


def reject_arguments(argv):
    """Fail in one line when a script that takes only flags got positional arguments."""
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; flags look like --name=value")
