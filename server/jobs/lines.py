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
from typing import Any, BinaryIO

import orjson

from batchd.protos import inference_pb2 as pb
from batchd.protos.tensors import deserialize_bytes
from batchd.server import json_data, rest_codec
from batchd.server.config import Limits
from batchd.server.errors import InvalidInput, clip
from batchd.server.json_body import json_kind, with_nan
from batchd.server.request import Tensor

MAX_CUSTOM_ID_CHARS = 512
# The longest line read: parsed, a line of numbers takes ~16x its size in Python
# objects, so this bounds one line's memory (~130 MB); longer lines are error lines.
MAX_LINE_BYTES = 8 * 1024 * 1024
# The numpy kinds a JSON list may parse to, per kind of the input's dtype: an
# integer input takes no 1.5, a boolean one only true and false.
_KINDS = {"b": "b", "u": "ui", "i": "ui", "f": "uif"}
_WHAT = {"b": "true or false", "u": "integers", "i": "integers", "f": "numbers"}


class LineError(Exception):
    """A line that is no request: its custom_id when it had one, and why (raised by
    request_of, and kept as the line's answer)."""

    def __init__(self, custom_id: str | None, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(custom_id, message, code)
        self.custom_id, self.message, self.code = custom_id, message, code


def custom_id_of(doc: Any) -> str:
    """The line's custom_id; ValueError when it has none or a bad one."""
    if not isinstance(doc, dict):
        raise ValueError(f"a line must be a JSON object, got {json_kind(doc)}")
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        got = "none" if "custom_id" not in doc else json_kind(cid) if cid != "" else '""'
        raise ValueError(f'a line needs "custom_id", a non-empty string, got {got}')
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
    """The JSON document of one line; ValueError naming the problem. NaN and Infinity
    are read, as on HTTP (json_body.load_json), and as results write them: a line of
    Python's json.dumps was an error line with its custom_id lost."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            doc = with_nan(line, "the line")
        except InvalidInput as refused:
            raise ValueError(refused.message) from None
        if doc is not None:
            return doc
        start = clip(line[:40].decode("utf-8", "replace").rstrip())
        raise ValueError(f"not JSON ({e}); the line starts {start}") from None


def parse(doc: Any, model: str, version: str, limits: Limits,
          outputs: int = rest_codec.MAX_LISTED) -> pb.ModelInferRequest:  # fmt: skip
    """The ModelInferRequest a line stands for; ValueError naming what is wrong."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError('a line needs "inputs", a non-empty list of tensors')
    if not isinstance(doc.get("parameters", {}), dict):
        raise ValueError('"parameters" must be an object')
    # The HTTP edge's own parser: a line is a v2 JSON request. Its parameters are not
    # applied: a job's requests have no deadline and their own lane.
    head = {k: doc[k] for k in ("inputs", "outputs") if k in doc}
    try:
        msg, _ = rest_codec.request_from(head, memoryview(b""), model, version, limits, outputs)
    except InvalidInput as e:
        raise ValueError(e.message) from None
    return msg


def request_of(
    line: bytes, model: str, version: str, limits: Limits, outputs: int = rest_codec.MAX_LISTED
) -> tuple[str, pb.ModelInferRequest]:
    """(custom_id, request) of a line; LineError (with the custom_id, when it had one) naming
    what is wrong. Called by chunks.decode through parser.run: in the JSON parser process
    for a long line."""
    cid: str | None = None
    try:
        doc = load(line)
        cid = custom_id_of(doc)
        return cid, parse(doc, model, version, limits, outputs)
    except ValueError as e:
        raise LineError(cid, str(e)) from None


def _output(t: Tensor) -> dict[str, Any]:
    """An output as v2 JSON (rest_codec's form); BYTES that are not UTF-8 as base64, since
    a results line cannot be refused after the model ran."""
    out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
    try:
        out["data"] = json_data.json_safe(json_data.values(t))
    except InvalidInput:
        raw = deserialize_bytes(t.data, (math.prod(t.shape),))
        out["data"] = [base64.b64encode(v).decode() for v in raw]
        out["parameters"] = {"content_type": "base64"}
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
