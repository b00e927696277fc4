"""Process-level behaviour: the CLI, workers started by hand, start-up errors,
clean shutdown, and every datatype through real worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd.client import AsyncClient, Client, DeadlineExceeded, ServerUnavailable
from batchd.client.codec import build_request, parse_response
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos.datatypes import DATATYPES
from batchd.protos.tensors import to_raw
from batchd.server import frontends
from batchd.server.config import Frontends
from tests.conftest import (
    MODEL_TOML,
    SAMPLES,
    batch_gate,
    make_model,
    model_log,
    scrape,
    total,
    value,
    workers_up,
)
from tests.servers import EXAMPLES, ServerProcess, alive, children, free_port, wait_for


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def own_channel(server: ServerProcess) -> grpc.Channel:
    """A channel with a connection of its own (channels of one process share one
    otherwise), so the kernel hands each to whichever frontend it picks."""
    return grpc.insecure_channel(server.url, options=[("grpc.use_local_subchannel_pool", 1)])


def liveness(channel: grpc.Channel) -> str:
    """What gRPC health says of `batchd.liveness` (the liveness probe's service)."""
    check = health_pb2.HealthCheckRequest(service="batchd.liveness")
    status = health_pb2_grpc.HealthStub(channel).Check(check, timeout=1).status
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))


def test_worker_started_by_hand_joins_over_tcp(tmp_path: Path) -> None:
    """It reads its own copy of the repository, as on another host: copied, its files
    have other modification times (a LOAD named the frontend's, and it loaded none)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    copy = tmp_path / "copy"
    shutil.copytree(EXAMPLES / "tiny", copy / "tiny", copy_function=shutil.copyfile)
    server = ServerProcess(
        EXAMPLES, "--no-local-workers", "--worker-endpoint", endpoint, log_dir=tmp_path
    ).start(ready=False)
    worker = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "batchd"),
            "worker",
            "--connect",
            endpoint,
            "--device",
            "cpu",
            "--model-repository",
            str(copy),
            "--models",
            "tiny",
            "--threads",
            "1",
        ],
    )
    try:
        with Client(server.url) as c:
            assert not c.model_ready("tiny")
            wait_for(lambda: c.model_ready("tiny"), 60, "the hand-started worker")
            assert not c.model_ready("mlp") and not c.ready()  # nobody serves mlp
            assert workers_up(server) == 1
            out = c.infer("tiny", np.ones((2, 16), np.float32), timeout=30)
            assert out["OUTPUT0"].shape == (2, 16)
            worker.kill()
            worker.wait()
            # Remote: no process exit to see, so missed heartbeats tell.
            wait_for(lambda: workers_up(server) == 0, 60, "the lost worker to be noticed")
            assert not c.model_ready("tiny")
    finally:
        if worker.poll() is None:
            worker.kill()
        assert server.stop() == 0, server.log()


def test_a_worker_whose_model_left_a_thread_running_exits_on_sigterm(tmp_path: Path) -> None:
    """Python's exit waits for every thread that is not a daemon: one a model started (in
    load(), or a forward's helper) kept a worker alive after SIGTERM for good (under a
    server, its stop waited 10 s, then killed it). The worker leaves without it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    model = make_model(tmp_path / "repo", "scaled", 2.0)
    with (model / "model.py").open("a") as f:
        f.write("\nimport threading as _t, time as _time, atexit as _atexit\n"  # (not a daemon)
                "_t.Thread(target=_time.sleep, args=(3600,), daemon=False).start()\n"
                f"_atexit.register(open, {str(tmp_path / 'left')!r}, 'w')\n")  # fmt: skip
    server = ServerProcess(tmp_path / "repo", "--no-local-workers", "--worker-endpoint",
                           endpoint, log_dir=tmp_path).start(ready=False)  # fmt: skip
    cmd = [sys.executable, "-m", "batchd.worker", "--connect", endpoint, "--device", "cpu",
           "--model-repository", str(tmp_path / "repo"), "--threads", "1"]  # fmt: skip
    worker = subprocess.Popen(cmd)
    try:
        with Client(server.url) as c:
            wait_for(lambda: c.model_ready("scaled"), 60, "the hand-started worker")
            assert c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=30)["Y"][0, 0] == 2
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        assert (tmp_path / "left").exists()  # its atexit handlers ran (os._exit skips them)
    finally:
        if worker.poll() is None:
            worker.kill()
        assert server.stop() == 0, server.log()


