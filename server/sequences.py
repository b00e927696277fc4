"""Step-wise models' sequences, on the frontend: START, STEP, CANCEL.

Each request to a step-wise model (model.toml [generate]) is one sequence. It
queues and is admitted like any request (the scheduler's queues, limits,
priorities and queue timeouts apply to the wait for a slot); its "batch" is a
START to the worker with the most free slots (pool: slots are the credits for
it). The worker sends a STEP message per step round, with an entry per
sequence; each output goes into its request's StepStream (server/flow.py), and
the final one ends it and frees its slot. Its worker is held by flow control: it
sends at most a window of bytes (START's credit) ahead of the caller, a step
past it waits there (its Step says what it needs), and CREDIT gives back what
the caller took, so a caller that falls behind has its sequence held at the
worker, slot and state kept. A caller
that leaves frees the slot at once and the worker drops it before its next
step. Lost workers: recovery.after_sequence_loss. Owned by the core, which
hands it the messages; like the core's own paths, it never calls the planner:
a freed slot schedules one pump.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig
from batchd.server.batching.scheduler import Scheduler
from batchd.server.batching.split_join import check_outputs
from batchd.server.errors import (
    BatchdError,
    InvalidInput,
    ModelFailed,
    ResponseTooLarge,
    StreamBehind,
    clip,
)
from batchd.server.flow import MAX_FLAG, StepStream
from batchd.server.link import WorkerLink
from batchd.server.pace import MIN_READ_RATE
from batchd.server.pool import WorkerHandle, WorkerPool
from batchd.server.request import Batch, Request, Tensor
from batchd.server.stats import Stats

# A paused sequence whose caller has nothing to take waits for a loan another's output
# holds, whose worker sends it within its execution_timeout_s: waiting more than this many
# of the stream's longest is a defect of flow control; the sequence is stopped, not hung.
IDLE_WATCHES = 3
log = logging.getLogger("batchd.server")


class Sequences:
    def __init__(
        self,
        pool: WorkerPool,
        link: WorkerLink,
        scheduler: Scheduler,
        stats: Stats,
        clock: Callable[[], float],
        pump_soon: Callable[[], None],
        lose: Callable[[WorkerHandle, str], None],  # a worker the link could not reach
    ) -> None:
        self._pool, self._link, self._scheduler = pool, link, scheduler
        self._stats, self._clock = stats, clock
        self._pump_soon, self._lose = pump_soon, lose

    def start(self, model: ModelConfig, requests: list[Request]) -> None:
        """Each request is one sequence: a START to the worker with the most free slots."""
        for r in requests:
            worker = self._pool.choose_slot(model)
            stream = r.stream
            assert stream is not None, "a step-wise request has its stream"
            if (why := stream.forsaken(model.key)) and not r.future.done():
                r.future.set_exception(StreamBehind(why))
                self._pump_soon()  # (the slot it would have had: the next request's)
                continue
            if worker is None or r.future.done():  # no slot after all, or its caller left
                if not r.future.done():
                    self._scheduler.requeue([r])
                    self._pump_soon()
                continue
            now = self._clock()
            sequence = self._pool.start(worker, model, r, now)
            stream.worker, stream.seq_id = worker.identity, sequence.id
            if stream.budget is not None:  # (a wait for another's output is that long)
                stream.budget.running[stream] = model.instances.execution_timeout_s
            header = wire.Header(
                kind=wire.Header.START, batch_id=sequence.id, model=model.name,
                version=model.version, credit=stream.window, max_response_bytes=stream.cap or 0,
            )  # fmt: skip
            stream.grant = functools.partial(self._credit, worker.identity, sequence)
            header.tensors.extend(
                wire.Tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in r.inputs
            )
            header.outputs.extend(o.name for o in model.outputs if o.name in r.outputs)
            frames = [t.data for t in r.inputs]
            copy = sum(len(f) for f in frames) < wire.ZERO_COPY_MIN_BYTES
            failed = self._link.send(worker.identity, wire.pack(header, frames), copy=copy)
            if failed:  # it never left, nor ran: it goes back uncharged, the worker's
                self._pool.end(worker, sequence.id)  # others as after any loss
                stream.worker, stream.seq_id = None, 0
                self._scheduler.requeue([r])
                self._lose(worker, failed)
            elif not r.attempts:  # one started again after its worker was lost is still
                r.took(int((now - r.arrival) * 1e9), 0, 0, 0)  # one: its first wait counts

    def cancel(self, request: Request) -> None:
        """The caller of a step-wise request left (cancelled, disconnected, its deadline
        passed, or it stopped reading): drop it from its queue, or free its slot and
        tell the worker, which drops it before its next step (within one step)."""
        if not request.future.done():
            request.future.cancel()
        stream = request.stream
        if stream is None or stream.worker is None:
            return  # still queued: the scheduler sweeps the cancelled entry
        worker = self._pool.get(stream.worker)
        if worker is not None and self._pool.end(worker, stream.seq_id) is not None:
            self._cancel(worker.identity, stream.seq_id, request.model)
            self._pump_soon()  # a slot is free
        stream.worker = None
        stream.close()

    def on_step(self, worker: WorkerHandle, header: wire.Header, frames: list[Any]) -> None:
        """One step round's outputs from `worker`: an entry per sequence of this frontend."""
        if header.round:
            self._count_step(worker, header)
        now, at = self._clock(), 0
        if not header.steps:  # ours all wait for a slot while the loop steps others' (a
            for seq in worker.sequences.values():  # worker shared by --frontends N): it
                if seq.model.name == header.model:  # is not stuck
                    worker.progress[seq.model.key] = now
        for step in header.steps:
            tensors = header.tensors[at : at + step.tensors]
            mine = frames[at : at + step.tensors]
            at += step.tensors
            sequence = worker.sequences.get(step.id)
            if sequence is not None:
                if header.round and not (step.need or step.error):  # it was stepped: the
                    sequence.requests[0].took(0, 0, header.compute_ns, 0)  # round's time
                self._on_output(worker, sequence, step, tensors, mine, now)
            elif not step.final:  # its caller left (the worker stepped it before our
                # CANCEL came), or it is the sequence of a frontend this one replaced:
                # it must not go on holding a slot
                self._cancel(worker.identity, step.id)

    def _on_output(
        self,
        worker: WorkerHandle,
        sequence: Batch,
        step: wire.Step,
        tensors: Sequence[wire.Tensor],
        frames: list[Any],
        now: float,
    ) -> None:
        model, r = sequence.model, sequence.requests[0]
        worker.progress[model.key] = now
        stream = r.stream
        assert stream is not None
        if step.error:
            failed = (
                InvalidInput(f"model {model.name!r} refused the inputs: {step.error}")
                if step.invalid
                else ResponseTooLarge(f"model {model.name!r}, after {stream.sent} outputs: "  # (its
                                      f"{step.error.replace(MAX_FLAG, stream.cap_from)}; the "
                                      "sequence was stopped")  # worker knows not what its cap is)
                if step.too_large
                else ModelFailed(f"model {model.name!r} on worker {worker.name}: {step.error}")
            )  # fmt: skip
            self._end_sequence(worker, sequence, failed)
            return
        if step.need:  # its next step is held at its worker, for want of credit
            if not stream.wants(step.need, len(r.outputs)):
                self._refused(worker, sequence)
            elif stream.paused and not stream.watched:
                self._watch(worker.identity, sequence)
            return
        if tensors:
            try:
                check_outputs(model, tensors, frames, r.outputs)
            except ValueError as e:
                bad = ModelFailed(
                    f"model {model.name!r} on worker {worker.name} sent bad outputs: {e}"
                )
                self._end_sequence(worker, sequence, bad)
                return
            outputs = [  # the ones it asked for (START's), and what its worker charged
                Tensor(h.name, h.datatype, tuple(h.shape), memoryview(f))
                for h, f in zip(tensors, frames, strict=True)
            ]
            first = stream.sent == 0
            if not stream.push(outputs, step.final):
                self._refused(worker, sequence)
                return
            since = r.arrival if first else sequence.sent_at
            self._stats.output(model.name, model.version, int((now - since) * 1e9), first)
            sequence.sent_at = now  # the previous output's time, for the next gap
            if stream.paused and not stream.watched:  # held at its worker from now
                self._watch(worker.identity, sequence)
        if step.final:
            self._end_sequence(worker, sequence, None)

    def _refused(self, worker: WorkerHandle, sequence: Batch) -> None:
        """A step its stream cannot take ends the sequence: more than a response
        carries, more than its worker had credit for, or its caller far behind."""
        model, stream = sequence.model, sequence.requests[0].stream
        assert stream is not None
        stopped = f"model {model.name!r}; the sequence was stopped after {stream.sent}"
        stop: BatchdError = (
            ResponseTooLarge(f"a step's outputs for this request hold {stream.offered} bytes, "
                             f"more than its stream can carry ({stream.cap}, "
                             f"{stream.cap_from}), of {stopped}")
            if stream.too_large()
            else StreamBehind(f"this stream's caller has not read its last {stream.limit} "
                              f"outputs of {stopped}")
            if stream.full()
            else ModelFailed(f"worker {worker.name} sent {stream.offered} bytes of outputs past "
                             f"the {stream.credit} it had credit for, of {stopped}")
        )  # fmt: skip
        self._stop(worker, sequence, stop)

    def _watch(self, identity: bytes, sequence: Batch) -> None:
        """A sequence held for its caller keeps its slot: if the caller takes none of its
        outputs for its model's execution_timeout_s, it is stopped (RESOURCE_EXHAUSTED)
        and the slot freed. A caller that reads, however slowly, is never stopped so."""
        stream, limit = sequence.requests[0].stream, sequence.model.instances.execution_timeout_s
        assert stream is not None
        stream.watched = True
        wait = stream.patience(limit) - (time.monotonic() - stream.taken_at)
        asyncio.get_running_loop().call_later(max(wait, 0), self._stalled, identity, sequence)

    def _stalled(self, identity: bytes, sequence: Batch) -> None:
        stream, worker = sequence.requests[0].stream, self._pool.get(identity)
        assert stream is not None
        stream.watched = False
        if worker is None or worker.sequences.get(sequence.id) is not sequence:
            return  # it ended, or its worker was lost meanwhile
        limit = sequence.model.instances.execution_timeout_s
        if stream.paused and not stream.owed():  # its caller has nothing to read: not its
            stream.start_clock()  # stall (it waits for a loan others' outputs hold, which
            stream.idle_watches += 1  # come within their models' execution_timeout_s)
            others = stream.budget.running.values() if stream.budget else ()
            slowest = max([limit, *others])
            if (idle := stream.idle_watches * limit) > IDLE_WATCHES * slowest:  # a defect
                log.error("model %s: a sequence (request id %s) held for credit with nothing "
                          "for its caller to take for %g s: stopped", sequence.model.name,
                          clip(sequence.requests[0].id), idle)  # fmt: skip
                self._stop(
                    worker,
                    sequence,
                    BatchdError(
                        f"internal error: the flow control of this sequence of model "
                        f"{sequence.model.name!r} made no progress for {idle:g} s "
                        f"with nothing for its caller to take; stopped after {stream.sent}"
                    ),
                )
                return
        else:
            stream.idle_watches = 0
        if stream.paused and time.monotonic() - stream.taken_at >= stream.patience(limit):
            stalled = StreamBehind(  # (nothing read)
                f"this stream's caller took none of the outputs of model {sequence.model.name!r} "
                f"for {limit:g} s (its execution_timeout_s){_reading(stream, limit)} while its "
                f"sequence waited for it; the sequence was stopped after {stream.sent}"
            )
            if stream.budget is not None:  # its stream's requests queued behind it go too
                stream.budget.behind[sequence.model.key] = (time.monotonic(), (
                    f"this stream's caller took none of the outputs of model "
                    f"{sequence.model.name!r} for {limit:g} s (its execution_timeout_s) while "
                    "an earlier sequence waited for it; this request, read before, was not "
                    "started"))  # fmt: skip
            self._stop(worker, sequence, stalled)
        elif stream.paused:  # it read meanwhile: its caller has that long from then
            self._watch(identity, sequence)

    def _stop(self, worker: WorkerHandle, sequence: Batch, error: BatchdError) -> None:
        """Its worker drops the sequence before its next step; its caller gets `error`."""
        self._cancel(worker.identity, sequence.id, sequence.model)
        self._end_sequence(worker, sequence, error)

    def _cancel(self, identity: bytes, seq_id: int, model: ModelConfig | None = None) -> None:
        """The worker drops the sequence before its next step (nothing goes back); its
        model's release() is held to that version's execution_timeout_s (none named: the
        longest of the worker's step-wise models')."""
        name, version = (model.name, model.version) if model else ("", "")
        cancel = wire.Header(kind=wire.Header.CANCEL, batch_id=seq_id, model=name, version=version)
        self._link.send(identity, wire.pack(cancel))

    def _credit(self, identity: bytes, sequence: Batch, more: int, paused: bool) -> None:
        """A sequence's caller read `more` bytes of its outputs: its worker may send as
        many more (`paused`: it held the sequence for want of them until now)."""
        worker = self._pool.get(identity)
        if worker is None or worker.sequences.get(sequence.id) is not sequence:
            return  # it ended, or its worker was lost meanwhile
        if paused:
            sequence.sent_at = self._clock()  # its execution_timeout_s counts from now
        credit = wire.Header(kind=wire.Header.CREDIT, batch_id=sequence.id, credit=more)
        if failed := self._link.send(identity, wire.pack(credit)):
            self._lose(worker, failed)

    def _end_sequence(self, worker: WorkerHandle, sequence: Batch,
                      error: Exception | None) -> None:  # fmt: skip
        self._pool.end(worker, sequence.id)
        r = sequence.requests[0]  # (its slot frees: a full queue's pushback, 1 ms before: 57a)
        self._scheduler.ended(sequence.model.key, self._clock() - r.arrival)
        if not r.future.done():
            if error is None:
                r.future.set_result([])
            else:
                r.future.set_exception(error)
        if r.stream is not None:
            r.stream.worker = None
            r.stream.close()
        self._pump_soon()  # a slot is free

    def _count_step(self, worker: WorkerHandle, header: wire.Header) -> None:
        """One step round per (worker, model, round): its STEP messages (one per frontend
        the worker serves) share it. Its version is its sequences' (STEP names none); a
        round of only sequences whose callers left is not counted."""
        if worker.step_rounds.get(header.model) != header.round:
            worker.step_rounds[header.model] = header.round
            ours = (worker.sequences.get(step.id) for step in header.steps)
            if (sequence := next((s for s in ours if s is not None), None)) is not None:
                version = sequence.model.version
                self._stats.step(header.model, version, header.active)


def _reading(stream: StepStream, limit: float) -> str:
    """What more its caller was given, to read what its connection took (pace.Pace)."""
    if (more := stream.patience(limit) - limit) < 0.05:
        return ""
    rate = MIN_READ_RATE // 1024
    return f" and {more:.3g} s more, to read at {rate} KiB/s what its connection had taken"
