"""Batch jobs' lanes: when a job's batch leaves, and for which worker.

Batch jobs' requests (`Request.background`) wait in a model's job lane, apart from
its online levels, and leave only when a worker is idle and no online request waits
that an idle worker could take, of any model (workers are shared), so online traffic
keeps every queue place and every busy worker (one that finds a worker on a job's
batch waits for that one batch, not the job).

A lane waits while the quarantine holds its model version (a job of poison lines
would end a worker with each). A retried line (a suspect: its batch ended its
worker, and it runs alone) goes to a settled worker, one that loads no model and
runs no sequence (Capacity.settled), so that a line that ends it there is the
death's sole suspect and is remembered (quarantine.py); it waits for one SETTLE_S
at most: a worker whose sequences never pause would hold the job for good; while
one only loads, till that is done. An online suspect waits so too (settling;
decision.py), half its time left at most, and the requests behind it go on
meanwhile (scheduler.pump), the job lanes too.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from typing import Protocol

from batchd.protos.model_config import ModelConfig
from batchd.server.batching.decision import Capacity
from batchd.server.batching.plan import Plan
from batchd.server.batching.queues import ModelQueue
from batchd.server.request import Request

SETTLE_S = 2.0  # a suspect waits this long, at most, for a settled worker beside sequences


class Dispatch(Protocol):
    """What the lanes need from the core (scheduler.Dispatch has more)."""

    def capacity(self, model: ModelConfig) -> Capacity: ...

    def jobs_paused(self, key: str) -> float: ...  # till when its job lane waits (0.0: not)

    # Hand a batch to a worker. A send that fails puts the requests back with
    # requeue() and schedules a pump later; it never calls pump() itself.
    def send(self, model: ModelConfig, requests: list[Request]) -> None: ...


def pump_job_lanes(queues: Collection[ModelQueue], dispatch: Dispatch, now: float) -> float:
    """Job batches, to idle workers, once no online request waits that an idle worker
    could take: of any model, for a job of one model would otherwise keep the workers
    it shares while another model's callers wait out the whole job. When to look
    again (inf: at an event: a worker's batch back, a load's end, a sequence's)."""
    wake = math.inf  # (`queues`: walked twice, no copy made on every pump)
    if not any(q.jobs for q in queues):
        return wake
    for q in queues:
        q.drop_dead_heads(now)
        if len(q) and not q.only_suspects() and dispatch.capacity(q.config).idle_worker:
            return wake  # it is filling a batch, or about to send one (not a retry waiting)
    for q in queues:
        if q.jobs and (until := dispatch.jobs_paused(q.config.key)) > now:
            wake = min(wake, until)
        elif q.jobs:
            wake = min(wake, _pump_jobs(q, dispatch, now))
    return wake


def settle_by(q: ModelQueue, r: Request, capacity: Capacity, now: float) -> float:
    """Till when suspect `r`, of `q`, waits for a settled worker, counted from the first
    time it finds only unsettled ones (from its loss, the worker's restart took most of
    the wait, and a poison ended a third worker, still loading), at most half its time
    left then: while an idle worker only loads, till that is done (a death as it loads is
    not counted, and its restart loads everything again: a load of 3 s, and one of 45 s
    with the wait cut at 30 s, had a poison end a third worker, reviews 54e, 54i; a load
    that hangs is ended by --load-timeout); beside sequences, SETTLE_S (they may never
    pause).
    Meanwhile the requests behind it go on (scheduler.pump), and the job lanes.
    The other suspects queued wait out the same window, not one each in turn. 0: `r`
    is no suspect."""
    if not r.suspect:
        return 0.0
    if not r.settle_from:
        for s in (r, *q.suspects()):
            s.settle_from = s.settle_from or now
    half = r.settle_from + (r.deadline - r.settle_from) / 2
    return half if capacity.loading else min(r.settle_from + SETTLE_S, half)


def settling(q: ModelQueue, plan: Plan, capacity: Capacity, now: float) -> Plan:
    """A suspect's plan (an idle worker free), with till when it waits for a settled one."""
    if capacity.settled:
        return plan
    return replace(plan, settle_by=settle_by(q, plan.requests[0], capacity, now))


def _pump_jobs(q: ModelQueue, dispatch: Dispatch, now: float) -> float:
    """Send `q`'s job batches to idle workers, a retried line's to a settled one for a
    while (settle_by): when to look again (math.inf: at an event)."""
    while q.jobs and (c := dispatch.capacity(q.config)).idle_worker:
        while q.jobs and q.jobs[0].future.done():
            q.jobs.popleft()  # a cancelled job's: its wait holds up no other line
        if q.jobs and not c.settled and (until := settle_by(q, q.jobs[0], c, now)) > now:
            return until  # (math.inf: an event wakes it, a load done)
        plan = q.plan_jobs(now)
        if plan is None:
            break
        q.take_jobs(plan)
        dispatch.send(q.config, plan.requests)
    return math.inf
