"""A property-based fuzzer over the frontend's request path as pure functions:
decode_request -> split_request -> join_inputs -> (a fake worker) ->
split_outputs -> join_results -> encode_response.

Hypothesis generates shapes, datatypes, BYTES framings, raw and typed contents
(and both at once), parameters and output lists, near-valid and not, for
models with every datatype, BYTES, ragged inputs with ragged_like outputs, and
no batch dim. Every example must:

  * be refused with InvalidInput only (nothing else escapes, so nothing becomes
    INTERNAL), with a message of bounded length whatever the request's size;
  * cost work linear in its size: the Python lines batchd runs for it (counted
    with a tracer, so the bound is exact and no timing decides it) stay under a
    constant plus a few lines per byte of the message and per chunk it makes;
  * when valid, come back whole: what an echoing worker returns reaches the
    response byte for byte, and the response is never larger than what the
    worker produced for it.

`make test` runs FUZZ_EXAMPLES examples (default 300); `make fuzz` runs 20,000.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import batchd.protos
import batchd.server
from batchd.protos import inference_pb2 as pb
from batchd.protos import wire
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import ModelConfig, TensorSpec, load_model_config
from batchd.protos.tensors import bytes_row_offsets, contents_to_raw
from batchd.server.batching.split_join import (
    join_inputs,
    join_results,
    split_outputs,
    split_request,
)
from batchd.server.codec import Limits, decode_request, encode_response
from batchd.server.errors import InvalidInput
from batchd.server.json_data import json_safe
from batchd.server.request import Request, Tensor
from tests.servers import EXAMPLES, TEST_MODELS

EXAMPLES_N = int(os.environ.get("FUZZ_EXAMPLES", "300"))
LIMITS = Limits(max_inputs=16, max_tensor_elements=4096, max_response_bytes=1 << 20)
FLAT = ModelConfig(  # no batch dim: every request is one batch of its own
    name="flat",
    directory=TEST_MODELS,
    artifact=TEST_MODELS / "model.py",
    platform="python",
    max_batch_size=0,
    inputs=(TensorSpec("S", "BYTES", (-1,)), TensorSpec("F", "FP16", (2, -1))),
    outputs=(TensorSpec("S_OUT", "BYTES", (-1,)), TensorSpec("F_OUT", "FP16", (2, -1))),
)
MODELS = {
    "echo": load_model_config(TEST_MODELS / "echo"),  # every datatype; BYTES [-1]
    "fifo": load_model_config(TEST_MODELS / "fifo"),  # ragged, mask, ragged_like, tokens
    "embed": load_model_config(EXAMPLES / "embed"),  # BYTES [1] -> two outputs
    "flat": FLAT,
}
LONG = "x" * 100_000  # a name far longer than any error may quote
MAX_MESSAGE_CHARS = 1000


# ---- work, counted ----

# Where the imported code is: the checkout, or a link to it (`batchd` -> it, on a GPU machine).
_OURS = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (batchd.protos, batchd.server))


def lines_run(fn: Callable[[], Any]) -> tuple[int, Any]:
    """How many lines of batchd's own code `fn()` runs, and its result (or error)."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(_OURS) else None

    sys.settrace(calls)
    try:
        result: Any = fn()
    except Exception as e:  # the caller judges it
        result = e
    finally:
        sys.settrace(None)
    return count, result


# ---- requests ----

DIMS = st.one_of(
    st.integers(0, 12), st.sampled_from([-1, -(2**63), 2**31, 2**62, 2**63 - 1, 100_000])
)
PARAM = st.one_of(
    st.builds(pb.InferParameter, bool_param=st.booleans()),
    st.builds(pb.InferParameter, int64_param=st.integers(-(2**63), 2**63 - 1)),
    st.builds(pb.InferParameter, string_param=st.text(max_size=8)),
    st.builds(pb.InferParameter, uint64_param=st.integers(0, 2**64 - 1)),
)


def _values(draw: st.DrawFn, datatype: str, count: int) -> list[Any]:
    if datatype == "BYTES":
        return [draw(st.binary(max_size=5)) for _ in range(count)]
    if datatype == "BOOL":
        return [draw(st.booleans()) for _ in range(count)]
    if datatype.startswith("FP"):
        return [draw(st.floats(width=32, allow_nan=True)) for _ in range(count)]
    info = np.iinfo(DATATYPES[datatype].numpy) if datatype != "BF16" else np.iinfo(np.uint16)
    return [draw(st.integers(int(info.min), int(info.max))) for _ in range(count)]


