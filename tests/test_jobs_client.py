"""The jobs client against real servers: what a submission that cannot be sent says,
a stopping server's refusal (taken during the drain notice, refused after it: its
port closed, or on a kept HTTP connection 503 with a Retry-After), a download longer
than the client's timeout, and `batchd jobs results` stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import numpy as np
import pytest

from batchd.client import (
    AsyncClient,
    BadResponse,
    Client,
    LimitExceeded,
    ServerUnavailable,
    jobs_cli,
)
from batchd.client.jobs import Job, _GivenUp, _Upload
from batchd.client.jobs_cli import bar, describe
from batchd.protos import jobs_pb2, jobs_pb2_grpc
from tests.conftest import Gate, run
from tests.servers import TEST_MODELS, ServerProcess, grpc_servicer, listening, wait_for
from tests.test_jobs import gated_lines, line
from tests.test_jobs_upload import until


def test_a_submission_that_cannot_be_read_says_why(example_server: ServerProcess,
                                                    tmp_path: Path) -> None:  # fmt: skip
    """gRPC reads an upload's pieces in its own thread and called any error there
    "Exception iterating requests!" (UNKNOWN): the client raises the error itself."""
    with Client(example_server.url) as c:
        with pytest.raises(FileNotFoundError):
            c.submit_job("tiny", tmp_path / "nope.jsonl")
        with pytest.raises(IsADirectoryError):
            c.submit_job("tiny", tmp_path)
        bad = [line("a", "INPUT0", "FP32", np.float32(1.0), [1, 1])]  # numpy: not JSON
        with pytest.raises(TypeError, match="not JSON serializable"):
            c.submit_job("tiny", iter(bad))


def test_a_stopping_server_takes_uploads_through_its_notice_then_refuses_with_a_pushback(
    gate: Gate, tmp_path: Path
) -> None:
    """SIGTERM with --drain-notice 2: balancers still send for 2 s, so a submission
    then is taken (it was refused at once, with nothing to retry it). After the
    notice the ports close and gRPC connections get GOAWAY: a submission reaches
    another replica, or none (UNAVAILABLE, which the client retries); one on an HTTP
    connection still open is refused 503 with a Retry-After and the connection closed:
    nothing was kept, and it may be sent again."""
    server = ServerProcess(TEST_MODELS, "--drain-notice", "2", log_dir=tmp_path,
                           env={"BATCHD_TEST_DIR": str(gate.state)}).start()  # fmt: skip
    answered: list[Any] = []
    kept = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    with Client(server.url, retries=2) as c:
        gate.close()  # a request in flight keeps the drain going past the notice
        online = threading.Thread(
            target=lambda: answered.append(c.infer("gated", np.ones((1, 1), np.float32)))
        )
        online.start()
        try:
            wait_for(lambda: gate.records("gated", log="entered"), 30, "the request's batch")
            kept.request("GET", "/v2/health/live")
            assert kept.getresponse().read() == b'{"live":true}'
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "stopping: not ready" in server.log(), 30, "the notice")
            taken = c.submit_job("gated", gated_lines(range(5, 7)))
            assert taken.status == "queued"
            wait_for(lambda: not listening(server.port), 30, "the notice to end")
            with pytest.raises(ServerUnavailable):
                c.submit_job("gated", gated_lines(range(8, 9)))
            body = "".join(json.dumps(x) + "\n" for x in gated_lines(range(8, 9)))
            kept.request("POST", "/v2/jobs?model=gated", body)
            refused = kept.getresponse()
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
            assert b"this server is stopping" in refused.read()
            assert refused.headers["Connection"] == "close"
        finally:
            gate.open()
            online.join(60)
            kept.close()
    assert server.stop() == 0, server.log()
    assert len(answered) == 1  # the drain answered it


class _SlowResults(jobs_pb2_grpc.JobsServicer):
    """JobResults sends one piece, then holds the stream until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def JobResults(self, request: Any, context: Any) -> Iterator[jobs_pb2.JobResultsChunk]:
        yield jobs_pb2.JobResultsChunk(data=b'{"custom_id": "a"}\n')
        self.release.wait(60)
        yield jobs_pb2.JobResultsChunk(data=b'{"custom_id": "b"}\n')


