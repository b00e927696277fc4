"""The worker pool: what the frontend knows of each worker and each batch it holds.

A step-wise model's sequences are held apart from batches: each worker has
`max_active` slots per such model, and slots are its credits for it; a new
sequence goes to the worker with the most free slots.

Pure state, no socket and no clock of its own: the registry of workers (by
their ZeroMQ identity), the models each has loaded, its credits (batches it
may hold at once: one on a CPU, where a staged batch would be formed early
and small and take CPU the frontend needs; two on a GPU, one running and one
staged, so the device never waits), round-robin among the workers with a
free credit (an idle one first), and the in-flight table (`batch id ->
requests`, per worker), written before a batch is sent. The core asks and
tells it; it calls nothing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig
from batchd.server.batching import decision
from batchd.server.batching.decision import IDLE, Capacity
from batchd.server.errors import clip
from batchd.server.request import Batch, Request

log = logging.getLogger("batchd.pool")
DIED_LOADING = 2  # workers of a slot lost in a row as they load a version: it is not sent again


@dataclass(eq=False)
class WorkerHandle:
    """The frontend's view of one worker process (it runs worker/runner.py)."""

    identity: bytes
    info: wire.WorkerInfo
    models: set[str] = field(default_factory=set)  # ModelConfig.key of each loaded version
    inflight: dict[int, Batch] = field(default_factory=dict)
    sequences: dict[int, Batch] = field(default_factory=dict)  # step-wise: one request each
    progress: dict[str, float] = field(default_factory=dict)  # key -> its last STEP came
    step_rounds: dict[str, int] = field(default_factory=dict)  # model -> last round counted
    loads: dict[str, asyncio.Future[str]] = field(default_factory=dict)  # key -> error or ""
    load_sent: dict[str, float] = field(default_factory=dict)  # key -> when its LOAD went
    load_errors: dict[str, str] = field(default_factory=dict)  # key -> why it did not load
    credits: int = 1  # batches it may hold at once
    # step-wise: key -> the sequences other frontends have on it, as its last heartbeat
    # told (a worker of several frontends; see WorkerPool.choose_slot)
    others: dict[str, int] = field(default_factory=dict)
    # It serves several frontends and answered a batch of ours: unless the pump that
    # follows sends it another, it is told PASS, so its next forward need not wait
    # for us (worker/gather.py).
    owes_pass: bool = False
    # When its heartbeats last showed it running a forward, and our batches in the one
    # running with when each began (as estimated from them): see WorkerPool.overdue.
    busy_at: float = -math.inf
    running: dict[int, float] = field(default_factory=dict)
    forward: tuple[float, float] | None = None  # the one it runs: began, its time limit
    # Another frontend's retry runs alone on it (worker/alone.py): it bounced a batch of
    # ours, or its heartbeats say so; no batch goes to it till a beat says otherwise.
    others_alone: bool = False
    silent: bool = False  # silent past its beats, kept: nothing new till heard (58c: 62 s)
    dropping: bool = False  # its beats say it drops a model (finalizers): not idle, if free

    @property
    def name(self) -> str:
        return self.info.worker_id

    @property
    def slot(self) -> str:
        """Where it runs, the same for its restarts: a local worker's name before '#'
        (cpu0#1: cpu0), a remote one's without its default pid (host-cpu-4242: host-cpu)."""
        return self.name.rpartition("#")[0] or self.name.removesuffix(f"-{self.info.pid}")

    def accepts(self, model: str) -> bool:
        return not self.info.models or model in self.info.models

    @property
    def exclusive(self) -> bool:
        """It runs a suspect: no other batch may be staged beside it."""
        return any(b.suspect for b in self.inflight.values())

    def has_credit(self) -> bool:
        closed = self.exclusive or self.others_alone or self.silent
        return len(self.inflight) < self.credits and not closed

    def settled(self) -> bool:
        """It loads no model and runs no sequence (any frontend's): a retried job line that
        ends it is then the death's sole suspect (quarantine.py; a storm of them beside
        loads and a bystander's sequences was never remembered, and kept it down)."""
        return not self.load_sent and not self.sequences and not any(self.others.values())

    def requests(self) -> list[Request]:
        """What it runs for this frontend: its batches' requests and its sequences'."""
        return [r for b in (*self.inflight.values(), *self.sequences.values()) for r in b.requests]


class Joined(enum.Enum):
    NEW = "new"  # a worker the pool did not know
    AGAIN = "again"  # the same process registering again: kept as it was
    REPLACED = "replaced"  # another process under a known identity: the old one is gone


