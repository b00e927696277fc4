"""The batching decision: a pure function of (now, the planned batch, capacity, delay).

A batch leaves
  * at once when a worker is idle and batching is `eager` (work-conserving:
    under load batches grow by themselves, because requests pile up while
    every worker is busy). The scheduler turns eagerness off while the
    frontend's event loop is busy (loopload.py): then a batch waits to
    fill like any other, since each batch sent costs the loop time, except
    that a request with less time left than the delay is not kept waiting,
    and that the scheduler passes `eager` again for a batch that holds every
    request lately present (Scheduler._all_here: no other is coming);
  * when it is full (no more rows or tokens fit) or has a preferred size, to
    fill a busy worker's staging credit so the worker never waits on a round
    trip between batches;
  * when its oldest request has waited `max_queue_delay_us`, or, with the
    automatic delay and an idle worker, once arrivals have stopped
    (`quiet_at`, queues.py): an idle worker does not wait for requests that
    are not coming.
Otherwise the scheduler waits until the oldest request's delay runs out, or
until something changes (a request arrives, a worker frees a credit).
Which requests form the batch is plan.py's business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchd.server.batching.plan import Plan


@dataclass(frozen=True, slots=True)
class Capacity:
    idle_worker: bool  # some worker for this model has nothing in flight
    free_credit: bool  # some worker for this model can take one more batch
    # ... and one idle worker loads no model and runs no sequence: a retry (a suspect)
    # that ends its process elsewhere is not the death's sole suspect (pool.py's
    # WorkerHandle.settled; it waits for one a while: lanes.settle_by)
    settled: bool = True
    loading: bool = False  # ... of those idle, one runs no sequence: it only loads


@dataclass(frozen=True, slots=True)
class Send:
    plan: Plan


@dataclass(frozen=True, slots=True)
class Wait:
    until: float | None  # monotonic seconds to decide again; None: until an event


IDLE = Capacity(idle_worker=True, free_credit=True)
IDLE_UNSETTLED = Capacity(idle_worker=True, free_credit=True, settled=False)
IDLE_LOADING = Capacity(idle_worker=True, free_credit=True, settled=False, loading=True)
BUSY_WITH_CREDIT = Capacity(idle_worker=False, free_credit=True)
NO_CAPACITY = Capacity(idle_worker=False, free_credit=False)
UNTIL_AN_EVENT = Wait(None)  # decide() runs for every arrival: no new object for the usual answer


def decide(
    now: float,
    plan: Plan | None,
    capacity: Capacity,
    max_delay_s: float,
    eager: bool = True,
    quiet_at: float | None = None,
) -> Send | Wait:
    if plan is None or not capacity.free_credit:
        return UNTIL_AN_EVENT
    if plan.suspect and not capacity.idle_worker:
        return UNTIL_AN_EVENT  # a retry after a failure runs only on a worker with nothing else
    if plan.suspect and not capacity.settled and plan.settle_by > now:  # ... loading nothing,
        return Wait(plan.settle_by if plan.settle_by < math.inf else None)  # for a while
    if (capacity.idle_worker and eager) or plan.full or plan.preferred:
        return Send(plan)
    due = plan.oldest_arrival + max_delay_s
    if quiet_at is not None and capacity.idle_worker:  # a busy worker's staged batch
        due = min(due, quiet_at)  # fills on: leaving early would only make it smaller
    if capacity.idle_worker:  # patient, but a worker is idle: let no request expire for it
        due = min(due, plan.deadline - max_delay_s)
    if now >= due:
        return Send(plan)
    return Wait(due)
