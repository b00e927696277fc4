"""Nothing lost: each test does the bad thing to real processes.

`crashy` kills its worker on X == 666, hangs on X == 777 (execution limit
1.5 s), and takes 20 ms per batch so a kill lands mid-batch under load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd.client import (
    AsyncClient,
    Client,
    InferenceFailed,
    InvalidInput,
    ServerBusy,
    ServerUnavailable,
)
from tests.conftest import (
    MODEL_TOML,
    Gate,
    fill,
    load_gate,
    make_model,
    outcome,
    scrape,
    total,
    worker_restarts,
    workers_up,
)
from tests.servers import TEST_MODELS, ServerProcess, alive, listening, wait_for


def x(v: float) -> dict[str, np.ndarray]:
    return {"X": np.array([[v]], np.float32)}


def failures(server: ServerProcess, model: str) -> float:
    """Requests to `model` answered with an error so far, whatever the reason."""
    return total(scrape(server), "batchd_inference_request_failure_total", model=model)


async def finished(calls: list[asyncio.Future[object]], count: int) -> None:
    """Return once `count` of the calls are done."""
    while sum(t.done() for t in calls) < count:
        await asyncio.wait([t for t in calls if not t.done()], return_when=asyncio.FIRST_COMPLETED)


def back_to_two(server: ServerProcess, restarts_before: float, restarts: int) -> None:
    """Wait until the server counts `restarts` more worker restarts and has both
    workers registered again (a restart is counted once its process started, before
    the worker registers)."""
    wait_for(
        lambda: worker_restarts(server) - restarts_before >= restarts and workers_up(server) == 2,
        120,
        f"{restarts} restart(s) and both workers back",
    )


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
        wait_for(lambda: workers_up(server) == 2, 120, "two workers")
    except BaseException:
        server.stop()  # a failed set-up leaves no server behind
        raise
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def both_workers(crash_server: ServerProcess) -> ServerProcess:
    wait_for(lambda: workers_up(crash_server) == 2, 120, "both workers back")
    return crash_server


def test_killing_a_worker_under_load_loses_nothing(both_workers: ServerProcess) -> None:
    server = both_workers
    results: dict[float, float] = {}
    killed: list[int] = []
    restarts_before, failed_before = worker_restarts(server), failures(server, "crashy")

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
                killed.append(server.worker_pids()[0])
                os.kill(killed[0], signal.SIGKILL)

            await asyncio.gather(killer(), *(caller(k) for k in range(16)))

    asyncio.run(scenario())
    assert len(results) == 16 * 30
    assert all(y == 2 * v for v, y in results.items())
    back_to_two(server, restarts_before, 1)
    assert worker_restarts(server) - restarts_before == 1  # the server saw the death
    assert not alive(killed[0]) and killed[0] not in server.worker_pids()
    assert failures(server, "crashy") == failed_before  # no request failed, for any reason


def test_a_worker_killed_by_a_signal_with_no_name_is_restarted(both_workers: ServerProcess) -> None:
    server = both_workers
    restarts_before = worker_restarts(server)
    rt = signal.SIGRTMIN + 1  # real-time signals are not members of signal.Signals
    os.kill(server.worker_pids()[0], rt)
    back_to_two(server, restarts_before, 1)
    assert server.proc is not None and server.proc.poll() is None  # the frontend lives on
    with Client(server.url) as client:
        assert client.infer("crashy", x(3), timeout=60)["Y"][0, 0] == 6
    assert f"process exited (killed by signal {int(rt)})" in server.log()


def poison_among_four(server: ServerProcess) -> None:
    """crashy called at once with 1, 2, 666 (which ends its worker), 3 and 4: the poison
    fails after two deaths, INTERNAL, and the others are answered."""

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as client:
            calls = [client.infer("crashy", x(v), timeout=60) for v in (1, 2, 666, 3, 4)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    out = asyncio.run(scenario())
    poison = out[2]
    assert isinstance(poison, InferenceFailed), out
    assert poison.code == grpc.StatusCode.INTERNAL
    assert "lost 2 times" in poison.message and "killed by SIGKILL" in poison.message
    assert [o["Y"][0, 0] for i, o in enumerate(out) if i != 2] == [2, 4, 6, 8]  # type: ignore[index]


def test_poison_request_fails_alone_after_two_deaths(both_workers: ServerProcess) -> None:
    server = both_workers
    restarts_before = worker_restarts(server)
    poison_among_four(server)
    back_to_two(server, restarts_before, 2)
    # Sent again, twice (a client retrying on INTERNAL), the same inputs are refused
    # unrun and end no more workers; other inputs run on.
    with Client(server.url) as client:
        for _ in range(2):
            with pytest.raises(InferenceFailed) as again:
                client.infer("crashy", x(666), timeout=60)
            assert again.value.code == grpc.StatusCode.INTERNAL
            assert "refused unrun: the same inputs failed" in again.value.message
            assert "lost 2 times" in again.value.message, again.value.message
        assert client.infer("crashy", x(5), timeout=60)["Y"][0, 0] == 10
    assert worker_restarts(server) - restarts_before == 2  # and no more
    assert workers_up(server) == 2


def test_a_poison_s_retry_waits_for_its_worker_to_finish_loading(tmp_path: Path) -> None:
    """One worker, serving crashy and a model whose load takes a second. Its batch's
    requests, retried alone, wait for the restarted worker to finish loading (2 s at
    most): a death there is then the retry's own, and the poison fails after two. They
    went at once, the second death came as it loaded, was not counted, and a third
    worker died."""
    repo = tmp_path / "repo"
    shutil.copytree(TEST_MODELS / "crashy", repo / "crashy")
    (repo / "slow").mkdir()
    (repo / "slow" / "model.toml").write_text(MODEL_TOML)
    (repo / "slow" / "model.py").write_text(
        "import time\n\ndef load(device):\n    time.sleep(1.0)\n    return lambda x: x\n"
    )
    server = ServerProcess(repo, log_dir=tmp_path, workers=1).start()
    try:
        wait_for(lambda: workers_up(server) == 1, 60, "the worker")
        restarts_before = worker_restarts(server)
        poison_among_four(server)
        wait_for(lambda: workers_up(server) == 1, 60, "the worker back")
        assert worker_restarts(server) - restarts_before == 2, server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_hung_batch_gets_its_worker_replaced(both_workers: ServerProcess) -> None:
    server = both_workers
    before = set(server.worker_pids())
    restarts_before = worker_restarts(server)

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as client:
            calls = [client.infer("crashy", x(v), timeout=60) for v in (5, 777, 6)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    out = asyncio.run(scenario())
    hung = out[1]
    # The execution limit (1.5 s), not the caller's 60 s deadline, ended it: twice.
    assert isinstance(hung, InferenceFailed), hung
    assert "execution_timeout_s 1.5" in hung.message and "lost 2 times" in hung.message
    assert [out[0]["Y"][0, 0], out[2]["Y"][0, 0]] == [10, 12]  # type: ignore[index]
    back_to_two(server, restarts_before, 2)
    assert worker_restarts(server) - restarts_before == 2
    replaced = before - set(server.worker_pids())
    assert replaced and not any(alive(p) for p in replaced)  # the hung processes are gone


def test_model_error_fails_only_the_offending_requests(
    test_server: ServerProcess, gate: Gate
) -> None:
    """Two bad inputs in a batch of four: the batch is retried request by request,
    so only the bad ones fail, with the model's own message: INTERNAL where the
    model raised, INVALID_ARGUMENT where it refused its inputs (InputRefused)."""

    def value(i: int) -> float:
        return (float(i + 1), -float(i + 1), float(i + 1), 1e6 + i)[i % 4]

    async def scenario() -> list[object]:
        async with AsyncClient(test_server.url) as client:
            gate.close()
            first = asyncio.ensure_future(client.infer("isolate", x(1000), timeout=60))
            await asyncio.to_thread(wait_for, lambda: gate.calls("isolate", "entered"), 30)

            async def call(i: int) -> object:
                try:
                    return await client.infer("isolate", x(value(i)), timeout=60)
                except (ServerBusy, InferenceFailed, InvalidInput) as e:
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
            assert o.code == grpc.StatusCode.INTERNAL
        elif v >= 1e6:
            assert isinstance(o, InvalidInput), o
            assert o.code == grpc.StatusCode.INVALID_ARGUMENT
            assert o.message == f"model 'isolate' refused the inputs: X must be below 1e6, got {v}"
        else:
            assert o["Y"][0, 0] == 2 * v  # type: ignore[index]
    batches = gate.calls("isolate")
    assert sorted(batches[1]) == sorted(admitted)  # they really shared one batch first
    assert all(len(b) == 1 for b in batches[2:])  # then each rode alone


WIDEN_PY = """
import json, time, torch
from pathlib import Path
HERE = Path(__file__).parent
def load(device):
    def run(x):  # Y: each row its X, as wide as the batch's largest X
        with open(HERE / "entered.log", "a") as f:
            f.write(json.dumps(x[:, 0].tolist()) + "\\n")
        while (HERE / "hold").exists():
            time.sleep(0.005)
        return torch.ones(x.shape[0], int(x[:, 0].max())) * x[:, :1]
    return run