class WorkerPool:
    def __init__(self, credits: int | None = None, load_timeout_s: float = math.inf) -> None:
        self._credits = credits  # None: 1 per CPU worker, 2 per GPU worker
        self._load_timeout_s = load_timeout_s  # --load-timeout
        # Versions whose load ran past it, by worker slot ((slot, key) -> why): the worker
        # that replaces the one it hung is not asked again (control.worker_ready): it hung
        # there too, again and again, taking that worker's other models with it
        self.hung: dict[tuple[str, str], str] = {}
        self._stuck: dict[str, tuple[int, str]] = {}  # slot -> the pid whose load hung, why
        self._died: dict[tuple[str, str], int] = {}  # (slot, key) -> lost loading it, in a row
        self._by_identity: dict[bytes, WorkerHandle] = {}
        self._order: list[WorkerHandle] = []
        self._rr = 0
        # Ids start at a random multiple of 2**32, so this process's ids are not those
        # of the frontend it replaced: a worker it shares with no process of ours
        # (`batchd worker`) may still step that one's sequences, and their outputs
        # must not reach this process's callers (Sequences.on_step cancels them).
        self._next_id = secrets.randbits(31) << 32

    # ---- the registry ----

    def hung_for(self, worker: WorkerHandle, key: str) -> str:
        """Why `worker` must not be sent version `key` to load, or "": that version's load
        hung on its slot (it would hang again), or this very process is the one whose
        load hung (a remote worker that outlived its STOP and registered again: every
        load would wait behind the hung one, and be judged hung in its turn)."""
        pid, why = self._stuck.get(worker.slot, (0, ""))
        return why if pid == worker.info.pid else self.hung.get((worker.slot, key), "")

    def forget_hung(self, key: str) -> None:
        """Version `key` is gone (retired): its hung loads are nobody's concern now."""
        self.hung = {k: why for k, why in self.hung.items() if k[1] != key}
        self._died = {k: n for k, n in self._died.items() if k[1] != key}

    def workers(self) -> list[WorkerHandle]:
        return list(self._order)

    def get(self, identity: bytes) -> WorkerHandle | None:
        return self._by_identity.get(identity)

    def join(self, identity: bytes, info: wire.WorkerInfo) -> tuple[Joined, WorkerHandle]:
        """Register the worker that said READY. AGAIN: it is the same process (same
        instance, pid and device) saying it again, and keeps its batches; REPLACED:
        the handle returned is the old one, which the caller must `leave` first."""
        old = self._by_identity.get(identity)
        if old is not None:
            was, now = old.info, info
            same = (was.instance, was.pid, was.device) == (now.instance, now.pid, now.device)
            return (Joined.AGAIN if same else Joined.REPLACED), old
        credits = self._credits or (1 if info.device == "cpu" else 2)
        worker = WorkerHandle(identity, info, credits=credits)
        self._by_identity[identity] = worker
        self._order.append(worker)
        return Joined.NEW, worker

    def loaded(self, worker: WorkerHandle, key: str) -> None:
        worker.models.add(key)
        self._died.pop((worker.slot, key), None)

    def leave(self, worker: WorkerHandle) -> tuple[list[Batch], list[Batch]]:
        """Forget `worker`; return the batches and the sequences it held. Lost while it
        loaded a version (the first sent: it loads one at a time) DIED_LOADING times in a
        row on its slot, that version is not sent there again, as one whose load hung
        (hung_for): a model.py that ends or crashes its process as it loads took every
        restart with it, and every other model's load behind it. Not while a request that
        has lost a worker before ran there (a suspect, a sequence started again): it is
        as likely the cause (in a poison storm, a healthy model's load was blamed twice,
        and never sent again; a load that ends its process is blamed the next time)."""
        if self._by_identity.get(worker.identity) is not worker:
            return [], []
        suspect = any(b.suspect for b in worker.inflight.values()) or any(
            s.requests[0].attempts or s.requests[0].spared for s in worker.sequences.values()
        )
        for key in list(worker.load_sent)[:1] if not suspect else ():
            died = self._died[worker.slot, key] = self._died.get((worker.slot, key), 0) + 1
            if died >= DIED_LOADING:
                why = f"not sent: a worker of {worker.slot} was lost {died} times as it loaded it"
                self.hung[worker.slot, key] = why
        del self._by_identity[worker.identity]
        self._order.remove(worker)
        batches, sequences = list(worker.inflight.values()), list(worker.sequences.values())
        worker.inflight.clear()
        worker.sequences.clear()
        return batches, sequences

    # ---- capacity and choice ----

    def model_ready(self, key: str) -> bool:
        return any(key in w.models for w in self._order)

    def inflight(self, key: str) -> int:
        """Batches and sequences of model version `key` on workers now."""
        return sum(
            b.model.key == key
            for w in self._order
            for held in (w.inflight, w.sequences)
            for b in held.values()
        )

    def capacity(self, model: ModelConfig) -> Capacity:
        if model.generate is not None:
            return self._slots(model)
        key, free, idle, loading = model.key, False, False, False
        for w in self._order:
            if key in w.models and w.has_credit():
                here = not (w.inflight or w.dropping)  # (dropping: its finalizers run first)
                if here and w.settled():
                    return IDLE
                free, idle = True, idle or here
                loading = loading or (here and not (w.sequences or any(w.others.values())))
        unsettled = decision.IDLE_LOADING if loading else decision.IDLE_UNSETTLED
        return unsettled if idle else decision.BUSY_WITH_CREDIT if free else decision.NO_CAPACITY

    def requests_out(self, key: str) -> int:
        """Online requests of model version `key` in batches on workers now (a job's
        batch is of the job lane alone)."""
        return sum(
            len(b.requests)
            for w in self._order
            for b in w.inflight.values()
            if b.model.key == key and not b.requests[0].background
        )

    def choose(self, key: str, idle_only: bool = False, suspect: bool = False,
               ) -> WorkerHandle | None:  # fmt: skip
        """The next worker for a batch of `key`, round-robin: an idle one first, else one
        with a free credit; `idle_only`, an idle one. A `suspect`'s: a settled idle one (a
        death there is its own), else an idle one where no sequence runs if one is: a poison
        ends the sequences beside it (a bystander's beside its retry was lost twice)."""
        order, n, busy, idle_only = self._order, len(self._order), None, idle_only or suspect
        for k in range(n):
            w = order[(self._rr + k) % n]
            if key in w.models and w.has_credit():
                idle = not (w.inflight or w.dropping)  # (dropping: its finalizers run first)
                if idle and not (suspect and (w.sequences or any(w.others.values()))):
                    if not suspect or w.settled():
                        self._rr = (self._rr + k + 1) % n
                        return w
                    busy = (w, k)  # (idle, loading: before one where sequences run)
                elif busy is None and not (idle_only and not idle):
                    busy = (w, k)
        if busy is not None:
            self._rr = (self._rr + busy[1] + 1) % n
        return None if busy is None else busy[0]

    # ---- step-wise models: slots ----

    def active(self, worker: WorkerHandle, key: str) -> int:
        return sum(b.model.key == key for b in worker.sequences.values())

    def _slots(self, model: ModelConfig) -> Capacity:
        assert model.generate is not None
        free = False
        for w in self._order:
            if (  # (not beside a suspect: it may be a poison, that ends what runs there)
                model.key in w.models
                and (n := self.active(w, model.key)) < model.generate.max_active
                and not (w.exclusive or w.silent)
            ):
                if not (n or w.dropping):  # (dropping: its finalizers run first)
                    return IDLE
                free = True
        return decision.BUSY_WITH_CREDIT if free else decision.NO_CAPACITY

    def choose_slot(self, model: ModelConfig) -> WorkerHandle | None:
        """The worker with the most free slots for `model` (None: none has a slot free of
        our sequences). Its slots free of ours are what may be sent to it; of several such
        workers, the one whose slots other frontends (of `--frontends N`, or servers
        sharing a `batchd worker`) fill least, as its last heartbeat told: a sequence sent
        where another frontend's fill every slot would wait there while a worker beside
        it idles. (A rank only: up to a second old; a worker queues one it has no slot for.)"""
        assert model.generate is not None
        best, most = None, (False, False, -math.inf)
        for w in self._order:
            if model.key in w.models and not (w.exclusive or w.silent):
                mine = self.active(w, model.key)  # (one dropping a model: after the others
                n = model.generate.max_active - mine - w.others.get(model.key, 0)  # with room)
                if mine < model.generate.max_active and (free := (n > 0, not w.dropping, n)) > most:
                    best, most = w, free
        return best

    def beat(self, worker: WorkerHandle, header: wire.Header, now: float) -> bool:
        """A heartbeat of `worker`, come at `now`: the forward it runs (see overdue),
        the sequences every frontend has on it, whether another's retry runs alone.
        True: it takes batches again (it did not: a pump is due)."""
        freed = (worker.others_alone and not header.alone) or (
            worker.dropping and not header.dropping)  # fmt: skip
        worker.others_alone, worker.dropping = header.alone, header.dropping
        if header.busy_ns:
            began, worker.busy_at = now - header.busy_ns / 1e9, now
            worker.running = {i: worker.running.get(i, began) for i in header.running}
            worker.forward = began, header.busy_limit_s  # (each beat's: a forward has no id)
        else:
            worker.running, worker.forward = {}, None
            if header.idle_ns:  # (a beat between two forwards says it was busy just now)
                worker.busy_at = max(worker.busy_at, now - header.idle_ns / 1e9)
        had = any(worker.others.values())  # (their last sequence ended: it is settled)
        self.occupied(worker, header.occupied)
        return freed or (had and not any(worker.others.values()))

    def occupied(self, worker: WorkerHandle, occupied: Mapping[str, int]) -> None:
        """A heartbeat's count of the sequences on `worker`, every frontend's: keep the
        others' (ours are counted as they start and end)."""
        others = {k: max(0, n - self.active(worker, k)) for k, n in occupied.items()}
        if others != worker.others:
            log.debug("worker %s holds other frontends' sequences: %s", worker.name, others)
        worker.others = others

    def start(self, worker: WorkerHandle, model: ModelConfig, request: Request,
              now: float) -> Batch:  # fmt: skip
        """Record a sequence on `worker` before its START is sent."""
        self._next_id += 1
        sequence = Batch(self._next_id, model, [request], now)
        worker.sequences[sequence.id] = sequence
        return sequence

    def end(self, worker: WorkerHandle, seq_id: int) -> Batch | None:
        """A sequence leaves its slot (it ended, failed, or its caller left)."""
        return worker.sequences.pop(seq_id, None)

    # ---- the in-flight table ----

    def hand(self, worker: WorkerHandle, model: ModelConfig, requests: list[Request],
             now: float) -> Batch:  # fmt: skip
        """Record a batch on `worker` before it is sent (its reply may race the send)."""
        self._next_id += 1
        batch = Batch(self._next_id, model, requests, now, any(r.suspect for r in requests))
        worker.inflight[batch.id] = batch
        return batch

    def finish(self, worker: WorkerHandle, batch_id: int) -> Batch | None:
        """The batch a reply answers, out of the table; None if it is no longer there."""
        return worker.inflight.pop(batch_id, None)

    def overdue(self, now: float) -> list[tuple[WorkerHandle, str]]:
        """The workers stuck in their work, each with why: a batch (or sequence) past
        its model's execution_timeout_s, or a load past --load-timeout (a load() that
        never returns holds up the worker's later loads: only a new process ends it).

        A batch is timed from its forward's start as the worker's heartbeats tell it;
        one they do not show running, from the last time they showed the worker in any
        forward (or its send, if later), a heartbeat interval more: a batch waiting
        behind other frontends' forwards on a shared worker, or staged behind another,
        is not late. (Timed from its send, a batch queued behind another frontend's
        forwards was taken for stuck, its worker killed, and its retry failed as a
        poison.) A worker stuck outside its forwards (an unload that hangs), or silent
        in one that holds the GIL, is timed from the last that its heartbeats said. The
        forward it runs is held to its own limit by every frontend (the one whose
        batches it runs may be gone), a heartbeat interval more. A sequence: since it
        started, or got credit again after its worker held it, or since the last step of
        its model on that worker, or its worker's last work, whichever is later; never
        one held for its caller."""
        late = []
        for w in self._order:
            for b in [*w.inflight.values(), *w.sequences.values()]:
                since = b.sent_at
                if b.id in w.sequences:
                    if (stream := b.requests[0].stream) is not None and stream.paused:
                        continue  # held for want of credit: its worker owes it nothing now
                    # (or since its worker was last seen in other work: one forward of
                    # another model within its own limit killed a worker stepping fine)
                    since = max(since, w.progress.get(b.model.key, since), w.busy_at)
                elif b.id in w.running:
                    since = max(since, w.running[b.id])
                else:  # it may have begun since the last heartbeat: the next tells
                    since = max(since, w.busy_at) + wire.HEARTBEAT_INTERVAL_S
                if now - since > (limit := b.model.instances.execution_timeout_s):
                    name = b.model.name
                    late.append((w, f"a sequence (request id {clip(b.requests[0].id)}) of "
                                    f"model {name!r} had no step in its execution_timeout_s "
                                    f"{limit}" if b.id in w.sequences else
                                    f"batch {b.id} of model {name!r} ran past "
                                    f"execution_timeout_s {limit}"))  # fmt: skip
                    break
            else:
                began, limit = w.forward or (now, 0.0)  # (whosever it is: its owner may be gone)
                if limit and now - began > limit + wire.HEARTBEAT_INTERVAL_S:
                    late.append((w, f"its forward (or a model's release, finalizer) ran past "
                                    f"execution_timeout_s {limit}"))  # fmt: skip
                    continue
                for key, sent in list(w.load_sent.items())[:1]:  # the load it runs (in turn;
                    limit = self._load_timeout_s  # one unloaded meanwhile runs till LOADED)
                    if now - sent > limit:
                        name, _, version = key.rpartition("@")
                        late.append((w, f"its load of model {name!r} version {version} ran "
                                        f"past --load-timeout {limit:g} s"))  # fmt: skip
                        self.hung[w.slot, key] = (f"not sent: its load on {w.name} ran past "
                                                  f"--load-timeout {limit:g} s")  # fmt: skip
                        self._stuck[w.slot] = (w.info.pid, self.hung[w.slot, key])
                        break
        return late
