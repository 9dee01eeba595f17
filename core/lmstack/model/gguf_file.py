"""A GGUF file's metadata and tensor index, read in one pass over the header.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value: a tokenizer's
vocabulary and merges (~100k strings) cost it ~5 s, paid by every process that opens the model
(the server's config check, the engine, each worker). Here the header is parsed with `struct`
(~0.1 s) and tensors are views of one read-only memory map, in the same layout the gguf reader
gives (typed [rows, cols] for float and integer types, uint8 [rows, bytes_per_row] for
quantized ones), so `gguf.quants` decodes them unchanged.

Format (little-endian; version 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64
key/value count, the key/values, the tensor infos (name, u32 n_dims, u64 dims innermost first,
u32 GGML type, u64 offset into the data section), then the data section at the next multiple
of `general.alignment` (default 32).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from lmstack.model.checkpoint import GGUFTensor

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9

# ggml tensors have at most 4 dimensions (GGML_MAX_DIMS).
MAX_DIMS = 4
# The fewest bytes an encoded item takes, so that a count the rest of the file cannot hold is
# refused before a loop runs (or a list grows) that long: a string is its u64 length; an array
# its u32 type and u64 count; a key/value a key and a u32 type; a tensor info a name, u32
# n_dims, u32 type and u64 offset.
_MIN_STRING, _MIN_ARRAY, _MIN_KV, _MIN_TENSOR_INFO = 8, 12, 12, 24

# Tensor types the gguf reader (and so `GGUFTensor.data`) keeps typed; the rest are bytes.
_TYPED = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file we can read; the message says where it went wrong."""


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # every key/value as plain Python values (str, int, float, bool, list)
    tensors: dict[str, GGUFTensor]  # by GGUF name, in file order; views of the file mapping


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"file ends inside the header (at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file (at byte {self.pos})")
        raw = bytes(self.buf[self.pos : end])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a string at byte {self.pos} is not UTF-8: {e}") from None
        self.pos = end
        return text

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """`n` items of at least `item_bytes` each, when what is left of the file can hold them."""
        if n * item_bytes > len(self.buf) - self.pos:
            raise GGUFFormatError(
                f"file ends inside the header: {n} {what} cannot fit in the rest of it (at byte {self.pos})"
            )
        return n

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            least = {_STRING: _MIN_STRING, _ARRAY: _MIN_ARRAY}.get(etype, 1)
            count = self.count(count, least, "array values")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"an array of {count} values runs past the end of the file")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(etype) for _ in range(count)]  # arrays of arrays
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype][0])
        raise GGUFFormatError(f"unknown metadata value type {vtype} (at byte {self.pos})")


def read_gguf(path: Path) -> GGUFFile:
    """Parse `path`'s header and index its tensors (nothing decoded). GGUFFormatError or OSError
    when it is not a readable GGUF file."""
    # A plain ndarray view of the mapping (it keeps the mapping open): slicing a np.memmap
    # runs its Python-level __array_finalize__ on every view.
    mapped = np.memmap(path, mode="r", dtype=np.uint8).view(np.ndarray)
    cur = _Cursor(memoryview(mapped))
    if len(mapped) < 24 or bytes(mapped[:4]) != MAGIC:
        raise GGUFFormatError("not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.take("<I")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(f"GGUF version {version} is not supported{hint}; expected 2 or 3")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    cur.count(n_kv, _MIN_KV, "metadata keys")
    cur.count(n_tensors, _MIN_TENSOR_INFO, "tensor infos")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(
                f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have at most {MAX_DIMS}"
            )
        dims = [cur.take("<Q") for _ in range(n_dims)]
        raw_type, offset = cur.take("<I"), cur.take("<Q")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
        infos.append((name, dims, ggml_type, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        shape = tuple(reversed(dims))  # row-major, outermost first
        # Python integers: a product of u64 dims must not wrap around to a small size.
        n_elements = math.prod(dims)  # 1 for a scalar (no dims)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements // block * type_size
        start = data_start + offset
        if start + n_bytes > len(mapped):
            raise GGUFFormatError(
                f"tensor {name!r} of shape {list(shape)} ({n_bytes} bytes) runs past the end of the file"
            )
        raw = mapped[start : start + n_bytes]
        if ggml_type in _TYPED:
            data = raw.view(_TYPED[ggml_type]).reshape(shape)
        else:
            if shape[-1] % block:
                raise GGUFFormatError(
                    f"tensor {name!r}: rows of {shape[-1]} are not whole {ggml_type.name} blocks"
                )
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors[name] = GGUFTensor(data=data, ggml_type=ggml_type, shape=shape)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
