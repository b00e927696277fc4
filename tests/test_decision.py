"""decision.py: when a planned batch leaves, as a pure function of (now, plan,
capacity, delay, eagerness)."""

from __future__ import annotations

from batchd.server.batching.decision import BUSY_WITH_CREDIT, IDLE, Send, Wait, decide
from batchd.server.batching.decision import NO_CAPACITY as FULL
from batchd.server.batching.plan import Plan
from tests.conftest import model, request


def plan(rows: int = 1, full: bool = False, preferred: bool = False, oldest: float = 5.0) -> Plan:
    return Plan([], rows, 0, full, preferred, oldest)


def test_empty_queue_waits_for_an_event() -> None:
    assert decide(5.0, None, IDLE, 0.01) == Wait(None)


def test_idle_worker_takes_the_queue_at_once() -> None:
    p = plan()
    assert decide(5.0, p, IDLE, 0.01) == Send(p)


def test_a_saturated_frontend_lets_batches_fill_even_for_an_idle_worker() -> None:
    p, full = plan(3), plan(32, full=True)
    assert decide(5.0, p, IDLE, 0.01, eager=False) == Wait(5.01)
    assert decide(5.01, p, IDLE, 0.01, eager=False) == Send(p)
    assert decide(5.0, full, IDLE, 0.01, eager=False) == Send(full)


def test_a_saturated_frontend_keeps_no_request_waiting_past_its_deadline() -> None:
    cfg = model()
    hurried = Plan([request(cfg, deadline=5.015)], 1, 0, False, False, 5.0, deadline=5.015)
    assert decide(5.0, hurried, IDLE, 0.01, eager=False) == Wait(5.005)
    assert decide(5.005, hurried, IDLE, 0.01, eager=False) == Send(hurried)
    assert decide(5.005, hurried, BUSY_WITH_CREDIT, 0.01, eager=False) == Wait(5.01)


def test_no_credit_means_wait_whatever_the_queue() -> None:
    assert decide(9.0, plan(64, full=True, oldest=1.0), FULL, 0.01) == Wait(None)


def test_busy_worker_gets_a_staged_batch_only_when_full_or_preferred() -> None:
    assert decide(5.0, plan(31), BUSY_WITH_CREDIT, 0.01) == Wait(5.01)
    full, preferred = plan(32, full=True), plan(8, preferred=True)
    assert decide(5.0, full, BUSY_WITH_CREDIT, 0.01) == Send(full)
    assert decide(5.0, preferred, BUSY_WITH_CREDIT, 0.01) == Send(preferred)


def test_busy_worker_gets_a_partial_batch_once_the_delay_ran_out() -> None:
    p = plan(3)
    assert decide(5.0099, p, BUSY_WITH_CREDIT, 0.01) == Wait(5.01)
    assert decide(5.01, p, BUSY_WITH_CREDIT, 0.01) == Send(p)


# ---- the queue and the scheduler ----


def test_a_patient_batch_leaves_once_arrivals_stop_not_after_the_whole_delay() -> None:
    p = plan(3)
    assert decide(5.0, p, IDLE, 0.02, eager=False, quiet_at=5.003) == Wait(5.003)
    assert decide(5.003, p, IDLE, 0.02, eager=False, quiet_at=5.003) == Send(p)
    assert decide(5.003, p, IDLE, 0.02, eager=False, quiet_at=None) == Wait(5.02)
    assert decide(5.0, p, IDLE, 0.02, eager=False, quiet_at=5.05) == Wait(5.02)  # bounded
    # A busy worker's staging credit (a GPU's) fills on: the worker is not waiting.
    assert decide(5.003, p, BUSY_WITH_CREDIT, 0.02, quiet_at=5.003) == Wait(5.02)
