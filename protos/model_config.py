"""The model repository format: `DIR/<model>/model.toml` beside its artifact.

    [model]                       # optional table; or these keys at top level
    max_batch_size = 32           # rows per batch; 0 = the model does not batch
    [[input]]        name, datatype ("FP32", ...), shape (no batch dim, -1 = variable),
                     ragged, packed, pad_value, padding_side ("right" | "left"), max_length
    [[batch_input]]  name, kind ("mask" | "lengths" | "offsets" | "segment_ids"),
                     source (a ragged input)
    [[output]]       name, datatype, shape, ragged_like (a ragged input)
    [batching]       max_queue_delay_us, max_queue_size, default_timeout_us,
                     preferred_batch_sizes, priority_levels, default_priority_level,
                     max_starvation_us, priority_queue_sizes, max_batch_tokens,
                     bucket_by_length, target_latency_ms
    [instances]      count (copies per device), execution_timeout_s
    [generate]       max_active, max_steps, admission ("continuous" | "static"):
                     a step-wise model (no batch dim; load() returns start/step/release)

The artifact is exactly one of model.py (defines `load(device)`), model.pt
(TorchScript) or model.pt2 (torch.export). Parsed once at start-up into frozen
dataclasses; every error names the file and the key.

Model names are plain (letters, digits, `_`, `-`, `.`; no leading dot), so a
name can be turned into a directory without escaping (repository.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchd.protos._toml_reader import INT32_MAX, ConfigError, Reader, read_toml, said
from batchd.protos.datatypes import DATATYPE_NAMES, DATATYPES, element

__all__ = ["MODEL_NAME", "ConfigError", "ModelConfig", "load_model_config"]

ARTIFACTS = {"model.py": "python", "model.pt": "pytorch_libtorch", "model.pt2": "torch_export"}
BATCH_INPUT_KINDS = ("mask", "lengths", "offsets", "segment_ids")
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch dim; -1 = variable
    ragged: bool = False  # inputs: rows of different lengths batch together, padded
    pad_value: float = 0
    padding_side: str = "right"
    ragged_like: str | None = None  # outputs: cut back to this ragged input's length
    max_length: int = 0  # ragged inputs: the longest row a request may send; 0: no limit
    packed: bool = False  # ragged inputs: rows concatenated along the ragged dim, no padding

    def accepts(self, shape: tuple[int, ...]) -> bool:
        if shape == self.shape:  # the common case, at C speed
            return True
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )


@dataclass(frozen=True, slots=True)
class BatchInputSpec:
    """A tensor the batcher generates for the model from a ragged input."""

    name: str
    kind: str  # INT64: "mask" 1/0 like the padded source; "lengths" [rows]; packed
    source: str  # sources only: "offsets" [rows + 1] from 0, "segment_ids" [elements]


AUTO_DELAY_MAX_US = 20_000  # the longest an automatic queue delay waits
# The scheduler looks at every level's queue for each batch it forms.
MAX_PRIORITY_LEVELS = 256
MAX_COPIES = 64  # [instances] count: a worker process (and its torch) each, per device


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    # None: automatic (server/batching/queues.py): the time a full batch takes to
    # arrive at the model's measured arrival rate, at most AUTO_DELAY_MAX_US.
    max_queue_delay_us: int | None = None
    max_queue_size: int = 1024  # requests waiting, per model
    default_timeout_us: int = 0  # 0 = only the caller's deadline
    preferred_batch_sizes: tuple[int, ...] = ()
    priority_levels: int = 0  # 0 = one FIFO; else levels 1 (highest) .. N
    default_priority_level: int = 0
    max_starvation_us: int = 1_000_000  # a lower level waits at most this long behind higher ones
    priority_queue_sizes: tuple[int, ...] = ()  # per level; 0 = only max_queue_size
    max_batch_tokens: int = 0  # rows x longest ragged length; 0 = no budget
    bucket_by_length: bool = False
    target_latency_ms: float = 0.0  # 0 = no adaptive cap


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    """A step-wise model: each request is one sequence, stepped with the others."""

    max_active: int = 8  # sequences stepping together on one worker
    max_steps: int = 256  # a sequence ends after this many steps at the latest
    admission: str = "continuous"  # or "static": a batch admits nobody until it ends


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    count: int = 1  # copies of the model per device, each in its own worker process
    execution_timeout_s: float = 60.0


_BATCHING, _INSTANCES, _GENERATE = BatchingConfig(), InstanceConfig(), GenerateConfig()


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
    batch_inputs: tuple[BatchInputSpec, ...] = ()
    generate: GenerateConfig | None = None  # set: a step-wise model
    version: str = "1"  # the frontend counts loads: "2" after the first reload
    # Derived once, in __post_init__ (every request reads them). `key` names one loaded
    # version: queues, workers and batches are keyed by it.
    key: str = field(init=False, repr=False, compare=False)
    batches: bool = field(init=False, repr=False, compare=False)  # max_batch_size > 0
    ragged: bool = field(init=False, repr=False, compare=False)  # some input is ragged
    packed: bool = field(init=False, repr=False, compare=False)  # its ragged inputs are packed
    output_names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _specs: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)
    _out_specs: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = {
            "key": model_key(self.name, self.version),
            "batches": self.max_batch_size > 0,
            "ragged": any(t.ragged for t in self.inputs),
            "packed": any(t.packed for t in self.inputs),
            "output_names": tuple(t.name for t in self.outputs),
            "_specs": {t.name: t for t in self.inputs},
            "_out_specs": {t.name: t for t in self.outputs},
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def input(self, name: str) -> TensorSpec | None:
        return self._specs.get(name)

    def output(self, name: str) -> TensorSpec | None:
        return self._out_specs.get(name)

    def rows_per_batch(self, length: int = 0) -> int:
        """The most rows of a request whose ragged rows are `length` long that one
        batch holds: a request of more is split into chunks of this many rows."""
        rows = max(self.max_batch_size, 1)
        tokens = self.batching.max_batch_tokens
        if tokens and length:
            rows = min(rows, max(1, tokens // length))
        return rows

    def length_limit(self, spec: TensorSpec) -> tuple[int, str]:
        """The longest row a request may send for ragged input `spec`, and the
        setting that says so: `max_batch_tokens` (one row of more could never be
        batched) or the input's own `max_length`, whichever is smaller; 0: none."""
        tokens, own = self.batching.max_batch_tokens, spec.max_length
        if tokens and (not own or tokens <= own):
            return tokens, "[batching] max_batch_tokens"
        return own, f"[[input]] {spec.name!r} max_length"


