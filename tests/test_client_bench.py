"""`batchd bench` (client/bench.py, client/loadgen.py): every datatype, the server's
error messages, and a load process that dies."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd.client import bench
from batchd.client.codec import build_request
from batchd.client.loadgen import (
    LoadFailed,
    _collect,
    declared_datatypes,
    make_inputs,
    split_level,
)
from batchd.protos.datatypes import DATATYPES
from tests.conftest import Gate
from tests.servers import ROOT, ServerProcess, children, wait_for


def run_bench(url: str, model: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    argv = ["--url", url, "--model", model, "--concurrency", "1", "--duration", "0.5"]
    argv += ["--warmup", "0", "--processes", "1", "--json", str(out), *extra]
    code = bench.main(argv)
    return code, json.loads(out.read_text())


def test_random_inputs_travel_as_each_declared_datatype() -> None:
    meta = {"inputs": [{"name": f"IN_{d}", "datatype": d, "shape": [-1, 3]} for d in DATATYPES]}
    msg = build_request("m", make_inputs(meta, 2, 4, {}), datatypes=declared_datatypes(meta))
    assert [(t.name, t.datatype, list(t.shape)) for t in msg.inputs] == [
        (f"IN_{d}", d, [2, 3]) for d in DATATYPES
    ]


@pytest.mark.parametrize(
    ("load", "processes", "callers"),
    [(3, 2, [2, 1]), (6, 4, [2, 2, 1, 1]), (5, 4, [2, 1, 1, 1]), (2, 4, [1, 1]), (8, 2, [4, 4])],
)
def test_a_concurrency_level_is_split_whole_over_the_processes(
    load: int, processes: int, callers: list[int]
) -> None:
    """`--concurrency 3 --processes 2` runs 3 callers (2 + 1), not 2 of 1.5 each."""
    assert [len(s) for s in split_level("concurrency", load, 1.0, processes)] == callers


def test_a_rate_level_sends_every_request_once_over_the_processes() -> None:
    """10 req/s for 1.5 s over 4 processes: the 15 requests of one process, each sent
    by one of them at its time i / 10 s, the processes taking turns."""
    shares = split_level("rate", 10.0, 1.5, 4)
    assert sorted(i for s in shares for i in s) == list(range(15))
    assert [len(s) for s in shares] == [4, 4, 4, 3]
    assert [s[0] for s in shares] == [0, 1, 2, 3]


def test_bench_drives_a_model_with_every_datatype(
    test_server: ServerProcess, tmp_path: Path
) -> None:
    """The echo model has one input of each datatype the README lists."""
    code, result = run_bench(test_server.url, "echo", tmp_path)
    (level,) = result["levels"]
    assert (code, level["errors"], level["error_messages"]) == (0, {}, {})
    assert level["ok"] > 0


def test_bench_shows_the_servers_first_message_per_error_code(
    test_server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An FP64 file for `limited`'s FP32 input: every request is refused, and the
    table and the JSON say why, not only how often."""
    wrong = tmp_path / "x.npy"
    np.save(wrong, np.zeros((1, 1), np.float64))
    code, result = run_bench(test_server.url, "limited", tmp_path, "--input", f"X={wrong}")
    (level,) = result["levels"]
    assert code == 1 and level["ok"] == 0 and level["errors"]["INVALID_ARGUMENT"] > 0
    message = level["error_messages"]["INVALID_ARGUMENT"]
    assert "FP32" in message and "FP64" in message
    assert f"INVALID_ARGUMENT: {message}" in capsys.readouterr().out


class FakeProcess:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode, self.pid = exitcode, 4242


@pytest.mark.parametrize(
    ("exitcode", "give_up_at", "why"),
    [
        (-signal.SIGKILL, 1e18, r"load process 4242 died \(killed by SIGKILL\)"),
        (1, 1e18, r"died \(exit code 1\)"),
        (0, 1e18, "exited without reporting"),
        (None, 0.0, r"load process\(es\) \[4242\] did not report in time"),
    ],
)
def test_collect_gives_up_on_a_report_that_cannot_come(
    exitcode: int | None, give_up_at: float, why: str
) -> None:
    with pytest.raises(LoadFailed, match=why):
        _collect([FakeProcess(exitcode)], queue.Queue(), give_up_at, lambda: None)  # type: ignore[list-item]


def test_collect_reports_a_load_process_that_failed() -> None:
    out: queue.Queue[str] = queue.Queue()
    out.put("ValueError: no such input")
    with pytest.raises(LoadFailed, match="a load process failed: ValueError: no such input"):
        _collect([FakeProcess(None)], out, 1e18, lambda: None)  # type: ignore[list-item]


def _load_processes(pid: int) -> list[int]:
    """The multiprocessing-spawned children of `pid` (not its resource tracker)."""
    found = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


def test_bench_ends_with_an_error_when_a_load_process_dies(
    test_server: ServerProcess, gate: Gate
) -> None:
    """The load process is killed while its request is held in the model; the bench
    stops with a message naming it and exit status 2 instead of waiting forever."""
    gate.close()
    cmd = [sys.executable, "-m", "batchd.client.bench", "--url", test_server.url]
    cmd += ["--model", "gated", "--concurrency", "1", "--duration", "600", "--warmup", "0"]
    cmd += ["--processes", "1"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ)
    )
    try:
        wait_for(lambda: gate.records("gated", log="entered"), 60, "the load to reach the model")
        (load_pid,) = _load_processes(proc.pid)
        os.kill(load_pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        gate.open()
    assert proc.returncode == 2, err
    assert f"load process {load_pid} died (killed by SIGKILL)" in err.decode()
