"""A job submission's idempotency key: sent again with it (the first answer lost),
the server answers the job the first made, never a second; two sent at once make
one job; a cut-off upload keeps no key, so sending it again makes the job. In the
process (SQLite), against a real server (gRPC and HTTP), and the client's retry."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import grpc
import pytest

from batchd.client import Client, ServerUnavailable
from batchd.client.core import ClientCore, Rpc, Wait
from batchd.client.jobs import submit_job
from batchd.protos import jobs_pb2 as pb
from batchd.server.errors import InvalidInput
from batchd.server.jobs.service import JobsService
from batchd.server.jobs.sqlite import SqliteStore
from tests.conftest import run
from tests.servers import ServerProcess
from tests.test_client import FakeRpcError
from tests.test_job_parts import ONE_LINE
from tests.test_jobs_upload import CFG, EVERYONE, jobs_of, paused, validating, whole

ALICE, BOB = ("alice", False), ("bob", False)


def test_a_key_sent_again_answers_the_job_it_made(tmp_path: Path) -> None:
    service = JobsService(jobs_of(SqliteStore(tmp_path)))

    async def body() -> None:
        first = await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), "k1")
        again = await service.submit(ALICE, CFG.name, "", whole(b"not even JSON"), "k1")
        assert again.id == first.id and again.status == "queued"
        other = await service.submit(BOB, CFG.name, "", whole(ONE_LINE.encode()), "k1")
        assert other.id != first.id  # a key is its owner's
        unkeyed = [await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()))
                   for _ in range(2)]  # fmt: skip
        assert unkeyed[0].id != unkeyed[1].id
        assert len((await service.listing(EVERYONE)).jobs) == 4
        with pytest.raises(InvalidInput, match=rf"key 'k1' made job {first.id} of model 'm'"):
            await service.submit(ALICE, "other", "", whole(ONE_LINE.encode()), "k1")
        await service.cancel(ALICE, first.id)  # a key names its job whatever became of it
        again = await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), "k1")
        assert (again.id, again.status) == (first.id, "cancelled")
        with pytest.raises(InvalidInput, match="at most 256 characters, got 300"):
            await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), "x" * 300)
        # an HTTP header of bytes that are not UTF-8 (aiohttp keeps them as surrogates):
        # HTTP 500 and a traceback from the store
        bad = b"\xff\xfe".decode("utf-8", "surrogateescape")
        with pytest.raises(InvalidInput, match=r"key is UTF-8 text, got '\\udcff\\udcfe'"):
            await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), bad)
        caf = await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), "café")
        assert caf.id != first.id

    run(lambda: asyncio.wait_for(body(), 60))


def test_two_sent_at_once_make_one_job_and_a_cut_upload_keeps_no_key(tmp_path: Path) -> None:
    """The first to be queued is the job; the other answers it and keeps nothing. An
    upload cut off (its client went) keeps no key: the next with it makes the job."""
    service = JobsService(jobs_of(SqliteStore(tmp_path)))

    async def body() -> None:
        resume = asyncio.Event()
        slow = asyncio.ensure_future(
            service.submit(ALICE, CFG.name, "", paused(ONE_LINE.encode(), resume), "k")
        )
        await validating(service)
        fast = await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), "k")
        resume.set()
        assert (await slow).id == fast.id
        assert [j.id for j in (await service.listing(EVERYONE)).jobs] == [fast.id]

        cut = asyncio.ensure_future(
            service.submit(ALICE, CFG.name, "", paused(ONE_LINE.encode(), asyncio.Event()), "c")
        )
        await validating(service)
        cut.cancel()  # the connection went mid-upload
        with pytest.raises(asyncio.CancelledError):
            await cut
        made = await service.submit(ALICE, CFG.name, "", whole(ONE_LINE.encode()), "c")
        assert made.status == "queued" and len((await service.listing(EVERYONE)).jobs) == 2

    run(lambda: asyncio.wait_for(body(), 60))


def test_a_jobs_database_of_an_older_batchd_gets_the_key_column(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    db.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, model TEXT NOT NULL, "
        "version TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL, "
        "finished_at REAL NOT NULL DEFAULT 0)"  # (every batchd's had finished_at)
    )
    db.close()
    store = SqliteStore(tmp_path)
    names = {c[1] for c in store._db.execute("PRAGMA table_info(jobs)")}
    assert "submission" in names
    store.close()


def test_the_client_sends_a_keyed_submission_again_when_the_server_was_unavailable() -> None:
    """UNAVAILABLE with no pushback (a connection lost after the job was stored): keyed,
    the same submission goes again, with the same key; without a key it is not."""
    core = ClientCore(timeout=None, retries=2, call_kwargs={})
    steps = submit_job(core, "m", [{"custom_id": "a", "inputs": []}])
    first = next(steps)
    assert isinstance(first, Rpc) and first.method == "SubmitJob"
    key = next(iter(first.request)).idempotency_key
    assert len(key) == 32
    wait = steps.send(FakeRpcError(grpc.StatusCode.UNAVAILABLE, None))
    assert isinstance(wait, Wait)
    again = steps.send(None)
    assert isinstance(again, Rpc) and next(iter(again.request)).idempotency_key == key
    with pytest.raises(StopIteration) as done:
        steps.send(pb.Job(id="job-1", status="queued"))
    assert done.value.value.id == "job-1"

    unkeyed = submit_job(core, "m", [{"custom_id": "a", "inputs": []}], idempotency_key="")
    next(unkeyed)
    with pytest.raises(ServerUnavailable):
        unkeyed.send(FakeRpcError(grpc.StatusCode.UNAVAILABLE, None))


def test_a_real_server_answers_a_key_sent_again_over_grpc_and_http(
    example_server: ServerProcess,
) -> None:
    import http.client
    import json

    lines = [{"custom_id": "a", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                                            "shape": [1, 16], "data": [0.0] * 16}]}]  # fmt: skip
    with Client(example_server.url) as c:
        first = c.submit_job("tiny", lines, idempotency_key="same-upload")
        assert c.submit_job("tiny", lines, idempotency_key="same-upload").id == first.id
        assert c.submit_job("tiny", lines).id != first.id
    body = json.dumps(lines[0]).encode() + b"\n"
    ids = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", example_server.http_port, timeout=30)
        conn.request("POST", "/v2/jobs?model=tiny", body, {"Idempotency-Key": "over-http"})
        r = conn.getresponse()
        assert r.status == 201
        ids.append(json.loads(r.read())["id"])
        conn.close()
    assert ids[0] == ids[1] != first.id


def test_a_keyed_submission_s_attempts_share_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attempt had a timeout of its own: timeout=5 with three retries could take 20 s."""
    now = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    core = ClientCore(timeout=None, retries=3, call_kwargs={})
    steps = submit_job(core, "m", [{"custom_id": "a", "inputs": []}], timeout=5.0)
    first = next(steps)
    assert isinstance(first, Rpc) and first.timeout == 5.0
    now[0] += 3.0  # the attempt took 3 s, then failed
    assert isinstance(steps.send(FakeRpcError(grpc.StatusCode.UNAVAILABLE, None)), Wait)
    again = steps.send(None)
    assert isinstance(again, Rpc) and again.timeout is not None and again.timeout <= 2.0
    steps.close()
