"""Batch jobs against real servers: results, a crash mid-job, cancel, bad lines,
the job lane behind online traffic, and owners.

The gated test model (tests/models/gated) holds its batches while the gate is
closed and logs every batch it ran, so the order of batches is read from its
log, not guessed from timing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd.client import (
    AsyncClient,
    Client,
    InvalidInput,
    JobNotFound,
    ModelNotFound,
    ServerBusy,
)
from tests.conftest import Gate, scrape, value
from tests.servers import EXAMPLES, TEST_MODELS, ServerProcess, wait_for


def line(cid: str, name: str, datatype: str, data: Any, shape: list[int]) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}],
    }


def gated_lines(values: range) -> list[dict[str, Any]]:
    return [line(f"g{v}", "X", "FP32", [float(v)], [1, 1]) for v in values]


def results(client: Client, job_id: str, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / f"{job_id}.jsonl"
    client.job_results(job_id, out)
    return [json.loads(x) for x in out.read_text().splitlines()]


def ended(client: Client, job_id: str, timeout: float = 60) -> Any:
    wait_for(lambda: client.job(job_id).ended, timeout, f"job {job_id} to end")
    return client.job(job_id)


def test_a_jobs_results_equal_direct_infer_answers(example_server: ServerProcess,
                                                   tmp_path: Path) -> None:  # fmt: skip
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((40, 16)).astype(np.float32)
    texts = ["", "a", "hello world", "batchd", "ünïcode ✓"]
    lines = [line(f"t{i}", "INPUT0", "FP32", r.tolist(), [1, 16]) for i, r in enumerate(rows)]
    lines.append(line("two-rows", "INPUT0", "FP32", rows[:2].tolist(), [2, 16]))  # nested data
    with Client(example_server.url) as c:
        job = c.submit_job("tiny", lines)
        assert job.status == "queued" and job.total == 41
        assert ended(c, job.id).status == "completed"
        got = {r["custom_id"]: r for r in results(c, job.id, tmp_path)}
        assert len(got) == 41
        for i, r in enumerate(rows):
            direct = c.infer("tiny", {"INPUT0": r[None]})["OUTPUT0"]
            out = got[f"t{i}"]["outputs"][0]
            assert (out["name"], out["datatype"], out["shape"]) == ("OUTPUT0", "FP32", [1, 16])
            # Equal up to float32 rounding: a GEMM over a batch of 32 rows sums in another
            # order than over one (online batching does the same); gated is exact below.
            data = np.array(out["data"], np.float32)
            np.testing.assert_allclose(data, direct.ravel(), rtol=1e-5, atol=1e-6)
        two = got["two-rows"]["outputs"][0]
        assert two["shape"] == [2, 16] and len(two["data"]) == 32

        text_job = c.submit_job(
            "embed",
            [line(f"e{i}", "TEXT", "BYTES", [t], [1, 1]) for i, t in enumerate(texts)],
        )
        assert ended(c, text_job.id).status == "completed"
        embedded = {r["custom_id"]: r for r in results(c, text_job.id, tmp_path)}
        for i, t in enumerate(texts):
            direct = c.infer("embed", {"TEXT": np.array([[t.encode()]], dtype=object)})
            name = next(iter(direct))
            out = next(o for o in embedded[f"e{i}"]["outputs"] if o["name"] == name)
            np.testing.assert_allclose(
                np.array(out["data"]), direct[name].ravel(), rtol=1e-5, atol=1e-6
            )


def test_malformed_lines_become_error_lines_and_the_job_completes(
    example_server: ServerProcess, tmp_path: Path
) -> None:
    good = line("good", "INPUT0", "FP32", [0.5] * 16, [1, 16])
    body = [
        json.dumps(good),
        "this is not json",
        json.dumps({"inputs": good["inputs"]}),  # no custom_id
        json.dumps(line("shape", "INPUT0", "FP32", [1.0, 2.0], [1, 2])),
        json.dumps(line("count", "INPUT0", "FP32", [1.0, 2.0], [1, 16])),
        json.dumps(line("ints", "INPUT0", "INT32", [1] * 16, [1, 16])),
        json.dumps(line("name", "NOPE", "FP32", [0.5] * 16, [1, 16])),
        json.dumps(line("text", "INPUT0", "FP32", ["a"] * 16, [1, 16])),
        json.dumps({**good, "custom_id": "outputs", "outputs": [{"name": "MISSING"}]}),
        "",  # blank lines are skipped, not counted
        json.dumps({**good, "custom_id": "last"}),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(body) + "\n")
    with Client(example_server.url) as c:
        job = c.submit_job("tiny", path)
        assert job.total == 10
        done = ended(c, job.id)
        assert (done.status, done.completed, done.failed) == ("completed", 2, 8)
        got = results(c, job.id, tmp_path)
    assert [r.get("custom_id") for r in got] == [
        "good", None, None, "shape", "count", "ints", "name", "text", "outputs", "last",
    ]  # fmt: skip
    errors = {r["custom_id"] or f"line {r['line']}": r["error"] for r in got if "error" in r}
    assert set(errors) == {"line 2", "line 3", "shape", "count", "ints", "name", "text", "outputs"}
    assert all(e["code"] == "INVALID_ARGUMENT" for e in errors.values())
    assert "not JSON" in errors["line 2"]["message"]
    assert "custom_id" in errors["line 3"]["message"]
    assert "[1, 2]" in errors["shape"]["message"]
    assert "needs 16 values, 'data' holds 2" in errors["count"]["message"]
    assert "'NOPE'" in errors["name"]["message"]
    assert "MISSING" in errors["outputs"]["message"]


def test_a_token_keeps_at_most_jobs_max_kept_ended_jobs(tmp_path: Path) -> None:
    """Each submission removes its token's oldest ended jobs past --jobs-max-kept (they
    were all kept until --jobs-retention-hours: 7 days of one caller's tiny jobs)."""
    server = ServerProcess(EXAMPLES, "--jobs-max-kept", "2", "--jobs-dir",
                           str(tmp_path / "jobs"), log_dir=tmp_path).start()  # fmt: skip
    one = [line("a", "INPUT0", "FP32", [0.0] * 16, [1, 16])]
    try:
        with Client(server.url) as c:
            made = []
            for _ in range(4):
                made.append(c.submit_job("tiny", one).id)
                ended(c, made[-1])
            assert {j.id for j in c.jobs()} == set(made[1:])  # the 4th removed the 1st
            with pytest.raises(JobNotFound):
                c.job(made[0])
            assert not (tmp_path / "jobs" / made[0]).exists()
        assert f"job {made[0]}: past its token's --jobs-max-kept; removed" in server.log()
    finally:
        server.stop()


