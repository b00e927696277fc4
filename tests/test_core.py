"""The core's decisions on the link's events, on an in-process socket, with no
worker process: a worker here is a READY message the test sends."""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import zmq

from batchd.protos import wire
from batchd.server import core as core_module
from batchd.server import frontends
from batchd.server.batching.lanes import SETTLE_S
from batchd.server.batching.scheduler import Scheduler
from batchd.server.core import Core
from batchd.server.errors import BatchdError, ModelFailed, StreamBehind
from batchd.server.flow import StepStream
from batchd.server.pool import WorkerHandle
from batchd.server.request import Request, Tensor
from batchd.server.stats import Stats
from batchd.server.supervisor import Launch, Supervisor
from tests.conftest import Clock, model, request, run, stepwise_model


@pytest.fixture
def router() -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind("inproc://batchd-test-core")
    yield sock
    sock.close(linger=0)
    ctx.term()


def ready(worker_id: str, pid: int = 7, frontends: int = 1) -> wire.Header:
    info = wire.WorkerInfo(
        worker_id=worker_id,
        device="cpu",
        pid=pid,
        protocol=wire.PROTOCOL_VERSION,
        frontends=frontends,
    )
    return wire.Header(kind=wire.Header.READY, worker=info)


def make_core(router: zmq.Socket[bytes], clock: Clock) -> tuple[Core, list[str]]:
    """A core serving model "m" (conftest.model), recording the workers it kills."""
    core = Core(router, Stats(), Path("."), clock=clock)
    core.control.start_with({"m": model()})
    killed: list[str] = []
    core.supervisor.kill = lambda name, pid: killed.append(name)  # type: ignore[method-assign]
    return core, killed


def register(core: Core, name: str, key: str, pid: int = 7, frontends: int = 1) -> WorkerHandle:
    """A worker that said READY and has `key` loaded (it never answers LOAD here)."""
    core.on_message(name.encode(), ready(name, pid, frontends), [])
    worker = core.pool.get(name.encode())
    assert worker is not None
    worker.models.add(key)
    return worker


def one_batch_on(core: Core, name: str) -> tuple[WorkerHandle, Request]:
    """Worker `name`, registered with model "m", running a batch of one request."""
    cfg = core.models["m"]
    worker = register(core, name, cfg.key)
    r = request(cfg)
    r.future = asyncio.get_running_loop().create_future()
    core.pool.hand(worker, cfg, [r], 0.0)
    return worker, r


def test_a_refused_send_does_not_reenter_the_pump(router: zmq.Socket[bytes]) -> None:
    """The worker's identity is unknown to the socket (ROUTER_MANDATORY): the send
    fails, the worker is lost and the request goes back, all without a nested pump;
    the one pump scheduled for later finds no worker and leaves it queued. It never
    left, so it is not charged an attempt: it was, and with --frontends N, whose other
    frontends hear of a death 3 s late and keep sending to it, innocent requests
    were failed as lost twice."""

    async def body() -> None:
        core, killed = make_core(router, Clock())
        cfg = core.models["m"]
        register(core, "gone", cfg.key)
        depth, deepest = [0], [0]
        pump = Scheduler.pump

        def counted(self: Scheduler, only: Any = None) -> None:
            depth[0] += 1
            deepest[0] = max(deepest[0], depth[0])
            try:
                pump(self, only)
            finally:
                depth[0] -= 1

        Scheduler.pump = counted  # type: ignore[method-assign]
        try:
            r = request(cfg)
            future = core.submit(r)
            assert deepest[0] == 1 and core.pool.workers() == [] and killed == ["gone"]
            assert not r.suspect and r.attempts == 0
            assert core.scheduler.queued_version(r.model.key) == 1
            await asyncio.sleep(0)  # the deferred pump runs
            assert not future.done() and core.scheduler.queued_version(r.model.key) == 1
        finally:
            Scheduler.pump = pump  # type: ignore[method-assign]

    run(body)


