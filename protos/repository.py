"""A model repository: `DIR/<model>/model.toml` beside its artifact, one model per
subdirectory (model_config.py parses one).

Nothing is read from outside the repository: a model directory, model.toml or
artifact that resolves elsewhere (a symlink out, `..`) is refused, and a model
name received over the network maps onto a directory only inside it
(`model_directory`).
"""

from __future__ import annotations

import contextlib
import stat
from pathlib import Path

from batchd.protos.model_config import MODEL_NAME, ConfigError, ModelConfig, load_model_config

__all__ = ["confined", "files_of", "find_model", "load_each", "load_repository", "model_directory"]


def confined(root: Path, path: Path) -> Path:
    """`path`, resolved, if it lies inside the repository `root`; else ConfigError."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise ConfigError(f"{path}: resolves to {real}, outside the model repository {root}")
    return real


def model_directory(root: Path, name: str) -> Path:
    """The directory of model `name` in repository `root`, refusing names that would
    leave it (`..`, `/`, absolute paths) and symlinks out of it."""
    if not MODEL_NAME.fullmatch(name):
        raise ConfigError(f"{name!r} is not a model name (letters, digits, '_', '-', '.')")
    return confined(root, root / name)


def _load_confined(root: Path, sub: Path) -> ModelConfig:
    for path in (sub, sub / "model.toml"):
        confined(root, path)
    cfg = load_model_config(sub)
    confined(root, cfg.artifact)
    return cfg


def find_model(root: Path, name: str) -> ModelConfig:
    """Model `name` of repository `root`: `root/<name>/model.toml`, or the one
    subdirectory whose model.toml declares that name. Raise ConfigError if none."""
    model_directory(root, name)  # refuses names that would leave the repository
    if (root / name / "model.toml").is_file():
        cfg = _load_confined(root, root / name)
        if cfg.name == name:
            return cfg
    for sub in sorted(p for p in root.iterdir() if (p / "model.toml").is_file()):
        try:
            cfg = _load_confined(root, sub)
        except ConfigError:
            continue  # a broken neighbour does not stop this model from loading
        if cfg.name == name:
            return cfg
    raise ConfigError(f"{root}: no model named {name!r} in the repository")


def load_each(root: Path) -> list[tuple[Path, ModelConfig | ConfigError]]:
    """Every model directory of repository `root`, with its config or why it is
    refused: what load_repository refuses, a name used twice included, but model by
    model, so that a report (`batchd models DIR --check`) goes on past the first."""
    found: list[tuple[Path, ModelConfig | ConfigError]] = []
    seen: dict[str, Path] = {}
    for sub in sorted(p for p in root.iterdir() if (p / "model.toml").is_file()):
        try:
            cfg = _load_confined(root, sub)
            if cfg.name in seen:
                raise ConfigError(f"{sub / 'model.toml'}: model name {cfg.name!r} is used "
                                  f"twice (also by {seen[cfg.name].name}/)")  # fmt: skip
        except ConfigError as e:
            found.append((sub, e))
            continue
        seen[cfg.name] = sub
        found.append((sub, cfg))
    return found


def load_repository(root: Path) -> dict[str, ModelConfig]:
    """Every model of a repository: each subdirectory holding a model.toml."""
    if not root.is_dir():
        raise ConfigError(f"{root}: model repository is not a directory")
    models: dict[str, ModelConfig] = {}
    for _, cfg in load_each(root):
        if isinstance(cfg, ConfigError):
            raise cfg
        models[cfg.name] = cfg
    return models


def files_of(directory: Path) -> frozenset[tuple[str, int, int]]:
    """What a model version is loaded from: each file under its directory, by path,
    size and modification time; not __pycache__, hidden files or *.log, which loading
    and serving may write there themselves."""
    found = set()
    for path in directory.rglob("*"):
        rel = path.relative_to(directory)
        if path.suffix == ".log" or any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile
            st = path.stat()
            if stat.S_ISREG(st.st_mode):
                found.add((str(rel), st.st_size, st.st_mtime_ns))
    return frozenset(found)
