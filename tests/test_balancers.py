"""Replicas behind real load balancers: three batchd servers on loopback with haproxy
(and nginx) in front, configured by deploy/render.py, as deploy/ ships them.

haproxy and nginx come from the distribution's packages: installed here when the
test runs as root with apt-get, skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from batchd.client import BatchdClientError, Client
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import jobs_pb2
from tests.conftest import Gate
from tests.servers import (
    EXAMPLES,
    ROOT,
    TEST_MODELS,
    ServerProcess,
    distro_binary,
    listening,
    wait_for,
)

sys.path.insert(0, str(ROOT / "deploy"))
import render

pytestmark = pytest.mark.slow
TINY = np.zeros((1, 16), np.float32)
LOAD_THREADS = 8  # callers sending at once while a replica is killed or drained
SLOW_LOAD = """
import os, time
from pathlib import Path
import torch

def load(device):
    while (Path(os.environ["BATCHD_TEST_DIR"]) / "load-closed").exists():
        time.sleep(0.01)
    return lambda x: x
"""


def _repo(root: Path) -> Path:
    """examples' tiny and tests' gated and limited: every replica serves the same."""
    shutil.copytree(EXAMPLES / "tiny", root / "tiny")
    for m in ("gated", "limited"):
        shutil.copytree(TEST_MODELS / m, root / m)
    return root


class Cluster:
    """Three replicas (one worker each) of one repository, sharing one gate."""

    def __init__(self, repo: Path, state: Path, logs: Path) -> None:
        self.repo, self.state, self.logs = repo, state, logs
        self.replicas: list[ServerProcess] = []

    def replica(self, *args: str, repo: Path | None = None) -> ServerProcess:
        return ServerProcess(  # (no ageing behind a per-call balancer: deploy/render.py)
            repo or self.repo, "--drain-notice", "3", "--max-connection-age", "0", *args,
            log_dir=self.logs,
            env={"BATCHD_TEST_DIR": str(self.state)},
        )  # fmt: skip

    def start(self, count: int = 3) -> None:
        with ThreadPoolExecutor(count) as pool:
            self.replicas = list(pool.map(lambda _: self.replica().start(), range(count)))

    def counts(self, model: str = "tiny") -> list[int]:
        """Rows each replica inferred for `model` (its own statistics)."""
        out = []
        for r in self.replicas:
            with Client(r.url) as c:
                out.append(c.model_statistics(model)[0].inference_count)
        return out

    def stop(self) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("cluster-state")
    c = Cluster(_repo(tmp_path_factory.mktemp("repo")), state, tmp_path_factory.mktemp("logs"))
    c.start()
    yield c
    Gate(state).open()
    c.stop()


class Haproxy:
    """haproxy with deploy/render.py's configuration and an admin socket."""

    def __init__(self, binary: str, cluster: Cluster, workdir: Path) -> None:
        self.binary, self.cluster, self.workdir = binary, cluster, workdir
        self.port = _free_port()
        self.socket = workdir / "admin.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Haproxy:
        cfg = render.haproxy(
            f"127.0.0.1:{self.port}", [r.url for r in self.cluster.replicas]
        ).replace("global\n", f"global\n    stats socket {self.socket} level admin\n", 1)
        (self.workdir / "haproxy.cfg").write_text(cfg)
        with (self.workdir / "haproxy.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-db", "-f", str(self.workdir / "haproxy.cfg")],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(lambda: self.states() == ["UP"] * len(self.cluster.replicas), 30,
                 "haproxy to see every replica UP")  # fmt: skip
        return self

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ask(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(command.encode() + b"\n")
            return b"".join(iter(lambda: s.recv(65536), b"")).decode()

    def stat(self) -> list[dict[str, str]]:
        """`show stat`: one row per server of the backend."""
        if not self.socket.exists():
            return []
        lines = self._ask("show stat").splitlines()
        head = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(head, line.split(","), strict=False)) for line in lines[1:] if line]
        return [r for r in rows if r["pxname"] == "batchd" and r["svname"] != "BACKEND"]

    def states(self) -> list[str]:
        return [r["status"] for r in self.stat()]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def haproxy(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Haproxy]:
    h = Haproxy(distro_binary("haproxy", "haproxy"), cluster, tmp_path_factory.mktemp("haproxy"))
    h.start()
    yield h
    h.stop()


