"""Atomic file writes (every file megdiffusion writes appears complete or not at all), and the output
directories of the scripts: checked before anything is written, locked while a command writes in them.

A write goes to a temporary file (or directory) named ``TEMPORARY`` + a random part beside its destination, locked
(``flock``) while it is written; one that no process holds is what a killed command left, and the next write into
that directory removes it."""
import contextlib
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import zipfile
import zlib

import numpy as np

from megdiffusion.errors import MegdiffusionError, one_line


TEMPORARY = ".megdiffusion-partial-"


class OutputError(MegdiffusionError):
    """An output path that cannot be written, or is in use or holds other files; the message is one line."""


class InputError(MegdiffusionError):
    """An input path that is neither a file nor a directory (a FIFO, a device, a socket); the message is one line."""


def check_not_special(path):
    """``InputError`` when ``path`` exists but is neither a regular file nor a directory: opening a FIFO for reading
    waits for a writer forever, a device never ends."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(os.stat(path).st_mode) else "not a regular file"
        raise InputError(f"{path} is {kind}, not a file to read; give a regular file")


def _locked(path):
    """A descriptor of ``path`` (a file or a directory) holding an exclusive lock on it, or None if another process
    holds one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


_SWEPT = set()  # the directories whose leftovers this process removed (once each: a directory may hold 50,000 images)


def remove_leftovers(directory):
    """Remove the temporary files and directories in ``directory`` that killed commands left (no process holds
    their lock), once a process."""
    if directory in _SWEPT:
        return
    _SWEPT.add(directory)
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not entry.startswith(TEMPORARY) or os.path.islink(path):
            continue
        try:
            fd = _locked(path)
        except OSError:  # gone already, or not ours to open
            continue
        if fd is None:
            continue
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Yield a file open on a temporary file beside ``path``; on success it is flushed, synced and renamed
    over ``path``. On any error the temporary file is removed and ``path`` is left as it was; an ``OSError``
    names ``path``, not the temporary file."""
    directory = os.path.dirname(os.path.abspath(path))
    before = tmp = None
    try:  # one block from the temporary file's creation on: an interrupt anywhere in it (SIGTERM too) removes it
        os.makedirs(directory, exist_ok=True)
        remove_leftovers(directory)
        before = os.stat(directory)
        fd = None
        while fd is None:  # the name is known before the file exists, so an interrupt after its creation removes it
            tmp = os.path.join(directory, TEMPORARY + secrets.token_hex(6))
            with contextlib.suppress(FileExistsError):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
        fcntl.flock(fd, fcntl.LOCK_EX)  # a file in use, not a leftover; released when closed
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # still locked: never taken for a leftover
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if before is not None:
            _set_times(directory, before)  # no trace left, the directory's modification time included
        if isinstance(err, OSError):
            raise OSError(err.errno, f"cannot write: {err.strerror or err}", str(path)) from None
        raise


@contextlib.contextmanager
def atomic_directory(path):
    """Yield a new temporary directory beside ``path`` to fill; on success it takes ``path``'s place (an existing
    ``path`` is replaced whole), on any error it is removed and ``path`` is left as it was."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = lock = moved = None
    try:  # one block from the temporary directory's creation on: an interrupt anywhere in it (SIGTERM too) undoes it
        os.makedirs(parent, exist_ok=True)
        remove_leftovers(parent)
        tmp = tempfile.mkdtemp(dir=parent, prefix=TEMPORARY)
        lock = _locked(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        old = None
        if os.path.lexists(path):
            old = tempfile.mkdtemp(dir=parent, prefix=".old-")
            moved = os.path.join(old, "replaced")
            os.replace(path, moved)
        os.replace(tmp, path)
        tmp = None
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        if moved is not None and os.path.lexists(moved) and not os.path.lexists(path):
            os.replace(moved, path)  # interrupted between the two renames: the original goes back
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path, text):
    """Write ``text`` to ``path`` atomically."""
    with atomic_write(path, "w") as f:
        f.write(text)


def copy_file(source, path):
    """Copy the file ``source`` to ``path`` atomically."""
    with open(source, "rb") as src, atomic_write(path) as f:
        shutil.copyfileobj(src, f)


