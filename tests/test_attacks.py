"""The hostile requests of issue 15, each against a real `batchd serve --workers 2`
(the example models), with a probe client on its own connection, in a process of
its own, calling `tiny` with a 1 s deadline the whole time. For every attack the
attacker gets a clear answer, the probe gets every answer within its second,
and no worker is lost. bench/attacks.py runs the same attacks at full size and
reports what each cost.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos.tensors import serialize_bytes
from tests.servers import EXAMPLES, ServerProcess, wait_for

# A probe calls alongside each attack with a 1 s deadline: it needs the cores to itself,
# not shared with another test process (make test runs these after the parallel ones).
pytestmark = pytest.mark.serial
OWN = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
BIG = [*OWN, ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _request(model: str, name: str, datatype: str, shape: list[int], raw: bytes) -> Any:
    msg = pb.ModelInferRequest(model_name=model)
    msg.inputs.add(name=name, datatype=datatype, shape=shape)
    msg.raw_input_contents.append(raw)
    return msg


def _tiny() -> Any:
    return _request("tiny", "INPUT0", "FP32", [1, 16], bytes(64))


def _probe(url: str, up: Any, stop: Any, out: Any) -> None:
    errors: Counter[str] = Counter()
    with grpc.insecure_channel(url, options=OWN) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        msg = _tiny()
        infer(msg, timeout=30)  # connected and answered: the attack may begin
        up.set()
        while not stop.wait(0.01):
            try:  # (3 s: a loop an attack stalls; one call of 1 s missed once on 2 loaded cores)
                infer(msg, timeout=3.0)
            except grpc.RpcError as e:
                errors[f"{e.code().name}: {e.details()}"] += 1
    out.put(dict(errors))


@contextmanager
def probing(server: ServerProcess) -> Iterator[None]:
    """Run the block with the probe calling alongside; then check what it and the
    server went through: every call answered in time, no worker lost."""
    lost = len(re.findall(r"worker \S+ lost", server.log()))
    ctx = multiprocessing.get_context("spawn")
    up, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_probe, args=(server.url, up, stop, out), daemon=True)
    proc.start()
    try:
        assert up.wait(60), "the probe never got its first answer"
        yield
    finally:
        stop.set()
        errors = out.get(timeout=60)
        proc.join(30)
    assert not errors, errors
    assert len(re.findall(r"worker \S+ lost", server.log())) == lost, server.log()[-3000:]


def _answers(channel: grpc.Channel) -> bool:
    pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_tiny(), timeout=10)
    return True


def _call(server: ServerProcess, msg: Any, timeout: float = 60) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(server.url, options=BIG) as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(msg, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_65536_bytes_rows_are_walked_once(example_server: ServerProcess) -> None:
    """262 KB of BYTES rows of mixed lengths for embed (64 rows a batch): 1,024
    chunks, split by the row offsets of one walk, decoded off the event loop.
    It froze the frontend for 14 s and restarted every worker."""
    n = 65_536
    raw = serialize_bytes([b"" if i % 2 else b"a" for i in range(n)])
    with probing(example_server):
        code, details = _call(example_server, _request("embed", "TEXT", "BYTES", [n, 1], raw))
    assert code == grpc.StatusCode.OK, details


def test_60_mb_of_bytes_elements_are_refused_from_the_header(
    example_server: ServerProcess,
) -> None:
    """15.7 M empty BYTES rows (it froze the frontend for good), and the same 60 MB
    under a shape of one element (it cost 3-5 s and 780 MB just to count)."""
    n = 15_728_640
    raw = b"\0\0\0\0" * n
    with probing(example_server):
        rows = _call(example_server, _request("embed", "TEXT", "BYTES", [n, 1], raw))
        one = _call(example_server, _request("embed", "TEXT", "BYTES", [1, 1], raw))
    assert rows[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "send at most 65536 rows a request" in rows[1]
    assert one[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 BYTES elements declared, the buffer holds more" in one[1]


def test_an_output_asked_for_3000_times_is_refused(example_server: ServerProcess) -> None:
    """98 KB asking for mlp's output 3,000 times built a 196 MB response."""
    msg = _request("mlp", "INPUT0", "FP32", [32, 512], bytes(32 * 512 * 4))
    for _ in range(3000):
        msg.outputs.add(name="OUTPUT0")
    with probing(example_server):
        code, details = _call(example_server, msg)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "asks for 3000 outputs" in details and len(details) < 200


def test_ragged_rows_over_the_token_budget_never_reach_a_worker(
    example_server: ServerProcess,
) -> None:
    """textpool (max_batch_tokens 4096): one row of 12,000 tokens took 1.1 GB on a
    worker, one of 100,000 an attempt at 40 GB. Rows that fit, but not all in one
    batch, are split by rows."""
    with probing(example_server):
        for n in (12_000, 100_000):
            msg = _request("textpool", "TOKENS", "INT64", [1, n], np.ones(n, np.int64).tobytes())
            code, details = _call(example_server, msg)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"rows of {n} elements" in details
            assert "[batching] max_batch_tokens = 4096" in details
        rows = np.arange(8 * 1000, dtype=np.int64).reshape(8, 1000) % 500 + 1
        msg = _request("textpool", "TOKENS", "INT64", [8, 1000], rows.tobytes())
        with grpc.insecure_channel(example_server.url, options=OWN) as channel:
            reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(msg, timeout=60)
    assert list(reply.outputs[0].shape) == [8, 64]


