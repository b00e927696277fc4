"""Tensor codecs shared by the frontend, the workers and the client.

Raw form (PROTOCOL.md): row-major, little-endian, no padding; a BYTES element
is a 4-byte little-endian length followed by its bytes. These functions are
pure: bytes and numpy in, bytes and numpy out.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchd.protos.datatypes import DATATYPES, datatype_of

_LEN = struct.Struct("<I")
_SLICE = 65_536  # BYTES elements whose offsets are Python ints at once (deserialize_bytes)


MAX_DIMS = 32  # dimensions of a tensor a client may send: more are refused unread
_NARROW = {  # integer datatypes narrower than the 32-bit contents field they travel in
    k: np.iinfo(v.numpy)
    for k, v in DATATYPES.items()
    if v.contents_field in ("int_contents", "uint_contents") and v.itemsize < 4
}


def bounded_count(shape: Sequence[int], limit: int) -> int:
    """prod(shape), or limit + 1 as soon as it passes `limit` (or the shape has more
    than MAX_DIMS dimensions): a hostile shape of many huge dimensions would otherwise
    make a product thousands of digits long, in time quadratic in its length."""
    if len(shape) > MAX_DIMS:
        return limit + 1
    if 0 in shape:  # (a product that passed `limit` before its 0 counted [2, 0] as 1)
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > limit:
            return limit + 1
    return count


def bytes_row_offsets(buf: bytes | memoryview, rows: int, per_row: int = 1) -> np.ndarray:
    """Where each of `rows` rows of `per_row` BYTES elements starts in `buf`, plus len(buf).

    One walk over the buffer that never reads more elements than `rows * per_row`:
    a buffer holding more, fewer or cut-short elements raises ValueError as soon as
    that is known, so the work is bounded by the count the header declared, not by
    what the sender packed. Memory: 8 bytes a row. Elements of one length (the
    densest framing, empty strings, among them) are checked with numpy at C speed.
    """
    end, count = len(buf), rows * per_row
    if count == 0:
        if end:
            raise ValueError(f"0 BYTES elements need 0 bytes, the buffer holds {end}")
        return np.zeros(rows + 1, np.int64)
    step, rest = divmod(end, count)
    if not rest and step >= 4 and _uniform(buf, count, step):
        return np.arange(0, end + 1, step * per_row, dtype=np.int64)
    offsets, pos, i = array("q"), 0, 0
    unpack, add = _LEN.unpack_from, offsets.append
    try:
        if per_row == 1:  # one loop, not two: twice as fast per element
            for i in range(count):  # noqa: B007 - `i` names the element that failed
                add(pos)
                pos += 4 + unpack(buf, pos)[0]
        else:
            for i in range(0, count, per_row):  # noqa: B007 - names the failed row
                add(pos)
                for _ in range(per_row):
                    pos += 4 + unpack(buf, pos)[0]
    except struct.error:
        raise _framing_error(buf, offsets, i, per_row, count) from None
    if pos != end:
        raise _framing_error(buf, offsets, i, per_row, count)
    add(end)
    return np.frombuffer(offsets, np.int64)


def _uniform(buf: bytes | memoryview, count: int, step: int) -> bool:
    """Whether `buf` is `count` elements of `step - 4` bytes each."""
    prefixes = np.ndarray((count,), np.dtype("<u4"), buffer=buf, strides=(step,))
    return bool((prefixes == step - 4).all())


def _framing_error(
    buf: bytes | memoryview, offsets: array[int], i: int, per_row: int, count: int
) -> ValueError:
    """What is wrong with `buf`, walked again from the row before the one where the walk
    failed (row `i // per_row`, starting at offsets[-1]): a prefix saying too many bytes
    is found one element later, so the element it names would be the next one's."""
    end, back = len(buf), len(offsets) > 1
    pos, i = (offsets[-2], i - per_row) if back else (offsets[-1], i)
    while i < count:
        if pos == end:
            return ValueError(f"{count} BYTES elements declared, the buffer holds only {i}")
        if pos + 4 > end:
            return ValueError(
                f"BYTES element {i} is truncated: a 4-byte length prefix needs 4 bytes, "
                f"{end - pos} remain"
            )
        (n,) = _LEN.unpack_from(buf, pos)
        if pos + 4 + n > end:
            return ValueError(
                f"BYTES element {i} is truncated: its prefix says {n} bytes, {end - pos - 4} remain"
            )
        pos, i = pos + 4 + n, i + 1
    return ValueError(
        f"{count} BYTES elements declared, the buffer holds more ({end - pos} bytes after them)"
    )


def bytes_element_offsets(buf: bytes | memoryview, count: int) -> np.ndarray:
    """Start offsets of the `count` BYTES elements of `buf`, plus len(buf) at the end."""
    return bytes_row_offsets(buf, count, 1)


def serialize_bytes(values: Any) -> bytes:
    """Length-prefix every element of an array-like of bytes/str (flattened row-major).
    A flat sequence (a protobuf repeated field) is read one element at a time, so
    its elements never all exist as Python objects at once."""
    flat = isinstance(values, Sequence) and not (
        len(values) and isinstance(values[0], (list, tuple, np.ndarray))
    )
    if not flat:  # an ndarray, or nested lists: flattened row-major
        values = np.asarray(values, dtype=object).ravel()
    out = bytearray()
    pack = _LEN.pack
    for v in values:
        if isinstance(v, str):
            b = v.encode()
        elif isinstance(v, (bytes, bytearray, memoryview)):
            b = bytes(v)
        else:  # bytes(5) would be five zero bytes: an int is not an element
            raise TypeError(f"a BYTES element is bytes or str, not {type(v).__name__}")
        out += pack(len(b))
        out += b
    return bytes(out)