def test_submission_is_refused_with_the_reason(example_server: ServerProcess,
                                               tmp_path: Path) -> None:  # fmt: skip
    lines = [line(f"d{i % 3}", "INPUT0", "FP32", [0.0] * 16, [1, 16]) for i in range(5)]
    with Client(example_server.url) as c:
        with pytest.raises(InvalidInput, match=r"duplicate custom_id: 'd0' on lines 1, 4"):
            c.submit_job("tiny", lines)
        with pytest.raises(ModelNotFound, match="model 'nope' is not loaded"):
            c.submit_job("nope", lines[:1])
        with pytest.raises(ModelNotFound, match=r"'nnnn.*\.\.\. \(100000 characters\)") as e:
            c.submit_job("n" * 100_000, lines[:1])
        assert len(str(e.value)) < 300  # quoted short, not echoed whole
        with pytest.raises(InvalidInput, match="step-wise"):  # (it is there: not NOT_FOUND)
            c.submit_job("decoder", lines[:1])
        with pytest.raises(JobNotFound, match="no job 'job-0'"):  # (it was ModelNotFound)
            c.job("job-0")
        assert not [j for j in c.jobs() if j.status == "validating"]  # refused ones are gone


def _gated_server(tmp: Path, state: Path, jobs_dir: Path, *args: str,
                  token: str | None = None) -> ServerProcess:  # fmt: skip
    server = ServerProcess(
        TEST_MODELS, "--credits-per-worker", "1", "--jobs-dir", str(jobs_dir), *args,
        log_dir=tmp, env={"BATCHD_TEST_DIR": str(state)},
    ).start(token=token)  # fmt: skip
    return server


