"""The call limiter (`--max-concurrent-streams`): at most N inference-service RPCs
open at once per client connection.

The servicer counts open RPCs per connection (the peer address) itself and
answers one too many with RESOURCE_EXHAUSTED, naming the limit. (A grpc.aio
interceptor would do the same for every service, at ~9 % of tiny's
throughput; health and reflection calls are small and stay uncounted.)
HTTP/2's own SETTINGS_MAX_CONCURRENT_STREAMS is advertised a little above it
(security.Connections): gRPC clients queue their calls beyond that themselves,
so a burst of thousands of calls on one connection waits in its client, not in
the server's backlog ahead of every other connection's calls.
"""

from __future__ import annotations

from collections import Counter

from batchd.server.errors import TooManyCalls


class CallLimiter:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()  # RPCs open, by connection

    def enter(self, peer: str) -> None:
        """Count one more RPC on `peer`'s connection, or raise TooManyCalls."""
        if self._open[peer] >= self.limit:
            raise TooManyCalls(
                f"this connection has {self._open[peer]} RPCs open, the limit per connection "
                f"(--max-concurrent-streams {self.limit}); wait for one to finish or open "
                "another connection"
            )
        self._open[peer] += 1

    def leave(self, peer: str) -> None:
        self._open[peer] -= 1
        if not self._open[peer]:
            del self._open[peer]
