"""The ZeroMQ link on an in-process socket pair, with a clock the test moves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from batchd.protos import wire
from batchd.server.link import WorkerLink
from tests.conftest import Clock, run


class Recorder:
    def __init__(self) -> None:
        self.messages: list[tuple[bytes, int]] = []
        self.silent: list[bytes] = []
        self.ticks = 0

    def on_message(self, identity: bytes, header: wire.Header, frames: list[Any]) -> None:
        self.messages.append((identity, header.kind))

    def on_silent(self, identity: bytes, silent_s: float) -> None:
        self.silent.append(identity)

    def on_tick(self, now: float) -> None:
        self.ticks += 1


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://batchd-test-link")
    dealer.setsockopt(zmq.IDENTITY, b"w")
    dealer.connect("inproc://batchd-test-link")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


READY = wire.pack(
    wire.Header(
        kind=wire.Header.READY,
        worker=wire.WorkerInfo(worker_id="w", pid=7, protocol=wire.PROTOCOL_VERSION),
    )
)
BEAT = wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))
WINDOW = wire.HEARTBEAT_INTERVAL_S * wire.LIVENESS


def arrive(router: zmq.Socket[bytes], dealer: zmq.Socket[bytes], parts: list[Any]) -> None:
    dealer.send_multipart(parts)
    assert router.poll(5000)  # it is waiting, unread


def kinds(dealer: zmq.Socket[bytes]) -> list[int]:
    got = []
    while dealer.poll(0):
        got.append(wire.unpack(dealer.recv_multipart())[0].kind)
    return got


def test_a_busy_loop_does_not_make_a_heard_peer_silent(sockets: Any) -> None:
    """The liveness check reads what came in before it judges: a heartbeat that
    waited unread through a long busy spell keeps the peer. Real silence is reported
    each round until the core forgets the peer."""
    router, dealer = sockets

    async def body() -> None:
        clock, events = Clock(), Recorder()
        link = WorkerLink(router, events, clock)
        arrive(router, dealer, READY)
        link.keep_alive()
        assert events.messages == [(b"w", wire.Header.READY)]
        link.watch(b"w")
        clock.now += 10 * WINDOW  # the event loop was busy all that time
        arrive(router, dealer, BEAT)
        link.keep_alive()
        assert events.silent == [] and events.ticks == 2
        assert kinds(dealer) == [wire.Header.HEARTBEAT]  # it was beaten, not dropped
        clock.now += 10 * WINDOW  # now truly silent
        link.keep_alive()
        assert events.silent == [b"w"]
        clock.now += 10 * WINDOW
        link.keep_alive()  # the core let it be (a worker loading a model may be silent):
        assert events.silent == [b"w", b"w"]  # asked again each round
        link.forget(b"w")  # the core lost it
        clock.now += 10 * WINDOW
        link.keep_alive()
        assert events.silent == [b"w", b"w"]  # no longer watched

    run(body)


def test_a_peer_saying_ready_again_is_heard_and_reported(sockets: Any) -> None:
    router, dealer = sockets

    async def body() -> None:
        clock, events = Clock(), Recorder()
        link = WorkerLink(router, events, clock)
        link.watch(b"w")
        clock.now += WINDOW - 0.5
        arrive(router, dealer, READY)  # it heard nothing from us and registers again
        clock.now += 1.0  # past the window counted from watch(), not from READY
        link.keep_alive()
        assert events.silent == [] and events.messages == [(b"w", wire.Header.READY)]

    run(body)


def test_after_stop_peers_silence_is_expected_not_a_loss(sockets: Any) -> None:
    router, dealer = sockets

    async def body() -> None:
        clock, events = Clock(), Recorder()
        link = WorkerLink(router, events, clock)
        link.watch(b"w")
        link.stop_peers()
        assert dealer.poll(5000) and kinds(dealer) == [wire.Header.STOP]
        clock.now += 10 * WINDOW  # it finishes the batch at hand, then leaves
        link.keep_alive()
        assert events.silent == [] and kinds(dealer) == []  # no heartbeat either

    run(body)


def test_a_send_to_a_gone_peer_says_why_instead_of_raising(sockets: Any) -> None:
    router, _ = sockets
    link = WorkerLink(router, Recorder())
    reason = link.send(b"nobody", BEAT)
    assert reason is not None and reason.startswith("send failed")


def test_a_malformed_message_is_dropped_and_the_next_one_read(sockets: Any) -> None:
    router, dealer = sockets

    async def body() -> None:
        events = Recorder()
        link = WorkerLink(router, events)
        arrive(router, dealer, [b"\xff\xff not a header"])
        arrive(router, dealer, READY)
        link.keep_alive()
        assert events.messages == [(b"w", wire.Header.READY)]

    run(body)


def test_a_flood_of_malformed_messages_is_counted_and_logged_once_a_second(
    sockets: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer sending garbage as fast as it can had a WARNING logged for each (200,000 in
    0.4 s: 34 MB of log, every caller stalled 2.5 s); a header frame past
    MAX_HEADER_BYTES is dropped before it is copied or parsed (a 1 GiB one took 2 GB)."""
    router, dealer = sockets
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 1024)
    big = wire.pack(wire.Header(kind=wire.Header.ERROR, error="x" * 2000))  # (well formed)

    async def body() -> None:
        clock, events = Clock(), Recorder()
        link = WorkerLink(router, events, clock)
        for _ in range(500):
            dealer.send_multipart([b"\xff\xff not a header"])
        dealer.send_multipart(big)
        arrive(router, dealer, READY)
        while not events.messages:
            link.keep_alive()
        assert events.messages == [(b"w", wire.Header.READY)] and link.malformed == 501
        clock.now += 1.0
        arrive(router, dealer, [b"\xff"])
        link.keep_alive()
        assert link.malformed == 502

    with caplog.at_level("WARNING", logger="batchd.server"):
        run(body)
    said = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].endswith("(1 dropped so far)") and said[1].endswith("(502 dropped so far)")
