"""What the command-line scripts share: one-line errors with exit code 2, for bad flags too."""
import contextlib
import sys

from absl import flags


class UsageError(ValueError):
    """Bad command-line input; the message is one line that says what to fix."""


def fail(message, code=2):
    """Print ``error: message`` to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@contextlib.contextmanager
def one_line_errors(*error_types):
    """Turn the given exception types (and UsageError) into one ``error:`` line and exit code 2."""
    try:
        yield
    except (UsageError,) + tuple(error_types) as exc:
        fail(str(exc))


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
