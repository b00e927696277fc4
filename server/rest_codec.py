"""KServe v2 REST bodies <-> the gRPC messages and tensors: pure functions, no I/O.

An HTTP inference request becomes the same ModelInferRequest a gRPC client would
send (every input in raw form), so it meets the same validation (codec.py), the
same limits and the same messages. JSON `data` is turned into raw bytes a whole
tensor at a time (json_data.py); Triton's binary tensor extension is taken as it
is: the first `Inference-Header-Content-Length` bytes are the JSON header and
each input with a `binary_data_size` parameter takes its bytes from what
follows, in order.

Every rejection is InvalidInput naming the field, what was expected and what came,
quoting at most a short prefix (errors.clip). The work is linear in the body.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

import orjson

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import ModelConfig
from batchd.protos.tensors import MAX_DIMS, bounded_count, set_parameter
from batchd.server.codec import check_inputs, fixed_output_bytes, refuse_unserved
from batchd.server.config import Limits
from batchd.server.errors import CLIP_ITEMS, InvalidInput, ResponseTooLarge, clip
from batchd.server.json_body import MAX_JSON_BYTES, load_json
from batchd.server.json_body import json_kind as _kind
from batchd.server.json_data import flatten, json_safe, number, to_raw, values
from batchd.server.request import Tensor

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_DIM = 1 << 62  # a shape dimension beyond this cannot be an int64 of a real tensor
# The parameters of each object of a request, and its outputs (or its model's, if more):
# more are refused before any is read (gRPC's protobuf parses them in C++; these are walked
# in Python, and 600,000 request parameters held the loop ~0.7 s, then were served).
MAX_LISTED = 256


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


def _parameters(target: Any, params: dict[str, Any], where: str, skip: Iterable[str] = ()) -> None:
    _at_most(len(params), "parameters", where)
    for key, value in params.items():
        if key not in skip and not set_parameter(target[key], value):
            raise InvalidInput(
                f"{where}, parameter {clip(key)}: a boolean, number or string, got {_kind(value)}"
            )


def _at_most(count: int, what: str, where: str, most: int = MAX_LISTED) -> None:
    if count > most:
        raise InvalidInput(f"{where} has {count} {what}, at most {most}")


def _flag(params: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """A boolean parameter (binary_data, binary_data_output): another kind is refused,
    as Triton refuses it, not read as false."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"{where}: parameter '{key}' must be true or false, got {_kind(value)}")
    return value


class Wanted:
    """Which outputs a REST caller wants in binary form."""

    __slots__ = ("default", "named")

    def __init__(self, default: bool, named: dict[str, bool]) -> None:
        self.default, self.named = default, named

    def binary(self, name: str) -> bool:
        return self.named.get(name, self.default)

    def heavy(self, response: pb.ModelInferResponse, json_bytes: int, all_bytes: int) -> bool:
        """Whether writing `response` is work for off the loop: the outputs it writes as
        JSON pass `json_bytes` of raw data, or all of them `all_bytes` (copied whole)."""
        pairs = list(zip(response.outputs, response.raw_output_contents, strict=False))
        as_json = sum(len(raw) for t, raw in pairs if not self.binary(t.name))
        return as_json > json_bytes or sum(len(raw) for _, raw in pairs) > all_bytes


def parse_infer(
    body: bytes,
    header_length: int | None,
    model: str,
    version: str,
    limits: Limits,
    outputs: int = MAX_LISTED,
) -> tuple[pb.ModelInferRequest, Wanted]:
    """A v2 REST inference body (JSON, or JSON + binary tensors) -> ModelInferRequest;
    `outputs`: at most how many it may ask for (its model's number, or MAX_LISTED)."""
    size = len(body)
    if header_length is None:
        header_length = size
    elif header_length == 0:
        raise InvalidInput(f"{HEADER_LENGTH} 0 asks for Triton's raw binary request (the body "
                           "as the one input's bytes), which batchd does not serve; send the "
                           "JSON header first and its length")  # fmt: skip
    elif not 0 <= header_length <= size:
        raise InvalidInput(f"{HEADER_LENGTH} is {header_length}, but the body holds {size} bytes")
    head = load_json(memoryview(body)[:header_length], "the inference header")
    return request_from(head, memoryview(body)[header_length:], model, version, limits, outputs)


def request_from(
    head: dict[str, Any],
    binary: memoryview,
    model: str,
    version: str,
    limits: Limits,
    outputs: int = MAX_LISTED,
) -> tuple[pb.ModelInferRequest, Wanted]:
    """A v2 JSON request (parsed) and the binary tensors after it -> ModelInferRequest
    (also a batch job's line, jobs/lines.py); more inputs than `limits` allow, or more
    outputs than `outputs` (or MAX_LISTED), are refused before any is read."""
    msg = pb.ModelInferRequest(
        model_name=model, model_version=version, id=_field(head, "id", str, "the request", "")
    )
    params = _field(head, "parameters", dict, "the request", {})
    _parameters(msg.parameters, params, "the request", skip=("binary_data_output",))
    at, inputs = 0, _field(head, "inputs", list, "the request", [])
    check_inputs(len(inputs), limits)
    for i, item in enumerate(inputs):
        at = _input(msg, i, item, binary, at)
    if at != len(binary):
        raise InvalidInput(
            f"the body holds {len(binary)} bytes after the header; the inputs' "
            f"binary_data_size parameters add up to {at}"
        )
    default = _flag(params, "binary_data_output", "the request", False)
    return msg, _wanted(msg, head, default, max(outputs, MAX_LISTED))


