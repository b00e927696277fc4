"""The frontend's internal request and result: what travels from the gRPC edge
through the queue to a worker and back. Tensor data stays `bytes` throughout.

A request to a step-wise model carries a StepStream: the outputs of its
sequence on their way to the caller. The core pushes each step's outputs as
the worker streams them; the transport takes them one at a time. The buffer is
bounded: a caller that does not read cannot grow the server's memory; when it
is full the push fails, and the core ends the sequence with RESOURCE_EXHAUSTED.
Bounded twice: in outputs (MAX_BUFFERED) and, with a StreamBudget, in bytes (each
output's data and OUTPUT_COST for its objects), over every request of one caller's
stream: a budget counts an output from its push until its caller took it (the
transport gives it back then), so a stream's sequences together hold at most its
limit. Those bounds are the last resort. Before them, each sequence has a
window of credit (Header.credit): its worker sends at most that many bytes of
outputs ahead of what the frontend has passed on towards its caller, and the
frontend gives the bytes back as they move on (not while its stream holds more
than half its budget: the responses waiting for the caller count there). A
sequence whose credit is spent is held at its worker, which keeps its slot
and state. The caller's reading paces its own sequence: a slow reader is not
cut for being slow.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from batchd.protos import wire
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


# Outputs of one sequence waiting for its caller: a bound of last resort, as its window
# (below) keeps it to about 512. Memory is the byte budget's, which charges each
# output OUTPUT_COST over its data, for its objects.
MAX_BUFFERED = 4096
OUTPUT_COST = wire.OUTPUT_COST
# A sequence's window of credit: the bytes of outputs (data and OUTPUT_COST each) its
# worker may send ahead of its caller; given back in pieces of half of it as the caller
# reads. At most an eighth of its stream's budget, so a few sequences of a stream that
# is not read are held before that budget stops one; at least OUTPUT_COST a step, so
# at most WINDOW / OUTPUT_COST outputs (512) wait: within MAX_BUFFERED.
WINDOW = 1 << 19
# A stream's budget, in responses of the largest size (--max-message-bytes): at least
# one, or a response the server may send could never be held for its caller; two, so
# that one can be on its way out while the sequences' next outputs come in.
STREAM_BUDGET_RESPONSES = 2


def output_bytes(outputs: Sequence[Tensor]) -> int:
    return sum(len(t.data) for t in outputs)


class StreamBudget:
    """The bytes of outputs that one caller has not taken yet, over all the requests of
    its stream: a push that would take it past `limit` is refused (the core stops that
    sequence), and new requests wait (`room`) while more than half of it is held, so
    the sequences already running keep the other half to go on in."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._room = asyncio.Event()
        self._room.set()
        self.deferred: set[StepStream] = set()  # sequences owed credit while crowded

    def take(self, size: int) -> bool:
        """Hold `size` more bytes; False, and nothing held, past the limit."""
        if self.held + size > self.limit:
            return False
        self.hold(size)
        return True

    def hold(self, size: int) -> None:
        """Hold bytes already counted once (an output moving on towards its caller)."""
        self.held += size
        if self.held * 2 > self.limit:
            self._room.clear()

    def give(self, size: int) -> None:
        """`size` bytes left: taken by the caller, or dropped."""
        self.held -= size
        if self.held * 2 <= self.limit and not self._room.is_set():
            self._room.set()
            for stream in list(self.deferred):  # the credit they were owed goes now
                stream.give_credit()

    def crowded(self) -> bool:
        return not self._room.is_set()

    async def room(self) -> None:
        """Return once at most half the limit is held."""
        await self._room.wait()


def stream_budget(max_response_bytes: int) -> StreamBudget:
    """The budget of one caller's stream: STREAM_BUDGET_RESPONSES largest responses."""
    return StreamBudget(STREAM_BUDGET_RESPONSES * max_response_bytes)


