"""Datasets as uint8 NHWC arrays (RGB, or one channel for grayscale data), loaded by name.

``load_dataset(name, path, image_size)`` is the single entry point; every loader reports bad input by
raising ``DatasetError`` with a one-line message that says what to fix.
"""
import gzip
import os
from pathlib import Path

import numpy as np

from megdiffusion.data.prepared import PreparedDataset, is_prepared, read_record
from megdiffusion.data.sources import CROP_RULE, IMAGE_EXTENSIONS, DatasetError, check_files, decode_array, \
    decode_file, image_paths, is_lmdb, subfolder_classes
from megdiffusion.errors import one_line
from megdiffusion.files.disk import read_npz
from megdiffusion.files.torch_archive import load_array_pickle

ASSETS = Path(__file__).parent / "assets"
IMAGES, LABELS = "images-idx3", "labels-idx1"  # the two kinds of Fashion-MNIST idx file


def _read_idx(path):
    """The bytes of an idx file (optionally gzipped) and its big-endian 32-bit header words."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"cannot read idx file {path}: {one_line(exc)}") from None
    return data, [int.from_bytes(data[i:i + 4], "big") for i in range(0, 16, 4)]  # 0 past a short file's end


def read_idx_images(path):
    """Read an idx3-ubyte image file (optionally gzipped) as uint8 (N, H, W, 1)."""
    data, header = _read_idx(path)
    magic, n, h, w = header
    if magic != 2051 or len(data) != 16 + n * h * w:
        raise DatasetError(f"{path} is not an idx3 image file (magic {magic}, {len(data)} bytes)")
    return np.frombuffer(data, np.uint8, offset=16).reshape(n, h, w, 1)


def read_idx_labels(path):
    """Read an idx1-ubyte label file (optionally gzipped) as int32 (N,)."""
    data, header = _read_idx(path)
    magic, n = header[:2]
    if magic != 2049 or len(data) != 8 + n:
        raise DatasetError(f"{path} is not an idx1 label file (magic {magic}, {len(data)} bytes)")
    return np.frombuffer(data, np.uint8, offset=8).astype(np.int32)


def _idx_file(directory, stem):
    """``directory``/``stem``, or the same gzipped, whichever exists; else None."""
    return next((c for c in (directory / stem, directory / f"{stem}.gz") if c.is_file()), None)


def _fashion_mnist_file(path, kind):
    """The Fashion-MNIST idx file of ``kind`` (``IMAGES`` or ``LABELS``) that ``--data_path`` means: the embedded
    split's without one; beside an images file, the labels file of the same name (gzipped or not); in a directory,
    the train split's, else the test split's."""
    if path is None:
        return ASSETS / f"t10k-{kind}-ubyte.gz"
    path = Path(path)
    if path.is_file():
        if kind == IMAGES:
            return path
        name = path.name.removesuffix(".gz")
        stem = name.replace(IMAGES, kind)
        found = _idx_file(path.parent, stem) if stem != name else None
        if found is None:
            raise DatasetError(f"no {kind} file beside {path} (expected {stem}[.gz]); point --data_path at the "
                               "directory of the Fashion-MNIST idx files")
        return found
    for stem in (f"train-{kind}-ubyte", f"t10k-{kind}-ubyte"):
        found = _idx_file(path, stem)
        if found is not None:
            return found
    raise DatasetError(f"no train-{kind}-ubyte[.gz] or t10k-{kind}-ubyte[.gz] in {path}; "
                       "point --data_path at the Fashion-MNIST idx files, or omit it for the embedded split")


def _fashion_mnist(path):
    return read_idx_images(_fashion_mnist_file(path, IMAGES))


def _cifar10_batches(path):
    """The five training batches of CIFAR-10's python version: dicts with b"data" and b"labels"."""
    if path is None:
        raise DatasetError("cifar10 needs --data_path: the directory of the CIFAR-10 python batches "
                           "(data_batch_1 .. data_batch_5)")
    path = Path(path)
    if (path / "cifar-10-batches-py").is_dir():
        path = path / "cifar-10-batches-py"
    batches = [path / f"data_batch_{i}" for i in range(1, 6)]
    missing = [b.name for b in batches if not b.is_file()]
    if missing:
        raise DatasetError(f"CIFAR-10 python batches missing in {path}: {', '.join(missing)}")
    contents = []
    for batch in batches:
        try:
            # The official batches are pickled dicts of numpy arrays and lists (Python 2 pickles).
            content = load_array_pickle(batch, encoding="bytes")
            contents.append({key: np.asarray(content[key]) for key in (b"data", b"labels")})
        except Exception as exc:  # noqa: BLE001 - any failure means an unreadable batch
            raise DatasetError(f"cannot read CIFAR-10 batch {batch}: {one_line(exc)}") from None
        _check_cifar10_batch(batch, **{key.decode(): value for key, value in contents[-1].items()})
    return contents


