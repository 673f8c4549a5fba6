"""The safetensors reader against files written from the format's description, and the reference file."""
import json

import numpy as np
import pytest

from megdiffusion.formats.safetensors_file import is_safetensors, read_safetensors
from megdiffusion.files.torch_archive import WeightsError


def _write(path, tensors, metadata=None):
    """A safetensors file: header length, JSON header, then the tensors' bytes back to back."""
    header, chunks, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}
    for name, array in tensors.items():
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.normal(size=(3, 2, 1, 1)).astype(np.float32), "a": np.arange(5, dtype=np.int64),
               "half": rng.normal(size=4).astype(np.float16), "empty": np.zeros((0, 3), np.float32)}
    path = tmp_path / "model.safetensors"
    _write(path, tensors, metadata={"format": "pt"})
    assert is_safetensors(path)
    loaded = read_safetensors(path)
    assert list(loaded) == list(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        np.testing.assert_array_equal(loaded[name], array)


def test_malformed_files_are_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"PK\x03\x04 a zip file")
    assert not is_safetensors(path)
    with pytest.raises(WeightsError, match="is not a safetensors file"):
        read_safetensors(path)
    _write(path, {"w": np.zeros(4, np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[:-4])  # the last value cut off
    with pytest.raises(WeightsError, match=r"tensor 'w' of shape \(4,\) does not fit bytes 0..16 of the 12"):
        read_safetensors(path)
    text = b'{"w": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}'
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\0\0")
    with pytest.raises(WeightsError, match="unsupported safetensors entry 'w'"):
        read_safetensors(path)
