"""Admission and batch formation: the bounded per-model queues and the shell
around `plan.plan_batch` and `decision.decide`.

Admission never waits: a full queue (or priority level) raises QueueFull at
once. A request with more rows than one batch holds (`max_batch_size`, or
fewer when its ragged rows are long under `max_batch_tokens`) is split by rows
into chunks that queue like any other request and are joined again for the
caller; the chunks are counted, and refused if too many, before any is made.
`pump()` is synchronous and runs whenever something changes (a request arrives,
a worker frees a credit or joins, a batch comes back for retry, a delay runs
out). The scheduler owns the queues; nothing else touches them.

Batch jobs' requests (`Request.background`) wait in a model's job lane, apart
from its online levels: they hold no place of `max_queue_size`, never join an
online request's batch, and leave as lanes.py says.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Protocol

from batchd.protos.model_config import ModelConfig
from batchd.server.batching import lanes
from batchd.server.batching.decision import NO_CAPACITY, Capacity, Send, decide
from batchd.server.batching.lanes import pump_job_lanes, settling
from batchd.server.batching.queues import (
    GAP_ROWS,
    GAP_ROWS_SPARE,
    NEARLY_SATURATED,
    ModelQueue,
    dead,
    expire,
)
from batchd.server.batching.split_join import join_results, split_request
from batchd.server.errors import InvalidInput, QueueFull, Unavailable
from batchd.server.flow import StepStream
from batchd.server.request import Request, Tensor

log = logging.getLogger("batchd.scheduler")
COMPACT_EVERY_S = 0.01  # a full queue is swept for dead entries at most this often


class Handle(Protocol):
    def cancel(self) -> None: ...


class Timer(Protocol):
    """Calls `callback` once the scheduler's clock reaches `when` (a fake in tests)."""

    def at(self, when: float, callback: Callable[[], None]) -> Handle: ...


class LoopTimer:
    """The event loop's timers, on the scheduler's clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def at(self, when: float, callback: Callable[[], None]) -> Handle:
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + max(0.0, when - self._clock()), callback)


class Dispatch(lanes.Dispatch, Protocol):
    """What the scheduler needs from the core (a fake in unit tests): the lanes' too."""

    def requests_out(self, key: str) -> int: ...  # online requests of `key` on workers now

    def held(self, key: str) -> bool: ...  # whether some live worker holds model version `key`


