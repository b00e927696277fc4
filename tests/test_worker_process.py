"""A real `python -m batchd.worker` process against a frontend played by the test:
a ROUTER socket that sends what it likes (garbage included) and reads the
worker's replies and log lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from batchd.protos import wire
from batchd.protos.tensors import from_raw, to_raw
from tests.conftest import stepwise_toml
from tests.servers import wait_for

TOML = """max_batch_size = 4
[[input]]
name = "X"
datatype = "FP32"
shape = [2]
[[output]]
name = "Y"
datatype = "FP32"
shape = [2]
"""
WAIT_S = 60.0  # a bound on waiting for a worker that works; never reached when it does


def _repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for name, code in {
        "plus1": "def load(device):\n    return lambda x: x + 1\n",
        "broken": "def load(device):\n    raise RuntimeError('no weights here')\n",
        # a data file beside model.py, read the documented way and by a relative path
        "beside": "from pathlib import Path\n\ndef load(device):\n"
        "    n = float((Path(__file__).parent / 'n.txt').read_text())\n"
        "    return lambda x: x + n\n",
        "relative": "def load(device):\n    n = float(open('n.txt').read())\n"
        "    return lambda x: x + n\n",
        # sys.exit() raises SystemExit, which `except Exception` lets through
        "exits_loading": "import sys\n\ndef load(device):\n    sys.exit('no weights')\n",
        "exits_running": "import sys\n\ndef load(device):\n    return lambda x: sys.exit(3)\n",
        # a batch waits while the hidden file .gate beside it exists
        "waits": "import time\nfrom pathlib import Path\n\ndef load(device):\n"
        "    gate = Path(__file__).parent / '.gate'\n\n    def run(x):\n"
        "        while gate.exists():\n            time.sleep(0.005)\n"
        "        return x + 1\n\n    return run\n",
    }.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(TOML)
        (repo / name / "model.py").write_text(code)
        (repo / name / "n.txt").write_text("5")
    for name, code in {"endless": ENDLESS_PY, "unreleased": UNRELEASED_PY}.items():
        (repo / name).mkdir()
        (repo / name / "model.toml").write_text(ENDLESS_TOML)
        (repo / name / "model.py").write_text(code)
    return repo


ENDLESS_TOML = stepwise_toml(1, 1_000_000)
ENDLESS_PY = """
import time, torch
class Endless:  # a sequence steps until it is cancelled or its model goes
    def start(self, requests):
        return [0 for _ in requests]
    def step(self, states):
        time.sleep(0.01)
        return [({"OUT": torch.tensor([7])}, False) for _ in states]
def load(device):
    return Endless()
