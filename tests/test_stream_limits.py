"""A step-wise model's outputs against the bounds of one answer and of one stream:
a unary call's joined answer (server/unary_steps.py: no outputs, steps that do not
join, more than a response may carry, a sequence started over) and the byte budget
of a ModelStreamInfer stream whose caller does not read (request.StreamBudget).

The live tests run a server over a model written here, `wide`, with
--max-message-bytes 1 MiB: a stream then holds at most 2 MiB for its caller."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import math
import queue
import re
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos.model_config import GenerateConfig, ModelConfig, TensorSpec
from batchd.server import flow, recovery
from batchd.server.errors import ModelFailed, ResponseTooLarge
from batchd.server.flow import OUTPUT_COST, WINDOW, StepStream, StreamBudget
from batchd.server.request import Batch, Request, Tensor
from batchd.server.streaming import write_all
from batchd.server.unary_steps import Joined, follow
from tests.conftest import scrape, total, value
from tests.servers import ServerProcess, wait_for

MiB = 1 << 20
TIMEOUT_S = 3.0
WIDE_TOML = f"""
[[input]]
name = "ID"
datatype = "INT64"
shape = [1]

[[input]]
name = "N"
datatype = "INT64"
shape = [1]

[[input]]
name = "MODE"
datatype = "INT64"
shape = [1]

[[input]]
name = "WIDTH"
datatype = "INT64"
shape = [1]

[[output]]
name = "OUT"
datatype = "INT64"
shape = [1, -1]

[generate]
max_active = 4
max_steps = 1000

[instances]
execution_timeout_s = {TIMEOUT_S}
"""
WIDE_PY = '''
"""Sequence ID runs N steps. MODE 0: OUT [1, WIDTH] holding k at step k; MODE 1: no
output at any step; MODE 2: OUT [1, k]; MODE 3: OUT [1, WIDTH], a view of one k. $WIDE_LOG
gets a line per start and release."""
import json
import os

import torch


def note(**record):
    with open(os.environ["WIDE_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


class Wide:
    def start(self, requests):
        states = []
        for r in requests:
            s = {k: int(r[k][0]) for k in ("ID", "N", "MODE", "WIDTH")}
            s["k"] = 0
            note(started=s["ID"])
            states.append(s)
        return states

    def step(self, states):
        out = []
        for s in states:
            s["k"] += 1
            k, done = s["k"], s["k"] >= s["N"]
            note(step=s["ID"])
            if s["MODE"] == 1:
                out.append((None, done))
            else:
                width = k if s["MODE"] == 2 else s["WIDTH"]
                if s["MODE"] == 3:
                    out.append(({"OUT": torch.full((1, 1), k).expand(1, width)}, done))
                    continue
                out.append(({"OUT": torch.full((1, width), k, dtype=torch.int64)}, done))
        return out

    def release(self, state):
        note(released=state["ID"], k=state["k"])


def load(device):
    return Wide()
'''

# Step-wise: N steps, each with SMALL [1] (k) and BIG [1, WIDTH] (k everywhere).
TWO_TOML = f"""
[[input]]
name = "N"
datatype = "INT64"
shape = [1]

[[input]]
name = "WIDTH"
datatype = "INT64"
shape = [1]

[[output]]
name = "SMALL"
datatype = "INT64"
shape = [1]

[[output]]
name = "BIG"
datatype = "INT64"
shape = [1, -1]

[generate]
max_active = 8
max_steps = 1000

[instances]
execution_timeout_s = {TIMEOUT_S}
"""
TWO_PY = """
import torch


class Two:
    def start(self, requests):
        return [{"n": int(r["N"][0]), "w": int(r["WIDTH"][0]), "k": 0} for r in requests]

    def step(self, states):
        out = []
        for s in states:
            s["k"] += 1
            k = s["k"]
            big = torch.full((1, s["w"]), k, dtype=torch.int64)
            out.append(({"SMALL": torch.tensor([k]), "BIG": big}, k >= s["n"]))
        return out


def load(device):
    return Two()
"""
# One-shot: BLOB holds WIDTH int64 values.
BLOB_TOML = """
max_batch_size = 0

[[input]]
name = "WIDTH"
datatype = "INT64"
shape = [1]

[[output]]
name = "BLOB"
datatype = "INT64"
shape = [-1]
"""
BLOB_PY = """
import torch


def load(device):
    return lambda width: (torch.full((int(width[0]),), 7, dtype=torch.int64),)
