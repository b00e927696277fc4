"""A model repository: `DIR/<model>/model.toml` beside its artifact, one model per
subdirectory (model_config.py parses one).

Nothing is read from outside the repository: a model directory, model.toml or
artifact that resolves elsewhere (a symlink out, `..`) is refused, and a model
name received over the network maps onto a directory only inside it
(`model_directory`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from batchd.protos._toml_reader import read_bounded
from batchd.protos.model_config import (
    ARTIFACTS,
    MODEL_NAME,
    ConfigError,
    ModelConfig,
    load_model_config,
)

__all__ = [
    "NO_MODELS",
    "DuplicateName",
    "Files",
    "RepositoryUnreadable",
    "changed_since",
    "check_root",
    "confined",
    "digest",
    "files_of",
    "find_model",
    "find_with_files",
    "identity",
    "load_each",
    "load_repository",
    "model_directory",
    "strays",
]


def confined(root: Path, path: Path) -> Path:
    """`path`, resolved, if it lies inside the repository `root`; else ConfigError."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:  # (3.11: a symlink loop is a RuntimeError)
        raise ConfigError(f"{path}: cannot be resolved: {e}") from None
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


class RepositoryUnreadable(ConfigError):
    """The repository's folder cannot be listed (gone, or no permission)."""


def _with_toml(root: Path) -> list[Path]:
    """The subdirectories of `root` holding a model.toml, in order."""
    try:
        return sorted(p for p in root.iterdir() if (p / "model.toml").is_file())
    except OSError as e:
        raise RepositoryUnreadable(
            f"{root}: the model repository cannot be read ({e.strerror or e})"
        ) from None


def find_model(root: Path, name: str, unique: bool = False) -> ModelConfig:
    """Model `name` of repository `root`: `root/<name>/model.toml`, or the one
    subdirectory whose model.toml declares that name. Raise ConfigError if none, or,
    `unique`, if two folders declare it (as start-up and the index refuse: a load took
    the first, and a folder added beside the one serving swapped the model served)."""
    model_directory(root, name)  # refuses names that would leave the repository
    if (root / name / "model.toml").is_file():
        cfg = _load_confined(root, root / name)
        if cfg.name == name and not unique:
            return cfg
    found: list[ModelConfig] = []
    for sub in _with_toml(root):
        try:
            if sub.name != name and not _may_declare(sub / "model.toml", name):
                continue
            cfg = _load_confined(root, sub)
        except (ConfigError, OSError):
            continue  # a broken neighbour does not stop this model from loading
        if cfg.name == name:
            found.append(cfg)
    if len(found) > 1:
        raise DuplicateName(root, name, [c.directory for c in found])
    if found:
        return found[0]
    raise ConfigError(f"{root}: no model named {name!r} in the repository")


def _may_declare(toml: Path, name: str) -> bool:
    """Whether a model.toml may declare `name`: its text spells it, or a name key's line
    escapes something (a backslash anywhere, in a comment say, had every file parsed:
    1.2 s a load among 3,000 models)."""
    text = read_bounded(toml)  # (a FIFO swapped in, a disk image: ConfigError, skipped)
    return name.encode() in text or _ESCAPED_NAME.search(text) is not None


_ESCAPED_NAME = re.compile(rb"""(?m)^[ \t]*["']?name["']?[ \t]*=[^\n]*\\""")


class DuplicateName(ConfigError):
    """A model name several folders declare: refused in each, as a load of it is."""

    def __init__(self, where: Path, name: str, folders: list[Path]) -> None:
        listed = [f"{f.name}/" for f in folders[:4]] + [f"{len(folders) - 4} more"] * (
            len(folders) > 4
        )
        said = ", ".join(listed[:-1]) + f" and {listed[-1]}"
        self.name, self.why = name, f"model name {name!r} is declared by {said}; rename one"
        super().__init__(f"{where}: {self.why}")


def load_each(root: Path) -> list[tuple[Path, ModelConfig | ConfigError]]:
    """Every model directory of repository `root`, with its config or why it is
    refused: what load_repository refuses, a name used twice included, but model by
    model, so that a report (`batchd models DIR --check`) goes on past the first. A
    name several folders declare is refused in each (DuplicateName, naming them all), as
    a load of it is (find_model): the first was listed as loadable, and the
    RepositoryIndex named the second alone."""
    found: list[tuple[Path, ModelConfig | ConfigError]] = []
    folders: dict[str, list[Path]] = {}  # a name -> the folders that declare it
    for sub in _with_toml(root):
        try:
            cfg = _load_confined(root, sub)
        except ConfigError as e:
            found.append((sub, e))
            continue
        folders.setdefault(cfg.name, []).append(sub)
        found.append((sub, cfg))
    return [
        (sub, DuplicateName(sub / "model.toml", cfg.name, folders[cfg.name]))
        if isinstance(cfg, ModelConfig) and len(folders[cfg.name]) > 1
        else (sub, cfg)
        for sub, cfg in found
    ]


NO_MODELS = (
    "the model repository holds no model: each model is a folder of it holding model.toml "
    f"beside one of {', '.join(ARTIFACTS)}"
)


