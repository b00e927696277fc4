"""When to retry a failed call, and after how long. Pure: no sleeping here.

Retried: UNAVAILABLE, gRPC's own CANCELLED of a call it shed from the server's
backlog, and RESOURCE_EXHAUSTED that came with the server's
`grpc-retry-pushback-ms` (ServerBusy with .retry_after_ms: batchd sends it for a
full queue and a full decode backlog). A RESOURCE_EXHAUSTED without it is a
limit the call passed (LimitExceeded: a response over --max-message-bytes, a
message over the client's own max_message_bytes): the same call would fail
again, after running the model again, so it is not retried. Nor is an
UNAVAILABLE whose pushback is negative or not a number (gRFC A6: the server says
do not retry; `.retry_refused`). Nor is an input
the server rejected, an unknown model or a failed model. The wait is "full
jitter" exponential backoff, and never shorter than the server's pushback. All
attempts share the caller's timeout: a backoff that would pass it is cut to half
the time left, so that the last try is made (a call with retries gave up with a
quarter of its timeout left, the server back meanwhile). A pushback longer than that timeout, or
than `max_pushback_s` (60 s), is not waited out: the call raises at once, and
the caller reads .retry_after_ms (a server could otherwise hold a call with no
timeout asleep for as long as it liked).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from batchd.client.errors import BatchdClientError, ServerBusy, ServerUnavailable


def retryable(error: BatchdClientError) -> bool:
    """Whether the same call may succeed later (the module docstring's rules)."""
    if isinstance(error, ServerBusy):
        return error.retry_after_ms is not None
    # gRPC's own CANCELLED ("CANCELLED", and nothing more): a call it shed from the server's
    # backlog of calls not yet taken, never run (README, Status codes)
    shed = error.code == grpc.StatusCode.CANCELLED and error.message == "CANCELLED"
    return shed or (isinstance(error, ServerUnavailable) and not error.retry_refused)


LAST_TRY_S = 0.01  # the least time left worth a try: less, and the call raises its error


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 0  # extra attempts after the first
    base_s: float = 0.05
    max_s: float = 2.0
    max_pushback_s: float = 60.0  # a longer pushback raises instead of sleeping

    def delay(
        self, attempt: int, error: BatchdClientError, remaining_s: float | None, rng: random.Random
    ) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up and raise."""
        if attempt >= self.retries or not retryable(error):
            return None
        if remaining_s is not None and remaining_s < 2 * LAST_TRY_S:
            return None
        # (2**attempt capped: a float of 2**1024 overflowed, the 1,025th retry raised)
        wait = rng.uniform(0.0, min(self.max_s, self.base_s * 2 ** min(attempt, 64)))
        if remaining_s is not None:  # a backoff past the timeout is cut short, to leave a
            wait = min(wait, remaining_s / 2)  # last try half the time: none was made
        pushback_ms = getattr(error, "retry_after_ms", None)  # ServerBusy's, ServerUnavailable's
        if pushback_ms:
            if pushback_ms / 1000 > self.max_pushback_s:
                return None
            if remaining_s is not None and pushback_ms / 1000 >= remaining_s:
                return None
            wait = max(wait, pushback_ms / 1000)
        return wait
