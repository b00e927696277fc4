"""A tensor's JSON `data` <-> its raw bytes (PROTOCOL.md): pure functions, no I/O.

JSON values are turned into raw bytes with numpy, a whole tensor at a time, once
their types are known (one pass, in C); nesting is walked level by level (at most
MAX_DEPTH levels), each in one pass. Every rejection is InvalidInput naming the
tensor, what was expected and what came, quoting at most a short prefix.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

import numpy as np
import orjson

from batchd.protos.datatypes import DATATYPE_NAMES, DATATYPES, float_elements
from batchd.protos.tensors import deserialize_bytes
from batchd.server.errors import CLIP_CHARS, InvalidInput, clip
from batchd.server.json_body import json_kind as _kind
from batchd.server.request import Tensor

MAX_DEPTH = 32  # nesting levels of a tensor's `data`
_BF16_MAX = 3.3895313892515355e38  # bits 0x7F7F
_INT_LIMITS = {  # BF16 travels as uint16 bits, but its JSON values are numbers
    k: np.iinfo(v.numpy) for k, v in DATATYPES.items() if v.numpy.kind in "iu" and k != "BF16"
}


def number(value: Any) -> str:
    """A client-supplied number, cut to its first CLIP_CHARS digits: Python's json reads
    integers of thousands of digits."""
    text = str(value)
    return text if len(text) <= CLIP_CHARS else f"{text[:CLIP_CHARS]}... ({len(text)} digits)"


def flatten(data: Any, where: str) -> tuple[list[Any], list[int]]:
    """A tensor's JSON `data`, flat or nested, as a flat list, and the shape its
    nesting gives (rows of one level must be lists of equal length)."""
    if not isinstance(data, list):
        return [data], []
    level: list[Any] = data
    shape = [len(data)]
    for _ in range(MAX_DEPTH):
        if not level or not isinstance(level[0], list):
            return level, shape
        width = len(level[0])
        if any(type(x) is not list or len(x) != width for x in level):
            raise InvalidInput(f"{where}: 'data' nests lists of unequal lengths or mixes lists")
        shape.append(width)
        level = list(chain.from_iterable(level))
    raise InvalidInput(f"{where}: 'data' nests deeper than {MAX_DEPTH} levels")


def to_raw(datatype: str, values: Sequence[Any], where: str) -> bytes:
    """JSON values of one tensor (flat) -> its raw form (PROTOCOL.md)."""
    dt = DATATYPES.get(datatype)
    if dt is None:
        raise InvalidInput(f"{where}: unknown datatype {clip(datatype)}; expected {DATATYPE_NAMES}")
    if dt.is_bytes:
        return _bytes_raw(values, where)
    if not values:
        return b""
    # Types first (one pass, in C): numpy makes [true, 5] integers, and [0, ..., "xxx"]
    # strings each as wide as the longest (a 100 KB body: 800 MB, seconds of the loop).
    types, ints = set(map(type, values)), datatype in _INT_LIMITS
    if datatype == "BOOL":
        if types != {bool}:
            odd = _kind(next(v for v in values if type(v) is not bool))
            raise InvalidInput(f"{where}: BOOL data holds true and false only, got {odd}")
        return np.asarray(values, dtype=np.bool_).tobytes()
    arr, kind = _array(values, ints) if types <= {int, float} else (None, "")
    if arr is None or kind not in "iuf" or (ints and kind == "f"):
        raise InvalidInput(f"{where}: {datatype} data holds {'integers' if ints else 'numbers'} "
                           f"only, got {_not_one(values, ints)}")  # fmt: skip
    if (info := _INT_LIMITS.get(datatype)) is not None and (
        arr.min() < info.min or arr.max() > info.max
    ):
        raise InvalidInput(
            f"{where}: {datatype} holds {info.min} to {info.max}, "
            f"got {number(arr.min() if arr.min() < info.min else arr.max())}"
        )
    if datatype in _INT_LIMITS:
        return arr.astype(dt.numpy).tobytes()
    bits, past = float_elements(arr, datatype)  # a number past the type's range: refused
    if past.any():
        big = _BF16_MAX if datatype == "BF16" else float(np.finfo(dt.numpy).max)
        raise InvalidInput(
            f"{where}: {datatype} holds numbers of magnitude up to {big:.5g}, "
            f"got {number(arr[past][0])}"
        )
    return bits.tobytes()


def _array(values: Sequence[Any], ints: bool) -> tuple[np.ndarray, str]:
    """`values` as numpy sees them, and the kind of its dtype."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        arr = np.asarray([], dtype=object)
    kind = arr.dtype.kind
    if ints and kind in "fO" and all(type(v) is int for v in values):
        arr, kind = np.asarray(values, dtype=object), "i"  # ints past int64 beside small ones
    elif kind == "O" and all(type(v) in (int, float) for v in values):  # (an int past int64
        with contextlib.suppress(OverflowError):  # beside floats, from Python's json)
            arr, kind = np.asarray(values, dtype=np.float64), "f"
    return arr, kind


