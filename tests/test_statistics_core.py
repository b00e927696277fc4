"""ModelStatistics as the servicer and the core count them, in one process: the gRPC
servicer over a real Core on an in-process socket, a worker being READY messages
and replies the test sends, on a clock the test moves (so every duration is exact)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from batchd.protos import inference_pb2 as pb
from batchd.protos import wire
from batchd.server.core import Core
from batchd.server.errors import Unavailable
from batchd.server.pool import WorkerHandle
from batchd.server.request import Batch, Request, Tensor
from batchd.server.service import InferenceService
from batchd.server.stats import Stats
from tests.conftest import Clock, model, run, stepwise_model

INFER_NS = 400_000  # what each batch's worker says its forward took


@pytest.fixture
def router() -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("inproc://batchd-test-statistics")
    yield sock
    sock.close(linger=0)
    ctx.term()


def serving(router: zmq.Socket[bytes], clock: Clock, cfg: Any) -> tuple[Core, InferenceService]:
    """A core serving `cfg` whose sends always succeed, and its servicer."""
    core = Core(router, Stats(), Path("."), clock=clock)
    core.control.start_with({cfg.name: cfg})
    core.link.send = lambda identity, parts, copy=True: None  # type: ignore[method-assign,assignment,misc]
    core.supervisor.kill = lambda name, pid: None  # type: ignore[method-assign]
    return core, InferenceService(core, clock=clock)


def register(core: Core, name: str, key: str) -> WorkerHandle:
    """A worker that said READY and holds `key`."""
    info = wire.WorkerInfo(worker_id=name, device="cpu", pid=7, protocol=wire.PROTOCOL_VERSION)
    core.on_message(name.encode(), wire.Header(kind=wire.Header.READY, worker=info), [])
    worker = core.pool.get(name.encode())
    assert worker is not None
    worker.models.add(key)
    core.pump_soon()
    return worker


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until `condition` holds (a bounded number of turns)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def answer(core: Core, worker: WorkerHandle, batch: Batch, waited_ns: int = 0) -> None:
    """The worker's RESULT for `batch`: Y as wide as X (conftest.model), zeros."""
    rows = sum(r.rows for r in batch.requests)
    y = wire.Tensor(name="Y", datatype="FP32", shape=[rows, 2])
    result = wire.Header(kind=wire.Header.RESULT, batch_id=batch.id, tensors=[y],
                         compute_ns=INFER_NS, waited_ns=waited_ns)  # fmt: skip
    core.on_message(worker.identity, result, [bytes(rows * 8)])


def infer_msg(rows: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="X", datatype="FP32", shape=[rows, 2])
    msg.raw_input_contents.append(bytes(rows * 8))
    return msg


def test_a_split_request_counts_once_with_its_chunks_durations_and_job_lines_not_at_all(
    router: zmq.Socket[bytes],
) -> None:
    """10 rows, batches of 4: 3 chunks, sent one at a time (one credit), each answered
    1 ms after it left. The request is one success, one queue and one compute of each
    kind: it waited as long as its longest-waiting chunk (0, 1 and 2 ms: 2; their waits
    overlap, and summed they said a request waited longer than it took, review 58b),
    and took the chunks' compute times together; then a job's line: its row and batch
    count, its wait and compute do not (it answers no caller)."""

    async def body() -> None:
        clock = Clock()
        core, service = serving(router, clock, model(max_batch_size=4, queue=8, delay_us=0))
        worker = register(core, "w", core.models["m"].key)
        call = asyncio.ensure_future(service.infer(infer_msg(10), None))
        for _ in range(3):
            await until(lambda: len(worker.inflight) == 1, "a chunk sent")
            clock.now += 0.001
            answer(core, worker, next(iter(worker.inflight.values())))
        response = await call
        assert response.outputs[0].shape == [10, 2]
        m = core.stats.model("m", "1")
        assert (m.inference_count, m.execution_count) == (10, 3)
        counts = [m.success.count, m.queue.count, m.compute_input.count,
                  m.compute_infer.count, m.compute_output.count]  # fmt: skip
        assert counts == [1, 1, 1, 1, 1]
        assert m.queue.ns == 2_000_000
        assert m.compute_infer.ns == 3 * INFER_NS
        assert m.compute_input.ns == 3 * (1_000_000 - INFER_NS)

        line = Request(core.models["m"], "line-1", [Tensor("X", "FP32", (1, 2), bytes(8))],
                       ("Y",), 1, math.inf)  # fmt: skip
        line.background = True  # a batch job's line (jobs/runner.py)
        job = core.submit(line)
        await until(lambda: len(worker.inflight) == 1, "the job's line sent")
        clock.now += 0.005
        answer(core, worker, next(iter(worker.inflight.values())))
        await job
        assert (m.inference_count, m.execution_count) == (11, 4)
        assert [m.success.count, m.queue.count, m.compute_infer.count] == [1, 1, 1]
        assert (m.queue.ns, m.compute_infer.ns) == (2_000_000, 3 * INFER_NS)

    run(body)