def _shown(shape: Sequence[int]) -> str:
    return f"{list(shape[:8])}{f' ({len(shape)} dims)' if len(shape) > 8 else ''}"


def _count(shape: Sequence[int], buf: bytes | memoryview, itemsize: int) -> int:
    """The elements of `shape`, if `buf` can hold them (ValueError if not): counted no
    further than that, so a hostile shape of huge dimensions costs nothing."""
    most = len(buf) // max(itemsize, 1)
    if any(d < 0 for d in shape) or (count := bounded_count(shape, most)) > most:
        raise ValueError(f"a tensor of shape {_shown(shape)} cannot be in {len(buf)} bytes")
    return count


def deserialize_bytes(buf: bytes | memoryview, shape: Sequence[int]) -> np.ndarray:
    """A numpy object array of `bytes` with `shape` from a raw BYTES buffer."""
    count = _count(shape, buf, 4)  # (4 bytes at least, each element's length)
    try:
        offsets = bytes_element_offsets(buf, count)
    except ValueError as e:
        raise ValueError(f"BYTES tensor of shape {_shown(shape)}: {e}") from None
    data = bytes(buf)
    out = np.empty(count, dtype=object)
    for lo in range(0, count, _SLICE):  # (all the offsets as Python ints: 4x the offsets'
        starts = offsets[lo : lo + _SLICE + 1].tolist()  # memory, 14x a reply of b""s)
        for i in range(len(starts) - 1):
            out[lo + i] = data[starts[i] + 4 : starts[i + 1]]
    return out.reshape(tuple(shape))


def to_raw(arr: Any, datatype: str | None = None) -> tuple[str, list[int], bytes]:
    """(datatype, shape, raw bytes) of an array; `datatype` overrides inference (e.g. BF16)."""
    a = np.asarray(arr)
    name = datatype or datatype_of(a)
    dt = DATATYPES[name]
    if dt.is_bytes:
        return name, list(a.shape), serialize_bytes(a)
    if name == "BF16" and (a.dtype.kind, a.dtype.itemsize) != ("u", 2):  # (">u2" too)
        raise ValueError("BF16 tensors travel as their uint16 bit patterns: pass a uint16 array")
    return name, list(a.shape), np.ascontiguousarray(a, dtype=dt.numpy).tobytes()


def raw_view(arr: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, without a copy, any shape: one with a 0 in its shape
    too (`arr.data.cast("B")` raised TypeError for it, failing a legal empty output)."""
    return arr.reshape(-1).view(np.uint8).data  # (1-D: its memoryview casts nothing)


def from_raw(datatype: str, shape: Sequence[int], buf: bytes | memoryview) -> np.ndarray:
    """A numpy array over `buf` (read-only, no copy) with the given datatype and shape."""
    dt = DATATYPES[datatype]
    if dt.is_bytes:
        return deserialize_bytes(buf, shape)
    expected = _count(shape, buf, dt.itemsize) * dt.itemsize
    if len(buf) != expected:
        raise ValueError(
            f"{datatype} tensor of shape {_shown(shape)} needs {expected} bytes, got {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dt.numpy).reshape(tuple(shape))


def contents_to_raw(datatype: str, values: Sequence[Any]) -> bytes:
    """Raw bytes of typed `InferTensorContents` values (the field for `datatype`).

    UINT8, UINT16, INT8 and INT16 travel in 32-bit fields: they are read at that
    width and checked against the datatype's range (ValueError naming the first
    extreme out of it), never wrapped."""
    dt = DATATYPES[datatype]
    if dt.is_bytes:
        return serialize_bytes(values)
    if (info := _NARROW.get(datatype)) is None:
        return np.asarray(values, dtype=dt.numpy).tobytes()
    wide = np.asarray(values, dtype="<u4" if info.kind == "u" else "<i4")
    low, high = (int(wide.min()), int(wide.max())) if wide.size else (0, 0)
    if low < info.min or high > info.max:
        got = low if low < info.min else high
        raise ValueError(f"{datatype} holds {info.min} to {info.max}, got {got}")
    return wide.astype(dt.numpy).tobytes()


def set_parameter(target: Any, value: Any) -> bool:
    """Fill an InferParameter from a Python bool, int, float or str; False (and
    nothing set) for any other value or an int beyond 64 bits."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int) and -(1 << 63) <= value < 1 << 63:
        target.int64_param = value
    elif isinstance(value, int) and 0 <= value < 1 << 64:
        target.uint64_param = value
    elif isinstance(value, float):
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        return False
    return True


def batch_input(kind: str, lengths: np.ndarray, width: int = 0, left: bool = False) -> np.ndarray:
    """A [[batch_input]] (INT64) for rows of `lengths` elements: "lengths" [rows];
    packed sources: "offsets" [rows + 1] from 0 (cu_seqlens), "segment_ids" [total] (the
    row of every element); padded ones: "mask" [rows, width], 1 on the real elements
    (on the `left` when the padding is on the left). The frontend builds them for
    each batch; the check tool for its batch of zeros."""
    lens = np.asarray(lengths, np.int64)
    if kind == "lengths":
        return lens
    if kind == "offsets":
        return np.concatenate((np.zeros(1, np.int64), np.cumsum(lens)))
    if kind == "segment_ids":
        return np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    pos = np.arange(width, dtype=np.int64)[None, :]
    real = pos >= (width - lens)[:, None] if left else pos < lens[:, None]
    return real.astype(np.int64)
