"""Client.stream, AsyncClient.stream and `batchd bench --stream` against a fake
decoupled server: an in-process grpc.aio server whose ModelStreamInfer answers as
the step-wise protocol has it (Triton's decoupled streaming), so the client is
tested without the server's step-wise models.

The fake's model `count` takes MAX_NEW_TOKENS (INT64 [1]) = n and yields n outputs
TOKEN INT64 [1] = 100, 101, ..., one response each, with the request's id and
`triton_final_response` false except on the last; with
`triton_enable_empty_final_response` the last output is not final and an empty
final response follows. Every call records, once it has ended, whether it was
cancelled: the tests wait on that record, never on a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import numpy as np
import pytest

from batchd.client import (
    AsyncClient,
    BatchdClientError,
    Client,
    DeadlineExceeded,
    InferenceFailed,
    LimitExceeded,
    ServerBusy,
    ServerUnavailable,
    bench,
)
from batchd.client.core import End, Open
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


class FakeDecoupled(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The model `count`, decoupled. Set before a call: `first_s` (before the first
    output) and `step_s` (before each later one); `fail_after` k: after k outputs an
    error response, its status in the `error_code` parameter (`fail_code`, "" for
    none) and `fail_text` as its message; `hold_after` k: after k outputs, answer
    nothing more until the call ends; `hold_final`: after the final response, keep the
    call open until it is cancelled; `hold_metadata`: ModelMetadata never answers;
    `garble`: each answer's TOKEN shape says one more value than its data holds."""

    def __init__(self) -> None:
        self.first_s = 0.0
        self.step_s = 0.0
        self.fail_after: int | None = None
        self.fail_code = "RESOURCE_EXHAUSTED"
        self.fail_text = "stream too far behind"
        self.hold_after: int | None = None
        self.hold_final = False
        self.hold_metadata = False
        self.garble = False
        self.requests: list[pb.ModelInferRequest] = []
        self.ended: queue.Queue[bool] = queue.Queue()  # per call, once over: cancelled?

    def ended_call(self) -> bool:
        """Whether the next call to end was cancelled (waits for one to end)."""
        return self.ended.get(timeout=30)

    async def steps(
        self, req: pb.ModelInferRequest
    ) -> AsyncIterator[tuple[pb.ModelInferResponse, bool]]:
        """The step-wise model: one ModelInferResponse per output, and whether it is the last."""
        (n,) = np.frombuffer(req.raw_input_contents[0], np.int64)
        for i in range(int(n)):
            if i == self.fail_after:
                raise _Failure(self.fail_code, self.fail_text)
            if i == self.hold_after:
                await asyncio.Event().wait()  # until the call is cancelled
            await asyncio.sleep(self.first_s if i == 0 else self.step_s)
            out = pb.ModelInferResponse(model_name=req.model_name, id=req.id)
            out.outputs.add(name="TOKEN", datatype="INT64", shape=[1 + self.garble])
            out.raw_output_contents.append(np.array([100 + i], np.int64).tobytes())
            yield out, i == n - 1

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Records the call's end: cancelled when the client's cancellation reached the
        handler (grpc.aio cancels its task; context.cancelled() does not tell)."""
        cancelled = False
        try:
            async for req in request_iterator:
                self.requests.append(req)
                async for out in self.answer(req):
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            cancelled = True
            raise
        finally:
            self.ended.put(cancelled)

    async def answer(self, req: pb.ModelInferRequest) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """One request's responses, as the step-wise protocol has them."""
        empty_final = EMPTY_FINAL in req.parameters and req.parameters[EMPTY_FINAL].bool_param
        sent = 0
        try:
            async for out, last in self.steps(req):
                yield _streamed(out, final=last and not empty_final)
                sent += 1
        except _Failure as e:
            err = pb.ModelStreamInferResponse(error_message=e.text)
            err.infer_response.id = req.id
            code, _, pushback = e.code.partition("+")  # "CODE+MS": with a pushback
            if code:
                err.infer_response.parameters["error_code"].string_param = code
            if pushback.lstrip("-").isdigit():
                err.infer_response.parameters["retry_pushback_ms"].int64_param = int(pushback)
            elif pushback:  # not a count: as a hostile or broken server sends it
                err.infer_response.parameters["retry_pushback_ms"].string_param = pushback
            yield err  # the stream stays open; nothing more comes for this id
            return
        if empty_final or sent == 0:
            yield _streamed(pb.ModelInferResponse(model_name=req.model_name, id=req.id), True)
        if self.hold_final:
            await asyncio.Event().wait()  # until the call is cancelled

    async def ModelInfer(self, req: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        """Every step's outputs concatenated: TOKEN [n]."""
        tokens = []
        try:
            async for out, _ in self.steps(req):
                tokens.append(np.frombuffer(out.raw_output_contents[0], np.int64))
        except _Failure as e:
            await context.abort(grpc.StatusCode[e.code or "INTERNAL"], e.text)
        answer = pb.ModelInferResponse(model_name=req.model_name, id=req.id)
        answer.outputs.add(name="TOKEN", datatype="INT64", shape=[len(tokens) + self.garble])
        joined = np.concatenate([np.zeros(0, np.int64), *tokens])
        answer.raw_output_contents.append(joined.tobytes())
        return answer

    async def ModelMetadata(
        self, req: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        if self.hold_metadata:
            await asyncio.Event().wait()  # until the call is cancelled
        return pb.ModelMetadataResponse(
            name=req.name,
            versions=["1"],
            platform="python",
            inputs=[pb.TensorMetadata(name="MAX_NEW_TOKENS", datatype="INT64", shape=[1])],
            outputs=[pb.TensorMetadata(name="TOKEN", datatype="INT64", shape=[1])],
        )


class _Failure(Exception):
    def __init__(self, code: str, text: str) -> None:
        self.code, self.text = code, text


def _streamed(out: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    out.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=out)


@contextlib.contextmanager
def serving(fake: FakeDecoupled) -> Iterator[str]:
    """The fake on 127.0.0.1, its event loop on a thread of its own; yields its address."""
    loop = asyncio.new_event_loop()
    started: queue.Queue[int] = queue.Queue()
    stop = asyncio.Event()

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        started.put(port)
        await stop.wait()
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{started.get(timeout=30)}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@pytest.fixture
def fake() -> FakeDecoupled:
    return FakeDecoupled()


@pytest.fixture
def url(fake: FakeDecoupled) -> Iterator[str]:
    with serving(fake) as address:
        yield address


def n_tokens(n: int) -> dict[str, np.ndarray]:
    return {"MAX_NEW_TOKENS": np.array([n], np.int64)}


# ---- Client.stream ----


def test_stream_yields_one_dict_per_step_and_ends_at_the_final_response(
    fake: FakeDecoupled, url: str
) -> None:
    with Client(url) as c:
        outs = list(c.stream("count", n_tokens(4), request_id="r7"))
    assert [o["TOKEN"].tolist() for o in outs] == [[100], [101], [102], [103]]
    assert all(o["TOKEN"].dtype == np.int64 and set(o) == {"TOKEN"} for o in outs)
    (req,) = fake.requests
    assert (req.model_name, req.id, req.parameters[EMPTY_FINAL].bool_param) == ("count", "r7", True)
    assert fake.ended_call() is False  # read to its end, not cancelled


@pytest.mark.parametrize("empty_final", [True, False])
def test_stream_ends_with_or_without_an_empty_final_response(
    fake: FakeDecoupled, url: str, empty_final: bool
) -> None:
    """The empty final response is not an output; without it the last output is final.
    A sequence with no output still ends (the server then sends the empty final one)."""
    params = {EMPTY_FINAL: empty_final}
    with Client(url) as c:
        three = [o["TOKEN"][0] for o in c.stream("count", n_tokens(3), parameters=params)]
        none = list(c.stream("count", n_tokens(0), parameters=params))
    assert (three, none) == ([100, 101, 102], [])
    assert [fake.ended_call(), fake.ended_call()] == [False, False]


def test_a_single_array_names_the_models_only_input(fake: FakeDecoupled, url: str) -> None:
    with Client(url) as c:
        assert [o["TOKEN"][0] for o in c.stream("count", np.array([2], np.int64))] == [100, 101]


def test_stream_and_infer_agree(url: str) -> None:
    """Unary ModelInfer on a step-wise model concatenates what the stream yields."""
    with Client(url) as c:
        streamed = np.concatenate([o["TOKEN"] for o in c.stream("count", n_tokens(5))])
        assert np.array_equal(c.infer("count", n_tokens(5))["TOKEN"], streamed)


@pytest.mark.parametrize(
    ("code", "text", "error", "message"),
    [
        ("RESOURCE_EXHAUSTED", "stream too far behind", LimitExceeded, "stream too far behind"),
        ("RESOURCE_EXHAUSTED+250", "queue is full", ServerBusy, "queue is full"),
        ("RESOURCE_EXHAUSTED+-1", "queue is full", LimitExceeded, "queue is full"),
        ("UNAVAILABLE", "worker lost after 2 outputs", ServerUnavailable, "worker lost after 2"),
        ("UNAVAILABLE+100", "stopping", ServerUnavailable, "stopping"),
        ("UNAVAILABLE+-1", "stopping", ServerUnavailable, "stopping"),
        # a pushback that is no int64 is malformed: do not retry (it read as 0 ms: at once)
        ("RESOURCE_EXHAUSTED+never", "queue is full", LimitExceeded, "queue is full"),
        ("UNAVAILABLE+never", "stopping", ServerUnavailable, "stopping"),
        ("", "INTERNAL: the model raised boom", InferenceFailed, "the model raised boom"),
        ("", "UNAVAILABLE: worker lost", ServerUnavailable, "worker lost"),
        ("", "no code here", InferenceFailed, "no code here"),
        ("FAILED_PRECONDITION", "not now", BatchdClientError, "not now"),
        ("NO_SUCH_STATUS", "odd", InferenceFailed, "odd"),
    ],
)
def test_an_error_response_raises_its_typed_error_after_the_outputs_before_it(
    fake: FakeDecoupled,
    url: str,
    code: str,
    text: str,
    error: type[BatchdClientError],
    message: str,
) -> None:
    """The status comes from the response's `error_code` parameter, or from a leading
    "STATUS: " in the message; with neither, InferenceFailed. The text is the server's."""
    fake.fail_after, fake.fail_code, fake.fail_text = 2, code, text
    seen = []
    with Client(url) as c, pytest.raises(error) as raised:
        for out in c.stream("count", n_tokens(5)):
            seen.append(out["TOKEN"][0])
    assert seen == [100, 101]
    assert type(raised.value) is error and raised.value.message.startswith(message)
    # the pushback, as a unary call's trailer says it (gRFC A6: a negative one is none)
    said = code.partition("+")[2]
    pushback = int(said) if said.lstrip("-").isdigit() else -1
    assert getattr(raised.value, "retry_after_ms", None) == (pushback if pushback >= 0 else None)
    if isinstance(raised.value, ServerUnavailable):  # a negative one: do not retry (gRFC A6)
        assert raised.value.retry_refused == code.endswith(("+-1", "+never"))


def test_a_stream_that_closes_before_its_final_response_fails(
    fake: FakeDecoupled, url: str
) -> None:
    """A server that closes the stream normally without flagging the request's last
    response: the client says so rather than end as if the sequence were complete."""

    async def no_final(req: pb.ModelInferRequest) -> AsyncIterator[pb.ModelStreamInferResponse]:
        yield _streamed(pb.ModelInferResponse(model_name="count", id=req.id), False)

    fake.answer = no_final  # type: ignore[method-assign]
    with Client(url) as c, pytest.raises(InferenceFailed, match="closed before the final"):
        list(c.stream("count", n_tokens(3)))


def _leave_by_break(c: Client) -> None:
    for _ in c.stream("count", n_tokens(1000)):
        break


def _leave_by_exception(c: Client) -> None:
    with pytest.raises(KeyError):
        for out in c.stream("count", n_tokens(1000)):
            out["NOT_AN_OUTPUT"]


def _leave_by_close(c: Client) -> None:
    it = c.stream("count", n_tokens(1000))
    next(it)
    it.close()  # type: ignore[attr-defined]


def _leave_by_collection(c: Client) -> None:
    it = c.stream("count", n_tokens(1000))
    next(it)
    del it
    gc.collect()


@pytest.mark.parametrize(
    "leave", [_leave_by_break, _leave_by_exception, _leave_by_close, _leave_by_collection]
)
def test_leaving_the_loop_early_cancels_the_call(fake: FakeDecoupled, url: str, leave: Any) -> None:
    """The fake holds the stream open after two outputs; the consumer takes one and
    leaves: the server sees its call cancelled (so it can free the sequence)."""
    fake.hold_after = 2
    with Client(url) as c:
        leave(c)
        assert fake.ended_call() is True


@pytest.mark.timeout(60)  # it hung: the client waited for a call's end that never came
@pytest.mark.parametrize("empty_final", [True, False])
def test_a_stream_held_open_after_its_final_response_ends_and_is_cancelled(
    fake: FakeDecoupled, url: str, empty_final: bool
) -> None:
    """A server (or a proxy) that keeps the call open past the final response: the
    loop ends with every output, in both clients, and the held call is cancelled."""
    fake.hold_final = True
    params = {EMPTY_FINAL: empty_final}
    with Client(url) as c:
        assert [o["TOKEN"][0] for o in c.stream("count", n_tokens(3), parameters=params)] == [
            100, 101, 102
        ]  # fmt: skip
    assert fake.ended_call() is True

    async def drive() -> list[int]:
        async with AsyncClient(url) as ac:
            return [o["TOKEN"][0] async for o in ac.stream("count", n_tokens(2))]

    assert asyncio.run(drive()) == [100, 101]
    assert fake.ended_call() is True


def test_timeout_is_the_deadline_of_the_whole_stream(fake: FakeDecoupled, url: str) -> None:
    """Each output comes within 0.1 s, but all ten take a second: a 0.35 s stream
    ends with DeadlineExceeded after a few of them."""
    fake.step_s = 0.1
    seen = []
    with Client(url) as c, pytest.raises(DeadlineExceeded):
        for out in c.stream("count", n_tokens(10), timeout=0.35):
            seen.append(out["TOKEN"][0])
    assert 1 <= len(seen) < 10


@pytest.mark.timeout(60)  # without the shared deadline the lookup waits forever
def test_a_single_arrays_metadata_lookup_is_within_the_calls_timeout(
    fake: FakeDecoupled, url: str
) -> None:
    """A bare array is named from ModelMetadata first; that lookup shares the call's
    deadline. The fake never answers it and the client has no default timeout: infer
    and stream with a timeout end with DeadlineExceeded all the same."""
    fake.hold_metadata = True
    one = np.array([2], np.int64)

    async def awaited() -> None:
        async with AsyncClient(url) as c:
            await c.infer("count", one, timeout=0.2)

    with Client(url) as c:
        with pytest.raises(DeadlineExceeded):
            c.infer("count", one, timeout=0.2)
        with pytest.raises(DeadlineExceeded):
            list(c.stream("count", one, timeout=0.2))
    with pytest.raises(DeadlineExceeded):
        asyncio.run(awaited())


# ---- AsyncClient.stream ----


def test_async_stream_yields_each_step_and_raises_typed_errors(
    fake: FakeDecoupled, url: str
) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        async with AsyncClient(url) as c:
            whole = [int(o["TOKEN"][0]) async for o in c.stream("count", n_tokens(3))]
            fake.fail_after = 1
            part = []
            with pytest.raises(ServerBusy, match="stream too far behind"):
                async for out in c.stream("count", n_tokens(3)):
                    part.append(int(out["TOKEN"][0]))
            return whole, part

    assert asyncio.run(scenario()) == ([100, 101, 102], [100])
    assert fake.ended_call() is False


@pytest.mark.parametrize("how", ["break", "aclose", "exception"])
def test_async_leaving_the_loop_early_cancels_the_call(
    fake: FakeDecoupled, url: str, how: str
) -> None:
    fake.hold_after = 2

    async def scenario() -> bool:
        async with AsyncClient(url) as c:
            it = c.stream("count", n_tokens(1000))
            if how == "break":
                async for _ in it:
                    break
                del it  # asyncio closes a collected async generator
            elif how == "aclose":
                await anext(it)
                await it.aclose()  # type: ignore[attr-defined]
            else:
                with pytest.raises(KeyError):
                    async for out in it:
                        out["NOT_AN_OUTPUT"]
                del it
            return await asyncio.to_thread(fake.ended_call)

    assert asyncio.run(scenario()) is True


# ---- batchd bench --stream ----


def run_bench(
    url: str, tmp_path: Path, *extra: str, stream: bool = True
) -> tuple[int, dict[str, Any]]:
    tokens = tmp_path / "n.npy"
    np.save(tokens, np.array([5], np.int64))
    out = tmp_path / "bench.json"
    argv = ["--url", url, "--model", "count", *["--stream"] * stream, "--duration", "0.5"]
    argv += ["--warmup", "0", "--processes", "1", "--json", str(out)]
    argv += ["--input", f"MAX_NEW_TOKENS={tokens}", *extra]
    code = bench.main(argv)
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("load", [["--concurrency", "2"], ["--rate", "40"]])
def test_bench_stream_measures_outputs_and_their_timing(
    fake: FakeDecoupled,
    url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    load: list[str],
) -> None:
    """Five outputs per request, the first after 40 ms, the next 10 ms apart: outputs
    are five times the requests, and the time to first output and the inter-output
    latency are those of the fake, not swapped."""
    fake.first_s, fake.step_s = 0.04, 0.01
    code, result = run_bench(url, tmp_path, *load)
    (level,) = result["levels"]
    s = level["stream"]
    assert (code, result["stream"], level["errors"]) == (0, True, {})
    assert level["ok"] > 0 and s["outputs"] == 5 * level["ok"]
    assert s["outputs_per_s"] == pytest.approx(5 * level["throughput"])
    assert level["throughput"] == pytest.approx(level["ok"] / s["elapsed_s"])
    assert 40 <= s["ttfo_p50_ms"] <= s["ttfo_p99_ms"] < 1000
    assert 5 <= s["inter_output_p50_ms"] <= s["inter_output_p99_ms"]
    assert s["inter_output_p50_ms"] < 40
    assert all(r.parameters[EMPTY_FINAL].bool_param for r in fake.requests)
    table = capsys.readouterr().out
    assert "outputs/s" in table and "TTFO p50" in table and "ITL p99" in table


def test_bench_stream_counts_error_responses_by_status_with_the_first_message(
    fake: FakeDecoupled, url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.fail_after = 2
    code, result = run_bench(url, tmp_path, "--concurrency", "1")
    (level,) = result["levels"]
    assert code == 1 and level["ok"] == 0 and level["errors"]["RESOURCE_EXHAUSTED"] > 0
    assert level["error_messages"] == {"RESOURCE_EXHAUSTED": "stream too far behind"}
    assert level["stream"]["outputs"] == 2 * level["errors"]["RESOURCE_EXHAUSTED"]
    assert "RESOURCE_EXHAUSTED: stream too far behind" in capsys.readouterr().out


@pytest.mark.parametrize("stream", [False, True])
def test_bench_counts_answers_that_do_not_decode_as_errors(
    fake: FakeDecoupled, url: str, tmp_path: Path, stream: bool
) -> None:
    """An answer whose TOKEN shape its data cannot fill is an error, as Client.infer
    raises BadResponse for it: a server sending garbage benchmarked as healthy (exit 0,
    no errors)."""
    fake.garble = True
    code, result = run_bench(url, tmp_path, "--concurrency", "1", stream=stream)
    (level,) = result["levels"]
    assert code == 1 and level["ok"] == 0 and level["errors"]["BAD_RESPONSE"] > 0
    assert "does not decode" in level["error_messages"]["BAD_RESPONSE"]


def test_bench_stream_leaves_a_stream_held_open_after_its_final_response(
    fake: FakeDecoupled, url: str, tmp_path: Path
) -> None:
    """A server that keeps a stream open after its final response: the bench cancels it
    after the grace Client.stream gives (1 s), as Client.stream does. It waited for the
    request's 30 s deadline: a 0.5 s level took 61 s, and said 0.1 req/s."""
    fake.hold_final = True
    code, result = run_bench(url, tmp_path, "--concurrency", "2")
    (level,) = result["levels"]
    assert (code, level["errors"]) == (0, {}) and level["ok"] >= 2
    assert level["stream"]["elapsed_s"] < 10  # (its requests' 30 s deadline: not waited out)
    assert fake.ended_call() is True  # cancelled


def test_bench_gives_up_on_a_server_that_never_answers_its_own_calls(
    fake: FakeDecoupled,
    url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ModelMetadata never answered: exit 2 saying so, after SETUP_TIMEOUT_S (1 s here).
    It had no deadline, and waited for ever."""
    fake.hold_metadata = True
    monkeypatch.setattr(bench, "SETUP_TIMEOUT_S", 1.0)
    argv = ["--url", url, "--model", "count", "--duration", "0.5", "--processes", "1"]
    assert bench.main(argv) == 2
    assert "DEADLINE" in capsys.readouterr().err.upper()


def test_bench_stream_plots_outputs_per_second_and_time_to_first_output(
    url: str, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "stream.png"
    code, _ = run_bench(url, tmp_path, "--concurrency", "1,2", "--plot", str(plot))
    assert code == 0 and plot.stat().st_size > 0


def test_a_task_cancelled_as_its_stream_ends_stays_cancelled() -> None:
    """AsyncClient waited for the call's end with asyncio.wait_for, which on 3.11 drops
    a cancel landing in the turn the call ends (CPython gh-86296): the caller's task
    ran on past the loop as though never cancelled."""

    class Call:
        def __init__(self, ended: asyncio.Future[int]) -> None:
            self.ended = ended

        async def code(self) -> int:
            return await self.ended

        def cancel(self) -> bool:
            return False

    async def scenario() -> list[str]:
        ended = asyncio.get_running_loop().create_future()
        ran_on: list[str] = []
        async with AsyncClient("127.0.0.1:1") as ac:
            ac._stub = mock.Mock(ModelStreamInfer=lambda *a, **k: Call(ended))

            def steps() -> Any:
                yield Open("ModelStreamInfer", None, None)
                yield End(1.0)

            async def consume() -> None:
                async for _ in ac._drive_stream(steps()):
                    pass
                ran_on.append("after the loop")

            task = asyncio.create_task(consume())
            for _ in range(5):
                await asyncio.sleep(0)  # (it waits for the end)
            ended.set_result(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return ran_on

    assert asyncio.run(scenario()) == []
