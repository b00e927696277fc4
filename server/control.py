"""Model control: which version of each model serves, loading, swapping, unloading.

Every load gives a model its next version ("1", "2", ...), keyed "name@version".
A load asks every worker that may run the model to load the new version and waits
for all of them; only then does the swap happen, in one step: new requests go to
the new version's queue while the old version's queue and in-flight batches drain
on the copies the workers still hold, which drop it once nothing of it is queued or
running. A failed load changes nothing: the old version keeps serving. Workers that
register later are told to load the current versions. The load protocol lives here
too: LOAD to a worker, its LOADED (or why it could not), UNLOAD once drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from batchd.protos import repository as repo
from batchd.protos import wire
from batchd.protos.model_config import MODEL_NAME, ConfigError, ModelConfig, model_key
from batchd.server import index
from batchd.server.batching.scheduler import Scheduler
from batchd.server.errors import InvalidInput, ModelFailed, NotAllowed, Unavailable, clip
from batchd.server.link import WorkerLink
from batchd.server.pool import WorkerHandle, WorkerPool

log = logging.getLogger("batchd.control")
T = TypeVar("T")
Loading = asyncio.Future[str]  # a worker's load of a version: "" once loaded, else why not
Read = tuple[repo.Files, str, str]  # a version's files as read: files_of, their digest, its
UNREAD: Read = (frozenset(), "", "")  # folder's identity (repository.identity) then
DRAIN_POLL_S = 0.02  # how often a retiring version is checked for emptiness


def _check_name(verb: str, name: str) -> None:
    if not MODEL_NAME.fullmatch(name):  # before any message quotes it whole
        raise InvalidInput(f"cannot {verb} model {clip(name)}: not a model name (1 to 128 letters, "
                           "digits, '_', '-' or '.', not starting with '.' or '-')")  # fmt: skip


class ModelControl:
    def __init__(
        self, repository: Path, pool: WorkerPool, link: WorkerLink, scheduler: Scheduler,
        explicit: bool, clock: Callable[[], float],
        changed: Callable[[], None],  # readiness may have changed
        pump_soon: Callable[[], None],  # capacity changed: decide again, once, soon
        answering: Callable[[str, str], int] = lambda name, version: 0,  # (Stats.answering)
    ) -> None:  # fmt: skip
        self.repository = repository
        self.explicit = explicit  # False: the repository's models load at start, and stay
        self.current: dict[str, ModelConfig] = {}  # what new requests go to, by name
        self._pool, self._link, self._scheduler, self._answering = pool, link, scheduler, answering
        self._clock, self._changed, self._pump_soon = clock, changed, pump_soon
        self.broken: dict[str, str] = {}  # key -> why no worker could load that version
        self.failed: dict[str, str] = {}  # name -> why its last load failed, if it did
        self._awaited: set[str] = set()  # keys whose holder was lost, no load tried since
        self._loading: dict[str, ModelConfig] = {}
        self._versions: dict[str, int] = {}
        self._files: dict[str, Read] = {}  # key -> as its files were read
        # One load or unload at a time per model; another model's (a hung load(), a
        # long drain) holds up none: name -> its lock, and how many hold or await it.
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # retirements, loads and unloads under way
        self._next_load: dict[str, asyncio.Task[ModelConfig]] = {}  # name -> one not begun
        self._retiring: dict[str, set[asyncio.Task[None]]] = {}  # name -> its versions draining
        self.closed = False  # shutting down: loads and unloads are refused

    def start_with(self, configs: dict[str, ModelConfig],
                   files: Mapping[str, repo.Files] | None = None) -> None:  # fmt: skip
        """The models serving from the start (before any worker registered), with their
        files as the repository was read (frontends.at_start), else as they are."""
        here = repo.identity(self.repository)
        for cfg in configs.values():
            then = (files or {}).get(cfg.name) or repo.files_of(cfg.directory)
            self._install(self._next_version(cfg, (then, repo.digest(then), here)))

    def _next_version(self, cfg: ModelConfig, read: Read) -> ModelConfig:
        version = self._versions.get(cfg.name, 0) + 1
        self._versions[cfg.name] = version
        cfg = dataclasses.replace(cfg, version=str(version))
        self._files[cfg.key] = read
        return cfg

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, name: str) -> Any:
        lock, users = self._locks.setdefault(name, (asyncio.Lock(), [0]))
        if lock.locked():
            log.info("model %s: waits for the load or unload under way", name)
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[name]

    def _look(self, versions: list[ModelConfig]) -> tuple[list[str], str]:
        """Why a worker starting now must not load each version (its files are no longer
        those it was loaded from: it would serve other weights under its number), or "";
        and the folder they are read in now (a symlink may have been flipped since)."""
        whys = [repo.changed_since(c.name, c.version, self._files.get(c.key, UNREAD)[0],
                                   repo.files_of(c.directory)) for c in versions]  # fmt: skip
        return whys, repo.identity(self.repository)

    def _install(self, cfg: ModelConfig) -> None:
        self._scheduler.add_model(cfg)
        self.current[cfg.name] = cfg
        self.failed.pop(cfg.name, None)

    def ready(self, name: str) -> bool:
        return (cfg := self.current.get(name)) is not None and self._pool.model_ready(cfg.key)

    def load_error(self, name: str) -> str | None:  # why not served: no worker could load it
        return None if (cfg := self.current.get(name)) is None else self.broken.get(cfg.key)

    def _judge(self, key: str) -> None:
        """Whether version `key` is broken: no worker has it, none is loading it, some
        said why it could not (its queued requests then fail at once)."""
        workers = self._pool.workers()
        errors = [f"{w.name}: {w.load_errors[key]}" for w in workers if key in w.load_errors]
        loading = any(key in w.loads and not w.loads[key].done() for w in workers)
        if errors and not loading and not self._pool.model_ready(key) and key not in self._awaited:
            name = key.rpartition("@")[0]
            self.broken[key] = f"model {name!r} could not be loaded: {'; '.join(errors)}"
            if self._scheduler.has(key):
                self._scheduler.fail_queued(key, Unavailable(self.broken[key]))
        else:
            self.broken.pop(key, None)

    # ---- the load protocol ----

    def worker_ready(self, worker: WorkerHandle) -> None:
        """A worker registered: it loads, in order, every current (and loading) version it
        may run whose files are as loaded (explicit control: it drops any other it holds)."""
        joins, known = [], [*self.current.values(), *self._loading.values()]
        for key in set(worker.info.held if self.explicit else ()) - {c.key for c in known}:
            name, _, version = key.rpartition("@")  # retired while it was away: held for good
            if name in self._versions:  # (one this frontend loaded: not another server's)
                self._send_unload(worker, name, version)
        for cfg in known:
            if worker.accepts(cfg.name) and cfg.key not in worker.models:
                if hung := self._pool.hung_for(worker, cfg.key):  # it would hang again: the
                    worker.load_errors[cfg.key] = hung  # word awaited of a worker back (58c)
                    self._awaited.discard(cfg.key)
                    log.warning("worker %s: model %s version %s %s", worker.name, cfg.name,
                                cfg.version, hung, extra={"model": cfg.name})  # fmt: skip
                elif cfg.key not in worker.loads:
                    joins.append((cfg, self._load_on(worker, cfg, send=False)))
                self._judge(cfg.key)  # loading again: not broken while it tries
        if joins:
            self._keep(asyncio.create_task(self._join(worker, joins)))
        self._log_if_ready(worker)

    async def _join(self, worker: WorkerHandle, joins: list[tuple[ModelConfig, Loading]]) -> None:
        """A worker that registered late (a restart) loads a version only if its files
        are still those it was loaded from (read off the loop: a folder may hold
        thousands), else it may keep only a copy it holds. (It loads its models one by
        one, so they may change before it reads them: it checks, wire.Header.files.)"""
        whys, here = await asyncio.to_thread(self._look, [cfg for cfg, _ in joins])
        for (cfg, fut), why in zip(joins, whys, strict=True):
            if not fut.done():  # (done: the worker was lost, or cfg unloaded; changed: only a
                self._send_load(worker, cfg, held=bool(why), folder=here)  # copy it holds)
        for (cfg, fut), why in zip(joins, whys, strict=True):
            if not why or not await fut or cfg.key in worker.models:
                continue  # a plain load (on_loaded), or it held that version: kept
            if worker.load_errors.get(cfg.key) != wire.NOT_HELD:
                continue  # lost, or unloaded meanwhile (it said why)
            worker.loads.pop(cfg.key, None)
            worker.load_errors[cfg.key] = why
            log.warning("worker %s: %s", worker.name, why, extra={"model": cfg.name})
            self._judge(cfg.key)
            self._log_if_ready(worker)
            self._changed()

    def _load_on(self, worker: WorkerHandle, model: ModelConfig, send: bool = True) -> Loading:
        """Ask `worker` to load `model` (`send` False: the caller will): "" once loaded, or why."""
        fut = worker.loads.get(model.key)
        if fut is None:
            fut = worker.loads[model.key] = asyncio.get_running_loop().create_future()
            if send:
                self._send_load(worker, model)
        return fut

    def _send_load(self, worker: WorkerHandle, model: ModelConfig, held: bool = False,
                   folder: str = "") -> None:  # fmt: skip
        """LOAD (`held`: only a copy it holds), naming the files and where they were read."""
        _, files, read_in = self._files.get(model.key, UNREAD)  # (`folder`: read just now)
        header = wire.Header(kind=wire.Header.LOAD, model=model.name, version=model.version,
                             held=held, files="" if held else files,
                             folder=folder or read_in)  # fmt: skip
        self._link.send(worker.identity, wire.pack(header))  # a failed send: lost soon
        worker.load_sent[model.key] = self._clock()  # (--load-timeout: pool.overdue)

    def on_loaded(self, worker: WorkerHandle, header: wire.Header) -> None:
        key = model_key(header.model, header.version)
        self._awaited.discard(key)  # a load tried since: it says
        fut = worker.loads.get(key)
        if key == next(iter(worker.load_sent), None):  # the worker loads one model at a time:
            worker.load_sent = dict.fromkeys(list(worker.load_sent)[1:], self._clock())  # it
        worker.load_sent.pop(key, None)  # starts the next (not after one out of turn: at once)
        if fut is None or fut.done():  # (its load called off: settled now, maybe, lanes.py)
            return self._pump_soon()
        if header.error:
            del worker.loads[key]
            worker.load_errors[key] = header.error
            if not header.held:  # (else _join says why it was not asked to load it)
                log.error("worker %s could not load model %s version %s: %s", worker.name,
                          header.model, header.version, header.error,
                          extra={"worker": worker.name, "model": header.model})  # fmt: skip
        else:
            self._pool.loaded(worker, key)  # (a version its workers died loading: no more)
            worker.load_errors.pop(key, None)
        fut.set_result(header.error)
        self._judge(key)
        self._log_if_ready(worker)
        self._changed()
        self._pump_soon()

    def worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        # Wait for one back, not broken by another's old word, unless it is back (heard of
        # late, after 3 missed beats, by --frontends N's others): its replacement's is new.
        if all(w.slot != worker.slot for w in self._pool.workers()):
            self._awaited |= worker.models
        for fut in worker.loads.values():
            if not fut.done():
                fut.set_result(f"worker {worker.name} was lost while loading: {reason}")
        for key in {*worker.loads, *worker.load_errors}:
            self._judge(key)

    def _unload_everywhere(self, model: ModelConfig) -> None:
        """Every worker drops `model` (a version nothing is queued for or running)."""
        for w in self._pool.workers():
            fut = w.loads.pop(model.key, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(f"model {model.name!r} version {model.version} was unloaded")
                w.models.discard(model.key)
                self._send_unload(w, model.name, model.version)
        self._changed()

    def _send_unload(self, worker: WorkerHandle, name: str, version: str) -> None:
        unload = wire.Header(kind=wire.Header.UNLOAD, model=name, version=version)
        self._link.send(worker.identity, wire.pack(unload))

    def _log_if_ready(self, worker: WorkerHandle) -> None:
        if all(f.done() for f in worker.loads.values()):
            models = ", ".join(sorted(worker.models)) or "none"
            log.info("worker %s ready (pid %d, device %s) with models %s", worker.name,
                     worker.info.pid, worker.info.device, models,
                     extra={"worker": worker.name, "device": worker.info.device})  # fmt: skip

    def _allowed(self) -> None:
        if not self.explicit:
            raise NotAllowed("model control is disabled: start batchd with --model-control "
                             "explicit to load and unload models at run time")  # fmt: skip
        if self.closed:  # (its workers stop soon: a load would be lost, an unload moot)
            raise Unavailable("the server is shutting down: it loads and unloads no models")

    async def load(self, name: str) -> ModelConfig:
        """Load `name` from the repository (again); swap it in once every worker has it. A
        load not yet begun reads the files when it begins, so it serves those after it (a
        caller retrying on a short deadline queued one for each try, each run to its end)."""
        self._allowed()
        _check_name("load", name)
        if (task := self._next_load.get(name)) is None or task.done():
            task = self._next_load[name] = self._keep(asyncio.create_task(self._load(name)))
        return await asyncio.shield(task)

    async def _load(self, name: str) -> ModelConfig:
        async with self._one_at_a_time(name):  # (read in it: the files as they are now)
            if self._next_load.get(name) is asyncio.current_task():
                del self._next_load[name]  # begun: a later load reads the files after it
            try:  # (off the loop: a name no folder has is looked for in every model.toml)
                found, read = await asyncio.to_thread(self._read, name)
            except ConfigError as e:  # (a repository moved away by a deploy: not the caller's)
                fault = Unavailable if isinstance(e, repo.RepositoryUnreadable) else InvalidInput
                raise fault(f"cannot load model {name!r}: {e}") from None
            workers = [w for w in self._pool.workers() if w.accepts(name)]
            if not workers:
                raise Unavailable(f"no live worker may load model {name!r}; try again later")
            cfg = self._next_version(found, read)
            self._loading[name] = cfg
            try:
                errors = await asyncio.gather(*(self._load_on(w, cfg) for w in workers))
            finally:
                del self._loading[name]
            failed = [f"{w.name}: {e}" for w, e in zip(workers, errors, strict=True) if e]
            old = self.current.get(name)
            if failed:
                self._unload_everywhere(cfg)
                self.broken.pop(cfg.key, None)
                self._files.pop(cfg.key, None)  # (kept, each failed load held its file list)
                for w in workers:
                    w.load_errors.pop(cfg.key, None)  # that version is gone
                before = self._what_stays(old)
                why = f"model {name!r} failed to load; {before}: " + "; ".join(failed)
                self.failed[name] = why  # (the index says it till a load passes: review 57b)
                raise ModelFailed(why)
            self._install(cfg)
            short = cfg.instances.count * len({w.info.device for w in workers}) > len(workers)
            note = "; [instances] count takes effect at start-up: restart for more" if short else ""
            log.log(logging.WARNING if short else logging.INFO,
                    "model %s version %s loaded on %d worker(s)%s%s", name, cfg.version,
                    len(workers), f"; version {old.version} drains" if old else "", note,
                    extra={"model": name})  # fmt: skip
            self._changed()
            if old is not None:
                self._retire_soon(old)
            return cfg

    def _read(self, name: str) -> tuple[ModelConfig, Read]:
        found, files = repo.find_with_files(self.repository, name, unique=True)
        return found, (files, repo.digest(files), repo.identity(self.repository))

    def _what_stays(self, old: ModelConfig | None) -> str:
        """After a failed load: what serves the model now."""
        if old is None:
            return "no version of it serves"
        if self._pool.model_ready(old.key):
            return f"version {old.version} serving before stays"
        why = self.broken.get(old.key) or "no live worker holds it"
        return f"version {old.version} stays, and it does not serve either ({why})"

    async def unload(self, name: str) -> None:
        """Stop admitting requests for `name`; return once its admitted requests are answered."""
        self._allowed()
        _check_name("unload", name)  # (a name no model has: a typo, or worse, is no OK)
        self._next_load.pop(name, None)  # a load asked for after this one runs after it
        await self._to_the_end(self._unload(name))

    async def _unload(self, name: str) -> None:
        if name in self.current or name in self._loading or name in self._locks:
            async with self._one_at_a_time(name):  # (a first load under way: after it)
                if (cfg := self.current.pop(name, None)) is not None:
                    log.info("model %s version %s unloading", name, cfg.version,
                             extra={"model": name})  # fmt: skip
                    self._changed()
                    self._retire_soon(cfg)  # its drain holds up no other load or unload
        if draining := set(self._retiring.get(name, ())):  # under way now, not later reloads
            await asyncio.wait(draining)  # (not loaded: nothing to wait for, as Triton does)

    def _retire_soon(self, cfg: ModelConfig) -> None:
        task = self._keep(asyncio.create_task(self._retire(cfg), name=f"retire-{cfg.key}"))
        (draining := self._retiring.setdefault(cfg.name, set())).add(task)  # (names: the
        task.add_done_callback(draining.discard)  # repository's, so these sets stay few)

    async def _to_the_end(self, work: Coroutine[Any, Any, T]) -> T:
        """A load or unload run to its end though its caller left: half done, it left a copy."""
        return await asyncio.shield(self._keep(asyncio.create_task(work)))

    def _keep(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Hold `task` until it ends; a failure nobody awaits any more is not logged."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _retire(self, cfg: ModelConfig) -> None:
        # Answered here, not failed by the removal: a job's chunks in its lane (its next go
        # to the new version), requests admitted, not queued yet (decoding, an HTTP body).
        while self._scheduler.queued_version(cfg.key, jobs=True) or self._pool.inflight(
                cfg.key) or self._answering(cfg.name, cfg.version):  # fmt: skip
            if not self._pool.model_ready(cfg.key) and not self._pool.inflight(cfg.key):
                # Every worker holding this version was lost; new ones load only the current,
                # which takes its requests if it takes the same (a job's lines too).
                now = self.current.get(cfg.name)
                if now is None or not self._scheduler.move_queued(cfg.key, now):
                    self._scheduler.fail_queued(cfg.key, Unavailable(
                        f"model {cfg.name!r} version {cfg.version} was replaced or unloaded "
                        "and no worker holds it any more; retry"))  # fmt: skip
                else:
                    self._pump_soon()
                break
            await asyncio.sleep(DRAIN_POLL_S)
        self._scheduler.remove_model(cfg.key)
        self._files.pop(cfg.key, None)
        self._awaited.discard(cfg.key)
        self._pool.forget_hung(cfg.key)
        self._unload_everywhere(cfg)
        log.info("model %s version %s unloaded", cfg.name, cfg.version, extra={"model": cfg.name})

    async def index(self) -> list[index.IndexEntry]:
        """Every model of the repository, loaded or not, by name (its folder read off the loop)."""
        try:
            on_disk = await asyncio.to_thread(repo.load_each, self.repository)
        except repo.RepositoryUnreadable as e:
            raise Unavailable(str(e)) from None
        ready, broken = self._pool.model_ready, self.broken
        return index.entries(on_disk, self._loading, self.current, ready, broken, self.failed)
