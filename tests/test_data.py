import gzip
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from megdiffusion.data.datasets import DatasetError, ImageFolder, load_dataset, load_labels, read_idx_images
from megdiffusion.files.images import make_grid, read_image, save_png, to_float, to_uint8


def test_embedded_fashion_mnist_is_the_full_test_split():
    images = load_dataset("fashion_mnist")
    assert images.shape == (10000, 28, 28, 1) and images.dtype == np.uint8
    # The t10k split's first image is an ankle boot: dark border, bright object in the middle.
    assert images[0, :2].max() == 0 and images[0, 10:20, 10:20].mean() > 100


def test_embedded_fashion_mnist_labels_are_the_test_splits():
    """One label per embedded image, 1000 of each class, the first image (an ankle boot) of class 9."""
    labels = load_labels("fashion_mnist")
    assert labels.dtype == np.int32 and labels.shape == (10000,)
    np.testing.assert_array_equal(np.bincount(labels), [1000] * 10)
    np.testing.assert_array_equal(labels[:5], [9, 2, 1, 1, 6])


def write_idx_labels(path, labels):
    with gzip.open(path, "wb") as f:
        f.write(b"".join(v.to_bytes(4, "big") for v in (2049, len(labels))) + bytes(labels))


def test_fashion_mnist_labels_follow_the_images_file(tmp_path):
    """Labels come from the idx1 file of the split whose images are read: the train split's in a directory that
    holds both, the one named like a given images file; a missing or broken labels file is one clear error."""
    header = b"".join(v.to_bytes(4, "big") for v in (2051, 2, 1, 1))
    for split, labels in (("train", [3, 4]), ("t10k", [5, 6])):
        (tmp_path / f"{split}-images-idx3-ubyte").write_bytes(header + bytes(2))
        write_idx_labels(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels)
    np.testing.assert_array_equal(load_labels("fashion_mnist", str(tmp_path)), [3, 4])
    np.testing.assert_array_equal(load_labels("fashion_mnist", str(tmp_path / "t10k-images-idx3-ubyte")), [5, 6])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "t10k-images-idx3-ubyte").write_bytes(header + bytes(2))
    with pytest.raises(DatasetError, match="no labels-idx1 file beside .*t10k-labels-idx1-ubyte"):
        load_labels("fashion_mnist", str(tmp_path / "other" / "t10k-images-idx3-ubyte"))
    with pytest.raises(DatasetError, match="no train-labels-idx1-ubyte"):
        load_labels("fashion_mnist", str(tmp_path / "other"))
    (tmp_path / "other" / "t10k-labels-idx1-ubyte").write_bytes(header)
    with pytest.raises(DatasetError, match="not an idx1 label file"):
        load_labels("fashion_mnist", str(tmp_path / "other"))


def test_labels_of_cifar10_npz_and_folder(tmp_path):
    for i in range(1, 6):
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [i, 9 - i]}, f)
    np.testing.assert_array_equal(load_labels("cifar10", str(tmp_path)), [1, 8, 2, 7, 3, 6, 4, 5, 5, 4])
    images = np.zeros((3, 4, 4, 1), np.uint8)
    np.savez(tmp_path / "x.npz", arr_0=images, arr_1=np.array([2, 0, 1], np.int64))
    labels = load_labels("npz", str(tmp_path / "x.npz"))
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(labels, [2, 0, 1])
    np.savez(tmp_path / "unlabelled.npz", arr_0=images)
    with pytest.raises(DatasetError, match="no class labels.*'arr_1'"):
        load_labels("npz", str(tmp_path / "unlabelled.npz"))
    np.savez(tmp_path / "float.npz", arr_0=images, arr_1=np.zeros(3))
    with pytest.raises(DatasetError, match="must be integers"):
        load_labels("npz", str(tmp_path / "float.npz"))
    folder = tmp_path / "folder"
    for name in ("b/2.png", "a/1.png", "b/1.png", "c/deeper/1.png"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_png(folder / name, np.zeros((4, 4), np.uint8))
    # classes are the first-level subfolders, sorted; images in path order (a/1, b/1, b/2, c/deeper/1)
    np.testing.assert_array_equal(load_labels("folder", str(folder)), [0, 1, 1, 2])
    save_png(folder / "loose.png", np.zeros((4, 4), np.uint8))
    with pytest.raises(DatasetError, match="loose.png .* lie in .* itself; move the images into one subfolder"):
        load_labels("folder", str(folder))


def test_idx_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 7, 9), dtype=np.uint8)
    header = b"".join(v.to_bytes(4, "big") for v in (2051, 5, 7, 9))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(header + images.tobytes())
    np.testing.assert_array_equal(read_idx_images(path)[..., 0], images)
    np.testing.assert_array_equal(load_dataset("fashion_mnist", str(tmp_path))[..., 0], images)


