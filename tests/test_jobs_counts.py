"""A job's counts never go back: what a status (GetJob, ListJobs, CancelJob, HTTP) says
is answered must still be so when the job has ended, whatever ends it.

Before, a running job's status counted the lines written since the last checkpoint and
those answered ahead of a line still out, none of them durable: the job's model
unloaded mid-run (it ends failed at its last checkpoint) and a cancel (it drops the
lines answered ahead) followed by a SIGKILL (the lines written after the checkpoint go
too) both took back counts a client had seen. Here the runner is met both over a
HeldCore (the test answers each line) and in real servers, with the gated model on two
workers: one holds the batch of line 70 (a hold-70 file), the other answers every
later batch, so lines are answered ahead of one still out. Waits are bounded polls;
no sleep decides an assertion.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from batchd.client import Client
from batchd.server.jobs.store import JobRow
from tests.conftest import Gate, scrape, value
from tests.servers import TEST_MODELS, ServerProcess, wait_for
from tests.test_jobs import ended, gated_lines
from tests.test_jobs_progress import Setup, until

Counts = tuple[int, int]
N = 320  # ten batches of 32: the one holding line 70, held; the seven after it answered


def never_back(seen: list[Counts], final: Counts) -> None:
    """Each count seen is at least the one before it, and at most the final one."""
    for before, after in zip([*seen, final], [*seen, final][1:], strict=False):
        assert after[0] >= before[0] and after[1] >= before[1], (
            f"the counts (completed, failed) went back from {before} to {after}; "
            f"seen: {seen}, at the end: {final}"
        )


class Watch:
    """Reads the job's status in a loop while the test runs (HeldCore runs)."""

    def __init__(self, s: Setup) -> None:
        self.s, self._on = s, True
        self.seen: list[Counts] = []
        self._task: asyncio.Task[None] | None = None

    async def read(self) -> Counts:
        job = await self.s.status()
        self.seen.append((job.completed, job.failed))
        return self.seen[-1]

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while self._on:
            if self.s.job_id and await self.s.store.get(self.s.job_id) is not None:
                await self.read()
            await asyncio.sleep(0.002)

    async def stop(self) -> None:
        self._on = False
        if self._task is not None:
            await self._task


def test_an_unload_mid_job_takes_back_no_count_a_status_showed(tmp_path: Path) -> None:
    """Lines 0-9 answered and written, line 11 answered ahead of line 10; then the model
    goes and line 10 is answered: the job fails, and its counts at the end are at least
    every count a status showed while it ran (before: 11 shown, 0 at the end)."""
    s = Setup(tmp_path)
    watch = Watch(s)

    async def body() -> JobRow | None:
        task = await s.start()
        watch.start()
        try:
            s.core.answer(*range(10), 11)
            await until(lambda: s.jobs.running[s.job_id].completed == 10, "10 lines written")
            await watch.read()  # the runner has seen every answer
            s.core.models = {}  # unloaded
            s.core.answer(10)
            await until(lambda: s.jobs.running.get(s.job_id) is None, "the job's end")
            await watch.read()
            return await s.store.get(s.job_id)
        finally:
            await watch.stop()
            await s.stop(task)

    row = asyncio.run(body())
    assert row is not None and row.status == "failed" and "not loaded" in row.error
    never_back(watch.seen, (row.completed, row.failed))
    # It keeps (and counts) every line it wrote: lines 0-9, not line 10 its model's going
    # failed, nor line 11 after it.
    assert (row.completed, row.failed) == (10, 0)
    kept = s.store.results_path(s.job_id).read_bytes()[: row.results_bytes].splitlines()
    assert [json.loads(x)["custom_id"] for x in kept] == [f"c{i}" for i in range(10)]


def test_a_cancel_takes_back_no_count_a_status_showed(tmp_path: Path) -> None:
    """Lines 0-9 answered and written, line 11 ahead of line 10, still out; a cancel then
    keeps lines 0-9 only: no status before it said 11 (before: one did)."""
    s = Setup(tmp_path)
    watch = Watch(s)

    async def body() -> JobRow | None:
        task = await s.start()
        watch.start()
        try:
            s.core.answer(*range(10), 11)
            await until(lambda: s.jobs.running[s.job_id].completed == 10, "10 lines written")
            await watch.read()
            await s.jobs.cancel(s.job_id)
            await until(lambda: s.jobs.running.get(s.job_id) is None, "the job's end")
            return await s.store.get(s.job_id)
        finally:
            await watch.stop()
            await s.stop(task)

    row = asyncio.run(body())
    assert row is not None and (row.status, row.completed, row.failed) == ("cancelled", 10, 0)
    never_back(watch.seen, (row.completed, row.failed))


