"""A caller's pace of taking a stream's writes (a step-wise model's outputs, an SSE
answer, a download), and how long one that takes nothing is waited for: Pace, and
PatientStream for HTTP's streamed answers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

log = logging.getLogger("batchd.server")

# A caller's connection takes a stream's writes in bursts: gRPC's HTTP/2 windows (grown
# by its bandwidth probes) or the kernel's socket buffers take megabytes at once, then
# nothing till the caller has read through them. So a caller is behind once it has
# taken nothing for a limit and the time to read, at MIN_READ_RATE, what its connection
# took and it may not have read yet: `burst`, a leaky bucket filled by each write taken
# and drained at that rate (at most MAX_BURST). One taking 256 KiB each 0.3 s was cut
# at 2 s as having taken none, its writes waiting 2.3 s for it to read 4 MiB (review
# 57a); at 512 KiB/s, one each 1 s still was, and a burst that never drained (counted
# since a write last waited) gave a reader that stopped 32 s more (57e).
MIN_READ_RATE, MAX_BURST = 256 * 1024, 8 << 20  # bytes a second; bytes (32 s more at most)


class Pace:
    """When a caller last took a write of its stream, and what its connection took that
    it may not have read yet (`burst`, the module comment's bucket)."""

    def __init__(self) -> None:
        self.taken_at, self.burst = time.monotonic(), 0.0
        self._drained_at = self.taken_at  # the bucket's own clock (taken_at is the stall's,
        # which others move too: drained from it, a prompt reader's bucket never was, 57g)

    def took(self, size: int) -> None:
        """The connection took `size` more bytes."""
        now = time.monotonic()
        left = max(0.0, self.burst - (now - self._drained_at) * MIN_READ_RATE)
        self.taken_at = self._drained_at = now
        self.burst = min(left + size, MAX_BURST)

    def patience(self, limit: float) -> float:
        """How long past taken_at a caller that takes nothing is not behind yet."""
        return limit + self.burst / MIN_READ_RATE


class PatientStream(web.StreamResponse):
    """A streamed answer (SSE, a download) whose every write is done within `seconds` (0:
    no bound) and the time to read what the connection took (`pace`'s patience), or
    its connection is closed: a caller that reads nothing keeps no request open for ever
    (an unload, or a reload, waits for its model version's open requests)."""

    def __init__(self, request: web.Request, seconds: float, pace: Pace | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self._request, self._seconds, self._pace = request, seconds, pace or Pace()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self._within(super().write(data), len(data))

    async def write_eof(self, data: bytes = b"") -> None:  # (it drains what is left too)
        await self._within(super().write_eof(data), len(data))

    async def _within(self, sending: Awaitable[None], size: int) -> None:
        limit = self._seconds and self._pace.patience(self._seconds)
        try:
            async with asyncio.timeout(limit or None):
                await sending
            self._pace.took(size)
        except TimeoutError:
            r = self._request
            log.info("HTTP %s %s: its caller read nothing for %.3g s; connection closed",
                     r.method, r.path[:100], limit)  # fmt: skip
            if r.transport is not None:
                r.transport.abort()
            raise ConnectionResetError("the caller read nothing") from None
