"""A job file's lines in, its results' lines out. Pure: bytes in, bytes out.

A request line is a KServe v2 JSON request with a `custom_id`:

    {"custom_id": "a1", "inputs": [{"name": "INPUT0", "datatype": "FP32",
      "shape": [1, 4], "data": [1, 2, 3, 4]}], "outputs": [{"name": "OUTPUT0"}]}

`parse` turns it into the same ModelInferRequest a gRPC caller would send (the
data as raw contents), so a job's line is validated by codec.decode_request
exactly as an online request is. `data` may be flat or nested (row-major);
BYTES elements are strings. `parameters` is accepted for v2 compatibility: a
job's requests run in the job lane without a deadline, so `priority` and
`timeout` do not apply. A line that does not parse becomes a LineError, which
the runner writes as that line's error line.

A results line holds the outputs (`encode_outputs`, flat `data`, BYTES as
strings; BYTES that are not UTF-8 as base64 with `"parameters":
{"content_type": "base64"}`) or the error (`encode_error`).
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import orjson

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPES
from batchd.protos.tensors import MAX_DIMS
from batchd.server.errors import clip
from batchd.server.request import Tensor

MAX_CUSTOM_ID_CHARS = 512
# The longest line read: parsed, a line of numbers takes ~16x its size in Python
# objects, so this bounds one line's memory (~130 MB); longer lines are error lines.
MAX_LINE_BYTES = 8 * 1024 * 1024
# The numpy kinds a JSON list may parse to, per kind of the input's dtype: an
# integer input takes no 1.5, a boolean one only true and false.
_KINDS = {"b": "b", "u": "ui", "i": "ui", "f": "uif"}
_WHAT = {"b": "true or false", "u": "integers", "i": "integers", "f": "numbers"}


@dataclass(frozen=True, slots=True)
class LineError:
    """A line that is no request: its custom_id when it had one, and why."""

    custom_id: str | None
    message: str
    code: str = "INVALID_ARGUMENT"


def custom_id_of(doc: Any) -> str:
    """The line's custom_id; ValueError when it has none or a bad one."""
    if not isinstance(doc, dict):
        raise ValueError(f"a line must be a JSON object, got {type(doc).__name__}")
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError('a line needs "custom_id", a non-empty string')
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        raise ValueError(f"custom_id {clip(cid)} is over {MAX_CUSTOM_ID_CHARS} characters")
    return cid


def read_line(f: BinaryIO, limit: int = MAX_LINE_BYTES) -> tuple[bytes, int, bool]:
    """The next line of `f` (b"" at the end), its length in the file, and whether it was
    over `limit` bytes (then only its first `limit` bytes are returned, the rest skipped
    in pieces: memory stays bounded whatever the file holds)."""
    raw = f.readline(limit + 1)
    if len(raw) <= limit or raw.endswith(b"\n"):
        return raw, len(raw), False
    size = len(raw)
    while True:
        piece = f.readline(1 << 20)
        size += len(piece)
        if not piece or piece.endswith(b"\n"):
            return raw[:limit], size, True


def load(line: bytes) -> Any:
    """The JSON document of one line; ValueError naming the problem."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as e:
        start = clip(line[:40].decode("utf-8", "replace").rstrip())
        raise ValueError(f"not JSON ({e}); the line starts {start}") from None


def _flat(data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise ValueError(f'"data" must be a list, got {type(data).__name__}')
    if not data or not isinstance(data[0], list):
        return data
    out: list[Any] = []
    stack = [data]
    while stack:  # nested lists, row-major, without recursion
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def _bytes_raw(values: list[Any]) -> bytes:
    parts = []
    for v in values:
        if not isinstance(v, str):
            raise ValueError(f"BYTES elements are strings, got {type(v).__name__}")
        b = v.encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def _raw(datatype: str, values: list[Any]) -> bytes:
    dt = DATATYPES[datatype]
    if dt.is_bytes:
        return _bytes_raw(values)
    try:
        if datatype == "BF16":  # the upper half of each FP32, rounded to nearest even
            bits = np.asarray(values, dtype="<f4").view("<u4").astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return rounded.astype("<u2").tobytes()
        found = np.asarray(values)
        if found.ndim != 1 or found.dtype.kind not in _KINDS[dt.numpy.kind]:
            raise ValueError(f"{datatype} data must be {_WHAT[dt.numpy.kind]}, nested by rows")
        return found.astype(dt.numpy).tobytes()
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{datatype} data: {e}") from None


def _input(i: int, t: Any) -> tuple[pb.InferInputTensor, bytes]:
    if not isinstance(t, dict):
        raise ValueError(f"inputs[{i}] must be an object")
    name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise ValueError(f'inputs[{i}] needs "name" and "datatype" strings')
    if datatype not in DATATYPES:
        raise ValueError(f"input {clip(name)}: unknown datatype {clip(datatype)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f'input {clip(name)}: "shape" must be a list of integers >= 0')
    if len(shape) > MAX_DIMS:
        raise ValueError(
            f'input {clip(name)}: "shape" has {len(shape)} dimensions, at most {MAX_DIMS}'
        )
    values = _flat(t.get("data"))
    count = math.prod(shape)  # at most MAX_DIMS factors
    if len(values) != count:
        raise ValueError(
            f"input {clip(name)}: shape {shape[:8]} holds {count} elements, data has {len(values)}"
        )
    tensor = pb.InferInputTensor(name=name, datatype=datatype, shape=shape)
    return tensor, _raw(datatype, values)


def parse(doc: Any, model: str, version: str) -> pb.ModelInferRequest:
    """The ModelInferRequest a line stands for; ValueError naming what is wrong."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError('a line needs "inputs", a non-empty list of tensors')
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise ValueError('"parameters" must be an object')
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise ValueError('"outputs" must be a list of objects with a "name"')
    msg = pb.ModelInferRequest(model_name=model, model_version=version)
    for i, t in enumerate(inputs):
        tensor, raw = _input(i, t)
        msg.inputs.append(tensor)
        msg.raw_input_contents.append(raw)
    for o in outputs:
        msg.outputs.add(name=o["name"])
    return msg


def _bytes_values(t: Tensor) -> tuple[list[str], bool]:
    data, values, at = bytes(t.data), [], 0
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        values.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    try:
        return [v.decode() for v in values], False
    except UnicodeDecodeError:
        return [base64.b64encode(v).decode() for v in values], True


def _output(t: Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
    dt = DATATYPES[t.datatype]
    if dt.is_bytes:
        out["data"], b64 = _bytes_values(t)
        if b64:
            out["parameters"] = {"content_type": "base64"}
    elif t.datatype == "BF16":
        bits = np.frombuffer(t.data, "<u2").astype("<u4") << 16
        out["data"] = bits.view("<f4")
    else:
        out["data"] = np.frombuffer(t.data, dt.numpy)
    return out


def encode_outputs(custom_id: str, outputs: list[Tensor]) -> bytes:
    """A results line with the outputs, newline included."""
    doc = {"custom_id": custom_id, "outputs": [_output(t) for t in outputs]}
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


def encode_error(custom_id: str | None, code: str, message: str, line: int) -> bytes:
    """A results line with the error, newline included. `line` (1-based) lets a line
    without a custom_id be found in the file."""
    doc: dict[str, Any] = {"custom_id": custom_id, "error": {"code": code, "message": message}}
    if custom_id is None:
        doc["line"] = line
    return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)
