"""What a data spec names, read by one table for every command that takes data (prepare's SRC, fid's and nll's
sources): the same text means the same data everywhere."""
import os
from dataclasses import dataclass
from pathlib import Path

from megdiffusion.data.datasets import ImageFolder, array_dataset, load_dataset, load_labels
from megdiffusion.data.prepared import PreparedDataset, is_prepared
from megdiffusion.data.sources import IMAGE_EXTENSIONS, ArraySource, DatasetError, FolderSource, LmdbSource, is_lmdb
from megdiffusion.files.disk import check_not_special, read_npz

FORMS = ("a folder of images, a prepared dataset (scripts.prepare), an .npz of uint8 NHWC images, an LMDB, CIFAR-10's "
         "python batches (their directory, or cifar10:DIR), Fashion-MNIST's idx files, or fashion_mnist (the embedded "
         "split)")
NAMED = ("fashion_mnist", "cifar10")  # the datasets a spec may name, as NAME or NAME:DIR


@dataclass(frozen=True)
class DataSpec:
    """``kind`` (a ``datasets.DATASETS`` name, or "lmdb") and ``path`` (None: the embedded Fashion-MNIST split) of the
    data that ``text`` names."""

    text: str
    kind: str
    path: str | None

    @classmethod
    def parse(cls, text):
        """The data ``text`` names; ``DatasetError`` in one line when it names none."""
        name, colon, directory = text.partition(":")
        if name in NAMED and not os.path.exists(text):
            if name == "cifar10" and not directory:
                raise DatasetError(f"{text!r} names no directory: write cifar10:DIR, DIR holding the CIFAR-10 python "
                                   "batches (data_batch_1 .. data_batch_5)")
            return cls(text, name, directory or None)
        check_not_special(text)
        path = Path(text)
        if not path.exists():
            raise DatasetError(f"{text!r} does not exist; give {FORMS}")
        if is_lmdb(path):
            return cls(text, "lmdb", text)
        kind = array_dataset(path) or ("folder" if path.is_dir() else "prepared" if is_prepared(path) else None)
        if kind is None:
            raise DatasetError(f"{text!r} is none of the data a command reads: {FORMS}")
        return cls(text, kind, text)

    def images(self, image_size=None):
        """The images, uint8 NHWC (``load_dataset``'s; a folder's read as needed), centre-cropped and resized to
        ``image_size`` when given."""
        if self.kind == "lmdb":
            raise DatasetError(f"{self.text} is an LMDB, which only scripts.prepare reads: prepare it (python -m "
                               f"megdiffusion.scripts.prepare {self.text} OUT.data --image_size N) and give OUT.data")
        if self.kind == "folder":
            return ImageFolder(self.path, image_size)
        return load_dataset(self.kind, self.path, image_size)

    def source(self, labels="auto"):
        """The ``sources.Source`` that scripts.prepare reads. ``labels``: "auto" keeps the labels the data has
        (CIFAR-10's, an npz's ``arr_1``, the idx labels file beside the images, a prepared file's; a folder has none),
        "subfolders" takes a folder's first-level subfolders as classes, "none" drops them."""
        if labels == "subfolders" and self.kind != "folder":
            raise DatasetError(f"--labels subfolders takes classes from a folder's subfolders; {self.text} is not a "
                               "folder of images")
        if self.kind == "lmdb":
            return LmdbSource(self.path)
        if self.kind == "folder":
            return FolderSource(self.path, labels=labels == "subfolders")
        images = load_dataset(self.kind, self.path)
        kept = self._labels_if_any() if labels == "auto" else None
        if kept is not None and len(kept) != len(images):
            raise DatasetError(f"{self.text} has {len(images)} images but {len(kept)} labels")
        where = os.path.abspath(self.path) if self.path else "(embedded test split)"
        return ArraySource(images, kept, f"{self.kind} {where}")

    def _labels_if_any(self):
        """The labels, or None for data that may lack them and does (an npz without ``arr_1``, a prepared file made
        without them, Fashion-MNIST's idx images without their labels file)."""
        if (self.kind == "npz" and "arr_1" not in read_npz(self.path)) or \
                (self.kind == "prepared" and PreparedDataset(self.path).labels is None):
            return None
        try:
            return load_labels(self.kind, self.path)
        except DatasetError:
            if self.kind != "fashion_mnist":
                raise
            return None

    def has_images(self):
        """Whether the data holds an image: a folder with an image file (found without a full walk); any other kind
        is read by its loader, which reports its own faults."""
        if self.kind != "folder":
            return True
        return any(name.lower().endswith(IMAGE_EXTENSIONS) for _, _, files in os.walk(self.path) for name in files)