@pytest.fixture
def slow_results() -> Iterator[tuple[str, _SlowResults]]:
    servicer = _SlowResults()
    with grpc_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, servicer) as port:
        yield f"127.0.0.1:{port}", servicer
        servicer.release.set()


def test_a_download_takes_longer_than_the_client_s_timeout(
    slow_results: tuple[str, _SlowResults], tmp_path: Path
) -> None:
    """The client's timeout (seconds per call) bounded the whole download, so every
    download longer than it failed DEADLINE_EXCEEDED half way (60 s in the CLI)."""
    url, servicer = slow_results

    class Out:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data
            servicer.release.wait(60)  # the first piece: held until past the timeout

    out = Out()
    with Client(url, timeout=0.5) as c:
        threading.Timer(1.5, servicer.release.set).start()
        assert c.job_results("j", out) == 2  # type: ignore[arg-type]
    assert out.data.count(b"\n") == 2


class _CutResults(jobs_pb2_grpc.JobsServicer):
    """JobResults of 3 lines whose connection is cut after each line: UNAVAILABLE."""

    def __init__(self) -> None:
        self.offsets: list[int] = []

    def JobResults(self, request: Any, context: Any) -> Iterator[jobs_pb2.JobResultsChunk]:
        self.offsets.append(request.offset)
        results = b"a\nb\nc\n"[request.offset :]
        yield jobs_pb2.JobResultsChunk(data=results[:2])
        if len(results) > 2:
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")


def test_a_cut_download_goes_on_from_where_it_got_to(tmp_path: Path) -> None:
    """A download cut off went back to nothing: it failed (the CLI's retries=3 never
    reached it). It asks again from the bytes it has, its time to give up counted again
    after each one that got further; given none, it fails and leaves no file."""
    servicer = _CutResults()
    out = tmp_path / "results.jsonl"
    with grpc_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, servicer) as port:
        with Client(f"127.0.0.1:{port}") as c:
            assert c.job_results("j", out) == 3
        assert (out.read_bytes(), servicer.offsets) == (b"a\nb\nc\n", [0, 2, 4])

        async def download() -> int:
            async with AsyncClient(f"127.0.0.1:{port}") as c:
                return await c.job_results("j", tmp_path / "again.jsonl")

        assert run(download) == 3 and (tmp_path / "again.jsonl").read_bytes() == b"a\nb\nc\n"
        with Client(f"127.0.0.1:{port}") as c, pytest.raises(ServerUnavailable):
            c.job_results("j", tmp_path / "none.jsonl", give_up_s=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.jsonl", "results.jsonl"]


class _Restarting(jobs_pb2_grpc.JobsServicer):
    """JobResults UNAVAILABLE for OUTAGE_S from its first call (a server restarting),
    then its two lines."""

    OUTAGE_S = 1.5

    def __init__(self) -> None:
        self.calls: list[float] = []

    def JobResults(self, request: Any, context: Any) -> Iterator[jobs_pb2.JobResultsChunk]:
        self.calls.append(time.monotonic())
        if self.calls[-1] - self.calls[0] < self.OUTAGE_S:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        yield jobs_pb2.JobResultsChunk(data=b"a\nb\n"[request.offset :])

    def GetJob(self, request: Any, context: Any) -> jobs_pb2.Job:
        return jobs_pb2.Job(id=request.id, status="completed", total=2, completed=2)


def test_a_download_rides_out_a_server_s_restart(tmp_path: Path) -> None:
    """Its retries, a count (the CLI's 3 at 50 ms), ran out 0.35 s into an outage of a
    second and a half: `batchd jobs results` exited 2 while the server came back (review
    56d). It waits, with backoff, till --timeout passes without a byte."""
    servicer = _Restarting()
    with grpc_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, servicer) as port:
        code = jobs_cli.main(["results", "j", "--url", f"127.0.0.1:{port}", "-o",
                              str(tmp_path / "out.jsonl")])  # fmt: skip
    assert code == 0 and (tmp_path / "out.jsonl").read_bytes() == b"a\nb\n"
    assert servicer.calls[-1] - servicer.calls[0] >= _Restarting.OUTAGE_S