"""
# its sequences end at their first step, and its release() raises
UNRELEASED_PY = ENDLESS_PY.replace("False)", "True)") + "Endless.release = lambda _, s: 1 / 0\n"


class Frontend:
    """The frontend's side of the wire, driven by hand, and one worker connected to it."""

    def __init__(
        self, tmp_path: Path, worker_id: str, log_format: str = "text", also: str = ""
    ) -> None:
        """`also`: a second frontend's endpoint the worker serves too."""
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        connect = ",".join([f"tcp://127.0.0.1:{port}", *filter(None, [also])])
        self.log_path = tmp_path / f"worker-{worker_id}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "batchd.worker", "--connect", connect,
                 "--model-repository", str(_repository(tmp_path)), "--id", worker_id,
                 "--threads", "1", "--log-format", log_format],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.ready = self.recv(wire.Header.READY)
        assert self.ready.worker.worker_id == worker_id
        self.identity = worker_id.encode()

    def log(self) -> str:
        return self.log_path.read_text()

    def send(self, *parts: bytes) -> None:
        self.router.send_multipart([self.identity, *parts])

    def send_header(self, header: wire.Header, frames: tuple[bytes, ...] = ()) -> None:
        self.send(*wire.pack(header, frames))

    def recv(self, kind: int, skip: tuple[int, ...] = ()) -> wire.Header:
        """The next message of `kind` from the worker (heartbeats, READY and the kinds
        in `skip` skipped)."""
        return self.recv_with_frames(kind, skip)[0]

    def recv_with_frames(
        self, kind: int, skip: tuple[int, ...] = ()
    ) -> tuple[wire.Header, list[bytes]]:
        end = time.monotonic() + WAIT_S
        while (left := end - time.monotonic()) > 0:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"the worker exited with {code}:\n{self.log()}")
            if self.router.poll(int(min(left, 0.2) * 1000)):
                _, *parts = self.router.recv_multipart()
                header, frames = wire.unpack(parts)
                if header.kind == kind:
                    return header, frames
                # a heartbeat, or READY again: this frontend sends no heartbeats
                assert header.kind in (wire.Header.HEARTBEAT, wire.Header.READY, *skip), header
        raise AssertionError(f"no {wire.Header.Kind.Name(kind)} within {WAIT_S} s:\n{self.log()}")

    def load(self, model: str) -> wire.Header:
        self.send_header(wire.Header(kind=wire.Header.LOAD, model=model, version="1"))
        loaded = self.recv(wire.Header.LOADED)
        assert loaded.model == model
        return loaded

    def infer(self, batch_id: int, x: np.ndarray, model: str = "plus1") -> np.ndarray:
        datatype, shape, raw = to_raw(x)
        tensor = wire.Tensor(name="X", datatype=datatype, shape=shape)
        self.send_header(
            wire.Header(
                kind=wire.Header.BATCH, batch_id=batch_id, model=model, version="1",
                tensors=[tensor],
            ),
            (raw,),
        )  # fmt: skip
        reply, frames = self.recv_with_frames(wire.Header.RESULT)
        assert reply.batch_id == batch_id
        out = reply.tensors[0]
        return from_raw(out.datatype, tuple(out.shape), frames[0])

    def start_endless(self, *seqs: int, model: str = "endless") -> None:
        """Load the `endless` step-wise model and START a sequence of it per id."""
        assert self.load(model).error == ""
        for seq in seqs:
            tensor = wire.Tensor(name="N", datatype="INT64", shape=[1])
            start = wire.Header(kind=wire.Header.START, batch_id=seq, model=model,
                                version="1", tensors=[tensor])  # fmt: skip
            self.send_header(start, (np.array([1], np.int64).tobytes(),))

    def stop(self) -> int:
        """STOP the worker; its exit code (it finishes at once: nothing is pending)."""
        self.send_header(wire.Header(kind=wire.Header.STOP))
        return self.proc.wait(WAIT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.ctx.destroy(linger=0)


@pytest.fixture
def frontend(tmp_path: Path) -> Iterator[Frontend]:
    f = Frontend(tmp_path, "w-garbage")
    try:
        yield f
    finally:
        f.close()


X = np.array([[1.0, 2.0]], np.float32)


def test_a_malformed_frame_is_logged_once_per_kind_dropped_and_serving_goes_on(
    frontend: Frontend,
) -> None:
    too_few_frames = wire.Header(
        kind=wire.Header.BATCH, batch_id=7, model="plus1", version="1",
        tensors=[wire.Tensor(name="X", datatype="FP32", shape=[1, 2])],
    ).SerializeToString()  # one tensor declared, no frame for it  # fmt: skip
    not_for_a_worker = wire.Header(kind=wire.Header.RESULT, batch_id=7).SerializeToString()
    for _ in range(3):
        frontend.send(b"\xff\xfe not a header")
        frontend.send(too_few_frames)
        frontend.send(not_for_a_worker)

    assert frontend.load("plus1").error == ""  # the worker reads in order: all came before
    assert frontend.infer(1, X).tolist() == (X + 1).tolist()

    log = frontend.log()
    for kind in ("DecodeError", "ValueError", "RESULT"):
        lines = [line for line in log.splitlines() if "malformed" in line and kind in line]
        assert len(lines) == 1, f"{kind}: {lines}\n{log}"
        assert " WARNING " in lines[0] and "dropped" in lines[0]
    assert frontend.stop() == 0, frontend.log()


def test_a_model_calling_sys_exit_fails_its_load_or_batch_and_the_worker_serves_on(
    frontend: Frontend,
) -> None:
    """SystemExit from load() or a forward is the model's failure, answered at once:
    it used to end the loader or compute thread while the I/O thread heartbeated on,
    so the load never answered, and every batch after waited out its execution
    limit."""
    assert frontend.load("exits_loading").error == "SystemExit: no weights"
    assert frontend.load("exits_running").error == ""
    datatype, shape, raw = to_raw(X)
    tensor = wire.Tensor(name="X", datatype=datatype, shape=shape)
    frontend.send_header(wire.Header(kind=wire.Header.BATCH, batch_id=7, model="exits_running",
                                     version="1", tensors=[tensor]), (raw,))  # fmt: skip
    error = frontend.recv(wire.Header.ERROR)
    assert (error.batch_id, error.error, error.invalid) == (7, "SystemExit: 3", False)
    assert frontend.load("plus1").error == ""
    assert frontend.infer(8, X).tolist() == (X + 1).tolist()
    assert frontend.stop() == 0, frontend.log()


def test_model_py_reads_files_beside_it_by___file__(frontend: Frontend) -> None:
    """The worker runs in the test's working directory, not the model's folder."""
    assert frontend.load("beside").error == ""
    assert frontend.infer(2, X, "beside").tolist() == (X + 5).tolist()
    error = frontend.load("relative").error  # a relative path: the error says what to do
    assert error.startswith("FileNotFoundError: ") and "not beside model.py" in error
    assert "open Path(__file__).parent / 'n.txt'" in error
    assert frontend.stop() == 0, frontend.log()


def test_a_worker_of_two_frontends_says_so_and_takes_pass(tmp_path: Path) -> None:
    """--connect A,B: READY to each says two frontends, which is what makes a frontend
    answer a reply that left it nothing to send with PASS (worker/gather.py); PASS
    is taken as a message of the wire, not dropped as malformed, and both serve."""
    ctx: zmq.Context[Any] = zmq.Context()
    other = ctx.socket(zmq.ROUTER)
    other.linger = 0
    port = other.bind_to_random_port("tcp://127.0.0.1")
    frontend = Frontend(tmp_path, "w-two", also=f"tcp://127.0.0.1:{port}")
    try:
        assert frontend.ready.worker.frontends == 2
        assert other.poll(int(WAIT_S * 1000))
        _, *parts = other.recv_multipart()
        ready, _ = wire.unpack(parts)
        assert ready.kind == wire.Header.READY and ready.worker.frontends == 2
        assert frontend.load("plus1").error == ""
        assert frontend.infer(1, X).tolist() == (X + 1).tolist()
        frontend.send_header(wire.Header(kind=wire.Header.PASS))
        assert frontend.infer(2, 2 * X).tolist() == (2 * X + 1).tolist()
        assert frontend.stop() == 0, frontend.log()
    finally:
        frontend.close()
        ctx.destroy(linger=0)
    assert "malformed" not in frontend.log()


def test_another_frontend_s_batch_is_bounced_while_a_retry_runs_alone(tmp_path: Path) -> None:
    """A retry after a failure (BATCH alone) runs with nothing else on the worker; with
    --frontends N the other frontends did not know, and their batches queued behind a
    poison retry died with it (an innocent retry of theirs then failed, lost twice).
    While one is here, another frontend's batch is bounced unrun, and its heartbeats
    say so; once it has gone, batches run again."""
    ctx: zmq.Context[Any] = zmq.Context()
    other = ctx.socket(zmq.ROUTER)
    other.linger = 0
    port = other.bind_to_random_port("tcp://127.0.0.1")
    frontend = Frontend(tmp_path, "w-alone", also=f"tcp://127.0.0.1:{port}")
    gate = tmp_path / "repo" / "waits" / ".gate"

    def from_worker(sock: zmq.Socket[Any], want: Any) -> wire.Header:
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            if sock.poll(200):
                _, *parts = sock.recv_multipart()
                header, _ = wire.unpack(parts)
                if want(header):
                    return header
        raise AssertionError(f"nothing wanted within {WAIT_S} s:\n{frontend.log()}")

    def batch(batch_id: int, alone: bool = False) -> list[bytes]:
        datatype, shape, raw = to_raw(X)
        tensor = wire.Tensor(name="X", datatype=datatype, shape=shape)
        header = wire.Header(kind=wire.Header.BATCH, batch_id=batch_id, model="waits",
                             version="1", tensors=[tensor], alone=alone)  # fmt: skip
        return [b"w-alone", *wire.pack(header, (raw,))]

    try:
        from_worker(other, lambda h: h.kind == wire.Header.READY)
        assert frontend.load("waits").error == ""
        gate.touch()
        frontend.router.send_multipart(batch(1, alone=True))
        from_worker(frontend.router, lambda h: h.kind == wire.Header.HEARTBEAT and 1 in h.running)
        other.send_multipart(batch(7))
        bounced = from_worker(other, lambda h: h.kind == wire.Header.ERROR)
        assert bounced.batch_id == 7 and bounced.bounced
        from_worker(other, lambda h: h.kind == wire.Header.HEARTBEAT and h.alone)
        gate.unlink()
        assert frontend.recv(wire.Header.RESULT).batch_id == 1
        from_worker(other, lambda h: h.kind == wire.Header.HEARTBEAT and not h.alone)
        other.send_multipart(batch(8))
        ran = from_worker(other, lambda h: h.kind in (wire.Header.RESULT, wire.Header.ERROR))
        assert ran.kind == wire.Header.RESULT and ran.batch_id == 8
        assert frontend.stop() == 0, frontend.log()
    finally:
        gate.unlink(missing_ok=True)
        frontend.close()
        ctx.destroy(linger=0)


_LOGGED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_every_worker_log_line_names_the_worker(tmp_path: Path, log_format: str) -> None:
    worker_id = "cpu7#3"
    frontend = Frontend(tmp_path, worker_id, log_format)
    try:
        assert frontend.load("plus1").error == ""
        assert "no weights here" in frontend.load("broken").error
        frontend.send_header(wire.Header(kind=wire.Header.UNLOAD, model="plus1", version="1"))
        frontend.send(b"\xff")  # a malformed frame: logged, dropped
        assert frontend.stop() == 0, frontend.log()
    finally:
        frontend.close()

    log = frontend.log()
    expected = ["loaded model plus1", "cannot load model broken", "unloaded model plus1",
                "malformed", "STOP received"]  # fmt: skip
    if log_format == "json":
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        messages = [r["msg"] for r in records]
        assert all(r.get("worker") == worker_id for r in records), log
    else:
        messages = [line for line in log.splitlines() if _LOGGED.match(line)]
        assert all(f"[{worker_id}]" in line for line in messages), log
    for text in expected:
        assert any(text in m for m in messages), f"{text!r} not logged:\n{log}"


def test_heartbeats_count_each_step_wise_model_s_sequences_in_slots_and_waiting(
    tmp_path: Path,
) -> None:
    """What a frontend of several needs to place a sequence where the fewest are: the
    worker's heartbeat counts every sequence of each step-wise model version, running
    or waiting for a slot, and only those still there."""
    frontend = Frontend(tmp_path, "w-beats")
    try:
        frontend.start_endless(5, 6)  # max_active 1: 6 waits for 5's slot
        frontend.recv(wire.Header.STEP)  # both arrived: 5 runs

        def beat() -> dict[str, int]:
            return dict(frontend.recv(wire.Header.HEARTBEAT, skip=(wire.Header.STEP,)).occupied)

        assert beat() == {"endless@1": 2}
        frontend.send_header(wire.Header(kind=wire.Header.CANCEL, batch_id=5))
        while (counted := beat()) != {"endless@1": 1}:
            assert counted == {"endless@1": 2}  # one sent before the CANCEL was read
        frontend.send_header(wire.Header(kind=wire.Header.CANCEL, batch_id=6))
        while (counted := beat()) != {"endless@1": 0}:
            assert counted == {"endless@1": 1}
        assert frontend.stop() == 0, frontend.log()
    finally:
        frontend.close()


def test_an_unload_ends_the_model_s_sequences_with_a_final_step(tmp_path: Path) -> None:
    """UNLOAD of a step-wise model drops its loop: each of its sequences, stepping or
    waiting for a slot, gets a final STEP saying why, so its frontend waits on none
    and a STOP owes them nothing (it would wait out the 5 s grace)."""
    frontend = Frontend(tmp_path, "w-unload")
    try:
        frontend.start_endless(5, 6)  # max_active 1: 6 waits for 5's slot
        assert [s.id for s in frontend.recv(wire.Header.STEP).steps] == [5]  # it runs
        frontend.send_header(wire.Header(kind=wire.Header.UNLOAD, model="endless", version="1"))
        ended: dict[int, str] = {}
        while len(ended) < 2:
            for step in frontend.recv(wire.Header.STEP).steps:
                if step.final:
                    ended[step.id] = step.error
        assert ended == dict.fromkeys((5, 6), "model 'endless' version '1' was unloaded")
        assert frontend.stop() == 0, frontend.log()
    finally:
        frontend.close()
    assert "still running" not in frontend.log()


def test_a_release_that_raises_is_logged_with_its_own_traceback_alone(tmp_path: Path) -> None:
    """A sequence that ends in a round of steps run as the compute thread found no work
    logged its release()'s error chained to that queue.Empty ("During handling of the
    above exception, another exception occurred"), as if the worker had failed."""
    frontend = Frontend(tmp_path, "w-release")
    try:
        frontend.start_endless(5, model="unreleased")
        assert [s.final for s in frontend.recv(wire.Header.STEP).steps] == [True]
        wait_for(lambda: "ZeroDivisionError" in frontend.log(), WAIT_S, "release()'s error")
        frontend.load("plus1")  # the worker serves on
        assert frontend.infer(1, X).tolist() == (X + 1).tolist()
        assert frontend.stop() == 0, frontend.log()
    finally:
        frontend.close()
    log = frontend.log()
    assert "model unreleased: release() raised" in log, log
    assert "queue.Empty" not in log and "During handling" not in log, log
