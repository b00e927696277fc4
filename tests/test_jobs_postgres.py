"""The shared job store (`--jobs-db postgresql://...`) against a real PostgreSQL
server the tests start (tests/postgres.py): the store's leases and fencing with
two stores as two replicas, then real batchd replicas sharing jobs: any replica
answers for any job, a SIGKILLed replica's job runs on elsewhere with every
custom_id answered once, and a stopped replica gives its job back at once.

Orders are made by hold files and by starting the second replica only after the
first has claimed the job, never by timing: a lease that runs out is waited for
by asking until the other replica has the job.

An upload in progress on one replica is cancelled through another: it hears it
at its next renewal and removes the job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd.client import AsyncClient, Client
from batchd.protos import jobs_pb2 as pb
from batchd.protos import jobs_pb2_grpc as pb_grpc
from batchd.protos.model_config import ConfigError
from batchd.server.config import Limits, add_arguments, from_arguments
from batchd.server.errors import ModelNotFound, Unavailable
from batchd.server.jobs import database
from batchd.server.jobs import postgres as postgres_module
from batchd.server.jobs import run as run_module
from batchd.server.jobs.database import safe_url
from batchd.server.jobs.postgres import PART_BYTES, PostgresStore
from batchd.server.jobs.run import JobRun
from batchd.server.jobs.runner import Jobs
from batchd.server.jobs.store import JobRow, LeaseLost, Progress, Submitted
from tests.conftest import Gate, model, run
from tests.postgres import PostgresServer
from tests.servers import TEST_MODELS, ServerProcess, wait_for
from tests.test_job_parts import FakeCore, keeps_each_owner_s_newest_ended_jobs
from tests.test_jobs_upload import until

psycopg = pytest.importorskip("psycopg", reason="psycopg (batchd[postgres]) is not installed")


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def jobs_db(postgres: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A database of its own for each test: no test sees another's jobs."""
    name = "t_" + request.node.name.lower()[:50]
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return postgres.url.rsplit("/", 1)[0] + "/" + name


def job_lines(count: int, start: int = 1) -> str:
    return "".join(
        json.dumps({"custom_id": f"g{v}", "inputs": [{"name": "X", "datatype": "FP32",
                    "shape": [1, 1], "data": [float(v)]}]}) + "\n"
        for v in range(start, start + count)
    )  # fmt: skip


# ---- the store: two stores are two replicas ----


def test_a_lease_that_runs_out_moves_the_job_and_fences_the_old_runner(
    jobs_db: str, tmp_path: Path
) -> None:
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=0.5)
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=0.5)
    text = job_lines(100)

    async def body() -> None:
        row = await a.create("", "gated", "")
        a.upload_path(row.id).write_text(text)
        await a.queue(row.id, 100, len(text))
        mine = await a.claim()
        assert mine is not None and mine.id == row.id
        assert await b.claim() is None  # a holds the lease
        out = a.open_results(mine)
        out.write(b"first\n")
        assert await a.checkpoint(mine, out, Progress(10, 1, 1, 0)) == "running"
        assert (await b.get(row.id)).results_bytes == 6  # type: ignore[union-attr]

        # a stops renewing (killed, cut off): b takes the job once the lease has run out
        taken: JobRow | None = None
        while taken is None:  # b asks again (each a round trip) until the lease runs out
            taken = await b.claim()
        assert (taken.id, taken.input_offset) == (row.id, 10)
        assert (await b.open_input(taken)).read_text() == text  # from the database

        # a comes back: it writes nothing more, of results or offsets
        out.write(b"late\n")
        with pytest.raises(LeaseLost, match=f"job {row.id}: this replica no longer holds its "
                           "claim .*another replica took it over"):  # fmt: skip
            await a.checkpoint(mine, out, Progress(20, 2, 2, 0))
        with pytest.raises(LeaseLost):
            await a.finish(mine, "completed")
        theirs_out = b.open_results(taken)
        theirs_out.write(b"second\n")
        await a.cancel(row.id)  # any replica may cancel: the runner hears it at its checkpoint
        assert await b.checkpoint(taken, theirs_out, Progress(20, 2, 2, 0)) == "cancelling"
        await b.finish(taken, "cancelled")
        final = await a.get(row.id)
        assert final is not None and (final.status, final.results_bytes) == ("cancelled", 13)
        got = b"".join([p async for p in a.read_results(row.id, 0, final.results_bytes)])
        assert got == b"first\nsecond\n"
        assert b"".join([p async for p in a.read_results(row.id, 3, 9)]) == b"st\nsec"

    try:
        run(body)
    finally:
        a.close()
        b.close()


