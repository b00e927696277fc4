"""`batchd models DIR --check`: read the repository as serving does (a model
name used twice fails), load every model once on the CPU, run batches of zeros
through it, and check what comes back against the declared signature (the same
checks a serving worker applies). The batches have 2 rows, then 1 and
max_batch_size (at most MAX_ROWS, and what max_batch_tokens allows): a model
exported with a fixed batch dim fails here, not on its first odd-sized batch.

A step-wise model (model.toml [generate]) runs one sequence of zeros through a
worker's step loop to its end (max_steps at most). Zeros may not be an input it
takes (a token count of 0): when start() refuses them as a caller's fault
(batchd.worker.InputRefused) the model is still reported ok, loaded and with its
start/step contract in place, but with a note that its outputs were not checked.
Any other exception from start() is a bug in the model: it fails."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchd.protos import wire
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import ConfigError, ModelConfig, load_model_config
from batchd.protos.repository import NO_MODELS, check_root, load_each, strays
from batchd.protos.tensors import batch_input, to_raw
from batchd.worker.execute import run_batch, why
from batchd.worker.generate import StepLoop
from batchd.worker.loader import load_model

CPU = torch.device("cpu")
VARIABLE_DIM = 4  # what a -1 becomes in the zeros batch
MAX_ROWS = 64  # the largest batch of zeros, whatever max_batch_size says


@dataclass
class Row:
    model: str
    platform: str = "-"
    signature: str = "-"
    load_ms: float = 0.0
    run_ms: float = 0.0
    problem: str | None = None
    note: str | None = None


def batch_sizes(cfg: ModelConfig) -> list[int]:
    """The rows of the batches of zeros: 2, then 1 and the largest a batch may hold
    (0 alone for a model without a batch dim)."""
    if not cfg.batches:
        return [0]
    largest = min(cfg.rows_per_batch(ragged_length(cfg) if cfg.ragged else 0), MAX_ROWS)
    return list(dict.fromkeys((min(2, largest), min(1, largest), largest)))


def ragged_length(cfg: ModelConfig) -> int:
    """The length of every ragged row of the zeros: VARIABLE_DIM, or the longest row
    serving admits where that is less (a model may index a table of max_length)."""
    limits = [cfg.length_limit(s)[0] for s in cfg.inputs if s.ragged]
    return min([VARIABLE_DIM, *(n for n in limits if n)])


def zeros_batch(cfg: ModelConfig, rows: int = 2) -> tuple[list[wire.Tensor], list[Any]]:
    rows, length = min(rows, cfg.max_batch_size), ragged_length(cfg)
    headers, frames = [], []
    for spec in cfg.inputs:
        dims = [d if d > 0 else VARIABLE_DIM for d in spec.shape]
        if spec.ragged:
            dims[0] = length
        shape = [rows, *dims] if cfg.batches else dims
        if spec.packed:  # every row's elements, one after another
            shape = [rows * length, *dims[1:]]
        if spec.datatype == "BYTES":
            arr = np.full(shape, b"", dtype=object)
        else:
            arr = np.zeros(shape, DATATYPES[spec.datatype].numpy)
        datatype, shape, raw = to_raw(arr, spec.datatype)
        headers.append(wire.Tensor(name=spec.name, datatype=datatype, shape=shape))
        frames.append(raw)
    for b in cfg.batch_inputs:
        arr = batch_input(b.kind, np.full(rows, length), length)
        headers.append(wire.Tensor(name=b.name, datatype="INT64", shape=list(arr.shape)))
        frames.append(arr.astype(np.int64).tobytes())
    return headers, frames


def check_model(directory: Path, loaded: ModelConfig | ConfigError | None = None) -> Row:
    """One model's line of the report; `loaded`: its config as the repository
    loader read it (None: read `directory/model.toml` alone)."""
    if loaded is None:
        try:
            loaded = load_model_config(directory)
        except ConfigError as e:
            loaded = e
    if isinstance(loaded, ConfigError):
        return Row(directory.name, problem=str(loaded))
    cfg = loaded
    sig = ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in cfg.inputs)
    sig += " -> " + ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in cfg.outputs)
    row = Row(cfg.name, cfg.platform, sig)
    rows = 0
    try:
        start = time.perf_counter()
        fn = load_model(cfg, CPU)
        row.load_ms = (time.perf_counter() - start) * 1e3
        if cfg.generate is not None:
            start = time.perf_counter()
            row.note = run_sequence(fn, cfg, *zeros_batch(cfg))
            row.run_ms = (time.perf_counter() - start) * 1e3
            return row
        for rows in batch_sizes(cfg):
            headers, frames = zeros_batch(cfg, rows)
            start = time.perf_counter()
            run_batch(fn, cfg, CPU, headers, frames, rows)
            row.run_ms = row.run_ms or (time.perf_counter() - start) * 1e3  # the first's
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the report is the point: every failure becomes a line
        # (SystemExit too: a model calling sys.exit() ended the check, exit status 0)
        batch = f"a batch of {rows} row(s): " if rows else ""
        row.problem = f"{batch}{why(e)}"  # (cut short; a __str__ that raises is named)
    return row


def run_sequence(model: Any, cfg: ModelConfig, headers: list[wire.Tensor],
                 frames: list[Any]) -> str | None:  # fmt: skip
    """One sequence of zeros through a step loop, as a worker runs it. Raises what
    fails it; returns a note when the zeros were refused as inputs: by start() with
    InputRefused, or before it ("bad inputs")."""
    assert cfg.generate is not None
    loop = StepLoop(cfg, model)
    start = wire.Header(kind=wire.Header.START, batch_id=1, model=cfg.name)
    start.tensors.extend(headers)
    replies = loop.add(0, start, frames, CPU)
    steps = 0
    while not replies and loop.busy:
        replies = [r for r in loop.round() if r[2]]  # the message that ends it
        steps += 1
    ((_, parts, _),) = replies
    (step,) = wire.unpack(parts)[0].steps
    if step.invalid or step.error.startswith("bad inputs"):
        return f"a sequence of zeros was refused ({step.error}): outputs not checked"
    if step.error:
        raise RuntimeError(step.error)
    return f"a sequence of zeros ran {steps} step(s)"


def check_repository(root: Path) -> int:
    """Print a report; return the number of models that failed (1 if it has none)."""
    try:
        check_root(root)
    except ConfigError as e:
        print(e)
        return 1
    rows = [check_model(d, loaded) for d, loaded in load_each(root)]
    print(f"model repository {root}: {len(rows)} model(s)\n")
    for stray in strays(root) + ([] if rows else [NO_MODELS]):
        print(stray)
    for r in rows:
        status = "ok" if r.problem is None else "FAILED"
        print(
            f"{status:6} {r.model:16} {r.platform:17} load {r.load_ms:7.1f} ms  "
            f"batch of zeros {r.run_ms:7.1f} ms"
        )
        print(f"       {r.signature}")
        if r.problem:
            print(f"       {r.problem}")
        elif r.note:
            print(f"       {r.note}")
    failed = sum(r.problem is not None for r in rows)
    print(f"\n{len(rows) - failed} ok, {failed} failed")
    return failed if rows else 1  # (none: a repository pointed at the wrong folder)
