"""A rank's training steps made ahead: each step's batch (images, flips, float conversion) and random draws
(``draws``), computed by worker processes while the current step runs.

The main process plans the steps in order (``BatchLoader.next_indices``: the order, flips and rank shares are the
loader's), so the batches are the loader's whatever the number of workers; a worker turns a plan into arrays. The
draws are functions of (seed, step, sample) alone, so a worker computes exactly what the trainer would. Workers write
into a ring of slots in one shared file (in /dev/shm, unlinked as soon as every worker has mapped it; one left by a
process killed in that window is removed by the next run's start): handing over a step costs the main process no
copy.

Images held in memory (a plain array) are gathered by the main process (cheap at the sizes one holds in memory);
images read from disk (a prepared file, a streamed folder) are read by the workers, so decoding is off
the step's critical path. The checkpointed position (``state_dict``) is that of the last step handed out, not of the
steps planned ahead: exact resume is unchanged.
"""
import contextlib
import multiprocessing
import os
import queue
import tempfile
import time

import numpy as np

from megdiffusion.data.sources import DatasetError
from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.processes import start_worker
from megdiffusion.data.loader import batch_images
from megdiffusion.training.draws import StepDraws

_POLL = 1.0  # seconds between checks that the other side is alive


_PREFIX = "megdiffusion-feed-"  # the slot files: megdiffusion-feed-<pid of the training process>-<random>


