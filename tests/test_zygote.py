"""Workers forked from a zygote (worker/zygote.py, server/zygote.py): the zygote alone,
as the supervisor drives it, then under a real server, each failure done for real."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd.client import Client
from batchd.server import zygote
from tests.conftest import MODEL_TOML, make_model, worker_restarts, workers_up
from tests.servers import ServerProcess, alive, children, is_zygote, wait_for


class Zygote:
    """`python -m batchd.worker.zygote` run as the supervisor runs it."""

    def __init__(self, out: Path) -> None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "batchd.worker.zygote", "--stdout-fd", str(fd)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, pass_fds=(fd,),
                start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(fd)
        assert self.told() == {"ready": self.proc.pid}

    def told(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "the zygote said nothing"
        return json.loads(self.proc.stdout.readline())  # type: ignore[no-any-return]

    def fork(self, *argv: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(list(argv)).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.told()
        return int(answer["pid"])


@pytest.fixture
def zygote_process(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path / "out.txt")
    yield z
    if z.proc.poll() is None:
        z.proc.kill()
    z.proc.wait()
    for pipe in (z.proc.stdin, z.proc.stdout):
        if pipe is not None:
            pipe.close()


def _signals(pid: int, field: str) -> int:
    """A /proc/PID/status signal mask (SigBlk, SigIgn, SigCgt)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(field)


def _bit(sig: int) -> int:
    return 1 << (sig - 1)


def _hanging(parent: int, repo: Path) -> list[str]:
    """A worker's argv: it runs on, connecting to nothing, while `parent` lives."""
    return ["--connect", "tcp://127.0.0.1:1", "--id", "w", "--parent-pid", str(parent),
            "--model-repository", str(repo)]  # fmt: skip


def test_a_forked_worker_is_born_as_an_exec_d_one_was(
    zygote_process: Zygote, tmp_path: Path
) -> None:
    """Its own session (before its pid is told), SIGTERM blocked at birth (one sent at
    once does not kill it: it takes it once it handles it), stdin /dev/null, stdout the
    one the zygote was given, none of the zygote's pipes; its exit is told, by signal."""
    z = zygote_process
    pid = z.fork(*_hanging(z.proc.pid, tmp_path))
    assert os.getsid(pid) == pid
    os.kill(pid, signal.SIGTERM)  # (as it starts: blocked, then taken and dropped)
    wait_for(lambda: _signals(pid, "SigCgt") & _bit(signal.SIGTERM), 30, "its handler")
    assert not _signals(pid, "SigBlk") & _bit(signal.SIGTERM)  # unblocked by the worker
    assert not _signals(pid, "SigIgn") & _bit(signal.SIGCHLD)
    fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert fds[0] == os.devnull and fds[1] == str(tmp_path / "out.txt")
    assert z.proc.stdin is not None and z.proc.stdout is not None
    pipes = {f"pipe:[{os.fstat(f.fileno()).st_ino}]" for f in (z.proc.stdin, z.proc.stdout)}
    assert not pipes & set(fds.values())
    os.kill(pid, signal.SIGKILL)
    assert z.told() == {"exit": pid, "code": -signal.SIGKILL}


def test_a_worker_s_exit_code_is_told(zygote_process: Zygote, tmp_path: Path) -> None:
    """A worker that exits 2 (a bad --connect) is told so, and says why where a worker's
    stderr goes."""
    z = zygote_process
    pid = z.fork("--connect", "")
    assert z.told() == {"exit": pid, "code": 2}
    assert "--connect is required" in (tmp_path / "out.txt").read_text()


def test_at_eof_the_zygote_exits_and_its_workers_stop(
    zygote_process: Zygote, tmp_path: Path
) -> None:
    """Its frontend gone (or done): it exits at once, and each worker it forked sees
    its parent change and stops, as it did when the frontend that exec'd it died."""
    z = zygote_process
    workers = [z.fork(*_hanging(z.proc.pid, tmp_path)) for _ in range(2)]
    assert z.proc.stdin is not None
    z.proc.stdin.close()
    assert z.proc.wait(10) == 0
    wait_for(lambda: not any(alive(w) for w in workers), 20, "its workers to stop")


