"""A caller's pace (server/pace.py): how long one that takes nothing of its stream is
waited for, given what its connection took at once before (gRPC's grown HTTP/2
windows, the kernel's socket buffers), and HTTP's PatientStream that waits so long."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from batchd.server import pace
from batchd.server.flow import StreamBudget
from batchd.server.pace import MAX_BURST, MIN_READ_RATE, Pace, PatientStream

KiB = 1024


def test_what_the_connection_took_and_may_not_be_read_yet_is_given_time_to_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leaky bucket: each write taken adds its bytes, drained at MIN_READ_RATE. Counted
    since a write last waited, a stream read promptly never drained: a caller that had
    read 16 MiB at once and then stopped was given 32 s more (review 57e)."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    p = Pace()
    assert p.patience(2.0) == 2.0  # nothing taken yet: the limit alone
    for _ in range(16):  # 4 MiB taken at once
        p.took(256 * KiB)
    assert p.patience(2.0) == 2.0 + 4 * 1024 * KiB / MIN_READ_RATE
    now[0] += 4 * 1024 * KiB / MIN_READ_RATE  # as long as reading it takes: drained
    p.took(256 * KiB)
    assert p.patience(2.0) == 2.0 + 256 * KiB / MIN_READ_RATE
    for _ in range(100):
        p.took(1024 * KiB)
    assert p.patience(2.0) == 2.0 + MAX_BURST / MIN_READ_RATE  # (at most MAX_BURST)


def _stream(monkeypatch: pytest.MonkeyPatch, waits: list[float], seconds: float) -> Any:
    """A PatientStream whose writes each wait as long as `waits` says, in turn."""

    async def write(self: web.StreamResponse, data: Any) -> None:
        await asyncio.sleep(waits.pop(0))

    monkeypatch.setattr(web.StreamResponse, "write", write)
    request = make_mocked_request("GET", "/v2/jobs/x/results")
    return PatientStream(request, seconds), request


def test_an_sse_caller_that_reads_through_the_socket_buffers_is_not_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's socket buffers take megabytes of an answer at once, then a write
    waits till the caller has read through half of them: a caller reading 256 KiB each
    0.3 s was let go as having read nothing for 2 s (review 57a)."""
    waits = [0.0] * 16 + [1.5, 0.0]  # 4 MiB at once, then a write waits 1.5 s, past 1 s

    async def scenario() -> None:
        stream, request = _stream(monkeypatch, waits, 1.0)
        for _ in range(18):
            await stream.write(b"x" * 256 * KiB)
        assert not request.transport.abort.called

    asyncio.run(scenario())
    assert waits == []


def test_a_caller_that_reads_nothing_is_let_go_after_the_limit_and_what_it_was_sent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its connection took 1 MiB at once, then nothing: it is let go once its write has
    waited the limit (0.5 s) and the time to read that 1 MiB (at 1 MiB/s here)."""
    monkeypatch.setattr(pace, "MIN_READ_RATE", 1024 * KiB)
    caplog.set_level(logging.INFO, "batchd.server")

    async def scenario() -> None:
        stream, request = _stream(monkeypatch, [0.0] * 4 + [600.0], 0.5)
        for _ in range(4):
            await stream.write(b"x" * 256 * KiB)
        with pytest.raises(ConnectionResetError):
            await stream.write(b"x")
        assert request.transport.abort.called

    asyncio.run(scenario())
    assert "results: its caller read nothing for 1.5 s; connection closed" in caplog.text


def test_a_prompt_reader_s_bucket_drains_though_its_stall_clock_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bucket drained from taken_at, which each new output held after none moves too
    (the stall clock): a caller taking a 64 KiB output each 0.3 s kept all it had ever
    taken in it, 1,280 KiB after 20, and was given that much more time when it stopped
    (late review 57g)."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    budget = StreamBudget(1 << 30)
    for _ in range(20):
        now[0] += 0.3
        budget.hold(64 * KiB)  # (nothing held before: the stall clock starts now)
        budget.took(64 * KiB)
        budget.give(64 * KiB)
    assert budget.burst == 64 * KiB  # (each 0.3 s drains 76.8 KiB at 256 KiB/s)
