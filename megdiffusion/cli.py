"""What the command-line scripts share: one-line errors with exit code 2."""
import contextlib
import sys


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