def _bytes_framing(draw: st.DrawFn, values: list[bytes], odd: bool) -> bytes:
    """BYTES elements, length-prefixed, (`odd`) sometimes with a lying prefix or cut short."""
    parts = []
    for v in values:
        n = len(v)
        if odd and draw(st.integers(0, 30)) == 0:
            n = draw(st.sampled_from([n + 1, max(0, n - 1), 2**32 - 1, 2**31]))
        parts.append(n.to_bytes(4, "little") + v)
    raw = b"".join(parts)
    cut = draw(st.sampled_from([None, None, None, 1, 3, -1, -3])) if odd else None
    return raw[:cut] if cut is not None else raw


def _shape(
    draw: st.DrawFn, spec: TensorSpec, model: ModelConfig, rows: int, odd: bool
) -> list[int]:
    dims = [d if d != -1 else draw(st.integers(0 if not spec.ragged else 1, 7)) for d in spec.shape]
    shape = [rows, *dims] if model.batches else dims
    if not odd:
        return shape
    if draw(st.integers(0, 15)) == 0 and shape:
        shape[draw(st.integers(0, len(shape) - 1))] = draw(DIMS)
    if draw(st.integers(0, 30)) == 0:
        shape = draw(st.lists(DIMS, max_size=5))
    return shape


def _input(draw: st.DrawFn, msg: pb.ModelInferRequest, spec: TensorSpec, shape: list[int],
           raw: bool, odd: bool) -> None:  # fmt: skip
    """One input, exactly as declared, or (`odd`) now and then wrong in some way."""
    datatype, name = spec.datatype, spec.name
    if odd and draw(st.integers(0, 20)) == 0:
        datatype = draw(st.sampled_from(sorted(DATATYPES)))
    if odd and draw(st.integers(0, 25)) == 0:
        name = draw(st.sampled_from(["NOPE", "", LONG]))
    t = msg.inputs.add(name=name, datatype=datatype, shape=shape)
    count = math.prod(shape) if 0 <= math.prod(shape) <= 512 else draw(st.integers(0, 64))
    if odd:
        count += draw(st.sampled_from([0] * 8 + [-1, 1]))
    values = _values(draw, datatype, max(0, count))
    dt = DATATYPES[datatype]
    if raw:
        with np.errstate(all="ignore"):  # a float too large for FP16 becomes inf: fine
            data = (
                _bytes_framing(draw, values, odd)
                if dt.is_bytes
                else np.asarray(values, dt.numpy if datatype != "BF16" else np.uint16).tobytes()
            )
        msg.raw_input_contents.append(data)
        if odd and draw(st.integers(0, 30)) == 0:
            t.contents.int64_contents.append(1)  # raw and typed at once
    elif dt.contents_field is not None:
        field = dt.contents_field
        if odd and draw(st.integers(0, 20)) == 0:
            field = draw(st.sampled_from(["fp32_contents", "bytes_contents", "int_contents"]))
        if field == "bytes_contents":
            values = [bytes(v) if isinstance(v, bytes) else b"v" for v in values]
        elif field != dt.contents_field:
            values = [0] * len(values)
        getattr(t.contents, field).extend(values)


@st.composite
def requests(draw: st.DrawFn) -> tuple[ModelConfig, pb.ModelInferRequest]:
    model = MODELS[draw(st.sampled_from(sorted(MODELS)))]
    msg = pb.ModelInferRequest(model_name=model.name, id=draw(st.sampled_from(["", "r1", LONG])))
    rows = draw(st.integers(1, 40))
    odd = draw(st.booleans())  # else: exactly as declared, so about half are answered
    # Typed contents where every input has a typed field (not echo's FP16 and BF16).
    raw = draw(st.booleans()) or (model.name == "echo" and not odd)
    specs = list(model.inputs)
    if odd and draw(st.integers(0, 20)) == 0:
        specs = specs[:-1]  # one missing
    if odd and draw(st.integers(0, 20)) == 0:
        specs.append(specs[0] if specs else model.inputs[0])  # one twice
    for spec in specs:
        _input(draw, msg, spec, _shape(draw, spec, model, rows, odd), raw, odd)
    if odd and msg.raw_input_contents and draw(st.integers(0, 25)) == 0:
        msg.raw_input_contents.append(b"extra")
    names = [o.name for o in model.outputs] + (["NOPE", LONG] if odd else [])
    chosen = draw(st.lists(st.sampled_from(names), max_size=len(model.outputs) + int(odd)))
    for name in chosen if odd else dict.fromkeys(chosen):
        msg.outputs.add(name=name)
    keys = ["timeout", "priority", "other"] if odd else ["other"]
    for key in draw(st.lists(st.sampled_from(keys), max_size=3)):
        msg.parameters[key].CopyFrom(draw(PARAM))
    return model, msg


