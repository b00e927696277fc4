"""The frontend's codec as pure functions: ModelInferRequest -> Request -> response.

Over gRPC, test_serving checks the error messages; here, the shortcuts the hot
path takes: a request that names no outputs, outputs in the order asked, and
shapes with variable dimensions."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc

import grpc
import numpy as np
import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos.model_config import ModelConfig, load_model_config
from batchd.server.batching.split_join import split_request
from batchd.server.codec import decode_request, encode_response, fixed_output_bytes
from batchd.server.config import Limits
from batchd.server.errors import MAX_DETAILS_CHARS, InvalidInput, ResponseTooLarge, details
from batchd.server.request import Tensor
from tests.servers import EXAMPLES, TEST_MODELS

EMBED = load_model_config(EXAMPLES / "embed")  # TEXT BYTES [1] -> EMBEDDING FP32 [64], LENGTH
TEXTPOOL = load_model_config(EXAMPLES / "textpool")  # TOKENS INT64 [-1], ragged
TINY = load_model_config(EXAMPLES / "tiny")  # INPUT0 FP32 [16]
ECHO = load_model_config(TEST_MODELS / "echo")  # IN_<datatype> [3] for every datatype


def _text_request(*outputs: str) -> pb.ModelInferRequest:
    raw = len(b"hi").to_bytes(4, "little") + b"hi"
    msg = pb.ModelInferRequest(model_name="embed", raw_input_contents=[raw])
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1])
    for name in outputs:
        msg.outputs.add(name=name)
    return msg


def _results() -> list[Tensor]:
    """What the worker returns for one row of embed: its outputs in declared order."""
    embedding = np.zeros((1, 64), np.float32)
    length = np.array([[2]], np.int64)
    return [
        Tensor("EMBEDDING", "FP32", (1, 64), embedding.data.cast("B")),
        Tensor("LENGTH", "INT64", (1, 1), length.data.cast("B")),
    ]


def test_a_request_naming_no_outputs_gets_every_output_in_declared_order() -> None:
    request = decode_request(_text_request(), EMBED, now=0.0)
    assert request.outputs == ("EMBEDDING", "LENGTH")
    response = encode_response(request, _results())
    assert [o.name for o in response.outputs] == ["EMBEDDING", "LENGTH"]
    assert [len(b) for b in response.raw_output_contents] == [64 * 4, 8]
    assert list(response.outputs[0].shape) == [1, 64]


def test_outputs_come_back_in_the_order_asked() -> None:
    request = decode_request(_text_request("LENGTH", "EMBEDDING"), EMBED, now=0.0)
    response = encode_response(request, _results())
    assert [o.name for o in response.outputs] == ["LENGTH", "EMBEDDING"]
    assert [o.datatype for o in response.outputs] == ["INT64", "FP32"]
    assert response.raw_output_contents[0] == np.array([2], np.int64).tobytes()


def test_an_unknown_output_is_refused_by_name() -> None:
    with pytest.raises(InvalidInput, match=r"unknown output 'NOPE'.*'EMBEDDING', 'LENGTH'"):
        decode_request(_text_request("LENGTH", "NOPE"), EMBED, now=0.0)


@pytest.mark.parametrize(("id_", "ok"), [("x" * 4096, True), ("x" * 4097, False),
                                          ("é" * 2048, True), ("é" * 2049, False)])  # fmt: skip
def test_a_request_id_over_4096_bytes_is_refused_saying_how_long(id_: str, ok: bool) -> None:
    """An id comes back in every response of its request: a step-wise request's 4 MB
    id made a GB of responses (one per step), outside its stream's byte budget."""
    msg = _text_request()
    msg.id = id_
    if ok:
        assert decode_request(msg, EMBED, now=0.0).id == id_
        return
    size = len(id_.encode())
    with pytest.raises(InvalidInput, match=rf"the request id holds {size} bytes, more than an "
                       r"id may \(4096\); it came as '(x|é){40}'\.\.\."):  # fmt: skip
        decode_request(msg, EMBED, now=0.0)