def test_cifar10_batches_are_read_in_rgb_order(tmp_path):
    for i in range(1, 6):
        data = np.zeros((2, 3072), np.uint8)
        data[:, :1024] = 10 * i  # red plane
        data[:, 1024:2048] = 100  # green plane
        data[:, 2048:] = 200  # blue plane
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": data, b"labels": [0, 1]}, f)
    images = load_dataset("cifar10", str(tmp_path))
    assert images.shape == (10, 32, 32, 3)
    np.testing.assert_array_equal(images[0, 0, 0], [10, 100, 200])
    np.testing.assert_array_equal(images[-1, 5, 5], [50, 100, 200])


def test_cifar10_missing_batches(tmp_path):
    with pytest.raises(DatasetError, match="data_batch_1"):
        load_dataset("cifar10", str(tmp_path))


def test_folder_crops_resizes_and_reports_bad_files(tmp_path):
    (tmp_path / "sub").mkdir()
    wide = np.zeros((20, 40, 3), np.uint8)
    wide[:, 10:30] = 255  # the centre square is white, the sides black
    save_png(tmp_path / "sub" / "a.png", wide)
    save_png(tmp_path / "b.png", np.full((8, 8), 77, np.uint8))
    images = load_dataset("folder", str(tmp_path), image_size=10)
    assert images.shape == (2, 10, 10, 3)
    assert images[0].min() == 77  # b.png (gray -> RGB) sorts first
    assert images[1].min() >= 250  # a.png: only the white centre survives the crop
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match="cannot read image .*broken.jpg"):  # its header, before any step
        load_dataset("folder", str(tmp_path), image_size=10)
    os.remove(tmp_path / "broken.jpg")
    save_png(tmp_path / "broken.png", wide)
    cut = (tmp_path / "broken.png").read_bytes()[:60]  # the header reads, the pixels do not
    (tmp_path / "broken.png").write_bytes(cut)
    images = load_dataset("folder", str(tmp_path), image_size=10)  # streamed: read when a batch needs it
    assert images.shape == (3, 10, 10, 3)
    np.testing.assert_array_equal(images[np.array([2, 0])][0], images[2])  # broken.png is images[1]
    with pytest.raises(DatasetError, match="broken.png"):
        images[np.arange(3)]


def test_npz_and_errors(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "x.npz", arr_0=images)
    np.testing.assert_array_equal(load_dataset("npz", str(tmp_path / "x.npz")), images)
    np.savez(tmp_path / "bad.npz", arr_0=images.astype(np.float32))
    with pytest.raises(DatasetError, match="uint8 NHWC"):
        load_dataset("npz", str(tmp_path / "bad.npz"))
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset("npz", str(tmp_path / "missing.npz"))


def test_uint8_float_round_trip_and_range():
    images = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    x = to_float(images)
    assert x.shape == (1, 1, 16, 16) and x.min() == -1.0 and x.max() == 1.0
    np.testing.assert_array_equal(to_uint8(x), images)
    np.testing.assert_array_equal(to_uint8(np.array([[[[-3.0, 3.0]]]])), [[[[0], [255]]]])