def test_sigkill_mid_job_then_restart_answers_every_custom_id_once(
    gate: Gate, tmp_path: Path
) -> None:
    jobs_dir = tmp_path / "jobs"
    server = _gated_server(tmp_path, gate.state, jobs_dir)
    n, held = 20_000, gate.state / "hold-15000"
    held.touch()  # the batch holding line 15,000 waits: the job stops there, mid-way
    try:
        with Client(server.url) as c:
            job = c.submit_job("gated", gated_lines(range(1, n + 1)))
            wait_for(lambda: c.job(job.id).results_bytes > 0, 60, "a checkpoint")
            before = c.job(job.id)
            assert before.status == "running" and before.done < 15_000, before
    finally:
        server.proc.kill()  # type: ignore[union-attr]
        server.proc.wait()  # type: ignore[union-attr]
        held.unlink()
    again = _gated_server(tmp_path, gate.state, jobs_dir)
    try:
        with Client(again.url) as c:
            done = ended(c, job.id, timeout=120)
            assert (done.status, done.completed, done.failed) == ("completed", n, 0)
            got = results(c, job.id, tmp_path)
    finally:
        assert again.stop() == 0, again.log()
    counts = Counter(r["custom_id"] for r in got)
    assert len(got) == n and set(counts.values()) == {1}
    assert all(r["outputs"][0]["data"] == [2.0 * int(r["custom_id"][1:])] for r in got)
    assert "running from line" in again.log()


def test_cancel_stops_the_job_and_keeps_its_results(gate: Gate, tmp_path: Path) -> None:
    server = _gated_server(tmp_path, gate.state, tmp_path / "jobs")
    held = gate.state / "hold-3000"
    held.touch()  # the job stops at line 3,000: the cancel comes mid-job
    try:
        with Client(server.url) as c:
            job = c.submit_job("gated", gated_lines(range(1, 5001)))
            wait_for(lambda: c.job(job.id).results_bytes > 0, 60, "a checkpoint")
            assert c.cancel_job(job.id).status in ("cancelling", "cancelled")
            held.unlink()
            done = ended(c, job.id)
            got = results(c, job.id, tmp_path)
            assert c.cancel_job(job.id).status == "cancelled"  # an ended job stays as it is
    finally:
        held.unlink(missing_ok=True)
        assert server.stop() == 0, server.log()
    assert done.status == "cancelled" and 0 < done.completed < 3000
    assert len(got) == done.completed == done.done
    assert [r["custom_id"] for r in got] == [f"g{v}" for v in range(1, len(got) + 1)]


def test_online_requests_go_ahead_of_a_job_and_never_share_its_batches(
    unstaged_server: ServerProcess, gate: Gate
) -> None:
    """One worker, one credit. The worker is held on an online batch; a job fills the
    job lane; three online requests arrive behind it. Once the gate opens, the
    online requests leave first, together, and no batch mixes job and online rows."""

    def waiting(lane: str) -> float:
        metric = f"batchd_{lane}_pending_request_count"
        return value(scrape(unstaged_server), metric, model="gated", version="1")

    def job_ended(job_id: str) -> bool:
        with Client(unstaged_server.url) as c:
            return c.job(job_id).ended

    async def scenario() -> list[float]:
        async with AsyncClient(unstaged_server.url) as ac:
            gate.close()
            first = asyncio.ensure_future(
                ac.infer("gated", {"X": np.array([[1000.0]], np.float32)}, timeout=60)
            )
            await asyncio.to_thread(
                wait_for, lambda: len(gate.calls(log="entered")) == 1, 30, "the first batch"
            )
            job = await ac.submit_job("gated", gated_lines(range(1, 201)))
            await asyncio.to_thread(wait_for, lambda: waiting("job") == 200, 30, "the job lane")
            online = [
                asyncio.ensure_future(
                    ac.infer("gated", {"X": np.array([[v]], np.float32)}, timeout=60)
                )
                for v in (2000.0, 2001.0, 2002.0)
            ]
            await asyncio.to_thread(wait_for, lambda: waiting("inference") == 3, 30, "the online")
            gate.open()
            answers = await asyncio.gather(first, *online)
            await asyncio.to_thread(wait_for, lambda: job_ended(job.id), 60, "the job")
            return [float(a["Y"][0, 0]) for a in answers]

    answers = asyncio.run(scenario())
    assert answers == [2000.0, 4000.0, 4002.0, 4004.0]
    batches = gate.calls("gated")
    assert batches[0] == [1000.0] and batches[1] == [2000.0, 2001.0, 2002.0]
    job_rows = [v for b in batches[2:] for v in b]
    assert sorted(job_rows) == [float(v) for v in range(1, 201)]
    assert all(len(b) <= 32 for b in batches[2:])