def test_a_zygote_that_cannot_start_leaves_workers_to_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No zygote (one that says no `ready`, one that is not there): None, said once."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho nope\n")
    fake.chmod(0o755)

    async def body() -> list[object]:
        z = zygote.Zygote()
        got = [await z.fork(lambda parent: []) for _ in range(2)]
        await z.close()
        return got

    monkeypatch.setenv(zygote.SWITCH, "1")
    monkeypatch.setattr(zygote.sys, "executable", str(fake))
    with caplog.at_level(logging.ERROR, "batchd.supervisor"):
        assert asyncio.run(body()) == [None, None]
    assert [r.getMessage() for r in caplog.records] == [
        "the worker zygote did not start (it exited); workers are exec'd"]  # fmt: skip
    monkeypatch.setattr(zygote.sys, "executable", str(tmp_path / "none"))
    caplog.clear()
    with caplog.at_level(logging.ERROR, "batchd.supervisor"):
        assert asyncio.run(body()) == [None, None]
    assert len(caplog.records) == 1 and "could not start" in caplog.records[0].getMessage()


def test_a_zygote_closed_as_it_starts_is_ended_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop as the zygote starts (a server's first second; here one whose start hangs:
    a slow filesystem, a stuck import) waited for its start, up to READY_S (120 s: the
    stop ran past its drain, late review 58f). It is ended at once; it forks nothing."""
    hangs = tmp_path / "python"
    hangs.write_text("#!/bin/sh\nexec sleep 60\n")
    hangs.chmod(0o755)
    monkeypatch.setenv(zygote.SWITCH, "1")
    monkeypatch.setattr(zygote.sys, "executable", str(hangs))

    async def body() -> int | None:
        z = zygote.Zygote()
        starting = asyncio.create_task(z._running())
        for _ in range(1000):  # (its process made: its start under way)
            if z._starting_proc is not None:
                break
            await asyncio.sleep(0.01)
        await z.close()
        assert await starting is None and await z.fork(lambda parent: []) is None
        assert z._starting_proc is not None
        return z._starting_proc.returncode

    # ended (killed: -9, or 255 where asyncio's watcher came after the kill), not waited
    assert asyncio.run(body()) not in (None, 0)  # for (it sleeps 60 s, then exits 0)


def test_what_the_zygote_prints_before_it_is_ready_goes_to_the_frontend_s_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A line on its stdout before its `ready` (a sitecustomize's print under
    PYTHONUNBUFFERED=1) was taken for its answer: no zygote for the server's life
    (late review 58f). It is passed on, and the zygote forks."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho site: loaded\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)

    async def body() -> None:
        z = zygote.Zygote()
        forked = await z.fork(lambda parent: _hanging(parent, tmp_path))
        assert forked is not None
        forked.kill()
        assert await forked.wait() == -signal.SIGKILL
        await z.close()

    monkeypatch.setenv(zygote.SWITCH, "1")
    monkeypatch.setattr(zygote.sys, "executable", str(fake))
    asyncio.run(body())
    assert "site: loaded" in capfd.readouterr().out


def _server(tmp_path: Path, workers: int, env: dict[str, str] | None = None,
            **kw: Any) -> ServerProcess:  # fmt: skip
    """A server of `workers` local workers, through the zygote unless `env` says (a run
    of the suite under BATCHD_WORKER_ZYGOTE=0 tests it too)."""
    repo = tmp_path / "repo"
    if not repo.exists():
        make_model(repo, "m", 2.0)
    env = {zygote.SWITCH: "1", **(env or {})}
    return ServerProcess(repo, log_dir=tmp_path, workers=workers, env=env, **kw).start()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _answers(server: ServerProcess) -> float:
    with Client(server.url) as c:
        return float(c.infer("m", {"X": np.array([[3]], np.float32)}, timeout=30)["Y"][0, 0])


def test_a_killed_worker_is_forked_again_and_its_death_logged(tmp_path: Path) -> None:
    server = _server(tmp_path, 1)
    try:
        (z,) = server.zygote_pids()
        (worker,) = server.worker_pids()
        assert _parent(worker) == z
        wait_for(lambda: workers_up(server) == 1, 60, "the worker")
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: worker_restarts(server) == 1 and workers_up(server) == 1, 60, "again")
        print(f"restart to registered: {time.monotonic() - killed:.2f} s (through the zygote)")
        assert "process exited (killed by SIGKILL)" in server.log()
        (again,) = server.worker_pids()
        assert again != worker and _parent(again) == z and server.zygote_pids() == [z]
        assert _answers(server) == 6.0
    finally:
        assert server.stop() == 0, server.log()


def test_a_killed_zygote_loses_no_worker_s_exit_and_a_new_one_forks(tmp_path: Path) -> None:
    """Its workers, reparented, are killed and seen to exit (each restarted), and the
    next start starts another zygote."""
    server = _server(tmp_path, 2)
    try:
        wait_for(lambda: workers_up(server) == 2, 60, "both workers")
        (z,) = server.zygote_pids()
        workers = server.worker_pids()
        os.kill(z, signal.SIGKILL)
        wait_for(lambda: worker_restarts(server) == 2 and workers_up(server) == 2, 60, "back")
        assert not any(alive(w) for w in workers)
        assert f"the worker zygote (pid {z}) exited with code -9; killing its 2" in server.log()
        assert server.log().count("process exited (killed by SIGKILL)") == 2
        (z2,) = server.zygote_pids()
        assert z2 != z and sorted(server.worker_pids()) == sorted(children(z2))
        assert _answers(server) == 6.0
    finally:
        assert server.stop() == 0, server.log()


SEED_PY = """
import torch
def load(device):
    return lambda x: x * 0 + torch.initial_seed() % (1 << 20)  # (exact in FP32)
