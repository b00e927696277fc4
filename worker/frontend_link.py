"""A worker's link to one frontend: a DEALER socket that never blocks the I/O loop.

Registering: READY as soon as the socket is open, again as soon as the socket
connects anew to a frontend that had answered (a frontend restarted on the same
endpoint knows no worker: waiting out its silence left it none for seconds),
and whenever the frontend has been silent for LIVENESS heartbeat intervals (it
forgot this worker); silent for REOPEN_S, on a new connection (saying so: what
the old one carried may be lost). Heartbeats go out once the frontend answered.

A frontend may refuse the worker: one started with --worker-keys refuses a
worker without keys, with a key not in its authorized/, or holding another
frontend's server.key. It then never answers, and libzmq either drops the
connection for good (a refused key: a send then finds no connection to queue
on) or retries the handshake forever (queuing what is sent meanwhile). So:

- every send is NOBLOCK, never a wait, and the I/O loop goes on reading the
  stop flag, STOP and its parent's exit;
- a socket the frontend has never answered is closed (dropping what it
  queued) and opened afresh each retry interval, with one WARNING line saying
  why, as far as the handshake tells (a socket monitor reports its outcome);
- on a socket the frontend has answered, EAGAIN means the frontend is behind
  (ZeroMQ's queue of HWM messages is full: its event loop stalled, a step-wise
  model outpaced it). A reply is then kept, in order, and sent when the socket
  takes it again; meanwhile the worker steps no sequence (runner.py), so the
  backlog stays small. A reply is never dropped for being late: its frontend
  would wait on it until execution_timeout_s, then kill a healthy worker. Only
  a frontend silent for GIVE_UP_S loses its backlog, and its sequences here;
- at exit, a socket whose frontend is not answering is closed at once; only a
  frontend that answers gets time (LINGER_MS) to take the last replies.

A message from the frontend that does not parse, or that a frontend never
sends, is dropped: the first of each kind logged at WARNING, the rest at DEBUG.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from batchd.protos import keys, wire

log = logging.getLogger("batchd.worker")
RETRY_S = wire.HEARTBEAT_INTERVAL_S * wire.LIVENESS  # silence before registering again
LINGER_MS = 2000  # at exit: how long an answering frontend has to take the last replies
GIVE_UP_S = 30.0  # a frontend behind and silent this long is taken for gone (see above)
# A frontend silent this long gets a new connection: on a half-open one (a middlebox
# lost its state) READY never arrives, and the frontend's ROUTER has closed its own end
# by now (server/link.ROUTER_OPTIONS), so a new connection under this id is taken.
REOPEN_S = GIVE_UP_S + RETRY_S
LOOK_S = 0.1  # how often the socket's monitor is read for a reconnection
_BEAT = wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))
_FROM_FRONTEND = frozenset(
    {
        wire.Header.HEARTBEAT,
        wire.Header.BATCH,
        wire.Header.LOAD,
        wire.Header.UNLOAD,
        wire.Header.STOP,
        wire.Header.START,
        wire.Header.CANCEL,
        wire.Header.CREDIT,
        wire.Header.PASS,
    }
)
_KIND_NAMES = frozenset(wire.Header.Kind.values())
_HANDSHAKE = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITORED = _HANDSHAKE | zmq.EVENT_DISCONNECTED


class FrontendLink:
    """One frontend, as one worker sees it. Call open(), then feed the I/O loop's
    events to receive() and call tick() on every turn of the loop."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        identity: str,
        key_dir: Path | None,
        ready: Callable[[bool], list[Any]],  # READY as of now; True: on a new connection
    ) -> None:
        self.endpoint = endpoint
        self._ctx, self._identity, self._key_dir, self._ready = ctx, identity, key_dir, ready
        self.socket: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._handshake: tuple[int, int] | None = None  # the last handshake event, its value
        self._disconnected = False  # the connection closed since the last handshake
        self._lost = False  # the connection closed since this socket was last handshaken
        self._opened = 0  # sockets opened so far (names each one's monitor)
        self._malformed: dict[str, int] = {}  # kind -> how many came
        self.heard = 0.0  # when the frontend last sent anything
        self.accepted = False  # the frontend has answered on this socket
        self.answered = False  # ... on this one or an earlier one
        self.broken = False  # a send found no connection to queue on (never answered)
        self._backlog: deque[list[Any]] = deque()  # replies the frontend has not taken yet
        self.abandoned = False  # gave up on a silent frontend: replies dropped till it speaks
        self.polled_out = False  # the I/O loop also waits for the socket to take more
        self._next_beat = 0.0
        self._next_retry = 0.0
        self._next_look = 0.0  # when tick next reads the socket's monitor

    # ---- the socket ----

    def open(self, now: float) -> None:
        """Connect a new DEALER and say READY on it (saying, once the frontend has
        answered on an earlier one, that what that one carried may be lost)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        if self._key_dir is not None:
            keys.make_curve_client(sock, self._key_dir)
        self._opened += 1
        self._monitor = sock.get_monitor_socket(
            _MONITORED, f"inproc://batchd-link-{id(self)}-{self._opened}"
        )
        sock.connect(self.endpoint)
        self.socket, self._handshake, self._disconnected, self._lost = sock, None, False, False
        self.accepted = self.broken = False
        self._next_retry = now + RETRY_S
        self.send(self._ready(self.answered))

    def close(self, now: float | None = None) -> None:
        """Close the socket. With `now` (at exit), a frontend that is answering gets
        LINGER_MS to take what is queued; otherwise what is queued is dropped."""
        if self.socket is None:
            return
        if now is not None:
            self.flush(now)
        answering = (
            now is not None and self.accepted and not self.broken and now - self.heard <= RETRY_S
        )
        linger = LINGER_MS if answering else 0
        self.socket.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self.socket.close(linger=linger)
        self.socket = self._monitor = None

    def send(self, parts: list[Any], copy: bool = True) -> bool:
        """Queue a message without waiting; False if the socket takes none now (not
        connected, or the frontend is behind)."""
        assert self.socket is not None
        try:
            self.socket.send_multipart(parts, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self.broken = not self.accepted
            return False
        return True

    def reply(self, parts: list[Any]) -> None:
        """Send a reply, or keep it behind those kept until the frontend takes them."""
        if self.abandoned:
            return
        if self._backlog or not self.send(parts, copy=False):
            self._backlog.append(parts)

    def flush(self, now: float) -> int:
        """Send what was kept, as far as the socket takes it; the replies still kept.
        A frontend silent for GIVE_UP_S with replies kept is given up (abandoned)."""
        while self._backlog and self.send(self._backlog[0], copy=False):
            self._backlog.popleft()
        if self._backlog and now - self.heard > GIVE_UP_S:
            log.warning(
                "frontend %s has taken no reply and said nothing for %.0f s: dropping %d "
                "replies and its sequences here until it speaks again",
                self.endpoint, now - self.heard, len(self._backlog),
            )  # fmt: skip
            self._backlog.clear()
            self.abandoned = True
        return len(self._backlog)

    # ---- the loop's calls ----

    def receive(self, now: float) -> tuple[wire.Header, list[Any]] | None:
        """The message waiting on the socket, if it is work (BATCH, LOAD, UNLOAD, STOP).
        Anything the frontend sends shows it is there; what does not parse is dropped."""
        assert self.socket is not None
        parts = self.socket.recv_multipart(copy=False)
        self.heard, self.accepted, self.answered, self.abandoned = now, True, True, False
        self._next_retry = now + RETRY_S
        try:
            header, frames = wire.unpack(parts)
        except Exception as e:  # anything the frontend sends is data, never a reason to exit
            self._drop(type(e).__name__, f"{type(e).__name__}: {e}")
            return None
        if header.kind not in _FROM_FRONTEND:  # unknown kinds count as one: a bounded log
            known = header.kind in _KIND_NAMES
            name = wire.Header.Kind.Name(header.kind) if known else "unknown"
            self._drop(name, f"kind {name} ({header.kind}), which no frontend sends")
            return None
        return None if header.kind == wire.Header.HEARTBEAT else (header, frames)

    def tick(self, now: float, beat: Callable[[], list[Any]] | None = None,
             soon: bool = False) -> bool:  # fmt: skip
        """Heartbeat (`beat()`'s message, if given; `soon`: now, whenever the last went),
        and register again after a silence. True if the socket was replaced (the caller
        polls the new one)."""
        if self.accepted and (soon or now >= self._next_beat):
            self.send(beat() if beat is not None else _BEAT)
            self._next_beat = now + wire.HEARTBEAT_INTERVAL_S
        if now >= self._next_look:  # (a look costs ~4 us: not on every turn of the loop)
            self._next_look = now + LOOK_S
            if self._monitored() and self.accepted:  # connected anew: maybe a new frontend
                log.info("connected again to frontend %s; saying READY", self.endpoint)
                self.send(self._ready(True))
                self._next_retry = now + RETRY_S
        if now < self._next_retry:
            return False
        why = self._why_silent()
        gone = self.accepted and not self.broken and now - self.heard >= REOPEN_S
        if gone and not self._backlog:  # (replies kept wait for GIVE_UP_S, which drops them)
            log.warning("frontend %s silent for %.0f s (%s); connecting anew",
                        self.endpoint, now - self.heard, why)  # fmt: skip
            self.close()
            self.open(now)
            return True
        if self.accepted and not self.broken:  # it answered on this socket before
            log.warning(
                "frontend %s silent for %.0f s (%s); saying READY again",
                self.endpoint,
                now - self.heard,
                why,
            )
            self.send(self._ready(False))
            self._next_retry = now + RETRY_S
            return False
        log.warning(
            "not accepted by frontend %s: %s; trying again every %.0f s",
            self.endpoint,
            why,
            RETRY_S,
        )
        self.close()
        self.open(now)
        return True

    # ---- what to say ----

    def _drop(self, kind: str, what: str) -> None:
        seen = self._malformed[kind] = self._malformed.get(kind, 0) + 1
        if seen == 1:
            log.warning(
                "frontend %s sent a malformed message (%s); dropped. Further ones of "
                "this kind are counted at DEBUG",
                self.endpoint,
                what[:200],
            )
        else:
            log.debug("malformed message %d of kind %s dropped: %s", seen, kind, what[:200])

    def _monitored(self) -> bool:
        """Read what the socket's monitor reported; True if a handshake succeeded
        after the connection was lost (the socket reconnected)."""
        assert self._monitor is not None
        reconnected = False
        while True:
            try:
                message = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return reconnected
            event = int(message["event"])
            self._disconnected = event == zmq.EVENT_DISCONNECTED
            self._lost |= self._disconnected
            if event & _HANDSHAKE:
                self._handshake = (event, int(message["value"]))
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._lost:
                reconnected, self._lost = True, False

    def _why_silent(self) -> str:
        """What the socket's monitor says about the last handshake."""
        self._monitored()
        if self._handshake is None:
            return "no connection made (is a frontend listening there?)"
        event, value = self._handshake
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._disconnected:
            return "the connection was lost (is the frontend running?)"
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "connected, but the frontend has not answered"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"it refused this worker's CURVE key (ZAP status {value}): the frontend "
                "accepts only the worker keys in its --worker-keys DIR/authorized/"
            )
        if self._key_dir is None:
            return (
                "the handshake failed: a frontend started with --worker-keys accepts only "
                "workers started with --worker-keys DIR"
            )
        return (
            f"the CURVE handshake failed (is {self._key_dir / 'server.key'} the public key "
            "of this frontend, and was it started with --worker-keys?)"
        )


def poller(links: list[FrontendLink], results: zmq.Socket[Any]) -> zmq.Poller:
    """The I/O thread's: each frontend's socket and the compute and loader threads'."""
    poll = zmq.Poller()
    for link in links:
        poll.register(link.socket, zmq.POLLIN)
        link.polled_out = False
    poll.register(results, zmq.POLLIN)
    return poll
