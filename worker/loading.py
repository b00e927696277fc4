"""Loading models on a thread of their own, so that a worker serves its batches
while it loads: a new version beside the one serving, another model, a load()
that takes minutes or never returns. On the compute thread a load stopped
every batch behind it, of every model, for as long as it took.

The I/O thread hands LOAD and UNLOAD here, in the order they came. The loader
installs what it loaded at once (the runner's tables are replaced whole, never
changed under the compute thread reading them) and answers LOADED itself, so a
reload's swap waits for no batch; an UNLOAD goes on to the compute thread (a
step-wise model's sequences end there), after the loads asked before it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import zmq

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig, model_key
from batchd.protos.repository import (
    Files,
    changed_since,
    digest,
    files_of,
    find_model,
    find_with_files,
    identity,
)
from batchd.worker.execute import why
from batchd.worker.loader import ModelFn, forget, load_copy

if TYPE_CHECKING:
    from batchd.worker.held import Held

_OWN: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def own_thread(target: Callable[..., object], name: str, *args: Any) -> threading.Thread:
    """A thread of the worker's own (compute, loader): one that dies takes the process
    with it (__main__.die_with_a_worker_thread); a model's threads do not."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _OWN.add(thread)
    return thread


def is_own(thread: threading.Thread | None) -> bool:
    return thread in _OWN


log = logging.getLogger("batchd.worker")


@dataclass(frozen=True)
class Loaded:
    """What a LOAD came to: the model, or why not; None and "" when it was loaded already.
    `files`: the model's files as they were when it was read (repository.files_of);
    `package`: what its model.py was loaded as (loader.forget, once this copy is dropped)."""

    model: tuple[ModelConfig, ModelFn] | None = None
    error: str = ""
    files: tuple[Path, Files] | None = None
    package: str = ""


def load(
    header: wire.Header, repository: Path, device: torch.device, allowed: tuple[str, ...],
    have: Mapping[str, tuple[Path, Files]], stepping: bool = False,
) -> Loaded:  # fmt: skip
    """Load the model version `header` names, unless `have` holds it (by key: its folder
    and files as they were read), from the files the LOAD names (`files`: their digest),
    unchanged till the load ends. A plain LOAD of one read from other files loads them
    again: it comes from a frontend that read them as they are now (a frontend started
    again numbers its versions from 1: this worker served the old weights under the new
    version's number); a frontend that knows of the change says `held`. `stepping`: the
    copy held is step-wise (its sequences may be another frontend's)."""
    package = ""  # (what a load that then failed loaded goes: loader.forget)
    try:
        if allowed and header.model not in allowed:
            raise ValueError(f"not among this worker's --models ({', '.join(allowed)})")
        # (the folder the frontend read them in: else a copy, with other modification times)
        same = bool(header.files) and header.folder == identity(repository)
        if (had := have.get(model_key(header.model, header.version))) is not None:
            if header.held or (digest(had[1]) == header.files if same
                               else files_of(had[0]) == had[1]):  # fmt: skip
                return Loaded()
            if stepping and find_model(repository, header.model).generate is not None:
                log.warning("model %s version %s: its files changed since it was loaded here, "
                            "but it is step-wise, and another frontend's sequences may run on "
                            "it: kept (restart this worker to load them)", header.model,
                            header.version)  # fmt: skip
                return Loaded()  # (a new loop would leave them without an answer)
            log.warning("model %s version %s: its files changed since it was loaded here; "
                        "loading them again", header.model, header.version)  # fmt: skip
        elif header.held:  # (its files changed: they are not that version's)
            return Loaded(error=wire.NOT_HELD)
        start = time.perf_counter()
        found, snapshot = find_with_files(repository, header.model)  # (before what load() reads)
        if same and digest(snapshot) != header.files:  # changed since it was numbered
            when = "since they were read for version {}"  # (by the frontend)
            return Loaded(error=changed_since(header.model, header.version, snapshot, None, when))
        cfg = dataclasses.replace(found, version=header.version)
        files = (cfg.directory, snapshot)
        fn, package = load_copy(cfg, device)
        now = files_of(cfg.directory)  # changed as it read them: it may hold either
        if changed := changed_since(cfg.name, cfg.version, snapshot, now, "as version {} loaded"):
            forget(package)
            return Loaded(error=changed)
        settle_heap()
        log.info("loaded model %s version %s from %s in %.2f s", cfg.name, cfg.version,
                 cfg.artifact, time.perf_counter() - start, extra={"model": cfg.name})  # fmt: skip
        return Loaded((cfg, fn), files=files, package=package)
    except BaseException as e:  # a model that will not load is reply data too, even
        # one that calls sys.exit(): it would end this thread, and the compute thread
        forget(package)
        log.error("cannot load model %s:\n%s", header.model, _chain(e),
                  extra={"model": header.model})  # fmt: skip
        return Loaded(error=wire.text(why(e)))


