"""Step-wise models: the worker's continuous-batching loop.

A step-wise model (model.toml `[generate]`) is an object with
`start(requests) -> states`, `step(states) -> [(outputs | None, done)]` and,
optionally, `release(state)`. Each request is one sequence. The frontend sends
a START per sequence (at most `max_active` per worker: slots are its credits)
and a CANCEL when the caller leaves. Each sequence has a credit in bytes
(START's, topped up by CREDIT as its caller reads): its outputs take from it,
and one whose credit is spent is held, keeping its slot and state, until more
comes; so a caller slower than the model slows its own sequence (which still
holds its slot), not the others'. A step whose outputs would take more than the
credit left is held here, its Step saying what it needs, and sent once CREDIT
brings that much: the frontend never gets more than it gave credit for. Before
every step the loop drops the cancelled sequences, sends the held steps whose
credit came, admits waiting ones into free slots with one `start`, then runs one
`step` for every active sequence and sends the outputs back at once:
one STEP message per frontend per step, an entry of `steps` per sequence,
`final` when it ended (done, or max_steps).

With `admission = "static"` a batch admits nobody until every member ended: the
static batching continuous batching is measured against.

The model's calls run under torch.inference_mode(), as a one-shot model's do:
a state carried from step to step never holds an autograd graph.

Failures are reply data: `start` raising fails the joining sequences only (each
started alone again, so only the one at fault fails; InputRefused refuses its
caller's inputs), `step` raising fails the sequences of that step; the loop and the
worker go on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig, model_key
from batchd.worker import InputRefused, execute
from batchd.worker.execute import BatchError, count, counted, encode_output, to_model_input, why
from batchd.worker.loader import forked_off
from batchd.worker.steps import Replies, Running
from batchd.worker.steps import Reply as Reply  # (re-exported: the runner's)

log = logging.getLogger("batchd.worker")
EVERY = 0  # CANCEL of every sequence of a frontend (ids start at 1: server/pool.py)
WAITING_BEAT_S = 1.0  # how often a frontend whose sequences all wait hears the loop steps


@dataclass
class StepLoop:
    """The sequences of one loaded step-wise model version."""

    cfg: ModelConfig
    model: Any  # what load() returned: start / step / release
    waiting: list[Running] = field(default_factory=list)
    active: list[Running] = field(default_factory=list)
    rounds: int = 0
    told: dict[int, float] = field(default_factory=dict)  # frontend -> when last sent to
    calling: Callable[[], None] = lambda: None  # a model call begins (the runner's timer)

    @property
    def busy(self) -> bool:
        """It has a sequence to step or to admit now (held ones do not count)."""
        return any(not s.held for s in self.active) or bool(self.waiting and self._free())

    def add(self, frontend: int, header: wire.Header, frames: list[Any],
            device: torch.device) -> list[Reply]:  # fmt: skip
        """A sequence joins (it waits for the next step); or fails at once when its
        inputs are not what the model declares."""

        def fresh() -> dict[str, Any]:
            pairs = zip(header.tensors, frames, strict=True)
            return {t.name: to_model_input(t, f, device) for t, f in pairs}

        try:
            inputs = fresh()
        except Exception as e:  # its inputs: that sequence's failure only
            out = Replies(self.cfg.name)
            out.add(Running(header.batch_id, frontend, {}), error=f"bad inputs: {e}")
            return out.send()
        credit = header.credit or None  # 0: no flow control
        asked = frozenset(header.outputs)
        self.waiting.append(Running(header.batch_id, frontend, inputs, credit=credit, outputs=asked,
                                    fresh=fresh, most=header.max_response_bytes))  # fmt: skip
        return []

    def cancel(self, frontend: int, seq_id: int) -> int:
        """Drop a sequence before its next step (its caller left), or with EVERY all of
        that frontend's; no message goes back. Ids are per frontend: several frontends
        may share this worker. How many were here (one may have ended already)."""
        same = [
            s
            for s in self.waiting + self.active
            if s.frontend == frontend and seq_id in (EVERY, s.seq_id)
        ]
        for s in same:
            if s in self.active:
                self.active.remove(s)
                self._release(s)
            else:
                self.waiting.remove(s)
        return len(same)

    def credit(self, frontend: int, seq_id: int, more: int) -> None:
        """CREDIT for one of `frontend`'s sequences; one unknown (ended already): none."""
        for s in self.waiting + self.active:
            if s.frontend == frontend and s.seq_id == seq_id and s.credit is not None:
                s.credit += more

    def drop_all(self, why: str) -> list[Reply]:
        """Every sequence ends now (its model is unloaded): a final STEP with `why`
        for each, so no frontend waits on it and a STOP owes it nothing."""
        out = Replies(self.cfg.name)
        for s in self.active:
            self._release(s)
        for s in self.active + self.waiting:
            out.add(s, error=why)
        self.waiting, self.active = [], []
        return out.send()

    def round(self) -> list[Reply]:
        """Admit, then one step for every active sequence not held: the messages to
        send. A frontend whose sequences all wait (for a slot, or behind held ones)
        hears that the loop lives, every WAITING_BEAT_S."""
        out = Replies(self.cfg.name)
        self._send_pending(out)
        self._admit(out)
        stepping = [s for s in self.active if not s.held]
        if stepping:
            self._step(stepping, out)
        now = time.monotonic()
        for frontend in {w.frontend for w in self.waiting} - out.messages.keys():
            if now - self.told.get(frontend, -math.inf) >= WAITING_BEAT_S:
                out.waiting(frontend)
        self.told.update(dict.fromkeys(out.messages, now))
        return out.send()

    def _step(self, stepping: list[Running], out: Replies) -> None:
        still = [s for s in self.active if s.held]  # they keep their slots and states
        self.rounds += 1
        start = time.perf_counter_ns()
        try:
            results = self._call(self.model.step, [s.state for s in stepping])
            if count(results) != len(stepping):
                raise BatchError(f"step() returned {counted(results, 'results')} for "
                                 f"{len(stepping)} sequences")  # fmt: skip
        except BaseException as e:  # the model's failure: these sequences' (SystemExit too)
            said = str(e) if isinstance(e, BatchError) else f"step() raised: {why(e)}"
            for s in stepping:
                out.add(s, error=said)
                self._release(s)
            self.active = still
            return
        out.stepped(len(stepping), self.rounds, time.perf_counter_ns() - start)
        for s, result in zip(stepping, results, strict=True):
            s.steps += 1
            try:
                outputs, done = result
                final = bool(done) or s.steps >= self._max_steps()
                frames: list[Any] = []
                tensors = self._encode(outputs, frames, s) if outputs is not None else ()
                # as the frontend counts it
                cost = sum(len(f) for f in frames) + wire.OUTPUT_COST * len(tensors)
                if s.credit is not None and cost > s.credit:  # held till CREDIT covers it
                    s.pending = (tensors, frames, final, cost)
                    out.need(s, cost)
                    still.append(s)
                    continue
                out.add(s, tensors, frames, final)
                if s.credit is not None:
                    s.credit -= cost
            except BaseException as e:  # a bad output fails its sequence only
                large = isinstance(e, execute.OutputTooLarge)
                out.add(s, error=f"step() returned {why(e)}", too_large=large)
                final = True
            if final:
                self._release(s)
            else:
                still.append(s)
        self.active = still

    def _send_pending(self, out: Replies) -> None:
        """The held steps whose credit came: sent, their sequences stepped on (or ended)."""
        for s in [s for s in self.active if s.pending is not None and not s.held]:
            assert s.pending is not None and s.credit is not None
            tensors, frames, final, cost = s.pending
            s.pending, s.credit = None, s.credit - cost
            out.add(s, tensors, frames, final)
            if final:
                self._release(s)
                self.active.remove(s)

    def _max_steps(self) -> int:
        assert self.cfg.generate is not None
        return self.cfg.generate.max_steps

    def _free(self) -> int:
        """Slots a waiting sequence may take now."""
        g = self.cfg.generate
        assert g is not None
        return 0 if g.admission == "static" and self.active else g.max_active - len(self.active)

    def _admit(self, out: Replies) -> None:
        free = self._free()
        joining, self.waiting = self.waiting[:free], self.waiting[free:]
        if not joining:
            return
        try:
            states = self._start(joining)
        except BaseException as e:  # fails the joining sequences only
            if len(joining) == 1:
                out.add(joining[0], **_start_failed(e))
                return
            # One of them may be at fault: each starts alone, so only it fails, on its
            # inputs as they came (start() may have changed them: the innocent answered
            # from inputs shifted twice, the poison not failing at all: review 57f).
            for s in joining:
                self._admit_one(s, out, again=True)
            return
        for s, state in zip(joining, states, strict=True):
            s.state, s.inputs, s.fresh = state, {}, None
            self.active.append(s)

    def _call(self, fn: Callable[[Any], Any], values: Any) -> Any:
        self.calling()  # each start() and step() held to execution_timeout_s alone (a round
        with torch.inference_mode():  # was: two of 1.9 s under 2 s killed it, review 57f)
            try:
                return fn(values)
            finally:
                forked_off()

    def _start(self, joining: list[Running]) -> list[Any]:
        states = self._call(self.model.start, [s.inputs for s in joining])
        if count(states) != len(joining):
            raise BatchError(f"start() returned {counted(states, 'states')} for {len(joining)} "
                             "request(s)")  # fmt: skip
        return list(states)

    def _admit_one(self, s: Running, out: Replies, again: bool = False) -> None:
        try:
            if again and s.fresh is not None:
                s.inputs = s.fresh()
            (s.state,) = self._start([s])
        except BaseException as e:  # its failure only
            out.add(s, **_start_failed(e))
            return
        s.inputs, s.fresh = {}, None
        self.active.append(s)

    def _encode(self, outputs: dict[str, Any], frames: list[Any], s: Running) -> list[wire.Tensor]:
        """The outputs `s`'s caller asked for (none: all), checked and encoded; refused
        past `s.most`, an output by its shape before it is made (a view of 4 bytes was
        made 1 GB, then refused by the frontend)."""
        if not isinstance(outputs, dict):
            raise BatchError(f"outputs as {type(outputs).__name__}, expected a dict by name")
        tensors = []
        for spec in (o for o in self.cfg.outputs if not s.outputs or o.name in s.outputs):
            if spec.name not in outputs:
                raise BatchError(f"outputs without {spec.name!r}; got {sorted(map(str, outputs))}")
            tensor, frame = encode_output(spec, outputs[spec.name], batches=False, most=s.most)
            tensors.append(tensor)
            frames.append(frame)
        if s.most and (size := sum(memoryview(f).nbytes for f in frames)) > s.most:
            raise execute.OutputTooLarge(f"outputs holding {size} bytes, more than a response may "
                                 f"carry ({s.most}, --max-message-bytes)")  # fmt: skip
        return tensors

    def _release(self, s: Running) -> None:
        release = getattr(self.model, "release", None)
        if release is None or s.state is None:
            return
        try:  # (held to execution_timeout_s alone, as start() and step(): late review 57h)
            self._call(release, s.state)
        except BaseException:  # a release that fails frees nothing more; the loop goes on
            log.exception("model %s: release() raised", self.cfg.name)
        s.state = None