class _LongThenCut(jobs_pb2_grpc.JobsServicer):
    """JobResults that streams four lines 0.2 s apart and is then cut (UNAVAILABLE);
    asked again, the rest."""

    def __init__(self) -> None:
        self.offsets: list[int] = []

    def JobResults(self, request: Any, context: Any) -> Iterator[jobs_pb2.JobResultsChunk]:
        self.offsets.append(request.offset)
        if request.offset:
            yield jobs_pb2.JobResultsChunk(data=b"e\n")
            return
        for data in (b"a\n", b"b\n", b"c\n", b"d\n"):
            yield jobs_pb2.JobResultsChunk(data=data)
            time.sleep(0.2)  # (a long stream: 0.8 s, past give_up_s)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")


def test_a_download_streamed_longer_than_its_give_up_time_is_resumed_when_cut(
    tmp_path: Path,
) -> None:
    """The time to give up counted from the call that began it, not its last byte: any
    download longer than give_up_s (60 s) that a restart cut was given up at once."""
    servicer = _LongThenCut()
    with (
        grpc_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, servicer) as port,
        Client(f"127.0.0.1:{port}") as c,
    ):
        assert c.job_results("j", tmp_path / "out.jsonl", give_up_s=0.5) == 5
    assert servicer.offsets == [0, 8]


