"""numpy <-> ModelInferRequest / ModelInferResponse for the client. Pure.

A `datatypes=` override that narrows (FP64 values sent as UINT8, INT64 as INT32,
FP64 as FP16) is checked, never wrapped: numpy's cast would send 300 as UINT8
44, 2**40 as INT32 0, 1.7 as INT32 1 and 1e6 as FP16 inf, values the server
refuses when they come typed. An integer datatype takes whole numbers in its
range (1.0 is 1; 1.7 is refused, not truncated), BOOL 0 and 1, a float type
any number it can hold short of overflowing to inf (rounding to its precision,
as any float cast does). An array already of the datatype, or one numpy casts
to it safely (uint8 as INT32), is sent unchecked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from batchd.client.errors import BadResponse, InvalidInput
from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPE_NAMES, DATATYPES, element
from batchd.protos.tensors import (
    bounded_count,
    contents_to_raw,
    from_raw,
    set_parameter,
    to_raw,
)

CLIP = 64  # characters of a name or datatype from the server quoted in a message
EXACT = 2.0**53  # past it, a float holds not every whole number


def build_request(
    model: str,
    inputs: Mapping[str, Any],
    outputs: Sequence[str] | None = None,
    *,
    request_id: str = "",
    version: str = "",
    datatypes: Mapping[str, str] | None = None,
    parameters: Mapping[str, int | str | bool | float] | None = None,
) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, value in inputs.items():
        if not isinstance(name, str):
            raise InvalidInput(f"input names are strings, got {type(name).__name__}")
        override = (datatypes or {}).get(name)
        try:  # (a ragged list, a dtype with no datatype, an odd element)
            a = _array(value, override)
            if override is not None:
                a = _as_datatype(name, a, override)
            datatype, shape, raw = to_raw(a, override)
        except (ValueError, TypeError) as e:
            raise InvalidInput(f"input {name[:CLIP]!r}: {e}") from None
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(raw)
    if isinstance(outputs, str | bytes) or not isinstance(outputs, Iterable | None):
        raise TypeError(f"outputs: a list of output names, got {repr(outputs)[:40]} "
                        f"({type(outputs).__name__}); a timeout goes as timeout=")  # fmt: skip
    for name in outputs or ():
        msg.outputs.add(name=name)
    for key, v in (parameters or {}).items():  # (a numpy scalar as its Python value)
        if not set_parameter(msg.parameters[key], v.item() if isinstance(v, np.generic) else v):
            raise InvalidInput(f"parameter {str(key)[:CLIP]!r}: a bool, int, float or str "
                               f"(an int of 64 bits), got {type(v).__name__}")  # fmt: skip
    return msg


def _array(value: Any, datatype: str | None) -> np.ndarray:
    """An input as an array. Bytes or str not yet in one (a list) go into an object
    array: a fixed-width S/U array, what np.asarray makes, drops trailing NULs. Whole
    numbers sent as an integer `datatype` that numpy made floats (an int past 2**53
    beside others) are typed from the list, exactly: as floats 2**63 + 1 was 2**63,
    and 2**64 - 1 out of UINT64's range."""
    if isinstance(value, np.ndarray):
        return value
    a = np.asarray(value)
    if a.dtype.kind in "SU":
        return np.array(value, dtype=object)
    target = DATATYPES[datatype].numpy if datatype in DATATYPES else a.dtype
    if a.dtype.kind == "f" and target.kind in "iu" and (abs(a) >= EXACT).any():
        with contextlib.suppress(OverflowError, ValueError):  # (one past the type: refused
            exact = np.asarray(value, dtype=target)  # below, naming it)
            if np.array_equal(exact.astype(np.float64), a):  # what numpy's own floats in the
                return exact  # list made (it wraps them: -1.0 as UINT64 2**64 - 1) is not
    return a


def _as_datatype(name: str, a: np.ndarray, datatype: str) -> np.ndarray:
    """`a` cast to the override `datatype`, or InvalidInput naming the first value
    the cast would change (the module docstring's rules). Vectorized: the checks
    run only when the cast is not safe, at numpy speed."""
    dt = DATATYPES.get(datatype)
    if dt is None:
        raise InvalidInput(f"input {name!r}: datatype {datatype!r} is not one of {DATATYPE_NAMES}")
    if dt.is_bytes or datatype == "BF16" or np.can_cast(a.dtype, dt.numpy, "safe"):
        return a  # BYTES and BF16 (uint16 bits) are to_raw's to check
    given = a  # the values as the caller gave them, for the error
    if a.dtype.kind == "O":
        a = _numeric(name, a, datatype)
        if a.dtype == dt.numpy:
            return a
    if a.dtype.kind not in "biuf":
        raise InvalidInput(
            f"input {name!r}: datatypes= sends it as {datatype}, which holds numbers; "
            f"got a numpy {a.dtype} array"
        )
    with np.errstate(all="ignore"):
        out = a.astype(dt.numpy)
        changed = _changed(a, out)
    if (at := np.flatnonzero(changed)).size:
        raise _refused(name, datatype, given, int(at[0]))
    return out


