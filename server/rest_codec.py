"""KServe v2 REST bodies <-> the gRPC messages and tensors: pure functions, no I/O.

An HTTP inference request becomes the same ModelInferRequest a gRPC client would
send (every input in raw form), so it meets the same validation (codec.py), the
same limits and the same messages. JSON `data` is turned into raw bytes with
numpy, a whole tensor at a time; Triton's binary tensor extension is taken as it
is: the first `Inference-Header-Content-Length` bytes are the JSON header and
each input with a `binary_data_size` parameter takes its bytes from what
follows, in order.

Every rejection is InvalidInput naming the field, what was expected and what came,
quoting at most a short prefix (errors.clip). The work is linear in the body:
nesting is walked level by level (at most MAX_DEPTH levels), each in one pass.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterable, Sequence
from itertools import chain, islice
from typing import Any

import numpy as np
import orjson

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPE_NAMES, DATATYPES, float_elements
from batchd.protos.model_config import ModelConfig
from batchd.protos.tensors import MAX_DIMS, deserialize_bytes, set_parameter
from batchd.server.errors import CLIP_CHARS, CLIP_ITEMS, InvalidInput, ResponseTooLarge, clip
from batchd.server.json_body import MAX_JSON_BYTES, load_json
from batchd.server.json_body import json_kind as _kind
from batchd.server.request import Tensor

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_DEPTH = 32  # nesting levels of a tensor's `data`
MAX_DIM = 1 << 62  # a shape dimension beyond this cannot be an int64 of a real tensor
_BF16_MAX = 3.3895313892515355e38  # bits 0x7F7F
_INT_LIMITS = {  # BF16 travels as uint16 bits, but its JSON values are numbers
    k: np.iinfo(v.numpy) for k, v in DATATYPES.items() if v.numpy.kind in "iu" and k != "BF16"
}


def _number(value: Any) -> str:
    """A client-supplied number, cut to its first CLIP_CHARS digits: Python's json reads
    integers of thousands of digits."""
    text = str(value)
    return text if len(text) <= CLIP_CHARS else f"{text[:CLIP_CHARS]}... ({len(text)} digits)"


def _field(obj: dict[str, Any], key: str, kind: type, where: str, default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is default and key not in obj:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = {str: "a string", list: "a list", dict: "an object", int: "an integer",
                    bool: "true or false"}[kind]  # fmt: skip
        raise InvalidInput(f"{where}: '{key}' must be {expected}, got {_kind(value)}")
    return value


def _shape(value: list[Any], where: str) -> list[int]:
    if len(value) > MAX_DIMS:
        raise InvalidInput(f"{where}: 'shape' has {len(value)} dimensions, at most {MAX_DIMS}")
    for d in value:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise InvalidInput(f"{where}: 'shape' holds non-negative integers, got {clip(repr(d))}")
    return value


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
    arr, kind = _array(values, ints := datatype in _INT_LIMITS)
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidInput(f"{where}: BOOL data holds true and false only")
        return arr.tobytes()
    # numpy makes [true, 5] integers: JSON's true is no number (one pass, in C)
    if kind not in "iuf" or (ints and kind == "f") or bool in set(map(type, values)):
        raise InvalidInput(f"{where}: {datatype} data holds {'integers' if ints else 'numbers'} "
                           f"only, got {_not_one(values, ints)}")  # fmt: skip
    if (info := _INT_LIMITS.get(datatype)) is not None and (
        arr.min() < info.min or arr.max() > info.max
    ):
        raise InvalidInput(
            f"{where}: {datatype} holds {info.min} to {info.max}, "
            f"got {_number(arr.min() if arr.min() < info.min else arr.max())}"
        )
    if datatype in _INT_LIMITS:
        return arr.astype(dt.numpy).tobytes()
    bits, past = float_elements(arr, datatype)  # a number past the type's range: refused
    if past.any():
        big = _BF16_MAX if datatype == "BF16" else float(np.finfo(dt.numpy).max)
        raise InvalidInput(
            f"{where}: {datatype} holds numbers of magnitude up to {big:.5g}, "
            f"got {_number(arr[past][0])}"
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
        if type(v) is float and ints:
            return f"{_number(v)} (not an integer)"
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


def _parameters(target: Any, params: dict[str, Any], where: str, skip: Iterable[str] = ()) -> None:
    for key, value in params.items():
        if key not in skip and not set_parameter(target[key], value):
            raise InvalidInput(
                f"{where}, parameter {clip(key)}: a boolean, number or string, got {_kind(value)}"
            )


class Wanted:
    """Which outputs a REST caller wants in binary form."""

    __slots__ = ("default", "named")

    def __init__(self, default: bool, named: dict[str, bool]) -> None:
        self.default, self.named = default, named

    def binary(self, name: str) -> bool:
        return self.named.get(name, self.default)


def parse_infer(
    body: bytes, header_length: int | None, model: str, version: str
) -> tuple[pb.ModelInferRequest, Wanted]:
    """A v2 REST inference body (JSON, or JSON + binary tensors) -> ModelInferRequest."""
    size = len(body)
    if header_length is None:
        header_length = size
    elif not 0 <= header_length <= size:
        raise InvalidInput(f"{HEADER_LENGTH} is {header_length}, but the body holds {size} bytes")
    head = load_json(memoryview(body)[:header_length], "the inference header")
    return request_from(head, memoryview(body)[header_length:], model, version)


def request_from(
    head: dict[str, Any], binary: memoryview, model: str, version: str
) -> tuple[pb.ModelInferRequest, Wanted]:
    """A v2 JSON request (parsed) and the binary tensors after it -> ModelInferRequest
    (also a batch job's line, jobs/lines.py)."""
    msg = pb.ModelInferRequest(
        model_name=model, model_version=version, id=_field(head, "id", str, "the request", "")
    )
    params = _field(head, "parameters", dict, "the request", {})
    _parameters(msg.parameters, params, "the request", skip=("binary_data_output",))
    at = 0
    for i, item in enumerate(_field(head, "inputs", list, "the request", [])):
        at = _input(msg, i, item, binary, at)
    if at != len(binary):
        raise InvalidInput(
            f"the body holds {len(binary)} bytes after the header; the inputs' "
            f"binary_data_size parameters add up to {at}"
        )
    return msg, _wanted(msg, head, params.get("binary_data_output", False) is True)


def _input(msg: pb.ModelInferRequest, i: int, item: Any, binary: memoryview, at: int) -> int:
    """Add input `i` to `msg`; returns where the next binary input starts."""
    if not isinstance(item, dict):
        raise InvalidInput(f"input {i}: expected an object, got {_kind(item)}")
    name = _field(item, "name", str, f"input {i}", "")
    where = f"input {clip(name)}"
    datatype = _field(item, "datatype", str, where, "")
    shape = _shape(_field(item, "shape", list, where, []), where)
    size = _field(item, "parameters", dict, where, {}).get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:
            raise InvalidInput(
                f"{where}: binary_data_size must be a non-negative integer, got {_kind(size)} "
                f"{clip(str(size))}"
            )
        if at + size > len(binary):
            raise InvalidInput(
                f"{where}: binary_data_size {_number(size)} does not fit the "
                f"{len(binary) - at} binary bytes left after the header"
            )
        raw = bytes(binary[at : at + size])
        at += size
    elif "data" in item:
        values, _ = flatten(item["data"], where)
        if len(values) != math.prod(shape):
            raise InvalidInput(
                f"{where}: shape {shape[:8]} needs {_number(math.prod(shape))} values, "
                f"'data' holds {len(values)}"
            )
        raw = to_raw(datatype, values, where)
    else:
        raise InvalidInput(f"{where}: needs 'data' or a binary_data_size parameter")
    msg.inputs.add(name=name, datatype=datatype, shape=shape)
    msg.raw_input_contents.append(raw)
    return at


def _wanted(msg: pb.ModelInferRequest, head: dict[str, Any], default: bool) -> Wanted:
    named: dict[str, bool] = {}
    for i, item in enumerate(_field(head, "outputs", list, "the request", [])):
        if not isinstance(item, dict):
            raise InvalidInput(f"output {i}: expected an object, got {_kind(item)}")
        name = _field(item, "name", str, f"output {i}", "")
        params = _field(item, "parameters", dict, f"output {clip(name)}", {})
        if "classification" in params:
            raise InvalidInput(f"output {clip(name)}: the classification extension is not served")
        named[name] = params.get("binary_data", default) is True
        msg.outputs.add(name=name)
    return Wanted(default, named)


def parse_load(body: bytes, model: str) -> pb.RepositoryModelLoadRequest:
    """A model-control load body (empty, or `{"parameters": {...}}`). batchd refuses
    load parameters (service.load) quoting at most CLIP_ITEMS of them, so only the
    first CLIP_ITEMS + 1 are carried: a body of a million costs no more than one of 9."""
    msg = pb.RepositoryModelLoadRequest(model_name=model)
    if body.strip():
        params = _field(load_json(body), "parameters", dict, "the request", {})
        _parameters(msg.parameters, dict(islice(params.items(), CLIP_ITEMS + 1)), "the request")
    return msg


def parse_index(body: bytes) -> pb.RepositoryIndexRequest:
    """A repository index body: empty, or `{"ready": true}` (only models ready to serve)."""
    ready = _field(load_json(body), "ready", bool, "the request", False) if body.strip() else False
    return pb.RepositoryIndexRequest(ready=ready)


def parse_generate(body: bytes, cfg: ModelConfig) -> pb.ModelInferRequest:
    """A v2 generate body: each key an input (a scalar, or a list), plus `id` and
    `parameters` -> ModelInferRequest. A batching model's inputs get a batch of 1."""
    head = load_json(body)
    msg = pb.ModelInferRequest(
        model_name=cfg.name,
        model_version=cfg.version,
        id=_field(head, "id", str, "the request", ""),
    )
    _parameters(msg.parameters, _field(head, "parameters", dict, "the request", {}), "the request")
    for key, value in head.items():
        if key in ("id", "parameters"):
            continue
        spec = cfg.input(key)
        if spec is None:
            expected = ", ".join(repr(s.name) for s in cfg.inputs)
            raise InvalidInput(
                f"unknown input {clip(key)} for model {cfg.name!r}; expected {expected}"
            )
        values, shape = flatten(value, f"input {key!r}")
        shape = shape or [1]
        msg.inputs.add(
            name=key, datatype=spec.datatype, shape=[1, *shape] if cfg.batches else shape
        )
        msg.raw_input_contents.append(to_raw(spec.datatype, values, f"input {key!r}"))
    return msg


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


def json_safe(value: Any) -> Any:
    """`value` for orjson, which writes inf and nan as null: floats that are not finite
    go as Python's json writes them (Infinity, -Infinity, NaN, which Python's json, and
    so tritonclient.http, reads back), never silently changed."""
    floats = isinstance(value, np.ndarray | np.floating) and value.dtype.kind == "f"
    if floats and not np.isfinite(value).all():
        return orjson.Fragment(json.dumps(value.tolist()).encode())
    return value


def tensors(response: pb.ModelInferResponse) -> list[Tensor]:
    """A response's outputs as Tensors (no copy of their data)."""
    return [
        Tensor(o.name, o.datatype, tuple(o.shape), raw)
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    ]


def infer_response(response: pb.ModelInferResponse, wanted: Wanted) -> tuple[bytes, int | None]:
    """The REST body of a response: JSON, or JSON + binary outputs, and the JSON's
    length when binary parts follow (for Inference-Header-Content-Length)."""
    results = tensors(response)
    _json_room([t for t in results if not wanted.binary(t.name)])
    outputs = []
    parts: list[bytes] = []
    for t in results:
        out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if wanted.binary(t.name):
            out["parameters"] = {"binary_data_size": len(t.data)}
            parts.append(bytes(t.data))
        else:
            out["data"] = json_safe(values(t))
        outputs.append(out)
    head: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id:
        head["id"] = response.id
    head["outputs"] = outputs
    text = orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY)
    if not parts:
        return text, None
    return text + b"".join(parts), len(text)


def _json_room(in_json: Sequence[Tensor]) -> None:
    """Tensors written as JSON hold the GIL while orjson writes them, and grow about 3x:
    at most MAX_JSON_BYTES of them, as of a request's JSON."""
    if (size := sum(len(t.data) for t in in_json)) > MAX_JSON_BYTES:
        raise ResponseTooLarge(
            f"the answer's JSON outputs hold {size} bytes of tensors, more than "
            f"{MAX_JSON_BYTES}: ask for them in binary form (binary_data_output)"
        )


def generate_response(model: ModelConfig, request_id: str, results: Sequence[Tensor]) -> bytes:
    """A generate body: each output by name, a one-element output as its value."""
    _json_room(results)
    body: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if request_id:
        body["id"] = request_id
    for t in results:
        v = values(t)
        body[t.name] = json_safe(v[0] if len(v) == 1 else v)
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