def test_a_stopping_replica_gives_its_job_back_at_once(jobs_db: str, tmp_path: Path) -> None:
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=3600)
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=3600)

    async def body() -> None:
        row = await a.create("", "gated", "")
        a.upload_path(row.id).write_text(job_lines(3))
        await a.queue(row.id, 3, 1)
        mine = await a.claim()
        assert mine is not None and await b.claim() is None
        out = a.open_results(mine)
        out.write(b"x" * (5 * 1024 * 1024))  # more than one part of the table
        await a.release(mine, out, Progress(7, 1, 1, 0))
        taken = await b.claim()  # no lease to wait for
        assert taken is not None and (taken.input_offset, taken.results_bytes) == (
            7,
            5 * 1024 * 1024,
        )
        pieces = [p async for p in b.read_results(row.id, 0, taken.results_bytes)]
        assert b"".join(pieces) == b"x" * (5 * 1024 * 1024) and len(pieces) == 5

    try:
        run(body)
    finally:
        a.close()
        b.close()


def test_a_frontend_that_runs_no_jobs_keeps_no_input_and_the_runner_reads_it_back(
    jobs_db: str, tmp_path: Path
) -> None:
    """--frontends N: frontend 1 takes a job in (keep_inputs False: it runs none), stores
    it and keeps no copy; the runner, frontend 0, reads the input from the database."""
    taker = PostgresStore(jobs_db, tmp_path / "f1", lease_s=60, keep_inputs=False)
    runner = PostgresStore(jobs_db, tmp_path / "f0", lease_s=60)
    text = job_lines(60_000)  # over 5 MB: two parts of batchd_job_input
    assert len(text) > PART_BYTES

    async def body() -> None:
        row = await taker.create("", "gated", "")
        taker.upload_path(row.id).write_text(text)
        await taker.queue(row.id, 60_000, len(text))
        assert not taker.folder(row.id).exists()
        claimed = await runner.claim()
        assert claimed is not None
        assert (await runner.open_input(claimed)).read_text() == text

    try:
        run(body)
    finally:
        taker.close()
        runner.close()


def test_the_postgres_store_keeps_each_owner_s_newest_ended_jobs(
    jobs_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    store = PostgresStore(jobs_db, tmp_path / "a", lease_s=30, clock=lambda: clock[0])
    try:
        run(lambda: keeps_each_owner_s_newest_ended_jobs(store, clock))
        # expiry removes EXPIRE_MOST a run: all at once, a backlog held the database thread,
        # and every job call of the frontend behind it
        monkeypatch.setattr(postgres_module, "EXPIRE_MOST", 1)
        ended = [r.id for r in run(lambda: store.select(None)) if r.ended]
        assert len(ended) >= 2
        assert len(run(lambda: store.expire(retention_s=0))) == 1
        assert len(run(lambda: store.expire(retention_s=0))) == 1
    finally:
        store.close()


def _lock_waiters(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0])


@pytest.mark.parametrize("ended", [False, True], ids=["upload", "ended"])
def test_expiry_takes_no_row_another_transaction_holds(
    jobs_db: str, tmp_path: Path, ended: bool
) -> None:
    """An upload that queue() held past its lease (a large input being stored), then
    committed queued: expiry picked its id while it read 'validating, lease passed', waited,
    and deleted the queued job its submitter had been told of (late review). Rows held
    are skipped (an ended job too: another replica expiring it) and terms checked again."""
    store = PostgresStore(jobs_db, tmp_path / "a", lease_s=30)
    try:
        job = run(lambda: store.create("o", "m", ""))
        past = "finished_at = 1, status = 'completed'" if ended else "lease_until = 1"
        with psycopg.connect(jobs_db) as conn:
            conn.execute(f"UPDATE batchd_jobs SET {past} WHERE id = %s", (job.id,))
            conn.commit()
            then = "finished_at = 0, status = 'queued'" if ended else "status = 'queued'"
            conn.execute(f"UPDATE batchd_jobs SET {then} WHERE id = %s", (job.id,))  # held

            async def expiring() -> list[str]:
                task = asyncio.ensure_future(store.expire(retention_s=0))
                ended_or_waits = lambda: task.done() or _lock_waiters(jobs_db) > 0  # noqa: E731
                await asyncio.to_thread(wait_for, ended_or_waits, 30, "expiry to end or wait")
                conn.commit()  # queued
                return await task

            assert run(expiring) == []
        row = run(lambda: store.get(job.id))
        assert row is not None and row.status == "queued"
    finally:
        store.close()