def _check_cifar10_batch(batch, data, labels):
    """``DatasetError`` unless a batch holds rows of 3072 bytes (a 32x32 RGB image) and one label 0-9 a row."""
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or not np.issubdtype(data.dtype, np.integer) or \
            (data.size and (data.min() < 0 or data.max() > 255)):
        raise DatasetError(f"CIFAR-10 batch {batch} holds data {data.dtype} {data.shape}, not rows of 3072 bytes "
                           "(32x32 RGB images); use the python version of CIFAR-10 (cifar-10-python.tar.gz)")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer) or \
            (labels.size and (labels.min() < 0 or labels.max() > 9)):
        raise DatasetError(f"CIFAR-10 batch {batch} holds labels {labels.dtype} {labels.shape} for {len(data)} "
                           "images, not one class 0-9 an image; use the python version of CIFAR-10 "
                           "(cifar-10-python.tar.gz)")


def _cifar10(path):
    arrays = [batch[b"data"].astype(np.uint8) for batch in _cifar10_batches(path)]
    # Rows are 3072 bytes: the R, G and B planes of a 32x32 image, in that order (RGB, unlike MegEngine's CIFAR10).
    return np.concatenate(arrays).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


class ImageFolder:
    """The images under a directory (``sources.image_paths``: recursive, sorted), decoded when an item is asked
    for, as uint8 HWC RGB; with ``image_size``, centre-cropped and resized to it (``sources.fit_square``). An index
    array gives the stacked images. Training's streamed "folder" dataset and FID's image directories read through
    it; it never holds more than the images asked for. Pickles as its paths (worker processes decode too)."""

    def __init__(self, root, image_size=None, paths=None):
        self.root = root
        self.paths = image_paths(root) if paths is None else paths
        if not self.paths:
            raise DatasetError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root}")
        self.image_size = image_size

    def __len__(self):
        return len(self.paths)

    @property
    def shape(self):
        """(N, size, size, 3): what the stacked folder would be (with ``image_size``)."""
        return (len(self.paths), self.image_size, self.image_size, 3)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return decode_file(self.paths[index], self.image_size)
        if isinstance(index, slice):
            index = range(len(self))[index]
        images = [decode_file(self.paths[i], self.image_size) for i in np.asarray(index).reshape(-1)]
        return np.stack(images) if images else np.empty((0,) + self.shape[1:], np.uint8)

    def labels(self):
        """Class labels from the first-level subfolders (sorted names), and the names."""
        classes, labels = subfolder_classes(self.root, self.paths)
        return labels, classes


class Subset:
    """The images ``indices`` of ``images`` (an array, ``PreparedImages`` or ``ImageFolder``), read when asked for, with
    the same indexing (an int: one HWC image; an index array: stacked) and ``shape``."""

    def __init__(self, images, indices):
        self.images = images
        self.indices = np.asarray(indices)

    def __len__(self):
        return len(self.indices)

    @property
    def shape(self):
        return (len(self.indices),) + tuple(self.images.shape[1:])

    def __getitem__(self, index):
        return self.images[self.indices[index]]


