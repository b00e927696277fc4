"""A request that ended its worker twice: its inputs are refused a while, unrun
(server/quarantine.py), and the deaths it caused do not back the pool's restarts
off (server/supervisor.py). The real processes: test_failures.py's poison test."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import grpc
import pytest

from batchd.server import quarantine, recovery
from batchd.server.batching.split_join import split_request
from batchd.server.errors import ModelFailed, Refused
from batchd.server.quarantine import BREAK, HOLD_S, MOST, Quarantine
from batchd.server.request import Batch, Request, Tensor
from batchd.server.supervisor import BACKOFF_FIRST_S, Launch, Supervisor, WorkerSpec
from tests.conftest import Clock, model


def req(value: int, rows: int = 1, name: str = "m") -> Request:
    cfg = dataclasses.replace(model(), name=name)
    data = bytes([value]) * (rows * 2 * 4)
    return Request(cfg, "", [Tensor("X", "FP32", (rows, 2), data)], ("Y",), rows, float("inf"))


def test_the_same_inputs_are_refused_for_hold_s_and_no_others() -> None:
    clock = Clock()
    q = Quarantine(clock)
    q.check(req(1))  # nothing held
    q.add(req(1), "model 'm': the worker running this request was lost 2 times")
    assert list(q.held) == [req(1).model.key]
    with pytest.raises(ModelFailed) as refused:
        q.check(req(1))
    assert "refused unrun: the same inputs failed 0 s ago" in str(refused.value)
    assert str(refused.value).endswith("the worker running this request was lost 2 times")
    q.check(req(2))  # other data
    q.check(req(1, rows=2))  # other shape
    q.check(req(1, name="other"))  # another model
    other_version = dataclasses.replace(req(1).model, version="2")
    r = req(1)
    r.model = other_version
    q.check(r)  # another version: a reload starts with none held
    clock.now += HOLD_S - 1
    with pytest.raises(ModelFailed, match="refused for 1 s more"):
        q.check(req(1))
    clock.now += 1
    q.check(req(1))
    assert q.held == {}  # the core's hot path checks this dict only


def test_a_chunk_s_failure_holds_the_whole_request_s_inputs() -> None:
    """A request of more rows than a batch is split; the chunk that ended its worker
    holds the inputs of the request it came from, which is what comes again."""
    q = Quarantine(Clock())
    whole = req(3, rows=5)
    chunks = split_request(whole, 2)
    q.add(chunks[1], "lost")
    with pytest.raises(ModelFailed):
        q.check(req(3, rows=5))
    q.check(chunks[1])  # (a chunk is never admitted alone)


def test_inputs_past_digest_most_are_counted_not_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Their digest would hold the event loop (8 ms at DIGEST_MOST): such a request
    runs again, and counts towards its model's BREAK."""
    monkeypatch.setattr(quarantine, "DIGEST_MOST", 15)
    q = Quarantine(Clock())
    big, small = req(1, rows=2), req(2)  # 16 bytes, 8
    q.add(big, "lost big")
    q.add(small, "lost small")
    q.check(req(1, rows=2))
    with pytest.raises(ModelFailed, match=r"lost small$"):
        q.check(req(2))
    assert len(q.held[big.model.key]) == 2


def test_at_most_most_inputs_are_held_per_version_the_oldest_going() -> None:
    clock = Clock()
    q = Quarantine(clock)
    for i in range(MOST + 1):
        q.add(req(i), f"lost {i}")
        clock.now += 0.01
    oldest, next_oldest = req(0), req(1)
    oldest.background = next_oldest.background = True  # (a job's: the model is held too)
    q.check(oldest)
    with pytest.raises(ModelFailed, match=r"lost 1$"):
        q.check(next_oldest)
    assert len(q.held[req(0).model.key]) == MOST


