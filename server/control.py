"""Model control: which version of each model serves, loading, swapping, unloading.

Every load gives a model its next version ("1", "2", ...), keyed "name@version".
A load asks every worker that may run the model to load the new version and
waits for all of them; only then does the swap happen, in one step: new
requests go to the new version's queue while the old version's queue and
in-flight batches drain on the copies the workers still hold. When nothing of
the old version is queued or running, the workers drop it. A failed load
changes nothing: the old version keeps serving.

Workers that register later are told to load the current versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from batchd.protos.model_config import (
    MODEL_NAME,
    ConfigError,
    ModelConfig,
    find_model,
    load_model_config,
)
from batchd.server.batching.scheduler import Scheduler
from batchd.server.dispatch import Dispatcher
from batchd.server.errors import InvalidInput, ModelFailed, NotAllowed, Unavailable, clip
from batchd.server.workers import Worker

log = logging.getLogger("batchd.control")
DRAIN_POLL_S = 0.02  # how often a retiring version is checked for emptiness


@dataclass(frozen=True, slots=True)
class IndexEntry:
    name: str
    version: str
    state: str  # "READY", "UNAVAILABLE", "LOADING"
    reason: str


class ModelControl:
    def __init__(
        self,
        repository: Path,
        dispatcher: Dispatcher,
        scheduler: Scheduler,
        explicit: bool,
    ) -> None:
        self.repository = repository
        self.explicit = explicit  # False: the repository's models load at start, and stay
        self.current: dict[str, ModelConfig] = {}  # what new requests go to, by name
        self._dispatcher = dispatcher
        self._scheduler = scheduler
        self._loading: dict[str, ModelConfig] = {}
        self._versions: dict[str, int] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._retiring: set[asyncio.Task[None]] = set()

    def start_with(self, configs: dict[str, ModelConfig]) -> None:
        """The models serving from the start (before any worker registered)."""
        for cfg in configs.values():
            self._install(self._next_version(cfg))

    def _next_version(self, cfg: ModelConfig) -> ModelConfig:
        version = self._versions.get(cfg.name, 0) + 1
        self._versions[cfg.name] = version
        return dataclasses.replace(cfg, version=str(version))

    def _install(self, cfg: ModelConfig) -> None:
        self._scheduler.add_model(cfg)
        self.current[cfg.name] = cfg

    def ready(self, name: str) -> bool:
        cfg = self.current.get(name)
        return cfg is not None and self._dispatcher.model_ready(cfg.key)

    def worker_ready(self, worker: Worker) -> None:
        """A worker registered: have it load every current (and loading) version it may run."""
        for cfg in [*self.current.values(), *self._loading.values()]:
            if worker.accepts(cfg.name):
                self._dispatcher.load(worker, cfg)

    # ---- RepositoryModelLoad / RepositoryModelUnload ----

    def _allowed(self) -> None:
        if not self.explicit:
            raise NotAllowed(
                "model control is disabled: start batchd with --model-control explicit "
                "to load and unload models at run time"
            )

    async def load(self, name: str) -> ModelConfig:
        """Load `name` from the repository (again); swap it in once every worker has it."""
        self._allowed()
        if not MODEL_NAME.fullmatch(name):  # before any message quotes it whole
            raise InvalidInput(
                f"cannot load model {clip(name)}: not a model name (1 to 128 letters, "
                "digits, '_', '-' or '.', not starting with '.')"
            )
        async with self._lock:
            try:
                cfg = self._next_version(find_model(self.repository, name))
            except ConfigError as e:
                raise InvalidInput(f"cannot load model {name!r}: {e}") from None
            workers = [w for w in self._dispatcher.workers() if w.accepts(name)]
            if not workers:
                raise Unavailable(f"no live worker may load model {name!r}; try again later")
            self._loading[name] = cfg
            try:
                errors = await asyncio.gather(*(self._dispatcher.load(w, cfg) for w in workers))
            finally:
                del self._loading[name]
            failed = [f"{w.name}: {e}" for w, e in zip(workers, errors, strict=True) if e]
            if failed:
                self._dispatcher.unload(cfg)
                raise ModelFailed(
                    f"model {name!r} failed to load; the version serving before stays: "
                    + "; ".join(failed)
                )
            old = self.current.get(name)
            self._install(cfg)
            log.info(
                "model %s version %s loaded on %d worker(s)%s",
                name,
                cfg.version,
                len(workers),
                f"; version {old.version} drains" if old else "",
                extra={"model": name},
            )
            self._dispatcher.events.workers_changed()
            if old is not None:
                task = asyncio.create_task(self._retire(old), name=f"retire-{old.key}")
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
            return cfg

    async def unload(self, name: str) -> None:
        """Stop admitting requests for `name`; return once its admitted requests are answered."""
        self._allowed()
        async with self._lock:
            cfg = self.current.pop(name, None)
            if cfg is None:
                return  # not loaded: nothing to do (as Triton does)
            log.info("model %s version %s unloading", name, cfg.version, extra={"model": name})
            self._dispatcher.events.workers_changed()
            await self._retire(cfg)

    async def _retire(self, cfg: ModelConfig) -> None:
        while self._scheduler.queued_version(cfg.key) or self._dispatcher.inflight(cfg.key):
            if not self._dispatcher.model_ready(cfg.key) and not self._dispatcher.inflight(cfg.key):
                # Every worker holding this version was lost; new ones load only the current.
                self._scheduler.fail_queued(
                    cfg.key,
                    Unavailable(
                        f"model {cfg.name!r} version {cfg.version} was replaced or unloaded and "
                        "no worker holds it any more; retry"
                    ),
                )
                break
            await asyncio.sleep(DRAIN_POLL_S)
        self._scheduler.remove_model(cfg.key)
        self._dispatcher.unload(cfg)
        log.info("model %s version %s unloaded", cfg.name, cfg.version, extra={"model": cfg.name})

    # ---- RepositoryIndex ----

    def index(self) -> list[IndexEntry]:
        """Every model of the repository, loaded or not, sorted by name."""
        entries: dict[str, IndexEntry] = {}
        for sub in sorted(p for p in self.repository.iterdir() if (p / "model.toml").is_file()):
            try:
                name = load_model_config(sub).name
            except ConfigError as e:
                entries[sub.name] = IndexEntry(sub.name, "", "UNAVAILABLE", str(e))
                continue
            entries[name] = IndexEntry(name, "", "UNAVAILABLE", "not loaded")
        for name, cfg in self._loading.items():
            entries[name] = IndexEntry(name, cfg.version, "LOADING", "")
        for name, cfg in self.current.items():
            if name in self._loading:
                continue
            ready = self._dispatcher.model_ready(cfg.key)
            entries[name] = IndexEntry(
                name,
                cfg.version,
                "READY" if ready else "UNAVAILABLE",
                "" if ready else "no live worker serves it",
            )
        return sorted(entries.values(), key=lambda e: e.name)