def _tokens(shape: list[int], count: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="textpool", raw_input_contents=[bytes(8 * count)])
    msg.inputs.add(name="TOKENS", datatype="INT64", shape=shape)
    return msg


@pytest.mark.parametrize("length", [1, 7, 300])
def test_a_variable_dimension_takes_any_length(length: int) -> None:
    request = decode_request(_tokens([2, length], 2 * length), TEXTPOOL, now=0.0)
    assert request.rows == 2 and request.length == length
    assert request.deadline == math.inf


def test_a_negative_dimension_is_refused_even_where_the_spec_says_minus_one() -> None:
    with pytest.raises(InvalidInput, match=r"shape \[1, -1\] has a negative dimension"):
        decode_request(_tokens([1, -1], 0), TEXTPOOL, now=0.0)


def _token_rows(rows: int, length: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="textpool")
    msg.inputs.add(name="TOKENS", datatype="INT64", shape=[rows, length])
    msg.raw_input_contents.append(np.ones((rows, length), np.int64).tobytes())
    return msg


def test_a_ragged_row_longer_than_the_token_budget_is_refused_naming_it() -> None:
    """textpool's max_batch_tokens is 4096: one row of more could never be batched."""
    assert decode_request(_token_rows(1, 4096), TEXTPOOL, now=0.0).length == 4096
    with pytest.raises(InvalidInput) as e:
        decode_request(_token_rows(1, 12_000), TEXTPOOL, now=0.0)
    assert "rows of 12000 elements" in e.value.message
    assert "[batching] max_batch_tokens = 4096" in e.value.message


def test_max_length_limits_a_ragged_input_without_a_token_budget() -> None:
    spec = dataclasses.replace(TEXTPOOL.inputs[0], max_length=100)
    no_budget = dataclasses.replace(TEXTPOOL.batching, max_batch_tokens=0)
    model = dataclasses.replace(TEXTPOOL, inputs=(spec,), batching=no_budget)
    decode_request(_token_rows(2, 100), model, now=0.0)
    with pytest.raises(InvalidInput, match=r"\[\[input\]\] 'TOKENS' max_length = 100"):
        decode_request(_token_rows(2, 101), model, now=0.0)
    both = dataclasses.replace(model, batching=TEXTPOOL.batching)  # budget 4096 > 100
    with pytest.raises(InvalidInput, match="max_length = 100"):
        decode_request(_token_rows(1, 101), both, now=0.0)


def test_long_ragged_requests_split_by_rows_within_the_token_budget() -> None:
    """8 rows of 1,000 tokens under a 4,096 budget: chunks of 4 rows, never a cut row."""
    request = decode_request(_token_rows(8, 1000), TEXTPOOL, now=0.0)
    assert TEXTPOOL.rows_per_batch(request.length) == 4
    chunks = split_request(request, TEXTPOOL.rows_per_batch(request.length))
    assert [(c.rows, c.inputs[0].shape) for c in chunks] == [(4, (4, 1000)), (4, (4, 1000))]


def test_more_rows_than_the_queue_could_hold_are_refused_from_the_shape() -> None:
    """embed queues 1,024 batches of 64 rows: a request of more rows is refused
    before its BYTES are walked (here: a shape that lies about a tiny buffer)."""
    msg = pb.ModelInferRequest(model_name="embed", raw_input_contents=[b"\0\0\0\0"])
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=[15_728_640, 1])
    with pytest.raises(InvalidInput, match="send at most 65536 rows a request"):
        decode_request(msg, EMBED, now=0.0)


