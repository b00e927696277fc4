"""Joining requests into one batch's wire tensors, and splitting a batch's
outputs back into one result per request. Pure; bytes stay bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from batchd.protos import wire
from batchd.protos.datatypes import DATATYPES
from batchd.protos.tensors import bytes_element_offsets
from batchd.server.request import Request, Tensor


def join_inputs(requests: Sequence[Request]) -> tuple[list[wire.Tensor], list[Any]]:
    """Wire tensor headers and raw frames for one batch (row-concatenated inputs)."""
    first = requests[0]
    batches = first.model.batches
    rows = sum(r.rows for r in requests)
    headers, frames = [], []
    for i, t in enumerate(first.inputs):
        shape = (rows, *t.shape[1:]) if batches else t.shape
        headers.append(wire.Tensor(name=t.name, datatype=t.datatype, shape=shape))
        if len(requests) == 1:
            frames.append(t.data)
        else:
            frames.append(b"".join(r.inputs[i].data for r in requests))
    return headers, frames


def _row_bounds(datatype: str, shape: Sequence[int], buf: memoryview) -> list[int]:
    """Byte offset where each row of `buf` starts, plus the end."""
    rows = shape[0]
    per_row = math.prod(shape[1:])
    dt = DATATYPES[datatype]
    if not dt.is_bytes:
        if len(buf) != rows * per_row * dt.itemsize:
            raise ValueError(
                f"{datatype} output of shape {list(shape)} needs "
                f"{rows * per_row * dt.itemsize} bytes, the worker sent {len(buf)}"
            )
        step = per_row * dt.itemsize
        return [i * step for i in range(rows + 1)]
    offsets = bytes_element_offsets(buf)
    if len(offsets) - 1 != rows * per_row:
        raise ValueError(
            f"BYTES output of shape {list(shape)} needs {rows * per_row} "
            f"elements, the worker sent {len(offsets) - 1}"
        )
    return offsets[::per_row] if per_row else [0] * (rows + 1)


def split_outputs(
    requests: Sequence[Request], headers: Sequence[wire.Tensor], frames: Sequence[Any]
) -> list[list[Tensor]]:
    """One list of output tensors per request, cut by each request's rows.

    Raises ValueError when the worker's outputs do not cover the batch's rows.
    """
    if len(requests) == 1 and not requests[0].model.batches:
        return [
            [
                Tensor(h.name, h.datatype, tuple(h.shape), memoryview(f))
                for h, f in zip(headers, frames, strict=True)
            ]
        ]
    total = sum(r.rows for r in requests)
    results: list[list[Tensor]] = [[] for _ in requests]
    for h, frame in zip(headers, frames, strict=True):
        shape = tuple(h.shape)
        if not shape or shape[0] != total:
            raise ValueError(
                f"output {h.name!r} has shape {list(shape)}, expected {total} rows first"
            )
        buf = memoryview(frame)
        bounds = _row_bounds(h.datatype, shape, buf)
        row = 0
        for out, r in zip(results, requests, strict=True):
            data = buf[bounds[row] : bounds[row + r.rows]]
            out.append(Tensor(h.name, h.datatype, (r.rows, *shape[1:]), data))
            row += r.rows
    return results
