"""The frontend's codec as pure functions: ModelInferRequest -> Request -> response.

Over gRPC, test_serving checks the error messages; here, the shortcuts the hot
path takes: a request that names no outputs, outputs in the order asked, and
shapes with variable dimensions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos.model_config import load_model_config
from batchd.server.codec import decode_request, encode_response
from batchd.server.errors import InvalidInput
from batchd.server.request import Tensor
from tests.servers import EXAMPLES

EMBED = load_model_config(EXAMPLES / "embed")  # TEXT BYTES [1] -> EMBEDDING FP32 [64], LENGTH
TEXTPOOL = load_model_config(EXAMPLES / "textpool")  # TOKENS INT64 [-1], ragged


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