def test_a_response_larger_than_a_message_may_be_is_refused_before_it_is_built() -> None:
    request = decode_request(_text_request(), EMBED, now=0.0)
    with pytest.raises(ResponseTooLarge, match=r"264 bytes, more than a response may carry \(100"):
        encode_response(request, _results(), max_bytes=100)
    assert ResponseTooLarge.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_response_whose_outputs_alone_fit_but_not_with_its_own_fields_is_refused() -> None:
    """Outputs of exactly --max-message-bytes were sent: gRPC failed the whole call
    ("Sent message larger than max"), on a stream every other request with it. The
    response's own fields (names, shapes, the id, a stream's wrapper) count too."""
    request = decode_request(_text_request(), EMBED, now=0.0)
    request.id = "x" * 4000  # an id of up to 4 KiB comes back in the response
    with pytest.raises(ResponseTooLarge, match="this response would take 43"):
        encode_response(request, _results(), max_bytes=4000)
    response = encode_response(request, _results(), max_bytes=4500)
    streamed = pb.ModelStreamInferResponse(infer_response=response)
    streamed.infer_response.parameters["triton_final_response"].bool_param = True
    assert streamed.ByteSize() <= 4500  # what the check counted, wrapper and flag too


def test_an_answer_its_model_fixes_too_large_is_refused_before_the_model_runs() -> None:
    """tiny answers 64 bytes a row: 30,000 rows would be 1.9 MB, over a 1 MiB limit. It
    was refused once the model had run for it (decode found nothing wrong); embed's
    answer size is fixed too (EMBEDDING [64] FP32, LENGTH [1] INT64)."""
    msg = pb.ModelInferRequest(model_name="tiny", raw_input_contents=[bytes(30_000 * 64)])
    msg.inputs.add(name="INPUT0", datatype="FP32", shape=[30_000, 16])
    limits = Limits(max_response_bytes=1 << 20)
    with pytest.raises(ResponseTooLarge) as e:
        decode_request(msg, TINY, now=0.0, limits=limits)
    assert e.value.message == (
        "the outputs for this request would hold 1920000 bytes, more than a response may "
        "carry (1048576, --max-message-bytes); ask for fewer rows or outputs"
    )
    assert decode_request(msg, TINY, now=0.0, limits=Limits(max_response_bytes=2_000_000))
    assert fixed_output_bytes(EMBED, ["EMBEDDING", "LENGTH", "nope"], 3) == (3 * 264, True)


PRIO = dataclasses.replace(
    EMBED,
    batching=dataclasses.replace(EMBED.batching, priority_levels=3, default_priority_level=2),
)


def _with_priority(value: int | None) -> pb.ModelInferRequest:
    msg = _text_request()
    if value is not None:
        msg.parameters["priority"].int64_param = value
    return msg


@pytest.mark.parametrize(("value", "level"), [(None, 1), (0, 1), (1, 0), (3, 2)])
def test_priority_0_or_none_is_the_default_level(value: int | None, level: int) -> None:
    assert decode_request(_with_priority(value), PRIO, now=0.0).level == level


@pytest.mark.parametrize("value", [-1, 4])
def test_a_priority_that_is_no_level_is_refused_saying_what_is(value: int) -> None:
    with pytest.raises(InvalidInput) as e:
        decode_request(_with_priority(value), PRIO, now=0.0)
    assert e.value.message == (
        "parameter 'priority': model 'embed' takes 0 (its default level, 2) or a level "
        f"1 (highest) to 3, got {value}"
    )


def test_a_model_without_levels_ignores_a_priority_but_not_a_negative_one() -> None:
    assert decode_request(_with_priority(7), EMBED, now=0.0).level == 0
    with pytest.raises(InvalidInput, match=r"takes 0 \(its default level, none\).*got -1"):
        decode_request(_with_priority(-1), EMBED, now=0.0)


def _only(name: str) -> ModelConfig:
    """echo with `name` as its one input, so that a valid request of it decodes."""
    spec = ECHO.input(name)
    assert spec is not None
    return dataclasses.replace(ECHO, inputs=(spec,))


