"""The prepared dataset: one file of uint8 NHWC images at the training resolution, read image by image.

Layout: ``MAGIC`` and two little-endian uint64 (the record's offset and length) in the first 24 bytes; the images
from byte ``DATA_OFFSET``, image after image; int32 class labels after them when the source has labels; the record
(JSON: count, size, channels, classes, source, crop rule, checksum, skipped files) last. The file is written under a
temporary name and renamed when whole (``files.disk.atomic_write``), so a killed or failed ``prepare`` leaves nothing
that ``read_record`` accepts; a truncated or damaged file fails its size check.

Images are read with ``pread`` from a descriptor held open (``PreparedImages``), not through a memory map: the file's
pages are page cache all the same (every process that trains on it shares them, none holds the dataset in its own
memory), but a file truncated or replaced under a running training is one error line, where a mapped page past a
truncated file's end kills the process with SIGBUS.
"""
import collections
import hashlib
import json
import multiprocessing
import os
import struct
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from megdiffusion.data.sources import CROP_RULE, DatasetError, check_files, decode
from megdiffusion.errors import one_line
from megdiffusion.files.disk import atomic_write, check_not_special, check_writable
from megdiffusion.processes import start_worker

MAGIC = b"MEGDDSET"
FORMAT = "megdiffusion prepared dataset 1"
DATA_OFFSET = 4096
_HEADER = struct.Struct("<8sQQ")
CHUNK = 64  # images a worker decodes per task


