"""A running job's progress moves as its lines are answered and checkpointed, not a
chunk at a time, and a cancel keeps the lines already answered (in input order, each
once). A status counts only what a checkpoint made durable (tests/test_jobs_counts.py:
its counts never go back).

The runner here meets a core whose answers the test gives line by line (HeldCore),
so what a status says is checked at each step; a real server with the gated test
model holds one batch of the job (a hold-<V> file) and the job is read and
cancelled there. Waits are bounded polls; no sleep decides an assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from batchd.client import Client
from batchd.protos import jobs_pb2 as pb
from batchd.protos.model_config import ModelConfig
from batchd.server.config import Limits
from batchd.server.jobs import chunks, run, runner
from batchd.server.jobs.service import JobsService
from batchd.server.jobs.sqlite import SqliteStore
from batchd.server.jobs.store import JobRow
from batchd.server.request import Request, Tensor
from tests.conftest import Gate, model, scrape, value
from tests.servers import TEST_MODELS, ServerProcess, wait_for
from tests.test_jobs import ended, gated_lines, results

LINES = 600  # three chunks: all in the core at once (run.DEPTH)
UNTIL_S = 20.0


class HeldCore:
    """A core that answers a line only when the test says so (answer())."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.models: Mapping[str, ModelConfig] = {cfg.name: cfg}
        self.futures: list[tuple[Request, asyncio.Future[list[Tensor]]]] = []

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        f: asyncio.Future[list[Tensor]] = asyncio.get_running_loop().create_future()
        self.futures.append((request, f))
        return f

    def model_ready(self, name: str) -> bool:
        return name in self.models

    def answer(self, *indexes: int) -> None:
        """Answer the lines at `indexes` (0-based, in the order they were submitted): Y = 2X."""
        for i in indexes:
            request, f = self.futures[i]
            x = np.frombuffer(request.inputs[0].data, "<f4")
            f.set_result([Tensor("Y", "FP32", request.inputs[0].shape, (2 * x).tobytes())])


