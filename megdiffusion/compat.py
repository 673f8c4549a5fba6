"""MegEngine-version shims, in one place.

- ``quiet_megengine()``: import MegEngine without its CPU-mode banner and ``debug:`` lines;
  ``quiet_megengine_when_imported()``: the same for its first import wherever it happens (the commands).
- ``limit_worker_spin()``: stop MegEngine's idle worker threads from busy-waiting on CPU-only machines.
- ``idle_event_polling()`` (with ``quiet_megengine``): run MegEngine's event-polling thread only on otherwise idle
  cores, on CPU-only machines.
- ``keep_fastrun_cache_in_memory()``: no cache file written by importing MegEngine.
- ``empty_dtr_candidates()`` (with ``quiet_megengine``): keep MegEngine's DTR candidate list empty, the
  shared state of a race between ``Tensor.numpy()`` and MegEngine's worker thread.
- ``cuda_available()``: the CUDA probe, minus the ``debug:`` lines it prints on CPU machines;
  ``cuda_driver_loadable()``: whether libcuda loads, without importing MegEngine.
- ``assign_(param, value)``: overwrite a parameter in place (EMA, loading).
- ``is_megengine_error(error)``, ``megengine_error_cause(error)``: recognise an error MegEngine raised and
  name its first cause in one line.
"""
import contextlib
import ctypes
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
import time

from megdiffusion.errors import MegdiffusionError
from megdiffusion import environment

# MegEngine's worker threads busy-wait for their next op for up to ~5 ms (SCQueueSynchronizer::max_spin,
# calibrated at start-up) before sleeping; MGB_WORKER_MAX_SPIN caps the spin in loop iterations.
WORKER_SPIN = "1000"

# Lines MegEngine's C++ core writes to fd 2 when it runs without CUDA. Everything else is replayed.
_NOISE = re.compile(
    r"^(info: \+.*|debug: failed to load cuda func.*|.*Failed to load CUDA driver library.*"
    r"|.*make sure NVIDIA GPU driver.*|.*discuss\.megengine\.org\.cn.*"
    r"|.*WRN worker would execute with spin of " + WORKER_SPIN + r"\b.*)$"
)


# MegEngine 1.13's interpreter puts every produced tensor above ``dtr_evictee_minimum_size`` (1 MiB by default)
# in a vector of DTR (dynamic tensor rematerialisation) candidates, with DTR on or off. Its worker thread
# inserts and erases entries as it produces and frees tensors; ``Tensor.numpy()`` (ChannelImpl::get_value)
# erases and re-inserts the fetched tensor from the calling thread, under a lock the worker does not take.
# While the worker is busy, the two threads edit the vector at once: wrong candidate indices ("insert_candidate:
# got wrong candidate index", then "an input tensor is unusable due to previous error"), glibc heap aborts,
# segfaults (benchmarks/megengine_candidate_race.py, in git's history, reproduces it with MegEngine alone). No
# tensor is that large at this threshold, so the vector stays empty and nothing is shared. megdiffusion never
# enables DTR.
DTR_THRESHOLD_ENV = "MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE"
NO_DTR_CANDIDATES = 1 << 62  # bytes

_LIBC = ctypes.CDLL(None)
_started = False  # quiet_megengine has imported MegEngine and run its first op


def _verbose():
    return environment.read("MEGDIFFUSION_VERBOSE", False)


@contextlib.contextmanager
def _filtered_stderr():
    """Capture fd 2 for the duration, then write back every line that is not known MegEngine noise."""
    if _verbose():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            _LIBC.fflush(None)  # MegEngine logs through C stdio, which is buffered when fd 2 is not a tty
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines(keepends=True) if not _NOISE.match(line.rstrip("\n"))]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def limit_worker_spin():
    """Cap MegEngine's worker busy-wait at ``WORKER_SPIN`` iterations, on machines without a CUDA driver.

    On CPU, the fast convolutions do numpy work between MegEngine ops; meanwhile MegEngine's device
    thread spun for the next op and took most of a core; with the cap a CPU-recipe step is faster and native
    convolutions are unchanged (benchmarks/README.md, "Design choices measured").
    Takes effect only before MegEngine is imported (``import megdiffusion`` calls it), and never overrides
    ``MGB_WORKER_MAX_SPIN`` or ``MGB_WORKER_NO_SLEEP`` set by the user. GPU machines keep the default.
    """
    if "megengine" in sys.modules or "MGB_WORKER_MAX_SPIN" in os.environ or "MGB_WORKER_NO_SLEEP" in os.environ:
        return
    if not cuda_driver_loadable():
        os.environ["MGB_WORKER_MAX_SPIN"] = WORKER_SPIN