def _slot_directory(size):
    """/dev/shm when it has room for ``size`` bytes and more (a container's is often 64 MB, and a mapped page past its
    end kills the process), else the temporary directory (a file there is as fast while it stays in page cache)."""
    try:
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize > 2 * size:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def _remove_orphans(directory):
    """Remove slot files left by a training process killed while its workers started (the only window in which a
    slot file has a name)."""
    for name in os.listdir(directory):
        pid = name[len(_PREFIX):].partition("-")[0]
        if name.startswith(_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


class FeedError(MegdiffusionError):
    """A data worker died or failed; the message is one line."""


def _readable_elsewhere(images):
    """What a worker process reads the images through (a prepared file's ``PreparedImages``, a streamed folder: each
    pickles as its file or paths), or None when they are a plain array in this process's memory."""
    return None if isinstance(images, np.ndarray) else images


class _Slots:
    """``depth`` slots, each the x0, noise and (optional) perturbation arrays of one step, in one mapped file."""

    def __init__(self, path, depth, shape, perturbation, create):
        self.shape = shape
        self.parts = 3 if perturbation else 2
        count = self.nbytes(depth, shape, perturbation) // 4
        if create:
            with open(path, "wb") as f:
                f.truncate(count * 4)
        self.array = np.memmap(path, np.float32, "r+", 0, (depth, self.parts) + tuple(shape))

    @staticmethod
    def nbytes(depth, shape, perturbation):
        """The size of the file of ``depth`` slots of float32 arrays of ``shape``."""
        return depth * (3 if perturbation else 2) * int(np.prod(shape)) * 4

    def views(self, slot):
        """(x0, noise, perturbation or None) of ``slot``."""
        parts = self.array[slot]
        return parts[0], parts[1], parts[2] if self.parts == 3 else None


def _worker(images, draw, path, depth, shape, perturbation, tasks, results, parent):
    """A worker's loop: plans in, arrays into their slot, a short message out."""
    start_worker()  # Ctrl-C is the main process's to handle (a checkpoint first)
    slots = _Slots(path, depth, shape, perturbation, create=False)
    results.put(("ready", os.getpid()))
    while True:
        try:
            task = tasks.get(timeout=_POLL)
        except queue.Empty:
            if os.getppid() != parent:  # the main process is gone (killed): do not linger
                return
            continue
        if task is None:
            return
        step, slot, indices, flips, labels = task
        try:
            x0, noise, pert = slots.views(slot)
            if images is not None:
                x0[...] = batch_images(images, indices, flips)
            draws = draw(step, (len(flips),) + tuple(shape[1:]), labels)
            noise[...] = draws.noise
            if pert is not None:
                pert[...] = draws.perturbation
            results.put(("done", step, draws.t, draws.labels, draws.dropout_seed))
        except DatasetError as exc:  # an unreadable image of a streamed folder, a prepared file truncated
            results.put(("failed", step, DatasetError, str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported as one line by the main process
            results.put(("failed", step, FeedError, f"a data worker failed at step {step + 1}: "
                                                    f"{type(exc).__name__}: {one_line(exc)}"))


class StepFeed:
    """``next(step)``: the batch, labels and ``StepDraws`` of ``step`` from ``loader`` and ``draw``
    (``draw(step, shape, labels)``, picklable); with ``workers`` > 0 made ahead in that many processes,
    ``depth - 1`` steps ahead. ``state_dict``/``load_state_dict`` are the loader's position after the last step
    handed out. ``close`` stops the workers (also on garbage collection)."""

    def __init__(self, loader, draw, workers=0, depth=None, perturbation=False):
        self.loader = loader
        self.draw = draw
        self.workers = workers
        self.depth = depth or workers + 2
        self.perturbation = perturbation
        _, height, width, channels = loader.images.shape
        self.shape = (loader.local_batch, channels, height, width)
        self._consumed = loader.state_dict()
        self._processes = []
        self._expected = None  # the step next() is expected to be asked for
        self._plans = {}  # step -> (slot, indices, flips, labels, loader state after it)
        self._done = {}  # step -> the worker's message
        self._planned_to = None  # the next step to plan

    def state_dict(self):
        """The loader's position after the last step handed out."""
        return dict(self._consumed)

    def load_state_dict(self, state):
        """Continue from ``state`` (drops whatever was planned ahead)."""
        self.close()
        self.loader.load_state_dict(state)
        self._consumed = self.loader.state_dict()

    def next(self, step):
        """(x0 float32 NCHW, labels or None, ``StepDraws``) of ``step``. The arrays live until the next call."""
        if step != self._expected:
            self._restart(step)
        if not self.workers:
            indices, flips = self.loader.next_indices()
            self._consumed = self.loader.state_dict()
            labels = self._labels(indices)
            self._expected = step + 1
            x0 = batch_images(self.loader.images, indices, flips)
            return x0, labels, self.draw(step, x0.shape, labels)
        self._plan_ahead(step)
        message = self._wait(step)
        slot, indices, flips, labels, state = self._plans.pop(step)
        self._consumed = state
        self._expected = step + 1
        x0, noise, perturbation = self._slots.views(slot)
        if self._source is None:
            x0 = batch_images(self.loader.images, indices, flips)
        _, _, t, drawn_labels, dropout_seed = message
        return x0, labels, StepDraws(t, noise, perturbation, drawn_labels, dropout_seed)

    def _labels(self, indices):
        return None if self.loader.labels is None else self.loader.labels[indices]

    def _restart(self, step):
        self.close()
        self._expected = step
        if self.workers:
            self._start()
            self._planned_to = step

    def _start(self):
        context = multiprocessing.get_context("spawn")  # the trainer holds threads, maybe a CUDA context
        directory = _slot_directory(_Slots.nbytes(self.depth, self.shape, self.perturbation))
        _remove_orphans(directory)
        fd, path = tempfile.mkstemp(dir=directory, prefix=f"{_PREFIX}{os.getpid()}-")
        os.close(fd)
        try:
            self._slots = _Slots(path, self.depth, self.shape, self.perturbation, create=True)
            self._source = _readable_elsewhere(self.loader.images)
            self._tasks, self._results = context.Queue(), context.Queue()
            for _ in range(self.workers):
                process = context.Process(target=_worker, daemon=True, args=(
                    self._source, self.draw, path, self.depth, self.shape, self.perturbation, self._tasks,
                    self._results, os.getpid()))
                process.start()
                self._processes.append(process)
            ready = 0
            while ready < self.workers:
                message = self._get()
                ready += message[0] == "ready"
        finally:
            os.remove(path)  # every worker has it mapped (or none will): nothing outlives the processes

    def _plan_ahead(self, step):
        """Give the workers every step up to ``step + depth - 1`` not yet given (slot ``step % depth`` is free:
        its previous step was handed out before this call)."""
        while self._planned_to < step + self.depth:
            planned = self._planned_to
            indices, flips = self.loader.next_indices()
            labels = self._labels(indices)
            slot = planned % self.depth
            self._plans[planned] = (slot, indices, flips, labels, self.loader.state_dict())
            self._tasks.put((planned, slot, indices if self._source is not None else None, flips, labels))
            self._planned_to += 1

    def _get(self):
        while True:
            try:
                return self._results.get(timeout=_POLL)
            except queue.Empty:
                dead = [p for p in self._processes if not p.is_alive()]
                if dead:
                    raise FeedError(f"a data worker (pid {dead[0].pid}) died with exit code {dead[0].exitcode}; "
                                    "continue with --resume (--data_workers 0 makes the batches in the training "
                                    "process)") from None

    def _wait(self, step):
        while step not in self._done:
            message = self._get()
            if message[0] == "failed":
                self.close()
                _, _, error, text = message
                raise error(text)
            self._done[message[1]] = message
        return self._done.pop(step)

    def close(self):
        """Stop the workers and forget what was planned ahead."""
        processes, self._processes = self._processes, []
        for _ in processes:
            self._tasks.put(None)
        deadline = time.monotonic() + 5
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self._plans, self._done, self._expected = {}, {}, None
        if processes:
            self.loader.load_state_dict(self._consumed)  # the planning went ahead of what was handed out

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