def is_prepared(path):
    """Whether ``path`` is a file that begins like a prepared dataset."""
    if not os.path.isfile(path):  # a FIFO would block the read
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class PreparedDataset:
    """A prepared file opened: ``images`` (``PreparedImages``, N x S x S x C), ``labels`` (int32 (N,) or None),
    ``record`` (the JSON record)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.record = read_record(self.path)
        r = self.record
        self.images = PreparedImages(self.path, (r["count"], r["size"], r["size"], r["channels"]))
        self.labels = None
        if r["has_labels"]:
            offset = DATA_OFFSET + self.images.nbytes
            self.labels = np.fromfile(self.path, "<i4", r["count"], offset=offset).astype(np.int32)


class PreparedImages:
    """The images of a prepared file, indexed like a uint8 NHWC array (an int: one HWC image; a slice or an index
    array: stacked), each read from the file (``os.pread``) when asked for. ``DatasetError`` when the file was
    truncated, or replaced by another, since it was opened. Pickles as its path and identity (a worker process opens
    the same file again, and refuses another one under that name)."""

    def __init__(self, path, shape, identity=None):
        self.path, self.shape = path, tuple(shape)
        self.image_bytes = int(np.prod(self.shape[1:]))
        self.nbytes = self.shape[0] * self.image_bytes
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        status = os.fstat(self._fd)
        self.identity = (status.st_dev, status.st_ino)
        if identity is not None and tuple(identity) != self.identity:
            os.close(self._fd)
            self._fd = None
            raise DatasetError(f"{path} was replaced by another file while the run used it; continue with --resume "
                               "once it holds the prepared data again")

    def __reduce__(self):
        return PreparedImages, (self.path, self.shape, self.identity)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return self._read([int(index)])[0]
        if isinstance(index, slice):
            index = range(len(self))[index]
        return self._read([int(i) for i in np.asarray(index).reshape(-1)])

    def _read(self, indices):
        out = np.empty((len(indices),) + self.shape[1:], np.uint8)
        flat = out.reshape(len(indices), self.image_bytes)
        for row, i in enumerate(indices):
            if not -len(self) <= i < len(self):
                raise IndexError(f"image {i} is outside the {len(self)} images of {self.path}")
            offset = DATA_OFFSET + (i % len(self)) * self.image_bytes
            data = os.pread(self._fd, self.image_bytes, offset)
            if len(data) != self.image_bytes:
                size = os.fstat(self._fd).st_size
                raise DatasetError(f"{self.path} was truncated while the run used it ({size:,} bytes now, its images "
                                   f"end at byte {DATA_OFFSET + self.nbytes:,}); prepare it again, then continue "
                                   "with --resume")
            flat[row] = np.frombuffer(data, np.uint8)
        return out


def read_record(path):
    """The record of the prepared file at ``path``; ``DatasetError`` (one line) for a file that is not one, or is
    truncated or damaged."""
    check_not_special(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic, offset, length = _HEADER.unpack(f.read(_HEADER.size).ljust(_HEADER.size, b"\0"))
            if magic != MAGIC:
                raise DatasetError(f"{path} is not a prepared dataset (make one with megdiffusion.scripts.prepare)")
            if offset + length != size or offset < DATA_OFFSET:
                raise DatasetError(f"{path} is truncated or damaged ({size} bytes, the header promises "
                                   f"{offset + length}); prepare it again")
            f.seek(offset)
            record = json.loads(f.read(length))
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {one_line(exc)}") from None
    except ValueError:
        raise DatasetError(f"{path}: its record is damaged; prepare it again") from None
    expected = DATA_OFFSET + record["count"] * record["size"] ** 2 * record["channels"] \
        + (4 * record["count"] if record["has_labels"] else 0)
    if record.get("format") != FORMAT or expected != offset:
        raise DatasetError(f"{path} is truncated or damaged (its images end at byte {offset}, its record says "
                           f"{expected}); prepare it again")
    return record


def checksum(path):
    """The SHA-256 of a prepared file's images and labels, as its record writes it (reads the whole file)."""
    record = read_record(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(DATA_OFFSET)
        remaining = record["count"] * record["size"] ** 2 * record["channels"] + 4 * record["count"] * \
            record["has_labels"]
        while remaining:
            block = f.read(min(remaining, 1 << 24))
            digest.update(block)
            remaining -= len(block)
    return "sha256:" + digest.hexdigest()


def _decode_chunk(kind, names, items, size, skip_bad):
    """Decode one chunk (in a worker): (uint8 (n, S, S, C) of the images that read, [(position, name, reason)] of
    those that did not). Without ``skip_bad`` the first unreadable image raises ``DatasetError``."""
    images, failed = [], []
    for position, (name, item) in enumerate(zip(names, items)):
        try:
            images.append(decode(kind, name, item, size))
        except DatasetError as exc:
            if not skip_bad:
                raise
            failed.append((position, name, str(exc)))
    stacked = np.stack(images) if images else None
    return stacked, failed


def _chunks_in_order(source, size, skip_bad, workers):
    """The decoded chunks of ``source`` in order, at most ``2 * workers`` in flight (memory does not grow with the
    source); decoded in this process when ``workers`` is 0."""
    if workers == 0:
        for start, names, items in source.chunks(CHUNK):
            yield start, names, _decode_chunk(source.kind, names, items, size, skip_bad)
        return
    context = multiprocessing.get_context("spawn")  # the caller may hold threads (or a CUDA context)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=start_worker) as pool:
        pending = collections.deque()
        try:
            for start, names, items in source.chunks(CHUNK):
                pending.append((start, names, pool.submit(_decode_chunk, source.kind, names, items, size, skip_bad)))
                while len(pending) >= 2 * workers:
                    start_, names_, future = pending.popleft()
                    yield start_, names_, future.result()
            while pending:
                start_, names_, future = pending.popleft()
                yield start_, names_, future.result()
        finally:
            for _, _, future in pending:
                future.cancel()


def prepare(source, dest, size, workers=None, skip_bad=False, overwrite=False, progress=False):
    """Write ``source`` (a ``sources.Source``) to the prepared file ``dest`` at ``size`` x ``size``; returns the
    record. ``workers`` decode in parallel (default: every core; 0: in this process). Unreadable images are one
    ``DatasetError`` naming the file, or with ``skip_bad`` left out, counted and listed in the record. ``dest`` is
    checked before any work and written atomically."""
    check_writable(dest, "DEST", directory=False, overwrite=overwrite)
    if source.kind == "file" and not skip_bad:
        check_files(source.items(0, len(source)))
    workers = (os.cpu_count() or 1) if workers is None else workers
    channels = source.channels
    digest = hashlib.sha256()
    kept_labels, skipped, count = [], [], 0
    bar = None
    if progress:
        from megdiffusion.progress import progress_bar

        bar = progress_bar(total=len(source), unit="img", desc="prepare")
    try:
        with atomic_write(dest) as f:
            f.write(b"\0" * DATA_OFFSET)
            for start, names, (images, failed) in _chunks_in_order(source, size, skip_bad, workers):
                bad = {position for position, _, _ in failed}
                skipped += [{"name": name, "reason": reason} for _, name, reason in failed]
                if images is not None:
                    if images.shape[1:] != (size, size, channels):
                        raise DatasetError(f"{names[0]} decoded to {images.shape[1:]}, not ({size}, {size}, "
                                           f"{channels})")
                    block = np.ascontiguousarray(images).tobytes()
                    f.write(block)
                    digest.update(block)
                    count += len(images)
                if source.labels is not None:
                    kept_labels += [source.labels[start + i] for i in range(len(names)) if i not in bad]
                if bar is not None:
                    bar.update(len(names))
            if count == 0:
                raise DatasetError(f"no image of {source.description} could be read ({len(skipped)} skipped)")
            if source.labels is not None:
                block = np.asarray(kept_labels, "<i4").tobytes()
                f.write(block)
                digest.update(block)
            record = {"format": FORMAT, "count": count, "size": size, "channels": channels,
                      "has_labels": source.labels is not None, "classes": source.classes,
                      "source": source.description, "crop": CROP_RULE.format(size=size),
                      "checksum": "sha256:" + digest.hexdigest(), "skipped": skipped}
            offset = f.tell()
            text = json.dumps(record).encode()
            f.write(text)
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, offset, len(text)))
    except BaseException:
        if bar is not None:
            bar.leave = False  # the error line stands alone
        raise
    finally:
        if bar is not None:
            bar.close()
    return record