def _chain(e: BaseException | None) -> str:
    """A traceback of `e` and the exceptions it came of (a missing file under a model's
    own error), each message cut short as in a reply: a message of 10 MB came whole."""
    parts: list[str] = []
    while e is not None and len(parts) < 8:
        parts.append("".join(traceback.format_tb(e.__traceback__)) + wire.text(why(e)))
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return "\nwhich led to:\n".join(reversed(parts))


def settle_heap() -> None:
    """Collect, then freeze what is left (torch's modules, the loaded models): a
    full collection then walks only what batches create, not torch's thousands of
    long-lived objects, so it no longer stalls a batch for tens of milliseconds."""
    gc.collect()
    gc.freeze()


COLLECT_SHARE = 0.1  # of the compute thread's time, at most, for unloads' collections
COLLECT_GAP_MAX_S = 1.0  # ... but an unloaded model's memory waits no longer than this
COLLECT_MIN_S = 10.0  # the least an unload's collection is given (Collections.due)


class Collections:
    """The collection an unload needs, spaced out. An unloaded model's objects were
    frozen with the rest after its load, so freeing its cycles takes gc.unfreeze() and a
    full collection of every object, torch's too: 35-150 ms holding the GIL, on the
    compute thread. One per unload stalled every model on the worker: reloads back to
    back (7 a second) took another model from 1,338 to 79 req/s. Unloads now share one,
    run as soon as the last one is far enough behind that collections take at most
    COLLECT_SHARE of the time (at once, for an unload now and then), and at most
    COLLECT_GAP_MAX_S after it: a heap that takes a second to collect would otherwise
    hold an unloaded model's memory (a GPU's too) for ten, a reload's third copy."""

    def __init__(self, cuda: bool) -> None:
        self.pending = False
        self.limit = 0.0  # the longest execution_timeout_s of the models it frees (their
        self._at = 0.0  # finalizers run in it); the earliest the next may run (monotonic)
        self._cuda = cuda

    def due(self, limit: float) -> None:
        """A model version whose execution_timeout_s is `limit` was dropped. The collection
        walks every model's objects, not its alone: given COLLECT_MIN_S at least (one after
        dropping a model of 0.05 s killed a worker whose heap took longer: late review 58d)."""
        self.pending, self.limit = True, max(self.limit, limit, COLLECT_MIN_S)

    def run(self, now: float, timed: Callable[[float, Callable[[], None]], None]) -> float | None:
        """Collect, as `timed(limit, work)` runs it, if one is pending and its time has
        come; else the seconds until it may (None: none pending)."""
        if not self.pending:
            return None
        if now < self._at:
            return self._at - now
        start = time.perf_counter()
        timed(self.limit, self._collect)
        self.pending, self.limit = False, 0.0
        self._at = now + min((time.perf_counter() - start) / COLLECT_SHARE, COLLECT_GAP_MAX_S)
        return None

    def _collect(self) -> None:
        gc.unfreeze()  # the unloaded models' objects are among the frozen
        settle_heap()
        if self._cuda:
            torch.cuda.empty_cache()


Item = tuple[int, wire.Header, list[Any]]  # (the frontend's index, header, frames)


Riders = list[tuple[int, wire.Header]]  # LOADs answered with the one they came after


def _same(first: wire.Header, then: wire.Header) -> bool:
    return (first.files, first.folder, first.held) == (then.files, then.folder, then.held)


def _less(counts: dict[str, int], key: str) -> None:
    if (left := counts.get(key, 0) - 1) > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def addressed(frontend: int, ends: int) -> bytes:
    """The first frame of a message to the I/O thread: the frontend it goes to, and how
    many units of work it ends (a batch, a load, the sequences a STEP ends)."""
    return bytes([frontend]) + ends.to_bytes(4, "little")


