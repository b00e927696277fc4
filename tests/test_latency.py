"""latency.py: the adaptive batch cap under target_latency_ms."""

from __future__ import annotations

import pytest

from batchd.server.batching.latency import LatencyTarget


def test_latency_target_settles_where_queue_plus_compute_fits() -> None:
    """A fake model whose batch takes 2 ms + 1 ms per row, under saturating
    load (every batch fills the cap). With a 20 ms target a batch may run
    10 ms: the cap falls from 32 and settles at 8-9 rows, and the worst
    latency (wait for the running batch, ride one's own) stays near 20 ms."""
    target = LatencyTarget(0.020, max_cap=32)

    def compute(rows: int) -> float:
        return 0.002 + 0.001 * rows

    caps = []
    for _ in range(300):
        rows = target.cap
        target.observe(rows, compute(rows))
        caps.append(target.cap)
    assert caps[0] < 32 and set(caps[-50:]) <= {8, 9}
    worst = max(compute(a) + compute(b) for a, b in zip(caps[-50:], caps[-49:], strict=False))
    assert worst <= 0.022
    assert target.delay_s(0.010) == pytest.approx(max(0, 0.020 - 2 * target.expected_compute_s()))


def test_latency_target_grows_back_when_batches_get_cheap() -> None:
    target = LatencyTarget(0.020, max_cap=32)
    for _ in range(50):
        target.observe(target.cap, 0.015)  # too slow: shrink
    assert target.cap == 1
    for _ in range(40):
        target.observe(target.cap, 0.001 * target.cap)  # 1 ms a row: up to 10 rows fit
    assert 9 <= target.cap <= 11
