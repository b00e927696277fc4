"""worker/frontend_link.py in-process: a ROUTER in the test plays the frontend, and
the link's clock is the `now` the test passes, so a retry interval passes at once."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from batchd.protos import wire
from batchd.worker.frontend_link import GIVE_UP_S, REOPEN_S, RETRY_S, FrontendLink
from tests.servers import wait_for

READY = wire.pack(wire.Header(kind=wire.Header.READY))


def _ready(again: bool) -> list[bytes]:
    """READY, saying whether it comes on a new connection (WorkerInfo.reconnected)."""
    info = wire.WorkerInfo(worker_id="w1", reconnected=again)
    return wire.pack(wire.Header(kind=wire.Header.READY, worker=info))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def router(ctx: zmq.Context[Any]) -> Iterator[zmq.Socket[Any]]:
    """The frontend's socket, bound on a free port."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind("tcp://127.0.0.1:*")
    yield sock
    sock.close()


@pytest.fixture
def link(ctx: zmq.Context[Any], router: zmq.Socket[Any]) -> Iterator[FrontendLink]:
    """A worker's link to `router`, not yet open."""
    frontend_link = FrontendLink(ctx, router.LAST_ENDPOINT.decode(), "w1", None, _ready)
    yield frontend_link
    frontend_link.close()


def _next(router: zmq.Socket[Any], skip: int | None = None) -> wire.Header:
    """The next message's header from the worker, but for those of kind `skip`."""
    while True:
        assert router.poll(30_000), "nothing came from the worker"
        _, raw, *_ = router.recv_multipart()
        if (header := wire.Header.FromString(raw)).kind != skip:
            return header


def _next_kind(router: zmq.Socket[Any], skip: int | None = None) -> int:
    return int(_next(router, skip).kind)


def _receive(link: FrontendLink, now: float) -> tuple[wire.Header, list[Any]] | None:
    assert link.socket is not None and link.socket.poll(30_000), "nothing came from the frontend"
    return link.receive(now)


def test_a_frontend_that_went_silent_is_told_ready_again_on_the_same_socket(
    router: zmq.Socket[Any], link: FrontendLink, caplog: pytest.LogCaptureFixture
) -> None:
    link.open(now=0.0)
    assert _next_kind(router) == wire.Header.READY
    router.send_multipart([b"w1", *wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))])
    assert _receive(link, now=0.5) is None  # a heartbeat is no work, but it is an answer
    assert link.accepted
    first = link.socket

    assert not link.tick(now=0.5 + RETRY_S / 2)  # heard recently: only a heartbeat
    assert _next_kind(router) == wire.Header.HEARTBEAT
    with caplog.at_level(logging.WARNING, "batchd.worker"):
        assert not link.tick(now=0.5 + RETRY_S + 0.1)  # silent: READY again, same socket
    assert link.socket is first
    assert _next_kind(router, skip=wire.Header.HEARTBEAT) == wire.Header.READY
    assert "silent for 3 s" in caplog.text and "saying READY again" in caplog.text
    # Silent for long (a half-open connection: READY lost on it for ever): a new one,
    # whose READY says so (what the old one carried may be lost).
    with caplog.at_level(logging.WARNING, "batchd.worker"):
        assert link.tick(now=0.5 + REOPEN_S)
    assert link.socket is not first and "connecting anew" in caplog.text
    # (The ROUTER may not have dropped the old connection when the new one says who
    # it is: then it ignores the new one, which is opened again each RETRY_S.)
    for k in itertools.count(1):
        assert k < 10, "no READY on a new socket"
        if router.poll(1000) and (ready := _next(router)).kind == wire.Header.READY:
            break  # (else the old socket's last heartbeat, or nothing)
        link.tick(0.5 + REOPEN_S + k * RETRY_S)
    assert ready.worker.reconnected


