"""Data at scale: the prepared file (scripts.prepare), the streamed folder and the data workers train bit for bit
like the same images held in memory; memory does not grow with the dataset; prepare is atomic."""
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megdiffusion.data.datasets import ImageFolder, load_dataset, load_labels
from megdiffusion.data.spec import DataSpec
from megdiffusion.data.prepared import PreparedDataset, checksum, is_prepared, prepare, read_record
from megdiffusion.data.sources import ArraySource, DatasetError, FolderSource
from megdiffusion.training.checkpoint import CheckpointError, load_latest
from megdiffusion.training.config import resolve
from megdiffusion.training.start import train

REPO = Path(__file__).resolve().parents[1]


def make_folder(root, counts=(5, 7, 4), seed=0):
    """Class subfolders of RGB images of varied sizes and formats (some not square, some gray)."""
    rng = np.random.default_rng(seed)
    for c, count in enumerate(counts):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(count):
            h, w = rng.integers(9, 20, 2)
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            image = Image.fromarray(pixels).convert("L") if i % 4 == 3 else Image.fromarray(pixels)
            image.save(root / f"class_{c}" / f"{i:02d}.{'png' if i % 2 else 'jpg'}")
    return root


def run_prepare(*args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.prepare", *map(str, args)], env=env,
                            capture_output=True, timeout=120, **kwargs)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()  # carriage returns kept
    return result


def test_prepare_keeps_the_folder_pixels_labels_and_record(tmp_path):
    folder = make_folder(tmp_path / "folder")
    dest = tmp_path / "set.data"
    result = run_prepare(folder, dest, "--image_size=8", "--labels=subfolders", "--workers=2")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "16 images of 8x8x3, 3 classes" in result.stdout
    prepared = PreparedDataset(dest)
    streamed = ImageFolder(folder, 8)
    np.testing.assert_array_equal(prepared.images, streamed[np.arange(len(streamed))])
    np.testing.assert_array_equal(prepared.labels, [0] * 5 + [1] * 7 + [2] * 4)
    np.testing.assert_array_equal(prepared.labels, load_labels("folder", str(folder)))
    record = prepared.record
    assert record["classes"] == ["class_0", "class_1", "class_2"] and record["count"] == 16
    assert record["checksum"] == checksum(dest) and "centre crop" in record["crop"] and record["skipped"] == []
    assert str(folder) in record["source"]
    # the same images decoded in this process, and by one worker: the same file
    prepare(FolderSource(folder, labels=True), tmp_path / "here.data", 8, workers=0)
    assert (tmp_path / "here.data").read_bytes() == dest.read_bytes()


def test_prepare_reads_arrays_with_their_labels(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, (10, 6, 6, 1), dtype=np.uint8)
    np.savez(tmp_path / "x.npz", arr_0=images, arr_1=np.arange(10) % 4)
    record = prepare(DataSpec.parse(str(tmp_path / "x.npz")).source(), tmp_path / "x.data", 6, workers=0)
    assert record["channels"] == 1 and record["has_labels"]
    prepared = PreparedDataset(tmp_path / "x.data")
    np.testing.assert_array_equal(prepared.images, images)
    np.testing.assert_array_equal(prepared.labels, np.arange(10) % 4)
    prepare(DataSpec.parse(str(tmp_path / "x.npz")).source(labels="none"), tmp_path / "y.data", 4, workers=0)
    resized = PreparedDataset(tmp_path / "y.data")
    assert resized.labels is None and resized.images.shape == (10, 4, 4, 1)
    np.testing.assert_array_equal(resized.images, load_dataset("npz", str(tmp_path / "x.npz"), image_size=4))


def test_skip_bad_counts_and_lists_unreadable_images(tmp_path):
    folder = make_folder(tmp_path / "folder")
    (folder / "class_1" / "03.png").write_bytes(b"not an image")
    result = run_prepare(folder, tmp_path / "a.data", "--image_size=8", "--labels=subfolders")
    assert result.returncode == 2 and not (tmp_path / "a.data").exists()
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot read image ") and "03.png" in \
        result.stderr
    record = prepare(FolderSource(folder, labels=True), tmp_path / "b.data", 8, workers=1, skip_bad=True)
    assert record["count"] == 15 and [s["name"] for s in record["skipped"]] == [str(folder / "class_1" / "03.png")]
    prepared = PreparedDataset(tmp_path / "b.data")
    np.testing.assert_array_equal(prepared.labels, [0] * 5 + [1] * 6 + [2] * 4)  # the label left out with it


