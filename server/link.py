"""The frontend's side of the ZeroMQ wire: the ROUTER socket, framing, liveness.

Workers connect (DEALER) to one ROUTER socket. The link reads every message
with a reader callback on the socket's file descriptor (no zmq.asyncio: its
futures cost the event loop more per message than the work they carry),
parses the header (wire.py) and hands the message to its events sink; it
sends without waiting and says whether the send went out. It keeps the
peers' liveness: every HEARTBEAT_INTERVAL_S it reads what has come in, then
reports a peer silent for LIVENESS intervals, beats the others, and ticks.
After `stop_peers` (STOP sent to all) silence is expected and not reported.
What follows from an event (a worker lost, a batch retried) is the core's
business: the link decides nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import zmq
from google.protobuf.message import DecodeError

from batchd.protos import wire
from batchd.server.errors import clip

log = logging.getLogger("batchd.link")
DRAIN_MAX = 64  # messages read in one callback before the loop's other callbacks get a turn
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: zmq's flag enums are slow
_BEAT = wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))
_STOP = wire.pack(wire.Header(kind=wire.Header.STOP))
# The ROUTER's options. ROUTER_MANDATORY: a send to a gone worker fails, and says so.
# ZMTP heartbeats: a connection whose peer answers no PING for HEARTBEAT_TIMEOUT (a
# stopped process, a half-open link a middlebox forgot) is closed, freeing its worker's
# identity: libzmq ignores a new connection that claims one still in use, so the same
# worker reconnecting, or a new one under a hung one's id, was never registered. Longer
# than a worker's patience with a silent frontend (frontend_link.GIVE_UP_S).
ROUTER_OPTIONS = (
    (zmq.ROUTER_MANDATORY, 1),
    (zmq.LINGER, 0),
    (zmq.HEARTBEAT_IVL, 1000),
    (zmq.HEARTBEAT_TIMEOUT, 30_000),
)


class LinkEvents(Protocol):
    """What the link reports."""

    def on_message(self, identity: bytes, header: wire.Header, frames: list[Any]) -> None: ...

    def on_silent(self, identity: bytes, silent_s: float) -> None: ...  # a watched peer

    def on_tick(self, now: float) -> None: ...  # once a heartbeat round, after liveness


class WorkerLink:
    def __init__(
        self,
        socket: zmq.Socket[bytes],  # a plain ROUTER socket with ROUTER_MANDATORY set
        events: LinkEvents,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = socket
        self._events = events
        self._clock = clock
        self._heard: dict[bytes, float] = {}  # watched peers: when each was last heard from
        self._stopping = False
        self._drain_armed = False
        self._crashed: asyncio.Future[None] | None = None
        self.malformed = 0  # messages dropped as malformed
        self._malformed_said = -float("inf")  # when one was last logged

    def watch(self, identity: bytes) -> None:
        """Judge this peer's liveness from now on (it registered)."""
        self._heard[identity] = self._clock()

    def forget(self, identity: bytes) -> None:
        self._heard.pop(identity, None)

    # ---- sending ----

    def send(self, identity: bytes, parts: list[Any], copy: bool = True) -> str | None:
        """Send without waiting; None if it went out, else why not. A peer holds at
        most a few batches and a heartbeat a second, far below the send high-water
        mark, so EAGAIN (its pipe full) and EHOSTUNREACH (ROUTER_MANDATORY: gone)
        both mean it is lost."""
        try:
            self._sock.send_multipart([identity, *parts], flags=zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as e:
            return f"send failed: {e}"
        # A send may consume the socket's edge-triggered FD signal for messages that
        # have already arrived: look for them now rather than wait for the next.
        if cast(int, self._sock.getsockopt(_EVENTS)) & _POLLIN:
            self._drain_soon()
        return None

    def stop_peers(self) -> None:
        """STOP to every watched peer; their silence is expected from now on."""
        self._stopping = True
        for identity in list(self._heard):
            self.send(identity, _STOP)

    # ---- receiving ----

    async def run(self) -> None:
        """Read the socket and keep the peers' liveness until cancelled; an error in
        an event handler (a bug, not a worker's fault) ends it, loudly."""
        loop = asyncio.get_running_loop()
        self._crashed = loop.create_future()
        fd = cast(int, self._sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._drain)
        self._drain_soon()  # what came before the reader was added
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._beat(), name="link-heartbeat")
                await self._crashed
        finally:
            loop.remove_reader(fd)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(wire.HEARTBEAT_INTERVAL_S)
            self.keep_alive()

    def keep_alive(self) -> None:
        """One heartbeat round. What has come in is read first: after a busy spell of
        the event loop the peers' heartbeats wait unread on the socket, and silence
        is theirs only if nothing is there."""
        self._drain(most=1 << 30)
        if self._stopping:
            return
        now = self._clock()
        window = wire.HEARTBEAT_INTERVAL_S * wire.LIVENESS
        for identity, heard in list(self._heard.items()):
            if now - heard > window:  # the core forgets it, or lets it be silent longer
                self._events.on_silent(identity, now - heard)
            elif identity in self._heard:  # not forgotten by an earlier report
                self.send(identity, _BEAT)
        self._events.on_tick(now)

    def _drain_soon(self) -> None:
        if not self._drain_armed:
            self._drain_armed = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self, most: int = DRAIN_MAX) -> None:
        """Every message waiting on the socket, one callback for all (the FD is
        edge-triggered: it signals again only once the socket has been read dry)."""
        self._drain_armed = False
        if self._sock.closed:  # shut down after this call was scheduled
            return
        try:
            for _ in range(most):
                try:
                    parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._receive(parts)
            self._drain_soon()  # more may wait: let the loop's other callbacks run first
        except Exception as e:
            if self._crashed is None or self._crashed.done():
                raise  # no run() to end: the loop's exception handler reports it
            self._crashed.set_exception(e)

    def _receive(self, parts: list[Any]) -> None:
        identity = parts[0].bytes
        try:
            if len(parts) > 1 and len(parts[1]) > wire.MAX_HEADER_BYTES:  # (before a copy)
                raise ValueError(f"a header of {len(parts[1])} bytes, over {wire.MAX_HEADER_BYTES}")
            header, frames = wire.unpack(
                [p.bytes if i == 0 else p for i, p in enumerate(parts[1:])]
            )
        except (DecodeError, ValueError, IndexError) as e:
            self._malformed(identity, e)
            return
        if identity in self._heard:
            self._heard[identity] = self._clock()
        self._events.on_message(identity, header, frames)

    def _malformed(self, identity: bytes, e: Exception) -> None:
        """Logged once a second at most, with the count so far: a peer sending garbage as
        fast as it can made a warning each (200,000 in 0.4 s stalled every caller 2.5 s)."""
        self.malformed += 1
        if (now := self._clock()) - self._malformed_said >= 1.0:
            self._malformed_said = now
            log.warning("dropping malformed message from %s: %s (%d dropped so far)",
                        clip(repr(identity)), clip(str(e)), self.malformed)  # fmt: skip