def test_a_forward_that_forks_leaves_no_copy_of_the_worker_running(tmp_path: Path) -> None:
    """os.fork() as model.py is imported, in load() and in a forward (a library's helper
    that forgot to _exit): the child went on as a copy of the worker, blocked on its
    sockets for good, holding its memory past the server's stop (one forked on import
    ran load() too). It ends as the model's code returns in it."""
    model = make_model(tmp_path / "repo", "scaled", 2.0)
    text = (model / "model.py").read_text()
    assert "def load(device" in text
    loads = tmp_path / "loads"  # a line per load() run
    (model / "model.py").write_text("import os as _os\n_os.fork()\n" + text.replace(
        "def load(device", "def _forking(fn):\n    return lambda *a: (_os.fork(), fn(*a))[1]"
        "\n\n\ndef _load(device", 1) + "\n\ndef load(device):\n"
        f"    open({str(loads)!r}, 'a').write('.')\n"
        "    _os.fork()\n    return _forking(_load(device))\n"
    )  # fmt: skip
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(server.url) as c:
            for _ in range(3):
                assert c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=30)["Y"][
                    0, 0] == 2  # fmt: skip
        (worker,) = server.worker_pids()
        wait_for(lambda: not [p for p in children(worker) if alive(p)], 30, "no copy running")
        assert loads.read_text() == "."  # the copy forked as model.py was imported: not two
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_model_s_daemon_process_ends_with_its_worker(tmp_path: Path, method: str) -> None:
    """A daemon multiprocessing.Process a model starts (on import here) is ended by
    Python's exit (terminate(): SIGTERM), after the model's own atexit handlers. It
    inherited the worker's ignored SIGTERM (a signal to the whole group must not end a
    worker while its frontend drains), so it lived on after the worker, for good;
    spawned, or from a forkserver, the same (an ignored signal outlives exec)."""
    model = make_model(tmp_path / "repo", "scaled", 2.0)
    pid_file, at_exit = tmp_path / "child.pid", tmp_path / "at-exit"
    with (model / "model.py").open("a") as f:  # (its atexit handler still finds it alive)
        f.write(
            "\nimport atexit as _atexit, multiprocessing as _mp, time as _time\n"
            f"_p = _mp.get_context({method!r}).Process(target=_time.sleep, args=(3600,), "
            f"daemon=True)\n_p.start()\nopen({str(pid_file)!r}, 'w').write(str(_p.pid))\n"
            "_atexit.register(lambda: (_time.sleep(0.2), open("  # (a cleanup that takes a while)
            f"{str(at_exit)!r}, 'w').write(str(_p.is_alive()))))\n"
        )
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()  # fmt: skip
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the model's child")
        child = int(pid_file.read_text())
        assert alive(child)
    finally:
        assert server.stop() == 0, server.log()
    try:
        wait_for(lambda: not alive(child), 10, "the model's child to end with its worker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert at_exit.read_text() == "True"  # the model's own cleanup came first


def model_that_starts(tmp_path: Path, start: str, toml: str = MODEL_TOML) -> tuple[Path, Path]:
    """Model `scaled` (in tmp_path / "repo") whose module runs `start` as it loads, which
    makes process `_p`; and the file its pid is written to."""
    model = make_model(tmp_path / "repo", "scaled", 2.0, toml)
    pid_file = tmp_path / "child.pid"
    with (model / "model.py").open("a") as f:
        f.write(f"\n{start}\nopen({str(pid_file)!r}, 'w').write(str(_p.pid))\n")
    return model, pid_file


def test_a_worker_killed_from_outside_takes_what_its_model_started(tmp_path: Path) -> None:
    """A worker SIGKILLed from outside (the OOM killer, an operator) runs no cleanup: a
    process its model started lived on, re-parented, for good. Its frontend now kills
    what is left of the process group the worker led, and starts another worker."""
    _, pid_file = model_that_starts(
        tmp_path, "import multiprocessing as _mp, time as _time\n"
        "_p = _mp.get_context('spawn').Process(target=_time.sleep, args=(3600,))\n_p.start()",
    )  # fmt: skip
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    child = 0
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the model's child")
        child = int(pid_file.read_text())
        (worker,) = server.worker_pids()
        assert alive(child) and child in children(worker)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not alive(child), 30, "the model's child to end with its worker")
        wait_for(lambda: server.worker_pids() not in ([], [worker]), 30, "another worker")
        with Client(server.url) as c:
            y = c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=30)["Y"]
            assert y[0, 0] == 2
    finally:
        if child:  # (0 would be this test's own process group)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        assert server.stop() == 0, server.log()


def test_a_hung_worker_is_killed_with_a_helper_that_left_its_process_group(
    tmp_path: Path,
) -> None:
    """A helper program its model started in a session of its own (setsid) is not in
    the worker's process group: a worker killed as hung takes it along by its parent,
    read before the kill (review 54d: after 82d20e5, killing the group alone, it lived
    on, re-parented)."""
    model, pid_file = model_that_starts(
        tmp_path, "import subprocess as _sp\n"
        "_p = _sp.Popen(['sleep', '3600'], start_new_session=True)",
        MODEL_TOML + "\n[instances]\nexecution_timeout_s = 1.5\n",
    )  # fmt: skip
    (gate := batch_gate(model, 2.0)).touch()  # its batches hang
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    helper = 0
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the helper")
        helper = int(pid_file.read_text())
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(_infer_quietly, server.url)
            wait_for(lambda: "killing worker" in server.log(), 30, "the hung worker's kill")
            wait_for(lambda: not alive(helper), 30, "the helper to end with its worker")
            gate.unlink()
            call.result(60)
    finally:
        gate.unlink(missing_ok=True)
        if helper and alive(helper):
            os.kill(helper, signal.SIGKILL)
        assert server.stop() == 0, server.log()


def _infer_quietly(url: str) -> None:
    with contextlib.suppress(Exception), Client(url) as c:
        c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=60)


def test_a_pool_a_forward_terminates_ends(tmp_path: Path) -> None:
    """`with Pool()` in a forward terminate()s its processes as it leaves, with SIGTERM:
    they took the worker's ignored SIGTERM, and the forward hung now and then (2 of 25
    calls, each past execution_timeout_s, the worker killed), here for good. (From a
    forkserver: a process forked from the worker's threads may deadlock on its own.)"""
    model = make_model(tmp_path / "repo", "scaled", 2.0)
    text = (model / "model.py").read_text()
    (model / "model.py").write_text(text.replace("def load(device", "def _load(device", 1) + (
        "\nimport multiprocessing as _mp\n\ndef load(device):\n    fn = _load(device)\n"
        "    def forward(x):\n        pool = _mp.get_context('forkserver').Pool(1)\n"
        "        pool.terminate()\n        pool.join()\n        return fn(x)\n    return forward\n"
    ))  # fmt: skip
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(server.url) as c:
            for _ in range(3):
                y = c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=20)["Y"]
                assert y[0, 0] == 2
    finally:
        assert server.stop() == 0, server.log()


# A frontend judged hung sooner than the default 10 s (the tests below wait for it),
# yet far above the loop stalls of a busy 2-core run.
HUNG_S = 4.0
FRONTENDS_2 = ("--frontends", "2", "--frontend-timeout", str(HUNG_S))

SLOW_STEPS_TOML = """
[[input]]
name = "ID"
datatype = "INT64"
shape = [1]
[[output]]
name = "VALUE"
datatype = "INT64"
shape = [1]
[generate]
max_active = 4
max_steps = 1000
"""
SLOW_STEPS_PY = """
import time, torch
class Counter:  # sequence ID yields ID * 1000 + k at step k; ID 7 ends at step 10
    def start(self, requests):
        return [{"id": int(r["ID"][0]), "k": 0} for r in requests]
    def step(self, states):
        time.sleep(0.02)
        for s in states:
            s["k"] += 1
        return [({"VALUE": torch.tensor([s["id"] * 1000 + s["k"]])}, s["id"] == 7 and s["k"] == 10)
                for s in states]
def load(device):
    return Counter()
"""