def _folder(path, image_size):
    if path is None or not Path(path).is_dir():
        raise DatasetError(f"--data_path must be a directory of images for dataset 'folder', got {path!r}")
    if is_lmdb(path):
        raise DatasetError(f"--data_path {path} is an LMDB database (LSUN's), not a folder of images: train with "
                           f"--data_path DEST after python -m megdiffusion.scripts.prepare {path} DEST --image_size N")
    other = array_dataset(Path(path))
    if other:
        raise DatasetError(f"--data_path {path} holds {other}'s files, not a folder of images: use --dataset {other}")
    if not image_size:
        raise DatasetError("dataset 'folder' needs --image_size (images are centre-cropped and resized to it)")
    folder = ImageFolder(path, image_size)
    check_files(folder.paths)
    return folder


def _prepared(path, image_size, resumed=False):
    if path is None or not is_prepared(path):
        raise DatasetError(f"--data_path must be a file written by megdiffusion.scripts.prepare for dataset "
                           f"'prepared', got {path!r}")
    dataset = PreparedDataset(path)
    size = dataset.record["size"]
    if image_size and image_size != size:
        if resumed:
            raise DatasetError(f"{path} holds {size}x{size} images, but the run continued trains at "
                               f"{image_size}x{image_size}: prepare the source again with --image_size {image_size}")
        raise DatasetError(f"{path} holds {size}x{size} images, not --image_size {image_size}: prepare the source "
                           f"again with --image_size {image_size}, or train at {size}")
    return dataset.images


def _npz(path):
    if path is None or not Path(path).is_file():
        raise DatasetError(f"--data_path must be an .npz file with uint8 NHWC images under 'arr_0', got {path!r}")
    try:
        arrays = read_npz(path)
    except ValueError as exc:
        raise DatasetError(str(exc)) from None
    if "arr_0" not in arrays:
        raise DatasetError(f"{path} has no 'arr_0' array (expected uint8 NHWC images; it holds: "
                           f"{', '.join(arrays) or 'nothing'})")
    images = arrays["arr_0"]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] not in (1, 3):
        raise DatasetError(f"{path}: arr_0 must be uint8 NHWC with 1 or 3 channels, "
                           f"got {images.dtype} {images.shape}")
    return images


def _npz_labels(path):
    arrays = read_npz(path) if path is not None and Path(path).is_file() else {}
    if "arr_1" not in arrays:
        raise DatasetError(f"--data_path {path} has no class labels: a class-conditional run (--num_classes) on an "
                           "npz needs them under 'arr_1' (integers, one per image of 'arr_0')")
    return arrays["arr_1"]


def _folder_labels(path):
    if path is None or not Path(path).is_dir():
        raise DatasetError(f"--data_path must be a directory of images for dataset 'folder', got {path!r}")
    return ImageFolder(path).labels()[0]


def _prepared_labels(path):
    labels = PreparedDataset(path).labels if path is not None and is_prepared(path) else None
    if labels is None:
        raise DatasetError(f"{path} was prepared without class labels; prepare it again from a source with labels "
                           "(a folder with --labels subfolders, CIFAR-10, an npz with 'arr_1'), or train "
                           "unconditionally (--num_classes=0)")
    return labels


_LABEL_LOADERS = {
    "fashion_mnist": lambda path: read_idx_labels(_fashion_mnist_file(path, LABELS)),
    "cifar10": lambda path: np.concatenate([batch[b"labels"] for batch in _cifar10_batches(path)]),
    "folder": _folder_labels,
    "npz": _npz_labels,
    "prepared": _prepared_labels,
}


