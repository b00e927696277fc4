"""worker/alone.py: a retry runs alone on a worker several frontends share (pure state)."""

from __future__ import annotations

from batchd.protos import wire
from batchd.worker.alone import RESERVE_S, Alone, bounce

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
