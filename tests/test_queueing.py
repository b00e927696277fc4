"""Admission, batching, deadlines and cancellation, against real processes.

The `gated` and `limited` test models hold their batches while the gate is
closed, so a test can build a backlog on purpose; their call logs show which
rows reached the model and how they were batched.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from batchd.client import AsyncClient, Client, DeadlineExceeded, InferenceFailed, ServerBusy
from batchd.client.codec import build_request
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from tests.conftest import Gate, scrape, total
from tests.servers import ServerProcess, wait_for


def x(value: float) -> dict[str, np.ndarray]:
    return {"X": np.array([[value]], dtype=np.float32)}


def _stats(server: ServerProcess, model: str) -> pb.ModelStatistics:
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert "statistics" in stub.ServerMetadata(pb.ServerMetadataRequest()).extensions
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return reply.model_stats[0]


def started(gate: Gate, count: int) -> None:
    wait_for(lambda: len(gate.calls(log="entered")) >= count, 30, f"{count} batch(es) to start")


async def _outcome(client: AsyncClient, value: float) -> object:
    try:
        return (await client.infer("gated", x(value), timeout=60))["Y"][0, 0]
    except ServerBusy as e:
        return e


def test_backlog_leaves_as_one_batch_when_the_worker_frees(
    test_server: ServerProcess, gate: Gate
) -> None:
    """Work-conserving batching: requests that pile up behind a busy worker go
    out together as soon as it is idle, instead of one by one."""

    async def scenario() -> list[object]:
        async with AsyncClient(test_server.url) as client:
            gate.close()
            first = asyncio.ensure_future(client.infer("gated", x(1000), timeout=60))
            await asyncio.to_thread(started, gate, 1)
            calls = [asyncio.ensure_future(_outcome(client, v)) for v in range(31)]
            # The queue holds 31: once one caller is turned away, the backlog is complete.
            while not any(t.done() and isinstance(t.result(), ServerBusy) for t in calls):
                calls.append(asyncio.ensure_future(_outcome(client, 100 + len(calls))))
                await asyncio.wait(calls, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            gate.open()
            await first
            return list(await asyncio.gather(*calls))

    before = _stats(test_server, "gated")
    accepted = [v for v in asyncio.run(scenario()) if not isinstance(v, ServerBusy)]
    after = _stats(test_server, "gated")
    batches = gate.calls("gated")
    assert batches[0] == [1000.0]
    assert len(batches) == 2, batches
    assert len(batches[1]) == 31 == len(accepted)
    assert sorted(2 * v for v in batches[1]) == sorted(accepted)
    # ModelStatistics saw exactly these two batches: 1 + 31 rows.
    assert after.inference_count - before.inference_count == 32
    assert after.execution_count - before.execution_count == 2
    assert after.inference_stats.success.count - before.inference_stats.success.count == 32
    sizes = {b.batch_size: b.compute_infer.count for b in after.batch_stats}
    old = {b.batch_size: b.compute_infer.count for b in before.batch_stats}
    assert sizes[31] - old.get(31, 0) == 1 and sizes[1] - old.get(1, 0) == 1


def test_queue_limit_rejects_at_once_and_serves_the_rest(
    test_server: ServerProcess, gate: Gate
) -> None:
    """max_queue_size 4 under 64 concurrent callers: some RESOURCE_EXHAUSTED,
    every other caller gets its correct result."""

    async def scenario() -> list[object]:
        outcomes: list[object] = []
        enough_rejected = asyncio.Event()

        async def call(client: AsyncClient, v: float) -> None:
            try:
                out = await client.infer("limited", x(v), timeout=60)
                outcomes.append((v, float(out["Y"][0, 0])))
            except ServerBusy as e:
                outcomes.append(e)
                if sum(isinstance(o, ServerBusy) for o in outcomes) >= 64 - 12:
                    enough_rejected.set()

        async with AsyncClient(test_server.url) as client:
            gate.close()
            tasks = [asyncio.ensure_future(call(client, float(v))) for v in range(64)]
            # At most 2 batches of 4 on the worker plus 4 queued can be admitted.
            await asyncio.wait_for(enough_rejected.wait(), 60)
            gate.open()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return outcomes

    outcomes = asyncio.run(scenario())
    busy = [o for o in outcomes if isinstance(o, ServerBusy)]
    served = [o for o in outcomes if not isinstance(o, ServerBusy)]
    assert len(busy) + len(served) == 64
    assert busy and served
    assert all(y == 2 * v for v, y in served)  # type: ignore[misc]
    e = busy[0]
    assert "'limited'" in e.message and "max_queue_size 4" in e.message
    assert e.retry_after_ms is not None and e.retry_after_ms >= 1
    seen = sorted(v for batch in gate.calls("limited") for v in batch)
    assert seen == sorted(v for v, _ in served)  # type: ignore[misc]


def test_expired_request_never_reaches_the_model(test_server: ServerProcess, gate: Gate) -> None:
    with Client(test_server.url) as client:
        gate.close()
        pool = ThreadPoolExecutor(2)
        first = pool.submit(client.infer, "gated", x(1.0), timeout=60)
        started(gate, 1)
        with pytest.raises(DeadlineExceeded) as queue_timeout:  # timeout parameter: 50 ms queued
            client.infer("gated", x(2.0), timeout=60, parameters={"timeout": 50_000})
        with pytest.raises(DeadlineExceeded) as grpc_deadline:
            client.infer("gated", x(3.0), timeout=0.2)
        gate.open()
        assert first.result(30)["Y"][0, 0] == 2.0
        assert client.infer("gated", x(4.0), timeout=30)["Y"][0, 0] == 8.0
        pool.shutdown()
    for err in (queue_timeout.value, grpc_deadline.value):
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert "deadline" in queue_timeout.value.message
    assert gate.calls("gated") == [[1.0], [4.0]]


def failures(server: ServerProcess) -> float:
    """The gated model's requests its callers cancelled, as the server counts them."""
    return total(scrape(server), "batchd_inference_request_failure_total", model="gated",
                 reason="cancelled")  # fmt: skip


def test_cancelled_request_is_dropped(test_server: ServerProcess, gate: Gate) -> None:
    with Client(test_server.url) as client, grpc.insecure_channel(test_server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        gate.close()
        first = stub.ModelInfer.future(build_request("gated", x(1.0)), timeout=60)
        started(gate, 1)
        doomed = stub.ModelInfer.future(build_request("gated", x(7.0)), timeout=60)
        # Cancel only once the server holds it: a later request on the same
        # channel that completes proves the earlier one was accepted.
        assert stub.ModelReady(pb.ModelReadyRequest(name="gated")).ready
        cancelled = failures(test_server)
        doomed.cancel()
        # and only once the server has seen the cancel: opened before, the gate let the
        # worker ask for the next batch first, on a busy machine
        wait_for(lambda: failures(test_server) > cancelled, 30, "the server to see the cancel")
        gate.open()
        assert first.result(30).id == ""
        client.infer("gated", x(4.0), timeout=30)
    assert doomed.cancelled()
    assert 7.0 not in [v for batch in gate.calls("gated") for v in batch]


def test_model_exception_fails_its_batch_and_the_worker_lives(
    test_server: ServerProcess, gate: Gate
) -> None:
    before = test_server.worker_pids()
    with Client(test_server.url) as client:
        with pytest.raises(InferenceFailed) as info:
            client.infer("gated", x(-1.0), timeout=30)
        assert "ValueError: negative input -1.0" in info.value.message
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert client.infer("gated", x(3.0), timeout=30)["Y"][0, 0] == 6.0
    assert test_server.worker_pids() == before
