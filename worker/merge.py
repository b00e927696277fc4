"""One forward for the batches several frontends sent at once.

With `batchd serve --frontends N` each frontend batches only the requests it
took in, so each sends batches 1/N as large. A worker that finds several
batches of one model waiting runs them as one forward, up to the model's
`max_batch_size` rows, and cuts the outputs back into one reply per batch.
Only batches whose every input has the same name, datatype and per-row shape
merge; a ragged model's (padded per batch), a model with batch inputs, and a
retry after a failure (`Header.alone`) never do. Pure: wire headers and
frames in and out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig

Item = tuple[int, wire.Header, list[Any]]  # (frontend, BATCH header, frames)


def rows_of(header: wire.Header) -> int:
    if header.rows:
        return int(header.rows)
    return int(header.tensors[0].shape[0]) if header.tensors and header.tensors[0].shape else 0


def _signature(header: wire.Header) -> tuple[Any, ...]:
    return tuple((t.name, t.datatype, tuple(t.shape[1:])) for t in header.tensors)


def mergeable(cfg: ModelConfig, header: wire.Header) -> bool:
    """Whether a forward that this batch starts may take other batches with it."""
    return cfg.batches and not cfg.ragged and not cfg.batch_inputs and not header.alone


def can_merge(cfg: ModelConfig, first: wire.Header, other: wire.Header, rows: int) -> bool:
    """Whether `other` may join a forward that `first` started and that holds `rows`."""
    return (
        mergeable(cfg, first)
        and not other.alone
        and other.kind == wire.Header.BATCH
        and (other.model, other.version) == (first.model, first.version)
        and rows + rows_of(other) <= cfg.max_batch_size
        and _signature(other) == _signature(first)
    )


def join(group: Sequence[Item]) -> tuple[list[wire.Tensor], list[bytes]]:
    """The inputs of one forward: each tensor's rows of every batch, in order."""
    first = group[0][1]
    tensors, frames = [], []
    for i, t in enumerate(first.tensors):
        rows = sum(int(h.tensors[i].shape[0]) for _, h, _ in group)
        tensors.append(wire.Tensor(name=t.name, datatype=t.datatype, shape=[rows, *t.shape[1:]]))
        frames.append(b"".join(memoryview(f[i]) for _, _, f in group))
    return tensors, frames


def split(
    tensors: Sequence[wire.Tensor], frames: Sequence[Any], rows: Sequence[int]
) -> list[tuple[list[wire.Tensor], list[Any]]]:
    """The outputs of one forward, cut back into each batch's rows (BYTES by their
    row offsets, the rest by equal row sizes)."""
    total = sum(rows)
    parts: list[tuple[list[wire.Tensor], list[Any]]] = [([], []) for _ in rows]
    for t, frame in zip(tensors, frames, strict=True):
        view = memoryview(frame).cast("B")
        offsets = list(t.row_offsets) or [len(view) // total * r for r in range(total + 1)]
        start = 0
        for (out_t, out_f), n in zip(parts, rows, strict=True):
            a, b = offsets[start], offsets[start + n]
            piece = wire.Tensor(name=t.name, datatype=t.datatype, shape=[n, *t.shape[1:]])
            if t.row_offsets:
                piece.row_offsets.extend(o - a for o in offsets[start : start + n + 1])
            out_t.append(piece)
            out_f.append(view[a:b])
            start += n
    return parts
