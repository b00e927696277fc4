"""One job running: read its lines, hand them to the core in the job lane, write
their answers in input order, checkpoint (Jobs, runner.py, claims and starts them).

    JobRun:   input.jsonl ──read + parse + decode (a thread)──▶ Chunk
              Chunk's requests ──Core.submit (background)──▶ the model's job lane
              the oldest chunk's lines answered in order ──encode (a thread)──▶ results.jsonl
              every CHECKPOINT_S (or CHECKPOINT_BYTES): results made durable, then
              the offsets that cover them committed (store.py)

A chunk is up to CHUNK_LINES lines or CHUNK_BYTES of input; at most DEPTH chunks are in
the core at once (a job's memory and the lane's requests are bounded, whatever its size).
Lines are decoded by codec.decode_request as online requests are, a request a line (the
scheduler batches them); one that does not parse, is refused or fails is its error line.

A line is written once it and every line before it are answered; a status counts what the
last checkpoint made durable, so no count a client saw is taken back: not by a crash (lines
written after it are answered again), a cancel (it keeps the lines answered without a gap),
nor a failure of this server's own storage (Stalled: a full disk; the job is queued again
and runs on from its last checkpoint, never failed for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from batchd.protos.model_config import ModelConfig
from batchd.server.config import Limits
from batchd.server.errors import Unavailable
from batchd.server.jobs.chunks import (
    Chunk,
    JobFailed,
    ModelGone,
    Reader,
    Stalled,
    encode,
    job_model,
    stalls,
)
from batchd.server.jobs.store import JobRow, LeaseLost, Progress, Results, Store, pace
from batchd.server.request import Request, Tensor

log = logging.getLogger("batchd.jobs")
DEPTH = 4  # chunks in the core at once
CHECKPOINT_S = 1.0
CHECKPOINT_BYTES = 16 * 1024 * 1024  # results written since the last checkpoint, at most
NOT_READY_S = 3.0  # shared: a running job's model without a live worker this long: given back


class JobCore(Protocol):
    @property
    def models(self) -> Mapping[str, ModelConfig]: ...

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]: ...

    def model_ready(self, name: str) -> bool: ...


class JobRun:
    """One job, running in this process."""

    def __init__(self, row: JobRow, store: Store, core: JobCore, limits: Limits,
                 on_lines: Callable[[str, int, int], None]) -> None:  # fmt: skip
        self.row, self._store, self._core, self._limits = row, store, core, limits
        self._on_lines = on_lines  # (model, answered, failed): for the metrics
        self.cancelling = False
        self.stalled = self.requeued = False  # Stalled (or its end unrecorded); queued again
        self.why = ""  # (stalled) why, as its status tells it
        self._inflight: deque[Chunk] = deque()
        self.completed, self.failed = row.completed, row.failed  # written: the results'
        self._started, self._start_done = -math.inf, row.done  # (monotonic; -inf: not running)
        # Through the last line written; its last checkpoint (what a status counts), when
        # (monotonic); and when its model was seen workerless.
        self._done = Progress(row.input_offset, row.lines_read, row.completed, row.failed)
        self._saved, self._saved_at, self._unready_since = self._done, -math.inf, math.inf

    def cancel(self) -> None:
        self.cancelling = True
        for f in (f for chunk in self._inflight for f in chunk.futures):
            f.cancel()

    def pace(self, remaining: int) -> tuple[float, float]:
        """store.pace of this run's checkpoints (monotonic times)."""
        done, since = self._saved.completed + self._saved.failed, (self._started, self._start_done)
        return pace(done, remaining, since, self._saved_at, time.monotonic())

    async def run(self) -> None:
        row = self.row
        try:
            outcome = await self._outcome()
            if outcome is None:  # given back: another replica runs it
                return
            status, error = outcome
            await self._store.finish(row, status, error)
        except (LeaseLost, Unavailable) as e:  # it runs on elsewhere, or here once the
            log.warning("job %s: stopped here (%s); it runs on from its last checkpoint", row.id,
                        e, extra={"job": row.id, "model": row.model})  # fmt: skip
            return  # database answers again: from its last checkpoint either way
        except Stalled as e:
            await self._requeue(f"stopped by this server's storage ({e})")
            return
        except Exception as e:  # its end was not written (a full disk): the server lives
            await self._requeue(f"its end ({status}) could not be recorded ({type(e).__name__}: "
                                f"{e})")  # fmt: skip
            return
        log.info(
            "job %s %s: %d answered, %d failed%s", row.id, status, self.completed, self.failed,
            f" ({error})" if error else "", extra={"job": row.id, "model": row.model},
        )  # fmt: skip

    async def _requeue(self, why: str) -> None:
        """Stalled: queued again from its last checkpoint (Store.requeue), or by Jobs once
        the store takes it; `why` is its error (its status says it) till it runs again."""
        row, self.stalled = self.row, True
        self.why = f"{why}; queued again, it runs on from its last checkpoint"
        log.error("job %s: %s", row.id, self.why, extra={"job": row.id, "model": row.model})
        with contextlib.suppress(Exception):
            await self._store.requeue(row, self.why)
            self.requeued = True

    async def _outcome(self) -> tuple[str, str] | None:
        try:
            return await self._run()
        except ModelGone as e:
            if not self._store.shared:
                return "failed", str(e)
            log.warning("job %s: given back (%s); a replica that can run it takes it", self.row.id,
                        e, extra={"job": self.row.id, "model": self.row.model})  # fmt: skip
            return None
        except JobFailed as e:
            return "failed", str(e)
        except (LeaseLost, Unavailable):
            raise
        except Exception as e:  # the disk's (its results file too): Stalled, nothing past the
            if stalls(e):  # last checkpoint kept (a write it cut short is never counted)
                raise Stalled(f"{type(e).__name__}: {e}") from e
            log.exception("job %s failed", self.row.id)  # a bug: it fails, the server lives
            return "failed", f"{type(e).__name__}: {e}"
        finally:
            self.cancel()
            self._inflight.clear()  # its lines answered ahead are never written

    async def _run(self) -> tuple[str, str]:
        row, store = self.row, self._store
        out = store.open_results(row)
        try:
            model = job_model(self._core.models, row.model, row.version)
            reader = Reader(await store.open_input(row), row.input_offset, row.lines_read)
            try:
                return await self._steps(model, reader, out)
            finally:
                reader.close()
        except asyncio.CancelledError:  # the server stops: keep what is written, run on later
            await self._give_back(out, "the stop")  # (its input perhaps still loading)
            raise
        except JobFailed as e:
            if store.shared and isinstance(e, ModelGone):
                self.cancel()
                await self._give_back(out, "its return")
            else:  # it fails keeping, and counting, every line written
                with contextlib.suppress(Exception):  # (else: from its last checkpoint)
                    await self._checkpoint(out)
            raise
        finally:
            out.close()

    async def _give_back(self, out: Results, when: str) -> None:
        """Checkpoint what is written and give the job back (shared: queued at once)."""
        try:
            await self._store.release(self.row, out, self._done)
        except Exception as e:  # what was checkpointed before stays
            log.warning("job %s: its last results were not kept at %s (%s: %s); it runs on "
                        "from its last checkpoint", self.row.id, when, type(e).__name__, e,
                        extra={"job": self.row.id, "model": self.row.model})  # fmt: skip

    def _check_ready(self, model: ModelConfig, answers: Iterable[object] = ()) -> None:
        """Shared: ModelGone once the model has had no live worker here for NOT_READY_S,
        or at once when lines were refused for it (a model that failed to load)."""
        if not self._store.shared or self._core.model_ready(model.name):
            self._unready_since = math.inf
            return
        now = time.monotonic()
        self._unready_since = min(self._unready_since, now)
        refused = any(isinstance(a, Unavailable) for a in answers)
        if refused or now - self._unready_since >= NOT_READY_S:
            raise ModelGone(f"model {model.name!r} has no live worker here")

    async def _steps(self, model: ModelConfig, reader: Reader, out: Results) -> tuple[str, str]:
        self._started, self._start_done = time.monotonic(), self.completed + self.failed
        saved_at = self._started
        while True:
            while not reader.eof and len(self._inflight) < DEPTH and not self.cancelling:
                model = job_model(self._core.models, self.row.model, self.row.version)
                chunk = await asyncio.to_thread(reader.read, model, self._limits)
                if self.cancelling:  # (cancelled while it was read: never submitted)
                    break
                chunk.submit(self._core.submit)
                self._inflight.append(chunk)
            if not self._inflight:
                break
            head = self._inflight[0]
            pending = None if self.cancelling else head.pending()
            if pending is not None and not (await asyncio.wait([pending], timeout=CHECKPOINT_S))[0]:
                self._check_ready(model)  # no worker: it makes no progress here
                saved_at = time.monotonic()  # a slow model: save, or say it still runs
                if self._done.input_offset != self._saved.input_offset:
                    await self._checkpoint(out)
                elif self._heard(await self._store.renew(self.row)) == "cancelling":
                    self.cancel()
                continue
            if not await self._write(head, model, out) and self.cancelling:
                break  # what was answered in order is written; the rest is not
            now = time.monotonic()
            if now - saved_at >= CHECKPOINT_S or out.unsaved() >= CHECKPOINT_BYTES:
                saved_at = now
                await self._checkpoint(out)
        await self._checkpoint(out)
        self._started = -math.inf
        return ("cancelled", "") if self.cancelling else ("completed", "")

    async def _write(self, head: Chunk, model: ModelConfig, out: Results) -> bool:
        """Write the head chunk's lines answered in order; True once it is all written."""
        start, end = head.written, head.answered(self.cancelling)
        if end > start:
            done = head.lines[start:end]
            got = [line.result() for line in done]
            try:
                job_model(self._core.models, self.row.model, self.row.version)  # not unloaded
                self._check_ready(model, got)  # nor failed for want of a worker
            except JobFailed:
                if not self.cancelling:
                    raise
                return False  # cancelled: what its model's going failed is not kept
            data, ok, failed = await asyncio.to_thread(encode, done, got)
            out.write(data)
            head.written = end
            self.completed, self.failed = self.completed + ok, self.failed + failed
            self._on_lines(model.name, ok, failed)
        if end > start or head.whole:  # (a chunk of blank lines only: whole at once)
            self._done = Progress(*head.through(), self.completed, self.failed)
        if head.whole:
            self._inflight.popleft()
        return head.whole

    def _heard(self, status: str) -> str:
        """The job's status a checkpoint or renewal read; LeaseLost if its row is gone
        (removed as its submitter went: it ran on, into a folder removed)."""
        if not status:
            raise LeaseLost(f"job {self.row.id} was removed; nothing more of it runs")
        return status

    async def _checkpoint(self, out: Results) -> None:
        """The results made durable, then the offsets that cover them (store.py)."""
        done, before = self._done, (self._saved, self._saved_at)
        # Set first: a status may read the commit while it is made durable (the WAL's fsync)
        self._saved, self._saved_at = done, time.monotonic()
        try:
            status = await self._store.checkpoint(self.row, out, done)
        except BaseException:
            self._saved, self._saved_at = before
            raise
        if self._heard(status) == "cancelling":  # another frontend's or replica's cancel
            self.cancel()
