"""Adapting the batch cap to a latency target (AIMD, as Clipper did).

A request that arrives while a batch runs waits for it, waits up to the queue
delay for its own batch to fill, then rides that batch: its latency is at
most 2 x compute + delay. So the controller keeps a batch's execution time
within half the target and gives the queue delay what is left:

  * after every batch: if it ran longer than target / 2, the cap shrinks by
    10% (at least one row); if it ran within it and was as large as the cap
    allowed, the cap grows by one row;
  * delay = min(configured delay, target - 2 x expected compute at the cap).

It reacts to execution times only, never to time spent queueing behind an
overload: a smaller batch cannot shorten that queue, only lengthen it; queue
limits and timeouts deal with overload. Pure: no clock, no I/O.
"""

from __future__ import annotations


class LatencyTarget:
    def __init__(self, target_s: float, max_cap: int, decrease: float = 0.9) -> None:
        self.target_s = target_s
        self.max_cap = max_cap
        self.cap = max_cap
        self._decrease = decrease
        self._per_row_s: float | None = None  # EWMA of compute seconds per row

    def observe(self, rows: int, compute_s: float) -> None:
        per_row = compute_s / max(rows, 1)
        old = self._per_row_s
        self._per_row_s = per_row if old is None else 0.8 * old + 0.2 * per_row
        if compute_s > self.target_s / 2:
            self.cap = max(1, min(self.cap - 1, int(self.cap * self._decrease)))
        elif rows >= self.cap:
            self.cap = min(self.max_cap, self.cap + 1)

    def expected_compute_s(self) -> float:
        return 0.0 if self._per_row_s is None else self._per_row_s * self.cap

    def delay_s(self, configured_s: float) -> float:
        return max(0.0, min(configured_s, self.target_s - 2 * self.expected_compute_s()))
