"""How busy the frontend's event loop is: the share of wall time spent outside select().

The one event loop is a frontend's ceiling. While it has time to spare, an idle
worker takes the queue at once: the lowest latency. Once it is saturated, each
batch costs the loop time that requests need (join, send, receive, split) and
the worker's hand-offs take CPU from it too, so the scheduler lets batches wait
to fill (up to `max_queue_delay_us`, as Triton's batcher always does) instead.
Measured on a 2-core machine: tiny at concurrency 32 went from batches of 1.9
to 6.3 rows and from 1,985 to 2,628 req/s.

It turns patient well before the loop is full (PATIENT): a loop 65-85% busy
sending batches of 2-3 rows to 4-20 closed-loop callers spent most of its time
on their per-batch and per-wakeup costs. Patience there costs little latency,
because a patient batch for an idle worker still leaves as soon as every
request lately present is here (a closed loop's callers, all waiting) or
arrivals pause (queues.GAP_ROWS_SPARE, a short gap while the loop has time to
spare). What it costs is 0.6-1 ms of median latency to an open-loop load
near that share (tiny at 1,000 req/s on 2 cores): its callers are independent,
so no count says the batch is complete, and it waits for a pause in arrivals.

`new_loop()` makes an event loop whose selector counts the time it blocks;
`LoopLoad.current()` reads it (and /metrics shows it as
batchd_frontend_loop_busy_seconds_total). On any other loop (uvloop, an embedding
application's) the load reads as never saturated: batching stays eager.
"""

from __future__ import annotations

import asyncio
import selectors
import time
import weakref
from collections.abc import Callable
from typing import Any

WINDOW_S = 0.05  # the load is measured over windows of this length
# Hysteresis (no flapping): each state turns on at its first share, off below its second.
SATURATED, RELAXED = 0.9, 0.7  # the loop needs its core: a worker under load leaves it one
PATIENT, EAGER = 0.65, 0.5  # batches for an idle worker wait to fill


class TimedSelector(selectors.DefaultSelector):
    """The default selector, counting the seconds it spent waiting. A poll with
    timeout 0 (the loop has callbacks ready) is work, not waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.idle_s = 0.0
        self.started = time.perf_counter()

    def busy_s(self) -> float:
        """Seconds the loop has spent outside select() since it was made."""
        return time.perf_counter() - self.started - self.idle_s

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout == 0:
            return super().select(0)
        start = time.perf_counter()
        try:
            return super().select(timeout)
        finally:
            self.idle_s += time.perf_counter() - start


_SELECTORS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TimedSelector] = (
    weakref.WeakKeyDictionary()
)


def new_loop() -> asyncio.AbstractEventLoop:
    """An asyncio event loop whose load `LoopLoad.current()` can read."""
    selector = TimedSelector()
    loop = asyncio.SelectorEventLoop(selector)
    _SELECTORS[loop] = selector
    return loop


class LoopLoad:
    """Callable: is the loop saturated? `patient()`: should batches wait to fill?
    Both re-measured at most once per window."""

    def __init__(
        self, selector: TimedSelector | None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._selector = selector
        self._clock = clock
        self._since = clock()
        self._idle_at_since = selector.idle_s if selector else 0.0
        self.busy = 0.0  # share of the last full window spent outside select()
        self.saturated = False
        self.patient_now = False

    @classmethod
    def current(cls) -> LoopLoad:
        return cls(_SELECTORS.get(asyncio.get_running_loop()))

    def busy_seconds(self) -> float | None:
        """The loop's busy seconds so far (a counter), None on a loop that does not count."""
        return None if self._selector is None else self._selector.busy_s()

    def idle_s(self) -> float:
        """Seconds the loop has spent waiting in select() so far; on a loop that does
        not count, the clock (every second counts as idle)."""
        return self._clock() if self._selector is None else self._selector.idle_s

    def __call__(self) -> bool:
        self._measure()
        return self.saturated

    def patient(self) -> bool:
        self._measure()
        return self.patient_now

    def _measure(self) -> None:
        if self._selector is None:
            return
        now = self._clock()
        elapsed = now - self._since
        if elapsed >= WINDOW_S:
            idle = self._selector.idle_s
            self.busy = busy = max(0.0, 1.0 - (idle - self._idle_at_since) / elapsed)
            self.saturated = busy >= (RELAXED if self.saturated else SATURATED)
            self.patient_now = busy >= (EAGER if self.patient_now else PATIENT)
            self._since, self._idle_at_since = now, idle