def test_the_results_of_a_running_job_say_they_are_its_results_so_far(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`submit; results` wrote the lines kept so far, said "N lines written" and exited 0,
    a script none the wiser (review 56d)."""

    class Running(_Restarting):
        OUTAGE_S = 0.0

        def GetJob(self, request: Any, context: Any) -> jobs_pb2.Job:
            return jobs_pb2.Job(id=request.id, status="running", total=9, completed=2)

    with grpc_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, Running()) as port:
        code = jobs_cli.main(["results", "j", "--url", f"127.0.0.1:{port}", "-o",
                              str(tmp_path / "out.jsonl")])  # fmt: skip
    assert code == 0 and capsys.readouterr().err.splitlines() == [
        f"2 lines written to {tmp_path / 'out.jsonl'}",
        "job j is running (2 of 9 lines then): these are its results so far; `batchd jobs "
        "wait` for all of them",
    ]


class _ShortResults(jobs_pb2_grpc.JobsServicer):
    """JobResults that ends, OK, inside a line (a proxy, a broken server)."""

    def JobResults(self, request: Any, context: Any) -> Iterator[jobs_pb2.JobResultsChunk]:
        yield jobs_pb2.JobResultsChunk(data=b'{"custom_id": "a"}\n{"custom_id": "b", "outp')


def test_results_that_end_inside_a_line_are_refused_and_leave_the_file_as_it_was(
    tmp_path: Path,
) -> None:
    """A download whose stream ended OK inside a line replaced the file with the cut
    results, and the CLI said it had written them (exit 0): a file "written whole or
    not at all" was neither."""
    out = tmp_path / "results.jsonl"
    out.write_bytes(b"earlier\n")
    with grpc_servicer(jobs_pb2_grpc.add_JobsServicer_to_server, _ShortResults()) as port:
        with Client(f"127.0.0.1:{port}") as c, pytest.raises(BadResponse, match="cut short"):
            c.job_results("j", out)

        async def download() -> int:
            async with AsyncClient(f"127.0.0.1:{port}") as c:
                return await c.job_results("j", out)

        with pytest.raises(BadResponse, match="ended 43 bytes in, inside a line"):
            run(download)
    assert out.read_bytes() == b"earlier\n" and sorted(tmp_path.iterdir()) == [out]


def test_sigterm_during_a_download_leaves_no_partial_file(
    slow_results: tuple[str, _SlowResults], tmp_path: Path
) -> None:
    """Ctrl-C removed OUT.partial; SIGTERM (a service manager, `timeout`) left it."""
    url, _ = slow_results
    out = tmp_path / "results.jsonl"
    cmd = [str(Path(sys.executable).parent / "batchd"), "jobs", "results", "--url", url, "j",
           "-o", str(out)]  # fmt: skip
    with subprocess.Popen(cmd, stderr=subprocess.PIPE) as proc:
        try:
            wait_for(lambda: list(tmp_path.glob("*.partial")), 30, "the download to begin")
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not list(tmp_path.glob("*.partial")) and not out.exists()


def test_the_async_client_reports_the_server_s_refusal_of_an_upload_it_still_sends(
    tmp_path: Path,
) -> None:
    """A server that ends an upload early (over --jobs-max-file-bytes) while the client
    still sends: grpc.aio replaced the server's status with INTERNAL "Internal error
    from Core" when a write failed after it (grpc/grpc#36066), nine times in ten here.
    Both clients raise the server's own error, every time."""
    big = tmp_path / "big.jsonl"
    row = line("x", "X", "FP32", [1.0], [1, 1])
    with big.open("w") as f:
        for i in range(60_000):  # about 8 MB
            f.write(json.dumps({**row, "custom_id": f"x{i}"}) + "\n")
    server = ServerProcess(TEST_MODELS, "--jobs-max-file-bytes", "300000",
                           log_dir=tmp_path).start()  # fmt: skip
    over = "the job file is over 300000 bytes"

    async def submit_async() -> None:
        async with AsyncClient(server.url) as c:
            await c.submit_job("gated", big)

    try:
        for _ in range(5):
            with pytest.raises(LimitExceeded, match=over):
                run(submit_async)
        with Client(server.url) as c, pytest.raises(LimitExceeded, match=over):
            c.submit_job("gated", big)
    finally:
        assert server.stop() == 0, server.log()


def test_cancelling_an_async_submission_ends_its_upload(tmp_path: Path) -> None:
    """AsyncClient.submit_job sends from a thread of gRPC's: the task cancelled, the
    call is cancelled with it, and the server drops the upload."""
    server = ServerProcess(TEST_MODELS, log_dir=tmp_path).start()
    more = threading.Event()

    def lines() -> Iterator[dict[str, Any]]:
        yield from gated_lines(range(2))
        more.wait(60)  # the rest never comes while the call lives

    async def scenario() -> None:
        async with AsyncClient(server.url) as c:
            upload = asyncio.ensure_future(c.submit_job("gated", lines()))
            await until(lambda: c.jobs(status="validating"))
            upload.cancel()
            with pytest.raises(asyncio.CancelledError):
                await upload
            await until(lambda: empty(c))

    async def empty(c: AsyncClient) -> bool:
        return not await c.jobs()

    try:
        run(scenario)
    finally:
        more.set()
        assert server.stop() == 0, server.log()


def test_uploads_go_in_pieces_a_small_max_message_takes(tmp_path: Path) -> None:
    """A server with --max-message-bytes 262144 (set for small requests) refused every
    upload of the client's 1 MiB pieces, and then of 256 KiB ones (with the message's
    own bytes, 262148). A file, many lines, and one line longer than a
    piece now go in pieces of at most client.jobs.PIECE bytes, whole."""
    server = ServerProcess(TEST_MODELS, "--max-message-bytes", str(256 * 1024),
                           log_dir=tmp_path).start()  # fmt: skip
    many = gated_lines(range(1, 20_001))  # about 2 MB
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps(v) + "\n" for v in many))
    long = {**line("long", "X", "FP32", [1.0], [1, 1]), "parameters": {"note": "n" * 700_000}}
    mixed = [long, *many[:2]]
    try:
        with Client(server.url) as c:
            for source, total, size in (
                (path, 20_000, path.stat().st_size), (many, 20_000, compact(many)),
                (mixed, 3, compact(mixed)),
            ):  # fmt: skip
                job = c.submit_job("gated", source)
                assert (job.status, job.total, job.input_bytes) == ("queued", total, size)
    finally:
        assert server.stop() == 0, server.log()


