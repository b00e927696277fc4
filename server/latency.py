"""Adapting the batch cap to a latency target (AIMD, as Clipper did).

After every batch: if the oldest request's queue + compute time passed the
target, the cap shrinks by 10% (at least one row); if the batch was as large
as the cap allowed and came in under the target, the cap grows by one row.
The queue delay shrinks with it, so that waiting for a fuller batch never
spends time the target does not have: delay <= target - expected compute.
Pure: no clock, no I/O; the scheduler feeds it and reads `cap` and `delay_s`.
"""

from __future__ import annotations


class LatencyTarget:
    def __init__(self, target_s: float, max_cap: int, decrease: float = 0.9) -> None:
        self.target_s = target_s
        self.max_cap = max_cap
        self.cap = max_cap
        self._decrease = decrease
        self._per_row_s: float | None = None  # EWMA of compute seconds per row

    def observe(self, rows: int, latency_s: float, compute_s: float) -> None:
        per_row = compute_s / max(rows, 1)
        self._per_row_s = (
            per_row if self._per_row_s is None else 0.8 * self._per_row_s + 0.2 * per_row
        )
        if latency_s > self.target_s:
            self.cap = max(1, min(self.cap - 1, int(self.cap * self._decrease)))
        elif rows >= self.cap:
            self.cap = min(self.max_cap, self.cap + 1)

    def expected_compute_s(self) -> float:
        return 0.0 if self._per_row_s is None else self._per_row_s * self.cap

    def delay_s(self, configured_s: float) -> float:
        return max(0.0, min(configured_s, self.target_s - self.expected_compute_s()))