def model_key(name: str, version: str) -> str:
    """The key of one loaded version of a model, the same on both sides of the wire."""
    return f"{name}@{version}"


def _tensor(path: Path, kind: str, index: int, table: Any) -> TensorSpec:
    r = Reader(path, table, f"[[{kind}]] #{index + 1} ")
    name = r.get("name", str)
    r.where = f"[[{kind}]] '{said(name, False)}' "
    datatype = r.get("datatype", str)
    if datatype not in DATATYPES:
        raise r.fail("datatype", f"expected one of {DATATYPE_NAMES}, got {said(datatype)}")
    spec = TensorSpec(name, datatype, r.shape("shape"))
    if kind == "input" and r.get("ragged", bool, False):
        packed = r.get("packed", bool, False)
        fixed = spec.shape[1:] if packed else ()  # packed: [-1, d, ...] too
        if spec.shape != (-1, *fixed) or -1 in fixed or datatype == "BYTES":
            raise r.fail("ragged", "a ragged input has shape = [-1] (packed: or [-1, d, ...]) "
                         f"and a numeric datatype, got {list(spec.shape)} {datatype}")  # fmt: skip
        if packed and (key := next((k for k in ("pad_value", "padding_side") if k in r.table), "")):
            raise r.fail(key, "a packed input is not padded: its rows are concatenated")
        pad = r.get("pad_value", (int, float), 0)
        try:
            element(datatype, pad)
        except ValueError as e:
            raise r.fail("pad_value", f"the pad must be a {datatype} element: {e}") from None
        side = r.choice("padding_side", ("right", "left"), "right")
        longest = r.integer("max_length", 0)
        spec = TensorSpec(name, datatype, spec.shape, True, pad, side, None, longest, packed)
    elif kind == "input" and r.get("packed", bool, False):
        raise r.fail("packed", "needs ragged = true: only a ragged input's rows are packed")
    elif kind == "output" and "ragged_like" in r.table:
        like = r.get("ragged_like", str)
        if not spec.shape or spec.shape[0] != -1 or datatype == "BYTES":
            raise r.fail("ragged_like", "the output's shape must start with -1 and its datatype be "
                         f"numeric, got {list(spec.shape)} {datatype}")  # fmt: skip
        spec = TensorSpec(name, datatype, spec.shape, ragged_like=like)
    r.done()
    return spec


