"""Hostile input: hypothesis throws malformed requests at a real server.

Every answer must be a truthful status (OK for a request that happens to be
valid, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED for
a request that set a tiny timeout), never INTERNAL or UNKNOWN; and a
well-formed client running alongside sees no error at all.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchd.client import Client
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos.datatypes import DATATYPES
from tests.servers import ServerProcess

TRUTHFUL = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # the request asked for a queue timeout of a few µs
}
MODELS = ["tiny", "embed", "textpool", "nope", ""]
NAMES = ["INPUT0", "TEXT", "TOKENS", "MASK", "X", ""]
DIMS = st.one_of(
    st.integers(min_value=0, max_value=40),
    st.sampled_from([-1, -(2**63), 2**31, 2**62, 2**63 - 1, 16, 1]),
)
PARAM = st.one_of(
    st.builds(pb.InferParameter, bool_param=st.booleans()),
    st.builds(pb.InferParameter, int64_param=st.integers(-(2**63), 2**63 - 1)),
    st.builds(pb.InferParameter, string_param=st.text(max_size=8)),
    st.builds(pb.InferParameter, double_param=st.floats(allow_nan=True)),
    st.builds(pb.InferParameter, uint64_param=st.integers(0, 2**64 - 1)),
)


@st.composite
def contents(draw: st.DrawFn) -> pb.InferTensorContents:
    c = pb.InferTensorContents()
    for field in draw(
        st.lists(st.sampled_from(["fp32", "int", "int64", "bytes", "bool"]), max_size=2)
    ):
        n = draw(st.integers(0, 40))
        if field == "fp32":
            c.fp32_contents.extend(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)))
        elif field == "int":
            c.int_contents.extend(
                draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
            )
        elif field == "int64":
            c.int64_contents.extend(
                draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
            )
        elif field == "bytes":
            c.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), min_size=n, max_size=n)))
        else:
            c.bool_contents.extend(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return c


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(MODELS)), id=draw(st.text(max_size=4))
    )
    for _ in range(draw(st.integers(0, 3))):
        t = msg.inputs.add(
            name=draw(st.sampled_from(NAMES)),
            datatype=draw(st.sampled_from([*DATATYPES, "FP33", ""])),
            shape=draw(st.lists(DIMS, max_size=4)),
        )
        if draw(st.booleans()):
            t.contents.CopyFrom(draw(contents()))
    for raw in draw(st.lists(st.binary(max_size=300), max_size=3)):
        msg.raw_input_contents.append(raw)
    for key in draw(st.lists(st.sampled_from(["timeout", "priority", "weird"]), max_size=3)):
        msg.parameters[key].CopyFrom(draw(PARAM))
    for name in draw(
        st.lists(st.sampled_from(["OUTPUT0", "EMBEDDING", "LENGTH", "NOPE"]), max_size=2)
    ):
        msg.outputs.add(name=name)
    return msg


SIGNATURES = {
    "tiny": ("INPUT0", "FP32", [16]),
    "embed": ("TEXT", "BYTES", [1]),
    "textpool": ("TOKENS", "INT64", [-1]),
}
MUTATIONS = [
    "name",
    "datatype",
    "dim",
    "batch",
    "truncate",
    "extend",
    "typed",
    "mixed",
    "typed_count",
    "drop",
    "duplicate",
    "output",
    "param",
    "bytes_cut",
]


@st.composite
def near_valid(draw: st.DrawFn) -> pb.ModelInferRequest:  # noqa: C901 - one branch per mutation
    """A correct request for a real model, then 0-3 targeted mutations: the
    deep validation paths (sizes, shapes, framing, forms) get exercised."""
    model = draw(st.sampled_from(list(SIGNATURES)))
    name, datatype, dims = SIGNATURES[model]
    rows = draw(st.integers(1, 70))
    shape = [rows] + [d if d != -1 else draw(st.integers(1, 12)) for d in dims]
    count = int(np.prod(shape))
    if datatype == "BYTES":
        values = [draw(st.binary(max_size=6)) for _ in range(count)]
        raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
    else:
        raw = np.zeros(count, DATATYPES[datatype].numpy).tobytes()
    msg = pb.ModelInferRequest(model_name=model)
    t = msg.inputs.add(name=name, datatype=datatype, shape=shape)
    msg.raw_input_contents.append(raw)
    for m in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
        if m == "name":
            t.name = draw(st.sampled_from(NAMES))
        elif m == "datatype":
            t.datatype = draw(st.sampled_from([*DATATYPES, "fp32", ""]))
        elif m == "dim" and len(t.shape) > 1:
            t.shape[draw(st.integers(1, len(t.shape) - 1))] = draw(DIMS)
        elif m == "batch":
            t.shape[0] = draw(DIMS)
        elif m == "truncate" and msg.raw_input_contents:
            msg.raw_input_contents[0] = msg.raw_input_contents[0][: draw(st.integers(0, len(raw)))]
        elif m == "extend" and msg.raw_input_contents:
            msg.raw_input_contents[0] += draw(st.binary(min_size=1, max_size=9))
        elif m in ("typed", "typed_count", "mixed"):
            if m != "mixed":
                del msg.raw_input_contents[:]
            n = count + (draw(st.sampled_from([-1, 1])) if m == "typed_count" else 0)
            t.contents.CopyFrom(pb.InferTensorContents())
            t.contents.int64_contents.extend([1] * max(0, min(n, 5000)))
            t.contents.fp32_contents.extend([0.5] * max(0, min(n, 5000)))
        elif m == "drop":
            del msg.inputs[:]
        elif m == "duplicate":
            msg.inputs.add().CopyFrom(t)
            msg.raw_input_contents.append(raw)
        elif m == "output":
            msg.outputs.add(name=draw(st.sampled_from(["OUTPUT0", "EMBEDDING", "NOPE"])))
        elif m == "param":
            msg.parameters[draw(st.sampled_from(["timeout", "priority"]))].CopyFrom(draw(PARAM))
        elif m == "bytes_cut" and datatype == "BYTES" and msg.raw_input_contents:
            msg.raw_input_contents[0] = msg.raw_input_contents[0][:-1]
    return msg


@pytest.fixture(scope="module")
def bystander(example_server: ServerProcess) -> Iterator[list[BaseException]]:
    """A well-formed client calling `tiny` in a loop for the whole module."""
    errors: list[BaseException] = []
    stop = threading.Event()
    calls = [0]

    def loop() -> None:
        x = np.ones((2, 16), np.float32)
        with Client(example_server.url) as c:
            while not stop.is_set():
                try:
                    assert c.infer("tiny", x, timeout=30)["OUTPUT0"].shape == (2, 16)
                    calls[0] += 1
                except BaseException as e:  # every failure is the finding
                    errors.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield errors
    stop.set()
    thread.join(30)
    assert calls[0] > 0


@pytest.fixture(scope="module")
def stub(example_server: ServerProcess) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(example_server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@settings(
    max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(msg=st.one_of(requests(), near_valid()))
def test_malformed_requests_get_truthful_codes(stub, bystander, msg: pb.ModelInferRequest) -> None:  # type: ignore[no-untyped-def]
    try:
        stub.ModelInfer(msg, timeout=30)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    assert code in TRUTHFUL, f"{code}: {details}\n{msg}"
    assert not bystander, bystander[:3]


def test_bystander_saw_no_error(bystander: list[BaseException]) -> None:
    assert not bystander, bystander[:3]


@settings(
    max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "400")) // 4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(wire=st.binary(max_size=64))
def test_bytes_that_may_not_parse_get_truthful_codes(
    example_server: ServerProcess, wire: bytes
) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(example_server.url) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=bytes,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        try:
            call(wire, timeout=30)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
    assert code in TRUTHFUL, f"{code}: {details}\n{wire!r}"


UNDECODABLE = b"\x0a\x02\xff\xfe"  # model_name: bytes that are not UTF-8


def test_a_message_that_does_not_parse_is_answered_invalid_argument_and_logged_by_none(
    example_server: ServerProcess,
) -> None:
    with grpc.insecure_channel(example_server.url) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=bytes,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(UNDECODABLE, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "a message of 4 bytes that does not parse as inference.ModelMetadataRequest: Error "
        "parsing message with type 'inference.ModelMetadataRequest': String field had bad UTF-8"
    )
    assert "DecodeError" not in example_server.log()  # grpc's own answer logs a traceback


def test_a_stream_answers_a_message_that_does_not_parse_and_goes_on(
    example_server: ServerProcess,
) -> None:
    def good(i: int) -> bytes:
        return pb.ModelInferRequest(
            model_name="tiny",
            id=f"good-{i}",
            inputs=[pb.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 16])],
            raw_input_contents=[np.ones(16, np.float32).tobytes()],
        ).SerializeToString()

    with grpc.insecure_channel(example_server.url) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=bytes,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        out = list(stream(iter([good(1), UNDECODABLE, good(2)]), timeout=30))
    answered = sorted(r.infer_response.id for r in out if not r.error_message)
    failed = [r for r in out if r.error_message]
    assert answered == ["good-1", "good-2"]
    assert len(failed) == 1
    assert failed[0].error_message.startswith("a message of 4 bytes that does not parse")
    assert failed[0].infer_response.parameters["error_code"].string_param == "INVALID_ARGUMENT"
