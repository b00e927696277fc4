"""One model's waiting requests (ModelQueue): a FIFO per priority level and the job
lane, with the sweeps that answer expired and drop cancelled entries. The
scheduler owns the queues and decides what leaves; a queue only holds.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator

from batchd.protos.model_config import AUTO_DELAY_MAX_US, ModelConfig
from batchd.server.batching.latency import LatencyTarget
from batchd.server.batching.plan import Plan, plan_batch
from batchd.server.errors import DeadlineExceeded, clip
from batchd.server.request import Request

RATE_WINDOW_S = 0.05  # arrivals are counted over windows of this length
CALLERS_WINDOW_S = 0.5  # the most requests present is kept over one to two windows
AUTO_DELAY_MIN_S = 0.001  # the automatic delay before any rate is measured
TOGETHER_S = 0.002  # batches (sequences) ending this close free their places as one
# With the automatic delay, a batch for an idle worker stops waiting once the loop has
# idled, with no request coming, for the time this many rows take to arrive at the
# measured rate (ModelQueue.quiet_at): GAP_ROWS while the loop is nearly saturated,
# when each batch sent costs throughput, GAP_ROWS_SPARE while it has time to spare.
GAP_ROWS = 3.0
GAP_ROWS_SPARE = 0.5
NEARLY_SATURATED = 0.75  # the loop's busy share from which the gap is GAP_ROWS


def expire(request: Request, now: float) -> None:
    if request.timer is not None:
        request.timer.cancel()
        request.timer = None
    if not request.future.done():
        waited_ms = (now - request.arrival) * 1e3
        request.future.set_exception(
            DeadlineExceeded(
                f"request {clip(request.id) if request.id else '(no id)'} to model "
                f"{request.model.name!r} reached its "
                f"deadline after {waited_ms:.1f} ms in the queue, before a worker took it"
            )
        )


def dead(r: Request, now: float) -> bool:
    return r.future.done() or r.deadline <= now


def _without(q: deque[Request], chosen: set[int]) -> deque[Request]:
    """`q` less the requests whose ids are `chosen` (emptied as they are found). Those
    at its head (answered entries among them) leave in O(taken); `q` is rebuilt only
    when some were further in."""
    while q and (id(q[0]) in chosen or q[0].future.done()):
        chosen.discard(id(q.popleft()))
    return deque(r for r in q if id(r) not in chosen) if chosen else q


class ModelQueue:
    """One model's waiting requests: a FIFO per priority level."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        b = config.batching
        self.levels: list[deque[Request]] = [deque() for _ in range(max(1, b.priority_levels))]
        self.jobs: deque[Request] = deque()  # the job lane: batch jobs' requests
        self.limits = b.priority_queue_sizes or (0,) * len(self.levels)
        self.max_rows = max(config.max_batch_size, 1)
        self.compacted_at = -math.inf
        self.window = max(64, 4 * self.max_rows)  # how far bucketing looks into each level
        # One FIFO whose batches only rows bound: an arrival may skip the planner (a
        # ragged model's tokens bound them too, with or without max_batch_tokens).
        self.plain = len(self.levels) == 1 and not (
            b.preferred_batch_sizes or config.ragged or b.bucket_by_length
        )
        self.target = (
            LatencyTarget(b.target_latency_ms / 1e3, self.max_rows) if b.target_latency_ms else None
        )
        self.rate = 0.0  # rows arriving per second, measured (for the automatic delay)
        # A batch's compute seconds, and the seconds between batches' ends with requests
        # waiting, averaged: a full queue's pushback (batch_s was #workers times too long).
        self.batch_s, self.gap_s, self._backlog_at = 0.0, 0.0, -math.inf
        self.idle_at_arrival = -math.inf  # the loop's idle seconds at the last arrival
        self._window_at, self._window_rows = -math.inf, 0
        self.callers = 1 << 30  # the most requests present lately (present()); none yet
        self._callers_at, self._callers_now, self._callers_before = -math.inf, 0, 0

    def finished(self, compute_s: float, now: float) -> None:
        """A batch (or a sequence) of this model ended, `compute_s` its time."""
        self.batch_s = compute_s if not self.batch_s else 0.8 * self.batch_s + 0.2 * compute_s
        gap = now - self._backlog_at  # since the last end, requests waiting then and now:
        if gap < TOGETHER_S:  # how often places free (not how often requests come); ends of
            return  # one moment free theirs at once: a step round's 32 sequences said 1 ms
        if gap < math.inf and len(self):  # (review 57e)
            self.gap_s = gap if not self.gap_s else 0.8 * self.gap_s + 0.2 * gap
        self._backlog_at = now if len(self) else -math.inf

    def pushback_s(self) -> float:
        """About how long till this full queue has room: a place frees as a batch leaves,
        as often as batches end while requests wait; its delay if longer."""
        return max(self.delay_s(), self.gap_s or self.batch_s)

    def __len__(self) -> int:
        if len(self.levels) == 1:  # no priority levels: asked on every arrival
            return len(self.levels[0])
        return sum(len(q) for q in self.levels)

    @property
    def cap(self) -> int:
        return self.target.cap if self.target else self.max_rows

    def arrived(self, now: float, rows: int, idle_s: float) -> None:
        """Count an arrival for the measured arrival rate (rows per second); `idle_s`:
        the event loop's idle seconds so far (LoopLoad.idle_s)."""
        self.idle_at_arrival = idle_s
        self._window_rows += rows
        elapsed = now - self._window_at
        if elapsed >= RATE_WINDOW_S:
            rate = self._window_rows / elapsed
            self.rate = rate if elapsed > 4 * RATE_WINDOW_S else 0.5 * self.rate + 0.5 * rate
            self._window_at, self._window_rows = now, 0

    def present(self, now: float, count: int) -> None:
        """Count the requests present just after an arrival (queued, and in batches on
        workers): `callers` is the most over the last one to two CALLERS_WINDOW_S.
        A closed loop of N callers has at most N present; once all N are, no
        other request is coming (Scheduler._all_here)."""
        if (elapsed := now - self._callers_at) >= CALLERS_WINDOW_S:
            # after a silence of two windows or more, what came before it is forgotten
            self._callers_before = self._callers_now if elapsed < 2 * CALLERS_WINDOW_S else 0
            self._callers_at, self._callers_now = now, 0
        self._callers_now = max(self._callers_now, count)
        self.callers = max(self._callers_now, self._callers_before)

    def delay_s(self) -> float:
        """How long a partial batch may wait to fill (when waiting is on at all: the
        worker is busy, or the frontend's loop busy: loopload.PATIENT). Configured
        (`max_queue_delay_us`), or automatic: the time a full batch takes to arrive at
        the measured rate, at most AUTO_DELAY_MAX_US. Waiting longer cannot fill it,
        waiting less sends it part empty while more requests are on their way; but a
        wait in which not one more row is expected (under 50 a second) gains nothing:
        a sparse model on a frontend another model kept patient waited out 20 ms for
        1.2 rows a batch, its worker idle, its callers' p50 twice the busy model's."""
        configured_us = self.config.batching.max_queue_delay_us
        if configured_us is not None:
            configured = configured_us / 1e6
        elif self.rate > 0:
            wait = min(AUTO_DELAY_MAX_US / 1e6, self.cap / self.rate)
            configured = wait if wait * self.rate >= 1 else 0.0
        else:
            configured = AUTO_DELAY_MIN_S
        return self.target.delay_s(configured) if self.target else configured

    def quiet_at(self, now: float, idle_s: float, gap_rows: float = GAP_ROWS) -> float | None:
        """When arrivals count as stopped, so a batch waiting to fill for an idle
        worker leaves: once the event loop has idled for `gap_rows` rows' time at the
        measured rate since the last arrival (`idle_s`: its idle seconds now). Idle
        time, not wall time: a loop busy with other callbacks registers no arrival
        however many wait, and on 16 cores at 256 callers wall-time gaps cut
        batches of 31 rows to 20. Only with the automatic delay (a configured
        `max_queue_delay_us` is waited out, as Triton's). The automatic delay
        assumes requests keep coming; the callers of a closed loop smaller than a
        batch do not: tiny at 20 callers waited the whole 20 ms for a batch of 32
        that could not fill, each time the loop turned patient."""
        if self.config.batching.max_queue_delay_us is not None or self.rate <= 0:
            return None
        return now + max(0.0, gap_rows / self.rate - (idle_s - self.idle_at_arrival))

    def compact(self, now: float) -> None:
        """Drop every finished (cancelled, expired) entry; used when the queue looks full."""
        self.compacted_at = now
        for i, q in enumerate(self.levels):
            for r in q:
                if r.deadline <= now:
                    expire(r, now)
            self.levels[i] = deque(r for r in q if not dead(r, now))

    def room(self, level: int, count: int) -> str | None:
        """Why `count` more requests at `level` do not fit, or None if they do."""
        limit = self.config.batching.max_queue_size
        needs = f"; this request needs {count} places" if count > 1 else ""
        if len(self) + count > limit:
            return f"{len(self)} requests waiting, max_queue_size {limit}{needs}"
        level_limit = self.limits[level]
        if level_limit and len(self.levels[level]) + count > level_limit:
            return (
                f"{len(self.levels[level])} requests waiting at priority {level + 1}, "
                f"its limit {level_limit}{needs}"
            )
        return None

    def most(self, request: Request) -> int:
        """The most places `request` may take, in the queue and at its level (a job's
        lane is bounded by its runner: the queue's alone)."""
        limit = self.config.batching.max_queue_size
        return min(limit, (0 if request.background else self.limits[request.level]) or limit)

    def most_said(self, request: Request) -> str:
        limit = self.config.batching.max_queue_size
        if self.most(request) == limit:
            return f"max_queue_size {limit}"
        return f"priority {request.level + 1}: priority_queue_sizes {self.limits[request.level]}"

    def drop_dead_heads(self, now: float) -> None:
        for q in self.levels:  # dead heads go now; dead entries deeper are skipped, then compacted
            while q and dead(q[0], now):
                expire(q.popleft(), now)

    def plan(self, now: float, past_suspects: bool = False) -> Plan | None:
        self.drop_dead_heads(now)
        return plan_batch(self.levels, now, self.cap, self.config.batching, self.window,
                          self.config.packed, past_suspects)  # fmt: skip

    def take(self, plan: Plan) -> None:
        """Remove the plan's requests. They are mostly the heads of their levels (with
        answered entries among them): those leave in O(batch); only a level the plan
        took from further in (priorities, buckets, sizes) is rebuilt."""
        by_level: dict[int, set[int]] = {}
        for r in plan.requests:
            by_level.setdefault(r.level, set()).add(id(r))
        for level, chosen in by_level.items():
            self.levels[level] = _without(self.levels[level], chosen)
        for r in plan.requests:
            if r.timer is not None:
                r.timer.cancel()
                r.timer = None

    def suspect_first(self) -> bool:
        """Whether a retry after a failure (put back at the front) heads a level."""
        return any(q and q[0].suspect and not q[0].future.done() for q in self.levels)

    def suspects(self) -> Iterator[Request]:
        """The retries after a failure, at the front of each level and of the job lane."""
        for q in (*self.levels, self.jobs):
            yield from itertools.takewhile(lambda r: r.suspect, q)

    def only_suspects(self) -> bool:
        """Whether every request queued online is a retry after a failure (pump sent those
        that could go: the rest wait for a settled worker, or an idle one)."""
        return all(next(itertools.dropwhile(lambda r: r.suspect, q), None) is None
                   for q in self.levels)  # fmt: skip

    def hand_over(self, dest: ModelQueue) -> bool:
        """Move every live request queued here (online and job lane) to `dest`, another
        version of the model, ahead of its own, if it takes the same requests: inputs,
        outputs, batching dimension, priority levels, step-wise or not. Whether moved."""
        a, b = self.config, dest.config
        if (a.inputs, a.outputs, a.max_batch_size, a.batch_inputs, len(self.levels)) != (
            b.inputs, b.outputs, b.max_batch_size, b.batch_inputs, len(dest.levels)
        ) or (a.generate is None) != (b.generate is None):  # fmt: skip
            return False
        moved = [r for level in [*self.levels, self.jobs] for r in level if not r.future.done()]
        for level in [*self.levels, self.jobs]:
            level.clear()
        for r in moved:
            r.model = b
        dest.put_front(moved)
        return True

    def put_front(self, requests: Iterable[Request]) -> None:
        for r in reversed([r for r in requests if not r.future.done()]):
            (self.jobs if r.background else self.levels[r.level]).appendleft(r)

    def plan_jobs(self, now: float) -> Plan | None:
        """The next batch of the job lane: its requests in order, up to a full batch."""
        while self.jobs and self.jobs[0].future.done():
            self.jobs.popleft()  # a cancelled job's
        return plan_batch(
            [self.jobs], now, self.max_rows, self.config.batching, self.window, self.config.packed
        )

    def take_jobs(self, plan: Plan) -> None:
        """Remove the plan's requests: the lane's head, in order (as take())."""
        self.jobs = _without(self.jobs, {id(r) for r in plan.requests})
