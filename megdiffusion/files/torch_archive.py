"""Restricted unpickling of weight files, without torch or MegEngine, and a cache of converted arrays.

- :func:`load_torch_file`: what ``torch.save`` wrote (the zip archive of torch >= 1.6, or the legacy
  format before it), tensors as numpy arrays; :func:`read_torch_archive` flattens it (TorchScript too).
- :func:`load_array_pickle`: a plain pickle of numpy arrays in dicts and lists (``megengine.save``,
  megdiffusion's checkpoints, CIFAR-10's batches).

Each unpickler refuses every class but the few its format needs, so loading a file runs no code stored in
it. :func:`cached_arrays` converts a file once and keeps the result as ``.npz`` under :func:`cache_dir`.
The FID Inception's weights, checkpoints (``training.checkpoint``) and published DDPM checkpoints
(``megdiffusion.formats.convert``) come through here.
"""
import codecs
import collections
import hashlib
import io
import os
import pickle
import zipfile

import numpy as np

from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.files.disk import check_not_special, save_npz
from megdiffusion import environment


class WeightsError(MegdiffusionError):
    """Weights that are missing, unreadable or not the expected ones (one-line message)."""


class RefusedClass(WeightsError, pickle.UnpicklingError):
    """A pickle asked for a class its format does not need: nothing of it was run."""


_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
# The first pickles of a legacy (pre-zip) torch file: this magic number, then this protocol version.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


class _StorageType:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype).newbyteorder("<")


class _ScriptObject:
    """Inert stand-in for a TorchScript module object (``__torch__.*``): it only records its attributes."""

    def __setstate__(self, state):
        self.state = state


class _Storage:
    """A storage the pickle names; ``values`` (a flat array) is filled in after unpickling."""

    def __init__(self, dtype, numel):
        self.dtype, self.numel, self.values = dtype, numel, None


def _tensor_view(values, storage_offset, size, stride):
    """A contiguous copy of the tensor ``size``/``stride`` (in elements) at ``storage_offset`` of ``values``."""
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or min(stride + size + (storage_offset,), default=0) < 0:
        raise pickle.UnpicklingError(f"bad tensor layout: size {size}, stride {stride}")
    if all(size):
        extent = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if extent > values.size:
            raise pickle.UnpicklingError(f"tensor of size {size} reads past its storage ({values.size} values)")
    itemsize = values.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        values[storage_offset:], shape=size, strides=tuple(s * itemsize for s in stride)
    )
    return np.ascontiguousarray(view)


class _TensorRef:
    """A tensor of a storage whose values may not be read yet (legacy files store them after the pickle)."""

    def __init__(self, storage, storage_offset, size, stride, *unused):
        self.storage, self.layout = storage, (storage_offset, size, stride)

    def array(self):
        return _tensor_view(self.storage.values, *self.layout)


_TORCH_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _TensorRef,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.jit._pickle", "build_intlist"): list,
}


class _TorchUnpickler(pickle.Unpickler):
    """Unpickler for a torch pickle: tensors become ``_TensorRef``s of ``storages``; every other class is refused."""

    def __init__(self, file):
        super().__init__(file)
        self.storages = {}

    def find_class(self, module, name):
        if (module, name) in _TORCH_GLOBALS:
            return _TORCH_GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "__torch__" or module.startswith("__torch__."):
            return _ScriptObject
        raise RefusedClass(f"refusing to load {module}.{name}: not part of a tensor archive")

    def persistent_load(self, pid):
        # zip archives: ("storage", type, key, location, numel); legacy files add a view record (None).
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        if len(pid) == 6 and pid[5] is not None:
            raise pickle.UnpicklingError("storage views (torch < 0.4 files) are not supported")
        return self.storages.setdefault(key, _Storage(storage_type.dtype, numel))


