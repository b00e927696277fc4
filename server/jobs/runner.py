"""Running jobs: the runner claims queued jobs, one a model, and runs each (run.JobRun).

    Jobs.run ──claim──▶ JobRun (one per running job; at most one per model)

Shared jobs (a store with `shared`): only jobs of models this replica can run now
(loaded, a live worker serving them) are claimed; one whose model goes away after
its claim, or whose workers are gone for NOT_READY_S, is given back (queued,
fenced), never failed for it. One server (SQLite) claims no job of a model still
loading or that failed to load (it waits queued), and fails a job of a model it
does not have: no other server would run it. A stop gives claimed jobs back. A run
this server's storage stopped (Stalled) is queued again, and no job is claimed for a
while (REST_S, doubled at each, REST_MOST_S at most): a full disk is not spun on.
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
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from batchd.protos.model_config import ModelConfig
from batchd.server.config import Limits
from batchd.server.errors import Unavailable
from batchd.server.jobs.run import JobCore, JobRun
from batchd.server.jobs.store import STATUSES, JobRow, LeaseLost, Progress, Store

log = logging.getLogger("batchd.jobs")
POLL_S = 1.0  # how often the runner looks for queued jobs another frontend took in
STOP_S = 30.0  # a stop waits this long, at most, for its jobs to be given back
EXPIRE_EVERY_S = 60.0
REST_S, REST_MOST_S = 5.0, 300.0  # no claim after a Stalled run: this long, doubled each time


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
        self._stalled: dict[str, tuple[JobRow, str]] = {}  # Stalled runs not queued again
        # (the store failed) and why they stopped
        self._rest_until, self._rest_s = -math.inf, REST_S  # (monotonic) no claim till then
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
                row = None
                if time.monotonic() >= self._rest_until:
                    await self._requeue_stalled()
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

    async def _requeue_stalled(self) -> None:
        """The Stalled runs the store would not queue again then: now, once it does."""
        for job_id, (row, why) in sorted(self._stalled.items()):
            try:
                await self.store.requeue(row, why)
            except Exception:
                self._rest()
                raise
            del self._stalled[job_id]

    def _rest(self) -> None:
        self._rest_until, self._rest_s = time.monotonic() + self._rest_s, min(
            2 * self._rest_s, REST_MOST_S)  # fmt: skip

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
        run = self.running.pop(job_id, None)
        if run is not None and run.stalled:  # its storage failed: the next claim waits
            self._rest()
            if not run.requeued:
                self._stalled[job_id] = run.row, run.why
        elif run is not None and not run.cancelling:
            self._rest_s = REST_S
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
