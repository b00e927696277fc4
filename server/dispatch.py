"""The frontend's side of the ZeroMQ wire: workers, credits, the in-flight table.

Workers connect (DEALER) to one ROUTER socket and say READY with the models
they may load; `load` asks one to load a model version (LOAD/LOADED) and
`unload` drops a version everywhere. Batches are routed by the version key
("mlp@2") so that two versions can serve side by side while one drains.
Each worker holds at most `credits` batches: by default one on a CPU (a
staged batch would be formed early, small, and take CPU the frontend needs)
and two on a GPU (one running, one staged, so the device never waits);
`send` picks, round-robin, an idle worker first, then one with a free credit.
The in-flight entry is written before the send. A worker that goes silent
for LIVENESS heartbeats, whose process exits, or that holds a batch past its
execution limit is lost: its requests go back to the front of their queue,
except those already sent twice, which fail.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from google.protobuf.message import DecodeError

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig, model_key
from batchd.server.batching.decision import BUSY_WITH_CREDIT, IDLE, NO_CAPACITY, Capacity
from batchd.server.batching.split_join import join_inputs, split_outputs
from batchd.server.errors import ModelFailed
from batchd.server.request import Request
from batchd.server.stats import Stats
from batchd.server.workers import Batch, Events, Worker

log = logging.getLogger("batchd.dispatch")
MAX_ATTEMPTS = 2  # a request rides on at most two batches that lose their worker
DRAIN_MAX = 64  # messages read in one callback before the loop's other callbacks get a turn
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: zmq's flag enums are slow


class Dispatcher:
    def __init__(
        self,
        # A plain socket, read by a reader callback and sent on without waiting:
        # zmq.asyncio's futures cost the event loop more per message than the work
        # they carry (see run() and _send()).
        socket: zmq.Socket[bytes],
        stats: Stats,
        credits: int | None = None,  # None: 1 per CPU worker, 2 per GPU worker
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = socket
        self._stats = stats
        self._credits = credits
        self._clock = clock
        self._workers: dict[bytes, Worker] = {}
        self._order: list[Worker] = []
        self._rr = 0
        self._ids = itertools.count(1)
        self._events: Events | None = None
        self._stopping = False  # STOP was sent: workers leaving is expected, not a loss
        self._drain_armed = False
        self._crashed: asyncio.Future[None] | None = None

    def attach(self, events: Events) -> None:
        self._events = events

    @property
    def events(self) -> Events:
        assert self._events is not None, "Dispatcher.attach() was not called"
        return self._events

    # ---- state the rest of the frontend reads ----

    def workers(self) -> list[Worker]:
        return list(self._order)

    def model_ready(self, key: str) -> bool:
        return any(key in w.models for w in self._order)

    def inflight(self, key: str) -> int:
        """Batches of model version `key` on workers now."""
        return sum(b.model.key == key for w in self._order for b in w.inflight.values())

    def _has_credit(self, w: Worker) -> bool:
        return len(w.inflight) < w.credits and not w.exclusive

    def capacity(self, key: str) -> Capacity:
        free = False
        for w in self._order:
            if key in w.models and self._has_credit(w):
                if not w.inflight:
                    return IDLE
                free = True
        return BUSY_WITH_CREDIT if free else NO_CAPACITY

    # ---- sending ----

    def _choose(self, key: str, idle_only: bool = False) -> Worker | None:
        order, n, busy = self._order, len(self._order), None
        for k in range(n):
            w = order[(self._rr + k) % n]
            if key in w.models and self._has_credit(w):
                if not w.inflight:
                    self._rr = (self._rr + k + 1) % n
                    return w
                if busy is None and not idle_only:
                    busy = (w, k)
        if busy is None:
            return None
        self._rr = (self._rr + busy[1] + 1) % n
        return busy[0]

    def send(self, model: ModelConfig, requests: list[Request]) -> None:
        suspect = any(r.suspect for r in requests)
        worker = self._choose(model.key, idle_only=suspect)
        if worker is None:  # the scheduler asked capacity() first; keep the requests anyway
            self.events.requeue(requests)
            return
        batch = Batch(next(self._ids), model, requests, self._clock(), suspect)
        worker.inflight[batch.id] = batch  # before the send: a reply may race the callback
        tensors, frames = join_inputs(requests)
        header = wire.Header(
            kind=wire.Header.BATCH,
            batch_id=batch.id,
            model=model.name,
            version=model.version,
            tensors=tensors,
        )
        copy = sum(len(f) for f in frames) < wire.ZERO_COPY_MIN_BYTES
        self._send(worker, wire.pack(header, frames), copy=copy)

    # ---- loading and unloading ----

    def load(self, worker: Worker, model: ModelConfig) -> asyncio.Future[str]:
        """Ask `worker` to load `model`; the future gives "" once loaded, else why not."""
        fut = worker.loads.get(model.key)
        if fut is None:
            fut = worker.loads[model.key] = asyncio.get_running_loop().create_future()
            header = wire.Header(kind=wire.Header.LOAD, model=model.name, version=model.version)
            self._send(worker, wire.pack(header))
        return fut

    def unload(self, model: ModelConfig) -> None:
        """Every worker drops `model` (a version nothing is queued for or running)."""
        header = wire.pack(
            wire.Header(kind=wire.Header.UNLOAD, model=model.name, version=model.version)
        )
        for w in self._order:
            fut = w.loads.pop(model.key, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(f"model {model.name!r} version {model.version} was unloaded")
                w.models.discard(model.key)
                self._send(w, header)
        self.events.workers_changed()

    def _on_loaded(self, worker: Worker, header: wire.Header) -> None:
        key = model_key(header.model, header.version)
        fut = worker.loads.get(key)
        if fut is None or fut.done():
            return
        if header.error:
            del worker.loads[key]
            log.error(
                "worker %s could not load model %s version %s: %s",
                worker.name,
                header.model,
                header.version,
                header.error,
                extra={"worker": worker.name, "model": header.model},
            )
        else:
            worker.models.add(key)
        fut.set_result(header.error)
        self._log_if_ready(worker)
        self.events.workers_changed()
        self.events.pump()

    def _send(self, worker: Worker, parts: list[Any], copy: bool = True) -> None:
        # Straight on the socket, never waiting: a worker holds at most a few batches
        # and a heartbeat a second, far below the send high-water mark, so EAGAIN (its
        # pipe full) and EHOSTUNREACH (ROUTER_MANDATORY: gone) both mean it is lost.
        try:
            self._sock.send_multipart([worker.identity, *parts], flags=zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as e:
            if not self._stopping:
                self.lose(worker, f"send failed: {e}")
            return
        # A send may consume the socket's edge-triggered FD signal for messages
        # that have already arrived: look for them now rather than wait for the next.
        if cast(int, self._sock.getsockopt(_EVENTS)) & _POLLIN:
            self._drain_soon()

    def fail_inflight(self, error: Exception) -> None:
        """Answer every request still on a worker with `error` (shutdown)."""
        for w in self._order:
            for batch in w.inflight.values():
                for r in batch.requests:
                    if not r.future.done():
                        r.future.set_exception(error)

    def stop_workers(self) -> None:
        self._stopping = True
        for w in self._order:
            self._send(w, wire.pack(wire.Header(kind=wire.Header.STOP)))

    # ---- losing a worker ----

    def lose(self, worker: Worker, reason: str, stuck: bool = True) -> None:
        """Forget `worker`; send its requests back to the queue (or fail the twice-sent).
        `stuck`: its process may live on, useless (silent, hung past its execution
        limit, its pipe full): a local one is killed. Not for a process that exited
        or that another took the place of.

        Every request it held is charged an attempt and retried as a suspect:
        alone, on an idle worker that takes nothing else meanwhile. So an
        innocent request that shared a worker with a poison one is charged
        once, and its lone retry succeeds; the poison request kills one more
        worker at most, then fails.
        """
        if self._workers.get(worker.identity) is not worker:
            return
        del self._workers[worker.identity]
        self._order.remove(worker)
        back: list[Request] = []
        for batch in worker.inflight.values():
            for r in batch.requests:
                if r.future.done():
                    continue
                r.attempts += 1
                if r.attempts >= MAX_ATTEMPTS:
                    r.future.set_exception(
                        ModelFailed(
                            f"model {batch.model.name!r}: the worker running this request was lost "
                            f"{r.attempts} times (last: {worker.name}: {reason}); not retried again"
                        )
                    )
                else:
                    r.suspect = True
                    back.append(r)
        worker.inflight.clear()
        for fut in worker.loads.values():
            if not fut.done():
                fut.set_result(f"worker {worker.name} was lost while loading: {reason}")
        log.warning(
            "worker %s lost: %s; %d request(s) requeued",
            worker.name,
            reason,
            len(back),
            extra={"worker": worker.name, "reason": reason},
        )
        self.events.worker_lost(worker.name, reason, stuck)
        self.events.workers_changed()
        for key in {r.model.key for r in back}:
            self.events.requeue([r for r in back if r.model.key == key])
        self.events.pump()

    def lose_by_name(self, name: str, reason: str) -> None:
        """A worker's process exited (the supervisor saw it)."""
        for w in list(self._order):
            if w.name == name:
                self.lose(w, reason, stuck=False)

    # ---- receiving ----

    async def run(self) -> None:
        """Receive from the workers (a reader callback on the socket) and keep their
        heartbeats, until cancelled; an unexpected error in a message handler ends it."""
        loop = asyncio.get_running_loop()
        self._crashed = loop.create_future()
        fd = cast(int, self._sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._drain)
        self._drain_soon()  # what came before the reader was added
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._heartbeat_loop(), name="dispatch-heartbeat")
                await self._crashed
        finally:
            loop.remove_reader(fd)

    def _drain_soon(self) -> None:
        if not self._drain_armed:
            self._drain_armed = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self, most: int = DRAIN_MAX) -> None:
        """Every message waiting on the socket, one callback for all (the FD is
        edge-triggered: it signals again only once the socket has been read dry)."""
        self._drain_armed = False
        if self._sock.closed:  # shut down after this call was scheduled
            return
        try:
            for _ in range(most):
                try:
                    parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._receive(parts)
            self._drain_soon()  # more may wait: let the loop's other callbacks run first
        except Exception as e:  # a bug, not a worker's fault: end run() as a task would end
            if self._crashed is None or self._crashed.done():
                raise  # no run() to end: the loop's exception handler reports it
            self._crashed.set_exception(e)

    def _receive(self, parts: list[Any]) -> None:
        identity = parts[0].bytes
        try:
            header, frames = wire.unpack(
                [p.bytes if i == 0 else p for i, p in enumerate(parts[1:])]
            )
        except (DecodeError, ValueError, IndexError) as e:
            log.warning("dropping malformed message from %r: %s", identity, e)
            return
        self._on_message(identity, header, frames)

    def _on_message(self, identity: bytes, header: wire.Header, frames: list[Any]) -> None:
        kind = header.kind
        if kind == wire.Header.READY:
            self._on_ready(identity, header.worker)
            return
        worker = self._workers.get(identity)
        if worker is None:
            return  # a worker we already gave up on; it re-registers when we stay silent
        worker.last_seen = self._clock()
        if kind in (wire.Header.RESULT, wire.Header.ERROR):
            self._on_reply(worker, header, frames)
        elif kind == wire.Header.LOADED:
            self._on_loaded(worker, header)

    def _on_ready(self, identity: bytes, info: wire.WorkerInfo) -> None:
        old = self._workers.get(identity)
        if old is not None and old.info.pid == info.pid and old.info.device == info.device:
            # The same process registering again: it heard nothing from us for a while
            # (our loop was busy) and is alive, with its batches; keep it as it is.
            old.last_seen = self._clock()
            return
        if info.protocol != wire.PROTOCOL_VERSION:
            log.error(
                "worker %s speaks wire protocol %d, this frontend %d; ignored",
                info.worker_id,
                info.protocol,
                wire.PROTOCOL_VERSION,
            )
            return
        credits = self._credits or (1 if info.device == "cpu" else 2)
        worker = Worker(identity, info, self._clock(), credits=credits)
        if self._stopping:  # it started up while we shut down: it missed the STOP
            self._send(worker, wire.pack(wire.Header(kind=wire.Header.STOP)))
            return
        if old is not None:  # another process under the same id: the old one is gone
            self.lose(old, f"it registered again as pid {info.pid}", stuck=False)
        self._workers[identity] = worker
        self._order.append(worker)
        log.info(
            "worker %s registered (pid %d, device %s) for models %s",
            info.worker_id,
            info.pid,
            info.device,
            ", ".join(info.models) or "any",
            extra={"worker": info.worker_id, "device": info.device},
        )
        self.events.worker_ready(worker)
        self._log_if_ready(worker)

    def _log_if_ready(self, worker: Worker) -> None:
        if all(f.done() for f in worker.loads.values()):
            log.info(
                "worker %s ready (pid %d, device %s) with models %s",
                worker.name,
                worker.info.pid,
                worker.info.device,
                ", ".join(sorted(worker.models)) or "none",
                extra={"worker": worker.name, "device": worker.info.device},
            )

    def _on_reply(self, worker: Worker, header: wire.Header, frames: list[Any]) -> None:
        batch = worker.inflight.pop(header.batch_id, None)
        if batch is None:
            return
        received = self._clock()
        live = batch.requests
        pending = [r for r in live if not r.future.done()]
        if header.kind == wire.Header.ERROR and len(pending) > 1:
            # Find the offending request(s): every member retries alone.
            log.warning(
                "batch %d of model %s failed on worker %s (%s); retrying its %d "
                "requests one by one",
                batch.id,
                batch.model.name,
                worker.name,
                header.error,
                len(pending),
                extra={"batch": batch.id, "model": batch.model.name, "worker": worker.name},
            )
            for r in pending:
                r.suspect = True
            self.events.requeue(pending)
            self.events.pump()
            return
        try:
            if header.kind == wire.Header.ERROR:
                raise ModelFailed(
                    f"model {batch.model.name!r} raised on worker {worker.name}: {header.error}"
                )
            results = split_outputs(live, header.tensors, frames)
        except (ModelFailed, ValueError) as e:
            error = (
                e
                if isinstance(e, ModelFailed)
                else ModelFailed(
                    f"model {batch.model.name!r} on worker {worker.name} returned bad outputs: {e}"
                )
            )
            for r in live:
                if not r.future.done():
                    r.future.set_exception(error)
        else:
            for r, result in zip(live, results, strict=True):
                if not r.future.done():
                    r.future.set_result(result)
            self._record(batch, received, header.compute_ns)
        self.events.pump()

    def _record(self, batch: Batch, received: float, infer_ns: int) -> None:
        done = self._clock()
        round_trip_ns = int((received - batch.sent_at) * 1e9)
        rows = sum(r.rows for r in batch.requests)
        if batch.model.ragged:
            longest = max(r.length for r in batch.requests)
            self._stats.padding(
                batch.model.name, sum(r.rows * r.length for r in batch.requests), rows * longest
            )
        self.events.batch_done(batch.model.key, rows, infer_ns / 1e9)
        self._stats.batch_done(
            batch.model.name,
            rows=rows,
            requests=len(batch.requests),
            queue_ns=sum(int((batch.sent_at - r.arrival) * 1e9) for r in batch.requests),
            input_ns=max(0, round_trip_ns - infer_ns),
            infer_ns=infer_ns,
            output_ns=int((done - received) * 1e9),
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S)
            if not self._stopping:
                self.keep_alive()

    def keep_alive(self) -> None:
        """Judge every worker once: lost if silent for LIVENESS heartbeats or holding a
        batch past its execution limit, else sent a heartbeat. What has come in is
        read first: after a busy spell of the event loop, the workers' heartbeats
        wait unread on the socket, and silence is theirs only if nothing is there."""
        self._drain(most=1 << 30)
        beat = wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))
        silence = wire.HEARTBEAT_INTERVAL_S * wire.LIVENESS
        now = self._clock()
        for w in list(self._order):
            overdue = [
                b
                for b in w.inflight.values()
                if now - b.sent_at > b.model.instances.execution_timeout_s
            ]
            if now - w.last_seen > silence:
                self.lose(w, f"no message for {now - w.last_seen:.1f} s")
            elif overdue:
                self._send(w, wire.pack(wire.Header(kind=wire.Header.STOP)))  # if it can hear
                self.lose(
                    w,
                    f"batch {overdue[0].id} of model {overdue[0].model.name!r} ran "
                    f"past execution_timeout_s "
                    f"{overdue[0].model.instances.execution_timeout_s}",
                )
            else:
                self._send(w, beat)