"""


def test_an_answer_a_neighbour_widened_past_what_a_response_carries_is_retried_alone(
    tmp_path: Path,
) -> None:
    """A request of 4 rows of 1 float shared a forward with one of 100,000 floats: its
    rows came back 100,000 wide, 1.6 MB, more than --max-message-bytes 1 MiB, and it
    failed RESOURCE_EXHAUSTED (review 57f). Alone, its answer is 4 floats: it is
    retried alone and answered; the wide one is answered from the first forward."""
    model = tmp_path / "repo" / "widen"
    model.mkdir(parents=True)
    (model / "model.toml").write_text(
        MODEL_TOML.replace("shape = [1]\n\n[batching]", "shape = [-1]\n\n[batching]").replace(
            "max_queue_delay_us = 2000", "max_queue_delay_us = 10_000_000"))  # fmt: skip
    (model / "model.py").write_text(WIDEN_PY)
    (model / "hold").touch()
    args = ("--max-message-bytes", str(1 << 20), "--workers", "1")
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()

    def call(x: np.ndarray) -> np.ndarray:
        with Client(server.url) as c:
            return c.infer("widen", {"X": x.astype(np.float32)}, timeout=60)["Y"]

    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(call, np.ones((1, 1)))  # holds the worker: the next two queue
            wait_for(lambda: (model / "entered.log").exists(), 30, "the first forward")
            innocent = pool.submit(call, np.ones((4, 1)))
            wide = pool.submit(call, np.full((1, 1), 100_000))
            pending = "batchd_inference_pending_request_count"
            wait_for(lambda: total(scrape(server), pending, model="widen") == 2, 30, "both queued")
            (model / "hold").unlink()
            assert first.result().shape == (1, 1)
            assert innocent.result().tolist() == [[1.0]] * 4
            assert wide.result().shape == (1, 100_000)
        forwards = [json.loads(line) for line in (model / "entered.log").read_text().splitlines()]
        assert sorted(forwards[1]) == [1.0, 1.0, 1.0, 1.0, 100_000.0]  # together first
        assert forwards[2:] == [[1.0] * 4]  # then the innocent alone
    finally:
        assert server.stop() == 0, server.log()


def test_no_live_worker_then_recovery(tmp_path: Path) -> None:
    """With its only worker dead the model and the server are not ready; requests
    wait in the queue (4) for the worker to return and the rest are turned away.
    The replacement's load() is held, so the outage lasts until the test ends it."""
    model = make_model(tmp_path / "repo", "solo", 2.0, MODEL_TOML + "max_queue_size = 4\n")
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    hold = load_gate(model)
    try:
        with Client(server.url) as c, grpc.insecure_channel(server.url) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service)).status

            restarts_before = worker_restarts(server)
            hold.touch()
            os.kill(server.worker_pids()[0], signal.SIGKILL)
            wait_for(lambda: not c.model_ready("solo"), 60, "the model to be not ready")
            assert not c.ready()
            assert status("") == status("solo") == health_pb2.HealthCheckResponse.NOT_SERVING

            async def outage() -> list[object]:
                async with AsyncClient(server.url) as ac:
                    calls = [
                        asyncio.ensure_future(outcome(ac.infer("solo", x(v), timeout=60)))
                        for v in range(6)
                    ]
                    await asyncio.wait_for(finished(calls, 2), 60)
                    refused = [t.result() for t in calls if t.done()]
                    assert all(isinstance(r, ServerBusy) for r in refused), refused
                    assert len(refused) == 2  # the four admitted wait: no worker serves solo
                    assert not await ac.model_ready("solo")
                    hold.unlink()
                    return list(await asyncio.wait_for(asyncio.gather(*calls), 60))

            out = asyncio.run(outage())
            busy = [o for o in out if isinstance(o, ServerBusy)]
            served = {v: float(o["Y"][0, 0]) for v, o in enumerate(out) if isinstance(o, dict)}
            assert len(busy) == 2 and len(served) == 4
            assert all(y == 2 * v for v, y in served.items())
            wait_for(c.ready, 60, "ServerReady")
            assert status("") == health_pb2.HealthCheckResponse.SERVING
            assert worker_restarts(server) - restarts_before == 1
    finally:
        hold.unlink(missing_ok=True)
        assert server.stop() == 0, server.log()


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
            # draining, it takes no new connection and sent GOAWAY on those it had
            closed = lambda: not listening(server.port)  # noqa: E731
            await asyncio.to_thread(wait_for, closed, 30, "the port to close")
            refused: object = None
            # one retry, as the README asks: a call sent before the client reads the GOAWAY
            # can be CANCELLED by gRPC itself (Status codes); its retry is refused
            client.retry = dataclasses.replace(client.retry, retries=1)
            try:
                await client.infer("gated", x(9), timeout=5)
            except ServerUnavailable as e:
                refused = e
            gate.open()
            return list(await asyncio.gather(*admitted)), refused

    results, refused = asyncio.run(scenario())
    assert [r["Y"][0, 0] for r in results] == [2, 4, 6]  # type: ignore[index]
    assert isinstance(refused, ServerUnavailable), refused
    assert server.stop() == 0
    assert not any(alive(p) for p in workers)


