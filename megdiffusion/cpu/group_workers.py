"""Worker processes that compute groups of a batch through ``cpu.numpy_unet`` (``megdiffusion.cpu.native``): the loss
and gradients of a training step, or the output of an eval-mode call.

A batch is cut into groups of a fixed size (``native.GROUP``); group g runs on process g mod P, process 0 being
the caller, where P is at most one per core. Processes rather than threads: numpy's many small operations hand the GIL
to each other, and two threads ran a step little faster than one, where two processes run two groups in the time of one
(benchmarks/README.md, "Design choices measured"). Each group's arithmetic is the same in any process, and the caller
sums the groups' gradients in group order, so results are bit-identical for any number of processes.

The workers run ``python -c`` with this module and never import MegEngine; they receive the ``describe``d network
once, and per step their groups' inputs through a socket. Weights and gradients, the large arrays, go through
files mapped into every process (in ``/dev/shm`` where it exists), unlinked as soon as the workers have mapped
them. A worker exits when the caller closes its socket (``close``, or the caller's exit).
"""
import ctypes
import itertools
import math
import os
import socket
import subprocess
import sys
import tempfile
import traceback
import weakref
from multiprocessing.connection import Connection

import numpy as np

from megdiffusion.cpu.batch_threads import one_blas_thread
from megdiffusion.errors import MegdiffusionError
from megdiffusion.cpu import numpy_unet


_INSTEAD = "MEGDIFFUSION_NATIVE_STEP=0 trains through MegEngine's autodiff, without worker processes"


class WorkerError(MegdiffusionError):
    """A worker process failed or died."""

    exit_code = 1  # not the user's input


def keep_freed_memory():
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back to the system.

    Each layer of a pass allocates its outputs afresh (megabytes each). By default glibc serves such blocks with
    mmap or trims them off the heap when freed, so every pass faulted in new pages, a large share of its time
    (benchmarks/README.md, "Design choices measured"). With blocks of up to 32 MB taken from the heap and the heap
    never trimmed, a pass reuses the last pass's pages; the process keeps its peak heap. No-op where the C library
    is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest allowed threshold
    mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _shared_array(count):
    """A float32 array of ``count`` elements in a file mapped shared, and the file's path."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="megdiffusion-", dir=directory)
    os.close(fd)
    return np.memmap(path, np.float32, "w+", shape=(max(count, 1),))[:count], path


def _views(flat, shapes):
    """``flat`` cut into arrays of ``shapes``, one after the other."""
    bounds = list(itertools.accumulate((math.prod(shape) for shape in shapes), initial=0))  # np.prod is slow here
    return [flat[a:b].reshape(shape) for a, b, shape in zip(bounds, bounds[1:], shapes)]


class GroupWorkers:
    """The caller plus ``count`` worker processes for ``model`` (a ``describe``d UNet) with parameters of
    ``shapes``. ``close()`` stops the workers; so does collecting the object, or the caller's exit."""

    def __init__(self, model, shapes, count):
        keep_freed_memory()
        self.model, self.shapes = model, [tuple(shape) for shape in shapes]
        self.total = int(sum(np.prod(shape) for shape in self.shapes))
        self.processes, self.connections = [], []
        self.weights = self.grads = None
        # ``outputs`` at the weights of the last ``outputs`` call: their views, oneDNN layouts and copy are kept.
        self.fixed_weights = self.views = None
        self.prepared = {}  # numpy_unet's per-layer preparations of the fixed weights, in this process
        self.shared_fixed = False  # whether the shared weights hold the fixed weights
        self.local_grads = []  # the caller's per-group gradient buffers, kept between steps
        self.close = weakref.finalize(self, _stop, self.connections, self.processes)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        for _ in range(count):
            ours, theirs = socket.socketpair()
            code = f"from megdiffusion.cpu.group_workers import serve; serve({theirs.fileno()})"
            # A session of its own: a terminal's Ctrl-C (or a signal to the caller's process group) reaches only the
            # caller, which finishes its step and saves a checkpoint; workers exit when their socket closes.
            # cwd: ``python -c`` imports from its working directory first, which may hold another checkout.
            process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                                       cwd=package_root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       start_new_session=True)
            theirs.close()
            self.processes.append(process)
            self.connections.append(Connection(ours.detach()))
        self._broadcast(("model", model, self.shapes))

    def _broadcast(self, message):
        for connection in self.connections:
            self._send(connection, message)
        for connection in self.connections:
            self._receive(connection)

    def _send(self, connection, message):
        try:
            connection.send(message)
        except OSError:
            self._died(connection)

    def _receive(self, connection):
        try:
            kind, value = connection.recv()
        except (EOFError, OSError):
            self._died(connection)
        if kind == "error":
            self.close()
            raise WorkerError(f"a training worker process failed: {value} (its traceback is above); {_INSTEAD}")
        return value

    def _died(self, connection):
        process = self.processes[self.connections.index(connection)]
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "unknown (still running)"
        self.close()
        raise WorkerError(f"a training worker process (pid {process.pid}) died, exit code {code}; its error, if "
                          f"any, is above; {_INSTEAD}") from None

    def _map_buffers(self, slots):
        """Shared weights and ``slots`` shared gradient buffers, mapped into every worker."""
        self.weights, weights_path = _shared_array(self.total)
        self.shared_fixed = False
        self.grads, grads_path = _shared_array(slots * self.total)
        self.grads = self.grads.reshape(slots, self.total)
        try:
            self._broadcast(("buffers", weights_path, grads_path, slots))
        finally:
            os.unlink(weights_path)
            os.unlink(grads_path)

    def gradients(self, flat_weights, groups, batch_size):
        """[(loss, flat gradient)] of each group in ``groups`` ([(x_t, target, mse_weight, temb_in, dropout seed)])
        at the weights ``flat_weights``: ``numpy_unet.group_loss_and_gradients`` of each, in group order."""
        return self._map("gradients", flat_weights, groups, batch_size)

    def outputs(self, flat_weights, groups):
        """The network's output (NCHW) for each group in ``groups`` ([(x NCHW, temb_in)]) at ``flat_weights``: an
        array taken as unchanged when it was the last one given here (``NativeModel``'s weights, fixed), so that
        sampling copies the weights to the workers and prepares them for oneDNN once, not at every call."""
        return self._map("outputs", flat_weights, groups)

    def _map(self, kind, flat_weights, groups, *args):
        processes = min(len(self.connections) + 1, len(groups))
        jobs = [list(range(p, len(groups), processes)) for p in range(processes)]
        remote = [index for job in jobs[1:] for index in job]
        slot = {index: i for i, index in enumerate(remote)}
        if not (kind == "outputs" and flat_weights is self.fixed_weights):
            self.fixed_weights = flat_weights if kind == "outputs" else None
            self.views, self.prepared, self.shared_fixed = _views(flat_weights, self.shapes), {}, False
        if remote:
            slots = len(remote) if kind == "gradients" else 0
            if self.grads is None or len(self.grads) < slots:
                self._map_buffers(slots)
            fresh = not self.shared_fixed  # the workers drop their preparations of older weights
            if fresh:
                np.copyto(self.weights, flat_weights)
                self.shared_fixed = kind == "outputs"
            for connection, job in zip(self.connections, jobs[1:]):
                self._send(connection, (kind, [(slot[i], groups[i]) for i in job], fresh) + args)
        results = {}
        with one_blas_thread():
            for position, index in enumerate(jobs[0]):
                buffer = self._local_buffer(position) if kind == "gradients" else None
                result = _compute(kind, self.model, self.views, buffer, self.shapes, groups[index], self.prepared,
                                  *args)
                results[index] = result if buffer is None else (result, buffer)
        for connection, job in zip(self.connections, jobs[1:]):
            for index, result in zip(job, self._receive(connection)):
                results[index] = (result, self.grads[slot[index]]) if kind == "gradients" else result
        return [results[index] for index in range(len(groups))]

    def _local_buffer(self, position):
        """The caller's gradient buffer number ``position``, kept between steps (fresh pages cost more than zeros)."""
        while len(self.local_grads) <= position:
            self.local_grads.append(np.empty(self.total, np.float32))
        return self.local_grads[position]