def test_a_start_that_could_not_be_sent_goes_back_uncharged(router: zmq.Socket[bytes]) -> None:
    """A step-wise sequence's START the socket refused never reached a worker: the
    sequence goes back to the queue as it was, its wait not yet counted."""

    async def body() -> None:
        core = Core(router, Stats(), Path("."), clock=Clock())
        core.supervisor.kill = lambda name, pid: None  # type: ignore[method-assign]
        cfg = stepwise_model("gen")
        core.control.start_with({"gen": cfg})
        register(core, "gone", cfg.key)
        r = Request(cfg, "", [Tensor("N", "INT64", (1,), bytes(8))], ("OUT",), 1, math.inf)
        r.stream = StepStream(limit=4)
        future = core.submit(r)
        assert core.pool.workers() == [] and not future.done()
        assert r.attempts == 0 and not r.suspect and r.stream.worker is None
        assert core.scheduler.queued_version(cfg.key) == 1
        assert core.stats.model("gen", "1").queue.count == 0  # (counted once it starts)

    run(body)


def test_a_batch_bounced_goes_back_uncharged_and_its_worker_takes_none_till_it_beats_free(
    router: zmq.Socket[bytes],
) -> None:
    """A worker another frontend's retry runs alone on bounces our batch unrun
    (worker/alone.py): its requests go back as they were, and nothing more goes to it
    until a heartbeat says the retry has gone (a bounce each pump, else); that beat
    sends the batch again, with no other event (every caller stalled, else)."""

    async def body() -> None:
        worker_side = router.context.socket(zmq.DEALER)
        worker_side.setsockopt(zmq.IDENTITY, b"w")
        worker_side.connect("inproc://batchd-test-core")
        try:
            core, killed = make_core(router, Clock())
            worker, r = one_batch_on(core, "w")
            (batch_id,) = worker.inflight
            bounced = wire.Header(kind=wire.Header.ERROR, batch_id=batch_id, bounced=True,
                                  error="bounced: another frontend's runs alone here")  # fmt: skip
            core.on_message(b"w", bounced, [])
            assert r.attempts == 0 and not r.suspect and not r.future.done() and killed == []
            assert worker.inflight == {} and core.scheduler.queued_version(r.model.key) == 1
            assert worker.others_alone and not worker.has_credit()
            await asyncio.sleep(0)  # a pump: nothing goes to it
            assert worker.inflight == {} and core.scheduler.queued_version(r.model.key) == 1
            core.on_message(b"w", wire.Header(kind=wire.Header.HEARTBEAT, alone=True), [])
            assert not worker.has_credit()
            core.on_message(b"w", wire.Header(kind=wire.Header.HEARTBEAT), [])
            await asyncio.sleep(0)
            (again,) = worker.inflight.values()
            assert again.requests == [r] and core.pool.workers() == [worker]
        finally:
            worker_side.close(linger=0)

    run(body)


