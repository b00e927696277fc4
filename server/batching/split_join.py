"""Requests -> one batch's wire tensors, and a batch's outputs -> one result per
request. Pure; fixed-size tensors stay bytes, ragged ones go through numpy once
per batch (never per element).

Ragged inputs are padded to the batch's longest row with `pad_value`, on the
declared side, or, declared `packed`, concatenated: every row's elements one
after another, [total] or [total, d, ...], no padding at all. [[batch_input]]
companions (mask, lengths; packed: offsets, segment_ids) follow the declared
inputs. Outputs declared `ragged_like` are cut back to each request's length
(packed: each request's span of the concatenation, by the same offsets).
A request with more rows than a batch holds is split into row chunks and its
chunks' results joined again.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from batchd.protos import wire
from batchd.protos.datatypes import DATATYPES, element
from batchd.protos.model_config import ModelConfig, TensorSpec
from batchd.protos.tensors import batch_input, raw_view
from batchd.server.errors import ModelFailed, clip, clip_list
from batchd.server.request import Request, RowOffsets, Tensor


def _ragged_rows(requests: Sequence[Request], i: int) -> list[tuple[int, np.ndarray]]:
    dtype = DATATYPES[requests[0].inputs[i].datatype].numpy
    return [
        (r.rows, np.frombuffer(r.inputs[i].data, dtype).reshape(r.inputs[i].shape))
        for r in requests
    ]


def _pad(spec: TensorSpec, parts: list[tuple[int, np.ndarray]], width: int) -> np.ndarray:
    dtype = DATATYPES[spec.datatype].numpy
    fill = element(spec.datatype, spec.pad_value)  # (checked at load; BF16: its bits)
    out = np.full((sum(n for n, _ in parts), width), fill, dtype=dtype)
    row = 0
    for n, a in parts:
        cols = (
            slice(width - a.shape[1], width)
            if spec.padding_side == "left"
            else slice(0, a.shape[1])
        )
        out[row : row + n, cols] = a
        row += n
    return out


def join_inputs(requests: Sequence[Request]) -> tuple[list[wire.Tensor], list[Any]]:
    """Wire tensor headers and raw frames for one batch (row-concatenated inputs)."""
    model = requests[0].model
    rows = sum(r.rows for r in requests)
    headers: list[wire.Tensor] = []
    frames: list[Any] = []
    ragged: dict[str, tuple[TensorSpec, np.ndarray, int]] = {}
    for i, (spec, t) in enumerate(zip(model.inputs, requests[0].inputs, strict=True)):
        if spec.packed:  # each request's [rows, length, ...] bytes: its rows, in order
            lens = np.repeat([r.inputs[i].shape[1] for r in requests], [r.rows for r in requests])
            frames.append(
                t.data if len(requests) == 1 else b"".join(r.inputs[i].data for r in requests)
            )
            shape: tuple[int, ...] = (int(lens.sum()), *spec.shape[1:])
            ragged[spec.name] = (spec, lens.astype(np.int64), 0)
        elif spec.ragged:
            parts = _ragged_rows(requests, i)
            width = max(a.shape[1] for _, a in parts)
            frames.append(_pad(spec, parts, width))
            shape = (rows, width)
            lens = np.repeat([a.shape[1] for _, a in parts], [n for n, _ in parts])
            ragged[spec.name] = (spec, lens.astype(np.int64), width)
        else:
            shape = (rows, *t.shape[1:]) if model.batches else t.shape
            frames.append(
                t.data if len(requests) == 1 else b"".join(r.inputs[i].data for r in requests)
            )
        headers.append(wire.Tensor(name=t.name, datatype=t.datatype, shape=shape))
    for b in model.batch_inputs:
        spec, lengths, width = ragged[b.source]
        arr = batch_input(b.kind, lengths, width, spec.padding_side == "left")
        headers.append(wire.Tensor(name=b.name, datatype="INT64", shape=arr.shape))
        frames.append(arr)
    return headers, frames


def _output_bounds(h: wire.Tensor, buf: memoryview) -> RowOffsets:
    """Byte offset where each row of a batch output starts, plus the end. Fixed-size
    types by arithmetic; BYTES from the row offsets the worker sent (it walked the
    elements when it serialized them: the frontend never walks them again)."""
    shape = tuple(h.shape)
    rows, per_row = shape[0], math.prod(shape[1:])
    dt = DATATYPES[h.datatype]
    if not dt.is_bytes:
        if len(buf) != rows * per_row * dt.itemsize:
            raise ValueError(
                f"{h.datatype} output of shape {list(shape)} needs "
                f"{rows * per_row * dt.itemsize} bytes, the worker sent {len(buf)}"
            )
        step = per_row * dt.itemsize  # no bytes at all: any cut will do
        return range(0, len(buf) + 1, step) if step else range(rows + 1)
    offsets = np.asarray(h.row_offsets, dtype=np.int64)
    if (
        len(offsets) != rows + 1
        or offsets[0] != 0
        or offsets[-1] != len(buf)
        or (np.diff(offsets) < 0).any()
    ):
        raise ValueError(
            f"BYTES output {h.name!r} of {rows} rows came with {len(offsets)} row offsets "
            f"that do not cut its {len(buf)} bytes into rows"
        )
    return offsets


def _cut_ragged(
    model: ModelConfig,
    spec: TensorSpec,
    h: wire.Tensor,
    buf: memoryview,
    requests: Sequence[Request],
) -> list[Tensor]:
    """Each request's rows of a `ragged_like` output, cut back to its own length."""
    src = next(i for i, s in enumerate(model.inputs) if s.name == spec.ragged_like)
    if model.inputs[src].packed:
        return _cut_packed(src, h, buf, requests)
    left = model.inputs[src].padding_side == "left"
    shape = tuple(h.shape)
    if len(shape) < 2 or shape[0] != sum(r.rows for r in requests):
        raise ValueError(
            f"ragged output {h.name!r} has shape {list(shape)}, expected [rows, length, ...]"
        )
    width = max(r.inputs[src].shape[1] for r in requests)  # what the batch was padded to
    if shape[1] != width:  # (a peer that does not check: another position's values)
        raise ValueError(
            f"ragged output {h.name!r} has {shape[1]} positions, the batch was padded to {width}"
        )
    arr = np.frombuffer(buf, DATATYPES[h.datatype].numpy).reshape(shape)
    out, row = [], 0
    for r in requests:
        n = r.inputs[src].shape[1]
        cols = slice(shape[1] - n, shape[1]) if left else slice(0, n)
        part = np.ascontiguousarray(arr[row : row + r.rows, cols])
        out.append(Tensor(h.name, h.datatype, part.shape, raw_view(part)))
        row += r.rows
    return out