def _tensors(path: Path, kind: str, tables: Any, near: str = "") -> tuple[TensorSpec, ...]:
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path}: key '{kind}': expected at least one [[{kind}]] table{near}")
    specs = tuple(_tensor(path, kind, i, t) for i, t in enumerate(tables))
    _unique(path, kind, [s.name for s in specs])
    return specs


def _unique(path: Path, kind: str, names: list[str]) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{path}: [[{kind}]] names must be unique, repeated: {dupes}")


def _batch_inputs(path: Path, tables: Any, inputs: tuple[TensorSpec, ...]) -> tuple[Any, ...]:
    ragged = [t.name for t in inputs if t.ragged]
    specs = []
    for i, table in enumerate(tables or []):
        r = Reader(path, table, f"[[batch_input]] #{i + 1} ")
        name = r.get("name", str)
        r.where = f"[[batch_input]] '{said(name, False)}' "
        kind = r.choice("kind", BATCH_INPUT_KINDS, "mask")
        source = r.get("source", str)
        if source not in ragged:
            what = f"expected a ragged input ({ragged or 'none declared'})"
            raise r.fail("source", f"{what}, got {said(source)}")
        packed = next(t.packed for t in inputs if t.name == source)
        if kind == "mask" and packed:
            raise r.fail("kind", f"{source!r} is packed: no padding to mask (use offsets, "
                         "lengths or segment_ids)")  # fmt: skip
        if kind in ("offsets", "segment_ids") and not packed:
            raise r.fail("kind", f"{kind} find the rows of a packed input; {source!r} is padded "
                         "(packed = true concatenates its rows)")  # fmt: skip
        r.done()
        specs.append(BatchInputSpec(name, kind, source))
    _unique(path, "input]] and [[batch_input", [t.name for t in inputs] + [s.name for s in specs])
    return tuple(specs)


def _batching(r: Reader, max_batch_size: int, ragged: bool, packed: bool) -> BatchingConfig:
    d = _BATCHING
    levels = r.integer("priority_levels", 0, maximum=MAX_PRIORITY_LEVELS)
    preferred = r.int_list("preferred_batch_sizes", 1)
    if any(p > max_batch_size for p in preferred):
        raise r.fail(
            "preferred_batch_sizes",
            f"every size must be <= max_batch_size {max_batch_size}, got {list(preferred)}",
        )
    default_level = r.integer("default_priority_level", levels)
    if (levels or default_level) and not 1 <= default_level <= levels:  # (0 levels: only 0)
        raise r.fail("default_priority_level",
                     f"expected 1..priority_levels ({levels}), got {default_level}")  # fmt: skip
    level_sizes = r.int_list("priority_queue_sizes")
    if level_sizes and len(level_sizes) != levels:
        raise r.fail(
            "priority_queue_sizes",
            f"expected one size per level ({levels}), got {len(level_sizes)}",
        )
    cfg = BatchingConfig(
        max_queue_delay_us=(
            r.integer("max_queue_delay_us", 0) if "max_queue_delay_us" in r.table else None
        ),
        max_queue_size=r.integer("max_queue_size", d.max_queue_size, 1),
        default_timeout_us=r.integer("default_timeout_us", 0),
        preferred_batch_sizes=tuple(sorted(set(preferred))),
        priority_levels=levels,
        default_priority_level=default_level,
        max_starvation_us=r.integer("max_starvation_us", d.max_starvation_us),
        priority_queue_sizes=level_sizes,
        max_batch_tokens=r.integer("max_batch_tokens", 0),
        bucket_by_length=r.get("bucket_by_length", bool, False),
        target_latency_ms=r.number("target_latency_ms", 0.0),
    )
    for key in ("max_batch_tokens", "bucket_by_length"):
        if getattr(cfg, key) and not ragged:
            raise r.fail(key, "needs a ragged input (ragged = true)")
    if cfg.bucket_by_length and packed:
        raise r.fail("bucket_by_length", "a packed model pads nothing, so bucketing saves nothing "
                     "(max_batch_tokens counts its real elements): leave it out")  # fmt: skip
    r.done()
    return cfg