def _input(msg: pb.ModelInferRequest, i: int, item: Any, binary: memoryview, at: int) -> int:
    """Add input `i` to `msg`; returns where the next binary input starts."""
    if not isinstance(item, dict):
        raise InvalidInput(f"input {i}: expected an object, got {_kind(item)}")
    name = _field(item, "name", str, f"input {i}", "")
    where = f"input {clip(name)}"
    datatype = _field(item, "datatype", str, where, "")
    shape = _shape(_field(item, "shape", list, where, []), where)
    params = _field(item, "parameters", dict, where, {})
    _at_most(len(params), "parameters", where)
    refuse_unserved("input", name, params)
    size = params.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:
            raise InvalidInput(
                f"{where}: binary_data_size must be a non-negative integer, got {_kind(size)} "
                f"{clip(str(size))}"
            )
        if at + size > len(binary):
            raise InvalidInput(
                f"{where}: binary_data_size {number(size)} does not fit the "
                f"{len(binary) - at} binary bytes left after the header"
            )
        raw = bytes(binary[at : at + size])
        at += size
    elif "data" in item:
        values, _ = flatten(item["data"], where)
        if len(values) != math.prod(shape):
            raise InvalidInput(
                f"{where}: shape {shape[:8]} needs {number(math.prod(shape))} values, "
                f"'data' holds {len(values)}"
            )
        raw = to_raw(datatype, values, where)
    else:
        raise InvalidInput(f"{where}: needs 'data' or a binary_data_size parameter")
    msg.inputs.add(name=name, datatype=datatype, shape=shape)
    msg.raw_input_contents.append(raw)
    return at


def _wanted(msg: pb.ModelInferRequest, head: dict[str, Any], default: bool, most: int) -> Wanted:
    named: dict[str, bool] = {}
    outputs = _field(head, "outputs", list, "the request", [])
    _at_most(len(outputs), "outputs", "the request", most)
    for i, item in enumerate(outputs):
        if not isinstance(item, dict):
            raise InvalidInput(f"output {i}: expected an object, got {_kind(item)}")
        name = _field(item, "name", str, f"output {i}", "")
        params = _field(item, "parameters", dict, f"output {clip(name)}", {})
        _at_most(len(params), "parameters", f"output {clip(name)}")
        refuse_unserved("output", name, params)
        named[name] = _flag(params, "binary_data", f"output {clip(name)}", default)
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


def _json_room(in_json: Sequence[Tensor], size: int | None = None, would: str = "") -> None:
    """Tensors written as JSON hold the GIL while orjson writes them, and grow about 3x:
    at most MAX_JSON_BYTES of them, as of a request's JSON."""
    if (size := sum(len(t.data) for t in in_json) if size is None else size) > MAX_JSON_BYTES:
        raise ResponseTooLarge(
            f"the answer's JSON outputs {would or 'hold'} {size} bytes of tensors, more than "
            f"{MAX_JSON_BYTES}: ask for them in binary form (binary_data_output)"
        )


def json_room(msg: pb.ModelInferRequest, cfg: ModelConfig, wanted: Wanted) -> None:
    """Refuse, before the model runs, a request whose JSON outputs its model's signature
    makes too large (_json_room; one whose size the model decides is checked once made)."""
    asked = [o.name for o in msg.outputs] or cfg.output_names
    size, _ = fixed_output_bytes(cfg, [n for n in asked if not wanted.binary(n)], _rows(msg, cfg))
    _json_room((), size, "would hold")


def _rows(msg: pb.ModelInferRequest, cfg: ModelConfig) -> int:
    """The rows the first input declares; 0 where its data cannot fill its shape, or
    where they are more than the model queues ([2**40, 0] fills 0 bytes), which decoding
    refuses saying so (it was told to ask for binary outputs of 2**40 rows)."""
    if not (cfg.batches and msg.inputs and msg.inputs[0].shape):
        return 1
    shape, raw = msg.inputs[0].shape, msg.raw_input_contents
    dt = DATATYPES.get(msg.inputs[0].datatype)
    most = len(raw[0]) // max(dt.itemsize, 1) if dt is not None and raw else 0
    fills = min(shape) >= 0 and bounded_count(shape, most) <= most
    return shape[0] if fills and shape[0] <= cfg.max_batch_size * cfg.batching.max_queue_size else 0


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