class Scheduler:
    def __init__(
        self,
        dispatch: Dispatch,
        clock: Callable[[], float] = time.monotonic,
        patient: Callable[[], bool] = lambda: False,  # LoopLoad.patient in the server
        timer: Timer | None = None,  # None: the event loop's, on `clock`
        idle: Callable[[], float] | None = None,  # the loop's idle seconds; None: `clock`
        busy: Callable[[], float] = lambda: 1.0,  # its busy share lately (LoopLoad.busy)
    ) -> None:
        self._dispatch = dispatch
        self._clock = clock
        self._idle = idle or clock
        self._busy = busy
        self._timers = timer or LoopTimer(clock)
        self._patient = patient
        self._queues: dict[str, ModelQueue] = {}
        self._timer: Handle | None = None
        self._timer_at = math.inf
        self._turn = 0  # which queue a full pump offers capacity first: models take turns
        # A retry after a failure waits for a worker with nothing in flight: until one
        # has gone to it, no batch is staged on a busy worker, so that one drains (a
        # worker another model keeps busy would never be idle).
        self._suspect_waits = False

    def add_model(self, config: ModelConfig) -> None:
        """Queue requests for one model version, keyed by `config.key`."""
        self._queues[config.key] = ModelQueue(config)

    def remove_model(self, key: str) -> None:
        """Forget a drained version's queue (nothing queued online, nothing in flight);
        what its job lane still holds is failed."""
        q = self._queues.pop(key)
        assert not len(q), f"{key} removed with {len(q)} requests queued"
        gone = Unavailable(f"model {q.config.name!r} version {q.config.version} was unloaded")
        for r in q.jobs:
            if not r.future.done():
                r.future.set_exception(gone)

    def pending(self) -> Counter[str]:
        """Requests still waiting, by model (any version): not those whose caller left or
        whose deadline passed (one walk over the queues, for a scrape of every model)."""
        now, waiting = self._clock(), Counter[str]()
        for q in self._queues.values():
            waiting[q.config.name] += sum(not dead(r, now) for level in q.levels for r in level)
        return waiting

    def pending_jobs(self) -> Counter[str]:
        """Batch jobs' requests waiting in the models' job lanes, by model (for metrics)."""
        waiting = Counter[str]()
        for q in self._queues.values():
            waiting[q.config.name] += sum(not r.future.done() for r in q.jobs)
        return waiting

    def has(self, key: str) -> bool:
        return key in self._queues

    def queued_version(self, key: str, jobs: bool = False) -> int:
        """Online requests queued for model version `key` (with `jobs`, and its job lane's)."""
        q = self._queues[key]
        return len(q) + (sum(not r.future.done() for r in q.jobs) if jobs else 0)

    def cap(self, key: str) -> int:
        """The current batch cap in rows (adapted when the model has a latency target)."""
        return self._queues[key].cap

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        """Admit `request` or raise QueueFull; never waits. Returns the result future."""
        q = self._queues.get(request.model.key)
        if q is None:  # its version was retired while the request was decoded off the loop
            raise Unavailable(
                f"model {request.model.name!r} version {request.model.version} was replaced "
                "or unloaded while this request was decoded; retry"
            )
        now = self._clock()
        per_batch = q.config.rows_per_batch(request.length)
        count = -(-request.rows // per_batch)  # chunks, counted before any is made
        if count > (most := q.most(request)):  # (never admitted: no "retry later")
            raise InvalidInput(
                f"request of {request.rows} rows needs {count} batches of {per_batch}, more "
                f"than model {q.config.name!r} queues ({q.most_said(request)}); send at most "
                f"{most * per_batch} rows a request"
            )
        if not request.background:  # the job lane is bounded by its runner
            self._admit(q, request.level, count, now)
            q.arrived(now, request.rows, self._idle())
            q.present(now, len(q) + count + self._dispatch.requests_out(q.config.key))
        parts = split_request(request, per_batch) if count > 1 else [request]
        loop = asyncio.get_running_loop()
        for part in parts:
            part.arrival = now
            part.future = loop.create_future()
            if part.stream is not None:  # a step-wise request's caller reads its stream to
                # the end, then its future: one failed in the queue (its timeout, a broken or
                # retired version, the drain) must end the stream too
                part.future.add_done_callback(partial(_close, part.stream))
            (q.jobs if part.background else q.levels[part.level]).append(part)
            self._arm_timeout(part)
        self.pump(q)
        if len(parts) == 1:
            return parts[0].future
        return asyncio.ensure_future(self._join(parts))

    async def _join(self, parts: list[Request]) -> list[Tensor]:
        try:
            return join_results(await asyncio.gather(*(p.future for p in parts)))
        finally:
            for p in parts:
                p.future.cancel()  # one chunk failed or the caller left: drop the rest

    def check_room(self, key: str) -> None:
        """Raise QueueFull if the queue of model version `key` is full: lets the
        frontend refuse a request before it spends time decoding it. submit() checks fully."""
        if (q := self._queues.get(key)) is None:  # (retired while an HTTP body was parsed)
            raise Unavailable(f"model version {key} was replaced or unloaded while this "
                              "request was read; retry")  # fmt: skip
        if len(q) >= q.config.batching.max_queue_size:
            self._admit(q, 0, 1, self._clock())

    def _admit(self, q: ModelQueue, level: int, count: int, now: float) -> None:
        problem = q.room(level, count)
        if problem is not None and now - q.compacted_at >= COMPACT_EVERY_S:
            q.compact(now)  # cancelled or expired entries may be holding places
            problem = q.room(level, count)
        if problem is not None:  # a place frees as a batch leaves: about a batch's time
            raise QueueFull(  # (the delay alone said 1 ms of a model whose batches took 50)
                f"queue of model {q.config.name!r} is full ({problem}); retry later",
                retry_after_ms=max(1, round(q.pushback_s() * 1000)),
            )

    def requeue(self, requests: list[Request]) -> None:
        """Put requests back at the front of their queues (a lost or failed batch's).
        Deciding what leaves next is the caller's to schedule: requeue never pumps,
        so a failed send cannot re-enter the pump that made it."""
        for key in dict.fromkeys(r.model.key for r in requests):
            self._queues[key].put_front([r for r in requests if r.model.key == key])
        for r in requests:  # their timers went when they were taken: queued, they expire
            self._arm_timeout(r)
            self._suspect_waits |= r.suspect

    def _arm_timeout(self, request: Request) -> None:
        """A queued request with a queue timeout expires at its deadline."""
        if request.queue_timeout and request.timer is None and not request.future.done():
            request.timer = self._timers.at(request.deadline, partial(self._expire_queued, request))

    def observe(self, key: str, rows: int, compute_s: float) -> None:
        """A batch finished: its time averaged, and fed to the model's latency target."""
        q = self._queues.get(key)
        if q is None:
            return
        q.finished(compute_s, self._clock())
        if q.target is not None:
            q.target.observe(rows, compute_s)

    def ended(self, key: str, seconds: float) -> None:
        """A sequence of step-wise model version `key` ended, `seconds` after it came."""
        if (q := self._queues.get(key)) is not None:
            q.finished(seconds, self._clock())

    def fail_all(self, error: Exception) -> None:
        """Answer every queued request with `error` (shutdown)."""
        for key in self._queues:
            self.fail_queued(key, error)

    def move_queued(self, key: str, to: ModelConfig) -> bool:
        """Hand what is queued for `key` (no worker left) to `to`: ModelQueue.hand_over."""
        dest = self._queues.get(to.key)
        return dest is not None and self._queues[key].hand_over(dest)

    def fail_queued(self, key: str, error: Exception) -> None:
        """Answer every request queued for model version `key` with `error`."""
        q = self._queues[key]
        for level in [*q.levels, q.jobs]:
            for r in level:
                if not r.future.done():
                    r.future.set_exception(error)
            level.clear()

    def _expire_queued(self, request: Request) -> None:
        # Only requests still queued expire here; the dispatcher owns sent ones. No scan
        # of the queue says which: a request leaves it live only in a batch (take),
        # which cancels its timer, and put back (requeue) it gets a new one.
        request.timer = None
        if not request.future.done():
            expire(request, self._clock())

    def pump(self, only: ModelQueue | None = None) -> None:
        """Send every batch that should leave now and arm the timer for the next
        decision. `only`: just that queue changed (a request came), so only it is
        planned; a freed credit or a timer looks at every queue."""
        now = self._clock()
        wake = math.inf
        eager = not self._patient()
        if only is not None and self._arrival_changes_nothing(only, now, eager):
            return
        gap = GAP_ROWS if self._busy() >= NEARLY_SATURATED else GAP_ROWS_SPARE
        queues = [only] if only is not None else self._in_turn()
        if only is None and self._suspect_waits:  # an idle worker goes to a suspect first
            queues.sort(key=lambda q: not q.suspect_first())
        for q in queues:
            while len(q):
                capacity = self._capacity(q)
                plan = q.plan(now) if capacity.free_credit else None
                if plan is not None and plan.suspect and capacity.idle_worker:
                    plan = settling(q, plan, capacity, now)
                    if not capacity.settled and plan.settle_by > now:  # it waits, and the
                        wake = min(wake, plan.settle_by)  # requests behind it go (they timed
                        plan = q.plan(now, past_suspects=True)  # out behind it: review 54h)
                quiet = q.quiet_at(now, self._idle(), gap)
                here = plan is not None and capacity.idle_worker and self._all_here(q)
                decision = decide(now, plan, capacity, q.delay_s(), eager or here, quiet)
                if isinstance(decision, Send):
                    q.take(decision.plan)
                    self._dispatch.send(q.config, decision.plan.requests)
                    if only is None:  # the next full pump offers the next model first
                        self._turn = list(self._queues).index(q.config.key) + 1
                    continue
                if decision.until is not None:
                    wake = min(wake, decision.until)
                break
        wake = min(wake, pump_job_lanes(self._queues.values(), self._dispatch, now))
        if only is None:  # a suspect whose model no live worker holds waits for no worker
            held = self._dispatch.held
            self._suspect_waits = any(q.suspect_first() and held(q.config.key) for q in queues)
        self._arm(wake, earlier_only=only is not None)

    def _capacity(self, q: ModelQueue) -> Capacity:
        """The workers' capacity for `q`'s model; while a suspect waits, a busy worker's
        free credit is not offered."""
        capacity = self._dispatch.capacity(q.config)
        if self._suspect_waits and capacity.free_credit and not capacity.idle_worker:
            return NO_CAPACITY
        return capacity

    def _in_turn(self) -> list[ModelQueue]:
        """Every queue, from the one after the last that sent a batch in a full pump:
        a freed worker goes to the models in turn, so one model's backlog (a
        request of a thousand chunks) cannot keep the workers it shares from
        another model's callers. A pump that sends nothing changes no turn."""
        queues = list(self._queues.values())
        k = self._turn % len(queues) if queues else 0
        return queues[k:] + queues[:k]

    def _arrival_changes_nothing(self, q: ModelQueue, now: float, eager: bool) -> bool:
        """Whether the request just queued at the tail of `q` leaves the decision the
        last pump made for `q` standing, so the planner (a walk over the whole queue)
        need not run for it. Holds for a plain FIFO queue (one level, no preferred
        sizes, tokens or buckets) when no idle worker takes it eagerly, the queue
        had a request before (so the armed timer is at or before its due time), that
        timer is still ahead, the newcomer's deadline does not fall before it, and
        the rows queued, dead entries counted, are fewer than a batch. Like
        planning, it first answers expired heads. A patient scheduler filling a
        batch for an idle worker decides on every arrival: bench/hotpath.py
        --filling, batches of 32, went from 128-140 to 80-82 µs a request.
        With no free credit nothing can leave, whatever the queue: the credit's
        return pumps every queue, so an arrival then needs no decision at all."""
        capacity = self._capacity(q)
        if not capacity.free_credit:
            return True
        if not q.plain or (capacity.idle_worker and (eager or self._all_here(q))):
            return False  # the worker takes the batch now
        q.drop_dead_heads(now)  # as planning would: an expired head is answered now
        level = q.levels[0]
        if len(level) < 2 or now >= self._timer_at:
            return False
        if level[-1].deadline - q.delay_s() < self._timer_at:
            return False  # its deadline may need the batch to leave before the timer fires
        return sum(r.rows for r in level) < q.cap

    def _all_here(self, q: ModelQueue) -> bool:
        """Whether every request lately present is queued or on a worker again: then
        no other is coming (the callers of a closed loop wait for their answers), and
        an idle worker takes the batch now instead of waiting out the quiet rule.
        tiny at 20 callers on 2 cores waited each time for a gap in arrivals that
        its callers, all queued, could not make."""
        return len(q) + self._dispatch.requests_out(q.config.key) >= q.callers

    def _arm(self, wake: float, earlier_only: bool = False) -> None:
        # After one queue's pump the others' wake-ups are unknown: keep an earlier
        # timer (when it fires, a full pump re-arms for all).
        if wake == self._timer_at or (earlier_only and wake > self._timer_at):
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = wake
        if wake != math.inf:
            self._timer = self._timers.at(wake, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self.pump()


def _close(stream: StepStream, _: object) -> None:
    stream.close()