def idle_event_polling():
    """Put MegEngine's event-polling thread ("CompNodeSync") in the SCHED_IDLE class on machines without a CUDA
    driver: it runs when a core would otherwise idle, and no longer takes time from the process's real work.

    MegEngine 1.13 starts it with the first tensor op; it polls the comp nodes' events in rounds 10 us apart for the
    life of the process (``CompNodeSyncManager::monitor_events``), even when nothing runs, taking a good part of a core
    in wake-ups; with it idled, training steps are faster (benchmarks/README.md, "Design choices measured"). The thread
    only releases finished events' memory, which can wait for an idle moment. GPU machines keep the default.
    """
    if cuda_driver_loadable() or not hasattr(os, "SCHED_IDLE"):
        return
    # The thread names itself once it runs, which on a loaded machine can come after the first op returns.
    deadline = time.monotonic() + 1.0
    while True:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    if comm.read().strip() == "CompNodeSync":
                        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                        return
            except OSError:  # the thread ended meanwhile, or the system refuses: leave it as it is
                continue
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)


def keep_fastrun_cache_in_memory():
    """Keep MegEngine's fastrun cache in memory (``MGE_FASTRUN_CACHE_TYPE=MEMORY``).

    Importing MegEngine otherwise creates ``$XDG_CACHE_HOME/megengine/persistent_cache/cache.bin``, so every
    command, bad input included, wrote outside the paths it was given; megdiffusion runs no fastrun. Takes
    effect only before MegEngine is imported (``import megdiffusion`` calls it); a value the user set is kept.
    """
    if "megengine" not in sys.modules:
        os.environ.setdefault("MGE_FASTRUN_CACHE_TYPE", "MEMORY")


def empty_dtr_candidates():
    """Keep MegEngine's DTR candidate list empty from the start: sets ``MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE``.

    Takes effect only before MegEngine is imported (``import megdiffusion`` calls it; ``quiet_megengine``
    covers a MegEngine imported earlier). A value the user set is kept: DTR users accept the race above.
    """
    if "megengine" not in sys.modules and DTR_THRESHOLD_ENV not in os.environ:
        os.environ[DTR_THRESHOLD_ENV] = str(NO_DTR_CANDIDATES)


def _clear_dtr_candidates(megengine):
    """``empty_dtr_candidates`` for a MegEngine that was imported first: raise the threshold, drop the list.

    The worker is idle (synchronised) while the option changes and the list is cleared; entries left in the
    list would point at tensors freed without being erased once the threshold is raised.
    """
    from megengine.core import get_option, set_option
    from megengine.core._imperative_rt.core2 import clear_candidates

    if DTR_THRESHOLD_ENV in os.environ or get_option("dtr_evictee_minimum_size") >= NO_DTR_CANDIDATES:
        return
    megengine._full_sync()
    set_option("dtr_evictee_minimum_size", NO_DTR_CANDIDATES)
    megengine._full_sync()  # the worker applies the option in order with its other commands
    clear_candidates()