def _not_one(values: Sequence[Any], ints: bool) -> str:
    """The first of `values` that is not an integer (`ints`) or not a number, said."""
    for v in values:
        if type(v) is float and ints:  # (orjson reads an integer past 64 bits as a float)
            past = v.is_integer() and abs(v) >= 2**63
            return f"{number(v)} ({'an integer past 64 bits' if past else 'not an integer'})"
        if type(v) not in (int, float):
            return _kind(v)
    return "an integer past any float's range"  # (of hundreds of digits: Python's json)


def _bytes_raw(values: Iterable[Any], where: str) -> bytes:
    parts: list[bytes] = []
    for v in values:
        if type(v) is not str:
            raise InvalidInput(f"{where}: BYTES data holds strings, got {_kind(v)}")
        b = v.encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def values(t: Tensor) -> Any:
    """A tensor's elements, flat, for JSON: a numpy array orjson writes directly, or a
    list of strings for BYTES (InvalidInput if one is not UTF-8)."""
    dt = DATATYPES[t.datatype]
    if dt.is_bytes:
        try:
            return [b.decode() for b in deserialize_bytes(t.data, (math.prod(t.shape),))]
        except UnicodeDecodeError:
            raise InvalidInput(
                f"output {t.name!r} holds bytes that are not UTF-8, which JSON cannot carry; "
                "ask for it with the binary_data parameter"
            ) from None
    arr = np.frombuffer(t.data, dtype=dt.numpy)
    if t.datatype == "BF16":
        return (arr.astype("<u4") << 16).view("<f4")
    return arr


_SPELLED = np.array([b"NaN", b"Infinity", b"-Infinity"])


def json_safe(value: Any) -> Any:
    """`value` for orjson, which writes inf and nan as null: floats that are not finite
    go as Python's json writes them (Infinity, -Infinity, NaN, which Python's json, and
    so tritonclient.http, reads back), never silently changed. An array is still written
    by orjson, each null (its non-finite values, in order: nothing else is null) then
    spelled so; Python's json wrote it all, one value at a time, the event loop held
    (8 MiB of FP32 with one NaN: 250 ms, now 55; all NaN: 176 ms, now 60-85: 57a)."""
    floats = isinstance(value, np.ndarray | np.floating) and value.dtype.kind == "f"
    if not floats or np.isfinite(value).all():
        return value
    if not (isinstance(value, np.ndarray) and value.ndim == 1 and value.flags.c_contiguous):
        return orjson.Fragment(json.dumps(value.tolist()).encode())  # (a scalar)
    bad = value[~np.isfinite(value)]
    kinds = np.where(np.isnan(bad), 0, np.where(bad > 0, 1, 2))
    text = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    if (kinds == kinds[0]).all():  # (one kind: replaced in one pass)
        return orjson.Fragment(text.replace(b"null", _SPELLED[kinds[0]]))
    if 2 * len(bad) > len(value):  # (kinds mixed, most of them: json's is cheaper then)
        return orjson.Fragment(json.dumps(value.tolist()).encode())
    parts = text.split(b"null")
    joined: list[bytes] = [b""] * (2 * len(parts) - 1)
    joined[0::2], joined[1::2] = parts, _SPELLED[kinds].tolist()  # (no loop in Python)
    return orjson.Fragment(b"".join(joined))
