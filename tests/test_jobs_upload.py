"""A job's upload: it must keep up --jobs-min-upload-rate after --jobs-upload-grace,
or it ends and frees its --jobs-max-open place (before, a client dripping a byte
now and then held it for as long as it liked); and a CancelJob that comes while it
is uploaded stops it, removing the job.

The pure deadline first, then JobsService over an SQLite store in this process,
then a real server. No sleep decides an assertion: each waits for the upload's
own outcome, bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from batchd.client import AsyncClient
from batchd.client.jobs import PIECE
from batchd.protos import jobs_pb2 as pb
from batchd.protos import jobs_pb2_grpc as pb_grpc
from batchd.protos.model_config import ConfigError
from batchd.server.config import Jobs as JobsConfig
from batchd.server.config import Limits, add_arguments, from_arguments
from batchd.server.errors import Cancelled, LimitExceeded, Unavailable, http_status
from batchd.server.jobs import runner
from batchd.server.jobs.service import JobsService
from batchd.server.jobs.sqlite import SqliteStore
from batchd.server.jobs.store import OPEN
from batchd.server.jobs.upload import upload_deadline
from tests.conftest import Gate, model, run
from tests.servers import TEST_MODELS, ServerProcess
from tests.test_job_parts import ONE_LINE, FakeCore

CFG = model(max_batch_size=4, shape=(1,))
EVERYONE = ("", True)
T = TypeVar("T")


async def until(probe: Callable[[], Awaitable[T]]) -> T:
    """`probe`'s first answer that is not empty, asked every 10 ms: a poll for a state,
    bounded by the caller's timeout."""
    while True:
        if found := await probe():
            return found
        await asyncio.sleep(0.01)


# ---- the deadline ----


def test_an_upload_has_its_head_start_then_a_second_for_each_rate_bytes() -> None:
    assert upload_deadline(100.0, 10**9, 0, 5.0) == math.inf  # 0: off
    assert upload_deadline(100.0, 0, 1000, 5.0) == 105.0  # nothing came: the head start
    assert upload_deadline(100.0, 3000, 1000, 5.0) == 108.0  # 3,000 bytes buy 3 s more


def test_the_defaults_never_cut_the_client_s_pieces_while_it_keeps_up_the_rate() -> None:
    """A piece counts once it has all come. batchd's client sends ~256 KiB pieces: at the
    default rate, or faster, each arrives before the deadline the last one set."""
    rate, grace = JobsConfig().min_upload_rate, JobsConfig().upload_grace_s
    assert rate * grace >= PIECE
    for speed in (rate, rate * 1.5, rate * 100):
        received = 0
        for k in range(1, 2000):  # up to ~2 GiB, past --jobs-max-file-bytes
            arrives = k * PIECE / speed
            assert arrives <= upload_deadline(0.0, received, rate, grace), (speed, k)
            received += PIECE
    # One that falls behind is cut: the byte-a-while client of the review, at once.
    assert upload_deadline(0.0, 10, rate, grace) < grace + 1


def test_the_rate_and_grace_flags_are_checked_at_start_up() -> None:
    def parsed(*argv: str) -> Any:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return from_arguments(parser.parse_args(["--model-repository", ".", *argv]))

    for flag, value, takes in (
        ("--jobs-min-upload-rate", "-1", "bytes per second from 0 (off) to 2147483647, got -1"),
        ("--jobs-upload-grace", "inf", "seconds from 0 to 2147483.647, got inf"),
        # (SQLite's integers stop at 2**63 - 1: past it every expiry raised OverflowError)
        ("--jobs-max-kept", str(2**63), f"an integer from 1 to 2147483647, got {2**63}"),
        ("--jobs-max-kept", "0", "an integer from 1 to 2147483647, got 0"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"{flag} takes {takes}")):
            parsed(flag, value).check()
    ends = parsed("--jobs-min-upload-rate", "2147483647", "--jobs-upload-grace", "0")
    ends.check()
    assert (ends.jobs.min_upload_rate, ends.jobs.upload_grace_s) == (2**31 - 1, 0.0)
    off = parsed("--jobs-min-upload-rate", "0").jobs
    assert upload_deadline(0.0, 0, off.min_upload_rate, off.upload_grace_s) == math.inf