def test_a_release_that_hangs_is_its_model_s_fault_within_its_execution_timeout(
    tmp_path: Path,
) -> None:
    """A step-wise model's release() (run as its caller leaves) that never returns held
    the worker while its heartbeats said idle: the next batch of another model was
    blamed, after that model's 60 s, every call of every model waiting meanwhile. A
    start() or release() is work held to its model's execution_timeout_s (2 s here), not
    to another step-wise model's (a CANCEL named no model: the longest, 60 s, held)."""
    stuck = tmp_path / "repo" / "stuck"
    stuck.mkdir(parents=True)
    (stuck / "model.toml").write_text(SLOW_STEPS_TOML + "[instances]\nexecution_timeout_s = 2\n")
    (stuck / "model.py").write_text(SLOW_STEPS_PY.replace(
        "def load(device):", "Counter.release = lambda self, state: time.sleep(3600)\n"
        "def load(device):"))  # fmt: skip
    patient = tmp_path / "repo" / "patient"  # its limit is not the stuck release()'s
    patient.mkdir()
    (patient / "model.toml").write_text(SLOW_STEPS_TOML + "[instances]\nexecution_timeout_s = 60\n")
    (patient / "model.py").write_text(SLOW_STEPS_PY)
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(server.url) as c:
            with pytest.raises(DeadlineExceeded):  # its caller leaves: release() hangs
                for _ in c.stream("stuck", {"ID": np.array([1])}, timeout=0.5):
                    pass
            lost = "ran past execution_timeout_s 2.0"
            wait_for(lambda: lost in server.log(), 30, "the worker found stuck in release()")
            assert "model 'scaled'" not in server.log().split(lost)[0].splitlines()[-1]
            assert c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=60)["Y"][0, 0] == 2
    finally:
        assert server.stop() == 0, server.log()


def test_a_frontend_of_several_starts_a_sequence_on_the_worker_the_others_leave_free(
    tmp_path: Path,
) -> None:
    """Two frontends share two hand-started workers of one slot each. Frontend a's
    endless sequence takes W1's slot. Frontend b, which sees only its own sequences,
    learns from W1's heartbeat that W1 is full and starts its sequence on W2, where it
    used to queue behind a's on W1 till its deadline while W2 idled."""
    (tmp_path / "repo" / "counter").mkdir(parents=True)
    toml = SLOW_STEPS_TOML.replace("max_active = 4", "max_active = 1")
    (tmp_path / "repo" / "counter" / "model.toml").write_text(toml)
    (tmp_path / "repo" / "counter" / "model.py").write_text(SLOW_STEPS_PY)
    endpoints = {name: f"tcp://127.0.0.1:{free_port()}" for name in "ab"}
    frontends, workers = {}, []
    for name, endpoint in endpoints.items():
        (tmp_path / name).mkdir()
        frontends[name] = ServerProcess(
            tmp_path / "repo", "--no-local-workers", "--worker-endpoint", endpoint,
            "--log-level", "DEBUG", log_dir=tmp_path / name,
        ).start(ready=False)  # fmt: skip

    def worker(name: str) -> None:
        workers.append(subprocess.Popen([
            *(sys.executable, "-m", "batchd.worker", "--connect", ",".join(endpoints.values())),
            *("--id", name, "--model-repository", str(tmp_path / "repo"), "--threads", "1"),
        ]))  # fmt: skip

    first: list[int] = []

    def endless() -> None:  # ID 1 never ends: it holds its worker's one slot
        with contextlib.suppress(Exception), Client(frontends["a"].url) as c:
            for out in c.stream("counter", {"ID": np.array([1], np.int64)}, timeout=60):
                first.append(int(out["VALUE"][0]))

    try:
        worker("W1")  # registered first with both: each frontend's first choice
        for f in frontends.values():
            with Client(f.url) as c:
                wait_for(lambda: c.model_ready("counter"), 60, "W1")
        worker("W2")
        for f in frontends.values():
            wait_for(lambda f=f: "worker W2 registered" in f.log(), 60, "W2")
        threading.Thread(target=endless, daemon=True).start()
        wait_for(lambda: len(first) >= 3, 60, "frontend a's sequence to stream")
        told = "worker W1 holds other frontends' sequences: {'counter@1': 1}"
        assert told not in frontends["a"].log()  # its own sequence is not another's
        wait_for(lambda: told in frontends["b"].log(), 30, "W1's heartbeat to frontend b")
        with Client(frontends["b"].url) as c:
            out = [
                int(o["VALUE"][0])
                for o in c.stream("counter", {"ID": np.array([7], np.int64)}, timeout=20)
            ]
        assert out == [7001 + k for k in range(10)]
    finally:
        for w in workers:
            w.kill()
            w.wait()
        for f in frontends.values():
            f.stop()


def test_a_replaced_frontend_s_sequences_never_reach_its_successor_s_callers(
    tmp_path: Path,
) -> None:
    """A hand-started worker outlives a frontend that was killed mid-sequence and
    steps that frontend's sequences on. The new frontend's sequences never get
    their outputs (their ids are not the old ones), and it cancels them."""
    (tmp_path / "repo" / "counter").mkdir(parents=True)
    (tmp_path / "repo" / "counter" / "model.toml").write_text(SLOW_STEPS_TOML)
    (tmp_path / "repo" / "counter" / "model.py").write_text(SLOW_STEPS_PY)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    args = ("--no-local-workers", "--worker-endpoint", endpoint)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path / "a").start(ready=False)
    worker = subprocess.Popen(
        [
            *(sys.executable, "-m", "batchd.worker", "--connect", endpoint, "--device", "cpu"),
            *("--model-repository", str(tmp_path / "repo"), "--threads", "1"),
        ]
    )
    second = None
    old: list[int] = []

    def old_sequences() -> None:
        with contextlib.suppress(Exception), Client(first.url) as c:  # its server is killed
            for out in c.stream("counter", {"ID": np.array([1], np.int64)}, timeout=60):
                old.append(int(out["VALUE"][0]))

    try:
        with Client(first.url) as c:
            wait_for(lambda: c.model_ready("counter"), 60, "the hand-started worker")
        threading.Thread(target=old_sequences, daemon=True).start()
        wait_for(lambda: len(old) >= 3, 60, "the first frontend's sequence to stream")
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        second = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path / "b").start()
        with Client(second.url) as c:
            new = [
                int(o["VALUE"][0])
                for o in c.stream("counter", {"ID": np.array([7], np.int64)}, timeout=60)
            ]
        assert new == [7001 + k for k in range(10)]
    finally:
        worker.kill()
        worker.wait()
        if second is not None:
            assert second.stop() == 0, second.log()