def test_a_batch_s_wait_on_its_worker_counts_as_queue_not_compute_input(
    router: zmq.Socket[bytes],
) -> None:
    """Staged behind another batch on its worker (a GPU worker holds two), a batch
    waits there: its RESULT says how long, and that is queue time. compute_input keeps
    the rest of the round trip beside the model's own time (the transfers)."""

    async def body() -> None:
        clock = Clock()
        core, service = serving(router, clock, model(max_batch_size=4, queue=8, delay_us=0))
        worker = register(core, "w", core.models["m"].key)
        call = asyncio.ensure_future(service.infer(infer_msg(2), None))
        await until(lambda: len(worker.inflight) == 1, "the batch sent")
        clock.now += 0.001
        answer(core, worker, next(iter(worker.inflight.values())), waited_ns=300_000)
        await call
        m = core.stats.model("m", "1")
        assert (m.queue.ns, m.compute_infer.ns) == (300_000, INFER_NS)
        assert m.compute_input.ns == 1_000_000 - INFER_NS - 300_000

    run(body)


def test_a_request_refused_by_a_drain_counts_as_unavailable(router: zmq.Socket[bytes]) -> None:
    async def body() -> None:
        core, service = serving(router, Clock(), model())
        assert await service.drain(0) == 0
        with pytest.raises(Unavailable, match="shutting down"):
            await service.infer(infer_msg(1), None)
        m = core.stats.model("m", "1")
        assert (m.fail.count, dict(m.rejected), m.success.count) == (1, {"unavailable": 1}, 0)

    run(body)


def test_a_sequence_started_again_after_its_worker_was_lost_counts_one_wait(
    router: zmq.Socket[bytes],
) -> None:
    """Its first worker is lost before any output: the sequence starts again on another
    one. One request, one success, one wait for a slot (the first)."""

    async def body() -> None:
        clock = Clock()
        core, service = serving(router, clock, stepwise_model("gen"))
        key = core.models["gen"].key
        first = register(core, "w1", key)
        msg = pb.ModelInferRequest(model_name="gen")
        msg.inputs.add(name="N", datatype="INT64", shape=[1])
        msg.raw_input_contents.append(bytes(8))
        call = asyncio.ensure_future(service.infer(msg, None))
        await until(lambda: len(first.sequences) == 1, "the sequence started")
        clock.now += 0.002
        core.lose(first, "its process exited", stuck=False)
        second = register(core, "w2", key)
        await until(lambda: len(second.sequences) == 1, "the sequence started again")
        (seq_id,) = second.sequences
        step = wire.Header(kind=wire.Header.STEP, model="gen", active=1, round=1,
                           compute_ns=INFER_NS)  # fmt: skip
        step.steps.add(id=seq_id, tensors=1, final=True)
        step.tensors.add(name="OUT", datatype="INT64", shape=[1])
        core.on_message(second.identity, step, [(5).to_bytes(8, "little")])
        assert (await call).outputs[0].shape == [1]
        m = core.stats.model("gen", "1")
        assert (m.success.count, m.queue.count, m.queue.ns) == (1, 1, 0)
        assert (m.execution_count, m.compute_infer.count, m.compute_infer.ns) == (1, 1, INFER_NS)

    run(body)


def test_an_http_body_parsed_across_a_reload_is_answered_by_the_version_it_came_to(
    router: zmq.Socket[bytes],
) -> None:
    """A body parsed off the loop (of thousands of values) while a reload replaced its version was
    refused 404, "model 'm' has no version '1'", though its URL named none: the
    parsed message carried the version the route resolved, checked again after the
    parse. The request is the version's it was admitted to, which drains it."""

    async def body() -> None:
        core, service = serving(router, Clock(), model(max_batch_size=4, queue=8, delay_us=0))
        old = core.models["m"]
        worker = register(core, "w", old.key)

        async def parse() -> pb.ModelInferRequest:  # as rest.py's: the version resolved
            core.models["m"] = dataclasses.replace(old, version="2")  # (a reload, meanwhile)
            msg = infer_msg(1)
            msg.model_version = old.version
            return msg

        call = asyncio.ensure_future(service.infer((old, parse), None))
        await until(lambda: len(worker.inflight) == 1 or call.done(), "the request sent")
        assert not call.done(), call.exception()
        answer(core, worker, next(iter(worker.inflight.values())))
        response = await call
        assert (response.model_version, response.outputs[0].shape) == ("1", [1, 2])

    run(body)
