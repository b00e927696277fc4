"""Batch jobs from the clients: the operations, as steps (client/core.py), and Job.

    with Client("127.0.0.1:8001") as c:
        job = c.submit_job("mlp", "requests.jsonl")   # or an iterable of dict lines
        c.job(job.id).status                           # "queued", "running", ...
        c.jobs()                                       # this token's jobs, newest first
        c.cancel_job(job.id)
        c.job_results(job.id, "results.jsonl")         # the results so far; lines written

A request line: {"custom_id": "...", "inputs": [{"name", "datatype", "shape",
"data"}], "parameters": {...}, "outputs": [{"name": ...}]} (KServe v2 JSON).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import grpc

from batchd.client.core import ClientCore, Steps, Wait
from batchd.client.errors import (
    BadResponse,
    BatchdClientError,
    ServerUnavailable,
    from_rpc_error,
    undecodable,
)
from batchd.protos import jobs_pb2 as pb

# Bytes of the job file per SubmitJobRequest, at most: with the message's own few bytes,
# under the --max-message-bytes of a server set for small requests, down to 256 KiB
# (the file's own size is --jobs-max-file-bytes').
PIECE = 256 * 1024 - 64
_END = object()  # (a source's end)
ENDED = ("completed", "failed", "cancelled")
Source = str | os.PathLike[str] | Iterable[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Job:
    """A job as the server last saw it. Times are Unix seconds (0: not yet)."""

    id: str
    model: str
    version: str
    status: str
    total: int
    completed: int
    failed: int
    created_at: float
    started_at: float
    finished_at: float
    rows_per_second: float
    eta_seconds: float | None  # None: unknown
    error: str
    input_bytes: int
    results_bytes: int

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @staticmethod
    def from_pb(m: pb.Job) -> Job:
        return Job(
            m.id, m.model_name, m.model_version, m.status, m.total, m.completed, m.failed,
            m.created_at, m.started_at, m.finished_at, m.rows_per_second,
            None if m.eta_seconds < 0 else m.eta_seconds, m.error, m.input_bytes,
            m.results_bytes,
        )  # fmt: skip


class _GivenUp(RuntimeError):
    """Raised into gRPC's thread by an upload its caller gave up (its call is cancelled)."""