def _two_workers(tmp: Path, gate: Gate, jobs_dir: Path, *args: str) -> ServerProcess:
    return ServerProcess(
        TEST_MODELS, "--credits-per-worker", "1", "--jobs-dir", str(jobs_dir), *args,
        log_dir=tmp, env={"BATCHD_TEST_DIR": str(gate.state)}, workers=2,
    ).start()  # fmt: skip


def _answered_but_the_held_batch(server: ServerProcess, gate: Gate, version: str) -> None:
    """Wait till the batch holding line 70 runs and every other batch of the job came
    back to the frontend (the rows it counts when it has set their answers)."""
    wait_for(lambda: any(70.0 in b for b in gate.calls("gated")), 60, "the held batch")
    held = next(b for b in gate.calls("gated") if 70.0 in b)

    def rows() -> float:
        return value(scrape(server), "batchd_inference_count_total", model="gated", version=version)

    wait_for(lambda: rows() >= N - len(held), 60, f"{N - len(held)} rows answered")


def _counts(job: Any) -> Counts:
    return job.completed, job.failed


def test_a_cancel_then_a_sigkill_takes_back_no_count_a_status_showed(
    gate: Gate, tmp_path: Path
) -> None:
    """Every batch of the job answered but the one holding line 70; a status, a cancel, a
    SIGKILL of the server, a restart: the cancelled job's counts are at least those the
    status and the cancel's answer showed (before: 288 shown, 64 at the end)."""
    jobs_dir, held = tmp_path / "jobs", gate.state / "hold-70"
    server = _two_workers(tmp_path, gate, jobs_dir)
    held.touch()
    seen: list[Counts] = []
    try:
        with Client(server.url) as c:
            job = c.submit_job("gated", gated_lines(range(1, N + 1)))
            _answered_but_the_held_batch(server, gate, "1")
            seen.append(_counts(c.job(job.id)))
            seen.append(_counts(c.cancel_job(job.id)))
    finally:
        server.proc.kill()  # type: ignore[union-attr]
        server.proc.wait()  # type: ignore[union-attr]
        held.unlink(missing_ok=True)
    again = _two_workers(tmp_path, gate, jobs_dir)
    try:
        with Client(again.url) as c:
            done = ended(c, job.id)
    finally:
        assert again.stop() == 0, again.log()
    assert done.status == "cancelled"
    never_back(seen, _counts(done))


def test_an_unload_of_a_running_jobs_model_takes_back_no_count_a_status_showed(
    gate: Gate, tmp_path: Path
) -> None:
    """Every batch of the job answered but the one holding line 70; a status, then the
    model is unloaded and the held batch let go: the job fails, its counts at least
    those the status showed (before: 288 shown, 64 at the end)."""
    held = gate.state / "hold-70"
    server = _two_workers(tmp_path, gate, tmp_path / "jobs", "--model-control", "explicit",
                          "--load-model", "gated")  # fmt: skip
    held.touch()
    seen: list[Counts] = []
    try:
        with Client(server.url) as c:
            job = c.submit_job("gated", gated_lines(range(1, N + 1)))
            _answered_but_the_held_batch(server, gate, "1")
            seen.append(_counts(c.job(job.id)))
            unloading = threading.Thread(target=_unload, args=(server.url,))
            unloading.start()  # (it returns once the held batch is answered)
            wait_for(lambda: "model gated version 1 unloading" in server.log(), 30, "unloading")
            seen.append(_counts(c.job(job.id)))
            held.unlink()
            unloading.join(60)
            done = ended(c, job.id)
    finally:
        held.unlink(missing_ok=True)
        assert server.stop() == 0, server.log()
    assert done.status == "failed" and "not loaded" in done.error, done
    never_back(seen, _counts(done))


def _unload(url: str) -> None:
    with Client(url) as c:
        c.unload_model("gated")
