"""Worker processes that do not outlive the process that started them (Linux: the kernel kills them when it dies,
however it dies; elsewhere the worker's own checks must do)."""
import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent():
    """Ask the kernel to kill this process when its parent ends (``prctl(PR_SET_PDEATHSIG)``), then exit at once if
    the parent ended before that; a no-op where there is no prctl. For the ``initializer`` of a worker pool."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if parent == 1:  # already orphaned: the signal will never come
        os._exit(1)
