"""Client-side errors, one per gRPC status batchd answers with.

BatchdClientError            any failed call; .code is the grpc.StatusCode
├── InvalidInput             INVALID_ARGUMENT   (never worth retrying)
├── ModelNotFound            NOT_FOUND
├── ServerBusy               RESOURCE_EXHAUSTED (.retry_after_ms from the pushback trailer)
├── DeadlineExceeded         DEADLINE_EXCEEDED
├── ServerUnavailable        UNAVAILABLE
├── InferenceFailed          INTERNAL (the model raised)
└── Unauthenticated          UNAUTHENTICATED (no token, or a wrong one)
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


class ServerBusy(BatchdClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_ms: int | None = None


class DeadlineExceeded(BatchdClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ServerUnavailable(BatchdClientError):
    code = grpc.StatusCode.UNAVAILABLE


class InferenceFailed(BatchdClientError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(BatchdClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


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


def from_rpc_error(error: grpc.RpcError) -> BatchdClientError:
    """The typed exception for a failed gRPC call."""
    code = error.code()
    cls = _BY_CODE.get(code, BatchdClientError)
    exc = cls(error.details() or "", code)
    if isinstance(exc, ServerBusy):
        for key, value in error.trailing_metadata() or ():
            if key == "grpc-retry-pushback-ms" and str(value).isdigit():
                exc.retry_after_ms = int(value)
    return exc


def from_status_name(name: str, message: str) -> BatchdClientError:
    """The typed exception for a failure that arrived as text in a response (a stream's
    `error_message`) with the name of its gRPC status, e.g. "RESOURCE_EXHAUSTED";
    InferenceFailed when the name is empty or names no failure status."""
    code = grpc.StatusCode.__members__.get(name.upper())
    if code is None or code == grpc.StatusCode.OK:
        return InferenceFailed(message)
    return _BY_CODE.get(code, BatchdClientError)(message, code)