def test_a_frontend_restarted_on_the_same_endpoint_is_told_ready_at_once(
    ctx: zmq.Context[Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A frontend restarted (a child frontend killed and started again) knows no
    worker: the socket reconnects by itself, and READY goes out as soon as it does,
    not after LIVENESS silent heartbeats (the clock here never reaches them), saying
    it comes on a new connection: what the old one carried may be lost."""
    endpoint = f"ipc://{tmp_path}/frontend.sock"
    first = ctx.socket(zmq.ROUTER)
    first.linger = 0
    first.bind(endpoint)
    link = FrontendLink(ctx, endpoint, "w1", None, _ready)
    try:
        link.open(now=0.0)
        assert not _next(first).worker.reconnected  # (its first)
        first.send_multipart([b"w1", *wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))])
        assert _receive(link, now=0.5) is None and link.accepted
        assert not link.tick(now=0.6)  # connected once: nothing to say but a heartbeat
        assert _next_kind(first) == wire.Header.HEARTBEAT
        first.close()
        second = ctx.socket(zmq.ROUTER)  # the frontend, started again
        second.linger = 0
        second.bind(endpoint)
        clock = itertools.count()  # 0.7 s on, 2 ms a turn: a look each 50 turns, far from
        # the LIVENESS silence (3.5 s) in the 30 s the wait may take
        with caplog.at_level(logging.INFO, "batchd.worker"):
            wait_for(lambda: not link.tick(0.7 + next(clock) / 500) and second.poll(0), 30, "it")
        ready = _next(second, skip=wire.Header.HEARTBEAT)
        assert ready.kind == wire.Header.READY and ready.worker.reconnected
        assert "connected again to frontend" in caplog.text and "silent" not in caplog.text
        second.close()
    finally:
        link.close()


def test_a_frontend_that_never_answers_gets_a_new_socket_each_retry(
    router: zmq.Socket[Any], link: FrontendLink, caplog: pytest.LogCaptureFixture
) -> None:
    link.open(now=0.0)
    first = link.socket
    wait_for(lambda: router.poll(0), 30, "READY to arrive")  # connected and handshaken
    with caplog.at_level(logging.WARNING, "batchd.worker"):
        assert not link.tick(now=RETRY_S - 0.1)
        assert caplog.text == ""
        assert link.tick(now=RETRY_S)  # replaced: the caller polls the new socket
    assert link.socket is not first and first is not None and first.closed
    assert "not accepted by frontend" in caplog.text
    assert "connected, but the frontend has not answered" in caplog.text
    assert "trying again every 3 s" in caplog.text


def test_no_frontend_at_all_is_said_plainly(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    link = FrontendLink(ctx, "ipc://@batchd-test-link-nobody", "w3", None, _ready)
    link.open(now=0.0)
    try:
        with caplog.at_level(logging.WARNING, "batchd.worker"):
            assert link.tick(now=RETRY_S)
    finally:
        link.close()
    assert "no connection made (is a frontend listening there?)" in caplog.text


def test_replies_a_frontend_behind_cannot_take_are_kept_and_arrive_in_order(
    tmp_path: Path,
) -> None:
    """A frontend that reads nothing a while (its event loop stalled) fills ZeroMQ's
    queues (here 10 messages each way); the replies after that are kept, not dropped,
    and the socket is kept: once it reads again, every reply arrives, in order."""
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 10)
    ctx.setsockopt(zmq.RCVHWM, 10)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(f"ipc://{tmp_path}/frontend.sock")
    link = FrontendLink(ctx, router.LAST_ENDPOINT.decode(), "w1", None, _ready)
    try:
        link.open(now=0.0)
        assert _next_kind(router) == wire.Header.READY
        router.send_multipart([b"w1", *wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))])
        assert _receive(link, now=0.5) is None and link.accepted
        first, pad = link.socket, b"x" * 16_384
        for n in range(500):  # the frontend reads none of these yet
            link.reply([wire.Header(kind=wire.Header.RESULT, batch_id=n).SerializeToString(), pad])
        assert link.flush(now=1.0) > 0  # more than the queues hold: some are kept
        assert not link.tick(now=0.5 + RETRY_S) and link.socket is first  # not replaced
        got: list[int] = []
        poller = zmq.Poller()  # as the worker's loop: woken when its socket takes more
        poller.register(router, zmq.POLLIN)
        poller.register(link.socket, zmq.POLLOUT)
        while len(got) < 500:
            events = dict(poller.poll(30_000))
            assert events, f"{len(got)} replies came, then none"
            link.flush(now=1.0)
            if router in events:
                _, header, *_ = router.recv_multipart()
                if (h := wire.Header.FromString(header)).kind == wire.Header.RESULT:
                    got.append(h.batch_id)
        assert got == list(range(500)) and link.flush(now=1.0) == 0
    finally:
        link.close()
        ctx.destroy(linger=0)


def test_a_frontend_silent_for_long_with_replies_kept_is_given_up_until_it_speaks(
    router: zmq.Socket[Any], link: FrontendLink, caplog: pytest.LogCaptureFixture
) -> None:
    link.open(now=0.0)
    assert _next_kind(router) == wire.Header.READY
    router.send_multipart([b"w1", *wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))])
    assert _receive(link, now=0.5) is None
    router.close()
    for n in range(5_000):
        link.reply([wire.Header(kind=wire.Header.RESULT, batch_id=n).SerializeToString()])
    assert link.flush(now=0.5 + GIVE_UP_S - 1) > 0 and not link.abandoned
    with caplog.at_level(logging.WARNING, "batchd.worker"):
        assert link.flush(now=0.5 + GIVE_UP_S + 1) == 0
    assert link.abandoned and "said nothing for 31 s: dropping" in caplog.text
    link.reply([b"late"])  # dropped while given up
    assert link.flush(now=0.5 + GIVE_UP_S + 2) == 0


def test_malformed_messages_are_dropped_and_logged_once_per_kind(
    router: zmq.Socket[Any], link: FrontendLink, caplog: pytest.LogCaptureFixture
) -> None:
    link.open(now=0.0)
    assert _next_kind(router) == wire.Header.READY
    garbage = [
        [b"\xff"],
        [b"\xff\xfe"],
        wire.pack(wire.Header(kind=wire.Header.LOAD, tensors=[wire.Tensor(name="X")])),
        wire.pack(wire.Header(kind=wire.Header.LOADED)),
        [wire.Header(kind=77).SerializeToString()],
    ]
    with caplog.at_level(logging.DEBUG, "batchd.worker"):
        for parts in garbage * 2:
            router.send_multipart([b"w1", *parts])
            assert _receive(link, now=1.0) is None
        stop = wire.pack(wire.Header(kind=wire.Header.STOP))
        router.send_multipart([b"w1", *stop])
        message = _receive(link, now=1.0)
    assert message is not None and message[0].kind == wire.Header.STOP
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4, warnings  # DecodeError, ValueError, LOADED, unknown
    assert all("malformed" in w and "dropped" in w for w in warnings)
    assert sum("DecodeError" in w for w in warnings) == 1
