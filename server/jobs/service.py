"""The gRPC edge of jobs: `batchd.jobs.v1.Jobs` (protos/jobs.proto).

A job belongs to the token that submitted it (a digest of it is kept, never the
token): another infer token gets NOT_FOUND for it, exactly as for a job that does
not exist, and an admin token sees and cancels every job. Without
--auth-token-file there is one owner. The upload is written to disk as it comes,
bounded by --jobs-max-file-bytes; once it is whole its custom_ids are checked for
duplicates on a thread against a scratch SQLite table on disk, so neither the
upload nor the check holds the file in memory.

An upload holds a --jobs-max-open place, so it must keep up --jobs-min-upload-rate
(upload_deadline): one that falls behind, pieces coming or not, ends
RESOURCE_EXHAUSTED. A cancel ends it CANCELLED: at once when it comes to this
process, else when the upload next looks at its row (store.renew_every_s). Either
way the job and its files are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from batchd.protos import jobs_pb2 as pb
from batchd.protos import jobs_pb2_grpc as pb_grpc
from batchd.server.auth import ADMIN, Tokens, bearer
from batchd.server.errors import (
    BatchdError,
    Cancelled,
    InvalidInput,
    LimitExceeded,
    ModelNotFound,
    NotAllowed,
    Refused,
    Unavailable,
    clip,
    grpc_status,
)
from batchd.server.jobs import lines
from batchd.server.jobs.runner import JobFailed, Jobs, job_model
from batchd.server.jobs.store import OPEN, STATUSES, JobRow

log = logging.getLogger("batchd.jobs")
SHOWN_DUPLICATES = 5  # custom_ids named in a duplicates error ...
SHOWN_LINES = 4  # ... and line numbers for each
MIN_FREE_BYTES = 256 * 1024 * 1024  # an upload stops before the jobs disk has less free


def _first_lines(db: sqlite3.Connection, cid: str, count: int) -> str:
    """The first SHOWN_LINES line numbers of `cid` (of its `count`): a message stays short
    whatever the file repeats."""
    found = db.execute(
        f"SELECT line FROM ids WHERE cid = ? ORDER BY line LIMIT {SHOWN_LINES}", (cid,)
    )
    at = ", ".join(str(n) for (n,) in found)
    return at if count <= SHOWN_LINES else f"{at}, ... ({count} lines)"


def check_ids(path: Path, scratch: Path) -> int:
    """The number of request lines in the job file at `path`; InvalidInput naming the
    lines of duplicate custom_ids. Runs on a thread; memory does not grow with the file."""
    total = 0
    db = sqlite3.connect(scratch)
    try:
        db.execute("CREATE TABLE ids (cid TEXT, line INTEGER)")
        batch: list[tuple[str, int]] = []
        with path.open("rb") as f:
            number = 0
            while True:
                raw, length, too_long = lines.read_line(f)
                if not length:
                    break
                number += 1
                if too_long:  # blank or not: it becomes an error line when the job runs
                    total += 1
                    continue
                if not raw.strip():
                    continue
                total += 1
                try:
                    batch.append((lines.custom_id_of(lines.load(raw)), number))
                except ValueError:
                    continue  # so does this one
                if len(batch) >= 10_000:
                    db.executemany("INSERT INTO ids VALUES (?, ?)", batch)
                    batch.clear()
        db.executemany("INSERT INTO ids VALUES (?, ?)", batch)
        twice = db.execute(
            "SELECT cid, count(*) FROM ids GROUP BY cid HAVING count(*) > 1 "
            f"ORDER BY min(line) LIMIT {SHOWN_DUPLICATES + 1}"
        ).fetchall()
        shown = "; ".join(
            f"{clip(cid)} on lines {_first_lines(db, cid, n)}"
            for cid, n in twice[:SHOWN_DUPLICATES]
        )
    finally:
        db.close()
        scratch.unlink(missing_ok=True)
    if twice:
        more = " (and more)" if len(twice) > SHOWN_DUPLICATES else ""
        raise InvalidInput(f"duplicate custom_id: {shown}{more}; each must be unique")
    return total


def upload_deadline(started: float, received: int, min_rate: int, grace_s: float) -> float:
    """When an upload that began at `started` and has `received` bytes falls behind
    `min_rate` bytes/s (--jobs-min-upload-rate; 0: never): after a head start of
    `grace_s` it must have sent `min_rate` bytes for every second since it began. The
    head start is also the allowance of the piece on its way: a piece counts once it has
    all come (gRPC reads whole messages), so a client sending pieces of up to
    min_rate x grace_s bytes is never cut while it keeps up the rate."""
    if min_rate <= 0:
        return math.inf
    return started + grace_s + received / min_rate


def upload_stopped(job_id: str, status: str) -> BatchdError:
    """Why an upload stops whose job is no longer `validating` (its status now)."""
    if status == "cancelled":
        return Cancelled(f"job {job_id} was cancelled while it was uploading; none of it is kept")
    return Unavailable(
        f"job {job_id} was removed while it was uploading (taken for dead: this server did "
        "not renew it within --jobs-lease); submit it again"
    )


class Upload:
    """One upload taken in by this process, under a deadline that moves: after each
    piece, to upload_deadline; to now when it is stopped (a cancel). The check of its
    ids runs under it too, with no rate: a cancel stops that as well."""

    def __init__(self, jobs: Jobs, job_id: str) -> None:
        self._jobs, self.job_id = jobs, job_id
        self.size = 0
        self._why: BatchdError | None = None  # it was stopped: the error it ends with
        self._timeout: asyncio.Timeout | None = None  # while pieces come or the ids are checked

    def stop(self, why: BatchdError) -> None:
        self._why = self._why or why
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())

    def cancel(self) -> None:
        self.stop(upload_stopped(self.job_id, "cancelled"))

    async def take(self, pieces: AsyncIterator[bytes]) -> tuple[int, int]:
        """(bytes, request lines) of the job file from `pieces`, on disk and checked."""
        jobs, path = self._jobs, self._jobs.store.upload_path(self.job_id)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(None) as self._timeout:
                self._reschedule(started)
                with path.open("wb") as f:
                    async for data in pieces:
                        self._write(f.name, data)
                        f.write(data)
                        self._reschedule(started)
                if self._why is None:  # the check: no rate, but a cancel still stops it
                    self._timeout.reschedule(None)
                scratch = jobs.store.folder(self.job_id) / "ids.sqlite"
                total = await asyncio.to_thread(check_ids, path, scratch)
        except TimeoutError:
            if self._timeout is None or not self._timeout.expired():
                raise  # not ours: an HTTP piece later than --handshake-timeout
            error = self._why or self._too_slow(loop.time() - started)
            log.info("job %s: upload stopped: %s", self.job_id, error.message,
                     extra={"job": self.job_id})  # fmt: skip
            raise error from None
        finally:
            self._timeout = None
        return self.size, total

    def _reschedule(self, started: float) -> None:
        assert self._timeout is not None
        if self._why is not None:
            return  # stopped: it expires now
        jobs = self._jobs
        when = upload_deadline(started, self.size, jobs.min_upload_rate, jobs.upload_grace_s)
        self._timeout.reschedule(None if when == math.inf else when)

    def _write(self, name: str, data: bytes) -> None:
        """Count `data` in; LimitExceeded if it makes the file or the disk too full."""
        jobs = self._jobs
        self.size += len(data)
        if self.size > jobs.max_file_bytes:
            raise LimitExceeded(
                f"the job file is over {jobs.max_file_bytes} bytes "
                "(--jobs-max-file-bytes); split it into several jobs"
            )
        if shutil.disk_usage(name).free - len(data) < MIN_FREE_BYTES:
            raise LimitExceeded(
                f"the disk of --jobs-dir would have less than {MIN_FREE_BYTES >> 20} MiB "
                "free; remove ended jobs or give the server more room"
            )

    def _too_slow(self, elapsed: float) -> LimitExceeded:
        jobs = self._jobs
        return LimitExceeded(
            f"the upload averaged {self.size / max(elapsed, 1e-3):.1f} B/s over {elapsed:.1f} s, "
            f"under --jobs-min-upload-rate {jobs.min_upload_rate} (after --jobs-upload-grace "
            f"{jobs.upload_grace_s:g}); send it faster, with the whole file ready before it starts"
        )


Caller = tuple[str, bool]  # (owner: a digest of the token, sees every job: an admin token)


class JobsService(pb_grpc.JobsServicer):
    def __init__(self, jobs: Jobs | None, off: str = "", tokens: Tokens | None = None) -> None:
        self._jobs = jobs
        self._off = off  # why jobs are off, when they are
        self._tokens = tokens

    def _on(self) -> Jobs:
        if self._jobs is None:
            raise NotAllowed(f"batch jobs are off in this server: {self._off}")
        return self._jobs

    def caller(self, token: bytes | None) -> Caller:
        """(owner, sees every job) of a caller with this bearer token (HTTP or gRPC)."""
        if self._tokens is None:
            return "", True
        token = token or b""
        return hashlib.sha256(token).hexdigest()[:32], self._tokens.allows(ADMIN, token)

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        return self.caller(bearer(context.invocation_metadata()))

    async def _job(self, job_id: str, caller: Caller) -> JobRow:
        row = await self._on().store.get(job_id)
        owner, every = caller
        if row is None or not (every or row.owner == owner):
            raise ModelNotFound(f"no job {clip(job_id)}")
        return row

    def _message(self, row: JobRow) -> pb.Job:
        jobs = self._on()
        run = jobs.running.get(row.id)
        done, completed, failed = row.done, row.completed, row.failed
        rate = 0.0
        if run is not None:
            completed, failed, rate = run.completed, run.failed, run.rate
            done = completed + failed
        elif row.status == "running" and row.resumed_at:  # run by another frontend
            rate = (row.done - row.resumed_done) / max(time.time() - row.resumed_at, 1e-3)
        eta = (row.total - done) / rate if rate > 0 else (0.0 if row.ended else -1.0)
        return pb.Job(
            id=row.id, model_name=row.model, model_version=row.version, status=row.status,
            total=row.total, completed=completed, failed=failed, created_at=row.created_at,
            started_at=row.started_at, finished_at=row.finished_at, rows_per_second=rate,
            eta_seconds=eta, error=row.error, input_bytes=row.input_bytes,
            results_bytes=row.results_bytes,
        )  # fmt: skip

    # ---- what gRPC (below) and HTTP (http.py) call ----

    async def submit(
        self, caller: Caller, model_name: str, model_version: str, pieces: AsyncIterator[bytes]
    ) -> pb.Job:
        """A job from its file's `pieces`, once the whole file is on disk and checked."""
        jobs = self._on()
        if not jobs.taking_uploads:  # (uploads under way may end: runner.Jobs.stop)
            log.info("new job upload refused: this server is stopping")
            raise Refused("this server is stopping: submit the job again, to another replica")
        if not model_name:
            raise InvalidInput("a job must name its model (model_name)")
        try:
            job_model(jobs.models, model_name, model_version)
        except JobFailed as e:
            raise ModelNotFound(f"{e}") from None
        if (n := await jobs.store.count(OPEN)) >= jobs.max_open:
            raise LimitExceeded(
                f"{n} jobs are open, the most this server keeps (--jobs-max-open "
                f"{jobs.max_open}); wait for one to end or cancel one"
            )
        row = await jobs.store.create(caller[0], model_name, model_version)
        upload = Upload(jobs, row.id)
        jobs.uploads[row.id] = upload.cancel
        watching = asyncio.create_task(self._watching(jobs, upload))
        try:
            size, total = await upload.take(pieces)
            if not await jobs.store.queue(row.id, total, size):  # cancelled meanwhile
                now = await jobs.store.get(row.id)
                raise upload_stopped(row.id, "" if now is None else now.status)
        except BaseException:
            await asyncio.shield(jobs.store.delete(row.id))
            raise
        finally:
            watching.cancel()
            jobs.uploads.pop(row.id, None)
            jobs.wake()  # (a stop waits for the uploads under way)
        jobs.wake()
        return self._message(await self._job(row.id, caller))

    @staticmethod
    async def _watching(jobs: Jobs, upload: Upload) -> None:
        """Say the upload is alive every renew_every_s until it is queued, whether pieces
        come or not (a client that pauses, the check of a large file): a replica
        removes an upload whose lease ran out (store.py). A job no longer validating
        was cancelled through another frontend or replica: the upload stops."""
        if jobs.store.renew_every_s == math.inf:
            return
        while True:
            await asyncio.sleep(jobs.store.renew_every_s)
            with contextlib.suppress(Unavailable):  # the database is down: the next time
                status = await jobs.store.uploading(upload.job_id)
                if status != "validating":
                    upload.stop(upload_stopped(upload.job_id, status))
                    return

    async def get(self, caller: Caller, job_id: str) -> pb.Job:
        return self._message(await self._job(job_id, caller))

    async def listing(
        self, caller: Caller, status: str = "", limit: int = 0
    ) -> pb.ListJobsResponse:
        jobs = self._on()
        if status and status not in STATUSES:
            raise InvalidInput(
                f"unknown status {clip(status)}; expected one of {', '.join(STATUSES)}"
            )
        if limit < 0:
            raise InvalidInput(f"limit must be 0 (the most, 1000) or more, got {limit}")
        owner, every = caller
        rows = await jobs.store.select(None if every else owner, status, min(limit or 1000, 1000))
        return pb.ListJobsResponse(jobs=[self._message(r) for r in rows])

    async def cancel(self, caller: Caller, job_id: str) -> pb.Job:
        row = await self._job(job_id, caller)
        await self._on().cancel(row.id)
        now = await self._on().store.get(row.id)
        if now is None:  # an upload, cancelled: it went with its upload
            now = dataclasses.replace(row, status="cancelled", finished_at=time.time())
        return self._message(now)

    async def results(self, caller: Caller, job_id: str, offset: int = 0) -> AsyncIterator[bytes]:
        """The results from `offset` to the last checkpoint, in pieces; checked first."""
        row = await self._job(job_id, caller)
        end = row.results_bytes
        if offset > end:
            raise InvalidInput(f"offset {offset} is past the results' {end} bytes")
        return self._on().store.read_results(row.id, offset, end)

    # ---- RPCs ----

    async def SubmitJob(
        self, request_iterator: AsyncIterator[pb.SubmitJobRequest], context: Any
    ) -> pb.Job | None:
        with grpc_status(context):
            first = await anext(aiter(request_iterator), None)
            if first is None or not first.model_name:
                raise InvalidInput("the first SubmitJobRequest must name the model (model_name)")

            async def pieces() -> AsyncIterator[bytes]:
                yield first.data
                async for piece in request_iterator:
                    yield piece.data

            caller = self._caller(context)
            return await self.submit(caller, first.model_name, first.model_version, pieces())
        return None

    async def GetJob(self, request: pb.GetJobRequest, context: Any) -> pb.Job | None:
        with grpc_status(context):
            return await self.get(self._caller(context), request.id)
        return None

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: Any
    ) -> pb.ListJobsResponse | None:
        with grpc_status(context):
            return await self.listing(self._caller(context), request.status, request.limit)
        return None

    async def CancelJob(self, request: pb.CancelJobRequest, context: Any) -> pb.Job | None:
        with grpc_status(context):
            return await self.cancel(self._caller(context), request.id)
        return None

    async def JobResults(
        self, request: pb.JobResultsRequest, context: Any
    ) -> AsyncIterator[pb.JobResultsChunk]:
        with grpc_status(context):
            pieces = await self.results(self._caller(context), request.id, request.offset)
            async for data in pieces:
                yield pb.JobResultsChunk(data=data)
