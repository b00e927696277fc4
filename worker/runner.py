"""The worker process: an I/O thread, a compute thread and a loader thread.

The I/O thread (main) owns the links to the frontends, one per frontend it serves
(`--connect` takes a comma-separated list: `batchd serve --frontends N` runs N frontend
processes in front of the same workers; frontend_link.py registers, heartbeats, and
never blocks on a send): it hands batches to the compute thread, loads and unloads to
the loader thread (loading.py), and forwards the replies. It waits at most POLL_MS for
anything, so a stop (SIGTERM, STOP, its parent's exit) is seen within that, whether or
not a frontend ever accepted the worker.

The compute thread runs the models, in the order the frontend asked, and drops
them on UNLOAD (held.py); the loader installs them, so batches go on while a model
loads. Each talks back over its own inproc PUSH socket, so no ZeroMQ socket is ever
shared between threads. Heartbeats keep flowing while a long batch or load runs. A
model exception becomes an ERROR reply, a failed load a LOADED reply with the
reason; the worker lives on. STOP, a vanished parent, or SIGTERM end it."""

from __future__ import annotations

import functools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from batchd.protos import traces, wire
from batchd.protos.model_config import model_key
from batchd.worker import InputRefused, alone, execute, frontend_link, loader, merge
from batchd.worker.execute import COUNTED, BatchError, OutputTooLarge, failed, run_batch, why
from batchd.worker.frontend_link import FrontendLink
from batchd.worker.gather import Gatherer
from batchd.worker.generate import EVERY, Reply, on_sequence, time_limit
from batchd.worker.held import Held, limit_of
from batchd.worker.loader import defaults_kept, leave
from batchd.worker.loading import Collections, Loaded, Loader, addressed, own_thread, settle_heap

log = logging.getLogger("batchd.worker")
_RESULTS = "inproc://batchd-results"
_SEQUENCE = (wire.Header.START, wire.Header.CANCEL, wire.Header.CREDIT)
POLL_MS = 100  # the I/O loop's longest wait: a SIGTERM's flag is read within it (exit < 1 s)
RELOADED = "reloaded (its files changed)"  # why a copy is dropped, beside an UNLOAD
HOLD_S = 0.01  # while a frontend is behind, how often the compute thread looks again
STOP_GRACE_S = 5.0  # after STOP (or SIGTERM), how long the batch at hand may take to finish
_NOTHING: merge.Item = (-1, wire.Header(), [])  # the compute thread found no work
DROPPING: list[merge.Item] = []  # `_busy`'s batches while a drop (not a forward) runs


@dataclass(frozen=True)
class RunnerOptions:
    worker_id: str
    endpoint: str  # one frontend, or several separated by commas
    device: torch.device
    repository: Path
    allowed: tuple[str, ...] = ()  # models it may load; empty: any in the repository
    parent_pid: int | None = None
    keys: Path | None = None  # CURVE key directory (protos/keys.py); None: no encryption
    tracing: traces.Tracing | None = None  # on: a compute span per traced batch


