"""RepositoryIndex: every model of the repository, loaded or not, and what serves it.

Pure: model control reads the repository (off the loop) and passes what it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from batchd.protos import wire
from batchd.protos.model_config import ConfigError, ModelConfig
from batchd.protos.repository import DuplicateName


@dataclass(frozen=True, slots=True)
class IndexEntry:
    name: str
    version: str
    state: str  # "READY", "UNAVAILABLE", "LOADING"
    reason: str


def entries(
    on_disk: list[tuple[Path, ModelConfig | ConfigError]],  # repository.load_each
    loading: Mapping[str, ModelConfig],  # name -> the version loading (a first load, a reload)
    current: Mapping[str, ModelConfig],  # name -> the version serving
    ready: Callable[[str], bool],  # a version's key -> whether a live worker holds it
    broken: Mapping[str, str],  # a version's key -> why no worker could load it
    failed: Mapping[str, str] | None = None,  # a name -> why its last load failed (as Triton)
) -> list[IndexEntry]:
    """One entry per model, sorted by name: a folder's model as not loaded (or why it
    cannot be), overridden by what loads and what serves."""
    found: dict[str, IndexEntry] = {}
    twice: dict[str, str] = {}  # a name several folders declare -> why (DuplicateName)
    for sub, cfg in on_disk:
        name, why = (sub.name, str(cfg)) if isinstance(cfg, ConfigError) else (cfg.name, "")
        if isinstance(cfg, DuplicateName):  # the name's entry, not its folder's (which may
            name, why = cfg.name, cfg.why  # be another model's name), said once
            twice[name] = why
        if (shown := wire.text(name)) != name:  # (a lone surrogate: protobuf would raise)
            name, why = shown, "its folder's name is not UTF-8"
        said = wire.text(why)  # (of one name, a folder broken and the name declared twice:
        if (prior := found.get(name)) and prior.reason not in ("not loaded", said):  # both)
            said = f"{prior.reason}; {said}" if said else prior.reason
        last = (failed or {}).get(name)  # (it said "not loaded" alone: review 57b)
        reason = said or (f"not loaded: {last}" if last else "not loaded")
        found[name] = IndexEntry(name, "", "UNAVAILABLE", reason)
    for name, cfg in loading.items():  # (a reload: its serving version, below)
        found[name] = IndexEntry(name, cfg.version, "LOADING", "")
    for name, cfg in current.items():
        up = ready(cfg.key)
        reason = "" if up else broken.get(cfg.key, "no live worker serves it")
        if name in loading:
            reason = f"version {loading[name].version} loading; {reason or 'serving'}"
        reason = reason or twice.get(name, "")  # (served, but no longer loadable)
        found[name] = IndexEntry(name, cfg.version, "READY" if up else "UNAVAILABLE", reason)
    return sorted(found.values(), key=lambda e: e.name)