def test_grid_layout_and_png_round_trip(tmp_path):
    images = np.stack([np.full((3, 4, 3), v, np.uint8) for v in (10, 20, 30)])
    grid = make_grid(images, nrow=2, padding=1, pad_value=0)
    assert grid.shape == (1 + 2 * 4, 1 + 2 * 5, 3)
    assert grid[1, 1, 0] == 10 and grid[1, 6, 0] == 20 and grid[5, 1, 0] == 30 and grid[5, 6, 0] == 0
    save_png(tmp_path / "g.png", grid)
    np.testing.assert_array_equal(read_image(tmp_path / "g.png"), grid)
    assert [p.name for p in tmp_path.iterdir()] == ["g.png"]  # no temporary file left behind


def test_written_files_get_the_usual_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        save_png(tmp_path / "p.png", np.zeros((2, 2), np.uint8))
    finally:
        os.umask(previous)
    assert (tmp_path / "p.png").stat().st_mode & 0o777 == 0o644


def test_16_bit_gray_is_scaled_and_32_bit_pixels_are_refused(tmp_path):
    """One image reader for training folders, FID folders and samples: 16-bit PNGs are not read as white."""
    values = np.array([[0, 257, 32896], [65535, 128, 65278]], np.uint16)  # v / 257: 0, 1, 128, 255, 0.5, 254.0
    Image.fromarray(values).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    expected = np.array([[0, 1, 128], [255, 0, 254]], np.uint8)
    np.testing.assert_array_equal(read_image(tmp_path / "g16.png", mode=None)[..., 0], expected)
    np.testing.assert_array_equal(ImageFolder(tmp_path)[0], np.repeat(expected[..., None], 3, axis=2))
    Image.fromarray(values.astype(np.int32)).save(tmp_path / "g32.tif")
    with pytest.raises(DatasetError, match="g32.tif has 32-bit integer pixels; convert it to 8 or 16 bits"):
        load_dataset("folder", str(tmp_path), image_size=2)[np.arange(2)]


def test_cifar10_batches_of_python_2_load_and_crafted_ones_are_refused(tmp_path):
    data = np.arange(2 * 3072).astype(np.uint8).reshape(2, 3072)
    for i in range(1, 6):  # protocol 2, as the official batches were written
        with open(tmp_path / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": data, b"labels": [0, 1], b"filenames": [b"a.png", b"b.png"]}, f, protocol=2)
    images = load_dataset("cifar10", str(tmp_path))
    np.testing.assert_array_equal(images[1, 0, 0], data[1, [0, 1024, 2048]])
    with open(tmp_path / "data_batch_3", "wb") as f:
        pickle.dump({b"data": data, b"run": os.system}, f, protocol=2)
    with pytest.raises(DatasetError, match="data_batch_3: refusing to load posix.system"):
        load_dataset("cifar10", str(tmp_path))


def test_a_folder_walk_lists_each_real_image_once_whatever_its_links(tmp_path):
    """Links followed without loops: to the folder itself, to its parent, twice to one directory, to a file; a
    dangling link, a FIFO and a directory named like images are left out."""
    from megdiffusion.data.sources import image_paths

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    for path in (root / "a.png", root / "sub" / "b.png", tmp_path / "outside" / "c.png", tmp_path / "d.png"):
        save_png(path, np.zeros((4, 4, 3), np.uint8))
    os.symlink("..", root / "sub" / "loop")
    os.symlink("..", root / "up")
    os.symlink("../outside", root / "x1")
    os.symlink("../outside", root / "x2")
    os.symlink("a.png", root / "z_same.png")
    os.symlink("nowhere.png", root / "dangling.png")
    os.mkfifo(root / "zz.png")
    (root / "dir.png").mkdir()
    assert image_paths(root) == [str(root / "a.png"), str(root / "sub" / "b.png"), str(root / "x1" / "c.png")]
    assert len(ImageFolder(str(root))) == 3