def on_sequence(loops: Mapping[str, StepLoop], frontend: int, header: wire.Header,
                frames: list[Any], device: torch.device) -> list[Reply]:  # fmt: skip
    """A sequence's message from `frontend`. START: it waits for its loop's next step;
    CANCEL: it leaves; CREDIT: its caller read, it may send more."""
    if header.kind == wire.Header.CREDIT:
        for each in loops.values():
            each.credit(frontend, header.batch_id, header.credit)
        return []
    if header.kind == wire.Header.CANCEL:
        dropped = sum(each.cancel(frontend, header.batch_id) for each in loops.values())
        # Nothing goes back for a dropped sequence, but the I/O thread counted its
        # START as owed: an empty reply settles it (a STOP waits for those).
        return [(frontend, [], dropped)] if dropped else []
    loop = loops.get(model_key(header.model, header.version))
    if loop is None:
        error = wire.Header(kind=wire.Header.STEP, model=header.model)
        error.steps.add(
            id=header.batch_id,
            final=True,
            error=f"model {header.model!r} version {header.version!r} is not loaded as a "
            "step-wise model on this worker",
        )
        return [(frontend, wire.pack(error), 1)]
    return loop.add(frontend, header, frames, device)


def time_limit(loops: Mapping[str, StepLoop], header: wire.Header) -> float | None:
    """How long a sequence's message may hold the compute thread as the model's code runs:
    a CANCEL's release(), its model version's execution_timeout_s (one naming none: any
    loop's longest); None for a START or CREDIT, which run none (start() runs in the next
    step round, timed as the round). A release() that hung beat idle: the next batch of
    another model was blamed, after that model's 60 s."""
    if header.kind != wire.Header.CANCEL:
        return None
    own = loops.get(model_key(header.model, header.version))
    chosen = [own] if own else loops.values()
    return max((x.cfg.instances.execution_timeout_s for x in chosen), default=0.0)


def _start_failed(e: BaseException) -> dict[str, Any]:
    """How a sequence whose start() raised `e` ends: refused inputs are its caller's
    fault (InputRefused), anything else the model's."""
    if isinstance(e, InputRefused):
        return {"error": why(e), "invalid": True}
    return {"error": str(e) if isinstance(e, BatchError) else f"start() raised: {why(e)}"}
