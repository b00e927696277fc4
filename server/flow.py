"""Flow control of a step-wise model's outputs, on the frontend: one sequence's
outputs on their way to its caller (StepStream), and the bytes one caller's
stream may hold over all its sequences (StreamBudget).

A caller that does not read cannot grow the server's memory, and one that reads
as fast as it can is never cut. Each sequence has a window of credit
(Header.credit): its worker sends at most that many bytes of outputs (data and
OUTPUT_COST each) that its caller has not taken yet; a step that would pass it
is held at the worker, which says what it needs (Step.need), and goes once the
credit covers it. The frontend gives credit back as the caller takes outputs
(from gRPC's hands, for a stream). A stream's windows are reserved from its
budget when its requests are read: a step-wise request waits to be read while
the stream's windows already hold half the budget (gRPC's flow control then
holds the client's sends); the other half is what steps larger than their
window borrow, one at a time at least, so every sequence moves on as its
caller reads. A sequence whose credit is spent is held at its worker, which
keeps its slot and state: the caller's reading paces its own sequence, and a
slow reader is not cut for being slow. The bounds in outputs (MAX_BUFFERED)
and of one step's bytes (`cap`) are the last resort.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from batchd.protos import wire
from batchd.server.pace import Pace
from batchd.server.request import Tensor

# Outputs of one sequence waiting for its caller: a bound of last resort, as its window
# (below) keeps it to about 256. Memory is the budget's, which charges each output
# OUTPUT_COST over its data, for its objects.
MAX_BUFFERED = 4096
OUTPUT_COST = wire.OUTPUT_COST
# A sequence's window of credit: the bytes of outputs its worker may send ahead of its
# caller; given back in pieces of half of it as the caller reads. At most a sixteenth of
# its stream's budget, so that eight sequences of a stream run at once at least (a
# stream's windows hold half of it); at least two outputs' OUTPUT_COST; at most WINDOW,
# so at most WINDOW / OUTPUT_COST outputs (256) wait: within MAX_BUFFERED.
WINDOW = 1 << 18
# A stream's budget, in responses of the largest size (--max-message-bytes): at least
# one, or a response the server may send could never be held for its caller; two, so
# that one can be on its way out while the sequences' next outputs come in.
STREAM_BUDGET_RESPONSES = 2
MAX_FLAG = "--max-message-bytes"  # what most caps come from


def output_bytes(outputs: Sequence[Tensor]) -> int:
    return sum(len(t.data) for t in outputs)


class StreamBudget(Pace):
    """The bytes one caller's stream holds or has promised: outputs and responses it
    has not taken (`held`), its sequences' windows (`reserved`) and what steps larger
    than their window borrowed (`lent`); its caller's Pace."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.window = min(WINDOW, max(limit // 16, 2 * OUTPUT_COST))
        self.held = self.reserved = self.lent = 0
        self.promised = 0  # the answers of one-shot requests read and not answered yet
        self.largest = 0  # the largest one-shot answer held yet (what one of unknown size
        # is promised)
        # by model key: when a sequence of it was last stopped for its caller's reading
        # nothing, and what its requests queued then are told (Sequences._stalled)
        self.behind: dict[str, tuple[float, str]] = {}
        self.running: dict[StepStream, float] = {}  # its sequences not ended: their models'
        # execution_timeout_s (a wait for another's output is at most the longest)
        self._asks: dict[StepStream, int] = {}  # sequences waiting to borrow, in order
        self._changed = asyncio.Event()

    def admits(self) -> bool:
        """Whether one more sequence's window fits: its windows hold at most half."""
        return not self.reserved or (self.reserved + self.window) * 2 <= self.limit

    async def room(self, sequence: bool = False, answer: int = 0) -> None:
        """Return once the caller is not behind (at most half the limit held) and, for a
        `sequence`, once its window fits, then reserved (its StepStream, made `reserved`,
        gives it back once its outputs are all taken); for a one-shot request, once its
        `answer`'s bytes fit in half the limit beside what is held and promised to the
        others (or none is promised), then promised (`answered` gives it back)."""
        while (
            self.held * 2 > self.limit
            or (sequence and not self.admits())
            or (self.promised and (self.held + self.promised + answer) * 2 > self.limit)
        ):
            self._changed.clear()
            await self._changed.wait()
        if sequence:
            self.reserved += self.window
        self.promised += answer

    def answered(self, answer: int) -> None:
        """A one-shot request's promise ends: its answer is held, or there is none."""
        self.promised -= answer
        self._changed.set()

    def unreserve(self) -> None:
        self.reserved -= self.window
        self._changed.set()
        self._lend()

    def hold(self, size: int) -> None:
        """`size` more bytes wait for the caller (an output, or a response); the first
        after none starts the clock of its not reading (a wait in a queue is not)."""
        if not self.held:
            self.taken_at = time.monotonic()
        self.held += size

    def give(self, size: int) -> None:
        """`size` bytes left: taken by the caller, or dropped."""
        self.held -= size
        self._changed.set()
        self._lend()

    def ask(self, stream: StepStream, more: int) -> None:
        """`stream` would borrow `more` (it replaces what it asked before); lent in order,
        while the limit allows, and always to one when its caller caught up (_lend)."""
        self._asks[stream] = more
        self._lend()

    def withdraw(self, stream: StepStream) -> None:
        self._asks.pop(stream, None)

    def repay(self, size: int) -> None:
        self.lent -= size
        self._lend()

    def _lend(self) -> None:
        """To the first that asked, once the limit has room for it beside the windows (a
        window is reserved till its sequence's outputs are all taken), what is lent and
        what its caller has not taken: a stream not read holds no more. With the caller
        caught up and nothing lent, the first goes whatever its size (its tensors'
        OUTPUT_COST may pass what a response carries): a stream moves on as it is read."""
        while self._asks:
            stream, more = next(iter(self._asks.items()))
            caught_up = not self.lent and not self.held  # one loan goes, whatever its size
            if max(self.reserved + self.lent, self.held) + more > self.limit and not caught_up:
                return
            del self._asks[stream]
            self.lent += more
            stream.borrowed(more)


