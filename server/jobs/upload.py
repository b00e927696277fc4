"""One job upload taken in: written to disk as it comes, under --jobs-max-file-bytes,
the jobs disk's room and --jobs-min-upload-rate (upload_deadline), then its
custom_ids checked for duplicates in a process of its own (ids.py), so neither
the upload nor the check holds the file in memory. A cancel stops it at once
(Upload.stop)."""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
from collections.abc import AsyncIterator

from batchd.server.errors import (
    BatchdError,
    Cancelled,
    LimitExceeded,
    Unavailable,
)
from batchd.server.jobs import ids
from batchd.server.jobs.runner import Jobs

log = logging.getLogger("batchd.jobs")
MIN_FREE_BYTES = 256 * 1024 * 1024  # an upload stops before the jobs disk has less free


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
        "not renew its lease in time: --jobs-lease, or 30 s without --jobs-db); submit it "
        "again"
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
                total = await ids.checked(path, scratch)
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
