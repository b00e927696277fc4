"""A step-wise model's sequence on the worker (Running) and the STEP messages a step
round sends (Replies): one per frontend, an entry per sequence (generate.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchd.protos import wire

Reply = tuple[int, list[Any], int]  # to which frontend, the message, how many sequences it ends


@dataclass(eq=False)
class Running:
    """One sequence on this worker."""

    seq_id: int
    frontend: int  # which frontend sent it (replies go back there)
    inputs: dict[str, Any]
    state: Any = None
    # its inputs made afresh from the frames they came in, till it starts: a start() of
    # several that raised is tried one by one, and a model may have changed what it got
    fresh: Callable[[], dict[str, Any]] | None = None
    steps: int = 0
    credit: int | None = None  # bytes of outputs it may still send; None: unbounded
    most: int = 0  # bytes a step's outputs may hold (START's max_response_bytes); 0: any
    outputs: frozenset[str] = frozenset()  # those its caller asked for (START's); none: all
    # a step's outputs (tensors, frames, final, their cost) that its credit did not cover
    pending: tuple[Sequence[wire.Tensor], list[Any], bool, int] | None = None

    @property
    def held(self) -> bool:
        """Its credit is spent, or less than its pending step needs: its caller is
        behind; it is not stepped (nor its pending step sent) till CREDIT."""
        if self.credit is None:
            return False
        return self.credit <= 0 or (self.pending is not None and self.pending[3] > self.credit)


class Replies:
    """STEP messages being built: one per frontend, an entry per sequence."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.round: tuple[int, int, int] | None = None  # active, round, compute_ns
        self.messages: dict[int, tuple[wire.Header, list[Any], list[int]]] = {}

    def add(self, s: Running, tensors: Sequence[wire.Tensor] = (), frames: Sequence[Any] = (),
            final: bool = True, error: str = "", **flags: bool) -> None:  # fmt: skip
        """A step of `s` (`flags`: Step's invalid, too_large)."""
        header, all_frames, ends = self._message(s.frontend)
        header.steps.add(id=s.seq_id, tensors=len(tensors), final=final, error=wire.text(error),
                         **flags)  # fmt: skip
        header.tensors.extend(tensors)
        all_frames.extend(frames)
        ends[0] += final

    def need(self, s: Running, cost: int) -> None:
        """`s`'s step is held here: it needs `cost` credit, more than it has."""
        self.add(s, final=False)
        self.messages[s.frontend][0].steps[-1].need = cost

    def stepped(self, active: int, round: int, compute_ns: int) -> None:
        """The messages carry a step round (for its statistics, counted once)."""
        self.round = (active, round, compute_ns)

    def waiting(self, frontend: int) -> None:
        """An empty STEP for a frontend whose sequences all wait for a slot: the loop
        steps (others'), so the frontend does not judge this worker stuck."""
        self._message(frontend)

    def _message(self, frontend: int) -> tuple[wire.Header, list[Any], list[int]]:
        if frontend not in self.messages:
            header = wire.Header(kind=wire.Header.STEP, model=self.model)
            self.messages[frontend] = (header, [], [0])
        return self.messages[frontend]

    def send(self) -> list[Reply]:
        out = []
        for to, (header, frames, (ends,)) in self.messages.items():
            if self.round is not None and header.steps:  # (a round is counted where it ran)
                header.active, header.round, header.compute_ns = self.round
            out.append((to, wire.pack(header, frames), ends))
        return out