GIL_HOLDING_LOAD = """
import ctypes
def load(device):
    ctypes.PyDLL(None).sleep(5)  # holds the GIL, as torch.jit.load of gigabytes does
    return lambda x: x * 2
"""
GIL_HOLDING_FORWARD = """
import ctypes
def load(device):
    def forward(x):
        ctypes.PyDLL(None).sleep(5)  # holds the GIL, as a C call that does not release it
        return x * 2
    return forward
"""


@pytest.mark.parametrize(
    ("model_py", "frontends"),
    [(GIL_HOLDING_LOAD, 1), (GIL_HOLDING_FORWARD, 1), (GIL_HOLDING_FORWARD, 2)],
    ids=["load", "forward", "forward-2-frontends"],
)
def test_a_worker_holding_the_gil_longer_than_the_heartbeat_window_is_not_lost(
    tmp_path: Path, model_py: str, frontends: int
) -> None:
    """The worker's I/O thread cannot beat while load() or forward() holds the GIL: a
    worker that is loading, or one of the server's own with a batch on it, may be
    silent longer than 3 missed heartbeats, not lost and restarted for ever. With
    --frontends 2 the frontend without the batch (frontend 0: the one that kills; or
    the child, whose workers are frontend 0's) took the silence for a death."""
    (tmp_path / "repo" / "slow").mkdir(parents=True)
    (tmp_path / "repo" / "slow" / "model.toml").write_text(MODEL_TOML)
    (tmp_path / "repo" / "slow" / "model.py").write_text(model_py)
    args = ("--frontends", str(frontends))
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    try:
        ready = "model slow is ready"
        wait_for(lambda: server.log().count(ready) == frontends, 60, "every frontend ready")
        with Client(server.url, own_connection=True) as c:
            out = c.infer("slow", {"X": np.array([[3.0]], np.float32)}, timeout=30)
        assert out["Y"][0, 0] == 6.0
        assert "no message for" not in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_bad_model_toml_stops_start_up_naming_file_and_key(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "broken").mkdir(parents=True)
    (repo / "broken" / "model.toml").write_text('max_batch_size = 4\n[[input]]\nname = "X"\n')
    (repo / "broken" / "model.py").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "batchd.server", "--model-repository", str(repo), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{repo / 'broken' / 'model.toml'}: [[input]] 'X' key 'datatype': is required" in (
        result.stderr
    )


def test_sigint_stops_server_and_every_worker(tmp_path: Path) -> None:
    server = ServerProcess(EXAMPLES, log_dir=tmp_path, workers=2).start()
    workers = server.worker_pids()
    assert len(workers) == 2
    assert server.stop(signal.SIGINT) == 0
    assert not any(alive(p) for p in workers)
    assert "stopped" in server.log()
    assert "lost" not in server.log()  # workers told to STOP are not failures