def _cut_packed(src: int, h: wire.Tensor, buf: memoryview, requests: Sequence[Request]
                ) -> list[Tensor]:  # fmt: skip
    """Each request's span of a packed output ([elements, ...]), as [rows, length, ...]."""
    shape, spans = tuple(h.shape), [r.rows * r.inputs[src].shape[1] for r in requests]
    if not shape or shape[0] != sum(spans):
        raise ValueError(
            f"packed output {h.name!r} has shape {list(shape)}, expected {sum(spans)} "
            "elements first (the packed input's)"
        )
    step = math.prod(shape[1:]) * DATATYPES[h.datatype].itemsize
    out, at = [], 0
    for r, span in zip(requests, spans, strict=True):
        part = (r.rows, r.inputs[src].shape[1], *shape[1:])
        out.append(Tensor(h.name, h.datatype, part, buf[at : at + span * step]))
        at += span * step
    return out


def check_outputs(
    model: ModelConfig, headers: Sequence[wire.Tensor], frames: Sequence[Any],
    only: Collection[str] = (),
) -> None:  # fmt: skip
    """ValueError unless `headers` and `frames` are the model's declared outputs (those
    named in `only`, if any: a sequence's, its caller's), in order: each in its
    datatype, no dim under 0, and (fixed-size types) as many bytes as its shape needs.
    A batchd worker checks its model's (worker/execute.py); this keeps a peer that does
    not (a broken one, another build) from taking the frontend down or sending callers
    garbage."""
    specs = [o for o in model.outputs if not only or o.name in only]
    names = [o.name for o in specs]
    if len(headers) != len(names) or [h.name for h in headers] != names:
        got = clip_list([clip(h.name) for h in headers[: len(names) + 1]])
        raise ValueError(f"expected the outputs {names}, got {got}")
    if len(frames) != len(headers):
        raise ValueError(f"{len(headers)} outputs came in {len(frames)} frames")
    for spec, h, frame in zip(specs, headers, frames, strict=True):
        shape, dt = tuple(h.shape), DATATYPES[spec.datatype]
        if h.datatype != spec.datatype or any(d < 0 for d in shape):
            raise ValueError(
                f"output {spec.name!r}: expected {spec.datatype}, got {clip(h.datatype)} "
                f"of shape {clip_list(shape)}"
            )
        size = memoryview(frame).nbytes
        if not dt.is_bytes and size != math.prod(shape) * dt.itemsize:
            raise ValueError(
                f"output {spec.name!r}: {spec.datatype} of shape {clip_list(shape)} "
                f"needs {math.prod(shape) * dt.itemsize} bytes, got {size}"
            )


