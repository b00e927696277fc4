"""Operating batchd: Prometheus metrics after known traffic, structured logs."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from batchd.client import Client, DeadlineExceeded, InvalidInput
from batchd.protos._pool import slow_backend
from batchd.protos.logs import TEXT_FORMAT, TextFormatter, setup_logging
from tests.conftest import Gate, scrape, value
from tests.servers import EXAMPLES, FIRST_SLOT, TEST_DEVICE, ServerProcess, wait_for
from tests.test_contracts import GOOD  # X FP32 [2] -> Y FP32 [2]


def test_metrics_count_known_traffic_exactly(test_server: ServerProcess) -> None:
    before = scrape(test_server)
    with Client(test_server.url) as c:
        for v in range(5):  # one at a time: five batches of one row
            c.infer("gated", {"X": np.array([[float(v)]], np.float32)}, timeout=30)
        c.infer("gated", {"X": np.zeros((3, 1), np.float32)}, timeout=30)  # one batch, 3 rows
        with pytest.raises(InvalidInput):
            c.infer("gated", {"X": np.zeros((1, 2), np.float32)}, timeout=30)
    after = scrape(test_server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    m = {"model": "gated", "version": "1"}
    assert delta("batchd_inference_request_success_total", **m) == 6
    assert delta("batchd_inference_request_failure_total", reason="invalid", **m) == 1
    assert delta("batchd_inference_count_total", **m) == 8
    assert delta("batchd_inference_exec_count_total", **m) == 6
    assert delta("batchd_batch_size_count", **m) == 6
    assert delta("batchd_batch_size_sum", **m) == 8
    assert delta("batchd_batch_size_bucket", le="1.0", **m) == 5
    assert delta("batchd_batch_size_bucket", le="4.0", **m) == 6
    assert value(after, "batchd_inference_pending_request_count", **m) == 0
    assert delta("batchd_inference_queue_duration_us_total", **m) > 0
    assert delta("batchd_inference_compute_infer_duration_us_total", **m) > 0
    # every local slot has its restarts series from the start (increase() sees the first)
    slots = {dict(ls)["worker"] for n, ls in after if n == "batchd_worker_up"}
    restarts = {dict(ls)["slot"] for n, ls in after if n == "batchd_worker_restarts_total"}
    assert slots and slots == restarts
    up = [k for k, v in after.items() if k[0] == "batchd_worker_up" and v == 1.0]
    assert len(up) == 1
    assert delta("batchd_frontend_loop_busy_seconds_total") > 0  # the loop served all that


def test_callers_whose_deadline_passed_are_counted_so_and_pending_no_more(
    unstaged_server: ServerProcess, gate: Gate
) -> None:
    """Two callers give up (their 1 s deadline passes) while queued behind a held
    batch: they count as `deadline` failures, not `cancelled`, and the pending
    gauge drops to 0 at once, not when their dead entries are swept."""
    m = {"model": "gated", "version": "1"}
    before = scrape(unstaged_server)
    gate.close()
    with Client(unstaged_server.url) as c, ThreadPoolExecutor(1) as pool:
        held = pool.submit(c.infer, "gated", {"X": np.array([[1.0]], np.float32)}, timeout=60)
        wait_for(lambda: len(gate.calls(log="entered")) == 1, 30, "the held batch to start")
        for _ in range(2):
            with pytest.raises(DeadlineExceeded):
                c.infer("gated", {"X": np.array([[2.0]], np.float32)}, timeout=1.0)

        def failed(reason: str) -> float:
            after = scrape(unstaged_server)
            return value(after, "batchd_inference_request_failure_total", reason=reason, **m) - (
                value(before, "batchd_inference_request_failure_total", reason=reason, **m)
            )

        wait_for(lambda: failed("deadline") + failed("cancelled") == 2, 30, "both counted")
        assert failed("deadline") == 2 and failed("cancelled") == 0
        assert value(scrape(unstaged_server), "batchd_inference_pending_request_count", **m) == 0
        gate.open()
        assert held.result(60)["Y"][0, 0] == 2.0  # gated doubles X


def test_metrics_endpoint_answers_only_metrics(test_server: ServerProcess) -> None:
    url = test_server.metrics_url().replace("/metrics", "/other")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 404
    info.value.close()


def test_json_logs_carry_ids_as_fields(tmp_path: Path) -> None:
    server = ServerProcess(EXAMPLES, "--log-format", "json", log_dir=tmp_path).start()
    try:
        with Client(server.url) as c:
            c.infer("tiny", np.zeros((1, 16), np.float32), timeout=30)
    finally:
        assert server.stop() == 0
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "msg", "pid"} <= set(line) for line in lines)
    ready = [line for line in lines if "ready (pid" in line["msg"]]
    assert ready and ready[0]["worker"] == f"{FIRST_SLOT}#0"
    assert ready[0]["device"] == (TEST_DEVICE or "cpu")
    assert any(line.get("model") == "tiny" and line["logger"] == "batchd.server" for line in lines)
    assert not [
        line
        for line in lines
        if line["level"] == "INFO" and "tiny" in line["msg"] and "infer" in line["msg"].lower()
    ]  # no per-request lines at INFO


def test_text_written_into_a_log_line_cannot_forge_another_or_hold_controls(
    tmp_path: Path,
) -> None:
    """A model's error may quote what a caller sent; its newline began a line of its own
    (a forged ERROR record), an escape sequence cleared the terminal, a NUL made grep
    take the log for binary. Now continuation lines start with spaces, controls are
    written as \\xNN."""
    forged = "2026-01-01 00:00:00,000 ERROR batchd.server: FORGED"
    (repo := tmp_path / "repo" / "broken").mkdir(parents=True)
    (repo / "model.toml").write_text(GOOD)
    (repo / "model.py").write_text(
        f"def load(device):\n    raise ValueError('bad\\n{forged}\\x1b[2J\\x00\\r')\n"
    )
    server = ServerProcess(repo.parent, log_dir=tmp_path).start()
    assert server.stop() == 0
    log = server.log()
    assert "FORGED\\x1b[2J\\x00\\x0d" in log and "\x1b" not in log and "\x00" not in log
    assert not [line for line in log.splitlines() if line.startswith(forged)], log


def test_serving_raises_its_open_file_limit_to_the_hard_limit() -> None:
    """At the usual soft limit of 1,024, as many idle connections locked out every new
    client, and asyncio logged each accept refused (138,000 lines in 30 s)."""
    code = (
        "import resource\n"
        "from batchd.server.cli import more_files\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "print(*more_files(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, now, hard = (int(v) for v in out.stdout.split())
    assert before == 256 and after == now and (after == hard or (hard == -1 and after >= 1 << 20))


def test_no_character_in_a_message_begins_a_text_log_line_of_its_own() -> None:
    """Every character Python's splitlines() breaks at (a log viewer's too, some of
    them): U+2028 and U+2029 passed, so a message still split into forged lines."""
    breaking = [chr(c) for c in range(0x110000) if len(f"a{chr(c)}b".splitlines()) > 1]
    assert "\u2028" in breaking and "\n" in breaking
    text = TextFormatter(TEXT_FORMAT)
    for ch in breaking:
        said = f"a{ch}2026-01-01 00:00:00,000 ERROR batchd.server: FORGED"
        record = logging.LogRecord("batchd.server", logging.WARNING, "x", 1, "%s", (said,), None)
        first, *more = text.format(record).splitlines()
        assert "WARNING" in first and all(line.startswith("    ") for line in more), repr(ch)


def test_an_answer_gRPC_s_core_refused_as_its_call_ended_is_logged_at_debug_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gRPC logs a unary call's answer its core refused (the caller left as it went
    out) at ERROR with a traceback: shown at DEBUG only. Other errors stay errors."""

    class ExecuteBatchError(Exception):  # (as gRPC's core names its refusal)
        pass

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    core = logging.getLogger("grpc._cython.cygrpc")
    try:
        for level in ("INFO", "DEBUG", "INFO"):  # (set up twice: one filter, not two)
            setup_logging(level)
            try:
                raise ExecuteBatchError("Failed execute_batch")
            except ExecuteBatchError:
                core.exception("ExecuteBatchError raised in core by servicer method [/m]")
            core.error("something else")
            err = capsys.readouterr().err
            assert "something else" in err and ("ExecuteBatchError" in err) == (level == "DEBUG")
            assert ("DEBUG grpc._cython.cygrpc: ExecuteBatchError raised" in err) == (
                level == "DEBUG"
            )
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_a_model_s_warnings_are_json_log_lines_too(tmp_path: Path) -> None:
    """Python's warnings go to stderr on their own: torch's (a .pt2 loaded by an older
    torch, seen on a GPU machine) broke the JSON log stream."""
    (repo := tmp_path / "repo" / "warns").mkdir(parents=True)
    (repo / "model.toml").write_text(GOOD)
    (repo / "model.py").write_text(
        "import warnings\n"
        "def load(device):\n"
        "    warnings.warn('the weights were saved by a newer version', UserWarning)\n"
        "    return lambda x: {'Y': x}\n"
    )
    server = ServerProcess(repo.parent, "--log-format", "json", log_dir=tmp_path).start()
    assert server.stop() == 0
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    warned = [line for line in lines if "saved by a newer version" in line["msg"]]
    assert [(w["level"], w["logger"]) for w in warned] == [("WARNING", "py.warnings")]