def test_every_datatype_round_trips_raw_and_typed(test_server: ServerProcess) -> None:
    inputs = {}
    for name, arr in SAMPLES.items():
        row = np.resize(arr.ravel(), 3)  # the echo model's inputs are [3] (BYTES: [-1])
        inputs[name] = np.stack([row, row[::-1]])  # two rows: the batch dim really is used
    with grpc.insecure_channel(test_server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        raw = pb.ModelInferRequest(model_name="echo")
        typed = pb.ModelInferRequest(model_name="echo")
        for name, arr in inputs.items():
            raw.inputs.add(name=f"IN_{name}", datatype=name, shape=list(arr.shape))
            raw.raw_input_contents.append(to_raw(arr, name)[2])
        raw_out = parse_response(stub.ModelInfer(raw, timeout=30))
        for name, arr in inputs.items():
            dt = DATATYPES[name]
            if dt.contents_field is None:  # FP16, BF16 exist only in raw form
                continue
            t = typed.inputs.add(name=f"IN_{name}", datatype=name, shape=list(arr.shape))
            getattr(t.contents, dt.contents_field).extend(arr.ravel().tolist())
        with pytest.raises(grpc.RpcError) as info:  # FP16/BF16 missing: named, not crashed
            stub.ModelInfer(typed, timeout=30)
        assert "needs input(s) ['IN_FP16', 'IN_BF16']" in info.value.details()
    for name, arr in inputs.items():
        assert raw_out[f"OUT_{name}"].tolist() == arr.tolist(), name


def test_models_check_reports_each_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, body in (("good", "x * 2"), ("bad", "x[:, :1]")):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(
            'max_batch_size = 4\n[[input]]\nname = "X"\ndatatype = "FP32"\nshape = [3]\n'
            '[[output]]\nname = "Y"\ndatatype = "FP32"\nshape = [3]\n'
        )
        (repo / name / "model.py").write_text(f"def load(device):\n    return lambda x: {body}\n")
    batchd = str(Path(sys.executable).parent / "batchd")
    listing = subprocess.run([batchd, "models", str(repo)], capture_output=True, text=True)
    assert listing.returncode == 0 and "X FP32[3] -> Y FP32[3]" in listing.stdout
    check = subprocess.run(
        [batchd, "models", str(repo), "--check"], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 1, check.stdout + check.stderr
    assert "1 ok, 1 failed" in check.stdout
    assert "output 'Y': expected shape [2, 3], the model returned [2, 1]" in check.stdout


def test_frontends_share_the_port_and_the_workers(tmp_path: Path) -> None:
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path).start()
    try:
        children = server.worker_pids()  # the worker and frontend 1
        assert len(children) == 2
        # Which frontend a connection reaches is the kernel's choice, so frontend 1's
        # readiness cannot be asked for: its log line (one per process) says it.
        wait_for(lambda: server.log().count("model scaled is ready") == 2, 60, "both frontends")
        all_answered = asyncio.Event()
        answered = 0

        async def caller(k: int) -> tuple[list[float], int]:
            nonlocal answered
            # A connection of its own: channels in one process otherwise share one.
            options = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(server.url, options=options) as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                outs = []
                for i in range(5):
                    msg = build_request("scaled", {"X": np.array([[k * 10 + i]], np.float32)})
                    reply = parse_response(await stub.ModelInfer(msg, timeout=20))
                    outs.append(float(reply["Y"][0, 0]))
                answered += 5
                if answered == 80:
                    all_answered.set()
                await asyncio.wait_for(all_answered.wait(), 60)
                # Whichever frontend this connection reached, its statistics add up every
                # frontend's (they said its own alone)
                stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="scaled"))
                return outs, stats.model_stats[0].inference_stats.success.count

        async def callers() -> list[tuple[list[float], int]]:
            return await asyncio.gather(*(caller(k) for k in range(16)))

        results = asyncio.run(callers())
        assert [outs for outs, _ in results] == [
            [2.0 * (k * 10 + i) for i in range(5)] for k in range(16)
        ]
        assert {count for _, count in results} == {80}, results
        # /metrics (frontend 0's) gathers every frontend's, each labelled: it said
        # frontend 0's counts alone
        samples = scrape(server)
        name = "batchd_inference_request_success_total"
        each = [value(samples, name, model="scaled", version="1", frontend=f) for f in "01"]
        for _ in range(4):  # HTTP's /stats too, whichever frontend each connection reaches
            with urllib.request.urlopen(f"{server.http_url}/v2/models/scaled/stats") as reply:
                stats = json.loads(reply.read())["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 80, stats
        jobs = [labels for n, labels in samples if n == "batchd_jobs"]  # the store's: once
        assert (("status", "queued"),) in jobs and all(len(k) == 1 for k in jobs), jobs
    finally:
        assert server.stop() == 0, server.log()
    # Each frontend answered some of the 80 and not all: the kernel spread the 16
    # connections over both, whose counts add up to 80.
    assert min(each) > 0 and sum(each) == 80, each
    assert not any(alive(p) for p in children)


def test_a_child_frontend_s_callers_are_answered_once_frontend_0_dies(tmp_path: Path) -> None:
    """Frontend 0 killed with batches on its worker: the worker left without sending
    their replies, and the child, its workers gone for good, held its callers for the
    whole --drain-timeout. The worker now sends what it was running; the child answers
    the rest UNAVAILABLE once no worker is left."""
    model_dir = make_model(tmp_path / "repo", "held", 2.0)
    (gate := batch_gate(model_dir, 2.0)).touch()
    args = ("--frontends", "2", "--drain-timeout", "120")
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    wait_for(lambda: server.log().count("model held is ready") == 2, 60, "both frontends")

    async def scenario() -> list[object]:
        clients = [AsyncClient(server.url, own_connection=True) for _ in range(8)]
        x = [{"X": np.array([[float(k)]], np.float32)} for k in range(8)]
        calls = [asyncio.ensure_future(c.infer("held", x[k], timeout=60))
                 for k, c in enumerate(clients)]  # fmt: skip
        await asyncio.to_thread(wait_for, lambda: model_log(model_dir, "entered.log"), 30)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        gate.unlink()
        try:
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            for c in clients:
                await c.close()

    out = asyncio.run(scenario())
    assert all(isinstance(o, dict | ServerUnavailable) for o in out), out  # none held 60 s
    assert all(o["Y"][0, 0] == 2 * k for k, o in enumerate(out) if isinstance(o, dict)), out


def test_a_child_frontend_s_sequences_finish_on_the_worker_frontend_0_left(
    tmp_path: Path,
) -> None:
    """Frontend 0 killed while sequences step on its worker: the worker finishes what it
    holds before it leaves, and a child frontend's sequences end whole. The child took
    every worker for gone as soon as frontend 0 was (their parent no longer it), and
    failed its sequences at once as "lost", with the worker still stepping them."""
    (tmp_path / "repo" / "counter").mkdir(parents=True)
    toml = SLOW_STEPS_TOML.replace("max_active = 4", "max_active = 16")
    (tmp_path / "repo" / "counter" / "model.toml").write_text(toml)
    (tmp_path / "repo" / "counter" / "model.py").write_text(
        SLOW_STEPS_PY.replace('s["id"] == 7 and s["k"] == 10', 's["k"] == 60'))  # fmt: skip
    server = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path).start()
    wait_for(lambda: server.log().count("model counter is ready") == 2, 60, "both frontends")

    async def one(c: AsyncClient, got: list[int]) -> object:
        try:
            async for out in c.stream("counter", {"ID": np.array([1], np.int64)}, timeout=60):
                got.append(int(out["VALUE"][0]))
        except Exception as e:  # (frontend 0's own: its connection closed)
            return e
        return None

    async def scenario() -> list[tuple[object, list[int]]]:
        clients = [AsyncClient(server.url, own_connection=True) for _ in range(12)]
        got: list[list[int]] = [[] for _ in clients]
        calls = [asyncio.ensure_future(one(c, g)) for c, g in zip(clients, got, strict=True)]
        await asyncio.to_thread(wait_for, lambda: all(got), 30, "every sequence to step")
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        try:
            return list(zip(await asyncio.gather(*calls), got, strict=True))
        finally:
            for c in clients:
                await c.close()

    out = asyncio.run(scenario())
    whole = [g for e, g in out if e is None]
    assert whole and all(g == [1001 + k for k in range(60)] for g in whole), out
    assert not [e for e, _ in out if "lost" in str(e)], out  # (frontend 0's: Socket closed)


def _admitted(server: ServerProcess, token: str) -> set[str]:
    """How ServerLive goes with `token` over 8 fresh connections (the kernel spreads them
    over the frontends)."""
    seen = set()
    for _ in range(8):
        with own_channel(server) as ch:
            try:
                live = pb_grpc.GRPCInferenceServiceStub(ch).ServerLive
                live(pb.ServerLiveRequest(), metadata=[("authorization", f"Bearer {token}")])
                seen.add("OK")
            except grpc.RpcError as e:
                seen.add(e.code().name)
    return seen


def test_a_restarted_child_frontend_serves_the_models_frontend_0_read(tmp_path: Path) -> None:
    """A child restarted after a crash read the repository again: a model folder added
    broken since stopped it starting, again and again (and files changed since were
    served as the version frontend 0 refused them for). It takes frontend 0's models,
    and a version the worker holds, whose files changed since (here a mere touch), it
    takes from the worker, which does not read them. So with the tokens: it read the
    token file again, and let in an edit's token that frontend 0 refused."""
    scaled = make_model(tmp_path / "repo", "scaled", 2.0)
    (tmp := tmp_path / "tmp").mkdir()
    (tokens := tmp_path / "tokens").write_text("infer: at-start-0123456789\n")
    tokens.chmod(0o600)
    args = ("--frontends", "2", "--auth-token-file", str(tokens))
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path, env={"TMPDIR": str(tmp)})
    server.start(token="at-start-0123456789")
    try:
        ready = "model scaled is ready"
        wait_for(lambda: server.log().count(ready) == 2, 60, "both frontends")
        for saved in tmp.glob("batchd-*/*.pickle"):  # a /tmp cleaner took it: written
            saved.unlink()  # again for each start (every restart failed to read it)
        (tmp_path / "repo" / "broken").mkdir()
        (tmp_path / "repo" / "broken" / "model.toml").write_text("max_batch_size = 'x'\n")
        os.utime(scaled / "model.py", ns=(1, 1))  # (the worker holds version 1 still)
        tokens.write_text("infer: edited-since-0123456789\n")
        (child,) = [p for p in server.worker_pids() if "--frontend-index" in cmdline(p)]
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: server.log().count(ready) == 3, 60, "frontend 1 back, serving")
        assert "connected again to frontend" in server.log()  # READY at once, not in 3 s
        assert _admitted(server, "at-start-0123456789") == {"OK"}
        assert _admitted(server, "edited-since-0123456789") == {"UNAUTHENTICATED"}
    finally:
        assert server.stop() == 0, server.log()