class _QuietGivenUp(logging.Filter):
    """gRPC logs every exception of a request iterator with a traceback, at ERROR: not
    this one, which is no failure (an AsyncClient.submit_job cancelled)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _GivenUp))


logging.getLogger("grpc._channel").addFilter(_QuietGivenUp())


class _Upload:
    """A job's SubmitJobRequests (an iterator), and the error that ended them early:
    gRPC reads them in its own thread and reports any such error as "Exception
    iterating requests!". A path is opened here, before the call: a missing file fails
    as itself. Once `stop`ped (the caller gave up), no more of the source is read."""

    def __init__(self, model: str, version: str, source: Source, key: str) -> None:
        self.error: Exception | None = None
        self._head = pb.SubmitJobRequest(model_name=model, model_version=version,
                                         idempotency_key=key)  # fmt: skip
        self._file = None
        if isinstance(source, str | os.PathLike):
            self._file = Path(source).open("rb")  # noqa: SIM115 (closed by close())
        self._source, self._stopped = source, False
        self._messages = self._generate()

    def __iter__(self) -> Iterator[pb.SubmitJobRequest]:
        return self

    def __next__(self) -> pb.SubmitJobRequest:
        return next(self._messages)

    def stop(self) -> None:
        self._stopped = True

    def _more(self) -> bool:
        if self._stopped:  # (raised: gRPC cancels the call, never ends the upload as whole)
            raise _GivenUp("the upload was given up")
        return True

    def _generate(self) -> Iterator[pb.SubmitJobRequest]:
        try:
            yield self._head
            if self._file is not None:
                while self._more() and (piece := self._file.read(PIECE)):
                    yield pb.SubmitJobRequest(data=piece)
            else:
                yield from _lines(self._source, self._more)  # type: ignore[arg-type]
        except _GivenUp:
            raise  # (not the upload's error: the server's, if it ended the call, stays it)
        except Exception as e:
            self.error = e
            raise

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _lines(source: Iterable[Mapping[str, Any]], more: Callable[[], bool]
           ) -> Iterator[pb.SubmitJobRequest]:  # fmt: skip
    """`source` as messages of PIECE bytes at most; `more()` before each line is drawn."""
    buffer: list[bytes] = []
    size, lines = 0, iter(source)
    while more() and (line := next(lines, _END)) is not _END:
        encoded = json.dumps(line, separators=(",", ":")).encode() + b"\n"
        buffer.append(encoded)
        size += len(encoded)
        if size >= PIECE:
            data = b"".join(buffer)
            cut = len(data) - len(data) % PIECE
            yield from (pb.SubmitJobRequest(data=data[i : i + PIECE]) for i in range(0, cut, PIECE))
            buffer, size = [data[cut:]], len(data) - cut
    if size:
        yield pb.SubmitJobRequest(data=b"".join(buffer))


def submit_job(
    core: ClientCore, model: str, source: Source, version: str = "", timeout: float | None = None,
    idempotency_key: str | None = None,
) -> Steps[Job]:  # fmt: skip
    """Upload a job: `source` is a JSONL file's path, or an iterable of request lines
    (dicts). Returns once the server has stored and checked it (status "queued");
    duplicate custom_ids raise InvalidInput naming the lines. It goes with an
    idempotency key (a new one unless given): sent again with it, the server answers
    the job it made, never a second. So a path or a sequence of lines, which can be
    sent again, is, up to the client's retries, when the server was unavailable."""
    if isinstance(source, bytes | bytearray | memoryview | Mapping):  # (iterable, but its
        raise TypeError(  # bytes or keys are no request lines)
            f"a job's source is a JSONL file's path or an iterable of request "
            f"lines (dicts), got {type(source).__name__}"
        )
    again = isinstance(source, str | os.PathLike | Sequence)
    key = uuid.uuid4().hex if idempotency_key is None else idempotency_key
    attempt, deadline = 0, core.deadline(timeout)  # one, for every attempt and wait
    while True:
        upload = _Upload(model, version, source, key)
        try:
            reply = yield from core.call_by("SubmitJob", upload, deadline, "jobs")
            return Job.from_pb(reply)
        except BatchdClientError as e:
            if upload.error is not None:  # the lines, not the server: say what broke
                raise upload.error from None
            # The policy's rules (client/retry.py), but an unkeyed upload only where the
            # server's pushback says it kept nothing: one lost after it was kept ran twice.
            pushback = getattr(e, "retry_after_ms", None)
            safe = again and (key or not isinstance(e, ServerUnavailable) or pushback is not None)
            remaining = None if deadline is None else deadline - time.monotonic()
            wait = core.retry.delay(attempt, e, remaining, core.rng) if safe else None
            if wait is None:
                raise
        finally:
            upload.close()
        attempt += 1
        yield Wait(wait)


def job(core: ClientCore, job_id: str) -> Steps[Job]:
    """The job `job_id` now: status, counts, times, rate and ETA."""
    return Job.from_pb(
        (yield from core.call("GetJob", pb.GetJobRequest(id=job_id), service="jobs"))
    )


def jobs(core: ClientCore, status: str = "", limit: int = 0) -> Steps[list[Job]]:
    """This token's jobs (every job for an admin token), newest first; `status` filters,
    `limit` caps the count (0: the server's most, 1,000)."""
    if not 0 <= limit < 1 << 32:  # (protobuf's own message named no field)
        raise ValueError(f"limit is a count of jobs, or 0 for the server's most; got {limit}")
    msg = pb.ListJobsRequest(status=status, limit=limit)
    reply = yield from core.call("ListJobs", msg, service="jobs")
    return [Job.from_pb(j) for j in reply.jobs]


def cancel_job(core: ClientCore, job_id: str) -> Steps[Job]:
    """Stop the job; the results it has are kept. An ended job is left as it is."""
    msg = pb.CancelJobRequest(id=job_id)
    return Job.from_pb((yield from core.call("CancelJob", msg, service="jobs")))