# ---- JobsService in this process ----


def jobs_of(store: SqliteStore, rate: int = 0, grace: float = 0.0, max_open: int = 4) -> Any:
    return runner.Jobs(store, FakeCore(CFG), Limits(), max_file_bytes=1 << 20,
                       max_open=max_open, retention_s=3600.0, min_upload_rate=rate,
                       upload_grace_s=grace, runs=False)  # fmt: skip


async def paused(first: bytes, resume: asyncio.Event) -> AsyncIterator[bytes]:
    """A client that sends `first`, then nothing until `resume`."""
    yield first
    await resume.wait()


async def whole(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def validating(service: JobsService) -> str:
    """The id of the job being uploaded, once its row is made."""

    async def uploads() -> list[pb.Job]:
        return list((await service.listing(EVERYONE, "validating")).jobs)

    return str((await until(uploads))[0].id)


def test_an_upload_that_stops_sending_ends_after_its_head_start_and_frees_its_place(
    tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path)
    service = JobsService(jobs_of(store, rate=1000, grace=0.05, max_open=1))

    async def body() -> str:
        resume = asyncio.Event()
        began = time.monotonic()
        with pytest.raises(LimitExceeded) as e:
            await service.submit(EVERYONE, CFG.name, "", paused(b"{", resume))
        assert time.monotonic() - began >= 0.05  # never before the head start
        assert re.fullmatch(
            r"the upload averaged [\d.]+ B/s over [\d.]+ s, under --jobs-min-upload-rate 1000 "
            r"\(after --jobs-upload-grace 0\.05\); send it faster, with the whole file ready "
            r"before it starts",
            e.value.message,
        ), e.value.message
        assert await store.count(OPEN) == 0 and await store.select(None) == []
        job = await service.submit(EVERYONE, CFG.name, "", whole(ONE_LINE.encode()))
        assert job.status == "queued"  # the place is free
        return str(job.id)

    queued = run(lambda: asyncio.wait_for(body(), 30))
    assert [p.name for p in tmp_path.glob("job-*")] == [queued]  # the dripper's files went


def test_a_trim_that_fails_leaves_the_submission_answered(tmp_path: Path) -> None:
    """The job is queued by the time --jobs-max-kept trims its token's: a trim that
    failed (a database that did not answer) answered the submission 503, and a client
    without an idempotency key sent the job again (second late review)."""

    class FailingTrim(SqliteStore):
        async def trim(self, owner: str, keep: int) -> list[str]:
            raise Unavailable("the jobs database did not answer within 10 s")

    store = FailingTrim(tmp_path)
    service = JobsService(jobs_of(store))

    async def body() -> None:
        resume = asyncio.Event()
        resume.set()
        job = await service.submit(EVERYONE, CFG.name, "", paused(ONE_LINE.encode(), resume))
        assert job.status == "queued" and await store.get(job.id) is not None

    run(lambda: asyncio.wait_for(body(), 30))


def test_a_submitter_gone_as_its_queued_job_is_made_durable_leaves_it_queued(
    tmp_path: Path,
) -> None:
    """Once committed queued, a job is not removed as an upload cut short: its submitter
    cancelled during the WAL's fsync (a deadline) had it deleted while it ran (review 56c)."""
    synced = asyncio.Event()

    class SlowDisk(SqliteStore):
        async def settle(self) -> None:
            synced.set()
            await asyncio.Event().wait()  # (an fsync that does not return before the cancel)

    store = SlowDisk(tmp_path)
    service = JobsService(jobs_of(store))

    async def body() -> None:
        submit = asyncio.ensure_future(
            service.submit(EVERYONE, CFG.name, "", whole(ONE_LINE.encode()))
        )
        await synced.wait()
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        (job,) = await store.select(None)
        assert job.status == "queued"

    run(lambda: asyncio.wait_for(body(), 30))


def test_a_queued_job_whose_fsync_failed_is_answered_queued_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Committed queued, it runs: an error answer would have its submitter send it again
    (a new key: a second job)."""

    class EioDisk(SqliteStore):
        async def settle(self) -> None:
            raise OSError(5, "Input/output error")

    store = EioDisk(tmp_path)
    service = JobsService(jobs_of(store))
    job = run(lambda: service.submit(EVERYONE, CFG.name, "", whole(ONE_LINE.encode())))
    assert job.status == "queued" and [r.id for r in run(lambda: store.select(None))] == [job.id]
    assert "queued, but its commit may not outlive a power loss (OSError" in caplog.text


def test_a_cancel_stops_an_upload_to_this_process_at_once(tmp_path: Path) -> None:
    class NoLooks(SqliteStore):
        renew_every_s = math.inf  # the upload never reads its row: only the cancel can stop it

    store = NoLooks(tmp_path)
    service = JobsService(jobs_of(store))

    async def body() -> None:
        resume = asyncio.Event()
        upload = asyncio.ensure_future(
            service.submit(EVERYONE, CFG.name, "", paused(ONE_LINE.encode(), resume))
        )
        job_id = await validating(service)
        answer = await service.cancel(EVERYONE, job_id)
        assert (answer.id, answer.status) == (job_id, "cancelled") and answer.finished_at > 0
        with pytest.raises(
            Cancelled, match=f"job {job_id} was cancelled while it was uploading"
        ) as e:
            await upload
        assert await store.get(job_id) is None and not store.folder(job_id).exists()
        assert http_status(e.value) == (409, {})  # over HTTP

    run(lambda: asyncio.wait_for(body(), 30))


@pytest.mark.parametrize(
    ("timeout_s", "notice_s"), [(30.0, 0.0), (2.0, 10.0)], ids=["no notice", "notice >= drain"]
)
def test_a_stop_lets_uploads_under_way_end_and_refuses_new_ones(
    tmp_path: Path, timeout_s: float, notice_s: float
) -> None:
    """SIGTERM's stop waits (within its time) for uploads under way, which a cut would
    make their clients send again whole, and refuses new ones with UNAVAILABLE: the
    client retries it through a balancer, to another replica. New ones are taken
    through the drain notice, but at most half the drain: a notice as long as the
    drain took uploads to its very end, and cut one begun late with no answer."""
    store = SqliteStore(tmp_path)
    jobs = jobs_of(store)
    service = JobsService(jobs)

    async def refused() -> bool:
        return not jobs.taking_uploads

    async def body() -> None:
        resume = asyncio.Event()
        upload = asyncio.ensure_future(
            service.submit(EVERYONE, CFG.name, "", paused(ONE_LINE.encode(), resume))
        )
        await validating(service)
        stop = asyncio.ensure_future(jobs.stop(timeout_s=timeout_s, notice_s=notice_s))
        await until(refused)
        with pytest.raises(Unavailable, match="this server is stopping: submit the job again"):
            await service.submit(EVERYONE, CFG.name, "", whole(ONE_LINE.encode()))
        assert not stop.done()  # (it waits for the upload, not for the time)
        resume.set()
        assert (await upload).status == "queued"
        await asyncio.wait_for(stop, 30)

    run(lambda: asyncio.wait_for(body(), 60))


def test_a_cancel_through_another_frontend_stops_the_upload_at_its_next_look(
    tmp_path: Path,
) -> None:
    """--frontends N share one SQLite database: the cancel comes to another process,
    and the upload reads its row every renew_every_s."""

    class Looks(SqliteStore):
        renew_every_s = 0.01

    store, other = Looks(tmp_path), SqliteStore(tmp_path, lock=False)
    service = JobsService(jobs_of(store))

    async def body() -> None:
        resume = asyncio.Event()
        upload = asyncio.ensure_future(
            service.submit(EVERYONE, CFG.name, "", paused(ONE_LINE.encode(), resume))
        )
        job_id = await validating(service)
        await other.cancel(job_id)
        assert (await other.get(job_id)).status == "cancelled"  # type: ignore[union-attr]
        with pytest.raises(Cancelled, match=f"job {job_id} was cancelled"):
            await upload
        assert await other.get(job_id) is None and await store.count(OPEN) == 0

    run(lambda: asyncio.wait_for(body(), 30))


def test_a_cancel_just_before_the_upload_is_queued_keeps_nothing(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)

    async def body() -> None:
        row = await store.create("", CFG.name, "")
        store.upload_path(row.id).write_text(ONE_LINE)
        await store.cancel(row.id)
        assert await store.uploading(row.id) == "cancelled"
        assert await store.queue(row.id, 1, len(ONE_LINE)) is False  # not queued after all
        assert (await store.get(row.id)).status == "cancelled"  # type: ignore[union-attr]

    run(body)


# ---- a real server ----


async def held(first: pb.SubmitJobRequest, resume: asyncio.Event
               ) -> AsyncIterator[pb.SubmitJobRequest]:  # fmt: skip
    """`first`, then nothing more until `resume`."""
    yield first
    await resume.wait()


def drip(url: str) -> Any:
    """The review's client over a blocking channel: a byte each 0.1 s, until the call ends;
    the call's error."""

    def requests() -> Iterator[pb.SubmitJobRequest]:
        yield pb.SubmitJobRequest(model_name="gated", data=b"{")
        while True:
            time.sleep(0.1)  # the client's pace, not a wait for an outcome
            yield pb.SubmitJobRequest(data=b" ")

    with grpc.insecure_channel(url) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.JobsStub(channel).SubmitJob(requests(), timeout=30)
    return e.value


def gated_lines(n: int) -> list[dict[str, Any]]:
    return [
        {"custom_id": f"g{v}", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1],
                                           "data": [float(v)]}]}
        for v in range(1, n + 1)
    ]  # fmt: skip