def test_errors_quote_a_short_prefix_of_a_4_mb_name(example_server: ServerProcess) -> None:
    """A name of megabytes came back whole, and past the client's 16 KB metadata
    limit turned NOT_FOUND into RESOURCE_EXHAUSTED 'Stream removed'."""
    big = "m" * (4 << 20)
    with probing(example_server):
        model = _call(example_server, _request(big, "INPUT0", "FP32", [1, 16], bytes(64)))
        name = _call(example_server, _request("tiny", big, "FP32", [1, 16], bytes(64)))
    assert model[0] == grpc.StatusCode.NOT_FOUND and len(model[1]) < 300
    assert "(4194304 characters)" in model[1]
    assert name[0] == grpc.StatusCode.INVALID_ARGUMENT and len(name[1]) < 300


async def _burst(url: str, n: int) -> Counter[str]:
    async with grpc.aio.insecure_channel(url, options=OWN) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        msg = _tiny()

        async def one() -> str:
            try:
                await infer(msg, timeout=60)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        return Counter(await asyncio.gather(*(one() for _ in range(n))))


def test_6000_calls_at_once_on_one_connection_get_no_cancelled(
    example_server: ServerProcess,
) -> None:
    """They got 3,222 OK and 2,778 CANCELLED: gRPC shed its backlog of calls not yet
    taken (1,000 by default). Now its backlog is larger, and one connection may
    hold only --max-concurrent-streams + 64 streams in it: the rest wait in the
    client, and nobody else's call waits behind thousands."""
    with probing(example_server):
        codes = asyncio.run(_burst(example_server.url, 6000))
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["OK"] > 0


async def _storm(url: str, seconds: float) -> int:
    async with grpc.aio.insecure_channel(url, options=OWN) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        msg = _request("mlp", "INPUT0", "FP32", [1, 512], bytes(2048))
        cancelled = 0
        end = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < end:
            calls = [infer(msg, timeout=10) for _ in range(200)]
            await asyncio.sleep(0.002)
            for call in calls:
                call.cancel()
            cancelled += len(calls)
        return cancelled


def test_a_cancel_storm_on_another_connection_cancels_nothing_of_ours(
    example_server: ServerProcess,
) -> None:
    """A well-behaved client got CANCELLED twice during another's cancel storm."""
    with probing(example_server):
        assert asyncio.run(_storm(example_server.url, 4.0)) > 0


async def _flood(url: str, rate: float, seconds: float) -> Counter[str]:
    async with grpc.aio.insecure_channel(url, options=OWN) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        msg = _request("mlp", "INPUT0", "FP32", [1, 512], bytes(2048))
        codes: Counter[str] = Counter()

        async def one() -> None:
            try:
                await infer(msg, timeout=10)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

        loop = asyncio.get_running_loop()
        start, tasks = loop.time(), []
        for i in range(int(rate * seconds)):
            if (delay := start + i / rate - loop.time()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return codes


def test_overload_with_deadlines_and_no_cancels_gets_no_cancelled(
    example_server: ServerProcess,
) -> None:
    """Open-loop load beyond capacity with 10 s deadlines got 160 CANCELLED."""
    with probing(example_server):
        codes = asyncio.run(_flood(example_server.url, 3000, 3.0))
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes


@pytest.fixture(scope="module")
def reaping_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        EXAMPLES,
        "--handshake-timeout",
        "1",
        "--max-connection-idle",
        "1",
        log_dir=tmp_path_factory.mktemp("logs"),
    ).start()
    yield server
    assert server.stop() == 0, server.log()


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        while s.recv(65536):  # what it sent before closing (a GOAWAY)
            pass
        return True
    except BlockingIOError:
        return False


def test_idle_and_silent_connections_are_closed(reaping_server: ServerProcess) -> None:
    """500 idle sockets stayed open, half without even the HTTP/2 preface."""
    with probing(reaping_server):  # its own connection is busy: never idle
        _reap(reaping_server)


def _reap(reaping_server: ServerProcess) -> None:
    host, port = reaping_server.url.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(20)]
    for s in silent:
        s.setblocking(False)
    assert not any(_closed_by_peer(s) for s in silent)  # open until the timeout
    with grpc.insecure_channel(reaping_server.url, options=OWN) as channel:
        assert _answers(channel)
        ready = grpc.ChannelConnectivity.READY
        states: list[grpc.ChannelConnectivity] = []
        channel.subscribe(states.append, try_to_connect=False)
        wait_for(lambda: all(_closed_by_peer(s) for s in silent), 30, "silent sockets closed")
        wait_for(lambda: states and states[-1] != ready, 30, "the idle connection's GOAWAY")
        assert _answers(channel)  # it reconnects on its next call, without an error
    for s in silent:
        s.close()
