"""Image sources read item by item, never whole: a folder of image files (recursive, optionally with classes from
its first-level subfolders), LSUN's LMDB of encoded images, and arrays already in memory (CIFAR-10's batches, an
npz, Fashion-MNIST's idx files).

One rule turns every image into a training image (``fit_square``): centre-crop to a square, then PIL's bicubic
resize to the training size. ``prepare`` (``data.prepared``), the streamed folder and FID's folders all use it, so
the same file gives the same pixels on every path.

A source yields its items in chunks (``chunks``); ``decode`` turns one item into uint8 HWC pixels. The items are
cheap (paths, encoded bytes, small arrays) and ``decode`` is a module-level function, so worker processes can
decode while the caller reads on.
"""
import io
import os
import stat
from pathlib import Path

import numpy as np
from PIL import Image

from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.files.images import ImageError, check_image, open_image, pillow_quiet

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
CROP_RULE = "centre crop to a square, then PIL bicubic resize to {size}x{size}"


class DatasetError(MegdiffusionError):
    """Bad dataset input; the message is one line that says what is wrong and how to fix it."""


def fit_square(image, size):
    """Centre-crop a PIL image to a square, then resize it to size x size (bicubic): the one crop rule."""
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    with pillow_quiet():
        image = image.crop((left, top, left + side, top + side))
        return image if side == size else image.resize((size, size), Image.BICUBIC)


def decode_file(path, size):
    """The image file at ``path`` as uint8 (size, size, 3) RGB (``size`` None: as stored); ``DatasetError``
    naming the file when it does not read."""
    try:
        image = open_image(path)
    except ImageError as exc:
        raise DatasetError(str(exc)) from None
    return np.asarray(fit_square(image, size) if size else image)


def check_files(paths):
    """``DatasetError`` naming the first of the image files ``paths`` whose header does not read: found before a
    command writes anything, not when its turn comes (about 35 us a file)."""
    for path in paths:
        try:
            check_image(path)
        except ImageError as exc:
            raise DatasetError(str(exc)) from None


def decode_encoded(name, data, size):
    """Encoded image bytes (an LMDB value) as uint8 (size, size, 3) RGB; ``DatasetError`` naming the entry."""
    try:
        image = open_image(io.BytesIO(data), name=name)
    except ImageError as exc:
        raise DatasetError(f"{exc}, or pass --skip_bad") from None
    return np.asarray(fit_square(image, size))


def decode_array(image, size):
    """A uint8 HWC image (1 or 3 channels) at size x size (``fit_square`` when it is not already)."""
    if image.shape[:2] == (size, size) or not size:
        return image
    gray = image.shape[2] == 1
    pil = Image.fromarray(image[:, :, 0] if gray else image, "L" if gray else "RGB")
    return np.asarray(fit_square(pil, size)).reshape(size, size, image.shape[2])


def decode(kind, name, item, size):
    """One item of a source of ``kind`` ("file", "encoded", "array") as uint8 (size, size, C)."""
    if kind == "file":
        return decode_file(item, size)
    if kind == "encoded":
        return decode_encoded(name, item, size)
    return decode_array(item, size)


def image_paths(root):
    """The image files under ``root`` (recursive, ``IMAGE_EXTENSIONS``), sorted by their path relative to it.
    Symbolic links are followed, but each real directory is walked once and never one that holds ``root`` (a link
    loop adds nothing), each real file is listed once (under its first path in that order), and only regular files
    count (a FIFO or device named like an image would block or never end)."""
    root = Path(root)
    real_root = os.path.realpath(root)
    walked, found = set(), []
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        walked.add(os.path.realpath(directory))
        subdirectories[:] = [name for name in sorted(subdirectories)
                             if _walk_into(os.path.realpath(os.path.join(directory, name)), walked, real_root)]
        found += [os.path.join(directory, name) for name in files if name.lower().endswith(IMAGE_EXTENSIONS)]
    found.sort(key=lambda p: Path(p).relative_to(root).parts)
    seen, unique = set(), []
    for path in found:
        try:
            status = os.stat(path)
        except OSError:  # a dangling link
            continue
        if stat.S_ISREG(status.st_mode) and (status.st_dev, status.st_ino) not in seen:
            seen.add((status.st_dev, status.st_ino))
            unique.append(path)
    return unique