def test_a_sighup_drains_as_a_sigterm_and_a_signal_as_it_starts_stops_it_cleanly(
    tmp_path: Path,
) -> None:
    """SIGHUP (a closed terminal's) ended the server at once: no drain, no "stopped",
    its private files left (review 58c); it drains and stops as SIGTERM does. A SIGTERM
    as it started (its first second: the ports opening) killed it too, -15: the signals
    are the server's from the first thing it does, and it stops cleanly."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    (tmp_path / "hup").mkdir()
    (tmp_path / "early").mkdir()
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # (a suite run under nohup: the
    try:  # server would inherit its SIG_IGN, and keep it, as a server under nohup does)
        s = ServerProcess(tmp_path / "repo", log_dir=tmp_path / "hup").start()
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert s.stop(signal.SIGHUP) == 0, s.log()
    assert "stopping: not ready" in s.log() and "stopped (pid" in s.log()
    early = ServerProcess(tmp_path / "repo", log_dir=tmp_path / "early").start(ready=False)
    wait_for(lambda: "model repository" in early.log(), 60, "its first line")
    assert early.stop() == 0, early.log()
    assert "stopped (pid" in early.log()


def test_workers_connect_again_after_their_socket_file_was_removed(tmp_path: Path) -> None:
    """A /tmp cleaner removed the workers' ipc:// socket (here its folders too): a worker
    restarted after it could never connect, and the server stayed live and unready for
    good (review 58c). The frontend listens there again, beside the connections it has
    (closing the old listener cut them: late review 58e); the restarted worker serves.
    A socket another process put there is left to it, said once."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    endpoint = tmp_path / "deep" / "er" / "w.sock"
    endpoint.parent.mkdir(parents=True)
    s = ServerProcess(tmp_path / "repo", "--worker-endpoint", f"ipc://{endpoint}",
                      log_dir=tmp_path, workers=1).start()  # fmt: skip
    try:
        shutil.rmtree(tmp_path / "deep")
        wait_for(lambda: "was removed; listening there again" in s.log(), 30, "it to listen again")
        with Client(s.url) as c:
            assert c.infer("scaled", x(1.0), timeout=30)["Y"][0, 0] == 2.0
            (worker,) = s.worker_pids()
            os.kill(worker, signal.SIGKILL)
            wait_for(lambda: worker not in s.worker_pids() and c.model_ready("scaled"), 60,
                     "a new worker serving")  # fmt: skip
            assert c.infer("scaled", x(2.0), timeout=30)["Y"][0, 0] == 4.0
        assert "connected again" not in s.log() and s.log().count("was removed") == 1
        endpoint.unlink()
        other = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            other.bind(f"ipc://{endpoint}")  # (another server's, say)
            mine = endpoint.stat().st_ino
            wait_for(lambda: "was replaced by another process's" in s.log(), 30, "it to say so")
            assert endpoint.stat().st_ino == mine  # not taken back
        finally:
            other.close(linger=0)
    finally:
        assert s.stop() == 0, s.log()


