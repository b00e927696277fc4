"""Client-side errors, one per gRPC status batchd answers with.

BatchdClientError            any failed call; .code is the grpc.StatusCode
├── InvalidInput             INVALID_ARGUMENT   (never worth retrying)
├── ModelNotFound            NOT_FOUND
├── JobNotFound              NOT_FOUND of a call about one job (GetJob, CancelJob, JobResults)
├── ServerBusy               RESOURCE_EXHAUSTED (.retry_after_ms: the pushback trailer, or
│   │                        a stream's error response's `retry_pushback_ms` parameter)
│   └── LimitExceeded        RESOURCE_EXHAUSTED with no pushback: a limit the call passed
├── DeadlineExceeded         DEADLINE_EXCEEDED
├── ServerUnavailable        UNAVAILABLE (.retry_after_ms: a pushback says nothing was done)
├── InferenceFailed          INTERNAL (the model raised)
├── Unauthenticated          UNAUTHENTICATED (no token, or a wrong one)
└── BadResponse              INTERNAL, raised here: the server's answer does not decode

RESOURCE_EXHAUSTED means two things. A server that is busy (batchd: a full queue,
a full decode backlog) says when to come back, with a `grpc-retry-pushback-ms`
trailer; one answering a call that passed a limit (a response over
--max-message-bytes, a job's limits) sends none,
and neither does gRPC for a message over this client's own max_message_bytes. The
same call would fail again, after the model ran again: LimitExceeded, never
retried. It stays a ServerBusy so that `except ServerBusy` still catches every
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import grpc


class BatchdClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidInput(BatchdClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(BatchdClientError):
    code = grpc.StatusCode.NOT_FOUND


class JobNotFound(BatchdClientError):
    """No such job (or not this token's): an ended one is dropped after
    --jobs-retention-hours."""

    code = grpc.StatusCode.NOT_FOUND


class ServerBusy(BatchdClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_ms: int | None = None


class LimitExceeded(ServerBusy):
    """RESOURCE_EXHAUSTED without a pushback: the message names the limit."""


class DeadlineExceeded(BatchdClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ServerUnavailable(BatchdClientError):
    code = grpc.StatusCode.UNAVAILABLE
    retry_after_ms: int | None = None  # with a pushback: the server did nothing, send it again
    retry_refused = False  # a pushback that is not a count of ms: gRFC A6, do not retry


class InferenceFailed(BatchdClientError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(BatchdClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


class BadResponse(BatchdClientError):
    """The server's answer does not decode (a shape its data cannot fill, an unknown
    datatype, outputs and contents that do not pair): not batchd, or a defect."""

    code = grpc.StatusCode.INTERNAL


UNDECODABLE = "Exception deserializing response!"  # blocking gRPC's INTERNAL for a reply
# that does not parse (grpc.aio's reply is None: client/core.py)

_BY_CODE: dict[grpc.StatusCode, type[BatchdClientError]] = {
    cls.code: cls
    for cls in (
        InvalidInput,
        ModelNotFound,
        ServerBusy,
        DeadlineExceeded,
        ServerUnavailable,
        InferenceFailed,
        Unauthenticated,
    )
}


def from_rpc_error(error: grpc.RpcError, of_job: bool = False) -> BatchdClientError:
    """The typed exception for a failed gRPC call; `of_job`: a call about one job, whose
    NOT_FOUND is the job's (SubmitJob's is its model's)."""
    code = error.code()
    if code == grpc.StatusCode.INTERNAL and error.details() == UNDECODABLE:
        return undecodable()
    cls = JobNotFound if of_job and code == grpc.StatusCode.NOT_FOUND else _BY_CODE.get(code)
    cls = cls or BatchdClientError
    if cls is ServerUnavailable:
        down = ServerUnavailable(error.details() or "", code)
        down.retry_after_ms = _pushback_ms(error)
        down.retry_refused = down.retry_after_ms is None and _pushback_said(error)
        return down
    if cls is not ServerBusy:
        return cls(error.details() or "", code)
    pushback = _pushback_ms(error)
    if pushback is None:
        return LimitExceeded(error.details() or "", code)
    busy = ServerBusy(error.details() or "", code)
    busy.retry_after_ms = pushback
    return busy


def undecodable() -> BadResponse:
    """A reply that does not parse: blocking gRPC's INTERNAL UNDECODABLE, grpc.aio's None."""
    return BadResponse(f"the answer does not parse as the message expected ({UNDECODABLE})")


def _pushback_ms(error: grpc.RpcError) -> int | None:
    """The `grpc-retry-pushback-ms` trailer; None when absent or not a count of
    milliseconds (gRFC A6: a negative or malformed pushback means do not retry). Over
    12 digits (31 years) is malformed too: int() of a few thousand raises ValueError."""
    for key, value in error.trailing_metadata() or ():
        text = str(value)
        if key == "grpc-retry-pushback-ms" and text.isascii() and text.isdigit():
            return int(text) if len(text) <= 12 else None
    return None


def _pushback_said(error: grpc.RpcError) -> bool:
    return any(key == "grpc-retry-pushback-ms" for key, _ in error.trailing_metadata() or ())


def from_status_name(name: str, message: str, pushback: int | None = None) -> BatchdClientError:
    """The typed exception for a failure that arrived as text in a response (a stream's
    `error_message`) with the name of its gRPC status, e.g. "RESOURCE_EXHAUSTED", and
    the pushback its response carried, read as a unary call's trailer is (a negative
    one: none); InferenceFailed when the name is empty or names no failure status."""
    code = grpc.StatusCode.__members__.get(name.upper())
    if code is None or code == grpc.StatusCode.OK:
        return InferenceFailed(message)
    refused = pushback is not None and not 0 <= pushback < 10**12  # (gRFC A6: do not retry)
    pushback = None if refused else pushback
    cls = _BY_CODE.get(code, BatchdClientError)
    if cls is ServerBusy and pushback is None:
        cls = LimitExceeded  # as a unary call's RESOURCE_EXHAUSTED with no pushback
    error = cls(message, code)
    if isinstance(error, ServerBusy | ServerUnavailable):
        error.retry_after_ms = pushback
    if isinstance(error, ServerUnavailable):  # (as a unary call's)
        error.retry_refused = refused
    return error
