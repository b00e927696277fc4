"""The frontend's internal request and result: what travels from the gRPC edge
through the queue to a worker and back. Tensor data stays `bytes` throughout.

A request to a step-wise model carries a StepStream (server/flow.py): the
outputs of its sequence on their way to its caller, under flow control.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from batchd.protos.model_config import ModelConfig

if TYPE_CHECKING:
    from batchd.server.flow import StepStream


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
    spared: bool = False  # one such loss, while the worker loaded a model, went uncounted
    loaded_beside: bool = False  # ... and a load was its other suspect (recovery.after_loss)
    suspect: bool = False  # its batch failed: it rides alone until it is answered
    level: int = 0  # priority level index: 0 is priority 1, the highest
    stream: StepStream | None = None  # a step-wise model's: where its outputs go
    background: bool = False  # a batch job's: it waits in the job lane (scheduler.py)
    settle_from: float = 0.0  # a suspect: since when it waits for a settled worker (lanes.py)
    trace: Any = None  # its tracing.RequestTrace, when tracing is on and it is sampled
    whole: Request | None = None  # a chunk's: the request it was split from
    # [queue, compute input, infer, output] ns, as its batches (or steps) came back: the
    # statistics count them once it is answered successfully (Request.took)
    timing: list[int] | None = None
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

    def took(self, queue_ns: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """A batch (or step) of it came back: its wait, and what computing it took. A
        split request's chunks are its own: it waited as long as its longest-waiting
        chunk (their waits overlap: summed, the mean queue time of 653 requests split
        into thousands of chunks was 28 s, longer than the requests), and computing it
        took its chunks' times together."""
        r = self.whole or self
        if (t := r.timing) is None:
            r.timing = [queue_ns, input_ns, infer_ns, output_ns]
        else:
            t[0], t[1], t[2] = max(t[0], queue_ns), t[1] + input_ns, t[2] + infer_ns
            t[3] += output_ns

    @property
    def bounded(self) -> bool:
        """Whether every output the model makes goes into one response that
        --max-message-bytes bounds: not a job's line (a file holds it), nor a request
        asking for some outputs (the others are dropped). Then its worker may refuse an
        output no response could carry (wire.proto, max_response_bytes)."""
        return not self.background and len(self.outputs) == len(self.model.outputs)


@dataclass(eq=False, slots=True)
class Batch:
    """Requests sent together to one worker: an entry of the pool's in-flight table."""

    id: int
    model: ModelConfig
    requests: list[Request]
    sent_at: float
    suspect: bool = False  # a retry after a failure: its worker takes nothing else meanwhile
    span: Any = None  # its tracing span, when a request it carries is traced