def test_a_download_of_a_job_removed_under_it_fails_rather_than_ends_short(
    jobs_db: str, tmp_path: Path
) -> None:
    """A submission's trim (or retention) removed a job whose results another client
    was reading: the next part was not found, and the download ended short, with OK
    and whole lines, so the client wrote the short file as the results (late review)."""
    store = PostgresStore(jobs_db, tmp_path / "a", lease_s=30)

    async def body() -> None:
        row = await store.create("", "gated", "")
        store.upload_path(row.id).write_text(job_lines(2))
        await store.queue(row.id, 2, len(job_lines(2)))
        mine = await store.claim()
        assert mine is not None
        out = store.open_results(mine)
        for n in (1, 2):  # two checkpoints: two parts
            out.write(b"x" * 9 + b"\n")
            await store.checkpoint(mine, out, Progress(n, n, n, 0))
        reading = store.read_results(row.id, 0, 20)
        assert await anext(reading) == b"x" * 9 + b"\n"
        await store.delete(row.id)
        with pytest.raises(ModelNotFound, match="was removed while its results were read"):
            await anext(reading)

    try:
        run(body)
    finally:
        store.close()


def test_an_upload_whose_replica_went_is_removed_and_a_database_down_is_unavailable(
    jobs_db: str, tmp_path: Path
) -> None:
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=0.2)
    gone = PostgresStore("postgresql://nobody@127.0.0.1:1/none", tmp_path / "x", lease_s=1)

    async def body() -> None:
        row = await a.create("", "gated", "")  # its replica dies mid-upload: nobody renews
        while await a.get(row.id) is not None:
            assert await a.recover() in ([], [row.id])
        with pytest.raises(Unavailable, match=r"jobs database postgresql://nobody@127\.0\.0\.1:1"):
            await gone.get("job-0")

    try:
        run(body)
    finally:
        a.close()
    assert safe_url("postgresql://u:secret@h:5/d") == "postgresql://u:***@h:5/d"


def test_a_cancel_through_one_replica_reaches_an_upload_on_another(
    jobs_db: str, tmp_path: Path
) -> None:
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=60)
    text = job_lines(3)

    async def body() -> None:
        row = await a.create("", "gated", "")
        assert await a.uploading(row.id) == "validating"
        a.upload_path(row.id).write_text(text)
        await b.cancel(row.id)
        assert (await b.get(row.id)).status == "cancelled"  # type: ignore[union-attr]
        assert await a.uploading(row.id) == "cancelled"  # a hears it at its next renewal
        assert await a.queue(row.id, 3, len(text)) is False  # and stores none of it
        with psycopg.connect(jobs_db) as conn:
            parts = "SELECT count(*) FROM batchd_job_input WHERE job_id = %s"
            assert conn.execute(parts, (row.id,)).fetchone() == (0,)
        await a.delete(row.id)
        assert await b.get(row.id) is None

    try:
        run(body)
    finally:
        a.close()
        b.close()


def test_a_key_queued_through_one_replica_answers_for_every_replica(
    jobs_db: str, tmp_path: Path
) -> None:
    """A submission's idempotency key, once its job is queued through replica a, names
    that job on b too; b's upload with the same key keeps nothing (Submitted). A
    database made by an older batchd (no key column) gets the column."""
    with psycopg.connect(jobs_db, autocommit=True) as conn:
        older = database.SCHEMA.split("-- a submission's idempotency key")[0]  # 9f07a6e's
        assert "submission" not in older
        conn.execute(older)
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=60)
    text = job_lines(2)

    async def body() -> None:
        first, second = await a.create("o", "gated", ""), await b.create("o", "gated", "")
        for store, row in ((a, first), (b, second)):
            store.upload_path(row.id).write_text(text)
        assert await a.queue(first.id, 2, len(text), "k") is True
        with pytest.raises(Submitted) as taken:
            await b.queue(second.id, 2, len(text), "k")
        assert taken.value.job_id == first.id
        assert (await b.get(second.id)).status == "validating"  # type: ignore[union-attr]
        assert await b.keyed("o", "k") == first.id and await b.keyed("p", "k") is None

    try:
        run(body)
    finally:
        a.close()
        b.close()