async def ended(client: AsyncClient, job_id: str) -> bool:
    return bool((await client.job(job_id)).ended)


async def http_answer(port: int, head: bytes) -> tuple[bytes, bytes]:
    """The status line and body answered to `head` and a body's first byte, the rest
    never sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"{")
        await writer.drain()
        answer = await reader.readuntil(b"\r\n\r\n")
        size = re.search(rb"content-length: (\d+)", answer, re.IGNORECASE)
        assert size is not None, answer
        return answer.split(b"\r\n")[0], await reader.readexactly(int(size.group(1)))
    finally:
        writer.close()


def test_a_dripping_upload_ends_after_the_grace_and_cancel_stops_an_upload(
    gate: Gate, tmp_path: Path
) -> None:
    """One open job at most. Uploads that drip (gRPC: a byte each 0.1 s; HTTP: one byte,
    then nothing) end after the 1 s grace, and a job then takes the place. An upload that
    keeps ahead of the rate (100 KB at once: 100 s at 1,000 B/s) is stopped by CancelJob."""
    jobs_dir = tmp_path / "jobs"
    server = ServerProcess(
        TEST_MODELS, "--credits-per-worker", "1", "--jobs-dir", str(jobs_dir),
        "--jobs-max-open", "1", "--jobs-min-upload-rate", "1000", "--jobs-upload-grace", "1",
        log_dir=tmp_path, env={"BATCHD_TEST_DIR": str(gate.state)},
    ).start()  # fmt: skip
    too_slow = r"the upload averaged [\d.]+ B/s over [\d.]+ s, under --jobs-min-upload-rate 1000"

    async def scenario() -> None:
        resume = asyncio.Event()
        async with grpc.aio.insecure_channel(server.url) as channel, AsyncClient(server.url) as c:
            stub = pb_grpc.JobsStub(channel)
            began = time.monotonic()
            # (a blocking stub: grpc.aio's reports INTERNAL if a write fails as the call
            # ends, grpc/grpc#36066, which a byte sent as the grace ends can hit)
            cut = await asyncio.to_thread(drip, server.url)
            assert cut.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, cut
            assert re.match(too_slow, cut.details() or ""), cut.details()
            assert time.monotonic() - began >= 1.0

            status, body = await asyncio.wait_for(
                http_answer(server.http_port, b"POST /v2/jobs?model=gated HTTP/1.1\r\n"
                            b"Host: [::1]\r\nContent-Length: 100000\r\n\r\n"), 30,
            )  # fmt: skip
            assert status == b"HTTP/1.1 429 Too Many Requests", (status, body)
            assert re.match(too_slow, json.loads(body)["error"]), body

            assert [j.id for j in await c.jobs()] == []  # both rows went
            job = await c.submit_job("gated", gated_lines(3))  # the place is free
            assert job.status == "queued"
            await until(lambda: ended(c, job.id))

            ahead = pb.SubmitJobRequest(model_name="gated", data=b"x" * 100_000)
            upload = asyncio.ensure_future(stub.SubmitJob(held(ahead, resume), timeout=30))
            found = await until(lambda: c.jobs(status="validating"))
            answer = await c.cancel_job(found[0].id)
            assert (answer.id, answer.status) == (found[0].id, "cancelled")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await upload
            assert e.value.code() == grpc.StatusCode.CANCELLED, e.value
            assert f"job {answer.id} was cancelled while it was uploading" in (
                e.value.details() or ""
            )
            assert [j.id for j in await c.jobs()] == [job.id]  # the cancelled one went
            assert not (jobs_dir / answer.id).exists()
            resume.set()

    try:
        run(lambda: asyncio.wait_for(scenario(), 90))
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize(
    ("owner", "status"), [(None, ""), ("me", ""), ("me", "queued"), (None, "queued")]
)
def test_listing_jobs_reads_an_index_not_every_job_kept(
    tmp_path: Path, owner: str | None, status: str
) -> None:
    """ListJobs runs on the event loop (SQLite): it sorted every job kept for
    --jobs-retention-hours to return `limit` of them, ~1 us each (a review: 6.8 ms at
    6,000 jobs, four listings at once pushed online p99 to 189 ms)."""
    store = SqliteStore(tmp_path)
    asked: list[str] = []
    store._db.set_trace_callback(asked.append)

    async def body() -> None:
        await store.select(owner, status, limit=1)

    asyncio.run(body())
    (sql,) = [q for q in asked if q.startswith("SELECT")]
    plan = " ".join(str(row[-1]) for row in store._db.execute(f"EXPLAIN QUERY PLAN {sql}"))
    assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, plan


def test_job_results_come_in_pieces_the_server_may_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store reads the results in 1 MiB pieces: a server started with
    --max-message-bytes 262144 failed every JobResults (Sent message larger than max),
    its client retrying the same for ever; over HTTP the same results came."""
    service = JobsService(None, max_message_bytes=262_144)

    async def results(caller: Any, job_id: str, offset: int = 0) -> AsyncIterator[bytes]:
        async def pieces() -> AsyncIterator[bytes]:
            yield bytes(range(256)) * 4096  # 1 MiB
            yield b"tail\n"

        return pieces()

    monkeypatch.setattr(service, "results", results)
    monkeypatch.setattr(service, "_caller", lambda context: ("", True))

    async def body() -> list[bytes]:
        return [c.data async for c in service.JobResults(pb.JobResultsRequest(id="j"), None)]

    chunks = asyncio.run(body())
    assert b"".join(chunks) == bytes(range(256)) * 4096 + b"tail\n"
    assert max(pb.JobResultsChunk(data=c).ByteSize() for c in chunks) <= 262_144
