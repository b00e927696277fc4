"""Admission and batch formation: the bounded per-model queues and the shell
around `batching.decide`.

Admission never waits: a full queue raises QueueFull at once. `pump()` is
synchronous and runs whenever something changes (a request arrives, a worker
frees a credit or joins, a batch comes back for retry, a delay runs out); it
asks `decide` per model and hands formed batches to the dispatcher. The
scheduler owns the queues; nothing else touches them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from batchd.protos.model_config import ModelConfig
from batchd.server.batching import Capacity, QueueState, Send, decide
from batchd.server.errors import DeadlineExceeded, QueueFull
from batchd.server.request import Request, Tensor

log = logging.getLogger("batchd.scheduler")


class Dispatch(Protocol):
    """What the scheduler needs from the dispatcher (a fake in unit tests)."""

    def capacity(self, model: str) -> Capacity: ...

    def send(self, model: ModelConfig, requests: list[Request]) -> None: ...


def _expire(request: Request, now: float) -> None:
    if request.timer is not None:
        request.timer.cancel()
        request.timer = None
    if not request.future.done():
        waited_ms = (now - request.arrival) * 1e3
        request.future.set_exception(
            DeadlineExceeded(
                f"request {request.id or '(no id)'} to model {request.model.name!r} reached its "
                f"deadline after {waited_ms:.1f} ms in the queue, before a worker took it"
            )
        )


class ModelQueue:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.items: deque[Request] = deque()
        self.rows = 0  # rows of every queued entry, including ones already done
        self.cap = max(config.max_batch_size, 1)
        self.fixed_shapes = all(-1 not in s.shape for s in config.inputs)

    def __len__(self) -> int:
        return len(self.items)

    def _drop_front(self, now: float) -> None:
        items = self.items
        while items and (items[0].future.done() or items[0].deadline <= now):
            r = items.popleft()
            self.rows -= r.rows
            _expire(r, now)

    def compact(self, now: float) -> None:
        """Remove every finished (cancelled, expired) entry; used when the queue looks full."""
        live = deque(r for r in self.items if not r.future.done() and r.deadline > now)
        for r in self.items:
            if r.deadline <= now:
                _expire(r, now)
        self.items = live
        self.rows = sum(r.rows for r in live)

    def state(self, now: float) -> QueueState | None:
        self._drop_front(now)
        if not self.items:
            return None
        head = self.items[0]
        if self.fixed_shapes:
            rows = min(self.rows, self.cap)
        else:
            key, rows = head.shape_key, 0
            for r in self.items:
                if rows >= self.cap:
                    break
                if r.shape_key == key and not r.future.done():
                    rows += r.rows
        return QueueState(oldest_arrival=head.arrival, batchable_rows=rows)

    def take(self, max_rows: int, now: float) -> list[Request]:
        """Pop, FIFO, the live requests that fit one batch with the head's shapes."""
        batch: list[Request] = []
        skipped: list[Request] = []
        rows, key = 0, None
        items = self.items
        while items and rows < max_rows:
            r = items[0]
            if r.future.done() or r.deadline <= now:
                items.popleft()
                self.rows -= r.rows
                _expire(r, now)
                continue
            if key is None:
                key = r.shape_key
            elif r.shape_key != key:
                skipped.append(items.popleft())
                continue
            if rows + r.rows > max_rows:
                break
            items.popleft()
            self.rows -= r.rows
            rows += r.rows
            if r.timer is not None:
                r.timer.cancel()
                r.timer = None
            batch.append(r)
        items.extendleft(reversed(skipped))
        return batch

    def put_front(self, requests: Iterable[Request]) -> None:
        live = [r for r in requests if not r.future.done()]
        self.items.extendleft(reversed(live))
        self.rows += sum(r.rows for r in live)


class Scheduler:
    def __init__(self, dispatch: Dispatch, clock: Callable[[], float] = time.monotonic) -> None:
        self._dispatch = dispatch
        self._clock = clock
        self._queues: dict[str, ModelQueue] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add_model(self, config: ModelConfig) -> None:
        self._queues[config.name] = ModelQueue(config)

    def queued(self, model: str) -> int:
        return len(self._queues[model])

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        """Admit `request` or raise QueueFull; never waits. Returns the result future."""
        q = self._queues[request.model.name]
        now = self._clock()
        limit = q.config.batching.max_queue_size
        if len(q) >= limit:
            q.compact(now)
            if len(q) >= limit:
                raise QueueFull(
                    f"queue of model {q.config.name!r} is full ({limit} requests waiting, "
                    f"max_queue_size {limit}); retry later",
                    retry_after_ms=self._pushback_ms(q),
                )
        loop = asyncio.get_running_loop()
        request.arrival = now
        request.future = loop.create_future()
        q.items.append(request)
        q.rows += request.rows
        if request.queue_timeout:
            request.timer = loop.call_at(
                loop.time() + (request.deadline - now), self._expire_queued, request
            )
        self.pump()
        return request.future

    def requeue(self, requests: list[Request]) -> None:
        """Put requests of a lost batch back at the front of their queue."""
        if requests:
            self._queues[requests[0].model.name].put_front(requests)
            self.pump()

    def fail_all(self, error: Exception) -> None:
        """Answer every queued request with `error` (shutdown)."""
        for q in self._queues.values():
            for r in q.items:
                if not r.future.done():
                    r.future.set_exception(error)
            q.items.clear()
            q.rows = 0

    def _expire_queued(self, request: Request) -> None:
        # Only requests still queued expire here; the dispatcher owns sent ones.
        q = self._queues.get(request.model.name)
        request.timer = None
        if q is not None and not request.future.done() and request in q.items:
            _expire(request, self._clock())

    def _pushback_ms(self, q: ModelQueue) -> int:
        return max(1, int(q.config.batching.max_queue_delay_us / 1000))

    def pump(self) -> None:
        now = self._clock()
        wake = math.inf
        for q in list(self._queues.values()):
            while True:
                state = q.state(now)
                cfg = q.config
                decision = decide(
                    now,
                    state,
                    self._dispatch.capacity(cfg.name),
                    q.cap,
                    cfg.batching.max_queue_delay_us / 1e6,
                )
                if isinstance(decision, Send):
                    batch = q.take(decision.max_rows, now)
                    if batch:
                        self._dispatch.send(cfg, batch)
                        continue
                elif decision.until is not None:
                    wake = min(wake, decision.until)
                break
        self._arm(wake, now)

    def _arm(self, wake: float, now: float) -> None:
        if wake == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = wake
        if wake != math.inf:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + max(0.0, wake - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self.pump()