def test_another_replica_reads_a_checkpoint_s_time_in_a_database_made_before_it(
    jobs_db: str, tmp_path: Path
) -> None:
    """A checkpoint writes its time (checkpointed_at), which another replica reads to time
    the job's rate (store.pace); a database made by a batchd before the column gets it."""
    with psycopg.connect(jobs_db, autocommit=True) as conn:
        table = database.SCHEMA.split("-- a submission's idempotency key")[0]
        older = re.sub(r",( +--[^\n]*)\n *checkpointed_at [^\n]*", r"\1", table)
        assert "checkpointed_at" in table and "checkpointed_at" not in older
        conn.execute(older)
    clock = [5000.0]
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60, clock=lambda: clock[0])
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=60)

    async def body() -> None:
        row = await _queued(a, "gated", n=2)
        mine = await a.claim()
        assert mine is not None and (await b.get(row.id)).checkpointed_at == 0.0  # type: ignore[union-attr]
        clock[0] = 5002.5
        out = a.open_results(mine)
        out.write(b"one\n")
        assert await a.checkpoint(mine, out, Progress(10, 1, 1, 0)) == "running"
        seen = await b.get(row.id)
        assert seen is not None and (seen.resumed_at, seen.checkpointed_at) == (5000.0, 5002.5)
        assert (seen.done, seen.resumed_done) == (1, 0)

    try:
        run(body)
    finally:
        a.close()
        b.close()


def test_one_key_queued_by_two_replicas_at_once_makes_one_job(jobs_db: str, tmp_path: Path) -> None:
    """Both pass any look for the key before either commits; the unique index then makes
    the second wait for the first and fail: Submitted, naming the first, not a 503."""
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=60)
    text = job_lines(1)
    first, second = run(lambda: a.create("o", "gated", "")), run(lambda: b.create("o", "gated", ""))
    b.upload_path(second.id).write_text(text)
    try:
        with psycopg.connect(jobs_db) as other:  # a's queue, under way: not yet committed
            other.execute("UPDATE batchd_jobs SET status = 'queued', submission = 'k' "
                          "WHERE id = %s", (first.id,))  # fmt: skip
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(run, lambda: b.queue(second.id, 1, len(text), "k"))
                waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                with psycopg.connect(jobs_db, autocommit=True) as look:
                    wait_for(lambda: look.execute(waiting).fetchone() == (1,), 30, "b to wait")
                other.commit()
                with pytest.raises(Submitted) as taken:
                    queued.result(30)
        assert taken.value.job_id == first.id
    finally:
        a.close()
        b.close()


def test_a_replica_that_starts_while_others_write_waits_on_no_lock(
    jobs_db: str, tmp_path: Path
) -> None:
    """Each replica's first call makes the tables: ALTER TABLE and CREATE INDEX ... IF NOT
    EXISTS lock the table even when there is nothing to make, so one started while
    another replica's transaction wrote waited out lock_timeout (10 s) and failed."""
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)
    run(lambda: a.create("o", "gated", ""))  # the tables are made
    with psycopg.connect(jobs_db) as writer:  # a transaction that wrote, still open
        writer.execute("UPDATE batchd_jobs SET error = 'x'")
        b = PostgresStore(jobs_db, tmp_path / "b", lease_s=60)
        try:
            assert run(lambda: b.count(("validating",))) == 1
        finally:
            b.close()
            a.close()


def test_a_jobs_db_that_is_not_postgresql_is_refused_without_echoing_it() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for url, scheme in (("mysql://u:secret@h/d", "'mysql'"), ("u:secret@h/d", "'none'")):
        cfg = from_arguments(parser.parse_args(["--model-repository", ".", "--jobs-db", url]))
        with pytest.raises(ConfigError, match=f"--jobs-db takes a PostgreSQL URL.*{scheme}") as e:
            cfg.check()
        assert "secret" not in str(e.value)


# ---- what a replica claims, and what it gives back ----


class Core(FakeCore):
    """A core whose model may be loaded yet have no live worker (loading, or broken)."""

    def __init__(self, *models: Any, ready: bool = True) -> None:
        super().__init__(models[0])
        self.models = {m.name: m for m in models}
        self.ready = ready

    def model_ready(self, name: str) -> bool:
        return self.ready and name in self.models


def named(name: str) -> Any:
    return dataclasses.replace(model(shape=(1,)), name=name)


def _jobs(store: PostgresStore, core: Core) -> Jobs:
    return Jobs(store, core, Limits(), max_file_bytes=1 << 20, max_open=4, retention_s=3600.0,
                min_upload_rate=0, upload_grace_s=0.0)  # fmt: skip


async def _queued(store: PostgresStore, name: str, version: str = "", n: int = 3) -> JobRow:
    row = await store.create("", name, version)
    text = job_lines(n)
    store.upload_path(row.id).write_text(text)
    await store.queue(row.id, n, len(text))
    return row


