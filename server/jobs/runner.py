"""Running jobs: read a job's lines, hand them to the core in the job lane, write
their answers in input order, checkpoint.

    Jobs.run ──claim──▶ JobRun (one per running job; at most one per model)
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
written after it are answered again), a cancel (it keeps the lines answered without a gap).

Shared jobs (a store with `shared`): only jobs of models this replica can run now
(loaded, a live worker serving them) are claimed; one whose model goes away after
its claim, or whose workers are gone for NOT_READY_S, is given back (queued,
fenced), never failed for it. One server (SQLite) claims no job of a model still
loading or that failed to load (it waits queued), and fails a job of a model it
does not have: no other server would run it. A stop gives claimed jobs back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from batchd.protos.model_config import ModelConfig
from batchd.server.config import Limits
from batchd.server.errors import Unavailable
from batchd.server.jobs.chunks import Chunk, JobFailed, ModelGone, Reader, encode, job_model
from batchd.server.jobs.store import STATUSES, JobRow, LeaseLost, Progress, Results, Store, pace
from batchd.server.request import Request, Tensor

log = logging.getLogger("batchd.jobs")
DEPTH = 4  # chunks in the core at once
CHECKPOINT_S = 1.0
CHECKPOINT_BYTES = 16 * 1024 * 1024  # results written since the last checkpoint, at most
POLL_S = 1.0  # how often the runner looks for queued jobs another frontend took in
NOT_READY_S = 3.0  # shared: a running job's model without a live worker this long: given back
STOP_S = 30.0  # a stop waits this long, at most, for its jobs to be given back
EXPIRE_EVERY_S = 60.0


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
        except Exception as e:  # its end was not written (a full disk): the server lives
            log.error("job %s: its end (%s) could not be recorded (%s: %s); it runs on from its "
                      "last checkpoint at the next start", row.id, status, type(e).__name__, e,
                      extra={"job": row.id, "model": row.model})  # fmt: skip
            return
        log.info(
            "job %s %s: %d answered, %d failed%s", row.id, status, self.completed, self.failed,
            f" ({error})" if error else "", extra={"job": row.id, "model": row.model},
        )  # fmt: skip

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
        except Exception as e:  # a bug or a disk error: the job fails, the server lives
            log.exception("job %s failed", self.row.id)
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
                elif await self._store.renew(self.row) == "cancelling":
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

    async def _checkpoint(self, out: Results) -> None:
        """The results made durable, then the offsets that cover them (store.py)."""
        done = self._done
        status = await self._store.checkpoint(self.row, out, done)
        self._saved, self._saved_at = done, time.monotonic()
        if status == "cancelling":  # another frontend's or replica's cancel
            self.cancel()


class Jobs:
    """This server's jobs: the store and (where jobs run) the runner, in order, one a model."""

    def __init__(self, store: Store, core: JobCore, limits: Limits, *, max_file_bytes: int,
                 max_open: int, retention_s: float, min_upload_rate: int, upload_grace_s: float,
                 runs: bool = True, max_kept: int = sys.maxsize) -> None:  # fmt: skip
        # A line's results go to a file, never a response: no response limit refuses it.
        self._limits = dataclasses.replace(limits, max_response_bytes=sys.maxsize)
        self.store, self._core = store, core
        self.max_file_bytes, self.max_open, self.retention_s = max_file_bytes, max_open, retention_s
        self.max_kept = max_kept  # ended jobs kept per owner (--jobs-max-kept)
        self.min_upload_rate, self.upload_grace_s = min_upload_rate, upload_grace_s  # 0: off
        self.runs = runs  # False in frontends 1..N-1: they take jobs in and answer about them
        self.running: dict[str, JobRun] = {}
        self.uploads: dict[str, Callable[[], None]] = {}  # taken in here: a call stops one
        self.answered: dict[tuple[str, str], int] = {}  # (model, "completed" | "failed")
        self.counts: dict[str, int] = {}  # jobs by status, as count_statuses() last read them
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._claiming: asyncio.Future[JobRow | None] | None = None  # a claim in flight
        self.stopping, self.taking_uploads = False, True  # uploads: till the drain notice ends

    def wake(self) -> None:
        self._wake.set()

    async def cancel(self, job_id: str) -> None:
        await self.store.cancel(job_id)
        stop = self.uploads.get(job_id)
        if stop is not None:  # an upload to this process stops now, not at its next look
            stop()
        run = self.running.get(job_id)
        if run is not None:
            run.cancel()

    def _count(self, model: str, ok: int, failed: int) -> None:
        for outcome, n in (("completed", ok), ("failed", failed)):
            self.answered[model, outcome] = self.answered.get((model, outcome), 0) + n

    @property
    def models(self) -> Mapping[str, ModelConfig]:
        return self._core.models

    async def run(self) -> None:
        """Run queued jobs until stop(); the interrupted ones first (store.recover)."""
        if not self.runs:
            return
        recovered, expired_at = False, -math.inf
        while not self.stopping:
            try:
                if not recovered:  # (a database down at the start is waited for too)
                    for job_id in await self.store.recover():
                        log.warning("job %s: its upload was cut short by a restart; removed",
                                    job_id)  # fmt: skip
                    recovered = True
                if time.monotonic() - expired_at > EXPIRE_EVERY_S:
                    expired_at = time.monotonic()
                    for job_id in await self.store.expire(self.retention_s):
                        log.info("job %s: past its retention, or an upload cut; removed", job_id)
                self._claiming = asyncio.ensure_future(self._claim())
                row = await asyncio.shield(self._claiming)  # a stop waits for it
            except Unavailable as e:  # the jobs database is down: online traffic goes on
                log.warning("batch jobs wait: %s", e)
                row = None
            except Exception as e:  # the store failed otherwise (a full disk): so it does
                log.error("batch jobs wait: the jobs store failed: %s: %s", type(e).__name__, e)
                row = None
            if row is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_S)
                continue
            if self.stopping:  # stop() came during the claim: it gives the job back
                break
            log.info("job %s of model %s: running from line %d", row.id, row.model,
                     row.lines_read + 1, extra={"job": row.id, "model": row.model})  # fmt: skip
            run = JobRun(row, self.store, self._core, self._limits, self._count)
            self.running[row.id] = run
            task = asyncio.create_task(run.run(), name=f"job {row.id}")
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._ended, row.id))

    async def _claim(self) -> JobRow | None:
        """The next job this server can run now (module docstring), claimed."""
        busy = frozenset(r.row.model for r in self.running.values())
        ready = {n for n in self._core.models if self._core.model_ready(n)}
        if self.store.shared:
            return await self.store.claim(busy, only=ready)
        return await self.store.claim(busy | (self._core.models.keys() - ready))

    async def stop(self, timeout_s: float = STOP_S, notice_s: float = 0.0) -> None:
        """Stop jobs where they are (they go on from a checkpoint, here or elsewhere), a claim
        in flight too; take uploads `notice_s` more, then let those under way end. `timeout_s`."""
        self.stopping, self.taking_uploads = True, self.taking_uploads and notice_s > 0
        self._wake.set()
        until = time.monotonic() + timeout_s  # uploads taken: the notice, at most half of it all
        asyncio.get_running_loop().call_later(min(notice_s, timeout_s / 2), self.no_uploads)
        claiming = self._claiming
        if claiming is not None:
            await asyncio.wait([claiming], timeout=timeout_s)
            row = claiming.result() if claiming.done() and not claiming.exception() else None
            if row is not None and row.id not in self.running and self.store.shared:
                progress = Progress(row.input_offset, row.lines_read, row.completed, row.failed)
                out = self.store.open_results(row)
                with contextlib.suppress(asyncio.TimeoutError, LeaseLost, Unavailable):
                    await asyncio.wait_for(self.store.release(row, out, progress),
                                           max(0.0, until - time.monotonic()))  # fmt: skip
                log.info("job %s: claimed as the server stopped; given back", row.id)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=max(0.0, until - time.monotonic()))
        while self.uploads and (left := until - time.monotonic()) > 0:
            self._wake.clear()  # (an upload that ends wakes it: service.py)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def no_uploads(self) -> None:  # (at the notice's end, or when a SIGINT ends it)
        if self.taking_uploads:
            self.taking_uploads = False
            log.info("the drain notice is over: new job uploads are refused")

    async def count_statuses(self) -> None:
        """Read the jobs by status, before each scrape; a database that fails keeps the last."""
        try:
            self.counts = await self.store.by_status()
        except Unavailable as e:
            log.warning("batch jobs metrics: %s", e)

    def _ended(self, job_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.running.pop(job_id, None)
        self._wake.set()

    def collect(self) -> Iterator[Metric]:
        """Prometheus metrics (called on the loop: it reads no store, count_statuses does)."""
        status = GaugeMetricFamily("batchd_jobs", "Batch jobs by status", labels=["status"])
        for name in STATUSES:
            status.add_metric([name], self.counts.get(name, 0))
        yield status
        answered = CounterMetricFamily(
            "batchd_job_requests", "Lines of batch jobs answered, by outcome",
            labels=["model", "outcome"],
        )  # fmt: skip
        for (model, outcome), n in sorted(self.answered.items()):
            answered.add_metric([model, outcome], n)
        yield answered
        rate = GaugeMetricFamily(
            "batchd_job_rows_per_second", "Lines per second of the jobs running", labels=["model"]
        )
        for run in self.running.values():
            rate.add_metric([run.row.model], run.pace(0)[0])
        yield rate