class Setup:
    """A store with one queued job of LINES lines, its runner over a HeldCore, and
    the gRPC edge that answers its status."""

    def __init__(self, tmp: Path) -> None:
        self.cfg = model(max_batch_size=4, shape=(1,))
        self.store = SqliteStore(tmp)
        self.core = HeldCore(self.cfg)
        self.jobs = runner.Jobs(self.store, self.core, Limits(), max_file_bytes=1 << 20,
                                max_open=4, retention_s=3600.0, min_upload_rate=0,
                                upload_grace_s=0.0)  # fmt: skip
        self.service = JobsService(self.jobs)
        self.text = "".join(
            json.dumps({"custom_id": f"c{i}", "inputs": [{"name": "X", "datatype": "FP32",
                        "shape": [1, 1], "data": [i]}]}) + "\n"
            for i in range(LINES)
        )  # fmt: skip
        self.job_id = ""

    async def start(self) -> asyncio.Task[None]:
        row = await self.store.create("", self.cfg.name, "")
        self.job_id = row.id
        self.store.upload_path(row.id).write_text(self.text)
        await self.store.queue(row.id, LINES, len(self.text))
        task = asyncio.create_task(self.jobs.run())
        await until(lambda: len(self.core.futures) == LINES, "every line in the core")
        return task

    async def status(self) -> pb.Job:
        row = await self.store.get(self.job_id)
        assert row is not None
        return self.service._message(row)

    def results(self) -> list[dict[str, Any]]:
        text = self.store.results_path(self.job_id).read_text()
        return [json.loads(x) for x in text.splitlines()]

    async def stop(self, task: asyncio.Task[None]) -> None:
        await self.jobs.stop(timeout_s=10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.store.close()


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Poll `condition`, a bounded wait: it fails after UNTIL_S seconds."""
    end = time.monotonic() + UNTIL_S
    while True:
        got = condition()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def completed_is(s: Setup, n: int) -> bool:
    return (await s.status()).completed == n


def test_a_status_counts_the_lines_checkpointed_not_whole_chunks(tmp_path: Path) -> None:
    """Ten lines of a 256-line chunk answered: the status says 10 once they are
    checkpointed, which the runner does while it waits on line 10 (before: 0 until the
    whole chunk was), with a rate and an ETA. One answered ahead of line 10, still out,
    is not counted (a cancel would drop it); once line 10 is, both are written and
    counted at the next checkpoint."""
    s = Setup(tmp_path)

    async def body() -> JobRow | None:
        task = await s.start()
        try:
            s.core.answer(*range(10))
            await until(lambda: completed_is(s, 10), "10 lines counted")
            job = await s.status()
            assert (job.status, job.failed) == ("running", 0)
            assert job.rows_per_second > 0 and job.eta_seconds > 0, job
            s.core.answer(11)  # ahead of line 10, still out
            assert (await s.status()).completed == 10  # (a status reads no answer itself)
            s.core.answer(10)
            await until(lambda: s.jobs.running[s.job_id].completed == 12, "12 lines written")
            await until(lambda: completed_is(s, 12), "12 lines counted")
            s.core.answer(*range(12, LINES))
            await until(lambda: s.jobs.running.get(s.job_id) is None, "the job's end")
            return await s.store.get(s.job_id)
        finally:
            await s.stop(task)

    row = asyncio.run(body())
    assert row is not None and (row.status, row.completed, row.failed) == ("completed", LINES, 0)
    got = s.results()
    assert [r["custom_id"] for r in got] == [f"c{i}" for i in range(LINES)]
    assert all(r["outputs"][0]["data"] == [2.0 * i] for i, r in enumerate(got))


def test_a_cancel_keeps_every_line_answered_in_order_and_no_other(tmp_path: Path) -> None:
    """Lines 0-299 answered (a whole chunk and 44 lines of the next) and line 310 ahead
    of them, then a cancel: it writes and counts exactly lines 0-299 (before: none, the
    chunk at the head was dropped), and the checkpoint covers them, to the byte."""
    s = Setup(tmp_path)

    async def body() -> JobRow | None:
        task = await s.start()
        try:
            s.core.answer(*range(300), 310)
            await s.jobs.cancel(s.job_id)  # (the runner has not looked at the answers yet)
            await until(lambda: s.jobs.running.get(s.job_id) is None, "the job's end")
            return await s.store.get(s.job_id)
        finally:
            await s.stop(task)

    row = asyncio.run(body())
    assert row is not None and (row.status, row.completed, row.failed) == ("cancelled", 300, 0)
    got = s.results()
    assert [r["custom_id"] for r in got] == [f"c{i}" for i in range(300)]
    first = s.text.splitlines(keepends=True)[:300]
    assert (row.input_offset, row.lines_read) == (sum(len(x) for x in first), 300)
    assert row.results_bytes == s.store.results_path(s.job_id).stat().st_size


def test_a_run_given_back_mid_chunk_goes_on_from_its_last_line_written(tmp_path: Path) -> None:
    """A stop after 100 lines of a chunk keeps those 100 (before: none, the chunk was not
    whole); the next run reads on from line 101 and answers each line once."""
    s = Setup(tmp_path)

    async def first() -> None:
        task = await s.start()
        try:
            s.core.answer(*range(100))
            await until(lambda: s.jobs.running[s.job_id].completed == 100, "100 lines written")
        finally:
            await s.stop(task)

    asyncio.run(first())
    store = SqliteStore(tmp_path)
    row = asyncio.run(store.get(s.job_id))
    assert row is not None and (row.completed, row.lines_read) == (100, 100)
    asyncio.run(store.recover())  # (as at the next start)
    again = asyncio.run(store.claim())
    assert again is not None and again.id == s.job_id
    counted: list[int] = []

    class Answering(HeldCore):
        def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
            f = super().submit(request)
            self.answer(len(self.futures) - 1)
            return f

    def count(model: str, ok: int, failed: int) -> None:
        counted.append(ok)

    asyncio.run(run.JobRun(again, store, Answering(s.cfg), Limits(), count).run())
    final = asyncio.run(store.get(s.job_id))
    store.close()
    assert final is not None and (final.status, final.completed, final.failed) == (
        "completed", LINES, 0,
    )  # fmt: skip
    assert sum(counted) == LINES - 100  # the 100 written before are not counted again
    got = s.results()
    assert [r["custom_id"] for r in got] == [f"c{i}" for i in range(LINES)]
    assert chunks.CHUNK_LINES < LINES


def test_a_served_job_shows_its_lines_answered_and_a_cancel_keeps_them(
    gate: Gate, tmp_path: Path
) -> None:
    """A 100-line job on the gated model; the batch holding line 70 waits. The status,
    the metrics and the results after a cancel all say the lines answered before it."""
    server = ServerProcess(
        TEST_MODELS, "--credits-per-worker", "1", "--jobs-dir", str(tmp_path / "jobs"),
        log_dir=tmp_path, env={"BATCHD_TEST_DIR": str(gate.state)},
    ).start()  # fmt: skip
    held = gate.state / "hold-70"
    held.touch()
    try:
        with Client(server.url) as c:
            job = c.submit_job("gated", gated_lines(range(1, 101)))
            wait_for(lambda: any(70.0 in b for b in gate.calls("gated")), 60, "the held batch")
            before = [v for b in gate.calls("gated") if 70.0 not in b for v in b]
            n = len(before)
            assert n > 0 and sorted(before) == [float(v) for v in range(1, n + 1)]
            wait_for(lambda: c.job(job.id).completed == n, 30, f"{n} lines counted")
            now = c.job(job.id)
            assert now.status == "running" and now.failed == 0
            assert now.rows_per_second > 0 and now.eta_seconds is not None
            samples = scrape(server)
            assert value(samples, "batchd_job_requests_total", model="gated",
                         outcome="completed") == n  # fmt: skip
            assert value(samples, "batchd_job_rows_per_second", model="gated") > 0
            c.cancel_job(job.id)
            done = ended(c, job.id)
            got = results(c, job.id, tmp_path)
    finally:
        held.unlink(missing_ok=True)
        assert server.stop() == 0, server.log()
    assert (done.status, done.completed, done.failed) == ("cancelled", n, 0)
    assert [r["custom_id"] for r in got] == [f"g{v}" for v in range(1, n + 1)]