def test_a_replica_claims_only_jobs_it_can_run_and_gives_back_one_whose_model_went(
    jobs_db: str, tmp_path: Path
) -> None:
    """A job of a model not loaded here, or loaded without a live worker (loading,
    failed to load) is left to a replica that can run it; one whose model goes after
    the claim is given back (queued), never failed for it. One that names a version
    other than the one loaded fails, as on one server: versions are each server's
    own count of its loads, so no replica might ever claim it."""
    dbl2, gated = named("dbl2"), named("gated")
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=3600)
    b = PostgresStore(jobs_db, tmp_path / "b", lease_s=3600)

    async def body() -> None:
        row = await _queued(a, "dbl2")
        assert await _jobs(a, Core(gated))._claim() is None  # not loaded here
        assert await _jobs(a, Core(dbl2, ready=False))._claim() is None  # no live worker
        mine = await _jobs(a, Core(dbl2))._claim()
        assert mine is not None and mine.id == row.id
        await JobRun(mine, a, Core(gated), Limits(), lambda *x: None).run()  # dbl2 unloaded
        back = await b.get(row.id)
        assert back is not None and (back.status, back.error) == ("queued", "")
        taken = await b.claim(only={"dbl2"})  # at once: no lease to wait out
        assert taken is not None and taken.id == row.id
        other = await _queued(a, "gated", version="7")
        pinned = await _jobs(a, Core(gated))._claim()  # gated has version "1" here
        assert pinned is not None and pinned.id == other.id
        await JobRun(pinned, a, Core(gated), Limits(), lambda *x: None).run()
        failed = await a.get(other.id)
        assert failed is not None and failed.status == "failed"
        assert "has no version '7' loaded (it has '1')" in failed.error

    try:
        run(body)
    finally:
        a.close()
        b.close()


def test_a_job_whose_model_has_no_live_worker_is_given_back(
    jobs_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its workers all gone after the claim: the run makes no progress, so it stops
    renewing its lease and gives the job back instead of holding it "0 of N"."""
    monkeypatch.setattr(run_module, "NOT_READY_S", 0.0)
    monkeypatch.setattr(run_module, "CHECKPOINT_S", 0.01)
    dbl2 = named("dbl2")
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=3600)

    class Stuck(Core):  # the lines wait in the queue for a worker that never comes
        def submit(self, request: Any) -> asyncio.Future[Any]:
            self.ready = False
            return asyncio.get_running_loop().create_future()

    async def body() -> None:
        row = await _queued(a, "dbl2")
        mine = await a.claim()
        assert mine is not None
        await asyncio.wait_for(JobRun(mine, a, Stuck(dbl2), Limits(), lambda *x: None).run(), 30)
        back = await a.get(row.id)
        assert back is not None and (back.status, back.done) == ("queued", 0)

    try:
        run(body)
    finally:
        a.close()


def test_a_replica_whose_disk_is_full_gives_the_job_back_not_failed(
    jobs_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its input cache cannot be written (ENOSPC): that replica's fault, not the job's.
    It failed the job for every replica, its lines lost (review 56b); it is given back,
    queued for a replica with room, and the part it had copied is removed."""
    dbl2 = named("dbl2")
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=3600, keep_inputs=False)
    real = Path.open

    def full(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if self.suffix == ".part":
            f = real(self, mode, *args, **kwargs)
            f.write(b"x")  # (what it had copied when the disk filled)
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, mode, *args, **kwargs)

    async def body() -> None:
        row = await _queued(a, "dbl2")
        mine = await a.claim()
        assert mine is not None
        monkeypatch.setattr(Path, "open", full)
        go = JobRun(mine, a, Core(dbl2), Limits(), lambda *x: None)
        await asyncio.wait_for(go.run(), 30)
        monkeypatch.undo()
        back = await a.get(row.id)
        assert back is not None and (back.status, back.done) == ("queued", 0)
        assert back.error.startswith("stopped by this server's storage (OSError: [Errno 28] ")
        assert go.stalled and not list(a.folder(row.id).glob("*.part"))
        again = await a.claim()  # (its status says why till it runs again)
        assert again is not None and (again.id, again.error) == (row.id, "")
        await a.requeue(again, "stopped")  # cancelled so, it says nothing of running on
        await a.cancel(row.id)
        gone = await a.get(row.id)
        assert gone is not None and (gone.status, gone.error) == ("cancelled", "")

    try:
        run(body)
    finally:
        a.close()


