"""The frontend's internal request and result: what travels from the gRPC edge
through the queue to a worker and back. Tensor data stays `bytes` throughout.

A request to a step-wise model carries a StepStream: the outputs of its
sequence on their way to the caller. The core pushes each step's outputs as
the worker streams them; the transport takes them one at a time. The buffer is
bounded: a caller that does not read cannot grow the server's memory; when it
is full the push fails, and the core ends the sequence with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from batchd.protos.model_config import ModelConfig


class Cancellable(Protocol):
    def cancel(self) -> None: ...


# Byte offsets where each row of a tensor starts, plus its length: a range for
# fixed-size types, an array for BYTES.
RowOffsets = Sequence[int] | np.ndarray


# Treat as immutable. Not frozen: a frozen dataclass's __init__ costs 3x, and every
# request makes two Tensors (its input, its output).
@dataclass(slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]  # full shape; batch dim first when the model batches
    data: bytes | memoryview  # raw form (PROTOCOL.md), already validated
    # BYTES only: where each row starts in `data`, plus len(data) (from the walk that
    # validated it), so splitting never walks the elements again.
    row_offsets: RowOffsets | None = None


@dataclass(eq=False, slots=True)
class Request:
    model: ModelConfig
    id: str
    inputs: list[Tensor]  # in the model's [[input]] order
    outputs: tuple[str, ...]  # requested output names, in response order
    rows: int  # size of the batch dim (1 for a model that does not batch)
    deadline: float  # monotonic seconds; math.inf for none
    # True when `deadline` comes from a queue timeout shorter than the gRPC
    # deadline: gRPC does not enforce it, so the scheduler arms a timer.
    queue_timeout: bool = False
    arrival: float = 0.0  # monotonic seconds, set on admission
    timer: Cancellable | None = None  # its queue timeout's, while it is queued
    attempts: int = 0  # batches of this request whose worker was lost
    suspect: bool = False  # its batch failed: it rides alone until it is answered
    level: int = 0  # priority level index: 0 is priority 1, the highest
    stream: StepStream | None = None  # a step-wise model's: where its outputs go
    background: bool = False  # a batch job's: it waits in the job lane (scheduler.py)
    trace: Any = None  # its tracing.RequestTrace, when tracing is on and it is sampled
    future: asyncio.Future[list[Tensor]] = field(init=False)  # set on admission
    # Derived from the inputs, once:
    length: int = field(init=False)  # longest ragged length (0: the model has no ragged input)
    shape_key: tuple[tuple[int, ...], ...] = field(init=False)  # batch only with equal keys

    def __post_init__(self) -> None:
        skip = 1 if self.model.batches else 0
        if not self.model.ragged:  # the common case, without zipping against the specs
            self.shape_key = tuple(t.shape[skip:] for t in self.inputs)
            self.length = 0
            return
        specs = self.model.inputs
        self.shape_key = tuple(
            t.shape[skip:] for t, s in zip(self.inputs, specs, strict=True) if not s.ragged
        )
        self.length = max(
            (t.shape[1] for t, s in zip(self.inputs, specs, strict=True) if s.ragged), default=0
        )


@dataclass(eq=False, slots=True)
class Batch:
    """Requests sent together to one worker: an entry of the pool's in-flight table."""

    id: int
    model: ModelConfig
    requests: list[Request]
    sent_at: float
    suspect: bool = False  # a retry after a failure: its worker takes nothing else meanwhile
    span: Any = None  # its tracing span, when a request it carries is traced


MAX_BUFFERED = 256  # outputs of one stream waiting for its caller


class StepStream:
    """The outputs of one sequence, in order, for its caller."""

    def __init__(self, limit: int = MAX_BUFFERED) -> None:
        self._items: deque[tuple[list[Tensor], bool]] = deque()  # (outputs, final)
        self.limit = limit  # outputs held for a caller that has not read them
        self._wake: asyncio.Future[None] | None = None
        self.closed = False
        self.sent = 0  # outputs pushed so far
        # Where the sequence runs, once the core has started it: the worker's
        # identity and the sequence's id there (to cancel it).
        self.worker: bytes | None = None
        self.seq_id = 0

    def push(self, outputs: list[Tensor], final: bool = False) -> bool:
        """One step's outputs (`final`: the sequence's last); False, and nothing kept,
        when the caller is too far behind."""
        if len(self._items) >= self.limit:
            return False
        self._items.append((outputs, final))
        self.sent += 1
        self._notify()
        return True

    def close(self) -> None:
        """No more outputs will come (the sequence ended, failed or was dropped)."""
        self.closed = True
        self._notify()

    async def next(self) -> tuple[list[Tensor], bool] | None:
        """The next step's outputs and whether they are the last, or None once closed
        and drained."""
        while not self._items:
            if self.closed:
                return None
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        return self._items.popleft()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
