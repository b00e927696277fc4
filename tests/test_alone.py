"""worker/alone.py: a retry runs alone on a worker several frontends share (pure state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from batchd.protos import wire
from batchd.worker import runner as runner_module
from batchd.worker.alone import RESERVE_S, Alone, bounce
from batchd.worker.runner import Runner, RunnerOptions

BATCH = wire.Header(kind=wire.Header.BATCH, batch_id=5)
RETRY = wire.Header(kind=wire.Header.BATCH, batch_id=6, alone=True)


def test_a_retry_here_keeps_the_other_frontends_batches_off_till_it_has_run() -> None:
    alone = Alone()
    assert alone.admit(0, RETRY, now=0.0)
    assert not alone.admit(1, BATCH, now=0.0)  # bounced
    assert alone.others(1, 0.0) and not alone.others(0, 0.0)  # (the heartbeats' word)
    alone.ran(0, RETRY)
    assert alone.admit(1, BATCH, now=0.0) and not alone.others(1, 0.0)


def test_a_retry_that_finds_other_work_is_bounced_and_the_worker_kept_for_it() -> None:
    """Queued behind another frontend's batch, a retry died with it when that batch was
    a poison: it is bounced, and the worker takes no other frontend's batch till it is
    back (its frontend's next heartbeat) or RESERVE_S has passed."""
    alone = Alone()
    assert alone.admit(1, BATCH, now=0.0)  # queued, or running
    assert not alone.admit(0, RETRY, now=0.0)
    assert not alone.admit(1, BATCH, now=0.1)  # kept for frontend 0's retry
    assert alone.others(1, 0.1) and not alone.others(0, 0.1)
    alone.ran(1, BATCH)
    assert alone.admit(0, RETRY, now=1.0)  # drained: it runs
    alone.ran(0, RETRY)
    assert not alone.others(1, 1.0) and alone.admit(1, BATCH, now=1.0)
    assert not alone.admit(0, RETRY, now=2.0)  # kept again, then not back:
    assert not alone.others(1, 2.0 + RESERVE_S)  # it lapses, even with no batch to see it
    assert alone.admit(1, BATCH, now=2.0 + RESERVE_S)
    alone.ran(1, BATCH)
    alone.ran(1, BATCH)  # (said twice: a failure's path) ...
    alone.ran(1, BATCH)
    assert alone.admit(0, RETRY, now=9.0)  # ... never leaves it busy for good


def test_a_bounce_names_its_batch_and_says_why() -> None:
    (header, _) = wire.unpack(bounce(BATCH))
    assert header.kind == wire.Header.ERROR and header.batch_id == 5 and header.bounced
    assert "runs alone" in header.error


def test_work_that_fails_in_the_compute_thread_counts_out_only_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message that fails on the compute thread (a defect) was counted out as a batch
    whatever its kind: a START's failure let another frontend's retry in beside a
    batch still queued, where a poison in it would take the retry down too."""
    runner = Runner(RunnerOptions("w", "ipc://unused", torch.device("cpu"), tmp_path))
    ctx: zmq.Context[Any] = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(runner_module._RESULTS)

    def broken(item: Any, reply: Any) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr(runner, "_handle", broken)
    try:
        assert runner._alone.admit(1, BATCH, now=0.0)  # queued, from frontend 1
        runner._work.put((0, wire.Header(kind=wire.Header.START, batch_id=9), []))
        runner._work.put(None)
        runner._compute(ctx)
        assert results.poll(10_000)  # (its failure, answered)
        assert not runner._alone.admit(0, RETRY, now=0.0)  # frontend 1's batch is still here
    finally:
        results.close(linger=0)
        ctx.term()