# ---- a worker that echoes ----


def _echo_worker(model: ModelConfig, batch: list[Request]) -> tuple[list[wire.Tensor], list[bytes]]:
    """What a worker would send back for `batch`: each output from its input
    (echo's OUT_x from IN_x, fifo's ECHO from the padded TOKENS, S_OUT/F_OUT from
    S/F), zeros for the rest, BYTES with their row offsets."""
    headers, frames = join_inputs(batch)
    by_name = {h.name: (h, f) for h, f in zip(headers, frames, strict=True)}
    rows = sum(r.rows for r in batch)
    out_h, out_f = [], []
    for spec in model.outputs:
        source = {"ECHO": "TOKENS", "S_OUT": "S", "F_OUT": "F"}.get(
            spec.name, spec.name.replace("OUT_", "IN_")
        )
        if source in by_name:
            h, f = by_name[source]
            shape, data = list(h.shape), bytes(memoryview(f).cast("B"))
        else:
            dims = [1 if d == -1 else d for d in spec.shape]
            shape = [rows, *dims]
            data = np.zeros(shape, DATATYPES[spec.datatype].numpy).tobytes()
        t = wire.Tensor(name=spec.name, datatype=spec.datatype, shape=shape)
        if spec.datatype == "BYTES" and model.batches:
            t.row_offsets.extend(bytes_row_offsets(data, shape[0], math.prod(shape[1:])).tolist())
        out_h.append(t)
        out_f.append(data)
    return out_h, out_f


def _serve(request: Request) -> tuple[list[Tensor], int]:
    """The request's chunks, each batched alone, echoed, split and joined: its
    results, and how many bytes the worker produced for its rows."""
    model = request.model
    per_batch = model.rows_per_batch(request.length)
    chunks = split_request(request, per_batch) if request.rows > per_batch else [request]
    parts, produced = [], 0
    for chunk in chunks:
        headers, frames = _echo_worker(model, [chunk])
        (results,) = split_outputs([chunk], headers, frames)
        parts.append(results)
        produced += sum(len(t.data) for t in results if t.name in request.outputs)
    return (join_results(parts) if len(parts) > 1 else parts[0]), produced


def _round_trip(model: ModelConfig, msg: pb.ModelInferRequest) -> Any:
    try:
        request = decode_request(msg, model, now=0.0, limits=LIMITS)
    except InvalidInput as e:
        return e
    results, produced = _serve(request)
    return request, encode_response(request, results, LIMITS.max_response_bytes), produced


@settings(
    max_examples=EXAMPLES_N,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=requests())
