"""The model versions a worker holds: tables the loader thread installs into and the
compute thread drops from (an UNLOAD), each replaced whole under a lock, so that a
thread reading one never sees it change (runner.py)."""

from __future__ import annotations

import threading

from batchd.protos.model_config import ModelConfig
from batchd.worker.generate import StepLoop
from batchd.worker.loader import ModelFn
from batchd.worker.loading import Loaded

Entry = tuple[ModelConfig, ModelFn]
Copy = tuple[Entry | None, StepLoop | None, str]  # a version as installed, and its package


class Held:
    def __init__(self) -> None:
        self.models: dict[str, Entry] = {}  # by ModelConfig.key
        self.loops: dict[str, StepLoop] = {}  # the step-wise ones' loops
        self._packages: dict[str, str] = {}  # what each one's model.py was loaded as
        self._taken: dict[str, Entry] = {}  # key -> the copy an UNLOAD handed on drops
        self._lock = threading.Lock()

    def install(self, loaded: Loaded) -> Copy | None:
        """Take in a model the loader loaded (on the loader thread). Returns the copy it
        replaced (its files changed: loaded again), unless an UNLOAD took it: the compute
        thread drops it as an UNLOAD's, its sequences ended, its memory collected."""
        assert loaded.model is not None
        cfg, fn = loaded.model
        key = cfg.key
        with self._lock:
            old = self.models.get(key), self.loops.get(key), self._packages.get(key, "")
            self.models = {**self.models, key: loaded.model}
            loops = {k: v for k, v in self.loops.items() if k != key}
            if cfg.generate is not None:
                loops[key] = StepLoop(cfg, fn)
            self.loops = loops  # (in one step: a reader never finds it without its loop)
            self._packages[key] = loaded.package
            return None if old[0] is None or self._taken.get(key) is old[0] else old

    def take(self, key: str) -> Copy:
        """The copy of `key` installed now: what an UNLOAD the loader hands on drops. By
        key, an UNLOAD the compute thread ran late dropped the copy a LOAD after it had
        installed (review 54k: LOADED said, every batch failed "not loaded")."""
        with self._lock:
            if (entry := self.models.get(key)) is None or self._taken.get(key) is entry:
                return None, None, ""  # (another UNLOAD drops it: once)
            self._taken[key] = entry
            return entry, self.loops.get(key), self._packages.pop(key, "")

    def drop(self, key: str, copy: Copy) -> None:
        """Drop `copy` of `key` (take's), unless another replaced it since (its sequences
        end, its package goes: the caller's)."""
        entry, loop, _ = copy
        with self._lock:
            if loop is not None and self.loops.get(key) is loop:
                self.loops = {k: v for k, v in self.loops.items() if k != key}
            if entry is not None and self.models.get(key) is entry:
                self.models = {k: v for k, v in self.models.items() if k != key}
            if entry is not None and self._taken.get(key) is entry:
                del self._taken[key]


def limit_of(copy: Copy) -> float:
    """How long dropping a copy of a model version may take (its release() and
    finalizers run): its execution_timeout_s (0: none, no model code runs)."""
    entry, loop, _ = copy
    cfg = entry[0] if entry else loop.cfg if loop else None
    return cfg.instances.execution_timeout_s if cfg else 0.0