def _walk_into(real, walked, real_root):
    """Whether the walk goes into the directory whose real path is ``real``: not one walked already, not an
    ancestor of the root."""
    return real not in walked and not real_root.startswith(real.rstrip(os.sep) + os.sep)


def subfolder_classes(root, paths):
    """Class names (the first-level subfolders that hold images, sorted) and each path's class index;
    ``DatasetError`` when an image lies directly in ``root`` or there are no subfolders."""
    root = Path(root)
    firsts = [Path(p).relative_to(root).parts for p in paths]
    loose = [os.path.join(root, *parts) for parts in firsts if len(parts) == 1]
    if loose:
        raise DatasetError(f"a folder's class labels are its first-level subfolders, but {loose[0]} (and "
                           f"{len(loose) - 1} more) lie in {root} itself; move the images into one subfolder per "
                           "class, or use no labels")
    classes = sorted({parts[0] for parts in firsts})
    index = {name: i for i, name in enumerate(classes)}
    return classes, np.array([index[parts[0]] for parts in firsts], np.int32)


class Source:
    """Items to decode: ``kind`` (see ``decode``), ``channels``, ``labels`` (int32 (N,) or None), ``classes``
    (names or None), ``description``; ``names(start, stop)``/``items(start, stop)`` read them in order."""

    kind = "array"
    channels = 3
    labels = None
    classes = None

    def __len__(self):
        raise NotImplementedError

    def chunks(self, size):
        """(start, names, items) for consecutive chunks of at most ``size`` items, in order."""
        for start in range(0, len(self), size):
            stop = min(start + size, len(self))
            yield start, self.names(start, stop), self.items(start, stop)


class FolderSource(Source):
    """Every image file under a directory (recursive, sorted); with ``labels``, classes from the first-level
    subfolders (sorted names)."""

    kind = "file"

    def __init__(self, root, labels=False):
        if not os.path.isdir(root):
            raise DatasetError(f"{root} is not a directory of images")
        self.paths = image_paths(root)
        if not self.paths:
            raise DatasetError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root}")
        if labels:
            self.classes, self.labels = subfolder_classes(root, self.paths)
        self.description = f"folder {os.path.abspath(root)}"

    def __len__(self):
        return len(self.paths)

    def names(self, start, stop):
        return self.paths[start:stop]

    def items(self, start, stop):
        return self.paths[start:stop]


class ArraySource(Source):
    """uint8 NHWC images already in memory, with their labels when they have them."""

    def __init__(self, images, labels, description):
        self.images = images
        self.labels = labels
        self.channels = images.shape[3]
        self.description = description

    def __len__(self):
        return len(self.images)

    def names(self, start, stop):
        return [f"image {i} of {self.description}" for i in range(start, stop)]

    def items(self, start, stop):
        return list(self.images[start:stop])


class LmdbSource(Source):
    """LSUN's LMDB: every value an encoded image (WebP, JPEG or PNG), in key order. Needs the ``lmdb`` package
    (``pip install megdiffusion[lmdb]``)."""

    kind = "encoded"

    def __init__(self, path):
        try:
            import lmdb
        except ImportError:
            raise DatasetError(f"{path} is an LMDB database; reading it needs the lmdb package: "
                               "pip install 'megdiffusion[lmdb]' (or pip install lmdb)") from None
        self.path = path
        try:
            self._env = lmdb.open(path, readonly=True, lock=False, readahead=False, subdir=os.path.isdir(path))
        except lmdb.Error as exc:
            raise DatasetError(f"cannot open LMDB {path}: {one_line(exc)}") from None
        self._count = self._env.stat()["entries"]
        if not self._count:
            raise DatasetError(f"the LMDB {path} holds no entries")
        self.description = f"LMDB {os.path.abspath(path)}"

    def __len__(self):
        return self._count

    def chunks(self, size):
        with self._env.begin(buffers=False) as txn:
            names, items, start = [], [], 0
            for key, value in txn.cursor():
                names.append(f"{self.path} entry {key.decode(errors='replace')}")
                items.append(value)
                if len(items) == size:
                    yield start, names, items
                    start += len(items)
                    names, items = [], []
            if items:
                yield start, names, items


def is_lmdb(path):
    """Whether ``path`` is an LMDB environment (a directory holding data.mdb, or the data file itself)."""
    path = Path(path)
    return (path.is_dir() and (path / "data.mdb").is_file()) or (path.is_file() and path.suffix == ".mdb")