class StepStream:
    """The outputs of one sequence, in order, for its caller."""

    def __init__(
        self, limit: int = MAX_BUFFERED, budget: StreamBudget | None = None, held: bool = False,
        handed_on: bool = False,
    ) -> None:  # fmt: skip
        self._items: deque[tuple[list[Tensor], bool]] = deque()  # (outputs, final)
        self._sizes: deque[int] = deque()  # the bytes each item counts (credit, budget)
        self.limit = limit  # outputs held for a caller that has not read them
        self.budget = budget  # the bytes its caller's stream may hold; None: not counted
        # True: the outputs are joined into one answer at the end (a unary call), so
        # its caller has seen none of them until then, and a restart loses nothing
        self.held = held
        # True: an output taken (next) stays held in the budget, its caller's to give back
        # once its own caller took it (streaming.py's queue): in between, the budget never
        # looked emptier than it was, and gave credit for outputs it had no room for
        self.handed_on, self.last_bytes, self.offered = handed_on, 0, 0
        self.restarts = 0  # times its sequence started over (recovery), dropping its outputs
        self._wake: asyncio.Future[None] | None = None
        self.closed = False
        self.sent = 0  # outputs pushed so far
        # Where the sequence runs, once the core has started it: the worker's
        # identity and the sequence's id there (to cancel it).
        self.worker: bytes | None = None
        self.seq_id = 0
        # Flow control: its START's credit; what its worker may still send (it holds the
        # sequence at 0 or below, as this does); bytes read and not given back yet;
        # and what sends CREDIT to its worker (set when it starts)
        self.window = min(WINDOW, budget.limit // 8) if budget is not None else WINDOW
        # The most bytes one step's outputs may hold: handed on, what one response may
        # carry (its caller's responses: gRPC's, --max-message-bytes); else the budget
        limit = budget.limit if budget is not None else 0
        self.cap = limit // STREAM_BUDGET_RESPONSES if handed_on else limit
        self.credit, self._owed = self.window, 0
        self.grant: Callable[[int, bool], None] | None = None
        self.taken_at = time.monotonic()  # when its caller last took an output
        self.watched = False  # a held sequence's timer runs (Sequences: the caller's stall)

    def push(self, outputs: list[Tensor], final: bool = False) -> bool:
        """One step's outputs (`final`: the sequence's last); False, and nothing kept,
        when the caller is too far behind (`behind` says how)."""
        self.offered = output_bytes(outputs)
        size = self.offered + OUTPUT_COST
        if len(self._items) >= self.limit:
            return False
        if self.budget is not None and (self.too_large() or not self.budget.take(size)):
            return False
        self._items.append((outputs, final))
        self._sizes.append(size)
        self.credit -= size
        self.sent += 1
        self._notify()
        return True

    @property
    def paused(self) -> bool:
        """Its worker spent its credit: it steps this sequence no more until given some."""
        return self.credit <= 0

    def give_credit(self) -> None:
        """Give the bytes its caller read back to its worker, once they are half a window
        (and not while its stream's budget is crowded: then once it is not)."""
        if self.grant is None or self._owed * 2 < self.window:
            return
        if self.budget is not None and self.budget.crowded():
            self.budget.deferred.add(self)
            return
        if self.budget is not None:
            self.budget.deferred.discard(self)
        more, self._owed, paused = self._owed, 0, self.paused
        self.credit += more
        self.grant(more, paused)

    def too_large(self) -> bool:
        """Whether the outputs a push refused are more than its stream can ever pass on
        (`cap`): no read makes room for them (its caller is not behind)."""
        return self.budget is not None and self.offered > self.cap

    def behind(self) -> str:
        """What the caller has not read, once a push was refused."""
        if len(self._items) >= self.limit or self.budget is None:
            return f"its last {self.limit} outputs"
        more = self.offered + OUTPUT_COST
        return (
            f"{self.budget.held} bytes of outputs, and this step's {more} more would pass the "
            f"{self.budget.limit} a stream holds for its caller (twice --max-message-bytes)"
        )

    def close(self) -> None:
        """No more outputs will come (the sequence ended, failed or was dropped)."""
        self.closed = True
        self._stop_credit()
        self._notify()

    def discard(self) -> None:
        """Drop the outputs not taken (their caller left), giving back their bytes."""
        if self.budget is not None:
            self.budget.give(sum(self._sizes))
        self._items.clear()
        self._sizes.clear()

    def restart(self) -> None:
        """The sequence starts over on another worker: what it gave so far goes."""
        self.discard()
        self._stop_credit()  # its new START carries a whole window again
        self.credit, self._owed, self.watched = self.window, 0, False
        self.restarts += 1

    async def next(self) -> tuple[list[Tensor], bool] | None:
        """The next step's outputs and whether they are the last, or None once closed
        and drained. Its bytes go back to the budget (the caller has them now), and
        to its worker's credit."""
        while not self._items:
            if self.closed:
                return None
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        size = self.last_bytes = self._sizes.popleft()
        item = self._items.popleft()
        self._owed, self.taken_at = self._owed + size, time.monotonic()
        if self.budget is not None and not self.handed_on:
            self.budget.give(size)
        self.give_credit()
        return item

    def _stop_credit(self) -> None:
        self.grant = None
        if self.budget is not None:
            self.budget.deferred.discard(self)

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
