"""Reading torch files (zip and legacy) and pickles of numpy arrays without torch (every tensor, nothing but
tensors), and the cache of converted arrays."""
import collections
import io
import os
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

from megdiffusion.files import torch_archive


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


def _write_archive(path, state, monkeypatch, legacy=False):
    """Write ``state`` (a Net record of attributes; arrays become tensors) as ``root/data.pkl`` +
    ``root/data/<key>`` storages, the layout of torch.save / TorchScript archives; ``legacy``: as the pickles
    and raw storages of torch's format before 1.6, with a plain dict at the top.

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
            obj = {} if legacy else net_cls()
            (obj if legacy else obj.__dict__).update({k: to_pickleable(v) for k, v in value.items()})
            return obj
        return value

    class Writer(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "storage":
                flat, storage_type = storages[obj[1]]
                return ("storage", storage_type, obj[1], "cpu", obj[2]) + ((None,) if legacy else ())
            return None

    buffer = io.BytesIO()
    if legacy:
        for header in (torch_archive.LEGACY_MAGIC, torch_archive.LEGACY_PROTOCOL,
                       {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(header, buffer, protocol=2)
    Writer(buffer, protocol=2).dump(to_pickleable(state))
    if legacy:
        pickle.dump(sorted(storages), buffer, protocol=2)
        for key in sorted(storages):
            buffer.write(len(storages[key][0]).to_bytes(8, "little") + storages[key][0].tobytes())
        path.write_bytes(buffer.getvalue())
        return
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", buffer.getvalue())
        for key, (flat, _) in storages.items():
            archive.writestr(f"archive/data/{key}", flat.tobytes())


@pytest.mark.parametrize("legacy", [False, True])
def test_reader_round_trips_every_tensor(tmp_path, monkeypatch, legacy):
    rng = np.random.default_rng(0)
    state = {
        "weight": rng.normal(size=(4, 3, 2, 2)).astype(np.float32),
        "stride": 2,
        "sub": {"mean": rng.normal(size=5).astype(np.float64),
                "count": np.arange(6, dtype=np.int64).reshape(2, 3),
                "deeper": {"var": rng.uniform(size=(3, 1)).astype(np.float32)}},
    }
    path = tmp_path / "tiny.pt"
    _write_archive(path, state, monkeypatch, legacy)
    tensors = torch_archive.read_torch_archive(str(path))
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
        torch_archive.read_torch_archive(str(path))
    assert not marker.exists()


def test_a_legacy_file_keeps_its_structure(tmp_path, monkeypatch):
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "ckpt.pt"
    _write_archive(path, {"ema_model": {"w": weights}, "step": 7, "name": "run"}, monkeypatch, legacy=True)
    loaded = torch_archive.load_torch_file(str(path))
    assert loaded["step"] == 7 and loaded["name"] == "run" and list(loaded) == ["ema_model", "step", "name"]
    np.testing.assert_array_equal(loaded["ema_model"]["w"], weights)


def test_reader_rejects_non_archives(tmp_path):
    path = tmp_path / "plain.pt"
    path.write_bytes(b"not a zip")
    with pytest.raises(torch_archive.WeightsError, match="not a torch file"):
        torch_archive.read_torch_archive(str(path))
    path.write_bytes(pickle.dumps(12345) * 3)  # pickles, but not torch's magic number
    with pytest.raises(torch_archive.WeightsError, match="not a torch file"):
        torch_archive.load_torch_file(str(path))


def test_reader_refuses_tensors_outside_their_storage():
    storage = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(torch_archive._tensor_view(storage, 1, (3,), (1,)), [1, 2, 3])
    with pytest.raises(pickle.UnpicklingError, match="past its storage"):
        torch_archive._tensor_view(storage, 2, (3,), (1,))
    with pytest.raises(pickle.UnpicklingError, match="bad tensor layout"):
        torch_archive._tensor_view(storage, 0, (2,), (-1,))


@pytest.mark.parametrize("protocol", [4, 5])  # megengine.save: pickle.DEFAULT_PROTOCOL (4)
def test_array_pickles_round_trip(tmp_path, protocol):
    rng = np.random.default_rng(0)
    state = collections.OrderedDict(w=rng.normal(size=(3, 2)).astype(np.float32), b=np.arange(4), s=np.float32(2.5),
                                    nested={"f16": np.ones(2, np.float16), "order": [1, "two"]})
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps(state, protocol=protocol))
    loaded = torch_archive.load_array_pickle(str(path))
    assert type(loaded) is collections.OrderedDict and list(loaded) == list(state)
    for name in ("w", "b"):
        assert loaded[name].dtype == state[name].dtype
        np.testing.assert_array_equal(loaded[name], state[name])
    assert loaded["s"] == np.float32(2.5) and loaded["nested"]["order"] == [1, "two"]
    np.testing.assert_array_equal(loaded["nested"]["f16"], state["nested"]["f16"])


def test_array_pickles_refuse_other_classes(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"w": np.zeros(2), "x": _Evil(marker)}))
    with pytest.raises(torch_archive.RefusedClass, match="refusing to load posix.system"):
        torch_archive.load_array_pickle(str(path))
    assert not marker.exists()
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(torch_archive.WeightsError, match="is not a pickle of arrays"):
        torch_archive.load_array_pickle(str(path))


def test_cached_arrays_convert_once_and_rebuild_a_damaged_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "weights.bin"
    source.write_bytes(b"anything")
    calls = []

    def convert(path):
        calls.append(path)
        return {"w": np.arange(3, dtype=np.float32)}

    first = torch_archive.cached_arrays(str(source), "demo", convert)
    [cached] = (tmp_path / "cache" / "megdiffusion").glob("demo_*.npz")
    again = torch_archive.cached_arrays(str(source), "demo", convert)
    assert len(calls) == 1 and list(again) == ["w"] and np.array_equal(again["w"], first["w"])
    cached.write_bytes(b"damaged")
    assert np.array_equal(torch_archive.cached_arrays(str(source), "demo", convert)["w"], first["w"])
    assert len(calls) == 2