def test_a_batch_that_cannot_be_built_fails_its_requests_and_holds_no_worker(
    router: zmq.Socket[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Joining the requests' inputs raised (a defect, or memory): it raised out of the
    pump after the batch was in the worker's in-flight table, so nothing was sent, the
    worker's credit stayed taken until execution_timeout_s, and the worker was then
    killed as stuck, again at every retry. Now those requests fail, and only they."""

    async def body() -> None:
        core, killed = make_core(router, Clock())
        cfg = core.models["m"]
        worker = register(core, "w", cfg.key)

        def broken(requests: list[Request]) -> Any:
            raise MemoryError("no room for the padded batch")

        monkeypatch.setattr(core_module, "join_inputs", broken)
        future = core.submit(request(cfg))
        assert future.done() and isinstance(future.exception(), BatchdError)
        assert "internal error building the batch: no room" in str(future.exception())
        assert worker.inflight == {} and worker.has_credit() and killed == []

    run(body)


def test_a_worker_registering_again_keeps_its_batch_and_is_not_killed(
    router: zmq.Socket[bytes],
) -> None:
    """READY again from the same process: kept as it is. From another process under
    the same id: the old one is gone, its requests retried, and nothing is killed
    (the id now names the new process)."""

    async def body() -> None:
        core, killed = make_core(router, Clock())
        worker, r = one_batch_on(core, "w")
        core.on_message(b"w", ready("w"), [])
        assert core.pool.workers() == [worker] and len(worker.inflight) == 1
        core.on_message(b"w", ready("w", pid=8), [])
        assert [w.info.pid for w in core.pool.workers()] == [8]
        assert killed == [] and r.suspect and r.attempts == 1

    run(body)


def test_a_worker_on_a_new_connection_gives_back_its_batch_uncharged(
    router: zmq.Socket[bytes],
) -> None:
    """A TCP reset while a batch was on the wire: the worker connected again and said
    READY, was kept "batches and all", and the batch it never got was waited on for
    execution_timeout_s; then the healthy worker was told to STOP. A READY on a new
    connection gives the batch back (not counted against it) and registers anew."""

    async def body() -> None:
        core, killed = make_core(router, Clock())
        worker, r = one_batch_on(core, "w")
        again = ready("w")
        again.worker.reconnected = True
        core.on_message(b"w", again, [])
        (anew,) = core.pool.workers()
        assert anew is not worker and not anew.inflight and killed == []
        assert r.attempts == 0 and r.spared and not r.future.done()
        assert core.scheduler.queued_version(r.model.key) == 1

    run(body)


def test_a_batch_past_its_execution_limit_stops_and_loses_its_worker(
    router: zmq.Socket[bytes],
) -> None:
    async def body() -> None:
        clock = Clock()
        core, killed = make_core(router, clock)
        cfg = core.models["m"]
        worker = register(core, "w", cfg.key)
        r = request(cfg)
        r.future = asyncio.get_running_loop().create_future()
        r.attempts = 1  # its second loss: it fails
        core.pool.hand(worker, cfg, [r], clock.now)
        core.on_tick(clock.now + 1)
        assert core.pool.workers() == [worker]
        # (a heartbeat interval more than its limit: no heartbeat said when it began)
        core.on_tick(clock.now + cfg.instances.execution_timeout_s + 2)
        assert core.pool.workers() == [] and killed == ["w"]
        assert isinstance(r.future.exception(), ModelFailed)
        assert "execution_timeout_s" in str(r.future.exception())

    run(body)


def test_a_silent_local_worker_of_several_frontends_is_busy_for_the_longest_limit(
    router: zmq.Socket[bytes],
) -> None:
    """A local worker silent with no batch of ours: one serving several frontends may be
    in another's forward holding the GIL, so it is not lost at 3 s (frontend 0 killed
    it), but not for ever either (a worker wedged on a child's batch, which only
    frontend 0 can kill, stayed so); a remote one is lost at 3 s, whatever /proc holds."""

    async def body() -> None:
        core, _ = make_core(router, Clock())  # model m: execution_timeout_s 60
        shared, alone = register(core, "s", "m@1", frontends=2), register(core, "a", "m@1")
        core.supervisor.pids = lambda: {"s": 7, "a": 7}  # type: ignore[method-assign]
        shared.loads.clear(), alone.loads.clear()  # (loaded: no load's allowance)
        assert core._may_be_silent(shared, 30.0) and not core._may_be_silent(shared, 63.5)
        assert not core._may_be_silent(alone, 3.5)
        # A remote one whose pid, on its host, is here a process of frontend 0's parent
        # (as two containers' pid 1 are) was taken for a child frontend's local worker.
        remote = register(core, "r", "m@1", pid=os.getpid(), frontends=2)
        remote.loads.clear()
        assert not core._may_be_silent(remote, 3.5)

    run(body)


def test_a_stream_too_far_behind_is_stopped_and_its_slot_freed(router: zmq.Socket[bytes]) -> None:
    """A caller that does not read its stream: the outputs buffered for it stop at
    the stream's bound, the sequence fails with StreamBehind (RESOURCE_EXHAUSTED,
    saying why), the worker is told to drop it, and its slot is free again."""

    async def body() -> None:
        worker_side = router.context.socket(zmq.DEALER)
        worker_side.setsockopt(zmq.IDENTITY, b"w")
        worker_side.connect("inproc://batchd-test-core")
        try:
            core = Core(router, Stats(), Path("."), clock=Clock())
            cfg = stepwise_model("gen")
            core.control.start_with({"gen": cfg})
            worker = register(core, "w", cfg.key)
            r = Request(cfg, "", [Tensor("N", "INT64", (1,), bytes(8))], ("OUT",), 1, math.inf)
            r.stream = StepStream(limit=4)
            future = core.submit(r)

            def received(kind: int) -> wire.Header:  # skipping the LOAD it was sent (and
                # the CANCEL of every sequence a worker registering anew hears first)
                while (header := wire.unpack(worker_side.recv_multipart())[0]).kind != kind:
                    assert header.kind == wire.Header.LOAD or header.batch_id == 0
                return header

            start = received(wire.Header.START)
            assert len(worker.sequences) == 1

            def step(k: int) -> None:
                header = wire.Header(kind=wire.Header.STEP, model="gen", active=1, round=k)
                header.steps.add(id=start.batch_id, tensors=1)
                header.tensors.add(name="OUT", datatype="INT64", shape=[1])
                core.on_message(b"w", header, [k.to_bytes(8, "little")])

            for k in range(1, 5):  # the bound: kept for the caller
                step(k)
            assert not future.done() and r.stream.sent == 4
            step(5)  # one too many
            with pytest.raises(StreamBehind, match="has not read its last 4 outputs"):
                future.result()
            assert StreamBehind.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert received(wire.Header.CANCEL).batch_id == start.batch_id
            assert worker.sequences == {} and r.stream.closed
            kept = [int.from_bytes(out[0].data, "little") for out, _ in r.stream._items]
            assert kept == [1, 2, 3, 4]  # what it had, in order; nothing past the bound
        finally:
            worker_side.close(linger=0)

    run(body)


def test_a_batch_says_whether_its_model_is_under_load(router: zmq.Socket[bytes]) -> None:
    """A lone request with nothing else of its model waiting or running: not loaded
    (the worker uses all its threads: one caller's latency); a batch of two, or a
    request while another batch runs: loaded (the worker leaves a core to the frontend)."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        cfg = core.models["m"]
        register(core, "w", cfg.key).credits = 4
        sent: list[wire.Header] = []

        def send(identity: bytes, parts: list[Any], copy: bool = True) -> None:
            sent.append(wire.unpack(parts)[0])

        core.link.send = send  # type: ignore[method-assign]

        def submitted(n: int = 1) -> list[Request]:
            rs = [request(cfg) for _ in range(n)]
            for r in rs:
                r.future = asyncio.get_running_loop().create_future()
            return rs

        core.send(cfg, submitted())
        core.send(cfg, submitted())  # the first batch is still running
        core.pool.workers()[0].inflight.clear()
        core.send(cfg, submitted(2))
        core.pool.workers()[0].inflight.clear()
        core.send(cfg, submitted())
        assert [h.loaded for h in sent] == [False, True, True, False]

    run(body)


def test_a_worker_registering_anew_drops_every_sequence_it_runs_for_this_frontend(
    router: zmq.Socket[bytes],
) -> None:
    """A worker this frontend process does not know (it replaced a killed frontend, or
    gave the worker up as lost) may still hold sequences for it: they step no more once
    their credit is spent, send nothing and would keep their slots for ever. The first
    thing it hears is CANCEL of every sequence (batch_id 0); a worker that only
    registers again (the same process) keeps its own."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        sent: list[wire.Header] = []
        core.link.send = lambda identity, parts, copy=True: sent.append(wire.unpack(parts)[0])  # type: ignore[method-assign]
        core.on_message(b"w", ready("w"), [])
        assert [(h.kind, h.batch_id) for h in sent[:1]] == [(wire.Header.CANCEL, 0)]
        sent.clear()
        core.on_message(b"w", ready("w"), [])  # the same process again: nothing dropped
        assert [h for h in sent if h.kind == wire.Header.CANCEL] == []

    run(body)


def test_a_worker_of_several_frontends_hears_pass_when_its_reply_leaves_us_nothing(
    router: zmq.Socket[bytes],
) -> None:
    """After a forward a worker of several frontends waits for each frontend that was
    in it (worker/gather.py): a reply whose pump sends that worker nothing is
    answered PASS; a reply followed by a batch is not, nor is a worker of ours alone."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        cfg = core.models["m"]
        shared = register(core, "s", cfg.key, frontends=2)
        sent: list[tuple[bytes, str]] = []

        def send(identity: bytes, parts: list[Any], copy: bool = True) -> None:
            sent.append((identity, wire.Header.Kind.Name(wire.unpack(parts)[0].kind)))

        core.link.send = send  # type: ignore[method-assign]

        async def answer(worker: WorkerHandle) -> None:
            (batch,) = worker.inflight.values()
            y = wire.Tensor(name="Y", datatype="FP32", shape=[1, 2])
            result = wire.Header(kind=wire.Header.RESULT, batch_id=batch.id, tensors=[y])
            core.on_message(worker.identity, result, [bytes(8)])
            await asyncio.sleep(0)  # the pump the reply scheduled runs

        first = core.submit(request(cfg))
        second = core.submit(request(cfg))  # waits: the worker holds its one batch
        await answer(shared)  # the pump sends `second`: no PASS
        assert first.done() and sent == [(b"s", "BATCH"), (b"s", "BATCH")]
        await answer(shared)  # nothing left to send
        assert second.done() and sent[2:] == [(b"s", "PASS")]
        sent.clear()
        core.lose(shared, "replaced by one of ours alone", stuck=False)
        alone = register(core, "a", cfg.key)
        third = core.submit(request(cfg))
        await answer(alone)
        kinds = [k for _, k in sent if k != "LOAD"]  # (a LOAD goes once the files are read)
        assert third.done() and kinds == ["CANCEL", "BATCH"]  # no PASS

    run(body)


BAD_OUTPUTS = [  # (tensors, frames, what the error says): model m's one output is Y FP32 [2]
    ([wire.Tensor(name="Y", datatype="NOPE", shape=[1, 2])], [bytes(8)], "expected FP32"),
    ([wire.Tensor(name="Z", datatype="FP32", shape=[1, 2])], [bytes(8)], "outputs ['Y']"),
    ([], [], "outputs ['Y'], got []"),
    ([wire.Tensor(name="Y", datatype="FP32", shape=[1, -1, -2])], [bytes(8)], "shape [1, -1, -2]"),
    ([wire.Tensor(name="Y", datatype="FP32", shape=[1, 2])], [bytes(4)], "needs 8 bytes, got 4"),
    ([wire.Tensor(name="Y", datatype="FP32", shape=[1, 2])], [], "1 outputs came in 0 frames"),
]


@pytest.mark.parametrize(("tensors", "frames", "says"), BAD_OUTPUTS)
def test_a_reply_that_is_not_the_model_s_outputs_fails_its_batch_only(
    router: zmq.Socket[bytes], tensors: list[wire.Tensor], frames: list[bytes], says: str
) -> None:
    """A RESULT from a peer that is not a batchd worker (a broken one, another build)
    whose outputs are not the model's: an unknown datatype raised KeyError out of the
    link and stopped the server; a missing output was UNKNOWN "KeyError"; a negative
    dim or short frame went to the caller. The batch fails, ModelFailed saying what
    came; the worker's next batch is answered."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        cfg = core.models["m"]
        worker = register(core, "w", cfg.key)
        core.link.send = lambda *_, **__: None  # type: ignore[method-assign]

        def reply(tensors: list[wire.Tensor], frames: list[bytes]) -> None:
            (batch,) = worker.inflight.values()
            header = wire.Header(kind=wire.Header.RESULT, batch_id=batch.id, tensors=tensors)
            core.on_message(b"w", header, frames)

        bad = core.submit(request(cfg))
        reply(tensors, frames)
        with pytest.raises(
            ModelFailed, match=f"on worker w returned bad outputs: .*{re.escape(says)}"
        ):
            bad.result()
        await asyncio.sleep(0)
        good = core.submit(request(cfg))
        reply([wire.Tensor(name="Y", datatype="FP32", shape=[1, 2])], [bytes(8)])
        assert good.result()[0].shape == (1, 2)

    run(body)


def test_a_step_that_is_not_the_model_s_outputs_ends_its_sequence(
    router: zmq.Socket[bytes],
) -> None:
    """A STEP whose outputs are not the model's (here an unknown datatype, which went to
    the caller as it came) ends its sequence with ModelFailed, and frees its slot."""

    async def body() -> None:
        core = Core(router, Stats(), Path("."), clock=Clock())
        cfg = stepwise_model("gen")
        core.control.start_with({"gen": cfg})
        worker = register(core, "w", cfg.key)
        core.link.send = lambda *_, **__: None  # type: ignore[method-assign]
        r = Request(cfg, "", [Tensor("N", "INT64", (1,), bytes(8))], ("OUT",), 1, math.inf)
        r.stream = StepStream(limit=4)
        future = core.submit(r)
        (sequence_id,) = worker.sequences
        header = wire.Header(kind=wire.Header.STEP, model="gen", active=1, round=1)
        header.steps.add(id=sequence_id, tensors=1)
        header.tensors.add(name="OUT", datatype="NOPE", shape=[1])
        core.on_message(b"w", header, [bytes(8)])
        with pytest.raises(ModelFailed, match="sent bad outputs: output 'OUT': expected INT64"):
            future.result()
        assert worker.sequences == {} and r.stream.sent == 0

    run(body)


def test_the_supervisor_kills_the_process_of_that_worker_s_pid_only() -> None:
    """A peer that registered under a local worker's id and went silent had the healthy
    local worker of that id killed: a stuck worker is killed by its id and its pid."""
    killed: list[int] = []
    sup = Supervisor(Launch(repository=Path(".")), lambda name, pid, reason: False)
    proc = SimpleNamespace(pid=41, returncode=None, kill=lambda: killed.append(41))
    sup._procs["cpu0"] = ("cpu0#0", proc)  # type: ignore[assignment]
    sup.kill("cpu0#0", 99)  # (the impostor's pid)
    assert killed == []
    sup.kill("cpu0#0", 41)
    assert killed == [41]


def test_the_supervisor_kills_only_process_groups_its_workers_lead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a killed worker's model started goes with its process group, only where that
    worker was seen to lead one as it started: a pid alone named any group (these tests'
    fake workers, pids 1 and 41, had the test run SIGKILL process group 1, the machine's)."""
    groups: list[int] = []
    monkeypatch.setattr("batchd.server.supervisor.os.killpg", lambda pid, sig: groups.append(pid))
    sup = Supervisor(Launch(repository=Path(".")), lambda name, pid, reason: False)
    proc = SimpleNamespace(pid=41, returncode=None, kill=lambda: None)
    sup._procs["cpu0"] = ("cpu0#0", proc)  # type: ignore[assignment]
    sup.kill("cpu0#0", 41)
    assert groups == []
    sup._groups.add(41)  # (as _start records a worker that leads its group)
    sup.kill("cpu0#0", 41)
    assert groups == [41]


