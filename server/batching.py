"""The batching decision: a pure function of (now, queue state, capacity, config).

A batch leaves
  * at once when a worker is idle (work-conserving: under load batches grow by
    themselves, because requests pile up while every worker is busy);
  * when it is full (`max_batch_size` rows), to fill a busy worker's staging
    credit so the worker never waits on a round trip between batches;
  * when its oldest request has waited `max_queue_delay_us`.
Otherwise the scheduler waits until the oldest request's delay runs out, or
until something changes (a request arrives, a worker frees a credit).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueState:
    oldest_arrival: float  # monotonic seconds of the oldest live request
    batchable_rows: int  # rows that can join the oldest request's batch, capped


@dataclass(frozen=True, slots=True)
class Capacity:
    idle_worker: bool  # some worker for this model has nothing in flight
    free_credit: bool  # some worker for this model can take one more batch


@dataclass(frozen=True, slots=True)
class Send:
    max_rows: int


@dataclass(frozen=True, slots=True)
class Wait:
    until: float | None  # monotonic seconds to decide again; None: until an event


def decide(
    now: float,
    queue: QueueState | None,
    capacity: Capacity,
    max_batch_rows: int,
    max_delay_s: float,
) -> Send | Wait:
    if queue is None or not capacity.free_credit:
        return Wait(None)
    if capacity.idle_worker or queue.batchable_rows >= max_batch_rows:
        return Send(max_batch_rows)
    due = queue.oldest_arrival + max_delay_s
    if now >= due:
        return Send(max_batch_rows)
    return Wait(due)