@pytest.mark.parametrize("datatype", ["UINT8", "UINT16", "INT8", "INT16"])
def test_typed_contents_out_of_a_narrow_datatype_s_range_are_refused_not_wrapped(
    datatype: str,
) -> None:
    """UINT8/16 and INT8/16 travel in 32-bit fields: a value beyond the datatype's range
    is refused saying what it holds (as REST says it), never wrapped into it."""
    info = np.iinfo(datatype.lower())
    field = "uint_contents" if info.kind == "u" else "int_contents"
    model = _only(f"IN_{datatype}")

    def typed(values: list[int]) -> pb.ModelInferRequest:
        msg = pb.ModelInferRequest(model_name="echo")
        t = msg.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[1, 3])
        getattr(t.contents, field).extend(values)
        return msg

    edges = [int(info.min), int(info.max), 0]
    request = decode_request(typed(edges), model, now=0.0)
    assert bytes(request.inputs[0].data) == np.array(edges, info.dtype).tobytes()
    widest = 2**32 - 1 if info.kind == "u" else 2**31 - 1  # wrapped, 255 or -1: a "valid" value
    for values, got in [
        ([0, int(info.max) + 1, 1], int(info.max) + 1),
        ([widest, 0, 0], widest),
        *([([int(info.min) - 1, int(info.max) + 1, 0], int(info.min) - 1)] if info.min else []),
    ]:
        with pytest.raises(InvalidInput) as e:
            decode_request(typed(values), model, now=0.0)
        assert e.value.message == (
            f"input 'IN_{datatype}': {datatype} holds {info.min} to {info.max}, got {got}"
        )


def _dims(count: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="tiny", raw_input_contents=[b""])
    msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1] * count)
    return msg


def test_a_shape_of_the_wrong_rank_is_refused_naming_both_ranks() -> None:
    with pytest.raises(InvalidInput) as e:
        decode_request(_dims(3), TINY, now=0.0)
    assert e.value.message == (
        "input 'INPUT0': expected shape [-1, 16] (batch dim first) of 2 dimensions, "
        "got 3 dimensions: [1, 1, 1]"
    )


def test_a_shape_of_a_million_dimensions_is_refused_from_its_length_unread() -> None:
    """gRPC has no limit on a shape's dimensions but the message size: a million (or 60
    million) of them are refused on their count, before a tuple of them is built, so
    the refusal allocates next to nothing (a tuple of them would take 8 MB)."""
    msg = _dims(1_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput) as e:
            decode_request(msg, TINY, now=0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak
    assert e.value.message == (
        "input 'INPUT0': expected shape [-1, 16] (batch dim first) of 2 dimensions, "
        "got 1000000 dimensions: [1, 1, 1, 1, 1, 1, 1, 1, ...] (1000000 items)"
    )


def test_a_status_s_details_are_cut_to_what_a_client_takes_as_grpc_sends_them() -> None:
    """gRPC sends each byte past printable ASCII (and %) as three characters, and clients
    take 8 KiB of metadata: a model's 4,096-character message (WHY_CHARS) in CJK went as
    36 KB, and its caller got RESOURCE_EXHAUSTED 'Stream removed' instead."""
    ascii_ = "x" * 4096  # a model's message at its longest, in ASCII: whole
    assert details(ascii_) is ascii_ and details("short") == "short"
    for text in ("\u4e2d" * 4096, "%" * 9000, "x" * 9000, "\u4e2d" + "\U0001f600" * 3000):
        cut = details(text)
        data = cut.encode()
        sent = len(data) + 2 * sum(1 for b in data if not 0x20 <= b < 0x7F or b == 0x25)
        assert MAX_DETAILS_CHARS - 100 < sent <= MAX_DETAILS_CHARS, (text[:3], sent)
        assert cut.endswith(f"... ({len(text)} characters)") and text.startswith(cut[:10])
