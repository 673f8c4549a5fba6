"""Datasets as uint8 NHWC arrays (RGB, or one channel for grayscale data), loaded by name.

``load_dataset(name, path, image_size)`` is the single entry point; every loader reports bad input by
raising ``DatasetError`` with a one-line message that says what to fix.
"""
import gzip
import os
from pathlib import Path

import numpy as np
from PIL import Image

from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.fileio import read_npz
from megdiffusion.images import ImageError, open_image
from megdiffusion.formats.torch_archive import load_array_pickle

ASSETS = Path(__file__).parent / "assets"
IMAGES, LABELS = "images-idx3", "labels-idx1"  # the two kinds of Fashion-MNIST idx file
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class DatasetError(MegdiffusionError):
    """Bad dataset input; the message is one line that says what is wrong and how to fix it."""


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
    return contents


def _cifar10(path):
    arrays = [batch[b"data"].astype(np.uint8) for batch in _cifar10_batches(path)]
    # Rows are 3072 bytes: the R, G and B planes of a 32x32 image, in that order (RGB, unlike MegEngine's CIFAR10).
    return np.concatenate(arrays).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def _centre_crop_resize(image, size):
    """Centre-crop a PIL image to a square, then resize it to size x size (bicubic)."""
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    image = image.crop((left, top, left + side, top + side))
    return image if side == size else image.resize((size, size), Image.BICUBIC)


class ImageFolder:
    """The images under a directory (recursive, sorted paths, ``IMAGE_EXTENSIONS``), read lazily as uint8
    HWC RGB (``images.open_image``: 16-bit gray is scaled); with ``image_size``, centre-cropped to a square
    and resized to it. Training's "folder" dataset and FID's image directories both read through it."""

    def __init__(self, root, image_size=None):
        self.paths = sorted(p for p in Path(root).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not self.paths:
            raise DatasetError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root}")
        self.image_size = image_size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        try:
            image = open_image(self.paths[index])
        except ImageError as exc:
            raise DatasetError(str(exc)) from None
        return np.asarray(_centre_crop_resize(image, self.image_size) if self.image_size else image)


def _folder(path, image_size):
    if path is None or not Path(path).is_dir():
        raise DatasetError(f"--data_path must be a directory of images for dataset 'folder', got {path!r}")
    if not image_size:
        raise DatasetError("dataset 'folder' needs --image_size (images are centre-cropped and resized to it)")
    folder = ImageFolder(path, image_size)
    images = np.empty((len(folder), image_size, image_size, 3), np.uint8)
    for i in range(len(folder)):
        images[i] = folder[i]
    return images


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


def _resize_all(images, size):
    """Resize square uint8 NHWC images to size x size (centre-cropping non-square ones)."""
    mode = "L" if images.shape[3] == 1 else "RGB"
    out = np.empty((len(images), size, size, images.shape[3]), np.uint8)
    for i, image in enumerate(images):
        resized = _centre_crop_resize(Image.fromarray(image.squeeze(2) if mode == "L" else image, mode), size)
        out[i] = np.asarray(resized).reshape(size, size, -1)
    return out


def _npz_labels(path):
    arrays = read_npz(path) if path is not None and Path(path).is_file() else {}
    if "arr_1" not in arrays:
        raise DatasetError(f"--data_path {path} has no class labels: a class-conditional run (--num_classes) on an "
                           "npz needs them under 'arr_1' (integers, one per image of 'arr_0')")
    return arrays["arr_1"]


def _no_labels(path):
    raise DatasetError("dataset 'folder' has no class labels; train it unconditionally (--num_classes=0), or "
                       "save the images with their labels as an npz (--dataset=npz: 'arr_0' images, 'arr_1' labels)")


_LABEL_LOADERS = {
    "fashion_mnist": lambda path: read_idx_labels(_fashion_mnist_file(path, LABELS)),
    "cifar10": lambda path: np.concatenate([batch[b"labels"] for batch in _cifar10_batches(path)]),
    "folder": _no_labels,
    "npz": _npz_labels,
}


def load_labels(name, path=None):
    """The class labels of dataset ``name`` (one of ``DATASETS``) at ``path``, one per image of ``load_dataset``'s, as
    int32 (N,): Fashion-MNIST's and CIFAR-10's classes 0-9 (their idx label files and batches), an npz's 'arr_1';
    ``DatasetError`` for a folder of images, which has none."""
    if name not in _LABEL_LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    labels = np.asarray(_LABEL_LOADERS[name](path))
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"class labels of dataset {name!r} at {path} must be integers, one per image; "
                           f"got {labels.dtype} {labels.shape}")
    return labels.astype(np.int32)


_LOADERS = {
    "fashion_mnist": lambda path, size: _fashion_mnist(path),
    "cifar10": lambda path, size: _cifar10(path),
    "folder": _folder,
    "npz": lambda path, size: _npz(path),
}
DATASETS = tuple(_LOADERS)


def load_dataset(name, path=None, image_size=None):
    """Load dataset ``name`` (one of ``DATASETS``) as uint8 NHWC; resize to ``image_size`` when given.

    "fashion_mnist" without a path is the embedded Fashion-MNIST test split (10,000 28x28 images).
    "cifar10" reads the python batches (train split) in RGB order. "folder" reads images recursively,
    centre-cropped and resized. "npz" reads uint8 NHWC images under ``arr_0``.
    """
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if path is not None and not os.path.exists(path):
        raise DatasetError(f"data path {path} does not exist")
    images = _LOADERS[name](path, image_size)
    if len(images) == 0:
        raise DatasetError(f"dataset {name!r} at {path} is empty")
    if image_size and images.shape[1:3] != (image_size, image_size):
        images = _resize_all(images, image_size)
    return images