def _changed(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Where `out`, `a` cast, does not hold `a`'s value (float rounding aside)."""
    kind = out.dtype.kind
    changed: np.ndarray
    if kind == "f":
        changed = np.isfinite(a) & ~np.isfinite(out)
    elif kind == "b":
        changed = (a != 0) & (a != 1)
    elif a.dtype.kind == "f":  # bounds as floats: info.max + 1 is exact, info.max may not be
        info = np.iinfo(out.dtype)
        low, past = float(info.min), float(info.max + 1)
        changed = ~np.isfinite(a) | (a != np.trunc(a)) | (a < low) | (a >= past)
    else:
        info = np.iinfo(out.dtype)
        changed = (a < info.min) | (a > info.max)
    return changed


def _refused(name: str, datatype: str, a: np.ndarray, i: int) -> InvalidInput:
    """The error for element `i` (row-major) of `a`, which `datatype` cannot hold."""
    target = DATATYPES[datatype].numpy
    if target.kind == "b":
        holds = "0 and 1"
    elif target.kind == "f":
        holds = f"numbers from {-np.finfo(target).max.item()} to {np.finfo(target).max.item()}"
    else:
        info = np.iinfo(target)
        holds = (
            f"whole numbers from {info.min} to {info.max} (fractions are refused, not truncated)"
        )
    value = a.flat[i]
    got = repr(value.item() if isinstance(value, np.generic) else value)
    got = got if len(got) <= 40 else f"{got[:37]}..."
    where = f" at {[int(k) for k in np.unravel_index(i, a.shape)]}" if a.ndim else ""
    return InvalidInput(
        f"input {name!r}: datatypes= sends it as {datatype}, which holds {holds}; got {got}{where}"
    )


def _numeric(name: str, a: np.ndarray, datatype: str) -> np.ndarray:
    """An object array (values numpy would not type: past 64 bits, or mixed) as a
    numeric one: as numpy types it, or else value by value as `datatype`, each
    checked as the server checks a typed value. A loop, but over Python objects
    already: only an object array comes here."""
    b = np.array(a.tolist())
    if b.dtype.kind in "biuf":
        return b
    out = np.empty(a.shape, DATATYPES[datatype].numpy)
    for i, v in enumerate(a.flat):
        value = v.item() if isinstance(v, np.generic) else v
        try:
            if not isinstance(value, int | float):
                raise ValueError("not a number")
            out.flat[i] = element(datatype, value)
        except (ValueError, OverflowError):
            raise _refused(name, datatype, a, i) from None
    return out


def _typed(t: pb.InferOutputTensor) -> np.ndarray:
    dt = DATATYPES[t.datatype]
    if dt.contents_field is None:
        raise ValueError(f"{t.datatype} came without raw contents")
    values, shape = getattr(t.contents, dt.contents_field), tuple(t.shape)
    if any(d < 0 for d in shape) or bounded_count(shape, len(values)) != len(values):
        raise ValueError(f"shape {list(shape[:8])} does not hold its {len(values)} values")
    # as raw, as the server reads typed contents (a narrow type's value past it: ValueError)
    arr = from_raw(t.datatype, shape, contents_to_raw(t.datatype, values))
    return arr if dt.is_bytes else arr.copy()


def parse_response(msg: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Each output as a writable numpy array (BF16 as its uint16 bit patterns); an
    answer that does not decode is BadResponse, saying why (a hostile shape costs
    nothing: its elements are counted no further than its data could hold)."""
    raw = msg.raw_output_contents
    if raw and len(raw) != len(msg.outputs):
        raise BadResponse(f"the response has {len(msg.outputs)} outputs and {len(raw)} raw "
                          "contents: one each was expected")  # fmt: skip
    out = {}
    for i, t in enumerate(msg.outputs):
        name = repr(t.name[:CLIP])
        if t.name in out:
            raise BadResponse(f"the response holds output {name} twice")
        if t.datatype not in DATATYPES:
            raise BadResponse(f"output {name}: unknown datatype {t.datatype[:CLIP]!r}")
        try:
            out[t.name] = from_raw(t.datatype, t.shape, raw[i]).copy() if raw else _typed(t)
        except (ValueError, OverflowError) as e:
            raise BadResponse(f"output {name} does not decode: {e}") from None
        if raw and t.datatype == "BOOL" and raw[i].translate(None, b"\0\1"):  # (linear, in C)
            raise BadResponse(f"output {name}: BOOL holds bytes 0 and 1 only, it came with "
                              "others")  # (taken as True, and sent on so: review 54b)  # fmt: skip
    return out
