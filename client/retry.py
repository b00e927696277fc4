"""When to retry a failed call, and after how long. Pure: no sleeping here.

Only RESOURCE_EXHAUSTED (ServerBusy) and UNAVAILABLE are retried; an input
the server rejected, an unknown model or a failed model never is. The wait is
"full jitter" exponential backoff, and never shorter than the server's
`grpc-retry-pushback-ms`. All attempts share the caller's timeout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from batchd.client.errors import BatchdClientError, ServerBusy, ServerUnavailable

RETRYABLE = (ServerBusy, ServerUnavailable)


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 0  # extra attempts after the first
    base_s: float = 0.05
    max_s: float = 2.0

    def delay(
        self, attempt: int, error: BatchdClientError, remaining_s: float | None, rng: random.Random
    ) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up and raise."""
        if attempt >= self.retries or not isinstance(error, RETRYABLE):
            return None
        wait = rng.uniform(0.0, min(self.max_s, self.base_s * 2**attempt))
        if isinstance(error, ServerBusy) and error.retry_after_ms:
            wait = max(wait, error.retry_after_ms / 1000)
        if remaining_s is not None and wait >= remaining_s:
            return None
        return wait
