"""PyTorch's zip archives (``torch.save``, TorchScript) read without torch, and a cache of converted arrays.

:func:`read_torch_archive` maps tensor storages to numpy arrays with an unpickler that refuses every class
but the few a tensor archive needs. :func:`cached_arrays` converts an archive once and keeps the result as
``.npz`` under :func:`cache_dir`. The FID Inception's weights come through here (``metrics.inception``).
Imports no MegEngine.
"""
import collections
import hashlib
import io
import os
import pickle
import zipfile

import numpy as np

from megdiffusion.errors import MegdiffusionError
from megdiffusion.fileio import save_npz


class WeightsError(MegdiffusionError):
    """Weights that are missing, unreadable or not the expected ones (one-line message)."""


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


class _StorageType:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _ScriptObject:
    """Inert stand-in for a TorchScript module object (``__torch__.*``): it only records its attributes."""

    def __setstate__(self, state):
        self.state = state


def _rebuild_tensor(storage, storage_offset, size, stride, *unused):
    """numpy equivalent of ``torch._utils._rebuild_tensor_v2`` (strides counted in elements)."""
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or min(stride + size + (storage_offset,), default=0) < 0:
        raise pickle.UnpicklingError(f"bad tensor layout: size {size}, stride {stride}")
    if all(size):
        extent = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if extent > storage.size:
            raise pickle.UnpicklingError(f"tensor of size {size} reads past its storage ({storage.size} values)")
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[storage_offset:], shape=size, strides=tuple(s * itemsize for s in stride)
    )
    return np.ascontiguousarray(view)


_ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.jit._pickle", "build_intlist"): list,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for ``data.pkl`` that maps storages to numpy arrays and refuses every other class."""

    def __init__(self, file, archive, root):
        super().__init__(file)
        self._archive = archive
        self._root = root
        self._storages = {}

    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "__torch__" or module.startswith("__torch__."):
            return _ScriptObject
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a tensor archive")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        if key not in self._storages:
            raw = self._archive.read(f"{self._root}/data/{key}")
            array = np.frombuffer(raw, dtype=storage_type.dtype.newbyteorder("<"))
            if array.size < numel:
                raise pickle.UnpicklingError(f"storage {key} holds {array.size} values, expected {numel}")
            self._storages[key] = array
        return self._storages[key]


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
    """Read every tensor of a torch zip archive (``torch.save`` or TorchScript) without torch.

    Returns ``{dotted_name: np.ndarray}`` in archive order. Raises :class:`WeightsError` on a file that is
    not such an archive, and ``pickle.UnpicklingError`` when the pickle asks for any class other than
    the tensor-rebuild functions, storages, ``OrderedDict`` and inert TorchScript module records.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise WeightsError(f"cannot read torch archive {path}: {exc}") from None
    with archive:
        roots = [name[: -len("/data.pkl")] for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(roots) != 1:
            raise WeightsError(f"{path} is not a torch archive (expected one */data.pkl)")
        data = archive.read(f"{roots[0]}/data.pkl")
        obj = _RestrictedUnpickler(io.BytesIO(data), archive, roots[0]).load()
    tensors = {}
    _collect_tensors(obj, "", tensors)
    return tensors


def cache_dir():
    """Folder of converted weights: ``$XDG_CACHE_HOME/megdiffusion`` or ``~/.cache/megdiffusion``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
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