def load_labels(name, path=None):
    """The class labels of dataset ``name`` (one of ``DATASETS``) at ``path``, one per image of ``load_dataset``'s, as
    int32 (N,): Fashion-MNIST's and CIFAR-10's classes 0-9 (their idx label files and batches), an npz's 'arr_1', a
    folder's subfolders, a prepared file's; ``DatasetError`` for a dataset without labels, or labels that are not
    integers that int32 holds."""
    if name not in _LABEL_LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    labels = np.asarray(_LABEL_LOADERS[name](path))
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"class labels of dataset {name!r} at {path} must be integers, one per image; "
                           f"got {labels.dtype} {labels.shape}")
    int32 = np.iinfo(np.int32)
    if len(labels) and (labels.min() < int32.min or labels.max() > int32.max):
        extreme = labels.max() if labels.max() > int32.max else labels.min()
        raise DatasetError(f"class labels of dataset {name!r} at {path} must be class numbers 0, 1, 2, ...; got "
                           f"{extreme}, which does not fit 32 bits: number the classes from 0")
    return labels.astype(np.int32)


def class_names(name, path, images):
    """The class names that dataset ``name`` at ``path``, opened as ``images`` (``load_dataset``'s), records: a
    prepared file's, a folder's first-level subfolders (from the paths ``images`` holds); else None."""
    if name == "prepared":
        return read_record(path)["classes"]
    if name == "folder":
        return images.labels()[1]
    return None


_LOADERS = {
    "fashion_mnist": lambda path, size, resumed: _fashion_mnist(path),
    "cifar10": lambda path, size, resumed: _cifar10(path),
    "folder": lambda path, size, resumed: _folder(path, size),
    "npz": lambda path, size, resumed: _npz(path),
    "prepared": _prepared,
}
DATASETS = tuple(_LOADERS)


def load_dataset(name, path=None, image_size=None, resumed=False):
    """Load dataset ``name`` (one of ``DATASETS``) as uint8 NHWC; resize to ``image_size`` when given (``resumed``:
    the size of a continued run, which cannot change).

    "fashion_mnist" without a path is the embedded Fashion-MNIST test split (10,000 28x28 images).
    "cifar10" reads the python batches (train split) in RGB order. "folder" reads images recursively,
    centre-cropped and resized. "npz" reads uint8 NHWC images under ``arr_0``.
    """
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if path is not None and not os.path.exists(path):
        raise DatasetError(f"data path {path} does not exist")
    images = _LOADERS[name](path, image_size, resumed)
    if len(images) == 0:
        raise DatasetError(f"dataset {name!r} at {path} is empty")
    if image_size and images.shape[1:3] != (image_size, image_size):
        images = np.stack([decode_array(image, image_size) for image in images])
    return images


def array_dataset(path):
    """The dataset name of a source held as arrays ("cifar10", "fashion_mnist", "npz"), or None."""
    if path.is_dir():
        if (path / "data_batch_1").is_file() or (path / "cifar-10-batches-py").is_dir():
            return "cifar10"
        if any(_idx_file(path, f"{split}-{IMAGES}-ubyte") for split in ("train", "t10k")):
            return "fashion_mnist"
        return None
    if path.suffix == ".npz":
        return "npz"
    if IMAGES in path.name:
        return "fashion_mnist"
    return None


def dataset_identity(name, path, count):
    """What a run records of its data, to refuse resuming on other data: the image count, and a prepared file's
    checksum (read from its record)."""
    return {"count": int(count), "checksum": read_record(path)["checksum"] if name == "prepared" else None}


def describe_dataset(name, path, images, num_classes=0):
    """One line for a run's start: how many images, of what size, from where, how read, in how many classes."""
    n, size, _, channels = images.shape
    classes = f", {num_classes} classes" if num_classes else ""
    if name == "prepared":
        record = read_record(path)
        how = f"prepared file {path} (read as the steps need it; {record['source']}, {record['crop']})"
    elif name == "folder":
        how = f"folder {path} (streamed: decoded as batches need them; {CROP_RULE.format(size=size)})"
    else:
        how = f"{name}{' ' + str(path) if path else ''} (in memory)"
    return f"{n:,} images of {size}x{size}x{channels}{classes} from {how}"
