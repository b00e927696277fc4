"""`batchd bench` (client/bench.py, client/loadgen.py): every datatype, the server's
error messages, a load process that dies, the arguments it refuses, the achieved
rate, percentiles without samples, and the one start its load processes share."""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from batchd.client import bench, loadgen
from batchd.client.bench import declared_datatypes, make_inputs
from batchd.client.codec import build_request
from batchd.client.loadgen import (
    Level,
    LoadFailed,
    _collect,
    _Report,
    _stream_summary,
    _summary,
    run_level,
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


def test_input_files_are_checked_and_set_the_rows_sent(tmp_path: Path) -> None:
    """`--input x.npy` gave "dictionary update sequence element #0 has length 1", a name
    the model lacks was passed over (random data sent), and `--batch 3` with a file of
    1 row said "3 row(s) per request" while sending 1, with the other inputs' 3."""
    meta = {"name": "m", "inputs": [{"name": n, "datatype": "FP32", "shape": [-1, 2]}
                                    for n in ("A", "B")]}  # fmt: skip
    np.save(tmp_path / "a.npy", np.ones((1, 2), np.float32))

    def request(*inputs: str) -> Any:
        args = bench.parse_args(["--model", "m", "--batch", "3", *inputs])
        return args, bench.request_for(args, meta)

    args, msg = request("--input", f"A={tmp_path / 'a.npy'}")
    assert args.batch == 1 and [list(t.shape) for t in msg.inputs] == [[1, 2], [1, 2]]
    with pytest.raises(
        ValueError, match=r"argument --input: expected NAME=FILE\.npy, got 'a\.npy'"
    ):
        request("--input", "a.npy")
    with pytest.raises(ValueError, match=r"model 'm' has no input C \(its inputs: A, B\)"):
        request("--input", f"C={tmp_path / 'a.npy'}")


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


def test_a_rate_level_sends_its_requests_rounded_up() -> None:
    """0.5 req/s for 1 s sends one request, not int(0.5) = none; 0.1 req/s for 30 s
    sends 3, though 0.1 * 30 is 3.0000000000000004."""
    assert split_level("rate", 0.5, 1.0, 2) == [range(0, 1)]
    assert [len(s) for s in split_level("rate", 0.1, 30.0, 1)] == [3]


def report(answered: int, elapsed: float, **errors: int) -> _Report:
    """A load process's report: `answered` latencies of 10 ms, over `elapsed` s."""
    empty = np.zeros(0)
    return _Report(np.full(answered, 0.01), errors, {}, elapsed, 0, empty, empty)


def test_the_throughput_of_a_rate_is_what_was_answered() -> None:
    """150 req/s offered for 2 s to a model serving ~46 req/s: the 300 answers took
    6.5 s (two processes, the slower's time counts), so 46 req/s, not 150. A rate
    kept up with is over the level: its last request left 1.9 s into 2 s, and its
    answer came 1.95 s in: 20 / 2 s, not 20 / 1.95 s."""
    level = _summary("rate", 150.0, 2.0, [report(150, 6.5), report(150, 6.0)])
    assert level.throughput == pytest.approx(300 / 6.5)
    assert (level.load, level.ok, level.elapsed_s) == (150.0, 300, 6.5)
    assert _summary("rate", 10.0, 2.0, [report(20, 1.95)]).throughput == 10.0


def test_a_rate_rounded_up_is_never_exceeded() -> None:
    """`--rate 0.3 --duration 1` sends one request (0.3 rounded up), answered in 11 ms:
    0.3 req/s, the time the schedule takes to send it, not 1 req/s over the 1 s level
    (nor, `--duration 0.0001`, 88.8 req/s over the 11 ms it took). elapsed_s stays."""
    level = _summary("rate", 0.3, 1.0, [report(1, 0.011)])
    assert (level.throughput, level.elapsed_s) == (pytest.approx(0.3), 0.011)
    assert _summary("rate", 1.0, 0.0001, [report(1, 0.0113)]).throughput == 1.0
    streamed = _summary("rate", 0.3, 1.0, [report(1, 0.011)], stream=True)
    assert streamed.throughput == pytest.approx(0.3)


@pytest.mark.parametrize("stream", [False, True])
def test_the_throughput_of_a_rate_never_exceeds_the_offered_rate(stream: bool) -> None:
    """Every request answered 1 ms after it left, over 1 to 3 processes: the throughput
    is at most the rate (a streamed level adds up each process's own, over its time)."""
    for rate in (0.3, 1.0, 3.0, 7.5, 10.0, 150.0):
        for seconds in (0.0001, 0.5, 1.0, 2.2):
            for processes in (1, 2, 3):
                shares = split_level("rate", rate, seconds, processes)
                reports = [report(len(s), s[-1] / rate + 0.001) for s in shares]
                level = _summary("rate", rate, seconds, reports, stream=stream)
                assert 0 < level.throughput <= rate * (1 + 1e-12), (rate, seconds, processes)


def test_a_level_of_no_time_divides_by_nothing() -> None:
    assert _summary("concurrency", 1.0, 0.0, [report(1, 0.0)]).throughput == 0.0


def test_a_level_that_sent_nothing_is_an_error() -> None:
    with pytest.raises(LoadFailed, match="no request was sent in 1 s"):
        _summary("rate", 0.5, 1.0, [report(0, 1.0)])


def test_percentiles_without_samples_are_none_and_shown_as_a_dash() -> None:
    """Every request failed: no latency to take a percentile of (not 0.0 ms)."""
    level = _summary("concurrency", 2.0, 1.0, [report(0, 1.0, UNAVAILABLE=3)])
    assert (level.p50_ms, level.p90_ms, level.p99_ms) == (None, None, None)
    assert json.loads(json.dumps(asdict(level)))["p50_ms"] is None
    assert bench.rows(level)[0].split()[:5] == ["c=2", "0.0", "-", "-", "-"]
    _, s = _stream_summary([report(0, 1.0, UNAVAILABLE=3)], 0.0)
    assert (s.ttfo_p50_ms, s.ttfo_p99_ms, s.inter_output_p50_ms) == (None, None, None)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--concurrency", "0:4"], "--concurrency: 0:4: a range start:end needs"),
        (["--concurrency=-2:4"], "--concurrency: -2:4: a range start:end needs"),
        (["--concurrency", "8:4"], "--concurrency: 8:4: a range start:end needs"),
        (["--concurrency", "4,0"], "--concurrency: 4,0: each level must be positive"),
        (["--rate", "0"], "--rate: 0: each level must be positive"),
        (["--rate", "100,-5"], "--rate: 100,-5: each level must be positive"),
        (["--rate", "inf"], "--rate: inf: each level must be positive and finite"),
        (["--duration", "0"], "--duration: 0: must be a positive number"),
        (["--duration", "-1"], "--duration: -1: must be a positive number"),
        (["--duration", "nan"], "--duration: nan: must be a positive number"),
        (["--warmup", "-1"], "--warmup: -1: must be 0 or a positive number"),
        (["--warmup", "inf"], "--warmup: inf: must be 0 or a positive number"),
        (["--batch", "0"], "--batch: 0: must be at least 1"),
        (["--batch=-2"], "--batch: -2: must be at least 1"),
        (["--processes", "0"], "--processes: 0: must be at least 1"),
        (["--processes=-1"], "--processes: -1: must be at least 1"),
        (["--connections", "0"], "--connections: 0: must be at least 1"),
        (["--connections=-3"], "--connections: -3: must be at least 1"),
    ],
)
def test_a_load_that_cannot_run_is_a_usage_error(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything runs (`--concurrency 0:4` doubled 0 forever; `--batch 0`
    ran every level with every request refused; `--processes 0` quietly ran one)."""
    with pytest.raises(SystemExit) as raised:
        bench.parse_args(["--model", "m", *argv])
    assert raised.value.code == 2
    assert why in capsys.readouterr().err


def test_json_to_stdout_leaves_stdout_to_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json -`: the table goes to stderr, so stdout parses."""
    args = argparse.Namespace(
        model="m", url="u", duration=1.0, batch=1, stream=False, json="-", plot=None
    )
    bench.report(args, [Level("rate", 10.0, 1.0, ok=10, throughput=10.0, p50_ms=1.0)])
    out, err = capsys.readouterr()
    assert json.loads(out)["levels"][0]["throughput"] == 10.0
    assert "req/s" in err and "r=10" in err


class ThreadProcess:
    """A load process as a thread: run_level's hand-over, in this process."""

    def __init__(self, target: Any, args: tuple[Any, ...]) -> None:
        self.thread, self.pid = threading.Thread(target=target, args=args), 0

    @property
    def exitcode(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def terminate(self) -> None:
        pass


def test_the_load_processes_of_a_level_share_one_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each process is handed the same start instant (not each its own clock's now),
    so that two of them keep one schedule."""
    starts: list[Any] = []

    async def drive(*args: Any) -> _Report:
        starts.append(args[0])
        return report(len(args[-1]), 1.0)

    context = SimpleNamespace(Queue=queue.Queue, Process=ThreadProcess)
    monkeypatch.setattr(loadgen, "mp", SimpleNamespace(get_context=lambda _: context))
    monkeypatch.setattr(loadgen, "_drive", drive)
    level = run_level("u", {}, 1, None, "rate", 4.0, 1.0, 2, lambda _: None)
    assert level.ok == 4 and len(starts) == 2
    assert isinstance(starts[0], float) and starts[0] == starts[1]


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


def test_an_open_loop_over_two_processes_prints_json_alone(
    test_server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--rate 3 --duration 0.5`: 2 requests (1.5 rounded up), one per load process,
    both answered, over at least the 2/3 s they take to send at 3/s; with `--json -`
    stdout is the JSON and the table is on stderr."""
    argv = ["--url", test_server.url, "--model", "echo", "--rate", "3", "--duration", "0.5"]
    code = bench.main([*argv, "--warmup", "0", "--processes", "2", "--json", "-"])
    out, err = capsys.readouterr()
    (level,) = json.loads(out)["levels"]
    assert (code, level["ok"], level["errors"]) == (0, 2, {})
    assert level["throughput"] == pytest.approx(2 / max(2 / 3, level["elapsed_s"]))
    assert "r=3" in err
