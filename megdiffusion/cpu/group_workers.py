"""Worker processes that compute groups of a batch through ``cpu.numpy_unet`` (``megdiffusion.cpu.native``): the
forward and backward of a training step (the loss between them is the caller's), or the output of an eval-mode call.

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


_INSTEAD = "MEGDIFFUSION_NATIVE_STEP=0 trains on MegEngine's engine, without worker processes"


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

    def gradients(self, flat_weights, groups, head):
        """[(loss, flat gradient)] of each group in ``groups`` ([(x_t, temb_in, labels, dropout seed)]) at the weights
        ``flat_weights``, in group order. Each group's training pass (``numpy_unet.training_pass``) runs forward in
        its process; ``head(index, output)`` gives its loss and d loss / d output (the diffusion's own loss, in
        this process); then its backward. The groups go in waves of one per process, so each process holds one
        group's activations at a time, as a whole pass would."""
        processes = min(len(self.connections) + 1, len(groups))
        remote = [index for index in range(len(groups)) if index % processes]
        slot = {index: i for i, index in enumerate(remote)}
        self._use_weights(flat_weights, fixed=False)
        if remote:
            if self.grads is None or len(self.grads) < len(remote):
                self._map_buffers(len(remote))
            np.copyto(self.weights, flat_weights)
        worker = {index: self.connections[index % processes - 1] for index in remote}  # group index -> its socket
        results = {}
        with one_blas_thread():
            for start in range(0, len(groups), processes):
                wave = range(start, min(start + processes, len(groups)))
                for index in wave[1:]:
                    self._send(worker[index], ("forward", slot[index], groups[index]))
                buffer = self._local_buffer(start // processes)
                buffer.fill(0)
                output, backward = numpy_unet.training_pass(self.model, self.views, _views(buffer, self.shapes),
                                                            *groups[start])
                outputs = {start: output, **{index: self._receive(worker[index]) for index in wave[1:]}}
                heads = {index: head(index, outputs[index]) for index in wave}
                for index in wave[1:]:
                    self._send(worker[index], ("backward", slot[index], heads[index][1]))
                backward(heads[start][1])
                results[start] = heads[start][0], buffer
                for index in wave[1:]:
                    self._receive(worker[index])
                    results[index] = heads[index][0], self.grads[slot[index]]
        return [results[index] for index in range(len(groups))]

    def outputs(self, flat_weights, groups):
        """The network's output (NCHW) for each group in ``groups`` ([(x NCHW, temb_in)]) at ``flat_weights``: an
        array taken as unchanged when it was the last one given here (``NativeModel``'s weights, fixed), so that
        sampling copies the weights to the workers and prepares them for oneDNN once, not at every call."""
        processes = min(len(self.connections) + 1, len(groups))
        jobs = [list(range(p, len(groups), processes)) for p in range(processes)]
        self._use_weights(flat_weights, fixed=True)
        if jobs[1:]:
            if self.grads is None:
                self._map_buffers(0)
            fresh = not self.shared_fixed  # the workers drop their preparations of older weights
            if fresh:
                np.copyto(self.weights, flat_weights)
                self.shared_fixed = True
            for connection, job in zip(self.connections, jobs[1:]):
                self._send(connection, ("outputs", [groups[i] for i in job], fresh))
        results = {}
        with one_blas_thread():
            for index in jobs[0]:
                results[index] = numpy_unet.unet_output(self.model, self.views, *groups[index], prepared=self.prepared)
        for connection, job in zip(self.connections, jobs[1:]):
            for index, result in zip(job, self._receive(connection)):
                results[index] = result
        return [results[index] for index in range(len(groups))]

    def _use_weights(self, flat_weights, fixed):
        """Views of ``flat_weights`` for this process; ``fixed``: an eval call's weights, whose views, oneDNN layouts
        and shared copy are kept while the same array comes again."""
        if not (fixed and flat_weights is self.fixed_weights):
            self.fixed_weights = flat_weights if fixed else None
            self.views, self.prepared, self.shared_fixed = _views(flat_weights, self.shapes), {}, False

    def _local_buffer(self, position):
        """The caller's gradient buffer number ``position``, kept between steps (fresh pages cost more than zeros)."""
        while len(self.local_grads) <= position:
            self.local_grads.append(np.empty(self.total, np.float32))
        return self.local_grads[position]


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
    path, slots), ("forward", slot, inputs) then ("backward", slot, d output) of a training pass into gradient slot
    ``slot``, and ("outputs", [inputs], fresh) of eval calls, fresh saying that the shared weights changed since the
    last ones; each answered with ("ok", result) or ("error", the exception in one line; its traceback goes to
    stderr)."""
    connection = Connection(fd)
    keep_freed_memory()
    model = shapes = weights = grads = None
    prepared = {}  # the eval pass's preparations of the shared weights while they stay the same
    pending = {}  # slot -> the backward of its training pass
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
            elif kind == "forward":
                _, slot, inputs = message
                prepared = {}
                grads[slot].fill(0)
                result, pending[slot] = numpy_unet.training_pass(model, weights, _views(grads[slot], shapes), *inputs)
            elif kind == "backward":
                _, slot, doutput = message
                pending.pop(slot)(doutput)
            else:
                _, jobs, fresh = message
                if fresh:
                    prepared = {}
                result = [numpy_unet.unet_output(model, weights, *inputs, prepared=prepared) for inputs in jobs]
            answer = ("ok", result)
        except Exception as error:  # noqa: BLE001 - the caller raises it
            traceback.print_exc()
            answer = ("error", f"{type(error).__name__}: {error}")
        try:
            connection.send(answer)
        except OSError:  # the caller ended (Ctrl-C, say) while this worker computed: nothing to report
            return