def _blocked(pid: int) -> set[int]:
    """The signals blocked in process `pid`'s main thread."""
    mask = int(re.search(r"SigBlk:\s*([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text())[1], 16)
    return {n for n in (signal.SIGINT, signal.SIGTERM) if mask >> (n - 1) & 1}


def test_a_child_frontend_restarted_beside_two_workers_stops_on_sigterm(tmp_path: Path) -> None:
    """Two workers started at once left frontend 0 with SIGINT and SIGTERM blocked for
    good (each start blocked them around an await, and the second restored the first's
    blocked mask); a child frontend it started again inherited that, ignored the stop,
    took new calls through it, and was killed at 40 s with its streams."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path, workers=2)
    server.start()
    try:
        assert server.proc is not None
        ready = "model scaled is ready"
        wait_for(lambda: server.log().count(ready) == 2, 60, "both frontends")
        assert _blocked(server.proc.pid) == set()
        (child,) = [p for p in server.worker_pids() if "--frontend-index" in cmdline(p)]
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: server.log().count(ready) == 3, 60, "frontend 1 back, serving")
        (again,) = [p for p in server.worker_pids() if "--frontend-index" in cmdline(p)]
        assert _blocked(again) == set() and _blocked(server.proc.pid) == set()
    finally:
        assert server.stop() == 0, server.log()
    assert "did not stop" not in server.log()


def test_a_hung_child_frontend_is_killed_and_started_again(tmp_path: Path) -> None:
    """A child frontend whose event loop stops (here SIGSTOP) kept its listening socket,
    and the new connections the kernel gave it hung; frontend 0 never knew."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", *FRONTENDS_2, log_dir=tmp_path).start()
    try:
        ready = "model scaled is ready"
        wait_for(lambda: server.log().count(ready) == 2, 60, "both frontends")
        (child,) = [p for p in server.worker_pids() if "--frontend-index" in cmdline(p)]
        os.kill(child, signal.SIGSTOP)
        wait_for(lambda: server.log().count(ready) == 3, 60, "frontend 1 replaced, serving")
        assert f"frontend 1 (pid {child}) silent for {HUNG_S:g} s; killing it" in server.log()
    finally:
        assert server.stop() == 0, server.log()
    # a child that goes (killed, or stopping) leaves an answer to its beat unread: reading
    # its socket then failed, with a traceback in frontend 0's log each time
    assert "Traceback" not in server.log(), server.log()


def _liveness_answers(server: ServerProcess) -> set[str]:
    """What fresh connections get, each over gRPC health (the liveness probe's service),
    ServerLive and HTTP /v2/health/live: the kernel spreads them over the frontends, and
    one reaching a stopped frontend gets nothing in its second."""
    seen = set()
    for _ in range(8):
        with contextlib.suppress(grpc.RpcError), own_channel(server) as ch:
            status = liveness(ch)
            live = pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(
                pb.ServerLiveRequest(), timeout=1
            )
            seen.add(f"{status} live={live.live}")
        with contextlib.suppress(OSError):
            try:
                with urllib.request.urlopen(f"{server.http_url}/v2/health/live", timeout=1) as r:
                    seen.add(f"http {r.status} {r.read().decode()}")
            except urllib.error.HTTPError as e:
                seen.add(f"http {e.code} {e.read().decode()}")
    return seen


def test_a_child_frontend_is_not_live_while_frontend_0_is_hung(tmp_path: Path) -> None:
    """Frontend 0's event loop stopped (here SIGSTOP): its own callers wait, and nothing
    restarts it, but a liveness probe the kernel handed to another frontend passed, so a
    supervisor found it late, if ever. Each other frontend is not live while frontend 0
    answers none of its beats, and live again once it does."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", *FRONTENDS_2, log_dir=tmp_path).start()
    assert server.proc is not None
    live = {"SERVING live=True", 'http 200 {"live":true}'}
    try:
        wait_for(lambda: server.log().count("model scaled is ready") == 2, 60, "both frontends")
        assert _liveness_answers(server) == live
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            hung = f"frontend 0 (pid {server.proc.pid}) silent for {HUNG_S:g} s: not live"
            wait_for(lambda: hung in server.log(), 60, "frontend 1 to hear frontend 0 is hung")
            not_live = {"NOT_SERVING live=False", 'http 503 {"live":false}'}
            wait_for(lambda: _liveness_answers(server) == not_live, 30, "frontend 1 not live")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        back = f"frontend 0 (pid {server.proc.pid}) answers again: live"
        wait_for(lambda: back in server.log(), 30, "frontend 1 to hear frontend 0 again")
        wait_for(lambda: _liveness_answers(server) == live, 30, "both live")
        assert "killing it" not in server.log()  # (frontend 0 heard frontend 1 all along)
    finally:
        assert server.stop() == 0, server.log()


def _answered(server: ServerProcess) -> str:
    """The liveness of whichever frontend answers a fresh connection first ("" if none
    did within its second)."""
    with contextlib.suppress(grpc.RpcError), own_channel(server) as ch:
        return liveness(ch)
    return ""


def test_a_silent_idle_worker_of_several_frontends_is_given_nothing_new(tmp_path: Path) -> None:
    """--frontends 2, 2 workers, one stopped (SIGSTOP) with nothing on it: each frontend
    keeps a silent local worker (another frontend's forward may be what holds it) but
    sent it new batches, which waited 62 s (review 58c) while the other worker idled.
    Once it is found silent it is given nothing new: every call is answered by the
    other; heard again, it takes work again."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", *FRONTENDS_2, log_dir=tmp_path, workers=2).start()
    stopped = 0
    try:
        # (each worker ready in each frontend: the model is ready in frontend 1 with the
        # first, and a worker stopped before frontend 1 heard it is not one it knows)
        wait_for(lambda: _workers_ready(server) == 4, 60, "both workers in both frontends")
        workers = [p for p in server.worker_pids() if "batchd.worker" in cmdline(p)]
        assert len(workers) == 2
        os.kill(stopped := workers[0], signal.SIGSTOP)
        said = "silent for"
        wait_for(lambda: server.log().count(said) >= 2, 30, "both frontends to find it silent")

        async def call(k: int) -> float:  # a connection of its own: whichever frontend
            options = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(server.url, options=options) as ch:
                msg = build_request("scaled", {"X": np.array([[k]], np.float32)})
                reply = await pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(msg, timeout=20)
                return float(parse_response(reply)["Y"][0, 0])

        async def calls() -> list[float]:
            return await asyncio.gather(*(call(k) for k in range(8)))

        assert asyncio.run(calls()) == [2.0 * k for k in range(8)]
        os.kill(stopped, signal.SIGCONT)
        stopped = 0
        assert asyncio.run(calls()) == [2.0 * k for k in range(8)]
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
        assert server.stop() == 0, server.log()


def _workers_ready(server: ServerProcess) -> int:
    """How many times a frontend has said a worker is ready (once per worker and frontend)."""
    return len(re.findall(r"batchd\.control: worker \S+ ready \(pid", server.log()))


def test_frontends_stopped_together_judge_no_silence_of_their_own(tmp_path: Path) -> None:
    """The whole process group stopped past --frontend-timeout (Ctrl-Z, a container paused): on
    resuming, frontend 0 took the child it had not heard from for hung and killed it, and
    the child took frontend 0 for hung and said it was not live, when either resumed
    first. The silence while a process itself was stopped is nobody's."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    # (the default --frontend-timeout: the first to resume must be asked before it finds
    # the other silent for it; 4 s were too few for a busy run's tries at 1 s each)
    server = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path).start()
    assert server.proc is not None
    zero = server.proc.pid
    try:
        wait_for(lambda: server.log().count("model scaled is ready") == 2, 60, "both frontends")
        (child,) = [p for p in server.worker_pids() if "--frontend-index" in cmdline(p)]
        for first, then in ((child, zero), (zero, child)):
            os.kill(then, signal.SIGSTOP)  # a second apart: `first` reads what `then` sent
            time.sleep(1.0)
            os.kill(first, signal.SIGSTOP)
            time.sleep(Frontends().hung_s + 1)  # (the conditions: stopped past its timeout)
            os.kill(first, signal.SIGCONT)
            try:  # the other still stopped: whoever answers is `first`, its checks made
                wait_for(lambda: _answered(server) == "SERVING", 30, "the first to answer")
            finally:
                os.kill(then, signal.SIGCONT)
        assert "killing it" not in server.log() and "not live" not in server.log()
        assert alive(child)
    finally:
        assert server.stop() == 0, server.log()


def test_frontend_0_passes_on_ctrl_c_and_alone_keeps_a_private_folder(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) stops without the drain notice: frontend 0 sent its children
    SIGTERM, which took --drain-notice, so they served 3 s more while it refused.
    Only frontend 0 makes a folder in TMPDIR (each child's was unused, and left behind
    by a child killed)."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    (tmp := tmp_path / "tmp").mkdir()
    args = ("--frontends", "2", "--drain-notice", "3")
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path, env={"TMPDIR": str(tmp)})
    server.start()
    wait_for(lambda: server.log().count("model scaled is ready") == 2, 60, "both frontends")
    assert len(list(tmp.glob("batchd-*"))) == 1
    assert server.stop(signal.SIGINT) == 0, server.log()
    assert server.log().count("serving new requests 0.0 s more") == 2, server.log()


def test_frontends_reach_each_other_again_after_their_folder_was_removed(tmp_path: Path) -> None:
    """A /tmp cleaner removed frontend 0's private folder: the workers' sockets there were
    listened on again, but not the frontends' own, through which they ask each other:
    every scrape left frontend 1 out for good (and statistics counted it as it last
    answered). Each frontend listens on its own again; a worker restarted connects."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    (tmp := tmp_path / "tmp").mkdir()
    server = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path,
                           env={"TMPDIR": str(tmp)}).start()  # fmt: skip

    def scraped() -> set[str]:
        return {dict(labels).get("frontend", "") for _, labels in scrape(server)}

    try:
        wait_for(lambda: server.log().count("model scaled is ready") == 2, 60, "both frontends")
        assert {"0", "1"} <= scraped()
        (private,) = tmp.glob("batchd-*")
        shutil.rmtree(private)
        for what in ("this frontend's socket for the others", "the workers' socket"):
            said = f"{what} {private}/"
            wait_for(lambda s=said: server.log().count(s) == 2, 30, f"{what}: both frontends")
        wait_for(lambda: "1" in scraped(), 30, "frontend 1 in a scrape")
        (worker,) = [p for p in server.worker_pids() if "--frontend-index" not in cmdline(p)]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: worker not in server.worker_pids(), 30, "the worker gone")
        with Client(server.url) as c:
            wait_for(lambda: c.model_ready("scaled"), 60, "a new worker serving")
            assert c.infer("scaled", {"X": np.array([[3.0]], np.float32)})["Y"][0, 0] == 6.0
    finally:
        assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