def _resolve(obj):
    """``obj`` with every ``_TensorRef`` replaced by its array (dicts, lists, tuples, TorchScript records)."""
    if isinstance(obj, _TensorRef):
        return obj.array()
    if isinstance(obj, _ScriptObject):
        obj.state = _resolve(obj.state)
        return obj
    if isinstance(obj, dict):
        return type(obj)((key, _resolve(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_resolve(value) for value in obj)
    return obj


def _fill(storage, raw, key):
    values = np.frombuffer(raw, dtype=storage.dtype)
    if values.size < storage.numel:
        raise pickle.UnpicklingError(f"storage {key} holds {values.size} values, expected {storage.numel}")
    storage.values = values


def _load_zip(archive, path):
    roots = [name[: -len("/data.pkl")] for name in archive.namelist() if name.endswith("/data.pkl")]
    if len(roots) != 1:
        raise WeightsError(f"{path} is not a torch archive (expected one */data.pkl)")
    unpickler = _TorchUnpickler(io.BytesIO(archive.read(f"{roots[0]}/data.pkl")))
    obj = unpickler.load()
    for key, storage in unpickler.storages.items():
        _fill(storage, archive.read(f"{roots[0]}/data/{key}"), key)
    return obj


class _NoClassUnpickler(pickle.Unpickler):
    """Unpickler for pickles of plain values only (numbers, strings, lists, dicts)."""

    def find_class(self, module, name):
        raise RefusedClass(f"refusing to load {module}.{name}: expected plain values")


def load_plain_pickle(data):
    """The object pickled in ``data`` (bytes), refusing any class: plain values only."""
    return _NoClassUnpickler(io.BytesIO(data)).load()


def _load_legacy(f, path):
    """The legacy format: pickles of the magic number, protocol and system info, the object, the storage keys;
    then each storage as an int64 element count and its raw little-endian values."""
    try:
        header = [_NoClassUnpickler(f).load() for _ in range(3)]
    except Exception:  # noqa: BLE001 -- any other file: unpickling garbage raises many types
        header = None
    if not header or header[0] != LEGACY_MAGIC:
        raise WeightsError(f"{path} is not a torch file (neither a zip archive nor the legacy format)")
    if header[1] != LEGACY_PROTOCOL or not isinstance(header[2], dict) or not header[2].get("little_endian"):
        raise WeightsError(f"{path}: unsupported legacy torch file (protocol {header[1]}, or big-endian)")
    unpickler = _TorchUnpickler(f)
    obj = unpickler.load()
    for key in _NoClassUnpickler(f).load():
        storage = unpickler.storages.get(key)
        if storage is None:
            raise pickle.UnpicklingError(f"storage {key} is stored but never used")
        count = int.from_bytes(f.read(8), "little")
        _fill(storage, f.read(count * storage.dtype.itemsize), key)
    return obj


def is_torch_file(path):
    """Whether ``path`` is a ``torch.save`` file: a zip archive or a legacy file (first pickle: the magic number)."""
    check_not_special(path)
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        try:
            return _NoClassUnpickler(f).load() == LEGACY_MAGIC
        except Exception:  # noqa: BLE001 -- any other file
            return False


def load_torch_file(path):
    """The object a ``torch.save`` file holds (zip archive or legacy format), every tensor a numpy array.

    Raises :class:`WeightsError` for a file that is neither or is damaged, and :class:`RefusedClass` (one)
    when the pickle asks for any class other than the tensor-rebuild function, storages, ``OrderedDict`` and inert
    TorchScript module records.
    """
    check_not_special(path)
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                obj = _load_zip(archive, path)
        else:
            with open(path, "rb") as f:
                obj = _load_legacy(f, path)
    except WeightsError:
        raise
    except Exception as exc:  # noqa: BLE001 -- truncated or garbled data raises many types
        raise WeightsError(f"cannot read torch file {path}: {type(exc).__name__}: {one_line(exc)}") from None
    return _resolve(obj)


def _collect_tensors(obj, prefix, out):
    """Flatten module objects and dicts into ``{"a.b.c": array}`` (non-tensor attributes are skipped)."""
    if isinstance(obj, _ScriptObject):
        obj = obj.state
    if isinstance(obj, dict):
        for key, value in obj.items():
            _collect_tensors(value, f"{prefix}{key}.", out)
    elif isinstance(obj, np.ndarray):
        out[prefix[:-1]] = obj


def read_torch_archive(path):
    """Every tensor of a torch file (``torch.save``, either format, or TorchScript) as ``{dotted_name: array}``
    in file order; errors as :func:`load_torch_file`."""
    tensors = {}
    _collect_tensors(load_torch_file(path), "", tensors)
    return tensors


# What a pickle of numpy arrays names: ndarray.__reduce__'s rebuild function (protocols 2-4) and
# __reduce_ex__(5)'s, ndarray and dtype themselves, and numpy scalars' rebuild function.
_NUMPY_NAMES = {f.__name__: f for f in (np.ndarray, np.dtype, np.zeros(1).__reduce__()[0],
                                        np.zeros(1).__reduce_ex__(5)[0], np.float32(0).__reduce__()[0])}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler for numpy arrays, numpy scalars and plain containers; every other class is refused."""

    def find_class(self, module, name):
        if (module == "numpy" or module.startswith(("numpy.core.", "numpy._core."))) and name in _NUMPY_NAMES:
            return _NUMPY_NAMES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("_codecs", "encode"):  # bytes, in a protocol 2 pickle written by Python 3
            return codecs.encode
        raise RefusedClass(f"refusing to load {module}.{name}: not a numpy array or container")


def load_array_pickle(path, encoding="ASCII"):
    """The object a plain pickle of numpy arrays holds (``megengine.save`` of a state dict, a megdiffusion
    checkpoint, a CIFAR-10 batch); ``encoding``: how Python 2 strings are read (``pickle.Unpickler``'s).

    Raises :class:`WeightsError` when the file cannot be read or is not a pickle, and :class:`RefusedClass` (one)
    when it names any class but numpy arrays, dtypes, scalars and ``OrderedDict``.
    """
    try:
        with open(path, "rb") as f:
            obj = _ArrayUnpickler(f, encoding=encoding).load()
    except WeightsError:
        raise
    except OSError as exc:
        raise WeightsError(f"cannot read {path}: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 -- garbled data raises many types
        raise WeightsError(f"{path} is not a pickle of arrays: {type(exc).__name__}: {one_line(exc)}") from None
    return obj


def cache_dir():
    """Folder of converted weights: ``$XDG_CACHE_HOME/megdiffusion`` or ``~/.cache/megdiffusion``."""
    base = environment.read("XDG_CACHE_HOME", None) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megdiffusion")


def cached_arrays(path, name, convert):
    """``convert(path)`` (a dict of numpy arrays), computed once per file and kept in :func:`cache_dir` as
    ``<name>_<hash>.npz``, keyed by the file's path, size and mtime. A damaged cache is rebuilt; one that
    cannot be written (a read-only home) is skipped."""
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    cached = os.path.join(cache_dir(), f"{name}_{hashlib.sha256(key).hexdigest()[:16]}.npz")
    if os.path.isfile(cached):
        try:
            with np.load(cached) as npz:
                return {array_name: npz[array_name] for array_name in npz.files}
        except (OSError, ValueError, zipfile.BadZipFile):
            pass  # rebuilt below
    arrays = convert(path)
    try:
        save_npz(cached, **arrays)
    except OSError:
        pass
    return arrays