def load_model_config(directory: Path) -> ModelConfig:
    """Parse and validate `directory/model.toml`; raise ConfigError on any problem.
    A failure the checks below did not foresee is one too, naming the file: callers
    (start-up, `--check`, RepositoryIndex) report a ConfigError and catch no other."""
    path = directory / "model.toml"
    try:
        return _parse(directory, path, read_toml(path))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{path}: cannot be read as a model: {type(e).__name__}: "
                          f"{str(e)[:200]}") from e  # fmt: skip


def _parse(directory: Path, path: Path, doc: dict[str, Any]) -> ModelConfig:
    doc.update(Reader(path, doc.pop("model", {}), "[model] ").table)
    top = Reader(path, doc, "")
    name = top.get("name", str, directory.name)
    if not MODEL_NAME.fullmatch(name):
        raise top.fail(
            "name", f"expected letters, digits, '_', '-', '.' (no leading '.'), got {said(name)}"
        )
    max_batch_size = top.integer("max_batch_size", 0, maximum=INT32_MAX)  # int32 on the wire
    inputs = _tensors(path, "input", top.table.pop("input", None), top.near("input"))
    outputs = _tensors(path, "output", top.table.pop("output", None), top.near("output"))
    batch_inputs = _batch_inputs(path, top.table.pop("batch_input", None), inputs)
    ragged = any(t.ragged for t in inputs)
    if ragged and not max_batch_size:
        raise top.fail("max_batch_size", "ragged inputs need a batching model (max_batch_size > 0)")
    ragged_names = [t.name for t in inputs if t.ragged]
    packed = [t.name for t in inputs if t.packed]
    if packed and len(packed) != len(ragged_names):
        raise ConfigError(
            f"{path}: [[input]] {packed} key 'packed': a model's ragged inputs are all packed or "
            f"all padded, and {sorted(set(ragged_names) - set(packed))} are padded"
        )
    for o in outputs:
        if o.ragged_like is not None and o.ragged_like not in ragged_names:
            raise ConfigError(
                f"{path}: [[output]] '{said(o.name, False)}' key 'ragged_like': expected a "
                f"ragged input ({ragged_names or 'none declared'}), "
                f"got {said(o.ragged_like)}"
            )
    batching = _batching(top.table_of("batching"), max_batch_size, ragged, bool(packed))
    generate = _generate(top, max_batch_size, inputs, outputs) if "generate" in top.table else None
    i = top.table_of("instances")
    instances = InstanceConfig(
        count=i.integer("count", 1, 1, maximum=MAX_COPIES),
        execution_timeout_s=i.number("execution_timeout_s", _INSTANCES.execution_timeout_s, 1e-3),
    )
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
        instances=instances,
        batch_inputs=batch_inputs,
        generate=generate,
    )


def _generate(
    top: Reader,
    max_batch_size: int,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
) -> GenerateConfig:
    r = top.table_of("generate")
    if max_batch_size:
        raise r.fail(
            "max_active",
            f"a step-wise model has no batch dim: leave max_batch_size out (got {max_batch_size})",
        )
    if any(t.ragged for t in inputs):
        raise r.fail("max_active", "a step-wise model takes no ragged inputs")
    flat = [o.name for o in outputs if not o.shape]
    if flat:
        raise r.fail(
            "max_active",
            f"outputs {flat} have shape []: a step's outputs need a first dim, along which "
            "a unary ModelInfer joins the steps",
        )
    cfg = GenerateConfig(
        max_active=r.integer("max_active", _GENERATE.max_active, 1),
        max_steps=r.integer("max_steps", _GENERATE.max_steps, 1),
        admission=r.choice("admission", ("continuous", "static"), "continuous"),
    )
    r.done()
    return cfg