class Runner:
    """What a worker process runs: it registers with its frontends, loads the models
    they ask for and runs their batches (a frontend's handle on it: server/pool.py)."""

    def __init__(self, options: RunnerOptions) -> None:
        self.options = options
        self.held = Held()  # the models, their loops (the loader and compute thread's)
        self._work: queue.SimpleQueue[merge.Item | None] = queue.SimpleQueue()  # (None: the end)
        self._instance = secrets.token_hex(8)  # WorkerInfo's
        self._busy: tuple[int, Sequence[merge.Item] | None, float]  # since, batches, limit
        self._busy = (time.perf_counter_ns(), None, 0.0)  # (None: since when none runs)
        self._stop = threading.Event()
        self._behind = threading.Event()  # a frontend has replies kept: no step till it takes
        o = options
        self._loader = Loader(self._work, self._install, self.held, o.repository, o.device,
                              o.allowed)  # fmt: skip
        self._collections = Collections(o.device.type == "cuda")
        self._dropping = functools.partial(self._timed, group=DROPPING)  # (beats say so)
        self._said_dropping = False  # a beat said so (the I/O thread's)
        self._gatherer = Gatherer(self._work, shared="," in options.endpoint)  # (frontends)
        self._alone = alone.Alone()

    # ---- compute thread ----

    def _compute(self, ctx: zmq.Context[Any]) -> None:
        # OpenMP keeps its thread count per thread (`--threads`, set in the main thread,
        # reached not this one: mlp's small batches spun a thread per core, 2 cores not 1)
        torch.set_num_threads(torch.get_num_threads())
        self._threads_all = torch.get_num_threads()
        out = ctx.socket(zmq.PUSH)
        out.connect(_RESULTS)

        def reply(frontend: int, parts: list[Any], ends: int = 1) -> None:
            out.send_multipart([addressed(frontend, ends), *parts], copy=False)

        held: merge.Item | None = None  # taken while gathering a forward, not merged
        try:
            while True:
                item: merge.Item | None
                due = self._collections.run(time.monotonic(), self._dropping)
                if held is not None:
                    item, held = held, None
                elif any(loop.busy or loop.waiting for loop in self.held.loops.values()):
                    held_back = self._behind.is_set()  # no step while a frontend is behind;
                    # stepping, take what came; all held, look again every HOLD_S (beats)
                    idle = held_back or not any(loop.busy for loop in self.held.loops.values())
                    try:
                        item = self._work.get(timeout=HOLD_S) if idle else self._work.get_nowait()
                    except queue.Empty:  # (the rounds run past this block: in it, a model's
                        item = _NOTHING  # traceback logged there was chained to this Empty)
                    if item is _NOTHING:
                        self._rounds(reply, held_back)
                        continue
                else:
                    try:
                        item = self._work.get(timeout=due)  # (None: till work comes)
                    except queue.Empty:
                        continue  # an unload's collection's time has come
                if item is None:
                    return
                try:
                    held = self._handle(item, reply)
                except Exception as e:  # a defect, or a message no frontend sends: it
                    log.exception("work of kind %d failed", item[1].kind)  # fails, not the
                    reply(item[0], *failed(item[1], e))  # compute thread
                if item[1].kind == wire.Header.BATCH and any(
                        x.busy for x in self.held.loops.values()):  # fmt: skip
                    self._rounds(reply, self._behind.is_set())  # (staged forwards starved them)
        finally:
            out.close(linger=0)

    def _rounds(self, reply: Callable[..., None], held_back: bool) -> None:
        """A round of every step-wise model's loop (none while a frontend is behind)."""
        for loop in [] if held_back else self.held.loops.values():  # (after each forward)
            loop.calling = lambda: setattr(self, "_busy", (time.perf_counter_ns(), *self._busy[1:]))
            limit = loop.cfg.instances.execution_timeout_s  # its beats say so: a round is
            replies = self._timed(limit, loop.round) if loop.busy else loop.round()  # work
            for frontend, parts, ends in replies:
                reply(frontend, parts, ends)

    def _timed(self, limit: float, work: Callable[[], Any], group: Sequence[Any] = ()) -> Any:
        """`work()`, busy in the heartbeats meanwhile (running `group`), held to `limit`."""
        self._busy = (time.perf_counter_ns(), group, limit)
        try:
            with defaults_kept():  # (torch's default dtype and device)
                return work()
        finally:
            self._busy = (time.perf_counter_ns(), None, 0.0)

    def _handle(self, item: merge.Item, reply: Callable[..., None]) -> merge.Item | None:
        """Do one piece of work from a frontend; returns an item taken but not done
        (a batch that could not join the forward gathered here), to do next."""
        frontend, header, frames = item
        if header.kind == wire.Header.UNLOAD:  # (held to its model's limit: a finalizer
            work = functools.partial(self._unload, header, frames)  # that hung was the next
            for to, parts, ends in self._dropping(limit_of(frames[0]), work):  # batch's fault)
                reply(to, parts, ends)
        elif header.kind == wire.Header.PASS:
            self._gatherer.passed(frontend)
        elif header.kind in _SEQUENCE:
            work = functools.partial(on_sequence, self.held.loops, frontend, header, frames,
                                     self.options.device)  # fmt: skip
            limit = time_limit(self.held.loops, header)  # None: it runs no model code
            for to, parts, ends in work() if limit is None else self._timed(limit, work):
                reply(to, parts, ends)
        else:
            cfg, _ = self.held.models.get(model_key(header.model, header.version), (None, None))
            stepping = any(loop.busy for loop in self.held.loops.values())
            try:
                group, held = self._gatherer.gather(cfg, item, not stepping)
            except BaseException:  # (a defect: the batch fails; it is here no more)
                self._alone.ran(frontend, header)
                raise
            limit = cfg.instances.execution_timeout_s if cfg else 0.0  # (the heartbeats tell)
            try:
                replies = self._timed(limit, functools.partial(self._run, group), group)
            except Exception as e:  # past the forward (a split, a pack): all of it fails
                log.exception("batch %d failed", header.batch_id)
                replies = [(f, failed(h, e)[0]) for f, h, _ in group]
            finally:
                for f, h, _ in group:
                    self._alone.ran(f, h)
            for to, parts in replies:
                reply(to, parts)
            return held
        return None

    def _install(self, loaded: Loaded) -> None:
        """Install a model the loader loaded; the copy it replaced goes as an UNLOAD's."""
        if (replaced := self.held.install(loaded)) is not None and loaded.model is not None:
            cfg = loaded.model[0]
            unload = wire.Header(kind=wire.Header.UNLOAD, model=cfg.name, version=cfg.version)
            self._work.put((0, unload, [replaced, RELOADED]))  # (answering none but its loop's)

    def _unload(self, header: wire.Header, frames: list[Any]) -> list[Reply]:
        """Drop a model version's copy (Held.take's) unless another replaced it; its sequences
        here end (the replies). `frames`: the copy, then why (RELOADED; none: an UNLOAD), popped:
        `item`, which the compute loop keeps, held a model past its collection (review 55b)."""
        why = frames.pop() if len(frames) > 1 else ""
        name, version, key = header.model, header.version, model_key(header.model, header.version)
        self.held.drop(key, copy := frames.pop())
        limit, (entry, loop, package) = limit_of(copy), copy
        del copy
        said = f"model {name!r} version {version!r} was {why or 'unloaded'}"
        ended = loop.drop_all(said) if loop else []
        del loop  # the model's last references here go before the collection below
        if entry is not None:
            del entry
            loader.forget(package)  # its model.py's modules
            self._collections.due(limit)  # (its objects may be among the frozen)
            what = f"model {name} version {version}"
            done = f"{what} was {why}: its old copy dropped" if why else f"unloaded {what}"
            log.info("%s", done, extra={"model": name})
        return ended

    def _run(self, group: list[merge.Item]) -> list[tuple[int, list[Any]]]:
        """One forward for the batches of `group`; a reply for each, to its frontend."""
        header = group[0][1]
        entry = self.held.models.get(model_key(header.model, header.version))
        rows = [merge.rows_of(h) for _, h, _ in group]
        try:
            if entry is None or entry[0].generate is not None:
                is_ = "step-wise (its files changed)" if entry else "not loaded"
                raise BatchError(f"model {header.model!r} version {header.version!r} is {is_} "
                                 "on this worker")  # fmt: skip
            cfg, fn = entry
            execute.use_threads(self._threads_all, header.loaded)
            tensors, frames = merge.join(group) if len(group) > 1 else (header.tensors, group[0][2])
            most = min(h.max_response_bytes for _, h, _ in group)  # (0, any batch's: none)
            start, wall = time.perf_counter_ns(), time.time_ns()
            out_tensors, out_frames = run_batch(fn, cfg, self.options.device, tensors, frames,
                                                sum(rows), most)  # fmt: skip
            compute_ns = time.perf_counter_ns() - start
        except BaseException as e:  # any model failure is reply data, never a dead worker
            log.debug("batch %d failed", header.batch_id, exc_info=True)  # (formatted if shown)
            message = wire.text(why(e))  # (SystemExit too: it would end this thread)
            return [  # forward_rows: whether the batch ran alone (server/recovery.py)
                (f, wire.pack(wire.Header(kind=wire.Header.ERROR, batch_id=h.batch_id,
                                          model=h.model, error=message, forward_rows=sum(rows),
                                          invalid=isinstance(e, InputRefused),
                                          too_large=isinstance(e, OutputTooLarge))))
                for f, h, _ in group
            ]  # fmt: skip
        headers = [h for _, h, _ in group]
        traces.compute_spans(self.options.tracing, headers, wall, compute_ns, sum(rows))
        parts = merge.split(out_tensors, out_frames, rows) if len(group) > 1 else None
        replies = []
        for n, (f, h, _) in enumerate(group):
            ts, fs = parts[n] if parts else (out_tensors, out_frames)
            reply = wire.Header(
                kind=wire.Header.RESULT, batch_id=h.batch_id, model=h.model,
                compute_ns=compute_ns, forward_rows=sum(rows), tensors=ts,
                waited_ns=max(0, start - h.waited_ns) if h.waited_ns else 0,
            )  # fmt: skip
            replies.append((f, wire.pack(reply, fs)))
        return replies

    # ---- I/O thread ----

    def _ready(self, reconnected: bool = False) -> list[Any]:
        o = self.options
        info = wire.WorkerInfo(worker_id=o.worker_id, device=str(o.device), pid=os.getpid(),
                               models=o.allowed, protocol=wire.PROTOCOL_VERSION,
                               frontends=o.endpoint.count(",") + 1, instance=self._instance,
                               held=sorted(self.held.models), reconnected=reconnected)  # fmt: skip
        return wire.pack(wire.Header(kind=wire.Header.READY, worker=info))

    def _beat(self, frontend: int) -> list[Any]:
        """A heartbeat to one frontend: the forward (or step round) running and its batches
        (it times a batch from its forward's start); each step-wise model's sequences here,
        every frontend's (a frontend of several places its own where the fewest are). Read
        from the I/O thread: `_busy` and `loops` are replaced whole."""
        since, group, cap = self._busy  # (a drop's group: it is not idle, though none runs)
        beat = wire.Header(kind=wire.Header.HEARTBEAT, busy_limit_s=cap, dropping=group is DROPPING)
        self._said_dropping |= beat.dropping
        if group is None:
            beat.idle_ns = max(1, time.perf_counter_ns() - since)
        else:
            beat.busy_ns = max(1, time.perf_counter_ns() - since)
            beat.running.extend(h.batch_id for f, h, _ in group if f == frontend)
        for key, loop in self.held.loops.items():
            beat.occupied[key] = len(loop.active) + len(loop.waiting)
        beat.alone = self._alone.others(frontend, time.monotonic())
        return wire.pack(beat)

    def serve(self) -> None:
        settle_heap()
        ctx: zmq.Context[Any] = zmq.Context()
        o, ready = self.options, self._ready
        links = [FrontendLink(ctx, e, o.worker_id, o.keys, ready) for e in o.endpoint.split(",")]
        results = ctx.socket(zmq.PULL)  # from the compute and the loader thread
        results.bind(_RESULTS)
        (compute := own_thread(self._compute, "compute", ctx)).start()
        self._loader.start(ctx, _RESULTS)
        grace = STOP_GRACE_S
        try:
            grace = self._loop(links, results)
        finally:
            end = time.monotonic() + grace
            if not self._loader.stop(waited := max(grace, 1.0)):  # it ends the compute
                log.error("a model is still loading %.0f s on; exiting without it", waited)
                leave(3)  # thread's queue
            compute.join(timeout=max(0.0, end - time.monotonic()))
            if compute.is_alive():  # a hung model: no way to stop its thread but to leave
                what = "the model is still running after %.0f s; exiting without it"
                log.error(what, STOP_GRACE_S)
                leave(3)
            results.close(linger=0)
            now = time.monotonic()
            for link in links:
                link.close(now)
            ctx.term()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self, links: list[FrontendLink], results: zmq.Socket[Any]) -> float:
        """Serve until a stop; returns how long the compute thread may still take."""
        now = time.monotonic()
        for link in links:
            link.open(now)
        poller, io = frontend_link.poller(links, results), _IO()
        beats = [functools.partial(self._beat, i) for i in range(len(links))]
        while not (io.stopping and io.pending == 0) and not self._stop.is_set():
            events = dict(poller.poll(timeout=POLL_MS))
            now = time.monotonic()
            if results in events:
                to, *reply = results.recv_multipart(copy=False)
                frontend, ends = to.bytes[0], int.from_bytes(to.bytes[1:], "little")
                io.pending -= ends
                if reply:  # (none: bookkeeping only, a cancelled sequence settled)
                    links[frontend].reply(reply)
            for i, link in enumerate(links):
                if events.get(link.socket, 0) & zmq.POLLIN and (msg := link.receive(now)):
                    batch = msg[0].kind == wire.Header.BATCH
                    if batch and not self._alone.admit(i, msg[0], now):
                        link.reply(alone.bounce(msg[0]))  # another frontend's runs alone here
                    elif (held := self._loader.at_once(msg[0], io.stopping)) is not None:
                        link.reply(held)  # a LOAD of a version installed: not behind loads
                    else:
                        self._from_frontend(io, i, *msg)
            self._keep_up(links, poller, now)
            ended = self._said_dropping and self._busy[1] is not DROPPING  # (said at once,
            self._said_dropping &= not ended  # a drop's end: frontends choose it again)
            # (a link opened a new socket: poll that one)
            if any([link.tick(now, beat, ended) for link, beat in zip(links, beats, strict=True)]):
                poller = frontend_link.poller(links, results)
            if io.stopping and now - io.stop_at > STOP_GRACE_S:
                return 0.0  # the batch at hand will not finish: serve() leaves without it
            if not io.stopping and self.options.parent_pid not in (None, os.getppid()):
                log.warning("parent process exited; stopping")  # as a STOP: the replies
                io.stopping, io.stop_at = True, now  # still go (to frontends of several)
        return STOP_GRACE_S

    def _keep_up(self, links: list[FrontendLink], poller: zmq.Poller, now: float) -> None:
        """Send the replies kept for frontends that were behind; while any are kept, the
        compute thread steps no sequence, and the loop wakes when a socket takes more.
        A frontend given up on (frontend_link.py) loses its sequences here."""
        behind = False
        for i, link in enumerate(links):
            given_up, kept = link.abandoned, link.flush(now)
            if link.abandoned and not given_up:
                self._work.put((i, wire.Header(kind=wire.Header.CANCEL, batch_id=EVERY), []))
            behind |= kept > 0
            if bool(kept) != link.polled_out:
                link.polled_out = bool(kept)
                poller.modify(link.socket, zmq.POLLIN | (zmq.POLLOUT if kept else 0))
        (self._behind.set if behind else self._behind.clear)()

    def _from_frontend(self, io: _IO, i: int, header: wire.Header, frames: list[Any]) -> None:
        to = self._loader if header.kind in (wire.Header.LOAD, wire.Header.UNLOAD) else self._work
        if header.kind == wire.Header.BATCH:  # its arrival: RESULT's waited_ns
            header.waited_ns = time.perf_counter_ns()
        if header.kind in COUNTED and not io.stopping:
            to.put((i, header, frames))
            io.pending += 1
        elif header.kind in (wire.Header.UNLOAD, wire.Header.PASS, *_SEQUENCE[1:]):
            to.put((i, header, frames))
        elif header.kind == wire.Header.STOP and not io.stopping:
            # the first STOP starts the grace: a stopping frontend answers each READY
            # again with STOP, and those must not push the hung model's deadline on
            log.info("STOP received")
            io.stopping, io.stop_at = True, time.monotonic()


@dataclass
class _IO:  # the I/O thread's own state
    pending: int = 0  # batches and loads handed to the compute thread, not yet answered
    stopping: bool = False  # STOP came: finish what is pending, take nothing new
    stop_at: float = 0.0
