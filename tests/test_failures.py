"""Nothing lost: each test does the bad thing to real processes.

`crashy` kills its worker on X == 666, hangs on X == 777 (execution limit
1.5 s), and takes 20 ms per batch so a kill lands mid-batch under load.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd.client import AsyncClient, Client, InferenceFailed, ServerBusy, ServerUnavailable
from tests.conftest import Gate
from tests.servers import TEST_MODELS, ServerProcess, alive, wait_for
from tests.test_policies import fill, outcome


def x(v: float) -> dict[str, np.ndarray]:
    return {"X": np.array([[v]], np.float32)}


def live_workers(server: ServerProcess) -> set[str]:
    """Worker ids registered and not lost since, read from the server's log."""
    alive_ids: set[str] = set()
    for line in server.log().splitlines():
        if m := re.search(r"worker (\S+) ready \(pid", line):
            alive_ids.add(m.group(1))
        elif m := re.search(r"worker (\S+) lost:", line):
            alive_ids.discard(m.group(1))
    return alive_ids


@pytest.fixture(scope="module")
def crash_server(
    state_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(
        TEST_MODELS,
        log_dir=tmp_path_factory.mktemp("logs"),
        workers=2,
        env={"BATCHD_TEST_DIR": str(state_dir)},
    ).start()
    try:
        wait_for(lambda: len(live_workers(server)) == 2, 60, "two workers")
    except BaseException:
        server.stop()  # a failed set-up leaves no server behind
        raise
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def both_workers(crash_server: ServerProcess) -> ServerProcess:
    wait_for(lambda: len(live_workers(crash_server)) == 2, 90, "both workers back")
    return crash_server


def test_killing_a_worker_under_load_loses_nothing(both_workers: ServerProcess) -> None:
    server = both_workers
    results: dict[float, float] = {}
    killed_at: list[float] = []

    async def scenario() -> None:
        sixty_done = asyncio.Event()
        async with AsyncClient(server.url) as client:

            async def caller(k: int) -> None:
                for j in range(30):
                    v = float(k * 1000 + j)
                    results[v] = float((await client.infer("crashy", x(v), timeout=60))["Y"][0, 0])
                    if len(results) >= 60:
                        sixty_done.set()

            async def killer() -> None:
                await sixty_done.wait()
                os.kill(server.worker_pids()[0], signal.SIGKILL)
                killed_at.append(time.monotonic())

            await asyncio.gather(killer(), *(caller(k) for k in range(16)))

    asyncio.run(scenario())
    assert len(results) == 16 * 30
    assert all(y == 2 * v for v, y in results.items())
    assert "lost: process exited (killed by SIGKILL)" in server.log()
    wait_for(lambda: len(live_workers(server)) == 2, 90, "the killed worker's replacement")
    print(f"recovered (replacement ready) {time.monotonic() - killed_at[0]:.2f} s after the kill")


def test_poison_request_fails_alone_after_two_deaths(both_workers: ServerProcess) -> None:
    server = both_workers
    deaths_before = server.log().count("killed by SIGKILL")

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as client:
            calls = [client.infer("crashy", x(v), timeout=60) for v in (1, 2, 666, 3, 4)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    out = asyncio.run(scenario())
    poison = out[2]
    assert isinstance(poison, InferenceFailed), poison
    assert poison.code == grpc.StatusCode.INTERNAL
    assert "lost 2 times" in poison.message and "killed by SIGKILL" in poison.message
    assert [o["Y"][0, 0] for i, o in enumerate(out) if i != 2] == [2, 4, 6, 8]  # type: ignore[index]
    assert server.log().count("killed by SIGKILL") - deaths_before == 2  # and no more


def test_hung_batch_gets_its_worker_replaced(both_workers: ServerProcess) -> None:
    server = both_workers

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as client:
            calls = [client.infer("crashy", x(v), timeout=60) for v in (5, 777, 6)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    started = time.monotonic()
    out = asyncio.run(scenario())
    hung = out[1]
    assert isinstance(hung, InferenceFailed), hung
    assert "execution_timeout_s 1.5" in hung.message and "lost 2 times" in hung.message
    assert [out[0]["Y"][0, 0], out[2]["Y"][0, 0]] == [10, 12]  # type: ignore[index]
    assert time.monotonic() - started < 15
    assert "killing worker" in server.log()


def test_model_error_fails_only_the_offending_requests(
    test_server: ServerProcess, gate: Gate
) -> None:
    """One bad input in a batch of four: the batch is retried request by
    request, so only the bad one fails, with the model's own message."""

    def value(i: int) -> float:
        return -float(i + 1) if i % 2 else float(i + 1)

    async def scenario() -> list[object]:
        async with AsyncClient(test_server.url) as client:
            gate.close()
            first = asyncio.ensure_future(client.infer("isolate", x(1000), timeout=60))
            await asyncio.to_thread(wait_for, lambda: gate.calls("isolate", "entered"), 30)

            async def call(i: int) -> object:
                try:
                    return await client.infer("isolate", x(value(i)), timeout=60)
                except (ServerBusy, InferenceFailed) as e:
                    return e

            calls = await fill(lambda i: asyncio.ensure_future(call(i)))
            gate.open()
            await first
            return list(await asyncio.gather(*calls))

    out = asyncio.run(scenario())
    admitted = {value(i): o for i, o in enumerate(out) if not isinstance(o, ServerBusy)}
    assert len(admitted) == 4
    for v, o in admitted.items():
        if v < 0:
            assert isinstance(o, InferenceFailed) and f"negative input {v}" in o.message
        else:
            assert o["Y"][0, 0] == 2 * v  # type: ignore[index]
    batches = gate.calls("isolate")
    assert sorted(batches[1]) == sorted(admitted)  # they really shared one batch first
    assert all(len(b) == 1 for b in batches[2:])  # then each rode alone


def test_no_live_worker_then_recovery(tmp_path: Path, state_dir: Path) -> None:
    server = ServerProcess(
        TEST_MODELS, log_dir=tmp_path, env={"BATCHD_TEST_DIR": str(state_dir)}
    ).start()
    try:
        with Client(server.url) as c, grpc.insecure_channel(server.url) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service)).status

            os.kill(server.worker_pids()[0], signal.SIGKILL)
            wait_for(lambda: not c.model_ready("limited"), 10, "the model to be not ready")
            assert not c.ready()
            assert status("") == status("limited") == health_pb2.HealthCheckResponse.NOT_SERVING

            async def during_outage() -> list[object]:
                async with AsyncClient(server.url) as ac:
                    calls = [
                        asyncio.ensure_future(outcome(ac.infer("limited", x(v), timeout=60)))
                        for v in range(6)
                    ]
                    return list(await asyncio.gather(*calls))

            out = asyncio.run(during_outage())  # the queue (4) waits for the worker to return
            busy = [o for o in out if isinstance(o, ServerBusy)]
            served = [o for o in out if not isinstance(o, ServerBusy)]
            assert len(busy) == 2 and len(served) == 4
            assert c.ready() and status("") == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.stop() == 0


def test_sigterm_drains_admitted_requests_then_stops(
    tmp_path: Path, state_dir: Path, gate: Gate
) -> None:
    server = ServerProcess(
        TEST_MODELS, log_dir=tmp_path, env={"BATCHD_TEST_DIR": str(state_dir)}
    ).start()
    workers = server.worker_pids()

    async def scenario() -> tuple[list[object], object]:
        async with AsyncClient(server.url) as client:
            gate.close()
            admitted = [
                asyncio.ensure_future(client.infer("gated", x(v), timeout=60)) for v in (1, 2, 3)
            ]
            await asyncio.to_thread(wait_for, lambda: gate.calls("gated", "entered"), 30)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            refused: object = None
            while refused is None:  # once draining, new requests are refused at once
                try:
                    await client.infer("gated", x(9), timeout=5)
                except ServerUnavailable as e:
                    refused = e
                await asyncio.sleep(0.01)
            gate.open()
            return list(await asyncio.gather(*admitted)), refused

    results, refused = asyncio.run(scenario())
    assert [r["Y"][0, 0] for r in results] == [2, 4, 6]  # type: ignore[index]
    assert "shutting down" in str(refused)
    assert server.stop() == 0
    assert not any(alive(p) for p in workers)


def test_drain_timeout_still_answers_every_request(
    tmp_path: Path, state_dir: Path, gate: Gate
) -> None:
    server = ServerProcess(
        TEST_MODELS,
        "--drain-timeout",
        "1",
        log_dir=tmp_path,
        env={"BATCHD_TEST_DIR": str(state_dir)},
    ).start()

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as client:
            gate.close()  # stays closed: the model never finishes
            calls = [
                asyncio.ensure_future(outcome(client.infer("gated", x(v), timeout=60)))
                for v in (1, 2, 3)
            ]
            await asyncio.to_thread(wait_for, lambda: gate.calls("gated", "entered"), 30)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            return list(await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30))

    out = asyncio.run(scenario())
    assert all(isinstance(o, ServerUnavailable) for o in out), out
    assert server.stop() == 0
    assert "drain timeout: answering 3 open request(s) UNAVAILABLE" in server.log()