def test_a_local_worker_s_exit_loses_that_process_only(router: zmq.Socket[bytes]) -> None:
    """The supervisor saw local worker cpu0#0 exit: every handle of that id was lost,
    a peer that registered under it with its own pid too, its batches requeued."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        cfg = core.models["m"]
        register(core, "cpu0#0", cfg.key, pid=99)  # (the peer; the local one was replaced)
        core.worker_exited("cpu0#0", 41, "process exited (killed by SIGKILL)")
        assert [w.info.pid for w in core.pool.workers()] == [99]
        core.worker_exited("cpu0#0", 99, "process exited (code 1)")
        assert core.pool.workers() == []

    run(body)


def test_a_request_of_a_worker_lost_while_loading_goes_back_uncharged_as_a_suspect(
    router: zmq.Socket[bytes],
) -> None:
    """A worker lost while it loaded a model and ran a batch: either may be the cause.
    Its request goes back uncharged, as a suspect: alone, so that its next loss is its
    own. It waits for a worker that loads nothing, from when it first finds one idle:
    a load till it is done, a sequence SETTLE_S, half its time left at most (a suspect
    waiting out every model's load hit its deadline); sent at once, its death there was
    not its own either, and a poison ended a third worker (review 54a)."""

    async def body() -> None:
        clock = Clock()
        core, _ = make_core(router, clock)
        lost, r = one_batch_on(core, "cpu0#0")
        lost.load_sent["other@1"] = 0.0
        core.worker_exited("cpu0#0", 7, "killed")
        assert (r.attempts, r.suspect) == (0, True)
        clock.now += 5.0  # (the worker's restart: not counted in the wait)
        loading = register(core, "cpu0#1", core.models["m"].key, pid=8)
        loading.load_sent["other@1"] = 0.0
        core.link.send = lambda identity, *a, **k: ""  # type: ignore[method-assign]
        core.scheduler.pump()
        assert loading.inflight == {} and r.settle_from == clock.now
        clock.now += SETTLE_S + 3600  # a load, however long: it waits on (no deadline)
        core.scheduler.pump()
        assert loading.inflight == {}
        loading.others["gen@1"] = 1  # a sequence runs there now: SETTLE_S at most
        core.scheduler.pump()
        batch = next(iter(loading.inflight.values()))
        assert batch.requests == [r] and batch.suspect
        lost, r = one_batch_on(core, "cpu1#0")  # and again, the load done in time
        core.worker_exited("cpu1#0", 7, "killed")
        core.pool.leave(loading)
        settling = register(core, "cpu1#1", core.models["m"].key, pid=9)
        settling.load_sent["other@1"] = 0.0
        core.scheduler.pump()
        assert settling.inflight == {}
        settling.load_sent.clear()  # (the load done)
        core.scheduler.pump()
        assert next(iter(settling.inflight.values())).requests == [r]

    run(body)


@pytest.mark.parametrize("frontends", [(1, 1), (2, 2), (1, 2)])
def test_a_request_spared_beside_a_load_counts_it_when_it_dies_alone_if_loads_are_all_seen(
    router: zmq.Socket[bytes], frontends: tuple[int, int]
) -> None:
    """A loss as its worker loaded a model spares a request; its next, alone where this
    frontend loads nothing, counts both (a poison ended 3 workers: review 54j). Not under
    --frontends N: another frontend's load there is unseen, so that death may be a load's
    (review 55e: an innocent failed, its inputs quarantined): it counts once, as before;
    so where it dies on a worker other frontends share, the first one not (review 55f)."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        core.link.send = lambda identity, *a, **k: ""  # type: ignore[method-assign]
        cfg = core.models["m"]
        lost = register(core, "cpu0#0", cfg.key, pid=7, frontends=frontends[0])
        r = request(cfg)
        r.future = asyncio.get_running_loop().create_future()
        core.pool.hand(lost, cfg, [r], 0.0)
        lost.load_sent["other@1"] = 0.0  # (it loads another model)
        core.worker_exited("cpu0#0", 7, "killed")
        assert r.spared and not r.future.done()
        again = register(core, "cpu0#1", cfg.key, pid=8, frontends=frontends[1])
        core.scheduler.pump()
        assert [b.requests for b in again.inflight.values()] == [[r]]  # alone, settled
        core.worker_exited("cpu0#1", 8, "killed")
        assert r.future.done() is (frontends == (1, 1))
        assert bool(core.quarantine.held) is (frontends == (1, 1))

    run(body)


def test_a_batch_lost_beside_a_sequence_just_begun_is_spared_once_and_not_quarantined(
    router: zmq.Socket[bytes],
) -> None:
    """The sequence's start() may as well have ended the worker: in a step-wise poison
    storm, a bystander's request lost twice beside it had its inputs refused. Beside
    sequences that have stepped, the batch is charged; it is remembered only when it
    ran alone on its worker (reviews 50a, 50b: innocents refused, a healthy model held)."""

    async def body() -> None:
        gen = stepwise_model("gen")
        core, _ = make_core(router, Clock())
        core.control.start_with({"m": model(), "gen": gen})
        for name, stepped in (("cpu0#0", False), ("cpu1#0", True)):
            worker, r = one_batch_on(core, name)
            r.attempts = 1  # (its last chance)
            worker.models.add(gen.key)
            seq = Request(gen, "", [Tensor("N", "INT64", (1,), bytes(8))], ("OUT",), 1, math.inf)
            seq.future, seq.stream = asyncio.get_running_loop().create_future(), StepStream()
            seq.stream.sent = int(stepped)  # (what push() counts)
            core.pool.start(worker, gen, seq, 0.0)
            core.worker_exited(name, 7, "killed")
            assert r.future.done() is stepped and r.spared is not stepped
        assert core.quarantine.held == {}
        slow, r = one_batch_on(core, "cpu3#0")  # past its execution limit: maybe only slow
        r.attempts = 1
        core.lose(slow, "ran past execution_timeout_s 1.0")
        assert r.future.done() and core.quarantine.held == {}
        _, r = one_batch_on(core, "cpu2#0")
        r.attempts = 1
        core.worker_exited("cpu2#0", 7, "killed")
        assert r.future.done() and list(core.quarantine.held) == [core.models["m"].key]

    run(body)


def test_a_lost_worker_is_said_to_have_run_requests_if_it_had_batches_and_no_load(
    router: zmq.Socket[bytes],
) -> None:
    """worker_exited tells the supervisor whether the process ran requests when it
    ended: not a crash loop, restarted without backing off (a load that ends its
    process is one, and an idle worker's end)."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        _, r = one_batch_on(core, "cpu0#0")
        assert core.worker_exited("cpu0#0", 7, "killed") is True and r.attempts == 1
        register(core, "cpu1#0", core.models["m"].key, pid=8)
        assert core.worker_exited("cpu1#0", 8, "killed") is False
        loading, _ = one_batch_on(core, "cpu2#0")
        loading.load_sent["other:1"] = 0.0
        assert core.worker_exited("cpu2#0", 7, "killed") is False
        _, line = one_batch_on(core, "cpu4#0")  # a job's line alone: as an online one (its
        line.background = True  # lane waits once the quarantine holds its model version)
        assert core.worker_exited("cpu4#0", 7, "killed") is True
        pair, _ = one_batch_on(core, "cpu6#0")  # one batch of two requests: it backs off
        other = request(core.models["m"])
        other.future = asyncio.get_running_loop().create_future()
        (batch,) = pair.inflight.values()
        batch.requests.append(other)  # (a job's full batch that ends it every time, its
        assert core.worker_exited("cpu6#0", 7, "killed") is False  # lines fine alone)
        two, _ = one_batch_on(core, "cpu5#0")  # two batches: not plainly its own doing
        other = request(core.models["m"])
        other.future = asyncio.get_running_loop().create_future()
        core.pool.hand(two, core.models["m"], [other], 0.0)
        assert core.worker_exited("cpu5#0", 7, "killed") is False
        assert core.worker_exited("cpu3#0", 7, "killed") is False  # (none of that name)

    run(body)


def test_a_child_frontend_s_worker_killed_while_it_loads_is_lost_at_once(
    router: zmq.Socket[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child frontend gave a silent worker that was loading a model LOADING_SILENCE_S
    (120 s) before it looked whether its process was alive: one SIGKILLed held a
    batch of another model until its execution_timeout_s (32 s). A child frontend's
    workers are all frontend 0's: one whose process is gone is lost at once."""

    dead = subprocess.Popen(["true"])
    dead.wait()

    async def body() -> None:
        core, _ = make_core(router, Clock())
        worker, r = one_batch_on(core, "w")
        worker.info.pid = dead.pid
        worker.loads["other@1"] = asyncio.get_running_loop().create_future()  # loading
        monkeypatch.setenv(frontends.PARENT, str(os.getpid()))
        core.on_tick(0.0)  # each heartbeat round: before any silence is judged
        assert core.pool.workers() == [] and r.attempts == 1 and not r.future.done()

    run(body)


def test_a_child_frontend_says_a_gone_worker_exited_not_that_its_batch_ran_late(
    router: zmq.Socket[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGKILLed under a 20 ms batch was reported by a child frontend as the
    batch that "ran past execution_timeout_s": its limit passed before the 3 s of
    silence that told the child of the death, and callers got the wrong cause."""
    dead = subprocess.Popen(["true"])
    dead.wait()

    async def body() -> None:
        clock = Clock()
        core, _ = make_core(router, clock)
        worker, r = one_batch_on(core, "w")
        worker.info.pid, r.attempts = dead.pid, 1  # (its second loss: it fails, saying why)
        monkeypatch.setenv(frontends.PARENT, str(os.getpid()))
        core.on_tick(clock() + 3600)  # long past any execution limit
        with pytest.raises(ModelFailed, match=r"w: its process exited\)"):
            r.future.result()

    run(body)


def test_a_model_whose_worker_was_lost_waits_for_one_not_broken_by_another_s_old_error(
    router: zmq.Socket[bytes],
) -> None:
    """A worker set up without model m said it could not load it; the worker that
    served m was then lost: m was taken for broken on the first one's word, its
    queued and new requests failing UNAVAILABLE at once while ServerReady said true.
    It waits for a worker to come back (its own, restarted), as with none at all."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        key = core.models["m"].key
        bad = register(core, "bad", key)
        bad.models.discard(key)
        bad.loads.pop(key).set_result("")  # (its LOADED said why not, as on_loaded keeps it)
        bad.load_errors[key] = "no model named 'm' in its repository"
        good = register(core, "good", key)
        good.loads[key].set_result("")  # (loaded)
        core.lose(good, "no message for 3.5 s")
        assert core.control.broken == {} and core.control.load_error("m") is None
        r = request(core.models["m"])
        future = core.submit(r)
        await asyncio.sleep(0)
        assert not future.done() and core.scheduler.queued_version(r.model.key) == 1

    run(body)


def test_a_worker_back_unloads_only_versions_of_models_this_frontend_loaded(
    router: zmq.Socket[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under explicit model control a worker that registers again has the versions it
    holds and this frontend does not serve unloaded (retired while it was away), but
    only of models this frontend loaded: one worker serving two servers lost each
    server's models to the other's UNLOADs, and a server broke for good."""

    async def body() -> None:
        core, _ = make_core(router, Clock())
        core.control.explicit = True
        unloads: list[tuple[str, str]] = []
        monkeypatch.setattr(core.control, "_send_unload", lambda w, n, v: unloads.append((n, v)))
        again = ready("w")
        again.worker.held[:] = ["m@1", "m@0", "theirs@1"]  # (m@1 serves; m@0 it retired)
        core.on_message(b"w", again, [])
        assert unloads == [("m", "0")]

    run(body)