"""


def test_each_forked_worker_draws_its_own_torch_seed(tmp_path: Path) -> None:
    """torch's seed, drawn at each process's start, was the zygote's in every worker
    forked from it: two workers sampled the same numbers (exec'd, each drew its own)."""
    (model := tmp_path / "repo" / "seed").mkdir(parents=True)
    (model / "model.toml").write_text(MODEL_TOML)
    (model / "model.py").write_text(SEED_PY)
    server = _server(tmp_path, 2)
    try:
        wait_for(lambda: workers_up(server) == 2, 60, "both workers")
        seeds = set()
        with Client(server.url) as c:  # (one at a time: each to an idle worker, in turn)
            for _ in range(8):
                seeds.add(
                    float(
                        c.infer("seed", {"X": np.ones((1, 1), np.float32)}, timeout=30)["Y"][0, 0]
                    )
                )
        assert len(seeds) == 2, seeds
    finally:
        assert server.stop() == 0, server.log()


def test_a_stopped_zygote_is_replaced_and_its_workers_restarted(tmp_path: Path) -> None:
    """A zygote that tells nothing (SIGSTOP here) held every restart: a worker killed was
    never seen to exit, its slot down for good, nothing logged at ERROR (late review
    58f). A killed worker's exit not told within ANSWER_S: the zygote is killed, its
    workers seen to exit, a new zygote forks the restart."""
    server, z = _server(tmp_path, 1), 0
    try:
        wait_for(lambda: workers_up(server) == 1, 60, "the worker")
        (z,) = server.zygote_pids()
        (worker,) = server.worker_pids()
        os.kill(z, signal.SIGSTOP)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: worker_restarts(server) == 1 and workers_up(server) == 1, 60, "again")
        assert f"the worker zygote (pid {z}) hangs (it told no exit" in server.log()
        assert not alive(z) and server.zygote_pids() != [z]
        assert _answers(server) == 6.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            if z:
                os.kill(z, signal.SIGCONT)
        assert server.stop() == 0, server.log()


def test_a_killed_frontend_leaves_no_worker_nor_zygote(tmp_path: Path) -> None:
    server = _server(tmp_path, 2, new_session=True)
    assert server.proc is not None
    wait_for(lambda: workers_up(server) == 2, 60, "both workers")
    left = server.worker_pids() + server.zygote_pids()
    assert len(left) == 3
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    wait_for(lambda: not any(alive(p) for p in left), 20, "its workers and zygote to exit")


def test_the_switch_execs_each_worker(tmp_path: Path) -> None:
    server = _server(tmp_path, 1, env={zygote.SWITCH: "0"})
    try:
        assert server.proc is not None and server.zygote_pids() == []
        (worker,) = server.worker_pids()
        assert _parent(worker) == server.proc.pid and not is_zygote(worker)
        assert _answers(server) == 6.0
    finally:
        assert server.stop() == 0, server.log()