def test_bench_measures_closed_and_open_loop(example_server: ServerProcess, tmp_path: Path) -> None:
    import subprocess
    import sys

    batchd = str(Path(sys.executable).parent / "batchd")
    common = [
        "--url",
        example_server.url,
        "--model",
        "tiny",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--processes",
        "1",
    ]
    for extra, loads in ((["--concurrency", "1,4"], [1.0, 4.0]), (["--rate", "50"], [50.0])):
        out = tmp_path / "bench.json"
        run = subprocess.run(
            [
                batchd,
                "bench",
                *common,
                *extra,
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "bench.png"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "req/s" in run.stdout and "p99 ms" in run.stdout
        result = json.loads(out.read_text())
        assert [lv["load"] for lv in result["levels"]] == loads
        for lv in result["levels"]:
            assert lv["ok"] > 0 and lv["errors"] == {} and lv["p50_ms"] > 0
            assert lv["server_avg_batch"] is not None and lv["server_avg_batch"] >= 1
        assert (tmp_path / "bench.png").stat().st_size > 1000


def test_the_protobuf_backend_is_checked() -> None:
    assert slow_backend("upb") is None and slow_backend("cpp") is None
    assert "'python' implementation" in str(slow_backend("python"))


def test_a_pure_python_protobuf_is_named_at_start(
    example_server: ServerProcess, tmp_path: Path
) -> None:
    env = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    server = ServerProcess(EXAMPLES, log_dir=tmp_path, env=env).start(ready=False)
    assert server.stop() == 0
    warning = "protobuf runs its 'python' implementation (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="
    assert warning in server.log()
    assert "protobuf runs" not in example_server.log()  # upb, as installed: no warning


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (a server started in a session of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    ("flag", "what", "hint"),
    [
        ("--grpc-port", "gRPC", "0: a free one"),
        ("--http-port", "HTTP", "-1 turns it off"),
        ("--metrics-port", "metrics", "-1 turns it off"),
    ],
)
def test_a_port_in_use_stops_start_up_cleanly_before_anything_serves(
    flag: str, what: str, hint: str, tmp_path: Path
) -> None:
    """Every port is bound before gRPC serves and before any worker starts: a busy one
    is a line naming the address and the flag, exit status 2, no traceback, nothing left
    running. (gRPC's raised a RuntimeError; metrics were bound last, once serving, and
    died in an ExceptionGroup.)"""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "batchd.server", "--model-repository", str(EXAMPLES),
             "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", flag, str(port),
             "--workers", "1", "--jobs-dir", str(tmp_path / "jobs"), "--drain-notice", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = server.communicate(timeout=120)
        finally:
            if server.poll() is None:
                server.kill()
    assert server.returncode == 2, out
    refusal = f"batchd: cannot serve {what} on 127.0.0.1:{port}: Address already in use ({flag}; "
    assert out.splitlines()[-1] == refusal + hint + ")", out
    assert "Traceback" not in out and "serving gRPC" not in out, out
    assert "serving HTTP" not in out, out  # (it served, when the metrics port was busy)
    wait_for(lambda: not _session(server.pid), 30, "the server's processes to exit")


def test_a_request_head_over_64_kib_closes_the_metrics_connection_quietly(
    test_server: ServerProcess,
) -> None:
    """No blank line within the stream's 64 KiB limit: the connection is closed, without
    an ERROR and its traceback in the log for each such connection."""
    url = urllib.parse.urlsplit(test_server.metrics_url())
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Long: " + b"a" * 70_000)
        with contextlib.suppress(ConnectionResetError):  # closed with some of it unread
            while s.recv(65536):
                pass
    log = test_server.log()
    assert "LimitOverrunError" not in log and "client_connected_cb" not in log, log[-3000:]