def check_root(root: Path) -> None:
    """ConfigError unless `root` can be a repository: a directory, not a model's own."""
    if not root.is_dir():
        raise ConfigError(f"{root}: model repository is not a directory")
    if (root / "model.toml").is_file():
        raise ConfigError(f"{root} holds a model.toml: it is one model's folder; a model "
                          f"repository is the folder above it ({root.parent})")  # fmt: skip


def strays(root: Path) -> list[str]:
    """What looks like a model but is not one, and is passed over: a subdirectory
    holding a model artifact (model.py, model.pt, model.pt2) but no model.toml, or a
    model.toml that is no file (a folder, a FIFO, a link that leads nowhere)."""
    found = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        toml = sub / "model.toml"
        if toml.is_symlink() or toml.exists():
            if not toml.is_file():  # (the model vanished without a word)
                found.append(f"{toml}: not a file, or a link to none: not a model, passed over")
        elif artifact := next((a for a in ARTIFACTS if (sub / a).exists()), ""):
            found.append(f"{sub}: {artifact} but no model.toml beside it: not a model, passed over")
    return found


def load_repository(
    root: Path, broken: Callable[[Path, ConfigError], None] | None = None
) -> dict[str, ModelConfig]:
    """Every model of a repository: each subdirectory holding a model.toml. The first
    that is broken is raised, or, with `broken`, each is passed to it (its folder and
    why) and left out."""
    check_root(root)
    models: dict[str, ModelConfig] = {}
    for folder, cfg in load_each(root):
        if isinstance(cfg, ConfigError):
            if broken is None:
                raise cfg
            broken(folder, cfg)
        else:
            models[cfg.name] = cfg
    return models


Files = frozenset[tuple[str, int, int]]  # a model's files: path, size, mtime (files_of)


def files_of(directory: Path) -> Files:
    """What a model version is loaded from: each file under its directory, by path,
    size and modification time; not __pycache__, hidden files or *.log, which loading
    and serving may write there themselves. Hidden folders and __pycache__ are not
    walked at all (a .git or a virtual environment beside the model was walked whole,
    163,000 entries, then left out)."""
    found = set()
    for top, folders, names in os.walk(directory):  # (links to folders: not followed)
        folders[:] = [f for f in folders if not f.startswith(".") and f != "__pycache__"]
        for name in names:
            if name.startswith(".") or name.endswith(".log"):
                continue
            path = Path(top, name)
            with contextlib.suppress(OSError):  # gone meanwhile
                st = path.stat()
                if stat.S_ISREG(st.st_mode):
                    found.add((str(path.relative_to(directory)), st.st_size, st.st_mtime_ns))
    return frozenset(found)


def digest(files: Files) -> str:
    """A short name for a snapshot of files_of: what a LOAD asks a worker to read (the
    files its version was numbered for), so the worker, which reads them, checks."""
    h = hashlib.sha256()
    for path, size, mtime in sorted(files):
        h.update(f"{path}\0{size}\0{mtime}\n".encode(errors="surrogateescape"))
    return h.hexdigest()[:32]


def changed_since(name: str, version: str, then: Files, now: Files | None,
                  when: str = "since version {} was loaded") -> str:  # fmt: skip
    """Why version `version` of model `name` is not loaded from the files as they are
    `now` (None: not known; `then`: those it was numbered for), or "" if they are those.
    `when` they changed, the version's number in its braces."""
    if now == then:
        return ""
    names = sorted({f for f, *_ in then ^ now}) if now is not None else []
    shown = [n.encode(errors="surrogateescape").decode(errors="backslashreplace")
             for n in names[:3]]  # (a name that is not UTF-8: escaped)  # fmt: skip
    which = f" ({', '.join(shown)}{', ...' if len(names) > 3 else ''})" if names else ""
    return (
        f"the files of model {name!r} changed {when.format(version)}{which}: not loaded as "
        f"version {version}; a load serves them as a new version (--model-control none: a "
        "restart); what a model writes there itself must be hidden or *.log"
    )


def identity(root: Path) -> str:
    """Which folder `root` is now, on which machine (its kernel's boot: containers on one
    host share it, whatever their host names): a worker that reads the folder a LOAD's
    files were read in is held to them (their modification times); one that reads a
    copy elsewhere (cp -r, git clone, an image: other times, the same weights) is not.
    Taken when the files are read: a symlink flipped to a new release is another."""
    try:
        st = os.stat(root)
    except OSError:
        return ""
    return f"{_boot()}:{st.st_dev}:{st.st_ino}"


@functools.cache
def _boot() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # (not Linux)
        return socket.gethostname()


def find_with_files(root: Path, name: str, unique: bool = False) -> tuple[ModelConfig, Files]:
    """find_model, and its files as they were when its model.toml was read: the config is
    read again after the snapshot, so a model.toml rewritten between the two is the
    snapshot's (a rewrite read first, then snapshotted as it was, passed as unchanged)."""
    files = files_of(directory := find_model(root, name, unique).directory.resolve())  # (link: now)
    if (cfg := find_model(root, name)).directory.resolve() != directory:  # (moved, relinked)
        raise ConfigError(f"{cfg.directory}: model {name!r} moved here from {directory} as "
                          "it was read; load it again")  # fmt: skip
    return cfg, files