def split_outputs(
    requests: Sequence[Request], headers: Sequence[wire.Tensor], frames: Sequence[Any]
) -> list[list[Tensor]]:
    """One list of output tensors per request, cut by each request's rows.

    Raises ValueError when the worker's outputs are not the model's (check_outputs)
    or do not cover the batch's rows.
    """
    model = requests[0].model
    check_outputs(model, headers, frames)
    if len(requests) == 1 and not model.batches:
        return [
            [
                Tensor(h.name, h.datatype, tuple(h.shape), memoryview(f))
                for h, f in zip(headers, frames, strict=True)
            ]
        ]
    total = sum(r.rows for r in requests)
    results: list[list[Tensor]] = [[] for _ in requests]
    for h, frame in zip(headers, frames, strict=True):
        shape, buf, spec = tuple(h.shape), memoryview(frame), model.output(h.name)
        if spec is not None and spec.ragged_like is not None:
            for out, t in zip(results, _cut_ragged(model, spec, h, buf, requests), strict=True):
                out.append(t)
            continue
        if not shape or shape[0] != total:
            raise ValueError(
                f"output {h.name!r} has shape {list(shape)}, expected {total} rows first"
            )
        bounds = _output_bounds(h, buf)
        row = 0
        for out, r in zip(results, requests, strict=True):
            data = buf[bounds[row] : bounds[row + r.rows]]
            out.append(Tensor(h.name, h.datatype, (r.rows, *shape[1:]), data))
            row += r.rows
    return results


def split_request(request: Request, max_rows: int) -> list[Request]:
    """Row chunks of at most `max_rows` each; their data are views of the original.
    Linear in the request's rows: row offsets come from the decoder's walk (BYTES)
    or arithmetic, never from walking the data again for each chunk."""
    rows = request.rows
    cuts: list[RowOffsets] = []
    for t in request.inputs:
        if t.row_offsets is not None:
            cuts.append(t.row_offsets)
        else:  # a fixed-size type: rows of equal byte length (no bytes at all: any cut)
            step = len(t.data) // rows
            cuts.append(range(0, len(t.data) + 1, step) if step else range(rows + 1))
    views = [memoryview(t.data) for t in request.inputs]
    chunks = []
    for start in range(0, rows, max_rows):
        stop = min(start + max_rows, rows)
        inputs = [
            Tensor(t.name, t.datatype, (stop - start, *t.shape[1:]), v[c[start] : c[stop]])
            for t, v, c in zip(request.inputs, views, cuts, strict=True)
        ]
        chunk = Request(
            request.model, request.id, inputs, request.outputs, stop - start, request.deadline
        )
        chunk.queue_timeout, chunk.level = request.queue_timeout, request.level
        chunk.background, chunk.trace, chunk.whole = request.background, request.trace, request
        chunks.append(chunk)
    return chunks


def join_results(parts: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """The results of a split request's chunks, joined back along the rows; ModelFailed
    when their other dims differ (a variable dim that is not ragged_like is its batch's,
    not its request's: chunks in batches of other widths came back in other widths)."""
    joined = []
    for pieces in zip(*parts, strict=True):
        first = pieces[0]
        if shapes := sorted({p.shape[1:] for p in pieces} - {first.shape[1:]}):
            raise ModelFailed(
                f"the model's output {first.name!r} came back {[-1, *first.shape[1:]]} "
                f"for one part of this request and {[-1, *shapes[0]]} for another (it was "
                "split into batches): a variable dim it does not take from a ragged input "
                "(ragged_like) cannot be joined; send at most max_batch_size rows"
            )
        rows = sum(p.shape[0] for p in pieces)
        joined.append(
            Tensor(
                first.name,
                first.datatype,
                (rows, *first.shape[1:]),
                b"".join(p.data for p in pieces),
            )
        )
    return joined