def compact(rows: list[dict[str, Any]]) -> int:
    """The bytes of `rows` as the client sends them."""
    return sum(len(json.dumps(v, separators=(",", ":"))) + 1 for v in rows)


def test_a_stopped_upload_reads_no_more_of_its_source() -> None:
    """AsyncClient.submit_job cancelled: gRPC's thread went on drawing lines from the
    caller's iterable, up to a whole piece (thousands of lines), after the coroutine
    had ended. Stopped, the upload draws none and ends the call as given up."""
    drawn: list[int] = []

    def source() -> Iterator[dict[str, Any]]:
        for i in range(100_000):
            drawn.append(i)
            yield {"custom_id": str(i), "inputs": []}

    upload = _Upload("m", "", source(), "key")
    assert next(upload).model_name == "m"
    upload.stop()
    with pytest.raises(RuntimeError, match="given up"):
        next(upload)
    assert drawn == [] and upload.error is None  # (the server's error, if any, stays it)


def test_grpc_logs_no_error_for_an_upload_given_up(caplog: pytest.LogCaptureFixture) -> None:
    """gRPC logs a request iterator's exception at ERROR with its traceback: every
    cancelled AsyncClient.submit_job did, though nothing failed. Other ones still are."""
    log = logging.getLogger("grpc._channel")
    for error in (_GivenUp("the upload was given up"), ValueError("a line that broke")):
        try:
            raise error
        except Exception:
            log.exception("Exception iterating requests!")
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ValueError]


def test_a_job_s_numbers_no_clock_holds_are_shown_not_a_traceback() -> None:
    """The server's numbers are data: an ETA of inf crashed `batchd jobs status` and
    `wait` with OverflowError (exit 1, a traceback), a time past any calendar too."""
    job = Job.from_pb(jobs_pb2.Job(id="j", model_name="m", status="running", created_at=1e300,
                                   started_at=math.nan, eta_seconds=math.inf))  # fmt: skip
    text = describe(job)
    assert "created   1e+300" in text and "started   nan" in text and "ETA ?" in text


def test_a_server_s_text_reaches_the_terminal_escaped_and_its_json_stays_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model name or an error holding an escape sequence retitled, cleared or hid the
    user's terminal; `--json` wrote a NaN rate as `NaN`, which JSON readers refuse."""
    evil = "m\x1b]0;owned\x07\x1b[2J\x9b8m"
    job = Job.from_pb(jobs_pb2.Job(id="j", model_name=evil, status="failed", error=evil,
                                   rows_per_second=math.nan))  # fmt: skip
    for text in (describe(job), bar(job)):
        assert not any(c in text for c in "\x1b\x07\x9b"), text
    assert "model     m\\x1b]0;owned\\x07\\x1b[2J\\x9b8m" in describe(job)
    jobs_cli._list([job], as_json=False)
    jobs_cli._list([job], as_json=True)
    plain, as_json = capsys.readouterr().out.splitlines()
    assert "\x1b" not in plain
    line = json.loads(as_json, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert line["rows_per_second"] is None and line["model"] == evil
    polls = iter([ServerUnavailable(evil), job])

    def poll(job_id: str) -> Job:
        if isinstance(answer := next(polls), Exception):
            raise answer
        return answer

    out = io.StringIO()
    jobs_cli.wait(mock.Mock(job=poll), "j", out, sleep=lambda s: None)
    assert "\x1b" not in out.getvalue() and "\\x1b]0;owned" in out.getvalue()