def stream_budget(max_response_bytes: int) -> StreamBudget:
    """The budget of one caller's stream: STREAM_BUDGET_RESPONSES largest responses."""
    return StreamBudget(STREAM_BUDGET_RESPONSES * max_response_bytes)


class StepStream:
    """The outputs of one sequence, in order, for its caller."""

    def __init__(
        self, limit: int = MAX_BUFFERED, budget: StreamBudget | None = None, held: bool = False,
        handed_on: bool = False, cap: int | None = None, reserved: bool = False,
    ) -> None:  # fmt: skip
        self._items: deque[tuple[list[Tensor], bool]] = deque()  # (outputs, final)
        self._sizes: deque[int] = deque()  # the bytes each item counts (credit, budget)
        self.limit = limit  # outputs held for a caller that has not read them
        self.budget = budget  # the bytes its caller's stream may hold; None: not counted
        # True: the outputs are joined into one answer at the end (a unary call), so
        # its caller has seen none of them until then, and a restart loses nothing
        self.held = held
        # True: an output taken (next) is not its caller's yet: it goes on to the caller's
        # stream, which calls `taken` once gRPC took it (its bytes count till then)
        self.handed_on, self.last_bytes, self.offered = handed_on, 0, 0
        self.restarts = 0  # times its sequence started over (recovery), dropping its outputs
        self._wake: asyncio.Future[None] | None = None
        self.closed = False
        self.sent = 0  # outputs pushed so far
        self._sent_before = 0  # ... before its last restart
        # Where the sequence runs, once the core has started it: the worker's
        # identity and the sequence's id there (to cancel it).
        self.worker: bytes | None = None
        self.seq_id = 0
        # Flow control: its START's credit; what its worker may still send; the bytes
        # pushed and not taken by its caller; what its worker's held step needs; what
        # it borrowed from the budget beyond its window; and what sends CREDIT to its
        # worker (set when it starts)
        self.window = budget.window if budget is not None else WINDOW
        # The most bytes one step's outputs may hold (None: any): `cap` given (a unary
        # call's answer); handed on, what one response may carry (its caller's
        # responses: gRPC's, --max-message-bytes); else its budget's limit
        self.cap_from = MAX_FLAG  # (what the cap is, said with it)
        if cap is None and budget is not None:
            cap = budget.limit // STREAM_BUDGET_RESPONSES if handed_on else budget.limit
            if not handed_on:
                self.cap_from = f"its stream's budget: {STREAM_BUDGET_RESPONSES}x {MAX_FLAG}"
        self.cap = cap
        self.credit, self.out, self.need, self.lent = self.window, 0, 0, 0
        # True: its window is reserved in the budget (StreamBudget.room), given back once
        # it ended and its caller took all its outputs
        self.reserved = reserved
        self.grant: Callable[[int, bool], None] | None = None
        # when its caller last took an output; when its request was read
        self._taken_at = self.made_at = time.monotonic()
        self.watched = False  # a held sequence's timer runs (Sequences: the caller's stall)
        self.idle_watches = 0  # its timer's times in a row with nothing for its caller

    def push(self, outputs: list[Tensor], final: bool = False) -> bool:
        """One step's outputs (`final`: the sequence's last); False, and nothing kept,
        when they are more than a response carries (`too_large`), the caller has not
        read its last `limit` outputs (`full`), or its worker sent more than it had
        credit for."""
        self.offered = output_bytes(outputs)
        size = self.offered + OUTPUT_COST * len(outputs)
        if self.full() or self.too_large() or size > self.credit:
            return False
        if not self.out:  # the first of its outputs to wait for its caller
            self.start_clock()
        self._items.append((outputs, final))
        self._sizes.append(size)
        self.credit, self.out, self.need = self.credit - size, self.out + size, 0
        if self.budget is not None:
            self.budget.hold(size)
        self.sent += 1
        self._notify()
        return True

    def wants(self, need: int, outputs: int) -> bool:
        """Its worker holds a step of `outputs` tensors that needs `need` credit; False
        when that step is more than its stream can ever pass on (`too_large`)."""
        self.offered = need - OUTPUT_COST * outputs
        if self.too_large():
            return False
        if not self.out:  # its first wait with nothing of it for its caller (as a push)
            self.start_clock()
        self.need = need
        self._settle()
        return True

    def forsaken(self, model: str) -> str | None:
        """Why not to start it, if it was read before a sequence of `model` on its stream
        was stopped for its caller's reading nothing, and the caller has read nothing
        since (one stream of such requests held the model's slots for its
        execution_timeout_s each round); None to start it."""
        if (budget := self.budget) is None:
            return None
        at, why = budget.behind.get(model, (0.0, ""))
        return why if at > max(self.made_at, budget.taken_at) else None

    @property
    def paused(self) -> bool:
        """Its worker holds it: its credit is spent, or less than its held step needs."""
        return self.credit <= 0 or self.need > self.credit

    def owed(self) -> bool:
        """Whether its caller has outputs to take: its own, or its stream's."""
        return bool(self.out or (self.budget is not None and self.budget.held))

    def start_clock(self) -> None:
        """The clock of its caller's not reading starts now: nothing of it waited for its
        caller before, its caller has nothing to take, or it started over."""
        self._taken_at = time.monotonic()

    @property
    def taken_at(self) -> float:
        """When its caller last took an output (of any sequence of its stream)."""
        return max(self._taken_at, self.budget.taken_at) if self.budget else self._taken_at

    def patience(self, limit: float) -> float:
        """Pace.patience of its stream's caller."""
        return self.budget.patience(limit) if self.budget else limit

    def taken(self, size: int) -> None:
        """Its caller took an output of `size` bytes: they go back to the budget, and to
        its worker's credit (or repay its loan, once ended)."""
        self.out -= size
        self._taken_at = time.monotonic()
        if self.budget is not None:
            self.budget.taken_at = self._taken_at
            self.budget.give(size)
        self._settle()
        self._release()

    def borrowed(self, more: int) -> None:
        """The budget lent it `more` beyond its window (it asked)."""
        self.lent += more
        self._settle()

    def _settle(self) -> None:
        """Borrow what a step larger than its window needs beyond it, repay what it no
        longer needs (once the outputs it paid for are taken), and give its worker the
        credit its caller made room for: in pieces of half a window, or at once for a
        held step (a step that fits the window waits for the caller's reading)."""
        ended = self.grant is None
        credit = 0 if ended else self.credit
        over = max(self.need - self.window, credit + self.out - self.window, 0)
        if over > self.lent and not ended:
            if self.budget is None:
                self.lent = over
            else:
                if self.lent and not self.out:  # a loan for outputs taken: back, then ask
                    self.budget.withdraw(self)  # anew, in turn (kept, it blocked its own
                    self.budget.repay(self.lent)  # next loan and others')
                    self.lent = 0
                self.budget.ask(self, over - self.lent)  # (its answer settles again)
        elif over < self.lent:
            if self.budget is not None:
                self.budget.withdraw(self)
                self.budget.repay(self.lent - over)
            self.lent = over
        if self.grant is None:
            return
        more = self.window + self.lent - self.out - self.credit  # (a loan may have given)
        if more > 0 and (more * 2 >= self.window or self.need > self.credit):
            paused = self.paused
            self.credit += more
            self.grant(more, paused)

    def too_large(self) -> bool:
        """Whether the outputs a push refused are more than its stream can ever pass on
        (`cap`): no read makes room for them (its caller is not behind)."""
        return self.cap is not None and self.offered > self.cap

    def full(self) -> bool:
        """Whether its caller has not read its last `limit` outputs (a push refused)."""
        return len(self._items) >= self.limit

    def close(self) -> None:
        """No more outputs will come (the sequence ended, failed or was dropped)."""
        self.closed = True
        if self.budget is not None:
            self.budget.running.pop(self, None)
        self._stop_credit()
        self._notify()
        self._release()

    def _release(self) -> None:
        """Its window back to the budget, once it ended and its outputs are all taken."""
        if self.reserved and self.closed and not self.out and self.budget is not None:
            self.reserved = False
            self.budget.unreserve()

    def discard(self) -> None:
        """Drop the outputs not taken (their caller left), giving back their bytes."""
        dropped = sum(self._sizes)
        self._items.clear()
        self._sizes.clear()
        self.out -= dropped
        if self.budget is not None:
            self.budget.give(dropped)
        self._settle()
        self._release()

    @property
    def gave(self) -> bool:
        """Whether its run on its worker has given outputs (since its last restart)."""
        return self.sent > self._sent_before

    def restart(self) -> None:
        """The sequence starts over on another worker: what it gave so far goes."""
        self.discard()
        self._stop_credit()  # its new START carries a whole window again
        self.credit, self.need, self.watched, self.idle_watches = self.window, 0, False, 0
        self.start_clock()  # (its time before is not its caller's)
        self.restarts += 1
        self._sent_before = self.sent

    async def next(self) -> tuple[list[Tensor], bool] | None:
        """The next step's outputs and whether they are the last, or None once closed
        and drained. Unless handed on, its caller has them now: its bytes go back to
        the budget and to its worker's credit."""
        while not self._items:
            if self.closed:
                return None
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        size = self.last_bytes = self._sizes.popleft()
        item = self._items.popleft()
        if not self.handed_on:
            self.taken(size)
        return item

    def _stop_credit(self) -> None:
        """It borrows no more, and repays what its outputs not taken do not hold (they
        stay counted in the budget's `held`, and their loan, till taken)."""
        self.grant, self.need = None, 0
        if self.budget is not None:
            self.budget.withdraw(self)
        self._settle()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