def test_a_sigint_ends_the_drain_notice_at_once(tmp_path: Path) -> None:
    """Ctrl-C after a SIGTERM (an operator who will not wait out the notice) left the
    server serving for all of --drain-notice: the second signal was ignored. A SIGINT now
    ends the notice, and the drain goes on; frontend 0 passes it on to the others. A
    SIGTERM to the whole group (systemd) reaches a child frontend twice, from frontend 0
    too: that is not a second signal (late review: the child's notice ended at once)."""
    server = ServerProcess(TEST_MODELS, "--drain-notice", "600", "--frontends", "2",
                           log_dir=tmp_path, new_session=True).start()  # fmt: skip
    assert server.proc is not None
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        wait_for(lambda: server.log().count("stopping: not ready") == 2, 30, "both notices")
        time.sleep(1.0)  # (the condition: a second of notice passed)
        server.proc.send_signal(signal.SIGINT)  # frontend 0's alone
        assert server.proc.wait(60) == 0, server.log()
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
    cut = re.findall(r"SIGINT: the drain notice ends after ([0-9.]+) s", server.log())
    assert len(cut) == 2 and all(float(s) >= 1.0 for s in cut), server.log()
    assert "the drain notice is over: new job uploads are refused" in server.log()


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
    (worker,) = server.worker_pids()
    assert server.stop() == 0
    log = server.log()
    assert "drain timeout: answering 3 open request(s) UNAVAILABLE" in log
    assert (state_dir / f"atexit-{worker}").exists()  # its atexit handlers ran, hung as it was
    # the hung model's worker leaves by itself after the 5 s grace (README, failure model),
    # however often the stopping frontend answers its READY with STOP again
    assert "the model is still running after 5 s; exiting without it" in log