def test_a_frontend_whose_frontend_0_dies_while_it_starts_stops(tmp_path: Path) -> None:
    """Frontend 0 killed just after it started frontend 1: the child took the parent it
    found when it began watching (init, by then) for frontend 0, and served for ever,
    holding the ports with no worker, every call hanging. It stops now, however early
    frontend 0 went."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path)
    server.start(ready=False)  # listening: frontend 0 is up and starts frontend 1 now
    found: list[int] = []
    started = re.compile(r"started frontend 1 \(pid (\d+)\)")
    wait_for(lambda: found.extend(int(m) for m in started.findall(server.log())) or found, 30,
             "frontend 1 started")  # fmt: skip
    assert server.proc is not None
    server.proc.kill()  # before frontend 1 is up
    server.proc.wait()
    wait_for(lambda: not alive(found[0]), 60, "frontend 1 to stop without frontend 0")


def test_a_second_server_of_several_frontends_is_refused_a_port_in_use(tmp_path: Path) -> None:
    """Frontends bind with SO_REUSEPORT: a second `serve --frontends 2` on the ports of
    a first shared them (the kernel spread the callers over two unrelated servers)
    where a port in use must stop start-up."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    first = ServerProcess(tmp_path / "repo", "--frontends", "2", log_dir=tmp_path).start()
    try:
        for grpc_port, http_port, what in (
            (first.port, 0, f"cannot serve gRPC on 127.0.0.1:{first.port}"),
            (0, first.http_port, f"cannot serve HTTP on 127.0.0.1:{first.http_port}"),
        ):
            second = subprocess.run(
                [sys.executable, "-m", "batchd.server", "--model-repository",
                 str(tmp_path / "repo"), "--frontends", "2", "--grpc-port", str(grpc_port),
                 "--http-port", str(http_port), "--metrics-port", "-1"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert second.returncode == 2, second.stderr
            assert f"{what}: Address already in use" in second.stderr
    finally:
        assert first.stop() == 0, first.log()


def test_a_child_frontend_restarts_sooner_again_after_a_stable_run() -> None:
    waits, last = [], 0.0
    for ran_s in (0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 40.0, 0.1):
        last = frontends.restart_after(last, ran_s)
        waits.append(last)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 0.5, 1.0]  # (it stayed at 10 s)


def test_a_child_frontend_has_time_to_start_before_its_silence_counts() -> None:
    """--frontend-timeout 1 killed each child before its first beat, over and over (it
    beats once it has imported and set up: ~1 s). Till its first beat a child has
    START_S; from then, the timeout. A real child process, watched as frontend 0 does."""

    async def watched(script: str) -> int | None:
        ours, theirs = socket.socketpair()
        beats, beating = ours.detach(), theirs.detach()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, str(beating), pass_fds=(beating,)
        )
        os.close(beating)
        try:
            return await asyncio.wait_for(frontends._watched(proc, beats, 1, 1.0), 30)
        finally:
            os.close(beats)

    slow_start = "import time; time.sleep(2)"  # no beat yet: it ends by itself, at 2 s
    assert asyncio.run(watched(slow_start)) == 0
    then_silent = "import os, sys, time; os.write(int(sys.argv[1]), b'.'); time.sleep(60)"
    assert asyncio.run(watched(then_silent)) == -signal.SIGKILL


