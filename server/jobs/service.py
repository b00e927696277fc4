"""The gRPC edge of jobs: `batchd.jobs.v1.Jobs` (protos/jobs.proto).

A job belongs to the token that submitted it (a digest of it is kept, never the
token): another infer token gets NOT_FOUND for it, exactly as for a job that does
not exist, and an admin token sees and cancels every job. Without
--auth-token-file there is one owner. An upload (upload.py) is on disk and
checked before its job is queued.

An upload holds a --jobs-max-open place, so it must keep up --jobs-min-upload-rate
(upload_deadline): one that falls behind, pieces coming or not, ends
RESOURCE_EXHAUSTED. A cancel ends it CANCELLED: at once when it comes to this
process, else when the upload next looks at its row (store.renew_every_s). Either
way the job and its files are removed.

A submission may carry an idempotency key: sent again with the same key (by the
same token) it answers the job the first made, once that one was queued, and
reads no more of its upload; two sent at once make one job (store.queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from batchd.protos import jobs_pb2 as pb
from batchd.protos import jobs_pb2_grpc as pb_grpc
from batchd.server.auth import ADMIN, Tokens, bearer
from batchd.server.errors import (
    InvalidInput,
    LimitExceeded,
    ModelNotFound,
    NotAllowed,
    Refused,
    Unavailable,
    clip,
    grpc_status,
)
from batchd.server.jobs.chunks import JobFailed, NotOneShot, job_model
from batchd.server.jobs.runner import Jobs
from batchd.server.jobs.store import MAX_KEY_CHARS, OPEN, STATUSES, JobRow, Submitted, pace
from batchd.server.jobs.upload import Upload, upload_stopped

log = logging.getLogger("batchd.jobs")
Caller = tuple[str, bool]  # (owner: a digest of the token, sees every job: an admin token)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # (lone surrogates: bytes that were not UTF-8)
        return False
    return True


async def _settled(jobs: Jobs, job_id: str) -> None:
    """The job's commit made durable before it is answered. An fsync that fails leaves it
    queued, and answered so: an error would have its submitter send it again, a second."""
    try:
        await jobs.store.settle()
    except OSError as e:
        log.warning("job %s: queued, but its commit may not outlive a power loss (%s: %s)",
                    job_id, type(e).__name__, e, extra={"job": job_id})  # fmt: skip


def _check_model(jobs: Jobs, model_name: str, model_version: str) -> None:
    """InvalidInput or ModelNotFound unless a job may name this model and version."""
    if not model_name:
        raise InvalidInput("a job must name its model (gRPC: model_name; HTTP: ?model=NAME)")
    try:
        job_model(jobs.models, model_name, model_version)
    except NotOneShot as e:  # (it was NOT_FOUND: the model is there)
        raise InvalidInput(f"{e}") from None
    except JobFailed as e:
        raise ModelNotFound(f"{e}") from None


class JobsService(pb_grpc.JobsServicer):
    def __init__(self, jobs: Jobs | None, off: str = "", tokens: Tokens | None = None,
                 max_message_bytes: int = 1 << 30) -> None:  # fmt: skip
        self._jobs = jobs
        self._off = off  # why jobs are off, when they are
        self._tokens = tokens
        # A JobResults piece's data at most (--max-message-bytes, less the chunk's own):
        # the store reads 1 MiB pieces, which a server of 256 KiB could never send.
        self._piece = max(1, max_message_bytes - 64)

    @property
    def max_file_bytes(self) -> float:
        """The largest job file taken (--jobs-max-file-bytes; none while jobs are off)."""
        return math.inf if self._jobs is None else self._jobs.max_file_bytes

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

    async def _same(self, caller: Caller, job_id: str, key: str, model: str, version: str,
                    ) -> pb.Job:  # fmt: skip
        """The job an idempotency key made, as it is now (what is left of the upload is
        not read): the same submission's, or refused if it named another model."""
        row = await self._job(job_id, caller)
        if (row.model, row.version) != (model, version):
            raise InvalidInput(
                f"idempotency key {clip(key)} made job {row.id} of model {row.model!r} version "
                f"{row.version!r}, not of {clip(model)} {clip(version)}: use a new key"
            )
        return self._message(row)

    def _message(self, row: JobRow) -> pb.Job:
        # The counts are the row's, its last checkpoint's: durable, so they never go back
        # (lines written since, or answered ahead of one still out, may be dropped).
        jobs = self._on()
        run = jobs.running.get(row.id)
        rate, eta = 0.0, 0.0 if row.ended else -1.0  # (an ended job's runner may linger)
        if run is not None and not row.ended:
            rate, eta = run.pace(row.total - row.done)
        elif row.status == "running" and row.resumed_at:  # run by another frontend
            since, remaining = (row.resumed_at, row.resumed_done), row.total - row.done
            rate, eta = pace(row.done, remaining, since, row.checkpointed_at, time.time())
        return pb.Job(
            id=row.id, model_name=row.model, model_version=row.version, status=row.status,
            total=row.total, completed=row.completed, failed=row.failed, created_at=row.created_at,
            started_at=row.started_at, finished_at=row.finished_at, rows_per_second=rate,
            eta_seconds=eta, error=row.error, input_bytes=row.input_bytes,
            results_bytes=row.results_bytes,
        )  # fmt: skip

    # ---- what gRPC (below) and HTTP (http.py) call ----

    async def submit(self, caller: Caller, model_name: str, model_version: str,
                     pieces: AsyncIterator[bytes], key: str = "") -> pb.Job:  # fmt: skip
        """A job from its file's `pieces`, once the whole file is on disk and checked; the
        job an earlier submission with idempotency `key` made, if one did (store.queue)."""
        jobs = self._on()
        if len(key) > MAX_KEY_CHARS:
            raise InvalidInput(f"an idempotency key has at most {MAX_KEY_CHARS} characters, "
                               f"got {len(key)}: {clip(key)}")  # fmt: skip
        if not key.isascii() and not _utf8(key):  # (an HTTP header's bytes came as they were)
            raise InvalidInput(f"an idempotency key is UTF-8 text, got {clip(key)}")
        if key and (made := await jobs.store.keyed(caller[0], key)) is not None:
            return await self._same(caller, made, key, model_name, model_version)
        if not jobs.taking_uploads:  # (uploads under way may end: runner.Jobs.stop)
            log.info("new job upload refused: this server is stopping")
            raise Refused("this server is stopping: submit the job again, to another replica")
        _check_model(jobs, model_name, model_version)
        if (n := await jobs.store.count(OPEN)) >= jobs.max_open:
            raise LimitExceeded(
                f"{n} jobs are open, the most this server keeps (--jobs-max-open "
                f"{jobs.max_open}); wait for one to end or cancel one"
            )
        row = await jobs.store.create(caller[0], model_name, model_version)
        upload = Upload(jobs, row.id)
        jobs.uploads[row.id] = upload.cancel
        watching, queued = asyncio.create_task(self._watching(jobs, upload)), False
        try:
            size, total = await upload.take(pieces)
            if not await jobs.store.queue(row.id, total, size, key):  # cancelled meanwhile
                now = await jobs.store.get(row.id)
                raise upload_stopped(row.id, "" if now is None else now.status)
            queued = True  # whatever comes now: not removed as an upload cut short
            await _settled(jobs, row.id)
        except Submitted as same:  # sent twice at once: the first to be queued is the job
            await asyncio.shield(jobs.store.delete(row.id))
            return await self._same(caller, same.job_id, key, model_name, model_version)
        except BaseException:
            if not queued:
                await asyncio.shield(jobs.store.delete(row.id))
            raise
        finally:
            watching.cancel()
            jobs.uploads.pop(row.id, None)
            jobs.wake()  # (a stop waits for the uploads under way)
        jobs.wake()
        await self._trim(jobs, caller[0])
        return self._message(await self._job(row.id, caller))

    @staticmethod
    async def _trim(jobs: Jobs, owner: str) -> None:
        """--jobs-max-kept: the token's oldest ended jobs past it go, at its submission. Its
        job is queued by then: a trim that fails is logged, never the submission's answer."""
        try:
            gone = await jobs.store.trim(owner, jobs.max_kept)
        except Exception as e:  # (a 503 made a client without a key submit the job twice)
            log.warning("trimming a token's ended jobs to --jobs-max-kept failed: %s", e)
            return
        for job_id in gone:
            log.info("job %s: past its token's --jobs-max-kept; removed", job_id)

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

            caller, key = self._caller(context), first.idempotency_key
            return await self.submit(caller, first.model_name, first.model_version, pieces(), key)
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
                for at in range(0, len(data), most := self._piece):
                    yield pb.JobResultsChunk(
                        data=data if len(data) <= most else data[at : at + most]
                    )