def test_a_batch_staged_behind_others_is_timed_from_its_own_forward(tmp_path: Path) -> None:
    """Three batches on one worker at once (three credits, as with several frontends
    sharing it): each forward takes 1 s, the limit is 1.5 s. The third waits 2 s behind
    the others and runs in 3 s from its send: timed from its send it was taken for
    stuck (a frontend's heartbeat round, once a second, always fell in its 1.5 s
    window past the limit), its worker killed and the calls retried until they failed."""
    repo = tmp_path / "repo"
    slow = repo / "slow"
    slow.mkdir(parents=True)
    toml = MODEL_TOML.replace("max_batch_size = 8", "max_batch_size = 1")
    (slow / "model.toml").write_text(toml + "\n[instances]\nexecution_timeout_s = 1.5\n")
    (slow / "model.py").write_text(
        "import time\n\ndef load(device):\n"
        "    def run(x):\n        time.sleep(1.0)  # a forward's work\n        return x * 2\n"
        "    return run\n"
    )
    server = ServerProcess(repo, "--credits-per-worker", "3", log_dir=tmp_path).start()

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as client:
            calls = [client.infer("slow", x(v), timeout=60) for v in (1, 2, 3)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    try:
        out = asyncio.run(scenario())
        assert [o["Y"][0, 0] for o in out] == [2, 4, 6], out  # type: ignore[index]
        assert worker_restarts(server) == 0
    finally:
        assert server.stop() == 0
    assert "ran past execution_timeout_s" not in server.log()