def test_a_job_belongs_to_its_token(gate: Gate, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    a, b, admin = "infer-token-a-0123456789", "infer-token-b-0123456789", "admin-token-0123456789"
    tokens.write_text(f"infer: {a}\ninfer: {b}\nadmin: {admin}\n")
    tokens.chmod(0o600)
    server = _gated_server(
        tmp_path, gate.state, tmp_path / "jobs", "--auth-token-file", str(tokens), token=a
    )
    try:
        with (
            Client(server.url, token=a) as ca,
            Client(server.url, token=b) as cb,
            Client(server.url, token=admin) as cadmin,
        ):
            job = ca.submit_job("gated", gated_lines(range(1, 11)))
            with pytest.raises(JobNotFound, match="no job"):
                cb.job(job.id)
            with pytest.raises(JobNotFound, match="no job"):
                cb.cancel_job(job.id)
            (tmp_path / "stolen.jsonl").write_text("b's own results\n")
            with pytest.raises(JobNotFound, match="no job"):
                cb.job_results(job.id, tmp_path / "stolen.jsonl")
            # a failed download leaves the file it would have replaced as it was
            assert (tmp_path / "stolen.jsonl").read_text() == "b's own results\n"
            assert not list(tmp_path.glob("*.partial"))
            assert [j.id for j in cb.jobs()] == []
            assert [j.id for j in ca.jobs()] == [job.id]
            assert [j.id for j in cadmin.jobs()] == [job.id]
            assert ended(ca, job.id).status == "completed"
    finally:
        assert server.stop() == 0, server.log()


def test_the_jobs_cli(example_server: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(
            json.dumps(line(f"c{i}", "INPUT0", "FP32", [0.25] * 16, [1, 16])) + "\n"
            for i in range(50)
        )
    )
    batchd = [str(Path(sys.executable).parent / "batchd"), "jobs"]  # the installed command
    url = ["--url", example_server.url]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*batchd, *args, *url], capture_output=True, text=True, timeout=120)

    submitted = run("submit", "--model", "tiny", str(path))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.startswith("job-") and "\n" not in job_id  # the id and nothing else
    waited = run("wait", job_id)
    assert waited.returncode == 0 and "completed" in waited.stderr, waited.stderr
    status = run("status", job_id, "--json")
    assert json.loads(status.stdout)["completed"] == 50
    assert job_id in run("list").stdout
    fetched = run("results", job_id, "-o", str(tmp_path / "out.jsonl"))
    assert fetched.returncode == 0 and len((tmp_path / "out.jsonl").read_text().splitlines()) == 50
    missing = run("wait", "job-missing")
    assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr


def test_job_metrics(example_server: ServerProcess) -> None:
    with Client(example_server.url) as c:
        before = value(
            scrape(example_server), "batchd_job_requests_total", model="tiny", outcome="failed"
        )
        job = c.submit_job(
            "tiny",
            [
                line("m1", "INPUT0", "FP32", [0.0] * 16, [1, 16]),
                line("m2", "INPUT0", "FP32", [0.0], [1, 1]),
            ],
        )
        ended(c, job.id)
    samples = scrape(example_server)
    assert value(samples, "batchd_job_requests_total", model="tiny", outcome="failed") == before + 1
    assert value(samples, "batchd_jobs", status="completed") >= 1


