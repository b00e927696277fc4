"""Start and stop a real `batchd serve` process for integration tests."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from batchd.client import Client

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
TEST_MODELS = Path(__file__).resolve().parent / "models"
_LISTENING = re.compile(r"serving gRPC on \S*:(\d+);")  # (an IPv6 host has colons)
_HTTP = re.compile(r"serving HTTP on \S*:(\d+)$", re.MULTILINE)
_METRICS = re.compile(r"metrics on (http://\S+/metrics)")


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _leads_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def is_zygote(pid: int) -> bool:
    """Whether process `pid` is a worker zygote (worker/zygote.py), or a worker it forked."""
    return b"batchd.worker.zygote" in _cmdline(pid)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def distro_binary(binary: str, package: str, where: str = "/usr/sbin") -> str:
    """The path of a distribution package's binary (on PATH, or `where`, a glob):
    installed now if this runs as root with apt-get, or the test is skipped saying why."""

    def look() -> str | None:
        found = sorted(glob.glob(f"{where}/{binary}"))
        return shutil.which(binary) or (found[-1] if found else None)

    if found := look():
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{binary} is not installed and apt-get cannot install {package} here")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        done = subprocess.run(step, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode:
            pytest.skip(f"cannot install {package}: {done.stderr.strip()[-300:]}")
    found = look()
    if found is None:
        pytest.skip(f"{package} installed no {binary}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def listening(port: int) -> bool:
    """Whether something takes connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


TEST_DEVICE = os.environ.get("BATCHD_TEST_DEVICE", "")  # .ci/gpu-test: cuda:0
FIRST_SLOT = TEST_DEVICE.replace(":", "") if TEST_DEVICE not in ("", "cpu") else "cpu0"


def workers_on(count: int) -> tuple[str, ...]:
    """`--workers COUNT` (CPU), or with BATCHD_TEST_DEVICE=cuda:0 that many workers on
    that device: how the suite runs the servers it starts on a GPU machine."""
    if TEST_DEVICE:
        return ("--devices", ",".join([TEST_DEVICE] * count))
    return ("--workers", str(count))


class ServerProcess:
    def __init__(
        self,
        repo: Path,
        *args: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        workers: int = 1,
        new_session: bool = False,  # its own process group, as a service manager starts it
        cwd: Path | None = None,  # its working directory (a relative `repo` is read there)
    ) -> None:
        self.repo, self.args, self.log_dir, self.cwd = repo, list(args), log_dir, cwd
        self.env = {**os.environ, **(env or {})}
        self.workers = workers
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.http_port = 0  # once started, unless --http-port -1
        self.log_path = log_dir / f"server-{time.monotonic_ns()}.log"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def start(
        self, timeout: float = 90.0, ready: bool = True, token: str | None = None
    ) -> ServerProcess:
        """Start it; wait for its port and, with `ready`, for ServerReady (asked with
        `token` when the server wants one). A server that never gets ready is stopped."""
        cmd = [
            sys.executable,
            "-m",
            "batchd.server",
            "--model-repository",
            str(self.repo),
            "--grpc-port",
            "0",
            *(() if "--http-port" in self.args else ("--http-port", "0")),
            "--metrics-port",
            "0",
            *workers_on(self.workers),
            "--threads-per-worker",
            "1",
            *self.args,
        ]
        if "--drain-notice" not in self.args:  # tests that stop a server wait for no balancer
            cmd += ["--drain-notice", "0"]
        if "--jobs-dir" not in self.args:  # its own: one server per jobs directory
            cmd += ["--jobs-dir", str(self.log_dir / f"jobs-{time.monotonic_ns()}")]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=self.new_session,
                cwd=self.cwd,
            )

        def listening() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            text = self.log()
            m = _LISTENING.search(text)
            if m:
                self.port = int(m.group(1))
            if h := _HTTP.search(text):
                self.http_port = int(h.group(1))
            return bool(m)

        wait_for(listening, timeout, "the server to listen")
        if ready:
            try:
                with Client(self.url, token=token) as c:
                    wait_for(c.ready, timeout, "ServerReady")
            except BaseException:
                self.stop()
                raise
        return self

    def metrics_url(self) -> str:
        wait_for(lambda: _METRICS.search(self.log()) is not None, 30, "the metrics endpoint")
        match = _METRICS.search(self.log())
        assert match is not None
        return match.group(1)

    def worker_pids(self) -> list[int]:
        """Its child processes, but for the worker zygote: its children (the workers
        forked from it, each in a session of its own: not the zygote's probe, a fork that
        exits at once) in its place. Not one forked that has not exec'd yet (it is the
        server's copy, in that instant, and may be becoming the zygote), nor one whose
        command line reads empty (in its exec: the zygote's was taken for a worker)."""
        assert self.proc is not None
        zygotes, own = self.zygote_pids(), _cmdline(self.proc.pid)
        found = [
            p for p in children(self.proc.pid) if p not in zygotes and _cmdline(p) not in (own, b"")
        ]
        return found + [w for z in zygotes for w in children(z) if _leads_session(w)]

    def zygote_pids(self) -> list[int]:
        """Its worker zygote (server/zygote.py), if one runs (BATCHD_WORKER_ZYGOTE=0: none)."""
        assert self.proc is not None
        return [p for p in children(self.proc.pid) if is_zygote(p)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server, wait, and check that no worker process outlives it. One that
        does not stop in time is killed, with its workers, and the test fails (it was left
        running, its workers too, past the suite: a SIGHUP ignored under nohup did it)."""
        assert self.proc is not None
        workers = self.worker_pids() + self.zygote_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *workers]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
            raise
        wait_for(lambda: not any(alive(p) for p in workers), 10, "workers to exit")
        return code


@contextlib.contextmanager
def grpc_servicer(add: Callable[[Any, Any], None], servicer: Any) -> Iterator[int]:
    """An in-process gRPC server of one servicer (`add_XServicer_to_server`) on a free
    loopback port, serving while the block runs: its port."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)