class Loader:
    """The loader thread: LOAD and UNLOAD in, in order. A LOAD is loaded, handed to
    `install` (which must be safe beside the compute thread) and answered LOADED to
    the I/O thread over its own socket, without waiting for the batch at hand; an
    UNLOAD goes on to the compute thread's queue, after the loads asked before it."""

    def __init__(
        self, compute: queue.SimpleQueue[Any], install: Callable[[Loaded], None], held: Held,
        repository: Path, device: torch.device, allowed: tuple[str, ...],
    ) -> None:  # fmt: skip
        self._compute, self._install, self._held = compute, install, held
        self._asked: queue.SimpleQueue[tuple[Item, Riders] | None] = queue.SimpleQueue()
        self._repository, self._device, self._allowed = repository, device, allowed
        # What is installed, as of the last message handed on: key -> its folder and files
        self._have: dict[str, tuple[Path, Files]] = {}
        self._digests: dict[str, tuple[str, str]] = {}  # ... their digest, and the folder's
        # identity then (at_once: no stat on the I/O thread, whose beats a hung mount stops)
        self._queued: dict[str, int] = {}  # key -> LOADs and UNLOADs asked, not yet done
        self._open: dict[str, tuple[wire.Header, Riders]] = {}  # key -> its last LOAD, if
        # not answered yet (nor an UNLOAD asked since), and the same LOADs that ride on it
        self._lock = threading.Lock()  # (_queued, _open: put on the I/O thread, done here)
        self._thread = own_thread(self._run, "loader")
        self._threads, self._to = 1, ""
        self._ctx: zmq.Context[Any] | None = None

    def start(self, ctx: zmq.Context[Any], to: str) -> None:
        """Run; answer LOADED on a PUSH socket to the I/O thread's `to`."""
        self._threads = torch.get_num_threads()  # --threads, as the main thread has it
        self._ctx, self._to = ctx, to
        self._thread.start()

    def put(self, item: Item) -> None:
        """Queue a LOAD or UNLOAD; a LOAD the same as one not answered yet, that no UNLOAD
        came between, is answered with it. Queued, another frontend's LOAD of a model that
        one was loading waited behind the loads asked between them (review 54j)."""
        frontend, header, _ = item
        key, riders = model_key(header.model, header.version), Riders()
        with self._lock:
            self._queued[key] = self._queued.get(key, 0) + 1
            if header.kind != wire.Header.LOAD:
                self._open.pop(key, None)
            elif (first := self._open.get(key)) is not None and _same(first[0], header):
                return first[1].append((frontend, header))
            else:
                self._open[key] = header, riders
        self._asked.put((item, riders))

    def at_once(self, header: wire.Header, stopping: bool) -> list[Any] | None:
        """LOADED, for the I/O thread to answer at once, where `header` is a LOAD of a
        version installed here from the same files that no LOAD or UNLOAD asked before it
        touches (None: it goes to this thread, in its turn). Queued, another frontend's
        LOAD of a model already here waited behind the loads asked before it, and so did
        its calls (review 54j: a 12 s load, 0 of 5 calls with a 5 s deadline answered)."""
        if header.kind != wire.Header.LOAD or stopping:
            return None
        key = model_key(header.model, header.version)
        with self._lock:
            if self._queued.get(key) or key not in self._have:
                return None
            had = self._digests.get(key)
        if not (header.held or (bool(header.files) and (header.files, header.folder) == had)):
            return None
        return wire.pack(wire.Header(kind=wire.Header.LOADED, model=header.model,
                                     version=header.version))  # fmt: skip

    def stop(self, timeout: float) -> bool:
        """No more loads: the compute thread's queue ends after what the loader handed
        on. False if a load is still under way after `timeout` (a hung load())."""
        self._asked.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _done(self, key: str) -> None:
        with self._lock:
            _less(self._queued, key)

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # OpenMP keeps its count per thread (runner.py)
        assert self._ctx is not None
        out = self._ctx.socket(zmq.PUSH)
        out.connect(self._to)
        try:
            while (asked := self._asked.get()) is not None:
                (frontend, header, _), riders = asked
                key = model_key(header.model, header.version)
                if header.kind != wire.Header.LOAD:
                    self._have.pop(key, None)
                    self._digests.pop(key, None)  # (read only beside _have: kept, it lingered)
                    # (with the copy it drops: the one installed now)
                    self._compute.put((frontend, header, [self._held.take(key)]))
                    self._done(key)
                    continue
                loaded = load(header, self._repository, self._device, self._allowed, self._have,
                              key in self._held.loops)  # fmt: skip
                if loaded.model is not None and loaded.files is not None:
                    self._install(loaded)
                    self._have[key] = loaded.files
                    self._digests[key] = digest(loaded.files[1]), identity(self._repository)
                with self._lock:
                    if self._open.get(key, (None, None))[1] is riders:
                        del self._open[key]  # (no more ride on it)
                error = loaded.error
                del loaded  # (kept, the model outlived its unload until the next load)
                reply = wire.Header(kind=wire.Header.LOADED, model=header.model,
                                    version=header.version, error=wire.text(error),
                                    held=header.held and bool(error))  # fmt: skip
                for to in (frontend, *(f for f, _ in riders)):
                    self._done(key)
                    out.send_multipart([addressed(to, 1), *wire.pack(reply)])
        finally:
            out.close(linger=0)
            self._compute.put(None)