def test_a_truncated_or_foreign_file_is_refused(tmp_path):
    prepare(ArraySource(np.zeros((4, 2, 2, 3), np.uint8), None, "zeros"), tmp_path / "z.data", 2, workers=0)
    data = (tmp_path / "z.data").read_bytes()
    (tmp_path / "cut.data").write_bytes(data[:-10])
    with pytest.raises(DatasetError, match="truncated or damaged"):
        read_record(tmp_path / "cut.data")
    (tmp_path / "other").write_bytes(b"hello")
    assert not is_prepared(tmp_path / "other")
    with pytest.raises(DatasetError, match="must be a file written by megdiffusion.scripts.prepare"):
        load_dataset("prepared", str(tmp_path / "other"))
    with pytest.raises(DatasetError, match="holds 2x2 images, not --image_size 4"):
        load_dataset("prepared", str(tmp_path / "z.data"), image_size=4)


def test_a_killed_prepare_leaves_nothing_training_accepts(tmp_path):
    """SIGKILL part-way: no DEST; the temporary file beside it is refused as a dataset, and the next prepare there
    removes it. SIGTERM: nothing left."""
    images = np.random.default_rng(0).integers(0, 256, (4000, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "big.npz", arr_0=images)
    for sig in (signal.SIGKILL, signal.SIGTERM):
        out = tmp_path / f"out_{sig.name}"
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        process = subprocess.Popen([sys.executable, "-m", "megdiffusion.scripts.prepare", str(tmp_path / "big.npz"),
                                    str(out / "set.data"), "--image_size=64", "--workers=1", "--noprogress"],
                                   env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not any(out.iterdir()) and time.monotonic() < deadline:  # the temporary file appears
            time.sleep(0.01)
        time.sleep(0.3)
        process.send_signal(sig)
        process.wait(timeout=60)
        assert process.returncode != 0 and not (out / "set.data").exists()
        left = list(out.iterdir())
        if sig == signal.SIGTERM:
            assert process.returncode == 143 and left == []
            assert process.stderr.read() == "error: stopped by SIGTERM; every file written so far is complete\n"
        for path in left:
            with pytest.raises(DatasetError):
                load_dataset("prepared", str(path))
        if sig == signal.SIGKILL:
            assert len(left) == 1 and left[0].name.startswith(".megdiffusion-partial-")
            prepare(ArraySource(images[:8], None, "noise"), out / "other.data", 8, workers=0)
            assert sorted(p.name for p in out.iterdir()) == ["other.data"]


def test_a_write_that_fails_part_way_leaves_nothing(tmp_path):
    """A full disk, made by a file-size limit: one error line naming DEST, exit 2, no file left behind."""
    np.savez(tmp_path / "x.npz", arr_0=np.zeros((200, 16, 16, 3), np.uint8))
    (tmp_path / "out").mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))  # Python ignores SIGXFSZ: writes fail with EFBIG

    result = run_prepare(tmp_path / "x.npz", tmp_path / "out" / "set.data", "--workers=0", preexec_fn=limit)
    lines = [line.rpartition("\r")[2] for line in result.stderr.split("\n") if line.rpartition("\r")[2].strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "set.data: cannot write: File too large" in lines[0]
    assert list((tmp_path / "out").iterdir()) == []


def test_lmdb_entries_are_read_in_key_order(tmp_path):
    lmdb = pytest.importorskip("lmdb", reason="the lmdb package (the 'lmdb' extra) is not installed")
    folder = make_folder(tmp_path / "folder", counts=(6,))
    paths = sorted((folder / "class_0").iterdir())
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for path in reversed(paths):  # inserted in reverse: LMDB keeps keys sorted
            txn.put(path.stem.encode(), path.read_bytes())
    env.close()
    result = run_prepare(tmp_path / "db", tmp_path / "l.data", "--image_size=8")
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(PreparedDataset(tmp_path / "l.data").images,
                                  ImageFolder(folder, 8)[np.arange(6)])


def _train(tmp_path, tiny_config, name, data, **changes):
    settings = dict(dataset="npz", data_path=str(data), random_flip=True,
                    num_classes=3, class_dropout=0.2, image_size=None)
    cfg, images = resolve(tiny_config(**{**settings, **changes, "logdir": str(tmp_path / f"run_{name}")}))
    train(cfg, images, progress=False)
    return load_latest(cfg.logdir)[0]


def test_in_ram_prepared_and_streamed_train_bit_for_bit(tmp_path, tiny_config):
    """The same folder held in memory (an npz of its images), prepared, and streamed, with 0, 1 and 2 data workers,
    with flips and labels, resumed in the middle of an epoch: identical checkpoints."""
    folder = make_folder(tmp_path / "folder")
    stacked = ImageFolder(folder, 8)
    np.savez(tmp_path / "ram.npz", arr_0=stacked[np.arange(len(stacked))], arr_1=load_labels("folder", str(folder)))
    prepare(FolderSource(folder, labels=True), tmp_path / "set.data", 8, workers=0)
    runs = {}
    for name, data, changes in (("ram", tmp_path / "ram.npz", {}),
                                ("prepared", tmp_path / "set.data", {"data_workers": 1}),
                                ("folder", folder, {"dataset": "folder", "image_size": 8, "data_workers": 2}),
                                ("folder_here", folder, {"dataset": "folder", "image_size": 8, "data_workers": 0})):
        _train(tmp_path, tiny_config, name, data, total_steps=3, **changes)  # 16 images, batch 8: mid-epoch 2
        runs[name] = _train(tmp_path, tiny_config, name, data, total_steps=5, resume=True, **changes)
    reference = runs.pop("ram")
    assert reference["loader"] == {"epoch": 2, "position": 8} and reference["step"] == 5
    for name, state in runs.items():
        assert state["loader"] == reference["loader"], name
        for key in ("model", "ema"):
            for param, value in reference[key].items():
                np.testing.assert_array_equal(state[key][param], value, err_msg=f"{name} {key} {param}")


ANON_PROBE = """
import sys
sys.path.insert(0, {tests!r})
from conftest import TINY
from megdiffusion.training.config import TrainConfig, resolve
from megdiffusion.training.trainer import TrainingRun

cfg, images = resolve(TrainConfig(**{{**TINY, "image_size": None, "dataset": "prepared", "data_path": sys.argv[1],
                                    "logdir": sys.argv[2], "data_workers": 0, "random_flip": True}}))
run = TrainingRun(cfg, images, progress=False)
for _ in range(3):
    run.trainer.step(*run.loader.next_batch())
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")))
"""


def test_memory_does_not_grow_with_a_prepared_dataset(tmp_path):
    """20,000 images of 64x64x3 (246 MB) against 2,000: the training process's anonymous memory after a few steps
    differs by much less than the data (loading the file into memory would add 221 MB)."""
    rng = np.random.default_rng(0)
    for count in (2000, 20000):
        images = np.broadcast_to(rng.integers(0, 256, (1, 64, 64, 3), dtype=np.uint8), (count, 64, 64, 3))
        prepare(ArraySource(images, None, "noise"), tmp_path / f"{count}.data", 64, workers=0)
    anon = {}
    for count in (2000, 20000):
        result = subprocess.run([sys.executable, "-c", ANON_PROBE.format(tests=str(Path(__file__).parent)),
                                 str(tmp_path / f"{count}.data"), str(tmp_path / f"run{count}")],
                                capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                                   "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, result.stderr
        anon[count] = int(result.stdout.split()[-1]) * 1024
    data_growth = 18000 * 64 * 64 * 3
    assert abs(anon[20000] - anon[2000]) < 0.15 * data_growth, anon


def test_a_streamed_image_that_cannot_be_read_is_one_error(tmp_path, tiny_config):
    """A file that is no image is refused before the run writes anything; one whose pixels are cut short (its
    header reads) when a batch needs it."""
    folder = make_folder(tmp_path / "folder")
    settings = dict(dataset="folder", data_path=str(folder), image_size=8, logdir=str(tmp_path / "run"),
                    data_workers=1, total_steps=4)
    png = (folder / "class_2" / "01.png").read_bytes()
    (folder / "class_2" / "01.png").write_bytes(b"broken")
    with pytest.raises(DatasetError, match="cannot read image .*class_2/01.png"):
        resolve(tiny_config(**settings))
    assert not (tmp_path / "run").exists()
    (folder / "class_2" / "01.png").write_bytes(png[:60])
    cfg, images = resolve(tiny_config(**settings))
    with pytest.raises(DatasetError, match="cannot read image .*class_2/01.png"):
        train(cfg, images, progress=False)


def test_a_prepared_file_truncated_or_replaced_under_a_reader_is_one_error(tmp_path):
    """Read by pread, not a memory map: a truncated file is a DatasetError, not SIGBUS; a worker's copy refuses a
    file replaced under the same name."""
    import pickle

    images = np.random.default_rng(0).integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
    prepare(ArraySource(images, None, "noise"), tmp_path / "set.data", 8, workers=0)
    dataset = PreparedDataset(tmp_path / "set.data")
    np.testing.assert_array_equal(dataset.images[[3, 0, 19]], images[[3, 0, 19]])
    np.testing.assert_array_equal(dataset.images[5:8], images[5:8])
    np.testing.assert_array_equal(dataset.images[-1], images[-1])
    copy = pickle.dumps(dataset.images)
    os.truncate(tmp_path / "set.data", 4096 + 10 * 8 * 8 * 3)
    np.testing.assert_array_equal(dataset.images[9], images[9])
    with pytest.raises(DatasetError, match=r"set.data was truncated while the run used it \(6,016 bytes now, its "
                                           r"images end at byte 7,936\); prepare it again"):
        dataset.images[[2, 12]]
    prepare(ArraySource(images, None, "noise"), tmp_path / "set.data", 8, workers=0, overwrite=True)
    with pytest.raises(DatasetError, match="set.data was replaced by another file while the run used it"):
        pickle.loads(copy)


def test_a_valid_huge_image_prepares_without_pillow_warnings(tmp_path):
    """9,500 x 9,500 pixels is past Pillow's decompression-bomb warning (89 M pixels), not its error (179 M)."""
    (tmp_path / "big").mkdir()
    Image.new("L", (9500, 9500), 128).save(tmp_path / "big" / "huge.png")
    result = run_prepare(tmp_path / "big", tmp_path / "out.data", "--image_size=8", "--workers=0", "--noprogress")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (load_dataset("prepared", str(tmp_path / "out.data"))[:] == 128).all()


def test_resuming_on_other_data_is_refused(tmp_path, tiny_config):
    images = np.random.default_rng(0).integers(0, 256, (16, 8, 8, 1), dtype=np.uint8)
    prepare(ArraySource(images, None, "a"), tmp_path / "a.data", 8, workers=0)
    prepare(ArraySource(images[::-1].copy(), None, "b"), tmp_path / "b.data", 8, workers=0)
    cfg, data = resolve(tiny_config(data_path=str(tmp_path / "a.data"), logdir=str(tmp_path / "run"), total_steps=2))
    assert cfg.dataset == "prepared"  # recognised by its record
    train(cfg, data, progress=False)
    other, other_data = resolve(cfg.replace(data_path=str(tmp_path / "b.data"), resume=True, total_steps=3))
    with pytest.raises(CheckpointError, match=r"was trained on 16 images \(checksum sha256:.*\); this dataset has "
                                              r"16 \(checksum sha256:"):
        train(other, other_data, progress=False)
    train(cfg.replace(resume=True, total_steps=3), data, progress=False)  # the run's own data resumes


@pytest.mark.parametrize("argv, recipe", [
    ([], "fashion_mnist_cpu.cfg"), (["--dataset=fashion_mnist", "--data_path", "x"], "fashion_mnist_cpu.cfg"),
    (["--dataset=cifar10"], "cifar10.cfg"), (["--dataset", "folder", "--data_path", "{folder}", "--image_size", "32"],
                                             "own32.cfg"),
    (["-dataset=npz", "-data_path={npz}", "-image_size=64"], "own64.cfg"), (["--data_path={prepared}"], "own32.cfg"),
    (["--dataset=folder", "--data_path={folder}", "--image_size=48"], "no recipe for 48x48 without a --flagfile"),
    (["--dataset=folder", "--data_path={folder}"], "no recipe for images of unknown size"),
    # the command line describes the network: the CPU recipe's training settings under it
    (["--dataset=npz", "--data_path={npz}", "--model_channels=32", "--attention_resolutions="],
     "fashion_mnist_cpu.cfg"),
    # data that is not there, or holds no image, or an unknown dataset: the flags and data give their own error
    (["--dataset=folder", "--data_path={empty}", "--image_size=48"], "fashion_mnist_cpu.cfg"),
    (["--dataset=npz", "--data_path=nope.npz"], "fashion_mnist_cpu.cfg"),
    (["--dataset=imagenet", "--data_path={folder}"], "fashion_mnist_cpu.cfg")])
def test_train_without_a_flagfile_reads_the_recipe_that_fits(tmp_path, argv, recipe):
    from megdiffusion.training.config import ConfigError
    from megdiffusion.training.recipes import default_flagfile

    prepare(ArraySource(np.zeros((2, 32, 32, 3), np.uint8), None, "zeros"), tmp_path / "p.data", 32, workers=0)
    make_folder(tmp_path / "folder", counts=(1,))
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    np.savez(tmp_path / "x.npz", arr_0=np.zeros((2, 64, 64, 3), np.uint8))
    paths = {"{prepared}": tmp_path / "p.data", "{folder}": tmp_path / "folder", "{empty}": tmp_path / "empty",
             "{npz}": tmp_path / "x.npz"}
    for name, path in paths.items():
        argv = [arg.replace(name, str(path)) for arg in argv]
    if recipe.endswith(".cfg"):
        chosen = default_flagfile(argv)
        assert os.path.basename(chosen) == recipe and os.path.isfile(chosen)
    else:
        with pytest.raises(ConfigError, match=recipe):
            default_flagfile(argv)


@pytest.mark.parametrize("recipe, size", [("own32.cfg", 32), ("own64.cfg", 64)])
def test_the_own_data_recipes_validate_at_their_size(tmp_path, recipe, size):
    from megdiffusion.scripts.cli import config_from_flagfile
    from megdiffusion.training.config import CONFIGS

    prepare(ArraySource(np.zeros((128, size, size, 3), np.uint8), None, "zeros"), tmp_path / "p.data", size,
            workers=0)
    cfg, _ = config_from_flagfile(os.path.join(CONFIGS, recipe), data_path=str(tmp_path / "p.data"))
    assert cfg.image_size == size and cfg.dataset == "prepared" and cfg.logdir == f"runs/own{size}"


def test_the_feeds_of_two_ranks_make_the_global_batch_of_one(tmp_path, tiny_config):
    """Each rank's data worker reads only its rows of the prepared file and draws only its samples: two ranks' steps
    side by side are one rank's, images, flips, labels, timesteps, noise and input perturbation alike."""
    import functools

    from megdiffusion.data.loader import BatchLoader
    from megdiffusion.training.draws import PER_SAMPLE, draw_step, first_sample
    from megdiffusion.training.feed import StepFeed

    images = np.random.default_rng(0).integers(0, 256, (24, 8, 8, 3), dtype=np.uint8)
    prepare(ArraySource(images, np.arange(24) % 3, "x"), tmp_path / "x.data", 8, workers=0)
    dataset = PreparedDataset(tmp_path / "x.data")
    cfg = tiny_config(num_classes=3, class_dropout=0.3, input_perturbation=0.1)
    steps = {}
    for world in (1, 2):
        for rank in range(world):
            loader = BatchLoader(load_dataset("prepared", str(tmp_path / "x.data")), 8, 5, world, rank, True,
                                 dataset.labels)
            draw = functools.partial(draw_step, PER_SAMPLE, cfg, 40, rank=rank, first_index=first_sample(8, world,
                                                                                                        rank))
            feed = StepFeed(loader, draw, workers=1, perturbation=True)
            made = []
            for step in range(5):  # 24 images, batch 8: into the second epoch
                x0, labels, d = feed.next(step)
                made.append([np.array(a) for a in (x0, labels, d.t, d.noise, d.perturbation, d.labels)])
            feed.close()
            steps[world, rank] = made
    for step in range(5):
        for part, one in enumerate(steps[1, 0][step]):
            np.testing.assert_array_equal(np.concatenate([steps[2, 0][step][part], steps[2, 1][step][part]]), one)