"""


# ---- the pieces, without a server ----


def wide_model(max_steps: int = 50) -> ModelConfig:
    return ModelConfig(
        name="wide",
        directory=Path("."),
        artifact=Path("model.py"),
        platform="python",
        max_batch_size=0,
        inputs=(TensorSpec("N", "INT64", (1,)),),
        outputs=(
            TensorSpec("OUT", "INT64", (1, -1)),
            TensorSpec("FLAT", "INT64", (-1,)),
            TensorSpec("GRID", "FP32", (2, 3, -1)),
            TensorSpec("TEXT", "BYTES", (1,)),
        ),
        generate=GenerateConfig(4, max_steps, "continuous"),
    )


def unary(outputs: tuple[str, ...] = ("OUT", "FLAT", "GRID", "TEXT")) -> Request:
    r = Request(wide_model(), "u", [Tensor("N", "INT64", (1,), bytes(8))], outputs, 1, math.inf)
    r.stream = StepStream(held=True)
    return r


def out(k: int, width: int = 2, name: str = "OUT") -> Tensor:
    return Tensor(name, "INT64", (1, width), np.full(width, k, np.int64).tobytes())


def test_a_failure_its_caller_left_before_reading_is_taken_not_logged() -> None:
    """A stream's caller left (cancelled) after its sequence failed (stopped as it fell
    behind, its worker lost) but before it read the failure: asyncio logged "Future
    exception was never retrieved", an ERROR per sequence, which any client could cause."""

    class Core:
        def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
            self.future: asyncio.Future[list[Tensor]] = asyncio.get_running_loop().create_future()
            return self.future

        def cancel(self, request: Request) -> None:
            pass

    async def body() -> list[str]:
        logged: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, c: logged.append(c["message"]))
        core, r = Core(), unary()
        assert r.stream is not None and r.stream.push([out(1)])
        steps = follow(core, r)
        assert (await anext(steps))[0] == [out(1)]
        core.future.set_exception(ModelFailed("stopped: its caller took none of its outputs"))
        await steps.aclose()  # the caller left
        del core.future, steps
        await asyncio.sleep(0)  # (the done callbacks)
        gc.collect()
        return logged

    assert asyncio.run(body()) == []


def test_a_sequence_without_outputs_answers_each_requested_output_empty() -> None:
    """A first dim of 0, the other dims as declared, a variable one as 0."""
    joined = Joined(unary(), 1 * MiB).result()
    assert [(t.name, t.datatype, t.shape, bytes(t.data)) for t in joined] == [
        ("OUT", "INT64", (0, 0), b""),
        ("FLAT", "INT64", (0,), b""),
        ("GRID", "FP32", (0, 3, 0), b""),
        ("TEXT", "BYTES", (0,), b""),
    ]
    only = Joined(unary(("FLAT",)), 1 * MiB).result()
    assert [t.name for t in only] == ["FLAT"]


def test_steps_whose_other_dims_differ_fail_naming_the_output_and_the_shapes() -> None:
    joined = Joined(unary(("OUT",)), 1 * MiB)
    joined.add([out(1, width=1)])
    with pytest.raises(ModelFailed) as e:
        joined.add([out(2, width=2)])
    assert e.value.message == (
        "model 'wide': output 'OUT' came with shape [1, 1] at first and [1, 2] in the "
        "sequence's output number 2; a unary ModelInfer joins the steps along their first "
        "dimension, so their other dimensions must agree (ModelStreamInfer, or "
        "/generate_stream, streams each step's outputs as they are)"
    )


def test_joined_outputs_past_a_response_stop_the_sequence_and_point_to_streaming() -> None:
    joined = Joined(unary(("OUT",)), 64)
    for k in range(1, 5):  # 4 x 16 bytes: exactly the limit
        joined.add([out(k), out(k, name="FLAT")])  # an output not asked for is not counted
    with pytest.raises(ResponseTooLarge) as e:
        joined.add([out(5)])
    assert "passed 80 bytes at its output number 5" in e.value.message
    assert "(64, --max-message-bytes)" in e.value.message
    assert "use ModelStreamInfer (or /generate_stream)" in e.value.message


def test_a_unary_sequence_whose_worker_was_lost_starts_over_and_answers_its_new_run_once() -> None:
    """Its outputs were held for one answer: the caller saw none, so recovery starts it
    again (not UNAVAILABLE), what the lost run gave is dropped, and the answer is the
    new run's alone. A streamed one that had sent an output still fails."""
    r = unary(("OUT",))
    streamed = unary(("OUT",))
    streamed.stream = StepStream()
    joined = Joined(r, 1 * MiB)
    assert r.stream is not None and streamed.stream is not None
    for k in (1, 2):
        assert r.stream.push([out(k)]) and streamed.stream.push([out(k)])
    joined.add([out(1)])  # the first taken; the second still buffered
    loop = asyncio.new_event_loop()
    try:
        for req in (r, streamed):
            req.future = loop.create_future()
        batches = [Batch(1, r.model, [r], 0.0), Batch(2, r.model, [streamed], 0.0)]
        back = recovery.after_sequence_loss(batches, "cpu0#0", "killed")
        assert back == [r] and r.attempts == 1 and not r.future.done()
        assert "after 2 output(s) were streamed" in str(streamed.future.exception())
    finally:
        loop.close()
    assert r.stream.restarts == 1 and r.stream.push([out(7)], final=True)
    joined.add([out(7)])
    (answer,) = joined.result()
    assert answer.shape == (1, 2) and np.frombuffer(answer.data, np.int64).tolist() == [7, 7]
    again = Joined(r, 1 * MiB)  # restarted, and the new run yields nothing
    again.add([out(7)])
    r.stream.restart()
    assert again.result()[0].shape == (0, 0)


