"""Tensor codecs shared by the frontend, the workers and the client.

Raw form (PROTOCOL.md): row-major, little-endian, no padding; a BYTES element
is a 4-byte little-endian length followed by its bytes. These functions are
pure: bytes and numpy in, bytes and numpy out.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchd.protos.datatypes import DATATYPES, datatype_of

_LEN = struct.Struct("<I")


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def bytes_element_offsets(buf: bytes | memoryview) -> list[int]:
    """Start offsets of every BYTES element in `buf`, plus len(buf) at the end.

    Raises ValueError naming the element whose length prefix or body is cut short.
    """
    offsets = []
    pos, end = 0, len(buf)
    unpack = _LEN.unpack_from
    while pos < end:
        offsets.append(pos)
        if pos + 4 > end:
            raise ValueError(
                f"BYTES element {len(offsets) - 1} is truncated: a 4-byte length prefix "
                f"needs 4 bytes, {end - pos} remain"
            )
        (n,) = unpack(buf, pos)
        pos += 4 + n
        if pos > end:
            raise ValueError(
                f"BYTES element {len(offsets) - 1} is truncated: its prefix says {n} bytes, "
                f"{end - (pos - n)} remain"
            )
    offsets.append(end)
    return offsets


def serialize_bytes(values: Any) -> bytes:
    """Length-prefix every element of an array-like of bytes/str (flattened row-major)."""
    flat = np.asarray(values, dtype=object).ravel()
    parts = []
    for v in flat:
        b = v.encode() if isinstance(v, str) else bytes(v)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(buf: bytes | memoryview, shape: Sequence[int]) -> np.ndarray:
    """A numpy object array of `bytes` with `shape` from a raw BYTES buffer."""
    offsets = bytes_element_offsets(buf)
    count = len(offsets) - 1
    if count != element_count(shape):
        raise ValueError(
            f"BYTES tensor of shape {list(shape)} needs "
            f"{element_count(shape)} elements, the buffer holds {count}"
        )
    data = bytes(buf)
    out = np.empty(count, dtype=object)
    for i in range(count):
        out[i] = data[offsets[i] + 4 : offsets[i + 1]]
    return out.reshape(tuple(shape))


def to_raw(arr: Any, datatype: str | None = None) -> tuple[str, list[int], bytes]:
    """(datatype, shape, raw bytes) of an array; `datatype` overrides inference (e.g. BF16)."""
    a = np.asarray(arr)
    name = datatype or datatype_of(a)
    dt = DATATYPES[name]
    if dt.is_bytes:
        return name, list(a.shape), serialize_bytes(a)
    if name == "BF16" and a.dtype != np.uint16:
        raise ValueError("BF16 tensors travel as their uint16 bit patterns: pass a uint16 array")
    return name, list(a.shape), np.ascontiguousarray(a, dtype=dt.numpy).tobytes()


def from_raw(datatype: str, shape: Sequence[int], buf: bytes | memoryview) -> np.ndarray:
    """A numpy array over `buf` (read-only, no copy) with the given datatype and shape."""
    dt = DATATYPES[datatype]
    if dt.is_bytes:
        return deserialize_bytes(buf, shape)
    expected = element_count(shape) * dt.itemsize
    if len(buf) != expected:
        raise ValueError(
            f"{datatype} tensor of shape {list(shape)} needs {expected} bytes, got {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dt.numpy).reshape(tuple(shape))


def contents_to_raw(datatype: str, values: Sequence[Any]) -> bytes:
    """Raw bytes of typed `InferTensorContents` values (the field for `datatype`)."""
    dt = DATATYPES[datatype]
    if dt.is_bytes:
        return serialize_bytes(list(values))
    return np.asarray(values, dtype=dt.numpy).tobytes()
