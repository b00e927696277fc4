"""A step-wise model's request at the edge: its sequence submitted and followed
(`follow`) and, for a unary call (ModelInfer, HTTP /generate), every step's
outputs joined into one answer (`join_sequence`).

A unary answer joins each requested output's steps along their first dimension
(the decoder's TOKEN [1] a step: TOKEN [n]). As the outputs come:

  * their other dimensions must agree from step to step, or no tensor holds them:
    the model's fault (ModelFailed, naming the output and both shapes), while
    ModelStreamInfer streams such steps as they are;
  * they must fit one response (--max-message-bytes): the sequence is stopped,
    its slot freed, as soon as they would not (ResponseTooLarge, pointing to the
    streamed calls), before the frontend holds more of them;
  * a sequence started over after its worker was lost (recovery.py: its caller
    has seen nothing) drops what its lost run gave.

A sequence that yields no output at all is answered with every requested output
empty: a first dimension of 0, the others as declared, and 0 for a variable one
(-1): no extent was ever produced, and a shape with -1 in it is no shape a
client can reshape to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Protocol

from batchd.server.errors import ModelFailed, ResponseTooLarge, clip_list
from batchd.server.flow import StepStream
from batchd.server.request import Request, Tensor


class Submitter(Protocol):
    """What following a sequence needs from the core."""

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]: ...
    def cancel(self, request: Request) -> None: ...


async def follow(core: Submitter, request: Request) -> AsyncGenerator[tuple[list[Tensor], bool]]:
    """Submit a step-wise request and take its outputs until its sequence ends; its
    failure is raised then. Whatever ends the iteration early cancels it and drops
    the outputs not taken (their bytes go back to the stream's budget)."""
    stream = request.stream
    assert stream is not None
    future = core.submit(request)
    try:
        while (item := await stream.next()) is not None:
            yield item
        await future
    finally:
        if not future.done() or stream.worker is not None:
            core.cancel(request)
        # a failure its caller left before reading (stopped as the stream fell behind, its
        # worker lost) is taken here: asyncio logged an ERROR for each, never retrieved
        future.add_done_callback(_taken)
        stream.discard()


def _taken(future: asyncio.Future[list[Tensor]]) -> None:
    if not future.cancelled():
        future.exception()


async def join_sequence(core: Submitter, request: Request, max_bytes: int) -> list[Tensor]:
    """A unary call's answer: its sequence run to its end, its outputs joined."""
    assert request.model.generate is not None
    request.stream = StepStream(
        limit=request.model.generate.max_steps + 1, held=True, cap=max_bytes
    )
    joined = Joined(request, max_bytes)
    async with contextlib.aclosing(follow(core, request)) as steps:
        async for outputs, _ in steps:
            joined.add(outputs)
    return joined.result()


class Joined:
    """The requested outputs of one sequence's steps, checked as they come."""

    def __init__(self, request: Request, max_bytes: int) -> None:
        self._request, self._max_bytes = request, max_bytes
        self._run = -1  # the run of the sequence the pieces are from (StepStream.restarts)
        self._pieces: dict[str, list[Tensor]] = {}
        self._bytes = self._steps = 0

    def _current(self) -> None:
        stream = self._request.stream
        run = stream.restarts if stream is not None else 0
        if run != self._run:  # (first, or the sequence started over: its old run's go)
            self._run = run
            self._pieces = {name: [] for name in self._request.outputs}
            self._bytes = self._steps = 0

    def add(self, outputs: list[Tensor]) -> None:
        """One step's outputs; raises, to stop the sequence, when they do not join."""
        self._current()
        self._steps += 1
        model = self._request.model.name
        for t in outputs:
            pieces = self._pieces.get(t.name)
            if pieces is None:
                continue  # not asked for: not held
            if pieces and t.shape[1:] != pieces[0].shape[1:]:
                raise ModelFailed(
                    f"model {model!r}: output {t.name!r} came with shape "
                    f"{clip_list(pieces[0].shape)} at first and {clip_list(t.shape)} in the "
                    f"sequence's output number {self._steps}; a unary ModelInfer joins the "
                    "steps along their first dimension, so their other dimensions must agree "
                    "(ModelStreamInfer, or /generate_stream, streams each step's outputs as "
                    "they are)"
                )
            pieces.append(t)
            self._bytes += len(t.data)
        if self._bytes > self._max_bytes:
            raise ResponseTooLarge(
                f"model {model!r}: this sequence's outputs passed {self._bytes} bytes at its "
                f"output number {self._steps}, more than a response may carry ({self._max_bytes}, "
                "--max-message-bytes), and it was stopped; a unary ModelInfer (or /generate) "
                "answers with every step's outputs joined: for long outputs use "
                "ModelStreamInfer (or /generate_stream), which sends each step's as it comes"
            )

    def result(self) -> list[Tensor]:
        """Each requested output, its steps joined (none: empty, see the docstring)."""
        self._current()
        specs = {s.name: s for s in self._request.model.outputs}
        joined = []
        for name, pieces in self._pieces.items():
            if not pieces:
                spec = specs[name]
                shape = (0, *(max(d, 0) for d in spec.shape[1:]))
                joined.append(Tensor(name, spec.datatype, shape, b""))
                continue
            first = pieces[0]
            rows = sum(p.shape[0] for p in pieces)
            data = first.data if len(pieces) == 1 else b"".join(p.data for p in pieces)
            joined.append(Tensor(name, first.datatype, (rows, *first.shape[1:]), data))
        return joined
