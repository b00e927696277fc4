"""ModelStreamInfer's response stream (server/streaming.respond) with a fake servicer:
a request that fails for a defect, or a request stream that fails, never leaves the
stream without an end; a failed request's response is its final one, as Triton's."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos.model_config import ModelConfig, TensorSpec
from batchd.server import streaming
from batchd.server.errors import InvalidInput
from batchd.server.flow import StreamBudget
from batchd.server.handlers import Undecodable
from batchd.server.streaming import respond
from tests.conftest import model, stepwise_model


class Service:
    """Answers each request with its id; `boom` is a defect, `bad` invalid input."""

    def served(self, msg: pb.ModelInferRequest) -> ModelConfig | None:
        return model() if msg.model_name == "m" else None  # version "1"

    async def infer(
        self, msg: pb.ModelInferRequest, time_remaining: Any, carrier: Any = None
    ) -> pb.ModelInferResponse:
        await asyncio.sleep(0)
        if msg.id == "boom":
            raise KeyError("tiny@1")  # as a retired version's queue once did
        if msg.id.startswith("bad"):
            raise InvalidInput("bad input")
        return pb.ModelInferResponse(model_name=msg.model_name, id=msg.id)

    def max_response_bytes(self) -> int:
        return 1 << 20


async def requests(
    ids: list[str], fail: Exception | None = None, name: str = "tiny"
) -> AsyncIterator[pb.ModelInferRequest]:
    for i in ids:
        yield pb.ModelInferRequest(model_name=name, id=i)
    if fail is not None:
        raise fail


async def collect(
    ids: list[str], fail: Exception | None = None
) -> list[pb.ModelStreamInferResponse]:
    out = []
    async for response in respond(Service(), requests(ids, fail)):  # type: ignore[arg-type]
        out.append(response)
    return out


def test_a_request_that_fails_for_a_defect_gets_internal_error_and_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = asyncio.run(asyncio.wait_for(collect(["a", "boom", "bad", "b"]), 10))
    by_id = {r.infer_response.id: r for r in out}
    assert sorted(by_id) == ["a", "b", "bad", "boom"]
    assert by_id["boom"].error_message == "internal error"
    assert by_id["boom"].infer_response.parameters["error_code"].string_param == "INTERNAL"
    assert by_id["bad"].error_message == "bad input"
    assert not by_id["a"].error_message and not by_id["b"].error_message
    assert "a ModelStreamInfer request failed" in caplog.text


def test_a_request_stream_that_fails_ends_the_call_with_its_error_after_the_answers() -> None:
    seen: list[str] = []

    async def run() -> None:
        async for response in respond(Service(), requests(["a", "b"], OSError("reset"))):  # type: ignore[arg-type]
            seen.append(response.infer_response.id)

    with pytest.raises(OSError, match="reset"):
        asyncio.run(asyncio.wait_for(run(), 10))
    assert sorted(seen) == ["a", "b"]


def test_a_failed_request_s_response_is_its_final_one_with_its_id_model_and_version() -> None:
    """As Triton's StreamInferResponseComplete: id, model name and version, and
    triton_final_response = true, whether or not the request asked for empty final
    responses (Triton sets the flag on every response it sends for an issued request).
    The version is the one asked for, else the one serving the model."""

    async def run() -> list[pb.ModelStreamInferResponse]:
        async def mixed() -> AsyncIterator[pb.ModelInferRequest | Undecodable]:
            yield pb.ModelInferRequest(model_name="m", id="bad")
            asked = pb.ModelInferRequest(model_name="m", model_version="7", id="bad")
            asked.parameters["triton_enable_empty_final_response"].bool_param = True
            yield asked
            yield pb.ModelInferRequest(model_name="gone", id="boom")
            yield Undecodable(InvalidInput("not a ModelInferRequest"))

        return [r async for r in respond(Service(), mixed())]  # type: ignore[arg-type]

    out = asyncio.run(asyncio.wait_for(run(), 10))
    seen = [
        (r.infer_response.id, r.infer_response.model_name, r.infer_response.model_version,
         r.infer_response.parameters["triton_final_response"].bool_param)
        for r in out
    ]  # fmt: skip
    assert sorted(seen) == [
        ("", "", "", True), ("bad", "m", "1", True), ("bad", "m", "7", True),
        ("boom", "gone", "", True),
    ]  # fmt: skip
    assert all(r.error_message for r in out)


def test_a_refused_request_s_long_id_is_not_echoed_and_empty_final_must_be_a_boolean() -> None:
    """An id refused for its length came back whole in the refusal: a stream that did
    not read held 4 MB per refused request. triton_enable_empty_final_response as a
    string "true" was read as false, for every model."""
    long_id = "bad" + "x" * 5000

    async def run() -> list[pb.ModelStreamInferResponse]:
        async def asked() -> AsyncIterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="tiny", id=long_id)
            wrong = pb.ModelInferRequest(model_name="tiny", id="s")
            wrong.parameters["triton_enable_empty_final_response"].string_param = "true"
            yield wrong

        return [r async for r in respond(Service(), asked())]  # type: ignore[arg-type]

    out = {r.error_message: r.infer_response.id for r in asyncio.run(asyncio.wait_for(run(), 10))}
    assert out == {
        "bad input": "",
        "parameter 'triton_enable_empty_final_response': expected a boolean, got string_param": "s",
    }


def test_any_response_its_caller_takes_counts_as_reading_for_the_stream_s_sequences(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence held for its caller is stopped once its caller has taken nothing for
    execution_timeout_s (sequences.py): the one-shot answers queued ahead of its
    outputs are taken too, and count (only a sequence's own outputs did: a steady
    reader of 60 answers queued ahead had its sequence stopped as stalled)."""
    budgets: list[StreamBudget] = []

    def kept(max_response_bytes: int) -> StreamBudget:
        budgets.append(StreamBudget(2 * max_response_bytes))
        return budgets[-1]

    monkeypatch.setattr(streaming, "stream_budget", kept)

    async def body() -> list[float]:
        seen = []
        async for _ in respond(Service(), requests(["a", "b", "c"])):  # type: ignore[arg-type]
            seen.append(budgets[0].taken_at)  # (set as the next is asked for)
            budgets[0].taken_at = -1.0
        return seen

    seen = asyncio.run(body())  # each after the one before it was taken
    assert len(seen) == 3 and all(t > 0 for t in seen), seen