def test_a_model_version_with_break_failures_in_hold_s_takes_no_online_request() -> None:
    """A model that crashes on a class of inputs, sent a new one each time: past BREAK
    failures in HOLD_S it is refused (UNAVAILABLE, with a pushback) till the oldest is
    HOLD_S old; a batch job's request only for its own inputs, another model never."""
    clock = Clock()
    q = Quarantine(clock)
    for i in range(BREAK - 1):
        q.add(req(i), f"lost {i}")
        clock.now += 10
    q.check(req(100))
    q.add(req(BREAK - 1), "lost last")
    with pytest.raises(Refused) as refused:
        q.check(req(100))
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(refused.value) == (
        f"model 'm' takes no requests for {HOLD_S - 10 * (BREAK - 1):.0f} s: {BREAK} of its "
        "requests ended their workers in the last 60 s, and it is held back so that the "
        "workers stay up for the other models (last: lost last)"
    )
    assert refused.value.trailers() == (
        ("grpc-retry-pushback-ms", str(int((HOLD_S - 10 * (BREAK - 1)) * 1000))),
    )
    job = req(100)
    job.background = True
    q.check(job)
    job.inputs = req(0).inputs
    with pytest.raises(ModelFailed):
        q.check(job)
    q.check(req(100, name="other"))
    clock.now += HOLD_S - 10 * (BREAK - 1)  # the oldest is HOLD_S old
    q.check(req(100))


def test_past_break_failures_a_model_version_s_job_lines_wait_till_the_oldest_expires() -> None:
    """A job's lines are not refused at BREAK (a refusal would fail each): they wait."""
    clock = Clock()
    q = Quarantine(clock)
    for i in range(BREAK - 1):
        q.add(req(i), f"lost {i}")
        assert q.paused_until("m@1") == 0.0
        clock.now += 10
    q.add(req(BREAK - 1), "lost last")
    assert q.paused_until("m@1") == clock.now - 10 * (BREAK - 1) + HOLD_S
    assert q.paused_until(req(0, name="other").model.key) == 0.0
    clock.now = q.paused_until("m@1")
    assert q.paused_until("m@1") == 0.0


def test_recovery_tells_of_each_request_out_of_attempts_only() -> None:
    """The poison (its second loss, alone) is told with its error; an innocent
    lost once beside it, and one lost while its worker loaded, are not."""
    poison, innocent, loading = req(1), req(2), req(3)
    loop = asyncio.new_event_loop()
    try:
        for r in (poison, innocent, loading):
            r.future = loop.create_future()
        poison.attempts = 1
        told: list[tuple[Request, str]] = []
        batch = Batch(1, poison.model, [poison, innocent], 0.0)
        back = recovery.after_loss(
            [batch], "cpu0#1", "killed", True, lambda r, why: told.append((r, why))
        )
        assert back == [innocent] and [r for r, _ in told] == [poison]
        assert told[0][1] == str(poison.future.exception())
        recovery.after_loss([Batch(2, loading.model, [loading], 0.0)], "cpu0#2", "x", False,
                            lambda r, why: told.append((r, why)))  # fmt: skip
        assert len(told) == 1
    finally:
        loop.close()


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    async def wait(self) -> int:
        self.returncode = -9
        return -9


def test_a_death_while_running_requests_is_restarted_without_backing_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crash loop backs off (0.2 s, doubling); a death the exit callback says ran
    requests is restarted after the first backoff, and does not double it. A stop
    during a backoff starts nothing more, and counts no restart."""
    ran = iter([False, False, True, True, False, False])
    sup = Supervisor(Launch(repository=Path("."), specs=(WorkerSpec("cpu0", "cpu", (), 1),)),
                     lambda wid, pid, why: next(ran))  # fmt: skip
    started: list[str] = []
    waits: list[float] = []

    async def start(spec: WorkerSpec, worker_id: str) -> Any:
        started.append(worker_id)
        return _Proc(len(started))

    real_sleep = asyncio.sleep

    async def sleep(s: float) -> None:
        waits.append(s)
        if len(waits) == 6:
            sup._stopping = True  # (stop() during this backoff)
        await real_sleep(0)

    monkeypatch.setattr(sup, "_start", start)
    monkeypatch.setattr("batchd.server.supervisor.asyncio.sleep", sleep)
    asyncio.run(sup.run())
    first = BACKOFF_FIRST_S
    assert waits == [first, 2 * first, first, first, first, 2 * first]
    assert len(started) == 6 and sup.restarts == {"cpu0": 5}
