"""Reading a safetensors file with numpy alone.

The format: an 8-byte little-endian header length N, N bytes of JSON naming each tensor's ``dtype``,
``shape`` and ``data_offsets`` (a byte range of what follows), an optional ``__metadata__`` entry, then
the raw little-endian data.
"""
import json
import os

import numpy as np

from megdiffusion.errors import one_line
from megdiffusion.files.disk import check_not_special
from megdiffusion.files.torch_archive import WeightsError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
MAX_HEADER = 100_000_000  # bytes: the limit the safetensors library itself enforces


def is_safetensors(path):
    """Whether ``path`` starts like a safetensors file: 8 bytes of header length, then a JSON object (``{"`` or
    ``{}``); ``read_safetensors`` says what is wrong with one whose length is not sane."""
    check_not_special(path)
    with open(path, "rb") as f:
        return f.read(10)[8:10] in (b'{"', b"{}")


def read_safetensors(path):
    """``{name: array}`` of every tensor in the file, in header order; ``WeightsError`` when it is malformed."""
    with open(path, "rb") as f:
        prefix = f.read(9)
        if len(prefix) < 9 or prefix[8:9] != b"{":
            raise WeightsError(f"{path} is not a safetensors file (no JSON header after its first 8 bytes)")
        size, available = int.from_bytes(prefix[:8], "little"), os.fstat(f.fileno()).st_size - 8
        problem = (f"more than the file's {available} bytes after it" if size > available else
                   f"more than {MAX_HEADER}, the format's limit" if size > MAX_HEADER else
                   "too short for a JSON object" if size < 2 else None)
        if problem:
            raise WeightsError(f"{path}: its safetensors header length, {size}, is {problem}; the file is damaged")
        f.seek(8)
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise WeightsError(f"{path}: the safetensors header is not JSON: {one_line(exc)}") from None
        data = f.read()
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a JSON object")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: bad or unsupported safetensors entry {name!r}: {info!r}") from None
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data) \
                or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise WeightsError(f"{path}: tensor {name!r} of shape {shape} does not fit bytes {begin}..{end} "
                               f"of the {len(data)} stored")
        tensors[name] = np.frombuffer(memoryview(data)[begin:end], dtype).reshape(shape)
    return tensors