def test_a_stream_s_windows_hold_half_its_budget_and_steps_past_a_window_borrow_the_rest() -> None:
    """A step-wise request is read only while its window fits in half the stream's
    budget (the first always); outputs count until their caller took them; a step
    larger than its window borrows from the budget, one at a time at least, more while
    the limit allows, and repays once taken; a push past its credit is refused."""

    async def body() -> None:
        budget = StreamBudget(64 * 1024)
        assert budget.window == 4096  # a sixteenth: eight sequences' windows hold half
        for _ in range(8):
            await asyncio.wait_for(budget.room(sequence=True), 5)
        assert budget.reserved == 32 * 1024 and not budget.admits()
        ninth = asyncio.create_task(budget.room(sequence=True))
        await asyncio.sleep(0)
        assert not ninth.done()  # waits to be read
        budget.unreserve()
        await asyncio.wait_for(ninth, 5)  # a sequence ended: the next is read
        budget = StreamBudget(64 * 1024)  # three sequences' windows: 12 KiB
        for _ in range(3):
            await budget.room(sequence=True)
        streams = [StepStream(budget=budget, handed_on=True) for _ in range(3)]
        grants: list[list[int]] = [[], [], []]
        for s, g in zip(streams, grants, strict=True):
            s.grant = lambda more, paused, g=g: g.append(more)
        a, b, c = streams
        big = 24 * 1024 + OUTPUT_COST  # a step of 24 KiB: six windows
        assert a.wants(big, 1) and grants[0] == [big - a.window] and a.lent == big - a.window
        assert a.push([out(1, width=24 * 1024 // 8)]) and budget.held == big
        assert b.wants(big, 1) and grants[1] == [big - b.window]  # within the limit: lent too
        assert c.wants(big, 1) and grants[2] == [] and c.paused  # past it: waits its turn
        assert not c.push([out(1, width=24 * 1024 // 8)])  # its worker had no credit for it
        await a.next()  # handed on: still its caller's to take
        assert budget.held == big and grants[2] == []
        a.taken(big)  # gRPC took it: a repays, c borrows
        assert budget.held == 0 and a.lent == 0 and grants[0][-1] == a.window
        assert grants[2] == [big - c.window] and not c.paused
        solo = StreamBudget(4096)  # a window of half the budget or more: one at a time
        assert solo.window == 2 * OUTPUT_COST and solo.admits()
        await solo.room(sequence=True)
        assert not solo.admits()
        count = StepStream(limit=1)
        assert count.push([out(1)]) and not count.push([out(2)]) and count.full()

    asyncio.run(body())


def test_credit_goes_back_to_the_worker_as_the_caller_takes_outputs() -> None:
    """A sequence's window of credit: its outputs spend it, what its caller took goes
    back in pieces of half a window (or at once what a step held at its worker needs),
    and a restart gives a whole window again."""

    async def body() -> None:
        each = 16 + OUTPUT_COST
        budget = StreamBudget(128 * each)
        a = StepStream(budget=budget)
        assert a.window == 8 * each  # a sixteenth of the budget
        grants: list[tuple[int, bool]] = []
        a.grant = lambda more, paused: grants.append((more, paused))
        for k in range(8):
            assert a.push([out(k)])
        assert a.credit == 0 and a.paused  # its worker holds it now
        for _ in range(3):
            await a.next()
        assert grants == []  # 3 outputs taken: less than half a window
        await a.next()
        assert grants == [(4 * each, True)] and a.credit == 4 * each and not a.paused
        # a step held at its worker that its window holds waits for its caller's reading
        assert a.wants(5 * each, 1) and a.paused and a.lent == 0
        await a.next()  # then what it needs goes at once, not half a window
        assert grants[-1] == (each, True) and a.credit == 5 * each and not a.paused
        a.restart()  # its START again, on another worker: a whole window, no grant
        assert (a.credit, a.grant) == (a.window, None) and budget.held == 0
        assert StepStream().window == WINDOW  # a unary call's sequence: no budget

    asyncio.run(body())


def sent(s: StepStream, width: int, final: bool = False) -> bool:
    """What a worker does with one step of `width` INT64s: sends it if its credit covers
    it, else holds it and says what it needs (Step.need), sending it if that came."""
    cost = width * 8 + OUTPUT_COST
    if s.credit < cost:
        assert s.wants(cost, 1)
    return s.credit >= cost and s.push([out(1, width=width)], final)


def test_a_stream_that_is_not_read_holds_at_most_its_budget_however_its_sequences_end() -> None:
    """Sequences whose one step is larger than their window, each ending with it, on a
    stream whose caller reads nothing: each borrows in turn while what is held leaves
    room, and an ended one keeps the loan its outputs not taken hold (before: an ended
    sequence repaid its loan, the next borrowed "as nothing was lent", and 8 of them
    held 4x the budget). Steps within the window borrow nothing: a sequence not read
    runs a window ahead, not a budget (before: 120 steps of 16 KiB, 2 MiB, where its
    window was 128 KiB)."""

    async def body() -> None:
        budget, grants = StreamBudget(2 * MiB), lambda more, paused: None
        streams = []
        while budget.admits():
            await budget.room(sequence=True)
            streams.append(StepStream(budget=budget, handed_on=True))
            streams[-1].grant = grants
        assert len(streams) == 8
        waiting, moved = list(streams), True
        while moved:  # its worker sends each step once its credit came
            moved = False
            for s in list(waiting):
                if sent(s, (MiB - 4096) // 8, final=True):
                    s.close()  # its last step sent: the sequence ended
                    waiting.remove(s)
                    moved = True
        assert budget.held <= budget.limit and 0 < len(waiting) < 8
        small = StreamBudget(2 * MiB)
        await small.room(sequence=True)
        one = StepStream(budget=small, handed_on=True)
        one.grant = grants
        steps = 0
        while sent(one, 2048):  # 16 KiB a step
            steps += 1
        assert steps == small.window // (16 * 1024 + OUTPUT_COST) and small.lent == 0

    asyncio.run(body())


def test_a_window_stays_reserved_till_its_outputs_are_taken_and_counts_from_the_first() -> None:
    """An ended sequence's window goes back to the budget once its caller took its
    outputs, not when its last was queued (unread outputs were then counted in no
    window, and a loan beside them took a stream to 1.4x its budget). Its caller's not
    reading is
    timed from its first output (a sequence that waited in a queue past the model's
    execution_timeout_s was stopped as stalled at its first pause). Each tensor of a
    step counts OUTPUT_COST (a step of 64 tensors counted one)."""

    async def body() -> None:
        now = [100.0]
        budget = StreamBudget(64 * 1024)
        await budget.room(sequence=True)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(flow.time, "monotonic", lambda: now[0])
            s = StepStream(budget=budget, handed_on=True, reserved=True)
            s.grant = lambda more, paused: None
            now[0] += 60  # it waits in its queue a minute
            assert s.push([out(1), out(2, name="FLAT")], final=True)
            assert s.taken_at == 160.0 and s.out == 32 + 2 * OUTPUT_COST
        s.close()
        assert budget.reserved == budget.window  # its outputs are not taken yet
        s.taken(s.out)
        assert budget.reserved == 0

    asyncio.run(body())


def test_a_step_whose_tensors_pass_the_budget_goes_once_its_caller_caught_up() -> None:
    """64 tensors of 8 bytes under a budget of 64 KiB: with OUTPUT_COST a tensor the step
    needs 66,048, more than any loan could fit beside the windows, and its sequence
    waited until stopped as stalled, its caller reading as fast as it could. With the
    caller caught up and nothing lent, one loan goes whatever its size. A sequence whose
    first pause is such a wait is timed from then, and not while its caller has
    nothing to take (it was timed from its admission: stopped at once after a queue)."""

    async def body() -> None:
        now = [100.0]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(flow.time, "monotonic", lambda: now[0])
            budget = StreamBudget(64 * 1024)
            await budget.room(sequence=True)
            s = StepStream(budget=budget, handed_on=True, reserved=True)
            grants: list[int] = []
            s.grant = lambda more, paused: grants.append(more)
            now[0] += 60  # it waited in its queue a minute
            assert s.wants(64 * (8 + OUTPUT_COST), 64) and not s.paused and grants
            assert s.taken_at == 160.0 and not s.owed()
            other = StepStream(budget=budget, handed_on=True)
            other.grant = lambda more, paused: None
            assert other.wants(30 * 1024, 1) and other.paused  # its loan waits its turn
            now[0] += 10
            other.start_clock()  # (Sequences: paused with nothing to take is not a stall)
            assert other.taken_at == 170.0

    asyncio.run(body())


def test_a_loan_for_outputs_taken_goes_back_before_the_next_is_asked() -> None:
    """A sequence whose worker already holds a larger next step when its caller takes
    the step its loan paid for: it kept that loan and asked for the difference, which
    could not fit beside it, and no loan went while its own was out: it waited for
    ever, its caller caught up, its slot held. Now the loan goes back and the next is
    asked anew, and goes."""

    async def body() -> None:
        budget = StreamBudget(2 * 32768)
        await budget.room(sequence=True)
        s = StepStream(budget=budget, handed_on=True, reserved=True)
        s.grant = lambda more, paused: None
        many = [out(1, width=1, name=f"o{k}") for k in range(64)]
        assert s.wants(64 * (8 + OUTPUT_COST), 64) and s.push(many)
        assert s.wants(64 * (16 + OUTPUT_COST), 64) and s.paused  # a larger next step
        s.taken(s.out)  # the caller took the first
        assert not s.paused and budget.lent == s.lent == 64 * (16 + OUTPUT_COST) - s.window

    asyncio.run(body())


# ---- a server ----


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("wide")
    model = root / "repo" / "wide"
    model.mkdir(parents=True)
    (model / "model.toml").write_text(WIDE_TOML)
    (model / "model.py").write_text(textwrap.dedent(WIDE_PY))
    for name, toml, py in (("two", TWO_TOML, TWO_PY), ("blob", BLOB_TOML, BLOB_PY)):
        (root / "repo" / name).mkdir()
        (root / "repo" / name / "model.toml").write_text(toml)
        (root / "repo" / name / "model.py").write_text(textwrap.dedent(py))
    log = root / "wide.log"
    server = ServerProcess(
        root / "repo", "--max-message-bytes", str(MiB),
        log_dir=root, env={"WIDE_LOG": str(log)},
    ).start()  # fmt: skip
    yield server, log
    assert server.stop() == 0, server.log()


def records(log: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def stepped(log: Path, seq: int) -> int:
    """The steps the model ran for sequence `seq` so far."""
    return sum(1 for r in records(log) if r.get("step") == seq)


def released(log: Path, seq: int) -> int | None:
    """The step at which the worker released sequence `seq`, once it has."""
    return next((r["k"] for r in records(log) if r.get("released") == seq), None)


def named(
    model: str, rid: str, outputs: tuple[str, ...] = (), **inputs: int
) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model, id=rid)
    for name, number in inputs.items():
        msg.inputs.add(name=name, datatype="INT64", shape=[1])
        msg.raw_input_contents.append(np.array([number], np.int64).tobytes())
    for name in outputs:
        msg.outputs.add(name=name)
    return msg


def wide_request(seq: int, n: int, mode: int = 0, width: int = 1) -> pb.ModelInferRequest:
    return named("wide", str(seq), ID=seq, N=n, MODE=mode, WIDTH=width)


# The client's HTTP/2 window stays at its first 64 KiB (no BDP probing): what the
# server holds for a caller that does not read is not hidden in a grown window.
CHANNEL = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture
def stub(wide: tuple[ServerProcess, Path]) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(wide[0].url, options=CHANNEL) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body))
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_a_sequence_without_outputs_answers_unary_and_http_with_empty_outputs(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    answer = stub.ModelInfer(wide_request(1, 3, mode=1), timeout=60)
    assert [(o.name, list(o.shape)) for o in answer.outputs] == [("OUT", [0, 0])]
    assert list(answer.raw_output_contents) == [b""]
    body = {"ID": 2, "N": 3, "MODE": 1, "WIDTH": 1}
    status, joined = post(wide[0], "/v2/models/wide/generate", {**body, "id": "g"})
    assert status == 200, joined
    assert json.loads(joined) == {"model_name": "wide", "model_version": "1", "id": "g", "OUT": []}
    status, streamed = post(wide[0], "/v2/models/wide/generate_stream", {**body, "id": "s"})
    assert status == 200, streamed
    assert streamed == b""  # no output: no event, as Triton's


def test_an_sse_caller_that_reads_nothing_for_execution_timeout_s_is_let_go(
    wide: tuple[ServerProcess, Path],
) -> None:
    """Its request stayed open as long as its connection, on a write that waited for it,
    and its model version with it: an unload, or a reload, never ended. A write that
    waits past the model's execution_timeout_s now closes the connection."""
    server, log = wide
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.http_port))
    body = json.dumps({"ID": 11, "N": 250, "MODE": 0, "WIDTH": 16384}).encode()
    s.sendall(b"POST /v2/models/wide/generate_stream HTTP/1.1\r\nHost: [::1]\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    try:
        assert s.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        # (past TIMEOUT_S, and the time to read what the socket's buffers took at once)
        closed = re.compile(r"generate_stream: its caller read nothing for ([\d.]+) s; connection")
        wait_for(lambda: closed.search(server.log()), 60, "the stream nobody reads to be let go")
        assert TIMEOUT_S <= float(closed.findall(server.log())[-1]) <= TIMEOUT_S + 32
        wait_for(lambda: released(log, 11) is not None, 30, "the sequence to be released")
    finally:
        s.close()


def test_unary_steps_that_do_not_join_fail_as_the_model_s_fault(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(wide_request(3, 3, mode=2), timeout=60)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "output 'OUT' came with shape [1, 1] at first and [1, 2]" in (e.value.details() or "")
    streamed = list(stub.ModelStreamInfer(iter([wide_request(4, 3, mode=2)]), timeout=60))
    assert [list(r.infer_response.outputs[0].shape) for r in streamed] == [[1, 1], [1, 2], [1, 3]]


def test_a_unary_answer_past_the_message_limit_stops_its_sequence_at_once(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """128 KiB a step, 1 MiB a response: refused at the ninth output, not after the
    1000th, and the worker releases the sequence then (within the steps it had run
    before its CANCEL came)."""
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(wide_request(5, 1000, width=16384), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = e.value.details() or ""
    assert "passed 1179648 bytes at its output number 9" in details
    assert "use ModelStreamInfer (or /generate_stream)" in details
    wait_for(lambda: released(wide[1], 5) is not None, 30, "the worker to release sequence 5")
    assert (released(wide[1], 5) or 0) < 500  # stopped, not run to its end


def test_a_step_output_no_response_may_carry_is_refused_by_its_worker_unmade(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """A step whose output is a view of one value as 8 TiB (MODE 3): its worker made it,
    a RuntimeError here (INTERNAL), a worker's memory where it fits. Its START says what
    a response may carry: refused by its shape, RESOURCE_EXHAUSTED, unary or streamed."""
    server = wide[0]
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(wide_request(10, 3, mode=3, width=1 << 40), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    holds = f"output 'OUT' holds {8 << 40} bytes (shape [1, {1 << 40}], INT64), more "
    assert holds + f"than a response may carry ({MiB}, --max-message-bytes)" in (
        e.value.details() or ""
    )
    (refused,) = stub.ModelStreamInfer(
        iter([wide_request(11, 3, mode=3, width=1 << 40)]), timeout=60
    )
    assert holds in refused.error_message and "after 0 outputs" in refused.error_message
    code = refused.infer_response.parameters["error_code"].string_param
    assert code == "RESOURCE_EXHAUSTED"
    # an SSE stream's cap is its budget, twice the flag: said so (it said the flag's
    # name with twice its figure)
    status, said = post(server, "/v2/models/wide/generate_stream", {"ID": 12, "N": 3, "MODE": 3,
                                                                  "WIDTH": 1 << 40})  # fmt: skip
    assert status == 400, said  # (before its first event: an HTTP error, as /generate's)
    cap = f"({2 * MiB}, its stream's budget: 2x --max-message-bytes)"
    assert holds + f"than a response may carry {cap}" in json.loads(said)["error"], said


def test_a_step_of_exactly_the_cap_refused_by_its_frame_is_counted_as_too_large(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """A step of exactly 1 MiB passes its worker (its bytes are not more than the cap)
    and is refused as its response is framed (names, shapes: a few bytes more). Its
    failure was counted `cancelled` (the sequence closed under it), not what it was
    (late review 58d)."""
    server = wide[0]

    def too_large() -> float:
        return value(scrape(server), "batchd_inference_request_failure_total", model="wide",
                     version="1", reason="response_too_large")  # fmt: skip

    before = too_large()
    (refused,) = stub.ModelStreamInfer(iter([wide_request(12, 3, width=MiB // 8)]), timeout=60)
    assert "this response would take" in refused.error_message
    wait_for(lambda: too_large() == before + 1, 30, "it counted as response_too_large")


def _held(server: ServerProcess, log: Path, seq: int) -> None:
    """Wait until sequence `seq`, whose caller has read nothing, is held: the model ran
    at least its window of steps, and sequence 8, run meanwhile on another stream, had
    5 rounds that would have stepped it too."""
    cost = 16384 * 8 + OUTPUT_COST
    wait_for(lambda: total(scrape(server), "batchd_sequences_held") == 1, 60, "it to be held")
    assert stepped(log, seq) >= 1
    with grpc.insecure_channel(server.url, options=CHANNEL) as channel:
        another = pb_grpc.GRPCInferenceServiceStub(channel)
        other = list(another.ModelStreamInfer(iter([wide_request(8, 5)]), timeout=60))
    assert [r.infer_response.outputs[0].shape[0] for r in other] == [1] * 5
    # at most one budget of steps (2 MiB: 15): what its window and the budget lend hold
    assert stepped(log, seq) <= 2 * MiB // cost and released(log, seq) is None


def test_a_caller_slower_than_its_model_holds_its_sequence_and_gets_every_output(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """Flow control. Sequence 6 (40 outputs of 128 KiB) on a stream nobody reads at
    first is held at its worker, not run on and not stopped. Its caller then reads one
    output every 0.1 s, 4 s in all, longer than the model's execution_timeout_s: it
    gets all 40 in order, and the worker is not judged stuck. Before: 6 was stopped
    with RESOURCE_EXHAUSTED once its caller was 2 MiB behind."""
    server, log = wide
    sent: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
    sent.put(wide_request(6, 40, width=16384))
    behind = stub.ModelStreamInfer(iter(sent.get, None), timeout=120)
    values = []
    try:
        _held(server, log, 6)
        assert total(scrape(server), "batchd_sequences_held") == 1
        sent.put(None)
        for r in behind:
            assert not r.error_message, r.error_message
            values.append(r.infer_response.raw_output_contents[0][:8])
            time.sleep(0.1)  # a slow reader (the load, not a check)
    finally:
        behind.cancel()
    assert values == [np.array([k], np.int64).tobytes() for k in range(1, 41)]
    assert stepped(log, 6) == 40 and "lost" not in server.log()
    assert total(scrape(server), "batchd_sequences_held") == 0


def test_a_steady_reader_of_outputs_near_the_message_limit_gets_every_one(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """Outputs of 0.72 MiB (the limit is 1 MiB, a stream's budget 2 MiB) read one every
    0.1 s: an output taken left the budget before its response entered the stream's
    queue, so the budget looked empty for a moment, gave credit for an output it had
    no room for, and the sequence was stopped RESOURCE_EXHAUSTED after 4, its caller
    blamed for not reading. Every output comes now. An output over what a response may
    carry (1.5 MiB) is refused as too large, not as unread, and only its own sequence:
    one on the same stream whose outputs come beside it is answered whole."""
    width = int(0.72 * MiB) // 8
    got, error = 0, ""
    for r in stub.ModelStreamInfer(iter([wide_request(71, 12, width=width)]), timeout=120):
        error = error or r.error_message
        got += bool(r.infer_response.raw_output_contents)
        time.sleep(0.1)  # a slow, steady reader (the load, not a check)
    assert (got, error) == (12, "")
    both = [wide_request(72, 3, width=3 * MiB // 16), wide_request(73, 5, width=MiB * 6 // 80)]
    answers: dict[str, list[str]] = {"72": [], "73": []}
    for r in stub.ModelStreamInfer(iter(both), timeout=60):
        answers[r.infer_response.id].append(r.error_message)
        time.sleep(0.05)  # the reader's pace (the load, not a check)
    assert answers["73"] == [""] * 5  # (0.6 MiB each: with 72's held, past the budget)
    (refused,) = answers["72"]
    assert (
        "holds 1572864 bytes (shape [1, 196608], INT64), more than a response may carry "
        "(1048576, --max-message-bytes); the sequence was stopped" in refused
    ), refused


def test_a_caller_that_reads_nothing_for_execution_timeout_s_is_stopped_not_its_worker(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """A held sequence keeps its slot: one whose caller took nothing for the model's
    execution_timeout_s is stopped with RESOURCE_EXHAUSTED, saying so, and its slot
    freed (before flow control's fix, a caller with no deadline held it for ever).
    The worker is not lost: sequence 7, sent on the stream then, runs."""
    server, log = wide
    sent: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
    sent.put(wide_request(9, 250, width=16384))
    behind = stub.ModelStreamInfer(iter(sent.get, None), timeout=120)
    try:
        _held(server, log, 9)
        time.sleep(TIMEOUT_S + 1)  # its caller reads nothing meanwhile (the fault)
        sent.put(wide_request(7, 3))
        sent.put(None)
        responses = list(behind)
    finally:
        behind.cancel()
    by_id: dict[str, list[pb.ModelStreamInferResponse]] = {"9": [], "7": []}
    for r in responses:
        by_id[r.infer_response.id].append(r)
    *outputs, stopped = by_id["9"]
    assert 0 < len(outputs) <= 15 and not any(r.error_message for r in outputs)
    assert (
        f"this stream's caller took none of the outputs of model 'wide' for {TIMEOUT_S:g} s "
        "(its execution_timeout_s) while its sequence waited for it"
    ) in stopped.error_message
    error = stopped.infer_response
    assert error.parameters["error_code"].string_param == "RESOURCE_EXHAUSTED"
    assert error.parameters["triton_final_response"].bool_param
    assert released(log, 9) is not None and "lost" not in server.log()
    assert [r.infer_response.raw_output_contents[0] for r in by_id["7"]] == [
        np.array([k], np.int64).tobytes() for k in (1, 2, 3)
    ]


def test_a_caller_that_reads_steadily_through_a_grown_window_is_not_stopped(
    wide: tuple[ServerProcess, Path],
) -> None:
    """gRPC's HTTP/2 windows, grown by its bandwidth probes, take megabytes of a stream
    at once, then nothing till its caller has read through them: a caller taking a
    256 KiB output each 0.3 s saw its writes wait 2.3 s and was stopped as having taken
    none for execution_timeout_s (2 s; review 57a). It is given the time to read them."""
    server, _ = wide
    with grpc.insecure_channel(server.url) as channel:  # (BDP probing on: the default)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(iter([wide_request(140, 30, width=32768)]), timeout=120)
        got = []
        for r in call:
            assert not r.error_message, (len(got), r.error_message)
            got.append(r.infer_response.raw_output_contents[0])
            time.sleep(0.4)  # (the caller's pace: slow and steady)
    assert got == [np.full(32768, k, np.int64).tobytes() for k in range(1, 31)]


def test_a_stream_that_reads_nothing_holds_the_slots_once_not_once_per_request_it_sent(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """Eight sequences on one stream whose caller reads nothing: four take the slots and
    are held, four queue. Once the held ones are stopped (execution_timeout_s), the four
    queued behind them, read before, fail unstarted, and another caller's sequence takes
    a slot. Before, they took the slots in turn for another execution_timeout_s each
    round: a stream of 64 such requests kept another caller waiting 20 s (3 s limit)."""
    server, log = wide
    sent: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
    for k in range(8):
        sent.put(wide_request(200 + k, 250, width=16384))
    behind = stub.ModelStreamInfer(iter(sent.get, None), timeout=120)
    try:
        wait_for(lambda: total(scrape(server), "batchd_sequences_held") == 4, 60, "4 held")
        with grpc.insecure_channel(server.url, options=CHANNEL) as channel:
            another = pb_grpc.GRPCInferenceServiceStub(channel)
            other = list(another.ModelStreamInfer(iter([wide_request(299, 3)]), timeout=60))
        sent.put(None)
        responses = list(behind)
    finally:
        behind.cancel()
    assert [r.error_message for r in other] == [""] * 3
    errors = {int(r.infer_response.id): r.error_message for r in responses if r.error_message}
    ran = {s for s in range(200, 208) if stepped(log, s)}
    assert len(ran) == 4 and set(range(200, 208)) - ran <= set(errors), errors
    # a held one stopped (and failed those queued); the others too, unless the caller
    # read (list(behind)) before their own timers came: then they ran to their end
    assert ran & set(errors), errors
    for s, error in errors.items():
        said = "while its sequence waited for it" if s in ran else "was not started"
        assert said in error and "of model 'wide' for 3 s (its execution_timeout_s)" in error


@pytest.mark.parametrize(("sequences", "steps", "width"), [(4, 8, 65536), (16, 40, 1)])
def test_a_caller_reading_as_fast_as_it_can_gets_every_output_of_every_sequence(
    wide: tuple[ServerProcess, Path], stub: Any, sequences: int, steps: int, width: int
) -> None:
    """Sequences of one stream whose windows together pass its budget (4 of 512 KiB
    outputs, 2 MiB in all; 16 of 8-byte outputs, 256 KiB windows): a caller that reads
    as fast as it can is never cut. Before, their workers sent up to a window each, and
    the push past the budget stopped a sequence RESOURCE_EXHAUSTED, its caller blamed."""
    asked = [wide_request(100 + k, steps, width=width) for k in range(sequences)]
    got: dict[str, list[int]] = {m.id: [] for m in asked}
    for r in stub.ModelStreamInfer(iter(asked), timeout=120):
        assert not r.error_message, r.error_message
        raw = r.infer_response.raw_output_contents
        got[r.infer_response.id].append(int(np.frombuffer(raw[0][:8], np.int64)[0]))
    assert got == {m.id: list(range(1, steps + 1)) for m in asked}


def test_a_caller_asking_for_one_of_a_step_s_outputs_gets_every_step_and_costs_no_worker(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """SMALL of `two`, not its 8 KiB BIG: the worker charged BIG to the sequence's
    credit, the frontend (which dropped it) did not, so it gave no credit back, never
    saw the sequence held, and took the worker for stuck: 14 of 50 outputs, then the
    worker killed ("lost"), twice for a unary call. START now names the outputs asked
    for, and only those are sent and charged."""
    server, _ = wide
    asked = named("two", "s", ("SMALL",), N=50, WIDTH=1024)
    values = []
    for r in stub.ModelStreamInfer(iter([asked]), timeout=60):
        assert not r.error_message, r.error_message
        assert [o.name for o in r.infer_response.outputs] == ["SMALL"]
        values.append(int(np.frombuffer(r.infer_response.raw_output_contents[0], np.int64)[0]))
    assert values == list(range(1, 51))
    both = list(stub.ModelStreamInfer(iter([named("two", "b", N=50, WIDTH=1024)]), timeout=60))
    assert [r.error_message for r in both] == [""] * 50  # two tensors a step, both charged
    unary = stub.ModelInfer(named("two", "u", ("SMALL",), N=50, WIDTH=1024), timeout=60)
    assert [o.name for o in unary.outputs] == ["SMALL"]
    assert np.frombuffer(unary.raw_output_contents[0], np.int64).tolist() == values
    assert "lost" not in server.log()


def test_a_unary_step_over_a_response_is_refused_before_its_worker_sends_it(
    wide: tuple[ServerProcess, Path], stub: Any
) -> None:
    """One step of 2 MiB under --max-message-bytes 1 MiB, for a unary call: its worker
    refuses it by its shape, before it is made (it was given the credit, sent, and
    refused only once joined; then made, and refused by the frontend)."""
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(wide_request(121, 1, width=MiB // 4), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "holds 2097152 bytes (shape [1, 262144], INT64), more than a response may carry " in (
        e.value.details() or ""
    )


class ExecuteBatchError(Exception):  # (as gRPC's core names its refusal of an operation)
    pass


@pytest.mark.parametrize("refused", ["send_initial_metadata", "write"])
def test_a_caller_gone_before_its_headers_or_a_response_ends_its_stream_quietly(
    refused: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The headers were sent outside the handling of a refused write: a caller gone
    before them (a deadline of a few ms) logged an ERROR with a traceback (review 57a).
    The call ends as cancelled, which gRPC ends quietly (a DEBUG line): returning, it
    had gRPC send the status and the headers into the call the core had ended (57d)."""

    class Context:
        async def send_initial_metadata(self, metadata: Any) -> None:
            if refused == "send_initial_metadata":
                raise ExecuteBatchError("Failed grpc_call_start_batch")

        async def write(self, response: Any) -> None:
            raise ExecuteBatchError("Failed grpc_call_start_batch")

    async def responses() -> Any:
        yield pb.ModelStreamInferResponse()
        yield pb.ModelStreamInferResponse()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(write_all(Context(), gen := responses()))  # type: ignore[arg-type]
    assert gen.ag_frame is None and "ERROR" not in caplog.text  # (closed)


@pytest.mark.parametrize("taken", [1, 0])
def test_a_caller_that_leaves_while_its_responses_wait_for_room_logs_no_error(
    wide: tuple[ServerProcess, Path], taken: int
) -> None:
    """Three callers of 512 KiB outputs stop reading, then cancel, while the server's
    writes wait for room in their HTTP/2 windows: the write that fails ends each
    stream quietly. gRPC wrote the responses itself before, and logged an ERROR with a
    traceback (ExecuteBatchError) for each such caller; and where the first response's
    write failed, one for sending the headers twice (TOO_MANY_OPERATIONS)."""
    server, _ = wide
    before = server.log().count("ExecuteBatchError")
    for k in range(3):
        with grpc.insecure_channel(server.url, options=CHANNEL) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelStreamInfer(iter([wide_request(130 + 3 * taken + k, 40, width=65536)]))
            for _ in range(taken):  # the others wait for the window the caller never opens
                next(call)
            wait_for(lambda: total(scrape(server), "batchd_sequences_held") == 1, 30, "held")
            call.cancel()
        wait_for(lambda: total(scrape(server), "batchd_sequences_active") == 0, 30, "its end")
    assert server.log().count("ExecuteBatchError") == before, server.log()