def test_frontends_refuse_what_they_cannot_share(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "batchd.server", "--model-repository", str(EXAMPLES)]
    for extra, why in [
        (["--model-control", "explicit"], "--model-control explicit"),
        (["--no-local-workers"], "--no-local-workers"),
    ]:
        done = subprocess.run([*cmd, "--frontends", "2", *extra], capture_output=True, text=True)
        assert done.returncode == 2
        assert f"--frontends 2 does not work with {why}" in done.stderr


def test_a_worker_signalled_as_it_starts_is_not_killed(tmp_path: Path) -> None:
    """A worker ignores SIGTERM and SIGINT (its frontend drains first), but only once its
    start-up (torch's import: seconds) is done: a signal to the whole group in that time
    killed it, and it was started again during the stop. Its frontend starts it with both
    blocked."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start(ready=False)
    assert server.proc is not None
    try:
        found: list[int] = []
        wait_for(lambda: found.extend(server.worker_pids()) or found, 30, "the worker")
        os.kill(found[0], signal.SIGTERM)  # (as it starts: a group signal in a test's time)
        with Client(server.url) as c:
            wait_for(lambda: c.ready(), 60, "the server ready")
        assert server.worker_pids() == found and "exited with code" not in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_a_signal_to_the_whole_process_group_still_drains(tmp_path: Path) -> None:
    """systemd stopping a unit, or Ctrl-C in a terminal, signals every process of the
    group: the workers must stay for the frontend's drain, not leave with the signal.
    One batch runs (held) and one request waits behind it when the signal comes: the
    worker that took the signal runs both."""
    model = make_model(tmp_path / "repo", "slow", 1.0)
    held = batch_gate(model, 1.0)
    helper = tmp_path / "helper.pid"  # a process the model forks: it stays for the drain too
    with (model / "model.py").open("a") as f:  # (it died at the signal, and a pool's batch)
        f.write("\nimport multiprocessing as _mp, time as _time\n_p = _mp.get_context('fork')"
                ".Process(target=_time.sleep, args=(3600,), daemon=True)\n_p.start()\n"
                f"open({str(helper)!r}, 'w').write(str(_p.pid))\n")  # fmt: skip
    server = ServerProcess(
        tmp_path / "repo", "--credits-per-worker", "1", log_dir=tmp_path, new_session=True
    ).start()
    assert server.proc is not None
    (worker,) = server.worker_pids()
    forked = int(helper.read_text())

    def queued() -> float:
        return total(scrape(server), "batchd_inference_pending_request_count", model="slow")

    held.touch()
    try:
        # (retries=1: with no notice the GOAWAY goes out at the signal, and a ready() then
        # can be CANCELLED by gRPC itself, as the README's Status codes say: retried)
        with Client(server.url, retries=1) as c, ThreadPoolExecutor(2) as pool:
            running = pool.submit(c.infer, "slow", {"X": np.array([[21.0]], np.float32)}, None, 30)
            wait_for(lambda: model_log(model, "entered.log"), 30, "the batch to start")
            waiting = pool.submit(c.infer, "slow", {"X": np.array([[22.0]], np.float32)}, None, 30)
            wait_for(lambda: queued() == 1, 30, "the second request to be queued")
            os.killpg(server.proc.pid, signal.SIGTERM)
            wait_for(lambda: not c.ready(), 30, "the server to drain")  # it took the signal
            assert alive(forked)
            held.unlink()
            assert float(running.result(timeout=30)["Y"][0, 0]) == 21.0
            assert float(waiting.result(timeout=30)["Y"][0, 0]) == 22.0
    finally:
        held.unlink(missing_ok=True)
    assert server.stop() == 0
    assert [(r["pid"], r["values"]) for r in model_log(model, "calls.log")] == [
        (worker, [21.0]),
        (worker, [22.0]),
    ]
    wait_for(lambda: not alive(forked), 10, "the model's process to end with its worker")
    assert "lost" not in server.log()  # the lost-worker alarm: the server is gone, ask its log
