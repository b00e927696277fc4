"""The core: one transport-agnostic object that owns the model queues, the worker
pool, the link to the workers, their processes and model control.

A transport (the gRPC servicer in service.py) converts a request and calls
`submit`; it never sees a worker or a queue. Inside, the pieces do not call each
other: the scheduler asks the core for capacity and hands it batches; the link
reports messages, silences and ticks; the pool and recovery are pure. The core
decides what follows each event. Sending and replying never re-enter the planner: a
send that fails, a reply, a worker lost or loaded each put requests back or free a
credit and schedule one deferred pump (`pump_soon`).

    transport ──submit──▶ Scheduler (batching/) ──send──▶ Core ──▶ WorkerPool.hand
                                                                 ──▶ WorkerLink.send
                                          (a step-wise model's: ──▶ Sequences.start)
    WorkerLink ──on_message / on_silent / on_tick──▶ Core ──▶ futures, recovery, control, pump
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig
from batchd.server import frontends, recovery, tracing
from batchd.server.batching.decision import Capacity
from batchd.server.batching.scheduler import Scheduler
from batchd.server.batching.split_join import join_inputs, split_outputs
from batchd.server.control import ModelControl
from batchd.server.errors import BatchdError, ModelFailed, Unavailable
from batchd.server.index import IndexEntry
from batchd.server.link import WorkerLink
from batchd.server.loopload import LoopLoad
from batchd.server.pool import Joined, WorkerHandle, WorkerPool
from batchd.server.quarantine import Quarantine
from batchd.server.request import Batch, Request, Tensor
from batchd.server.sequences import Sequences
from batchd.server.stats import Stats
from batchd.server.supervisor import Launch, Supervisor

log = logging.getLogger("batchd.core")
_STOP = wire.pack(wire.Header(kind=wire.Header.STOP))
_FORGET = wire.pack(wire.Header(kind=wire.Header.CANCEL, batch_id=0))  # our every sequence
_PASS = wire.pack(wire.Header(kind=wire.Header.PASS))
# A worker loading a model may be silent this long: a load can hold the GIL for seconds
# (torch.jit.load of a model of gigabytes starved the heartbeat thread 6.6 s of 6.7).
LOADING_SILENCE_S, LIVE_S = 120.0, wire.HEARTBEAT_INTERVAL_S * wire.LIVENESS  # (3 s: lost)


class Core:
    def __init__(
        self, socket: zmq.Socket[bytes], stats: Stats, repository: Path, *,
        explicit: bool = False,  # --model-control explicit
        launch: Launch | None = None,  # local worker processes; None: none
        credits: int | None = None,  # batches a worker holds; None: 1 on CPU, 2 on GPU
        clock: Callable[[], float] = time.monotonic,
        load: LoopLoad | None = None,  # the event loop's (None: never saturated nor patient)
        load_timeout_s: float = math.inf,  # --load-timeout
        max_response_bytes: int = 0,  # --max-message-bytes: a worker sends no output past it
    ) -> None:  # fmt: skip
        self.stats, self._clock, self._most = stats, clock, max_response_bytes
        self.changed = asyncio.Event()  # readiness may have changed
        self._stopping = self._pump_armed = False
        self.pool = WorkerPool(credits, load_timeout_s)
        self.link = WorkerLink(socket, self, clock)
        self._saturated: Callable[[], bool] = load if load is not None else (lambda: False)
        self.scheduler = Scheduler(self, clock) if load is None else Scheduler(
            self, clock, load.patient, idle=load.idle_s, busy=lambda: load.busy)  # fmt: skip
        self.control = ModelControl(
            repository, self.pool, self.link, self.scheduler, explicit, clock,
            self.changed.set, self.pump_soon, stats.answering,
        )  # fmt: skip
        self.supervisor = Supervisor(launch or Launch(repository=repository), self.worker_exited)
        self.quarantine = Quarantine(clock)
        self.sequences = Sequences(
            self.pool, self.link, self.scheduler, stats, clock, self.pump_soon, self.lose
        )

    # ---- what a transport calls ----

    @property
    def models(self) -> dict[str, ModelConfig]:
        """The version of each loaded model that new requests go to, by name."""
        return self.control.current

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        if self.quarantine.held:  # (inputs that ended their worker: refused a while, unrun)
            self.quarantine.check(request)
        return self.scheduler.submit(request)

    def check_room(self, key: str) -> None:
        """Raise before any decoding if the request cannot be queued: the version is
        broken (no worker could load it: UNAVAILABLE) or its queue is full."""
        if (broken := self.control.broken.get(key)) is not None:
            raise Unavailable(broken)
        self.scheduler.check_room(key)

    def model_ready(self, name: str) -> bool:
        return self.control.ready(name)

    def load_error(self, name: str) -> str | None:
        """Why `name` cannot be served, when no worker could load it; else None."""
        return self.control.load_error(name)

    async def load(self, name: str) -> ModelConfig:
        return await self.control.load(name)

    async def unload(self, name: str) -> None:
        await self.control.unload(name)

    async def index(self) -> list[IndexEntry]:
        return await self.control.index()

    def cancel(self, request: Request) -> None:
        """The caller of a step-wise request left: free its queue place or its slot."""
        self.sequences.cancel(request)

    # ---- running and stopping ----

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.link.run(), name="link")
            tg.create_task(self.supervisor.run(), name="supervisor")

    def fail_all(self, error: Exception) -> None:
        """Answer every queued and in-flight request with `error` (shutdown)."""
        self.scheduler.fail_all(error)
        for w in self.pool.workers():
            for r in w.requests():
                if not r.future.done():
                    r.future.set_exception(error)
                if r.stream is not None:
                    r.stream.close()

    def stop_workers(self) -> None:
        """STOP to every worker; from now on one that registers is told to stop too."""
        self._stopping = True
        self.link.stop_peers()

    def pump_soon(self) -> None:
        """Decide again once the current callback is done: many events, one pump."""
        if not self._pump_armed:
            self._pump_armed = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_armed = False
        self.scheduler.pump()
        for w in self.pool.workers():
            if w.owes_pass:  # a shared worker answered us and got nothing back
                w.owes_pass = False
                self.link.send(w.identity, _PASS)

    # ---- what the scheduler calls ----

    def capacity(self, model: ModelConfig) -> Capacity:
        return self.pool.capacity(model)

    def requests_out(self, key: str) -> int:
        return self.pool.requests_out(key)

    def held(self, key: str) -> bool:
        return self.pool.model_ready(key)

    def jobs_paused(self, key: str) -> float:
        return self.quarantine.paused_until(key) if self.quarantine.held else 0.0

    def send(self, model: ModelConfig, requests: list[Request]) -> None:
        if model.generate is not None:
            self.sequences.start(model, requests)
            return
        # A retry after a failure, and a job's batch, go only to an idle worker (a retry to
        idle_only = any(r.suspect or r.background for r in requests)  # a settled one first)
        worker = self.pool.choose(model.key, idle_only, requests[0].suspect)
        if worker is None:  # the scheduler asked capacity() first; keep the requests anyway
            self.scheduler.requeue(requests)
            self.pump_soon()
            return
        try:
            tensors, frames = join_inputs(requests)
        except Exception as e:  # a defect, or memory: these requests fail, nothing is held
            log.exception("model %s: a batch of %d could not be built", model.name, len(requests))
            for r in requests:
                if not r.future.done():
                    r.future.set_exception(BatchdError(f"internal error building the batch: {e}"))
            return
        loaded, worker.owes_pass = self._loaded(model, requests), False
        batch = self.pool.hand(worker, model, requests, self._clock())
        header = wire.Header(kind=wire.Header.BATCH, batch_id=batch.id, model=model.name,
                             version=model.version, tensors=tensors, loaded=loaded,
                             rows=sum(r.rows for r in requests), alone=batch.suspect,
                             max_response_bytes=self._most if all(
                                 r.bounded for r in requests) else 0)  # fmt: skip
        if traces := [r.trace for r in requests if r.trace is not None]:  # (header: its context)
            batch.span = tracing.start_batch(traces, model.name, batch.id, worker.name, header)
        copy = sum(len(f) for f in frames) < wire.ZERO_COPY_MIN_BYTES
        failed = self.link.send(worker.identity, wire.pack(header, frames), copy=copy)
        if failed:  # it never left, nor ran: its requests go back uncharged, and the
            self.pool.finish(worker, batch.id)  # worker's others as after any loss
            tracing.end_batch(batch.span, f"not sent to worker {worker.name}: {failed}")
            self.scheduler.requeue(requests)  # (and a pump is scheduled: no recursion)
            self.lose(worker, failed)

    def _loaded(self, model: ModelConfig, requests: list[Request]) -> bool:
        """Whether `model` is under load (wire.proto, Header.loaded): anything but a
        lone online request with nothing else of its model waiting or running, and a
        frontend with time to spare. Then the worker leaves a core to the frontend."""
        if len(requests) > 1 or requests[0].background or self._saturated():
            return True
        return bool(self.scheduler.queued_version(model.key) or self.pool.inflight(model.key))

    # ---- what the link reports ----

    def on_message(self, identity: bytes, header: wire.Header, frames: list[Any]) -> None:
        kind = header.kind
        if kind == wire.Header.READY:
            self._on_ready(identity, header.worker)
            return
        worker = self.pool.get(identity)
        if worker is None:
            return  # a worker we already gave up on; it registers again when we stay silent
        if worker.silent:  # heard again: it takes work again
            worker.silent = False
            self.pump_soon()
        if kind in (wire.Header.RESULT, wire.Header.ERROR):
            self._on_reply(worker, header, frames)
        elif kind == wire.Header.STEP:
            self.sequences.on_step(worker, header, frames)
        elif kind == wire.Header.LOADED:
            self.control.on_loaded(worker, header)
        elif kind == wire.Header.HEARTBEAT and self.pool.beat(worker, header, self._clock()):
            self.pump_soon()  # it takes batches again: another frontend's retry has gone

    def on_silent(self, identity: bytes, silent_s: float) -> None:
        worker = self.pool.get(identity)
        if worker is None:
            self.link.forget(identity)
        elif not self._may_be_silent(worker, silent_s):
            self.lose(worker, f"no message for {silent_s:.1f} s")
        elif not worker.silent:
            worker.silent = True
            log.warning("worker %s silent for %.1f s: kept (its work or another frontend's may "
                        "hold it), given nothing new till it is heard", worker.name, silent_s,
                        extra={"worker": worker.name})  # fmt: skip

    def _may_be_silent(self, worker: WorkerHandle, silent_s: float) -> bool:
        """Whether `worker`, silent `silent_s`, is still given time (asked again each
        heartbeat round). Its I/O thread cannot beat while its compute thread holds the
        GIL (torch.jit.load of gigabytes, a C call in a forward, a big heap's collection
        after a drop: 58d). A loading worker gets LOADING_SILENCE_S. A live local process
        with work on it (or its beats said: a drop) gets its work's limit (on_tick), one
        of several frontends (its forward may be another's, or a gone one's) the longest
        execution_timeout_s; a remote one could as well be gone."""
        if silent_s < LOADING_SILENCE_S and any(not f.done() for f in worker.loads.values()):
            return True
        pid, models = worker.info.pid, self.models.values()
        if not (self.supervisor.pids().get(worker.name) == pid or frontends.sibling(pid)):
            return False  # (not a local process)
        longest = max((c.instances.execution_timeout_s for c in models), default=0.0) + LIVE_S
        return bool(worker.inflight or worker.sequences or worker.forward) or (
            worker.info.frontends > 1 and silent_s < longest)  # fmt: skip

    def on_tick(self, now: float) -> None:
        for worker in [w for w in self.pool.workers() if frontends.gone(w.info.pid)]:  # (a
            self.lose(worker, "its process exited", stuck=False)  # child: frontend 0 saw it)
        for worker, why in self.pool.overdue(now):
            self.link.send(worker.identity, _STOP)  # if it can hear
            self.lose(worker, why)

    def worker_exited(self, name: str, pid: int, reason: str) -> bool:
        """The supervisor saw that local worker's process exit (not a peer under its id): if
        it ran one request alone, loading nothing, it is no crash loop (True; quarantine.py)."""
        ran = False
        for w in [w for w in self.pool.workers() if w.name == name and w.info.pid == pid]:
            ran = len(w.requests()) == 1 and not w.load_sent
            self.lose(w, reason, stuck=False)
        return ran

    # ---- workers joining and leaving ----

    def _on_ready(self, identity: bytes, info: wire.WorkerInfo) -> None:
        if info.protocol != wire.PROTOCOL_VERSION:
            log.error("worker %s speaks wire protocol %d, this frontend %d; ignored",
                      info.worker_id, info.protocol, wire.PROTOCOL_VERSION)  # fmt: skip
            return
        if self._stopping:  # it started up while we shut down: it missed the STOP
            self.link.send(identity, _STOP)
            return
        joined, worker = self.pool.join(identity, info)
        if joined is Joined.AGAIN and not info.reconnected:
            return  # the same process, which heard nothing from us for a while: kept as is
        if joined is not Joined.NEW:  # another process under that id (the old one is gone),
            why = f"it registered again, a new process (pid {info.pid})"
            if info.reconnected:
                why = "it connected again: what its old connection carried may be lost"
            self.lose(worker, why, stuck=False, blamed=joined is Joined.REPLACED)
            joined, worker = self.pool.join(identity, info)  # (or this one on a new connection)
        self.link.watch(identity)
        self.link.send(identity, _FORGET)  # what it runs for us now is a predecessor's, or lost
        log.info("worker %s registered (pid %d, device %s) for models %s", info.worker_id,
                 info.pid, info.device, ", ".join(info.models) or "any",
                 extra={"worker": info.worker_id, "device": info.device})  # fmt: skip
        self.control.worker_ready(worker)
        self.changed.set()
        self.pump_soon()

    def lose(self, worker: WorkerHandle, reason: str, stuck: bool = True,
             blamed: bool = True) -> None:  # fmt: skip
        """Forget `worker`; its requests go back to the queue (recovery decides which; not
        `blamed`, as for a load, once each uncharged). `stuck` (not for one that exited or
        was replaced): its process may live on, useless (silent, hung): a local one is killed."""
        if self.pool.get(worker.identity) is not worker:
            return
        batches, sequences = self.pool.leave(worker)
        for b in batches:
            tracing.end_batch(b.span, f"worker {worker.name} lost: {reason}")
        charged = blamed and not worker.load_sent  # (alone, its process ended: remembered;
        alone = charged and not stuck and len(batches) + len(sequences) == 1  # not a hang)
        poisoned, began = self.quarantine.add if alone else None, recovery.begun(sequences)
        sees = worker.info.frontends < 2  # every load on it (not so under --frontends N)
        back = recovery.after_loss(batches, worker.name, reason, charged and not began, poisoned,
                                   blamed and bool(worker.load_sent), sees)  # fmt: skip
        back += recovery.after_sequence_loss(sequences, worker.name, reason, batches, charged,
                                             poisoned)  # fmt: skip
        self.link.forget(worker.identity)
        self.control.worker_lost(worker, reason)
        log.warning("worker %s lost: %s; %d request(s) requeued", worker.name, reason,
                    len(back), extra={"worker": worker.name, "reason": reason})  # fmt: skip
        if stuck:
            self.supervisor.kill(worker.name, worker.info.pid)
        self.changed.set()
        self.scheduler.requeue(back)
        self.pump_soon()

    # ---- replies ----

    def _on_reply(self, worker: WorkerHandle, header: wire.Header, frames: list[Any]) -> None:
        batch = self.pool.finish(worker, header.batch_id)
        if batch is None:
            return
        received = self._clock()
        self.pump_soon()  # a credit is free
        worker.owes_pass = worker.info.frontends > 1
        tracing.end_batch(batch.span, header.error, **{  # (no span: nothing)
            "batchd.compute_ns": header.compute_ns, "batchd.forward_rows": header.forward_rows,
        })  # fmt: skip
        if header.bounced:  # unrun: another frontend's retry runs alone there (worker/alone.py)
            worker.others_alone = True  # till a heartbeat says it has gone
            self.scheduler.requeue(batch.requests)  # as they were: no attempt lost
            return
        if header.kind == wire.Header.ERROR:
            retry = recovery.after_error(batch, worker.name, header.error, header.forward_rows,
                                         header.invalid, header.too_large)  # fmt: skip
            if retry:
                log.warning("batch %d of model %s failed on worker %s (%s); retrying its %d "
                            "requests one by one", batch.id, batch.model.name, worker.name,
                            header.error, len(retry), extra={"batch": batch.id,
                            "model": batch.model.name, "worker": worker.name})  # fmt: skip
                self.scheduler.requeue(retry)
            return
        try:
            results = split_outputs(batch.requests, header.tensors, frames)
        except Exception as e:  # (ValueError: bad outputs; anything else, from a peer
            error = ModelFailed(f"model {batch.model.name!r} on worker {worker.name} returned "
                                f"bad outputs: {e}")  # (that is not a batchd worker)  # fmt: skip
            for r in batch.requests:
                if not r.future.done():
                    r.future.set_exception(error)
            return
        if widened := recovery.answer(batch, results, self._most, header.forward_rows):
            self.scheduler.requeue(widened)  # (retried alone: their answers may fit then)
        self._record(batch, received, header)

    def _record(self, batch: Batch, received: float, reply: wire.Header) -> None:
        done, model = self._clock(), batch.model
        infer_ns, waited_ns = reply.compute_ns, reply.waited_ns  # (waited: staged on the worker)
        round_trip_ns = int((received - batch.sent_at) * 1e9)
        rows = sum(r.rows for r in batch.requests)
        if model.ragged:  # a packed batch computes its real tokens, and no more
            real = sum(r.rows * r.length for r in batch.requests)
            computed = real if model.packed else rows * max(r.length for r in batch.requests)
            self.stats.padding(model.name, model.version, real, computed)
        self.scheduler.observe(model.key, rows, infer_ns / 1e9)
        # Each request's (not a job line's), counted once it is answered (stats.py); a
        # batch staged on its worker behind another waited there: queue time too.
        input_ns = max(0, round_trip_ns - infer_ns - waited_ns)
        output_ns = int((done - received) * 1e9)
        for r in batch.requests:
            if not r.background:
                r.took(int((batch.sent_at - r.arrival) * 1e9) + waited_ns, input_ns, infer_ns,
                       output_ns)  # fmt: skip
        self.stats.batch_done(model.name, model.version, rows, input_ns, infer_ns, output_ns,
                              reply.forward_rows)  # fmt: skip