def test_with_several_frontends_any_takes_a_job_in_and_the_first_runs_it(
    gate: Gate, tmp_path: Path
) -> None:
    server = _gated_server(tmp_path, gate.state, tmp_path / "jobs", "--frontends", "2")
    try:
        clients = [Client(server.url, own_connection=True) for _ in range(6)]
        jobs = [c.submit_job("gated", gated_lines(range(1, 21))) for c in clients]
        for c, job in zip(clients, jobs, strict=True):
            assert ended(c, job.id).status == "completed"
            assert len(results(c, job.id, tmp_path)) == 20
            c.close()
    finally:
        assert server.stop() == 0, server.log()
    assert "batch jobs are off" not in server.log()


def test_limits_on_file_size_and_open_jobs_refuse_with_the_flag(gate: Gate, tmp_path: Path) -> None:
    server = _gated_server(
        tmp_path, gate.state, tmp_path / "jobs", "--jobs-max-file-bytes", "2000",
        "--jobs-max-open", "1",
    )  # fmt: skip
    held = gate.state / "hold-1"
    held.touch()  # the first job stays open
    try:
        with Client(server.url) as c:
            with pytest.raises(ServerBusy, match=r"over 2000 bytes \(--jobs-max-file-bytes\)"):
                c.submit_job("gated", gated_lines(range(1, 101)))
            first = c.submit_job("gated", gated_lines(range(1, 3)))
            with pytest.raises(ServerBusy, match=r"1 jobs are open.*--jobs-max-open 1"):
                c.submit_job("gated", gated_lines(range(1, 3)))
            held.unlink()
            assert ended(c, first.id).status == "completed"
            assert c.submit_job("gated", gated_lines(range(1, 3))).status == "queued"
    finally:
        held.unlink(missing_ok=True)
        assert server.stop() == 0, server.log()


# ---- a jobs database that hangs, or restarts, seen from a scrape and from `jobs wait` ----


def test_a_scrape_is_answered_while_the_jobs_store_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refresh (the jobs store's counts) is waited for REFRESH_S at most; every other
    metric is served at once, and the hanging refresh is not started again."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as Count

    from batchd.server import metrics

    monkeypatch.setattr(metrics, "REFRESH_S", 0.05)
    registry = CollectorRegistry()
    Count("batchd_seen", "a metric", registry=registry).inc()
    started: list[float] = []

    async def hangs() -> None:
        started.append(0)
        await asyncio.Event().wait()  # a database that never answers

    async def body() -> None:
        server = await metrics.start_metrics([registry], "127.0.0.1", 0, refresh=hangs)
        port = server.sockets[0].getsockname()[1]
        try:
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
                got = await asyncio.wait_for(reader.read(), 10)
                writer.close()
                assert got.startswith(b"HTTP/1.1 200") and b"batchd_seen_total 1.0" in got
        finally:
            server.close()

    asyncio.run(body())
    assert started == [0]


def test_jobs_wait_asks_again_while_the_server_is_unavailable() -> None:
    """A restart (of a replica, or of the jobs database) answers a poll UNAVAILABLE:
    `batchd jobs wait` asks again with backoff, and gives up only after --timeout."""
    import io

    from batchd.client.errors import ServerUnavailable
    from batchd.client.jobs import Job
    from batchd.client.jobs_cli import wait

    job = Job("job-1", "m", "", "completed", 1, 1, 0, 0, 0, 0, 0, None, "", 1, 1)

    class Flaky:
        def __init__(self, failures: int) -> None:
            self.failures = failures

        def job(self, job_id: str) -> Job:
            if self.failures:
                self.failures -= 1
                raise ServerUnavailable("the jobs database failed: the connection was lost")
            return job

    pauses: list[float] = []
    out = io.StringIO()
    assert wait(Flaky(3), "job-1", out, give_up_s=60, sleep=pauses.append) is job  # type: ignore[arg-type]
    assert len(pauses) == 3 and "asking again" in out.getvalue()
    with pytest.raises(ServerUnavailable):
        wait(Flaky(10**9), "job-1", out, give_up_s=0, sleep=pauses.append)  # type: ignore[arg-type]