def test_the_request_path_refuses_cleanly_costs_linearly_and_round_trips(
    case: tuple[ModelConfig, pb.ModelInferRequest],
) -> None:
    model, msg = case
    work, outcome = lines_run(lambda: _round_trip(model, msg))
    if isinstance(outcome, Exception):
        assert isinstance(outcome, InvalidInput), repr(outcome)
        event("refused")
        assert len(outcome.message) <= MAX_MESSAGE_CHARS, outcome.message[:200]
        assert work <= 400 + 3 * msg.ByteSize(), (work, msg.ByteSize())
        return
    request, response, produced = outcome
    event(f"answered: {model.name}")
    chunks = -(-request.rows // model.rows_per_batch(request.length))
    assert work <= 600 + 4 * msg.ByteSize() + 150 * chunks, (work, msg.ByteSize(), chunks)
    assert sum(len(b) for b in response.raw_output_contents) <= produced
    assert [o.name for o in response.outputs] == list(request.outputs)
    sent = {t.name: t for t in request.inputs}
    for out, data in zip(response.outputs, response.raw_output_contents, strict=True):
        source = {"ECHO": "TOKENS", "S_OUT": "S", "F_OUT": "F"}.get(
            out.name, out.name.replace("OUT_", "IN_")
        )
        if source in sent and source != "TOKENS":
            assert data == bytes(sent[source].data), out.name
            assert tuple(out.shape) == sent[source].shape


def test_the_work_counter_sees_a_quadratic_split() -> None:
    """The linearity bound above can fail: a split that walked the BYTES buffer
    once per chunk (the bug issue 15 found) runs far more lines than it allows."""
    model = MODELS["embed"]
    n = 4096
    raw = b"\0\0\0\0\1\0\0\0a" * (n // 2)  # "", "a", ...: not one length, walked in Python
    msg = pb.ModelInferRequest(model_name="embed", raw_input_contents=[raw])
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=[n, 1])
    request = decode_request(msg, model, now=0.0)

    def walk_per_chunk() -> None:
        for start in range(0, n, 64):
            bytes_row_offsets(request.inputs[0].data, n, 1)[start]

    linear, _ = lines_run(lambda: split_request(request, 64))
    quadratic, _ = lines_run(walk_per_chunk)
    bound = 600 + 4 * msg.ByteSize() + 150 * (n // 64)
    assert linear <= bound < quadratic


def test_messages_quote_a_short_prefix_of_long_names() -> None:
    model = MODELS["embed"]
    for name, datatype, shape in (
        (LONG, "BYTES", [1, 1]),
        ("TEXT", LONG, [1, 1]),
        ("TEXT", "BYTES", list(range(1, 5000))),
    ):
        msg = pb.ModelInferRequest(model_name="embed")
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        with pytest.raises(InvalidInput) as e:
            decode_request(msg, model, now=0.0)
        assert len(e.value.message) < 300, e.value.message[:300]
        assert "characters)" in e.value.message or "items)" in e.value.message


def test_requested_outputs_are_unique() -> None:
    model = MODELS["embed"]
    raw = len(b"hi").to_bytes(4, "little") + b"hi"
    msg = pb.ModelInferRequest(model_name="embed", raw_input_contents=[raw])
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1])
    msg.outputs.add(name="LENGTH")
    msg.outputs.add(name="LENGTH")
    with pytest.raises(InvalidInput, match=r"\['LENGTH'\] requested more than once"):
        decode_request(msg, model, now=0.0)
    for _ in range(3000):
        msg.outputs.add(name="EMBEDDING")
    work, outcome = lines_run(lambda: decode_request(msg, model, now=0.0))
    assert isinstance(outcome, InvalidInput) and "asks for 3002 outputs" in outcome.message
    assert work < 100  # refused from the count, before any name is read


@settings(max_examples=EXAMPLES_N, deadline=None)
@given(
    datatype=st.sampled_from(["UINT8", "UINT16", "INT8", "INT16"]),
    data=st.data(),
)
def test_narrow_typed_contents_are_refused_out_of_range_and_exact_in_it(
    datatype: str, data: st.DataObject
) -> None:
    """Any values a 32-bit contents field carries: out of the datatype's range, refused
    naming an extreme that is out; in it, the very values (never wrapped)."""
    info = np.iinfo(DATATYPES[datatype].numpy)
    contents = pb.InferTensorContents()
    field = contents.uint_contents if info.kind == "u" else contents.int_contents
    low, high = (0, 2**32 - 1) if info.kind == "u" else (-(2**31), 2**31 - 1)
    near = st.integers(max(low, int(info.min) - 2), int(info.max) + 2)
    field.extend(data.draw(st.lists(st.one_of(near, st.integers(low, high)))))
    sent = list(field)
    outside = [v for v in sent if not info.min <= v <= info.max]
    try:
        raw = contents_to_raw(datatype, field)
    except ValueError as e:
        assert outside, e
        assert str(e).startswith(f"{datatype} holds {info.min} to {info.max}, got ")
        assert int(str(e).rsplit(" ", 1)[1]) in (min(outside), max(outside))
        return
    assert not outside, outside[:4]
    assert raw == np.array(sent, info.dtype).tobytes()


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["<f2", "<f4", "<f8"]).flatmap(
        lambda dt: st.tuples(
            st.just(dt),
            st.lists(
                st.floats(width=8 * np.dtype(dt).itemsize, allow_nan=True, allow_infinity=True),
                max_size=50,
            ),
        )
    )
)
def test_json_safe_spells_every_value_that_is_not_finite_where_it_stood(
    case: tuple[str, list[float]],
) -> None:
    """Arrays holding NaN or Infinity are written by orjson, each null (one of them)
    then spelled as Python's json writes it (review 57a: Python's json wrote them all,
    one value at a time); read back, every value is what it was, in its place."""
    dt, numbers = case
    arr = np.array(numbers, dt)
    text = orjson.dumps({"data": json_safe(arr)}, option=orjson.OPT_SERIALIZE_NUMPY)
    back = np.array(json.loads(text)["data"], dt)
    assert back.shape == arr.shape and np.array_equal(back, arr, equal_nan=True)
    assert b"null" not in text
