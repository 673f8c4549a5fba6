"""Image conversions, grids and image files read and written.

Convention: NCHW float32 in [-1, 1] inside the models, NHWC uint8 at the edges (files, datasets, FID).
Every image file is read through :func:`open_image`, which gives 8 bits per channel.
"""
import contextlib
import warnings

import numpy as np
from PIL import Image

from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.files.disk import atomic_write

SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")  # 16-bit gray, as PIL opens it from PNG and TIFF


class ImageError(MegdiffusionError):
    """An image file that cannot be read, or whose pixels are not 8 or 16 bits; the message is one line."""


def to_uint8(x):
    """Float images in [-1, 1], NCHW (numpy array or MegEngine tensor) -> uint8 NHWC, rounded."""
    x = np.asarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float32)
    x = np.clip((x + 1.0) * 127.5, 0.0, 255.0)
    return np.rint(x).astype(np.uint8).transpose(0, 2, 3, 1)


def to_float(images):
    """uint8 NHWC images -> float32 NCHW in [-1, 1]."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"expected uint8 NHWC images, got {images.dtype} with shape {images.shape}")
    return images.transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0


def make_grid(images, nrow=None, padding=2, pad_value=255):
    """Tile uint8 NHWC images into one uint8 HWC picture, ``nrow`` images per row (default: square)."""
    images = np.asarray(images)
    n, h, w, c = images.shape
    nrow = nrow or int(np.ceil(np.sqrt(n)))
    ncol = int(np.ceil(n / nrow))
    grid = np.full((padding + ncol * (h + padding), padding + nrow * (w + padding), c), pad_value, np.uint8)
    for i, image in enumerate(images):
        top = padding + (i // nrow) * (h + padding)
        left = padding + (i % nrow) * (w + padding)
        grid[top:top + h, left:left + w] = image
    return grid


def save_png(path, image):
    """Write a uint8 HWC (C = 1 or 3) or HW image to ``path`` as PNG, atomically."""
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    with atomic_write(path) as f:
        Image.fromarray(image).save(f, format="PNG")


def open_image(path, mode="RGB", name=None):
    """The image file at ``path`` (or a file object, called ``name``) as a loaded PIL image with 8 bits per channel,
    converted to ``mode`` (None: the file's own). 16-bit gray is scaled to 8 bits (65535 -> 255); 32-bit integer
    or float pixels, and files that do not read, raise :class:`ImageError` naming the file. Pillow's warnings about
    a file (a large image, odd EXIF data, a palette's transparency) stay off the terminal: the image reads, or
    the error says why not."""
    return _read(_eight_bit, path, mode, path if name is None else name)


def check_image(path):
    """``ImageError`` (``open_image``'s) unless the file at ``path`` begins as an image Pillow reads (its header
    only: fast enough to check every file of a folder before a run writes anything)."""
    _read(_header, path, None, path)


@contextlib.contextmanager
def pillow_quiet():
    """Keep Pillow's warnings about an image (its size against the decompression-bomb limit, odd EXIF data, a
    palette's transparency) off the terminal for the block: every image megdiffusion reads, crops or resizes
    either works or fails with a message of its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _read(read, path, mode, name):
    """``read(path, mode, name)`` with Pillow's warnings silenced and its errors as one ``ImageError``."""
    try:
        with pillow_quiet():
            return read(path, mode, name)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot read image {name}: {one_line(exc)}; remove or replace it") from None


def _header(path, mode, name):
    """Open the image's header, nothing more."""
    with Image.open(path):
        pass


def _eight_bit(path, mode, name):
    """``open_image`` with the warnings as the caller set them."""
    with Image.open(path) as image:
        image.load()
        if image.mode in SIXTEEN_BIT_MODES:
            scaled = np.rint(np.asarray(image, dtype=np.float64) / 257.0).astype(np.uint8)
            return Image.fromarray(scaled).convert(mode or "L")
        if image.mode in ("I", "F"):
            raise ImageError(f"{name} has 32-bit {'float' if image.mode == 'F' else 'integer'} pixels; "
                             "convert it to 8 or 16 bits per channel")
        return image.convert(mode) if mode else image.copy()


def read_image(path, mode="RGB"):
    """Read an image file as uint8 HWC (``open_image``); ``mode`` "RGB" converts gray/palette images, None keeps
    the file's."""
    array = np.asarray(open_image(path, mode), dtype=np.uint8)
    return array if array.ndim == 3 else array[:, :, None]