def save_npz(path, **arrays):
    """``np.savez`` to ``path`` atomically (the name is kept as given: no ``.npz`` is appended)."""
    with atomic_write(path) as f:
        np.savez(f, **arrays)


def read_npz(path):
    """Every array of the npz file at ``path`` as a dict (pickled objects refused); ``ValueError`` with a
    one-line reason for a file that is not a readable npz archive."""
    check_not_special(path)
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("it holds a single .npy array, not an npz archive")
        with data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"cannot read {path} as an npz archive: {one_line(exc)}") from None


def check_writable(path, flag, directory=True, overwrite=False):
    """``OutputError`` unless ``path`` (a directory, or with ``directory=False`` a file) can be created or
    written: its nearest existing ancestor must be a directory in which a file can be made (a probe file,
    removed at once), and a file must not exist unless ``overwrite`` (nothing is replaced that the user did not
    ask to replace). Names ``flag`` (the option that gave the path) in the message; returns that ancestor."""
    if not str(path):
        raise OutputError(f"{flag} is empty; give a path")
    if not directory and not overwrite and os.path.lexists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path} exists; give a new path, or --overwrite to replace it")
    full = os.path.abspath(path)
    if os.path.isdir(full) != directory and os.path.exists(full):
        raise OutputError(f"{flag} {path} is {'a file' if directory else 'a directory'}; give "
                          f"{'a directory' if directory else 'a file name'}")
    existing = full if directory else os.path.dirname(full)
    while not os.path.exists(existing):
        if os.path.islink(existing):  # makedirs would say "File exists"
            raise OutputError(f"{flag} {path} cannot be made: {existing} is a symbolic link to "
                              f"{os.readlink(existing)}, which does not exist; create that or choose another {flag}")
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OutputError(f"{flag} {path} cannot be made: {existing} is a file; choose another {flag}")
    before = os.stat(existing)
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".probe-")
        os.close(fd)
        os.remove(probe)
        _set_times(existing, before)  # the probe leaves no trace, the directory's modification time included
    except OSError as err:
        raise OutputError(f"{flag} {path} cannot be written ({err.strerror} in {existing}); "
                          f"choose another {flag}") from None
    return existing


def _set_times(path, status):
    """Give ``path`` the access and modification times of ``status`` (an ``os.stat`` result), if it can be."""
    with contextlib.suppress(OSError):
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


def check_not_input(output, flag, *inputs):
    """``OutputError`` when the path ``output`` (given by ``flag``) is one of ``inputs``, however named: through
    symbolic links, ``..`` or a hard link. Called before anything is opened for writing."""
    for source in inputs:
        if source is None:
            continue
        same = os.path.realpath(output) == os.path.realpath(source)
        if not same and os.path.exists(output) and os.path.exists(source):
            same = os.path.samefile(output, source)
        if same:
            raise OutputError(f"{flag} {output} is the input {source} itself; give the output another path")


@contextlib.contextmanager
def output_directory(path, flag, marker):
    """Hold directory ``path`` for one command's writes: ``check_writable``, create it, and lock it against
    other processes for the block (``OutputError`` if one holds it). A directory that already holds files
    but not ``marker`` (the file the command writes there first) is refused: it belongs to something else.
    Directories it created are removed again when the block fails before writing in them."""
    existing = check_writable(path, flag)
    existed_before = os.stat(existing)
    os.makedirs(path, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(f"{flag} {path} is in use by another megdiffusion command; wait for it to end or "
                              f"choose another {flag}") from None
        if os.listdir(path) and not os.path.exists(os.path.join(path, marker)):
            raise OutputError(f"{flag} {path} holds files that megdiffusion did not write (no {marker}); "
                              f"choose a new or empty {flag}")
        yield
    except BaseException:
        # A check in the block failed: leave no trace (the directories made, and the time they changed).
        if _remove_empty_directories(path, existing) and os.path.abspath(path) != existing:
            _set_times(existing, existed_before)
        raise
    finally:
        os.close(fd)  # releases the lock


def _remove_empty_directories(path, stop):
    """Remove ``path`` and its parents below ``stop`` while they are empty; whether all of them went."""
    path = os.path.abspath(path)
    while path != stop:
        try:
            os.rmdir(path)
        except OSError:  # not empty (or not ours to remove)
            return False
        path = os.path.dirname(path)
    return True