def test_a_give_back_the_database_missed_is_made_when_asked_again(
    jobs_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim was forgotten though the give-back failed (Unavailable): asked again,
    it was fenced as no claim, and the job stayed running till its lease ran out."""
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=3600)
    real, fails = a._runs.run, [1]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if fails[0]:
            fails[0] -= 1
            raise Unavailable("the jobs database did not answer within 10 s")
        return await real(*args, **kwargs)

    async def body() -> None:
        row = await _queued(a, "dbl2")
        mine = await a.claim()
        assert mine is not None
        monkeypatch.setattr(a._runs, "run", flaky)
        with pytest.raises(Unavailable):
            await a.requeue(mine, "stopped")
        await a.requeue(mine, "stopped")
        back = await a.get(row.id)
        assert back is not None and back.status == "queued"

    try:
        run(body)
    finally:
        a.close()


def test_an_upload_being_stored_holds_up_no_other_call(jobs_db: str, tmp_path: Path) -> None:
    """The file goes in on a connection of its own: on the store's one connection, a
    large upload's insert held every other call of the replica (a GetJob 5-8 s behind
    800 MB to 1 GB, review 56b; others' upload leases could run out)."""
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)

    async def body() -> None:
        row = await a.create("", "gated", "")
        path = a.upload_path(row.id)
        os.mkfifo(path)  # its insert reads it, and waits here till the test writes
        storing = asyncio.ensure_future(a.queue(row.id, 2, len(job_lines(2))))
        writer = await asyncio.to_thread(os.open, path, os.O_WRONLY)  # the insert reads
        try:
            seen = await asyncio.wait_for(a.get(row.id), 5)  # (a guard: it waited 10 s)
            assert seen is not None and seen.status == "validating"
        finally:
            os.write(writer, job_lines(2).encode())
            os.close(writer)
        assert await asyncio.wait_for(storing, 30)
        queued = await a.get(row.id)
        assert queued is not None and queued.status == "queued"

    try:
        run(body)
    finally:
        a.close()


def _signal_postgres(postgres: PostgresServer, sig: signal.Signals) -> None:
    """`sig` to the postmaster and every backend: SIGSTOP freezes the database. SIGCONT
    goes to the backends first: the postmaster, woken first, reaped one that had exited
    meanwhile, and its kill failed ESRCH (a fresh clone's run, session 57)."""
    pid = int((postgres.data / "postmaster.pid").read_text().split()[0])
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in [*children, pid] if sig == signal.SIGCONT else [pid, *children]:
        with contextlib.suppress(ProcessLookupError):  # (a backend gone since it was listed)
            os.kill(p, sig)


def test_a_database_that_stops_answering_makes_calls_unavailable_in_bounded_time(
    postgres: PostgresServer, jobs_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database, "CALL_TIMEOUT_S", 1.0)
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)

    async def body() -> None:
        row = await _queued(a, "gated")
        mine = await a.claim()
        assert mine is not None
        _signal_postgres(postgres, signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable, match=r"did not answer within 1 s"):
                await asyncio.wait_for(a.get(row.id), 10)
            with pytest.raises(Unavailable, match=r"did not answer"):
                await asyncio.wait_for(a.renew(mine), 10)
            with pytest.raises(Unavailable):  # a new connection: libpq's connect_timeout
                await asyncio.wait_for(a.get(row.id), 10)
        finally:
            _signal_postgres(postgres, signal.SIGCONT)
        got = await a.get(row.id)  # connected again
        assert got is not None and got.status == "running"

    try:
        run(body)
    finally:
        a.close()


def test_a_stop_gives_the_job_back_in_every_window(jobs_db: str, tmp_path: Path) -> None:
    """A checkpoint in flight (it commits anyway: the release keeps each result once), the
    input still loading from the database, a claim in flight: each is given back."""
    gated = named("gated")

    class Slow(PostgresStore):
        gate = asyncio.Event()
        entered = asyncio.Event()

        async def open_input(self, row: JobRow) -> Path:
            self.entered.set()
            await self.gate.wait()  # parts still coming from the database
            return await super().open_input(row)

        async def claim(self, exclude_models: frozenset[str] = frozenset(),
                        only: Any = None) -> JobRow | None:  # fmt: skip
            self.entered.set()
            await self.gate.wait()  # a claim's round trip, during which stop() comes
            return await super().claim(exclude_models, only)

    a = Slow(jobs_db, tmp_path / "a", lease_s=3600)

    async def status(job_id: str) -> str:
        return (await a.get(job_id)).status  # type: ignore[union-attr]

    async def body() -> None:
        Slow.gate, Slow.entered = asyncio.Event(), asyncio.Event()
        row = await _queued(a, "gated")
        mine = await PostgresStore.claim(a)
        assert mine is not None
        out = a.open_results(mine)
        out.write(b"abc\n")
        with psycopg.connect(jobs_db) as blocker:  # holds the row: the checkpoint waits
            blocker.execute("SELECT 1 FROM batchd_jobs WHERE id = %s FOR UPDATE", (row.id,))
            cp = asyncio.create_task(a.checkpoint(mine, out, Progress(9, 1, 1, 0)))
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"

            async def blocked() -> bool:
                return blocker.execute(waiting).fetchone() != (0,)

            await asyncio.wait_for(until(blocked), 30)
            cp.cancel()  # SIGTERM now
            release = asyncio.create_task(a.release(mine, out, Progress(9, 1, 1, 0)))
            await asyncio.sleep(0.1)
        await release  # the checkpoint commits, then the release: no duplicate key
        got = await a.get(row.id)
        assert got is not None and (got.status, got.results_bytes) == ("queued", 4)
        assert b"".join([x async for x in a.read_results(row.id, 0, 4)]) == b"abc\n"

        mine = await PostgresStore.claim(a)
        assert mine is not None
        task = asyncio.create_task(JobRun(mine, a, Core(gated), Limits(), lambda *x: None).run())
        await a.entered.wait()
        task.cancel()  # SIGTERM while its input loads
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert await status(row.id) == "queued"

        Slow.gate, Slow.entered = asyncio.Event(), asyncio.Event()
        jobs = _jobs(a, Core(gated))
        loop = asyncio.create_task(jobs.run())
        await a.entered.wait()
        stopping = asyncio.create_task(jobs.stop())
        await asyncio.sleep(0)
        a.gate.set()  # the claim comes in after the stop
        await asyncio.wait_for(stopping, 30)
        await asyncio.wait_for(loop, 30)
        assert await status(row.id) == "queued"

    try:
        run(body)
    finally:
        a.close()


