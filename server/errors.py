"""Every error the frontend answers with, and its gRPC status code.

    BatchdError                  (INTERNAL)
    ├── ModelNotFound            NOT_FOUND
    ├── InvalidInput             INVALID_ARGUMENT
    ├── QueueFull                RESOURCE_EXHAUSTED  + grpc-retry-pushback-ms
    ├── TooManyCalls             RESOURCE_EXHAUSTED  (--max-concurrent-streams) + pushback
    ├── ResponseTooLarge         RESOURCE_EXHAUSTED  (--max-message-bytes, outbound)
    ├── StreamBehind             RESOURCE_EXHAUSTED  (a stream's caller does not read)
    ├── LimitExceeded            RESOURCE_EXHAUSTED  (a job over --jobs-max-* limits)
    ├── DeadlineExceeded         DEADLINE_EXCEEDED
    ├── Unavailable              UNAVAILABLE
    │   └── Refused              UNAVAILABLE  + pushback: nothing done, send it again
    ├── NotAllowed               FAILED_PRECONDITION
    ├── Cancelled                CANCELLED  (a job cancelled while it was uploaded)
    ├── Unauthenticated          UNAUTHENTICATED  (auth.py)
    └── ModelFailed              INTERNAL

The code lives on the class; `grpc_status` turns any BatchdError into the
call's status, in one place, for every RPC, the stream and the token check.
Nothing else in the server names a gRPC status code. HTTP (http.py) answers
with HTTP_STATUS of that same code and the same message: 400 invalid, 404
unknown, 409 cancelled, 429 full (with Retry-After), 503 unavailable (refused:
with Retry-After), 504 deadline.

A message quotes what the client sent through `clip`: a short prefix, never all
of it (a name of megabytes would otherwise come back whole, and past the
client's metadata limit turn into an unrelated error).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from typing import Any

import grpc

CLIP_CHARS = 40  # of a client-supplied string quoted in an error
CLIP_ITEMS = 8  # of a client-supplied list (a shape) quoted in an error


def clip(value: str) -> str:
    """`repr` of a client-supplied string, cut to its first CLIP_CHARS characters."""
    if len(value) <= CLIP_CHARS:
        return repr(value)
    return f"{value[:CLIP_CHARS]!r}... ({len(value)} characters)"


def clip_list(values: Sequence[object]) -> str:
    """A client-supplied list (a shape, names), cut to its first CLIP_ITEMS items."""
    if len(values) <= CLIP_ITEMS:
        return str(list(values))
    shown = ", ".join(str(v) for v in values[:CLIP_ITEMS])
    return f"[{shown}, ...] ({len(values)} items)"


def parameter_said(p: Any) -> str:
    """An InferParameter's value in words, not protobuf's field name: `a string '1s'`."""
    if (kind := p.WhichOneof("parameter_choice")) is None:
        return "nothing"
    value = getattr(p, kind)
    words = {"bool_param": "a boolean", "string_param": "a string", "double_param": "a number"}
    shown = clip(value) if isinstance(value, str) else str(value).lower()  # (true, as JSON)
    return f"{words.get(kind, 'an integer')} {shown}"


def first_names(names: Collection[str], most: int = 32) -> str:
    """The first `most` of `names` (sorted), and how many there are past that: an
    unknown model's error lists what the server serves, never thousands of names,
    nor a sort of them all on every bad call."""
    shown = ", ".join(heapq.nsmallest(most, names)) or "none"
    return shown + (f", ... ({len(names)} models)" if len(names) > most else "")


class BatchdError(Exception):
    code = grpc.StatusCode.INTERNAL
    reason = "internal"  # the label statistics count failures under

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    # A pushback: nothing was done, and the same call may be sent again after this long
    # (the `grpc-retry-pushback-ms` trailer; a stream's `retry_pushback_ms` parameter).
    retry_after_ms: int | None = None

    def trailers(self) -> tuple[tuple[str, str], ...]:
        ms = self.retry_after_ms
        return () if ms is None else (("grpc-retry-pushback-ms", str(ms)),)


class ModelNotFound(BatchdError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "not_found"


class InvalidInput(BatchdError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid"


class QueueFull(BatchdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "queue_full"

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class TooManyCalls(BatchdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "too_many_calls"
    # Calls on the connection end, and the same call then passes: worth a retry
    # (clients retry RESOURCE_EXHAUSTED only with a pushback, client/retry.py).
    retry_after_ms = 100


class ResponseTooLarge(BatchdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "response_too_large"


class StreamBehind(BatchdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "stream_behind"


class LimitExceeded(BatchdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "limit"


class DeadlineExceeded(BatchdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "deadline"


class Unavailable(BatchdError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "unavailable"


class Refused(Unavailable):
    """UNAVAILABLE before anything was done or kept (a stopping server's new job upload):
    its pushback trailer tells a client the same call may be sent again, as it was."""

    retry_after_ms = 100


class NotAllowed(BatchdError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "not_allowed"


class Cancelled(BatchdError):
    code = grpc.StatusCode.CANCELLED
    reason = "cancelled"


class Unauthenticated(BatchdError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "unauthenticated"


class ModelFailed(BatchdError):
    code = grpc.StatusCode.INTERNAL
    reason = "model_failed"


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.CANCELLED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(error: BatchdError) -> tuple[int, dict[str, str]]:
    """The HTTP status and headers of a BatchdError: its gRPC code's (HTTP_STATUS); a
    full queue's retry-after in whole seconds, as Retry-After takes it."""
    headers: dict[str, str] = {}
    if isinstance(error, QueueFull | Refused) and error.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-error.retry_after_ms // 1000)))
    elif isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    elif isinstance(error, ResponseTooLarge):  # the same request fails again: not 429's "later"
        return 400, headers
    return HTTP_STATUS.get(error.code, 500), headers


def set_status(context: Any, error: BatchdError) -> None:
    """The status of a call that ends with `error`: code, details, trailers. Setting
    them and returning costs a fraction of context.abort(), which raises through
    grpc's machinery: rejections stay cheap in overload."""
    context.set_code(error.code)
    context.set_details(details(error.message))
    if trailers := error.trailers():
        context.set_trailing_metadata(trailers)


# Of a status's details, as sent: gRPC sends each byte past printable ASCII (and %) as
# three characters (%E4), and clients take 8 KiB of metadata (past it, and at 16 KiB
# always, the caller got RESOURCE_EXHAUSTED "Stream removed" instead: a load error
# quoting 4,000 CJK characters went as 11.8 KB).
MAX_DETAILS_CHARS = 7000
_PLAIN = bytes(c for c in range(0x20, 0x7F) if c != 0x25)


def details(message: str) -> str:
    """`message`, cut to MAX_DETAILS_CHARS as gRPC sends it (a short one at once)."""
    if len(message) <= MAX_DETAILS_CHARS // 12:  # (4 bytes a character, 3 characters a byte)
        return message
    data = message.encode("utf-8", "surrogatepass")
    if _sent(data) <= MAX_DETAILS_CHARS:
        return message
    low, high = 0, len(data)  # the longest prefix that fits, with room for the note
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _sent(data[:mid]) <= MAX_DETAILS_CHARS - 40 else (low, mid - 1)
    return f"{data[:low].decode('utf-8', 'ignore')}... ({len(message)} characters)"


def _sent(data: bytes) -> int:
    return len(data) + 2 * len(data.translate(None, _PLAIN))


class grpc_status:
    """Answer a BatchdError raised in the block with its status (set_status); the
    call then ends normally. A class, not @contextmanager: it runs on every RPC."""

    __slots__ = ("_context",)

    def __init__(self, context: Any) -> None:
        self._context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: Any) -> bool:  # fmt: skip
        if isinstance(error, BatchdError):
            set_status(self._context, error)
            return True
        return False