class ResultsFile:
    """Where job_results writes: a path (opened and closed here) or a binary file. A
    path is written whole or not at all: the results go to a file of the download's
    own beside it (.PATH.<random>.partial, made here: a link, FIFO or file another user
    put at a fixed name in a shared folder is never written through), which replaces
    PATH only once every piece came, so a download that fails (the job gone past its
    retention, a lost connection) leaves an earlier copy as it was."""

    writing: ClassVar[set[Path]] = set()  # the .partial files open now (jobs_cli's SIGTERM)

    def __init__(self, out: str | os.PathLike[str] | BinaryIO) -> None:
        self._out, self._mine = out, False
        self._path: Path | None = None
        self._partial: Path | None = None  # (set first: __exit__ removes it once set)
        self.file: BinaryIO
        self.lines = self.size = 0
        self._cut = False  # the last piece ended inside a line

    def _open(self) -> None:
        out = self._out
        if not isinstance(out, str | os.PathLike):
            self.file = out
            return
        path, self._mine = Path(out), True
        if path.exists() and not path.is_file():  # /dev/stdout, a FIFO: written as it is
            self.file = path.open("wb")
            return
        where = path.resolve()  # (a link: where it points)
        if not where.name or where.is_dir():  # ("/missing/..": "/")
            raise IsADirectoryError(21, "a folder, not a file", str(path))
        # (the name cut: a long PATH's would pass the 255 a name may have)
        partial = where.parent / f".{where.name[:200]}.{secrets.token_hex(4)}.partial"
        ResultsFile.writing.add(partial)  # (before it exists: Ctrl-C, SIGTERM remove it)
        self._partial = partial
        self._path = where
        # made here, O_EXCL: nothing another user put in a shared folder is written through;
        # mode 0666 less the umask, as open() makes PATH
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        self.file = os.fdopen(os.open(self._partial, flags, 0o666), "wb")

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.lines += data.count(b"\n")
        self.size += len(data)
        if data:
            self._cut = not data.endswith(b"\n")

    def whole(self) -> int:
        """The lines written, once the results ended: at a line's end, as the server's
        always do (it sends up to a checkpoint); else a proxy or a server cut them short
        and said they were whole, and the file is not put in place."""
        if self._cut:
            raise BadResponse(f"the results ended {self.size} bytes in, inside a line: they "
                              "were cut short (a path is left as it was)")  # fmt: skip
        return self.lines

    def __enter__(self) -> ResultsFile:
        try:
            self._open()
        except BaseException:  # (Ctrl-C, which lands anywhere) leaves no .partial file
            self.__exit__(BaseException)
            raise
        return self

    def __exit__(self, failed: type[BaseException] | None, *exc: object) -> None:
        replaced, partial = False, self._partial
        try:
            if self._mine and hasattr(self, "file"):
                self.file.close()  # (may fail: a full disk)
            if partial is not None and self._path is not None and failed is None:
                os.replace(partial, self._path)
                replaced = True
        finally:  # (what did not replace PATH is not left beside it)
            if partial is not None:
                if not replaced:
                    partial.unlink(missing_ok=True)
                ResultsFile.writing.discard(partial)


def data(piece: Any) -> bytes:
    """A JobResults piece's bytes; BadResponse for one that did not parse (grpc.aio's None)."""
    if piece is None:
        raise undecodable()
    return bytes(piece.data)


class Resume:
    """A download's retries: it asks again from the offset it got to (results only grow,
    so the bytes are the same), with the client's backoff, for as long as `give_up_s`
    passes without a byte got (the client's retries, a count, ran out 0.35 s into a
    server's restart); one that got further starts its backoff and time again."""

    def __init__(self, core: ClientCore, job_id: str, give_up_s: float) -> None:
        self._core, self._job_id, self._give_up_s = core, job_id, give_up_s
        self._attempt, self._had, self._since = 0, 0, time.monotonic()
        self._policy = replace(core.retry, retries=sys.maxsize)

    def call(self, method: Any, offset: int) -> Any:
        """JobResults (blocking or grpc.aio) from `offset`: its pieces."""
        request = pb.JobResultsRequest(id=self._job_id, offset=offset)
        return method(request, **self._core.results_kwargs())

    def wait(self, failure: grpc.RpcError, offset: int) -> float:
        """Seconds to wait before asking again from `offset`, the bytes got so far (the
        time to give up counts from the last: a stream longer than it, cut, was given up
        at once); the client's error when not to."""
        if offset > self._had:
            self._attempt, self._had, self._since = 0, offset, time.monotonic()
        error = from_rpc_error(failure, of_job=True)
        left = self._give_up_s - (time.monotonic() - self._since)
        wait = self._policy.delay(self._attempt, error, left, self._core.rng)
        if wait is None:
            raise error from None
        self._attempt += 1
        return wait
