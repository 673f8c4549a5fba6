"""Worker processes that do not outlive the process that started them (Linux: the kernel kills them when it dies,
however it dies; elsewhere the worker's own checks must do)."""
import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def start_worker():
    """Make this process a worker: Ctrl-C is ignored (a terminal sends it to every process of the group; the parent
    handles it and ends the workers, which stay silent), and the kernel kills it when its parent ends
    (``prctl(PR_SET_PDEATHSIG)``; it exits at once if the parent ended before that). For the ``initializer`` of a
    worker pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