def cuda_driver_loadable():
    """Whether the CUDA driver library (what MegEngine loads to find GPUs) loads, without MegEngine."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def quiet_megengine():
    """Import and return megengine, filtering its start-up banner out of stderr.

    Only the known CPU-mode banner and ``debug: failed to load cuda func`` lines are dropped; any
    other output of the import (warnings, real errors) is written back to stderr.
    ``MEGDIFFUSION_VERBOSE=1`` turns the filter off. When MegEngine was imported before, the first
    tensor op still runs here, filtered (it prints the CUDA probe's lines and the worker-spin warning),
    and the DTR candidate list is emptied (see ``empty_dtr_candidates``).
    """
    if not _started:
        with _filtered_stderr():
            import megengine

            _start(megengine)
    import megengine

    return megengine


def _start(megengine):
    """The rest of a quiet start, inside ``_filtered_stderr``: the distributed module, the DTR list emptied, the first
    tensor op (which starts the threads and prints the CUDA probe's lines), the polling thread idled."""
    global _started
    import megengine.distributed  # noqa: F401

    _clear_dtr_candidates(megengine)
    megengine.tensor([0.0]).numpy()
    idle_event_polling()
    _started = True


class _QuietFirstImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``quiet_megengine_when_imported``'s finder: MegEngine's first import, wherever it happens, runs as
    ``quiet_megengine`` would, then MegEngine's own loader takes its place on the module again."""

    def find_spec(self, name, path=None, target=None):
        if name != "megengine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self._loader
        with _filtered_stderr():
            self._loader.exec_module(module)
            _start(module)


def quiet_megengine_when_imported():
    """Make MegEngine's first import in this process quiet (``quiet_megengine``) wherever it happens, so that a command
    imports MegEngine (about a second) only when it reaches work that needs it, and bad input fails before."""
    if "megengine" not in sys.modules and not any(isinstance(f, _QuietFirstImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietFirstImport())


@contextlib.contextmanager
def megengine_errors_only():
    """MegEngine's own log (the ``[mgb] WRN`` lines) at errors only inside the block: its graph optimiser's advice
    on operators we chose is not news to a user."""
    from megengine.core._imperative_rt.utils import Logger

    old = Logger.set_log_level(Logger.LogLevel.Error)
    try:
        yield
    finally:
        Logger.set_log_level(old)


def cuda_available():
    """True when MegEngine sees a CUDA device (without the probe's debug lines on CPU machines); without a CUDA driver
    it can see none, and MegEngine is not imported to ask."""
    if not cuda_driver_loadable():
        return False
    megengine = quiet_megengine()
    with _filtered_stderr():
        return bool(megengine.is_cuda_available())


# MegEngine's C++ errors read "<what> at /path/file.cpp:<line>: <signature>", then "extra message: ...",
# then a backtrace. The asynchronous interpreter reports a worker's error later, as a different error
# ("an input tensor is unusable due to previous error", or AsyncError "See above for the actual cause").
_MEGENGINE_ASSERTION = re.compile(r"^(?P<what>.*?) at (?P<file>/\S+?):(?P<line>\d+)\b")
_MEGENGINE_TEXT = re.compile(r"failed at /\S+:\d+|unusable due to previous error|async error is reported")


class EngineFailure(MegdiffusionError, RuntimeError):
    """MegEngine failed while the project's own code was right (a MegEngine bug or a machine fault); the message
    is one line: the first cause, and what was kept."""

    exit_code = 1


def is_megengine_error(error):
    """Whether ``error`` was raised by MegEngine's core (a C++ assertion or an asynchronous worker error)."""
    return isinstance(error, RuntimeError) and (type(error).__module__.startswith("megengine")
                                                or bool(_MEGENGINE_TEXT.search(str(error))))


def _deepest(error):
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error


def megengine_error_cause(error):
    """One line naming the first cause of an error MegEngine raised.

    The first cause is the error the interpreter's worker kept back (a synchronisation rethrows it), else the
    deepest error in ``error``'s chain. C++ file paths, signatures and backtraces are left out.
    """
    cause = _deepest(error)
    megengine = sys.modules.get("megengine")
    if megengine is not None:
        try:
            megengine._full_sync()
        except Exception as stored:  # noqa: BLE001 -- whatever the worker kept is the first cause
            cause = _deepest(stored)
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()] or [type(cause).__name__]
    match = _MEGENGINE_ASSERTION.match(lines[0])
    text = f"{match['what']} ({os.path.basename(match['file'])}:{match['line']})" if match else lines[0]
    extra = [line[len("extra message:"):].strip() for line in lines[1:3] if line.startswith("extra message:")]
    return f"{text}: {extra[0]}" if extra and extra[0] else text


def assign_(param, value):
    """Overwrite ``param`` (a Parameter or Tensor) in place with ``value``, keeping its identity."""
    param._reset(value)


def upsample_nearest_2x(x):
    """Nearest-neighbour 2x upsampling of an NCHW tensor, with the output shape pinned by a reshape.

    MegEngine 1.9's Resize op (behind ``F.nn.interpolate``) could not infer its output shape in
    advance, so after backward + ``clip_grad_norm`` + ``optimizer.step()`` the next forward failed in
    the following convolution with "bad filter ndim for dense convolution: spatial_ndim=2
    filter_ndim=0". Reshaping to the shape computed from the input gives the graph a known shape
    again (fixed upstream in 1.10; the reshape is free there). Every UNet upsample goes through here.
    """
    import megengine.functional as F

    n, c, h, w = x.shape
    return F.nn.interpolate(x, scale_factor=2, mode="nearest").reshape(n, c, 2 * h, 2 * w)