def passes(client: Client) -> bool:
    """Whether a call through the balancer reaches a replica (False: not listening yet)."""
    try:
        return client.live()
    except BatchdClientError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_load(
    url: str, seconds: float, act: threading.Event, x: np.ndarray = TINY
) -> Counter[str]:
    """LOAD_THREADS callers sending tiny requests (`x`) over one channel for `seconds`;
    sets `act` once requests flow. The outcome of every request, by status."""
    outcomes: Counter[str] = Counter()
    with Client(url) as client:
        client.infer("tiny", x)
        end = time.monotonic() + seconds

        def caller() -> None:
            while time.monotonic() < end:
                try:
                    client.infer("tiny", x, timeout=20)
                    outcomes["OK"] += 1
                except BatchdClientError as e:
                    outcomes[f"{e.code.name}: {str(e)[:80]}"] += 1
                act.set()

        threads = [threading.Thread(target=caller) for _ in range(LOAD_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return outcomes


def _while_loaded(url: str, seconds: float, then: object, x: np.ndarray = TINY) -> Counter[str]:
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(under_load, url, seconds, started, x)
        assert started.wait(30)
        time.sleep(0.5)  # requests in flight on every replica when the replica goes
        then()  # type: ignore[operator]
        return load.result()


# ---- haproxy ----


def test_rendered_configurations_are_the_ones_shipped() -> None:
    """deploy/haproxy/haproxy.cfg and deploy/nginx/nginx.conf are deploy/render.py's
    output for three replicas, not hand-edited blobs."""
    replicas = ["10.0.0.11:8001", "10.0.0.12:8001", "10.0.0.13:8001"]
    shipped = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    assert shipped == render.haproxy("0.0.0.0:8001", replicas)
    assert (ROOT / "deploy" / "nginx" / "nginx.conf").read_text() == render.nginx(
        "0.0.0.0:8001", replicas
    )
    check = render.health_check_request()
    assert check.startswith(render.PREFACE) and check.endswith(b"\x00\x00\x00\x00\x00")


@pytest.mark.parametrize(
    "bad", ["10.0.0.11", "", "10.0.0.11:8001 backup", "10.0.0.11:8001\n", "h:0", "h:65536", "a;b:1"]
)
def test_render_refuses_a_replica_that_is_not_host_port(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replica without its port gave nginx a config sending gRPC to port 80; one with
    a space or a newline, a haproxy server line changed or without its check."""
    for balancer in ("haproxy", "nginx"):
        with pytest.raises(SystemExit) as exit_:
            render.main([balancer, "--replica", bad])
        assert exit_.value.code == 2 and "expected HOST:PORT" in capsys.readouterr().err
    for listen in ("*:8001", ":8001", "[::]:8001"):  # what haproxy and nginx bind to
        for replica in ("[::1]:8001", "h-1.example:1", "batchd_a:8001", "[fe80::1%eth0]:8001"):
            assert render.main(["haproxy", "--listen", listen, "--replica", replica]) == 0
    with pytest.raises(SystemExit):
        render.main(["nginx", "--replica", "*:8001"])  # (no replica is everywhere)


def test_one_channel_spreads_per_request(cluster: Cluster, haproxy: Haproxy) -> None:
    """300 calls over ONE client channel (one HTTP/2 connection to haproxy) land 100 on
    each replica: per call, not per connection."""
    before = cluster.counts()
    with Client(haproxy.url) as c:
        for _ in range(300):
            c.infer("tiny", TINY)
    spread = [a - b for a, b in zip(cluster.counts(), before, strict=True)]
    assert sum(spread) == 300
    assert all(90 <= n <= 110 for n in spread), spread


def test_resource_exhausted_and_its_pushback_pass_through(
    cluster: Cluster, haproxy: Haproxy
) -> None:
    """Full queues on every replica: RESOURCE_EXHAUSTED reaches the client through haproxy
    with the replica's message and its grpc-retry-pushback-ms trailer."""
    gate = Gate(cluster.state)
    gate.close()
    try:

        async def flood() -> list[grpc.aio.AioRpcError]:
            async with grpc.aio.insecure_channel(haproxy.url) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                msg = pb.ModelInferRequest(model_name="limited")
                msg.inputs.add(name="X", datatype="FP32", shape=[1, 1])
                msg.raw_input_contents.append(np.ones(1, np.float32).tobytes())
                calls = [asyncio.ensure_future(stub.ModelInfer(msg, timeout=60)) for _ in range(40)]
                # Refusals come back at once; the admitted calls wait behind the gate.
                done, held = await asyncio.wait(calls, timeout=3)
                for call in held:
                    call.cancel()
                return [e for c in done if isinstance(e := c.exception(), grpc.aio.AioRpcError)]

        errors = asyncio.run(flood())
    finally:
        gate.open()
    full = [e for e in errors if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert full, [e.code() for e in errors]
    for e in full:
        assert "queue" in (e.details() or "")
        pushback = dict(e.trailing_metadata() or ())["grpc-retry-pushback-ms"]
        assert int(pushback) > 0


def test_sigkill_of_a_replica_under_load_loses_no_request(
    cluster: Cluster, haproxy: Haproxy
) -> None:
    """haproxy retries the calls the killed replica never answered (retry-on
    empty-response) on the others: every request succeeds. Requests of 32 KB: haproxy
    resends only one it holds whole in a buffer, and its default 16 KiB lost 2-4 such
    calls each kill (review 56f; tune.bufsize 65536 now)."""
    victim, x = cluster.replicas[2], np.zeros((512, 16), np.float32)
    outcomes = _while_loaded(haproxy.url, 4.0, lambda: victim.proc and victim.proc.kill(), x)
    assert set(outcomes) == {"OK"}, outcomes
    assert outcomes["OK"] > 100
    victim.stop(signal.SIGKILL)  # reaps it and checks its workers left
    cluster.replicas[2] = cluster.replica("--grpc-port", victim.url.rsplit(":", 1)[1]).start()
    wait_for(lambda: haproxy.states() == ["UP"] * 3, 30, "the replica back UP")


def test_sigterm_drain_under_load_loses_no_request(cluster: Cluster, haproxy: Haproxy) -> None:
    """SIGTERM: the replica says NOT_SERVING and keeps serving for --drain-notice, haproxy's
    health check takes it out, it drains and exits 0: every request succeeds."""
    victim = cluster.replicas[1]
    assert victim.proc is not None
    start = time.monotonic()
    outcomes = _while_loaded(haproxy.url, 6.0, lambda: victim.proc.send_signal(signal.SIGTERM))
    assert set(outcomes) == {"OK"}, outcomes
    assert victim.proc.wait(30) == 0
    drained_s = time.monotonic() - start
    assert "stopping: not ready" in victim.log()
    assert drained_s < 30
    down = next(r for r in haproxy.stat() if r["svname"] == "replica2")
    assert down["status"] == "DOWN"
    cluster.replicas[1] = cluster.replica("--grpc-port", victim.url.rsplit(":", 1)[1]).start()
    wait_for(lambda: haproxy.states() == ["UP"] * 3, 30, "the replica back UP")


def test_health_check_marks_a_replica_down_and_up_through_grpc_health(
    cluster: Cluster, haproxy: Haproxy, tmp_path: Path
) -> None:
    """A replica whose port is open but whose model is still loading answers NOT_SERVING:
    haproxy keeps it DOWN on the gRPC answer (a layer-7 failure, not a refused
    connection), and marks it UP once the model is loaded and it answers SERVING."""
    victim = cluster.replicas[0]
    port = victim.url.rsplit(":", 1)[1]
    victim.stop()
    wait_for(lambda: haproxy.states()[0] == "DOWN", 30, "replica1 DOWN")
    slow = tmp_path / "repo"
    shutil.copytree(cluster.repo, slow)
    (slow / "tiny" / "model.py").write_text(SLOW_LOAD)
    (slow / "tiny" / "model.pt2").unlink()  # one artifact: model.py now
    gate = cluster.state / "load-closed"
    gate.touch()
    try:
        replica = cluster.replica("--grpc-port", port, repo=slow).start(ready=False)
        cluster.replicas[0] = replica

        def seen_serving_not() -> bool:
            row = haproxy.stat()[0]
            return row["status"] == "DOWN" and row["check_status"].startswith("L7")

        wait_for(seen_serving_not, 30, "a layer-7 (NOT_SERVING) check failure")
        with Client(replica.url) as c:
            assert c.live() and not c.ready()
    finally:
        gate.unlink()
    wait_for(lambda: haproxy.states()[0] == "UP", 60, "replica1 UP once SERVING")


L4 = """\
global
    stats socket {socket} level admin
defaults
    mode tcp
    timeout connect 2s
    timeout client 1m
    timeout server 1m
frontend l4
    bind 127.0.0.1:{port}
    default_backend batchd
backend batchd
    balance roundrobin
    default-server inter 200ms fall 1 rise 1
    server old {old} check
    server new {new} check
"""


def test_a_long_lived_channel_reaches_a_replica_started_after_it_connected(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Behind an L4 balancer (haproxy in tcp mode, as kube-proxy balances connections),
    a client's one channel is pinned to the replica it reached; --max-connection-age
    sends it GOAWAY, it reconnects, and its calls reach a replica started since."""
    binary = distro_binary("haproxy", "haproxy")
    age = ("--max-connection-age", "1", "--max-connection-age-grace", "1")
    old = cluster.replica(*age).start()
    new_port = _free_port()
    h = Haproxy(binary, cluster, tmp_path)
    cfg = L4.format(socket=h.socket, port=h.port, old=old.url, new=f"127.0.0.1:{new_port}")
    (tmp_path / "l4.cfg").write_text(cfg)
    proxy = subprocess.Popen([binary, "-db", "-f", str(tmp_path / "l4.cfg")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    new = None
    try:
        with Client(h.url) as c:
            wait_for(lambda: passes(c), 30, "the L4 balancer")
            for _ in range(20):
                c.infer("tiny", TINY)
            new = cluster.replica(*age, "--grpc-port", str(new_port)).start()

            def reached_new() -> bool:
                c.infer("tiny", TINY)
                with Client(new.url) as direct:
                    return direct.model_statistics("tiny")[0].inference_count > 0

            wait_for(reached_new, 30, "a call of the old channel on the new replica")
    finally:
        proxy.terminate()
        proxy.wait(10)
        for r in (old, new):
            if r is not None:
                r.stop()


def test_a_client_an_l4_balancer_pinned_to_a_draining_replica_moves_to_another(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Behind an L4 balancer (kube-proxy's way) a client's one connection stays on the
    replica it reached. Once that replica's drain notice is over it sends GOAWAY and closes
    its port, so the client's next calls connect anew, to the other replica: none fails.
    Before, every call and retry went on reaching the draining replica, refused, for as
    long as its drain lasted (here: a held request)."""
    binary = distro_binary("haproxy", "haproxy")
    old = cluster.replica("--drain-notice", "1", "--workers", "2").start()  # (one is held)
    new, new_port = None, _free_port()
    h = Haproxy(binary, cluster, tmp_path)
    cfg = L4.format(socket=h.socket, port=h.port, old=old.url, new=f"127.0.0.1:{new_port}")
    (tmp_path / "l4.cfg").write_text(cfg)
    proxy = subprocess.Popen([binary, "-db", "-f", str(tmp_path / "l4.cfg")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    gate, failures = Gate(cluster.state), []
    try:
        with Client(h.url, retries=5, timeout=30) as c, ThreadPoolExecutor(1) as pool:
            wait_for(lambda: passes(c), 30, "the L4 balancer")
            c.infer("tiny", TINY)  # its connection: to the old replica, the only one up
            new = cluster.replica("--grpc-port", str(new_port)).start()
            wait_for(lambda: h.states() == ["UP", "UP"], 30, "haproxy to see both UP")
            gate.close()
            before = len(gate.records("gated", "entered"))
            with Client(old.url) as direct:  # keeps the old replica draining
                held = pool.submit(direct.infer, "gated", {"X": np.ones((1, 1), np.float32)})
                wait_for(lambda: len(gate.records("gated", "entered")) > before, 30, "a hold")
                assert old.proc is not None
                old.proc.send_signal(signal.SIGTERM)

                def called_then_closed() -> bool:
                    try:
                        c.infer("tiny", TINY)
                    except BatchdClientError as e:
                        failures.append(e)
                    return not listening(int(old.url.rsplit(":", 1)[1]))

                wait_for(called_then_closed, 30, "the draining replica to close its port")
                for _ in range(20):
                    c.infer("tiny", TINY)
                gate.open()
                assert held.result(60)["Y"][0, 0] == 2.0
            assert old.proc.wait(30) == 0
        assert failures == []
        with Client(new.url) as direct:
            assert direct.model_statistics("tiny")[0].inference_count >= 20
    finally:
        gate.open()
        proxy.terminate()
        proxy.wait(10)
        for r in (old, new):
            if r is not None:
                r.stop()


# ---- nginx ----


@pytest.fixture(scope="module")
def nginx(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = distro_binary("nginx", "nginx")
    work = tmp_path_factory.mktemp("nginx")
    port = _free_port()
    conf = render.nginx(f"127.0.0.1:{port}", [r.url for r in cluster.replicas])
    (work / "nginx.conf").write_text(conf)
    with (work / "nginx.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, "-p", str(work), "-c", str(work / "nginx.conf"), "-g", "daemon off;"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"127.0.0.1:{port}"
    with Client(url) as c:
        wait_for(lambda: passes(c), 30, "nginx to pass a call")
    yield url
    proc.terminate()
    proc.wait(10)


def test_nginx_spreads_per_request(cluster: Cluster, nginx: str) -> None:
    before = cluster.counts()
    with Client(nginx) as c:
        for _ in range(90):
            c.infer("tiny", TINY)
    spread = [a - b for a, b in zip(cluster.counts(), before, strict=True)]
    assert sum(spread) == 90 and all(20 <= n <= 40 for n in spread), spread


def test_nginx_fails_only_the_calls_in_flight_on_a_killed_replica(
    cluster: Cluster, nginx: str
) -> None:
    """nginx cannot retry a call whose replica died mid-answer: those calls, at most
    the LOAD_THREADS in flight, fail as UNAVAILABLE; every other call succeeds."""
    victim = cluster.replicas[2]
    outcomes = _while_loaded(nginx, 4.0, lambda: victim.proc and victim.proc.kill())
    failed = {k: n for k, n in outcomes.items() if k != "OK"}
    assert all(k.startswith("UNAVAILABLE") for k in failed), outcomes
    assert sum(failed.values()) <= LOAD_THREADS, outcomes
    assert outcomes["OK"] > 100
    victim.stop(signal.SIGKILL)


# ---- each replica in its own network namespace, as if on its own node ----


class NetnsReplica:
    """A replica in its own network namespace, reached over a veth pair: 10.214.K.2, K
    of this process and `n` (fixed, a run killed before it cleaned up, its namespaces
    holding the addresses, failed every run after it: the replicas were unreachable)."""

    def __init__(self, n: int, repo: Path, logs: Path, state: Path) -> None:
        tag, net = f"{os.getpid() % 100000}{n}", f"10.214.{os.getpid() % 80 * 3 + n}"
        self.ns, self.host_if, self.ns_if = f"batchd-{tag}", f"bdh{tag}", f"bdn{tag}"
        self.url = f"{net}.2:8001"
        ip = ["ip"]
        for cmd in (
            [*ip, "netns", "add", self.ns],
            [*ip, "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            [*ip, "link", "set", self.ns_if, "netns", self.ns],
            [*ip, "addr", "add", f"{net}.1/30", "dev", self.host_if],
            [*ip, "link", "set", self.host_if, "up"],
            [*ip, "-n", self.ns, "addr", "add", f"{net}.2/30", "dev", self.ns_if],
            [*ip, "-n", self.ns, "link", "set", self.ns_if, "up"],
            [*ip, "-n", self.ns, "link", "set", "lo", "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        serve = [
            *("ip", "netns", "exec", self.ns, sys.executable, "-m", "batchd.server"),
            *("--model-repository", str(repo), "--host", f"{net}.2", "--grpc-port", "8001"),
            *("--http-port", "-1", "--metrics-port", "-1", "--workers", "1"),
            *("--threads-per-worker", "1", "--jobs-dir", str(logs / f"jobs-{tag}")),
        ]
        with (logs / f"{self.ns}.log").open("wb") as log:
            self.proc = subprocess.Popen(
                serve, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "BATCHD_TEST_DIR": str(state)},
            )  # fmt: skip

    def ready(self) -> bool:
        with Client(self.url) as c:
            try:
                return c.ready()
            except BatchdClientError:
                return False

    def remove(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)


def test_replicas_in_their_own_network_namespaces(cluster: Cluster, tmp_path: Path) -> None:
    """The same guarantees with each replica on its own network stack (a veth pair each,
    as on its own node): calls of one channel spread per call, and neither a SIGTERM
    nor a SIGKILL of a replica under load loses a call."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    binary = distro_binary("haproxy", "haproxy")
    replicas: list[NetnsReplica] = []
    try:
        for n in (1, 2, 3):
            replicas.append(NetnsReplica(n, cluster.repo, tmp_path, cluster.state))
        for r in replicas:
            wait_for(r.ready, 90, f"the replica in {r.ns}")
        nodes = Cluster(cluster.repo, cluster.state, tmp_path)
        nodes.replicas = replicas  # type: ignore[assignment]  (they have .url)
        h = Haproxy(binary, nodes, tmp_path).start()
        try:
            before = nodes.counts()
            with Client(h.url) as c:
                for _ in range(300):
                    c.infer("tiny", TINY)
            spread = [a - b for a, b in zip(nodes.counts(), before, strict=True)]
            assert spread == [100, 100, 100], spread
            drain = replicas[1].proc.send_signal
            drained = _while_loaded(h.url, 5.0, lambda: drain(signal.SIGTERM))
            assert set(drained) == {"OK"}, drained
            assert replicas[1].proc.wait(30) == 0
            killed = _while_loaded(h.url, 3.0, lambda: replicas[2].proc.kill())
            assert set(killed) == {"OK"}, killed
        finally:
            h.stop()
    finally:
        for r in replicas:
            r.remove()


def test_nginx_passes_a_job_upload_larger_than_64_mib(
    cluster: Cluster, nginx: str, tmp_path: Path
) -> None:
    """A SubmitJob stream is one request body to nginx: its client_max_body_size is off
    (0), or a 70 MB upload gets 413; batchd applies its own limits."""
    line = json.dumps({"custom_id": "c{}", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                       "shape": [1, 8000], "data": [1.5] * 8000}]})  # fmt: skip
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        n = 70_000_000 // len(line) + 1
        for i in range(n):
            f.write(line.replace("c{}", f"c{i}") + "\n")
    assert path.stat().st_size > 64 * 1024 * 1024
    with Client(nginx, timeout=None) as c:
        job = c.submit_job("tiny", path)  # (the replica's own jobs: SQLite, not shared)
        assert job.total == n


DYING_BACKEND = """
import os, sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from batchd.protos import inference_pb2_grpc, jobs_pb2_grpc

def died(name):
    with open(sys.argv[1], "a") as f:
        f.write(name + "\\n")
    os._exit(1)  # after the call came whole, before any answer: haproxy sees none

class Jobs(jobs_pb2_grpc.JobsServicer):
    def SubmitJob(self, pieces, context):
        for _ in pieces:
            pass
        died("SubmitJob")

class Inference(inference_pb2_grpc.GRPCInferenceServiceServicer):
    def ModelInfer(self, request, context):
        died("ModelInfer")

server = grpc.server(futures.ThreadPoolExecutor(4))
checks = health.HealthServicer()
checks.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(checks, server)
jobs_pb2_grpc.add_JobsServicer_to_server(Jobs(), server)
inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Inference(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


def dying_backends(tmp_path: Path, calls: Path) -> tuple[list[subprocess.Popen[str]], list[int]]:
    """Five DYING_BACKEND processes and the ports they took (port 0: one picked free and
    then bound was once another test's server, whose health checks passed until it went)."""
    (tmp_path / "backend.py").write_text(DYING_BACKEND)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(calls)],
                              stdout=subprocess.PIPE, text=True) for _ in range(5)]  # fmt: skip
    ports = []
    for p in procs:
        assert p.stdout is not None
        with p.stdout:  # (it says nothing more)
            ports.append(int(p.stdout.readline()))
    return procs, ports


def submit_in_one_frame(url: str) -> None:
    """A SubmitJob as a unary call sends it (as other clients may): its one piece ends
    the stream. The backends here die on it: it fails."""
    with grpc.insecure_channel(url) as channel, pytest.raises(grpc.RpcError):
        unary = channel.unary_unary(
            "/batchd.jobs.v1.Jobs/SubmitJob",
            request_serializer=jobs_pb2.SubmitJobRequest.SerializeToString,
            response_deserializer=jobs_pb2.Job.FromString,
        )
        unary(jobs_pb2.SubmitJobRequest(model_name="m", data=b"{}\n"), timeout=30)


def test_haproxy_never_sends_a_job_submission_twice(tmp_path: Path) -> None:
    """Five replicas that each die once a call has come whole, before answering: an
    inference call is sent again to the next (it has no side effect), a job submission
    is not (the replica may have stored it: a second would run it twice), whether it
    comes as grpc's Python client sends it (a client stream ending in a frame of its
    own, which haproxy does not resend anyway) or ending with its one piece, as a
    unary call is sent and as other clients may send it (resent without the rule)."""

    class Url:
        def __init__(self, port: int) -> None:
            self.url = f"127.0.0.1:{port}"

    calls = tmp_path / "calls.log"
    procs, ports = dying_backends(tmp_path, calls)
    backends = [Url(port) for port in ports]
    nodes = Cluster(tmp_path, tmp_path, tmp_path)
    nodes.replicas = backends  # type: ignore[assignment]  (they have .url)
    h = Haproxy(distro_binary("haproxy", "haproxy"), nodes, tmp_path).start()
    try:
        with Client(h.url) as c, pytest.raises(BatchdClientError):
            c.submit_job("m", [{"custom_id": "a", "inputs": []}])
        assert calls.read_text().split() == ["SubmitJob"]
        wait_for(lambda: h.states().count("UP") == 4, 30, "haproxy to see it down")
        submit_in_one_frame(h.url)
        assert calls.read_text().split() == ["SubmitJob", "SubmitJob"]
        wait_for(lambda: h.states().count("UP") == 3, 30, "haproxy to see it down")
        with Client(h.url) as c, pytest.raises(BatchdClientError):
            c.infer("m", {"X": np.zeros((1, 1), np.float32)})
        assert calls.read_text().split().count("ModelInfer") >= 2  # sent again
    finally:
        h.stop()
        for p in procs:
            p.kill()
            p.wait()


def test_nginx_never_sends_a_job_submission_twice(tmp_path: Path) -> None:
    """Five replicas that each die once a call has come whole, before answering, behind
    nginx as deploy/ configures it: nginx streams a gRPC request body to its replica,
    so it sends no call again once it went, a job submission in either framing (the
    replica may have stored it) nor an inference call, which then fails."""
    calls = tmp_path / "calls.log"
    procs, ports = dying_backends(tmp_path, calls)
    url = f"127.0.0.1:{_free_port()}"
    (tmp_path / "nginx.conf").write_text(render.nginx(url, [f"127.0.0.1:{p}" for p in ports]))
    binary = distro_binary("nginx", "nginx")
    with (tmp_path / "nginx.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # (the backends listen: they said their ports)
        wait_for(lambda: listening(int(url.rsplit(":", 1)[1])), 30, "nginx to listen")
        with Client(url) as c, pytest.raises(BatchdClientError):
            c.submit_job("m", [{"custom_id": "a", "inputs": []}])
        assert calls.read_text().split() == ["SubmitJob"]
        submit_in_one_frame(url)
        assert calls.read_text().split() == ["SubmitJob", "SubmitJob"]
        with Client(url) as c, pytest.raises(BatchdClientError):
            c.infer("m", {"X": np.zeros((1, 1), np.float32)})
        assert calls.read_text().split() == ["SubmitJob", "SubmitJob", "ModelInfer"]
    finally:
        proc.terminate()
        proc.wait(10)
        for p in procs:
            p.kill()
            p.wait()