def _compute(kind, model, weights, grads, shapes, inputs, prepared, *args):
    """One group's job in any process: its loss, with its gradients in the flat array ``grads``, or its output
    (``prepared``: the preparations of these weights kept between eval calls)."""
    if kind == "gradients":
        grads.fill(0)
        return numpy_unet.group_loss_and_gradients(model, weights, _views(grads, shapes), *inputs, *args)
    return numpy_unet.unet_output(model, weights, *inputs, prepared=prepared)


def _stop(connections, processes):
    """Close the workers' sockets (each worker then exits) and wait for them."""
    for connection in connections:
        connection.close()
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
    connections.clear()
    processes.clear()


def serve(fd):
    """A worker's loop on the socket ``fd``: messages ("model", model, shapes), ("buffers", weights path, gradients
    path, slots), ("gradients", [(slot, inputs)], fresh, batch size) and ("outputs", [(slot, inputs)], fresh), fresh
    saying that the shared weights changed since the last message; each answered with ("ok", result) or ("error",
    the exception in one line; its traceback goes to stderr)."""
    connection = Connection(fd)
    keep_freed_memory()
    model = shapes = weights = grads = None
    prepared = {}  # the eval pass's preparations of the shared weights while they stay the same
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the caller closed the socket or exited
            return
        try:
            kind = message[0]
            result = None
            if kind == "model":
                _, model, shapes = message
            elif kind == "buffers":
                _, weights_path, grads_path, slots = message
                total = int(sum(np.prod(shape) for shape in shapes))
                weights = _views(np.memmap(weights_path, np.float32, "r", shape=(max(total, 1),))[:total], shapes)
                grads = np.memmap(grads_path, np.float32, "r+", shape=(max(slots * total, 1),))
                grads = grads[:slots * total].reshape(slots, total)
            else:
                _, jobs, fresh, *args = message
                if fresh:
                    prepared = {}
                result = [_compute(kind, model, weights, grads[slot] if kind == "gradients" else None, shapes,
                                   inputs, prepared, *args) for slot, inputs in jobs]
            answer = ("ok", result)
        except Exception as error:  # noqa: BLE001 - the caller raises it
            traceback.print_exc()
            answer = ("error", f"{type(error).__name__}: {error}")
        try:
            connection.send(answer)
        except OSError:  # the caller ended (Ctrl-C, say) while this worker computed: nothing to report
            return