def test_a_lease_is_renewed_while_a_long_call_holds_the_other_connection(
    jobs_db: str, tmp_path: Path
) -> None:
    """A big upload being stored, or an input read back, never costs a running job its
    lease: the running jobs' calls have a connection of their own."""
    a = PostgresStore(jobs_db, tmp_path / "a", lease_s=60)

    async def body() -> None:
        await _queued(a, "gated")
        mine = await a.claim()
        assert mine is not None
        long = asyncio.create_task(a._db.run(database.one, "SELECT pg_sleep(3)"))
        await asyncio.sleep(0.2)
        assert not long.done()
        assert await asyncio.wait_for(a.renew(mine), 2) == "running"
        await long

    try:
        run(body)
    finally:
        a.close()


# ---- real replicas ----


def _replica(tmp: Path, gate: Gate, jobs_db: str, *args: str) -> ServerProcess:
    return ServerProcess(
        TEST_MODELS, "--credits-per-worker", "1", "--jobs-db", jobs_db, *args,
        log_dir=tmp, env={"BATCHD_TEST_DIR": str(gate.state)},
    ).start()  # fmt: skip


def _results(client: Client, job_id: str, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / f"{job_id}-{os.getpid()}.jsonl"
    client.job_results(job_id, out)
    return [json.loads(x) for x in out.read_text().splitlines()]


def _moved(tmp: Path, gate: Gate, jobs_db: str, n: int, hold: int, lease: str,
           stop: Callable[[ServerProcess], None]) -> ServerProcess:  # fmt: skip
    """A job of `n` lines, held at line `hold` on a first replica; a second replica starts
    (the job is claimed: it cannot take it), answers for it, then `stop(first)`: the
    job ends on the second, on from the first's checkpoint, every custom_id answered
    once with its value. Returns the first replica."""
    held = gate.state / f"hold-{hold}"
    held.touch()
    first = _replica(tmp, gate, jobs_db, "--jobs-lease", lease)
    second: ServerProcess | None = None
    try:
        with Client(first.url) as c:
            job = c.submit_job("gated", [json.loads(x) for x in job_lines(n).splitlines()])
            wait_for(lambda: c.job(job.id).results_bytes > 0, 60, "a checkpoint")
        second = _replica(tmp, gate, jobs_db, "--jobs-lease", lease)
        with Client(second.url) as c2:
            seen = c2.job(job.id)  # any replica answers for any job
            assert seen.status == "running" and 0 < seen.done < hold, seen
            assert [j.id for j in c2.jobs()] == [job.id]
            stop(first)
            held.unlink()  # the batch held at the stop is answered, or answered again, once
            wait_for(lambda: c2.job(job.id).ended, 120, "the job to end on the second replica")
            done, got = c2.job(job.id), _results(c2, job.id, tmp)
    except BaseException:
        if first.proc is not None and first.proc.poll() is None:
            first.stop(signal.SIGKILL)
        raise
    finally:
        held.unlink(missing_ok=True)
        if second is not None:
            assert second.stop() == 0, second.log()
    assert (done.status, done.completed, done.failed) == ("completed", n, 0), done
    counts = Counter(r["custom_id"] for r in got)
    assert len(got) == n and set(counts.values()) == {1}
    assert all(r["outputs"][0]["data"] == [2.0 * int(r["custom_id"][1:])] for r in got)
    resumed = re.findall(rf"job {job.id} of model gated: running from line (\d+)", second.log())
    assert [int(x) > 1 for x in resumed] == [True], resumed  # on from the checkpoint
    return first


def test_a_killed_replicas_job_runs_on_another_with_every_result_once(
    jobs_db: str, gate: Gate, tmp_path: Path
) -> None:
    """Killed: the second replica takes the job once the first's lease has run out."""

    def kill(first: ServerProcess) -> None:
        first.proc.kill()  # type: ignore[union-attr]
        first.proc.wait()  # type: ignore[union-attr]

    _moved(tmp_path, gate, jobs_db, 5000, 3000, "2", kill)


def test_a_replica_stopped_with_sigterm_hands_its_job_over_at_once(
    jobs_db: str, gate: Gate, tmp_path: Path
) -> None:
    """With a lease of an hour, only the job given back at the stop can run on the
    other replica within the test's wait."""
    first = _moved(
        tmp_path, gate, jobs_db, 600, 300, "3600",
        lambda first: first.proc.send_signal(signal.SIGTERM),  # type: ignore[union-attr]
    )  # fmt: skip
    assert first.proc.wait(60) == 0, first.log()  # type: ignore[union-attr]


def test_sigterm_says_not_ready_at_once_while_the_jobs_database_hangs(
    postgres: PostgresServer, jobs_db: str, gate: Gate, tmp_path: Path
) -> None:
    """Readiness goes NOT_SERVING at SIGTERM, before the job runner's stop gives its
    running job back to a database that does not answer (a balancer would keep
    sending for as long); the replica still ends once the database is back."""
    held = gate.state / "hold-3"
    held.touch()
    replica = _replica(tmp_path, gate, jobs_db, "--drain-notice", "1", "--drain-timeout", "30")
    check = health_pb2.HealthCheckRequest(service="")
    try:
        with Client(replica.url) as c, grpc.insecure_channel(replica.url) as channel:
            job = c.submit_job("gated", [json.loads(x) for x in job_lines(10).splitlines()])
            wait_for(lambda: c.job(job.id).status == "running", 60, "the job to run")
            health = health_pb2_grpc.HealthStub(channel)
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            _signal_postgres(postgres, signal.SIGSTOP)
            try:
                replica.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                # (before: only once the give-back gave up, database.CALL_TIMEOUT_S later)
                wait_for(lambda: health.Check(check, timeout=10).status == not_serving, 5, "not")
            finally:
                _signal_postgres(postgres, signal.SIGCONT)
                held.unlink()
        assert replica.proc.wait(60) == 0, replica.log()  # type: ignore[union-attr]
    except BaseException:
        held.unlink(missing_ok=True)
        replica.stop(signal.SIGKILL)
        raise


async def _paused(resume: asyncio.Event) -> AsyncIterator[pb.SubmitJobRequest]:
    """An upload that sends its first piece, then nothing until `resume`."""
    yield pb.SubmitJobRequest(model_name="gated", data=job_lines(1).encode())
    await resume.wait()


def test_cancel_through_one_replica_stops_an_upload_on_another(
    jobs_db: str, gate: Gate, tmp_path: Path
) -> None:
    """The upload runs on the first replica (no rate: it waits as long as it likes);
    the cancel comes to the second. The first hears it at its next renewal (a third
    of the 1 s lease): its submitter gets CANCELLED and the job is removed."""
    first = _replica(tmp_path, gate, jobs_db, "--jobs-lease", "1", "--jobs-min-upload-rate", "0")
    second: ServerProcess | None = None

    async def scenario(second: ServerProcess) -> None:
        resume = asyncio.Event()
        async with grpc.aio.insecure_channel(first.url) as channel, AsyncClient(second.url) as c:
            upload = asyncio.ensure_future(pb_grpc.JobsStub(channel).SubmitJob(_paused(resume)))
            found = await until(lambda: c.jobs(status="validating"))
            answer = await c.cancel_job(found[0].id)
            assert (answer.id, answer.status) == (found[0].id, "cancelled")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await upload
            assert e.value.code() == grpc.StatusCode.CANCELLED, e.value
            assert f"job {answer.id} was cancelled while it was uploading" in str(e.value.details())
            assert await c.jobs() == []
            resume.set()

    try:
        second = _replica(tmp_path, gate, jobs_db, "--jobs-lease", "1")
        run(lambda: asyncio.wait_for(scenario(second), 60))
    finally:
        for replica in (first, second):
            if replica is not None:
                assert replica.stop() == 0, replica.log()
