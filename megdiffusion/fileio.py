"""Atomic file writes: every file megdiffusion writes appears complete or not at all."""
import contextlib
import os
import tempfile

import numpy as np


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Yield a file open on a temporary file beside ``path``; on success it is flushed, synced and renamed
    over ``path``. On any error the temporary file is removed and ``path`` is left as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path, text):
    """Write ``text`` to ``path`` atomically."""
    with atomic_write(path, "w") as f:
        f.write(text)


def save_npz(path, **arrays):
    """``np.savez`` to ``path`` atomically (the name is kept as given: no ``.npz`` is appended)."""
    with atomic_write(path) as f:
        np.savez(f, **arrays)
