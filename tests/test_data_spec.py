"""One reading of a data spec: each form every command accepted maps to one kind, and the forms one command alone
used to read (a CIFAR-10 directory for fid, cifar10:DIR for prepare) read the same images for both."""
import gzip
import pickle

import numpy as np
import pytest
from PIL import Image

from megdiffusion.data.datasets import IMAGES, LABELS, load_dataset
from megdiffusion.data.prepared import prepare
from megdiffusion.data.sources import DatasetError, FolderSource
from megdiffusion.data.spec import DataSpec


def _cifar(directory, rng):
    directory.mkdir()
    for i in range(1, 6):
        data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        with open(directory / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": data, b"labels": [i % 10, (i + 1) % 10]}, f)


def _idx(path, array, magic):
    header = magic.to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


@pytest.fixture(scope="module")
def every_form(tmp_path_factory):
    """A directory holding one instance of each form of data (LMDB aside: it needs the lmdb package)."""
    root = tmp_path_factory.mktemp("forms")
    rng = np.random.default_rng(0)
    _cifar(root / "cifar", rng)
    (root / "idx").mkdir()
    _idx(root / "idx" / f"t10k-{IMAGES}-ubyte.gz", rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), 2051)
    _idx(root / "idx" / f"t10k-{LABELS}-ubyte.gz", np.array([1, 2, 3], np.uint8), 2049)
    (root / "folder").mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / "folder" / f"{i}.png")
    np.savez(root / "images.npz", arr_0=rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8), arr_1=np.arange(4))
    prepare(FolderSource(root / "folder"), root / "set.data", 8, workers=0)
    (root / "notes.txt").write_text("not data")
    return root


FORMS = [
    ("fashion_mnist", "fashion_mnist", None),
    ("fashion_mnist:{root}/idx", "fashion_mnist", "{root}/idx"),
    ("{root}/idx", "fashion_mnist", "{root}/idx"),
    ("{root}/idx/t10k-images-idx3-ubyte.gz", "fashion_mnist", "{root}/idx/t10k-images-idx3-ubyte.gz"),
    ("cifar10:{root}/cifar", "cifar10", "{root}/cifar"),
    ("{root}/cifar", "cifar10", "{root}/cifar"),
    ("{root}/folder", "folder", "{root}/folder"),
    ("{root}/images.npz", "npz", "{root}/images.npz"),
    ("{root}/set.data", "prepared", "{root}/set.data"),
]


@pytest.mark.parametrize("text, kind, path", FORMS, ids=[form[0].replace("{root}/", "") for form in FORMS])
def test_every_form_names_one_kind_and_reads_alike_for_prepare_and_fid(every_form, text, kind, path):
    spec = DataSpec.parse(text.format(root=every_form))
    assert (spec.kind, spec.path) == (kind, path and path.format(root=every_form))
    images = spec.images()
    source = spec.source()
    if kind == "folder":
        assert len(source) == len(images) == 3
    else:
        expected = load_dataset(kind, spec.path)
        np.testing.assert_array_equal(images[np.arange(len(images))], expected[np.arange(len(expected))])
        np.testing.assert_array_equal(np.stack(source.items(0, len(source))), expected[np.arange(len(expected))])
        assert (source.labels is None) == (kind == "prepared")  # prepared from a folder: no labels


def test_an_lmdb_is_named_and_only_prepare_reads_it(tmp_path):
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "data.mdb").write_bytes(b"")
    spec = DataSpec.parse(str(tmp_path / "db"))
    assert spec.kind == "lmdb"
    with pytest.raises(DatasetError, match=r"is an LMDB, which only scripts.prepare reads: prepare it"):
        spec.images()


@pytest.mark.parametrize("text, message", [
    ("{root}/missing", "does not exist; give a folder of images"),
    ("{root}/notes.txt", "is none of the data a command reads: a folder of images"),
    ("cifar10", "names no directory: write cifar10:DIR"),
    ("cifar10:", "names no directory: write cifar10:DIR"),
])
def test_what_names_no_data_is_refused_in_one_line(every_form, text, message):
    with pytest.raises(DatasetError, match=message):
        DataSpec.parse(text.format(root=every_form))


def test_labels_follow_the_data(every_form):
    np.testing.assert_array_equal(DataSpec.parse(f"{every_form}/images.npz").source().labels, np.arange(4))
    assert DataSpec.parse(f"{every_form}/images.npz").source("none").labels is None
    np.testing.assert_array_equal(DataSpec.parse(f"{every_form}/idx").source().labels, [1, 2, 3])
    np.testing.assert_array_equal(DataSpec.parse(f"cifar10:{every_form}/cifar").source().labels,
                                  [label for i in range(1, 6) for label in (i % 10, (i + 1) % 10)])
    with pytest.raises(DatasetError, match="--labels subfolders takes classes from a folder's subfolders"):
        DataSpec.parse(f"{every_form}/images.npz").source("subfolders")
