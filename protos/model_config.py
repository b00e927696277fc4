"""The model repository format: `DIR/<model>/model.toml` beside its artifact.

    [model]                      # optional table; or these keys at top level
    max_batch_size = 32          # rows per batch; 0 = the model does not batch
    [[input]]   name, datatype ("FP32", ...), shape (no batch dim, -1 = variable)
    [[output]]  name, datatype, shape
    [batching]  max_queue_delay_us, max_queue_size, default_timeout_us
    [instances] count (copies per device), execution_timeout_s

The artifact is exactly one of model.py (defines `load(device)`), model.pt
(TorchScript) or model.pt2 (torch.export). Parsed once at start-up into frozen
dataclasses; every error names the file and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchd.protos.datatypes import DATATYPE_NAMES, DATATYPES

ARTIFACTS = {"model.py": "python", "model.pt": "pytorch_libtorch", "model.pt2": "torch_export"}


class ConfigError(ValueError):
    """A model.toml (or repository) is invalid; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch dim; -1 = variable

    def accepts(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_queue_delay_us: int = 1000
    max_queue_size: int = 1024  # requests waiting, per model
    default_timeout_us: int = 0  # 0 = only the caller's deadline


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    count: int = 1  # copies of the model per device, each in its own worker process
    execution_timeout_s: float = 60.0


_BATCHING, _INSTANCES = BatchingConfig(), InstanceConfig()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    directory: Path
    artifact: Path
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    instances: InstanceConfig = field(default_factory=InstanceConfig)
    version: str = "1"

    @property
    def batches(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


class _Reader:
    """Reads one TOML table, remembering where it is for error messages."""

    def __init__(self, path: Path, table: dict[str, Any], where: str) -> None:
        self.path, self.table, self.where = path, dict(table), where

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.where}key '{key}': {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        if key not in self.table:
            if default is None:
                raise self.fail(key, "is required")
            return default
        value = self.table.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(key, f"expected {names}, got {value!r}")
        return value

    def positive(self, key: str, default: int, minimum: int = 0) -> int:
        value: int = self.get(key, int, default)
        if value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value}")
        return value

    def done(self) -> None:
        if self.table:
            unknown = ", ".join(sorted(self.table))
            raise ConfigError(f"{self.path}: {self.where}unknown key(s): {unknown}")


def _tensor(path: Path, kind: str, index: int, table: Any) -> TensorSpec:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [[{kind}]] #{index + 1} must be a table")
    r = _Reader(path, table, f"[[{kind}]] #{index + 1} ")
    name = r.get("name", str)
    r.where = f"[[{kind}]] '{name}' "
    datatype = r.get("datatype", str)
    if datatype not in DATATYPES:
        raise r.fail("datatype", f"expected one of {DATATYPE_NAMES}, got {datatype!r}")
    shape = r.get("shape", list)
    if not all(
        isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1) for d in shape
    ):
        raise r.fail("shape", f"expected a list of positive integers or -1, got {shape!r}")
    r.done()
    return TensorSpec(name, datatype, tuple(shape))


def _tensors(path: Path, kind: str, tables: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path}: key '{kind}': expected at least one [[{kind}]] table")
    specs = tuple(_tensor(path, kind, i, t) for i, t in enumerate(tables))
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{path}: [[{kind}]] names must be unique, repeated: {dupes}")
    return specs


def _section(path: Path, doc: dict[str, Any], key: str) -> _Reader:
    table = doc.pop(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: key '{key}': expected a table [{key}]")
    return _Reader(path, table, f"[{key}] ")


def load_model_config(directory: Path) -> ModelConfig:
    """Parse and validate `directory/model.toml`; raise ConfigError on any problem."""
    path = directory / "model.toml"
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    doc.update(doc.pop("model", {}))
    top = _Reader(path, doc, "")
    name = top.get("name", str, directory.name)
    max_batch_size = top.positive("max_batch_size", 0)
    inputs = _tensors(path, "input", top.table.pop("input", None))
    outputs = _tensors(path, "output", top.table.pop("output", None))

    b = _section(path, top.table, "batching")
    batching = BatchingConfig(
        max_queue_delay_us=b.positive("max_queue_delay_us", _BATCHING.max_queue_delay_us),
        max_queue_size=b.positive("max_queue_size", _BATCHING.max_queue_size, 1),
        default_timeout_us=b.positive("default_timeout_us", 0),
    )
    b.done()
    i = _section(path, top.table, "instances")
    count = i.positive("count", 1, 1)
    timeout = float(i.get("execution_timeout_s", (int, float), _INSTANCES.execution_timeout_s))
    if timeout <= 0:
        raise i.fail("execution_timeout_s", f"expected a positive number, got {timeout}")
    i.done()
    top.done()

    found = [a for a in ARTIFACTS if (directory / a).is_file()]
    if len(found) != 1:
        raise ConfigError(
            f"{directory}: expected exactly one of {', '.join(ARTIFACTS)}, found {found or 'none'}"
        )
    return ModelConfig(
        name=name,
        directory=directory,
        artifact=directory / found[0],
        platform=ARTIFACTS[found[0]],
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        batching=batching,
        instances=InstanceConfig(count=count, execution_timeout_s=timeout),
    )


def load_repository(root: Path) -> dict[str, ModelConfig]:
    """Every model of a repository: each subdirectory holding a model.toml."""
    if not root.is_dir():
        raise ConfigError(f"{root}: model repository is not a directory")
    models: dict[str, ModelConfig] = {}
    for sub in sorted(p for p in root.iterdir() if (p / "model.toml").is_file()):
        cfg = load_model_config(sub)
        if cfg.name in models:
            raise ConfigError(f"{sub / 'model.toml'}: model name {cfg.name!r} is used twice")
        models[cfg.name] = cfg
    return models