class BigAnswers(Service):
    """A model whose answer is its signature's: Y FP32 [65536] a row (256 KiB)."""

    started = 0

    def served(self, msg: pb.ModelInferRequest) -> ModelConfig | None:
        return model(shape=(65536,))

    async def infer(
        self, msg: pb.ModelInferRequest, time_remaining: Any, carrier: Any = None
    ) -> pb.ModelInferResponse:
        self.started += 1
        await asyncio.sleep(0)
        return pb.ModelInferResponse(id=msg.id, raw_output_contents=[bytes(4 * 65536)])


def test_a_stream_not_read_takes_only_the_one_shot_requests_whose_answers_fit_its_budget() -> None:
    """A one-shot request is read while the answers of those read before it, with its
    own, fit in half the stream's budget (what the model's signature says an answer
    holds): a caller that sends 300 and reads nothing holds about that, not 256 answers
    of 256 KiB (64 MiB, where the budget is 2 MiB). Read, they all come."""
    service = BigAnswers()

    async def asked() -> AsyncIterator[pb.ModelInferRequest]:
        for i in range(300):
            msg = pb.ModelInferRequest(model_name="m", id=str(i))
            msg.inputs.add(name="X", datatype="FP32", shape=[1, 65536])
            yield msg

    async def body() -> int:
        answers = respond(service, asked())  # type: ignore[arg-type]
        first = await anext(answers)
        for _ in range(5000):  # (no time passes: every request that may be read, is)
            await asyncio.sleep(0)
        held_back = service.started
        rest = [r async for r in answers]
        assert [r.infer_response.id for r in [first, *rest]] == [str(i) for i in range(300)]
        return held_back

    assert asyncio.run(body()) <= 6  # the 256 KiB of the one taken, and 1 MiB of 2


def test_what_a_one_shot_answer_is_promised() -> None:
    """Its signature's bytes: rows (at most max_batch_size) x each output asked for;
    unknown (the stream's largest answer yet) where an output's size is the model's to
    decide; nothing for a step-wise request or one refused."""
    fixed = model(max_batch_size=4, shape=(3,))

    def msg(rows: int, *outputs: str) -> pb.ModelInferRequest:
        m = pb.ModelInferRequest(model_name="m", outputs=[{"name": o} for o in outputs])
        m.inputs.add(name="X", datatype="FP32", shape=[rows, 3])
        return m

    assert streaming.answer_bytes(msg(2), fixed, 99) == 2 * 3 * 4
    assert streaming.answer_bytes(msg(10**9), fixed, 99) == 4 * 3 * 4  # (refused: 4 rows)
    assert streaming.answer_bytes(msg(2, "nope"), fixed, 99) == 0  # (refused)
    ragged = dataclasses.replace(fixed, outputs=(TensorSpec("Y", "FP32", (-1,)),))
    text = dataclasses.replace(fixed, outputs=(TensorSpec("Y", "BYTES", (1,)),))
    assert (
        streaming.answer_bytes(msg(2), ragged, 99) == streaming.answer_bytes(msg(2), text, 99) == 99
    )
    assert streaming.answer_bytes(msg(2), stepwise_model(), 99) == 0
    assert streaming.answer_bytes(msg(2), None, 99) == 0
    assert streaming.answer_bytes(Undecodable(InvalidInput("x")), fixed, 99) == 0


@pytest.mark.parametrize("read_as", ["none", "step-wise", "one-shot"])
def test_a_request_whose_model_changed_kind_while_it_was_read_is_unavailable(
    read_as: str,
) -> None:
    """The stream chose a one-shot or a step-wise answer by the model as it read the
    request, and the servicer ran the model serving when it answered: a step-wise model
    loaded meanwhile answered one response of every step's outputs joined, one reloaded
    as one-shot an empty final response, both OK (a review's load/unload loop)."""
    first = {"none": None, "step-wise": stepwise_model("s"), "one-shot": model()}[read_as]
    then = model() if read_as == "step-wise" else stepwise_model("s")
    asked: list[ModelConfig | None] = []

    class Changing(Service):
        def served(self, msg: pb.ModelInferRequest) -> ModelConfig | None:
            asked.append(first if not asked else then)
            return asked[-1]

    async def run() -> list[pb.ModelStreamInferResponse]:
        return [r async for r in respond(Changing(), requests(["a"], name="s"))]  # type: ignore[arg-type]

    (out,) = asyncio.run(asyncio.wait_for(run(), 10))
    assert out.infer_response.parameters["error_code"].string_param == "UNAVAILABLE"
    kind = "a one-shot" if read_as == "step-wise" else "a step-wise"
    assert f"model 's' was loaded or reloaded as {kind} model while this" in out.error_message
