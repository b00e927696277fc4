"""The pieces of batch jobs without a server: the job lane of the scheduler, the
lines codec (with hostile lines), the store, and a run cut short after its
last checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import shutil
import sqlite3
import stat
import struct
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.client.jobs import ResultsFile
from batchd.protos.model_config import ModelConfig
from batchd.server.batching.scheduler import Scheduler
from batchd.server.codec import DEFAULT_LIMITS, decode_request
from batchd.server.config import Limits
from batchd.server.errors import BatchdError, Unavailable
from batchd.server.jobs import chunks, ids, lines, runner
from batchd.server.jobs import service as service_module
from batchd.server.jobs import sqlite as sqlite_module
from batchd.server.jobs import store as store_module
from batchd.server.jobs.ids import check_ids
from batchd.server.jobs.run import JobRun
from batchd.server.jobs.service import JobsService
from batchd.server.jobs.sqlite import SqliteStore
from batchd.server.jobs.store import InUse, JobRow, Progress, Store
from batchd.server.request import Request, Tensor
from tests.conftest import Clock, FakeDispatch, model, ragged_model, request, run
from tests.servers import alive, children, wait_for
from tests.test_fuzz_codec import lines_run


def job_request(cfg: ModelConfig) -> Request:
    r = request(cfg)
    r.background = True
    return r


# ---- the job lane ----


def test_job_requests_wait_while_online_requests_do_and_never_share_their_batch() -> None:
    async def body() -> None:
        dispatch = FakeDispatch(idle=0, credits=0)  # the worker is busy
        s = Scheduler(dispatch, Clock())
        cfg = model(max_batch_size=4, queue=2)
        s.add_model(cfg)
        jobs = [job_request(cfg) for _ in range(6)]
        for r in jobs:
            s.submit(r)  # the job lane holds no place of max_queue_size 2
        online = [request(cfg), request(cfg)]
        for r in online:
            s.submit(r)
        assert s.pending_jobs()["m"] == 6 and s.pending()["m"] == 2
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert dispatch.sent == [online]  # the online pair first, alone
        dispatch.credits = 1  # staging room, but no idle worker: the job lane waits
        s.pump()
        assert len(dispatch.sent) == 1
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert dispatch.sent[1] == jobs[:4]  # a full batch of the job lane, in order
        assert s.pending_jobs()["m"] == 2

    run(body)


def test_a_job_never_takes_an_idle_worker_that_another_model_s_caller_waits_for() -> None:
    """The workers are shared: a job of one model got every freed worker while another
    model's online requests filled a batch for it, and they timed out for the whole
    job (the reviewer's repro_job_starves.py)."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=0, credits=0)  # the worker is busy
        s = Scheduler(dispatch, clock, patient=lambda: True)  # batches fill
        job, online = model(max_batch_size=4), replace(model(max_batch_size=4), name="other")
        s.add_model(job)  # first in turn
        s.add_model(online)
        for _ in range(3):  # three callers seen at once: one alone waits for the others
            s.submit(request(online))
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        dispatch.sent.clear()
        dispatch.idle, dispatch.credits = 1, 1  # answered: the worker is free
        caller = request(online)
        s.submit(caller)  # it fills a batch for the idle worker
        s.submit(job_request(job))
        s.pump()
        assert dispatch.sent == []  # not the job's: the idle worker is the caller's
        clock.now += 1.0  # its batch's time is up
        s.pump()
        assert dispatch.sent == [[caller]]
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert len(dispatch.sent) == 2 and dispatch.sent[1][0].background  # now the job's

    run(body)


def test_a_version_with_no_worker_left_hands_its_queue_to_the_current_one() -> None:
    """A reload, then the worker holding the old version is lost: its queued requests,
    a job's lines too, go to the new version if it takes the same requests (they were
    failed UNAVAILABLE, and a job's lines that way for good); else nothing moves."""

    async def body() -> None:
        dispatch = FakeDispatch(idle=0, credits=0)
        s = Scheduler(dispatch, Clock())
        old, new = model(max_batch_size=4), replace(model(max_batch_size=4), version="2")
        other = replace(model(max_batch_size=8), version="3")  # another batching dimension
        for cfg in (old, new, other):
            s.add_model(cfg)
        line, caller = job_request(old), request(old)
        s.submit(line)
        s.submit(caller)
        assert not s.move_queued(old.key, other)
        assert s.move_queued(old.key, new)
        assert s.queued_version(old.key, jobs=True) == 0
        assert (s.pending_jobs()["m"], s.queued_version(new.key)) == (1, 1)
        assert line.model is new and caller.model is new
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert dispatch.sent == [[caller]]  # the online one first ...
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert dispatch.sent == [[caller], [line]]  # ... then the job's, on the new version

    run(body)


def test_a_job_line_of_more_rows_than_a_batch_splits_into_the_lane() -> None:
    async def body() -> None:
        dispatch = FakeDispatch(idle=0, credits=0)
        s = Scheduler(dispatch, Clock())
        cfg = model(max_batch_size=4, queue=3)
        s.add_model(cfg)
        big = request(cfg, rows=10)
        big.background = True
        s.submit(big)
        assert (s.pending_jobs()["m"], s.pending()["m"]) == (3, 0)  # 4 + 4 + 2 rows, all lane

    run(body)


def test_a_lost_job_batch_goes_back_to_the_lane_and_an_unload_fails_the_lane() -> None:
    async def body() -> None:
        dispatch = FakeDispatch(idle=1, credits=1)
        s = Scheduler(dispatch, Clock())
        cfg = model(max_batch_size=4)
        s.add_model(cfg)
        r = job_request(cfg)
        s.submit(r)
        assert dispatch.sent == [[r]]
        s.requeue([r])  # its worker was lost
        assert s.pending_jobs()["m"] == 1 and s.pending()["m"] == 0
        s.remove_model(cfg.key)
        with pytest.raises(Unavailable, match="was unloaded"):
            await r.future

    run(body)


# ---- lines ----


def fp32_model() -> ModelConfig:
    return model(max_batch_size=4, shape=(3,))


def decoded(doc: dict[str, Any], cfg: ModelConfig) -> Request:
    return decode_request(lines.parse(doc, cfg.name, cfg.version, DEFAULT_LIMITS), cfg, 0.0)


def test_a_line_decodes_as_the_same_request_as_online() -> None:
    cfg = fp32_model()
    doc = {"custom_id": "a", "inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 3],
                                          "data": [[1, 2, 3], [4, 5.5, 6]]}]}  # fmt: skip
    r = decoded(doc, cfg)
    assert r.rows == 2 and r.outputs == ("Y",)
    assert np.frombuffer(r.inputs[0].data, "<f4").tolist() == [1, 2, 3, 4, 5.5, 6]


def test_a_line_has_no_deadline_whatever_the_model_s_default_timeout() -> None:
    """Its expiry in the job lane would be answered by nothing: the job would wait for ever."""
    cfg = fp32_model()
    cfg = dataclasses.replace(
        cfg, batching=dataclasses.replace(cfg.batching, default_timeout_us=2000)
    )
    tensor = {"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}
    raw = json.dumps({"custom_id": "a", "inputs": [tensor]}).encode()
    line = chunks.decode(raw, 1, cfg, Limits())
    assert line.request is not None and line.request.background
    assert line.request.deadline == math.inf and not line.request.queue_timeout
    assert decoded(json.loads(raw), cfg).queue_timeout  # online, the same request has one


def test_a_line_whose_answer_would_not_fit_a_response_runs_its_results_go_to_a_file() -> None:
    """The refusal, before the model runs, of a request whose fixed outputs would be
    larger than a response may carry (--max-message-bytes) took job lines too, whose
    results go to a file: lines that completed before now ended as error lines."""
    cfg = fp32_model()  # Y: 3 FP32 a row
    small = Limits(max_response_bytes=20)
    jobs = runner.Jobs(None, None, small, max_file_bytes=1, max_open=1,  # type: ignore[arg-type]
                       retention_s=1.0, min_upload_rate=0, upload_grace_s=0.0)  # fmt: skip
    tensor = {"name": "X", "datatype": "FP32", "shape": [4, 3], "data": [0.0] * 12}
    raw = json.dumps({"custom_id": "a", "inputs": [tensor]}).encode()
    assert chunks.decode(raw, 1, cfg, small).error is not None  # (as online)
    line = chunks.decode(raw, 1, cfg, jobs._limits)
    assert line.error is None and line.request is not None and line.request.rows == 4


@pytest.mark.parametrize(
    ("datatype", "data", "expected"),
    [
        ("INT64", [1, -2], np.array([1, -2], "<i8").tobytes()),
        ("BOOL", [True, False], b"\x01\x00"),
        ("FP16", [0.5, 2], np.array([0.5, 2], "<f2").tobytes()),
        ("BF16", [1.0, -2.0], np.array([0x3F80, 0xC000], "<u2").tobytes()),
        ("BYTES", ["ab", ""], struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)),
        # an int past int64 beside a float (as Python's json, which reads NaN, gives
        # them) was refused, as "holds numbers only"
        ("FP32", [1.5, 2**70], np.array([1.5, 2**70], "<f4").tobytes()),
    ],
)
def test_each_datatype_becomes_its_raw_form(
    datatype: str, data: list[Any], expected: bytes
) -> None:
    doc = {
        "custom_id": "a",
        "inputs": [{"name": "X", "datatype": datatype, "shape": [2], "data": data}],
    }
    assert lines.parse(doc, "m", "", DEFAULT_LIMITS).raw_input_contents[0] == expected


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT32", [1.5, 2], r"INT32 data holds integers only, got 1.5 \(not an integer\)"),
        ("INT64", [1, math.nan], r"INT64 data holds integers only, got nan \(not an integer\)"),
        ("INT64", [True, 1], "INT64 data holds integers only, got a boolean"),
        ("BOOL", [2, 0], "BOOL data holds true and false only"),
        ("FP32", ["1", "2"], "FP32 data holds numbers only, got a string"),
        ("FP32", [None, 2], "FP32 data holds numbers only, got null"),
        ("FP32", [1.5, 10**400], "FP32 data holds numbers only, got an integer past any float"),
        ("BYTES", [1, 2], "BYTES data holds strings, got a number"),
        ("FP32", [1.0], "needs 2 values, 'data' holds 1"),
        ("FP33", [1.0, 2.0], "unknown datatype 'FP33'"),
    ],
)
def test_bad_data_is_named(datatype: str, data: list[Any], message: str) -> None:
    doc = {
        "custom_id": "a",
        "inputs": [{"name": "X", "datatype": datatype, "shape": [2], "data": data}],
    }
    with pytest.raises(ValueError, match=message):
        lines.parse(doc, "m", "", DEFAULT_LIMITS)


def test_outputs_are_written_as_v2_json() -> None:
    f = Tensor("Y", "FP32", (1, 2), np.array([0.1, 2], "<f4").tobytes())
    raw = struct.pack("<I", 2) + b"\xff\xfe"
    b = Tensor("T", "BYTES", (1, 1), raw)
    out = json.loads(lines.encode_outputs("x", [f, b]))
    assert out["outputs"][0] == {
        "name": "Y",
        "datatype": "FP32",
        "shape": [1, 2],
        "data": [0.1, 2.0],
    }
    assert out["outputs"][1]["data"] == ["//4="] and out["outputs"][1]["parameters"] == {
        "content_type": "base64"
    }
    err = json.loads(lines.encode_error(None, "INVALID_ARGUMENT", "no", 7))
    assert err == {
        "custom_id": None,
        "error": {"code": "INVALID_ARGUMENT", "message": "no"},
        "line": 7,
    }


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
tensors = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["X", "Z", ""]) | json_values,
        "datatype": st.sampled_from(["FP32", "INT8", "BYTES", "BOOL", "BF16"]) | json_values,
        "shape": st.lists(st.integers(-2, 4), max_size=3) | json_values,
        "data": st.lists(json_values, max_size=8) | json_values,
    },
)
hostile_lines = st.fixed_dictionaries(
    {"custom_id": st.text(min_size=1, max_size=8)},
    optional={"inputs": st.lists(tensors, max_size=3) | json_values, "outputs": json_values,
              "parameters": json_values},
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(hostile_lines)
def test_a_hostile_line_is_refused_with_a_reason_never_a_crash(doc: dict[str, Any]) -> None:
    cfg = fp32_model()
    raw = json.dumps(doc).encode()
    try:
        decoded(lines.load(raw), cfg)
    except ValueError as e:
        assert str(e)
    except BatchdError as e:
        assert e.message


# ---- the store ----


def test_a_job_s_folder_is_removed_off_the_event_loop_and_a_stop_s_leftovers_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing a job (expiry, --jobs-max-kept, a failed upload) removed its folder on the
    event loop: a 1 GiB input took 0.26 s, four jobs' expiry held every call 0.65 s. The
    folder is renamed aside at once, removed on a thread; one a stop left aside goes at
    the next start."""
    on_loop_thread: list[bool] = []
    rmtree = shutil.rmtree

    def recorded(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).parent == tmp_path:  # (not another test's, in this process)
            on_loop_thread.append(threading.current_thread() is threading.main_thread())
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", recorded)
    (tmp_path / ".discarded-job-left-0000").mkdir()  # a stop came as it was removed
    (tmp_path / ".discarded-job-left-0000" / "input.jsonl").write_bytes(b"x" * 1000)
    store = SqliteStore(tmp_path)

    async def body() -> None:
        job = await store.create("", "m", "")
        store.upload_path(job.id).write_bytes(b"{}\n" * 1000)
        await store.delete(job.id)
        assert not store.folder(job.id).exists() and await store.get(job.id) is None
        await store.recover()

    run(body)
    store.close()
    wait_for(lambda: not store_module._removing, 30, "the removals")
    assert on_loop_thread == [False, False]
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(("jobs.", "lock"))] == []
    assert not aside_left(tmp_path)


def test_the_store_claims_checkpoints_recovers_and_expires(tmp_path: Path) -> None:
    clock = [1000.0]
    store = SqliteStore(tmp_path, clock=lambda: clock[0])
    with pytest.raises(InUse, match="in use by another batchd"):
        SqliteStore(tmp_path)

    async def body() -> None:
        a = await store.create("", "m", "")
        store.upload_path(a.id).write_bytes(b"x" * 100)
        await store.queue(a.id, total=10, input_bytes=100)
        b = await store.create("", "m", "")  # an upload the crash cut short
        running = await store.claim()
        assert running is not None and running.id == a.id and running.started_at == 1000.0
        assert await store.claim(exclude_models=frozenset({"m"})) is None
        results = store.open_results(running)
        results.write(b"x" * 90)
        status = await store.checkpoint(running, results, Progress(40, 4, 3, 1))
        results.close()
        assert status == "running"
        assert await store.recover() == [b.id]  # a crash: a runs on from its checkpoint
        row = await store.get(a.id)
        assert row is not None and (row.status, row.input_offset, row.done) == ("queued", 40, 4)
        assert row.results_bytes == 90
        assert await store.get(b.id) is None and not store.folder(b.id).exists()
        await store.cancel(a.id)
        assert (await store.get(a.id)).status == "cancelled"  # type: ignore[union-attr]
        clock[0] += 3600
        assert await store.expire(retention_s=7200) == []
        clock[0] += 3601
        assert await store.expire(retention_s=7200) == [a.id]

    run(body)
    store.close()
    SqliteStore(tmp_path).close()  # the lock went with the store


async def keeps_each_owner_s_newest_ended_jobs(store: Store, clock: list[float]) -> None:
    """--jobs-max-kept: one caller's tiny jobs were kept until their retention (7 days),
    68 times the bytes it sent, 12 kB a job: 500 in 159 s (state review)."""
    ended: dict[str, list[str]] = {"a": [], "b": []}
    for owner, n in (("a", 5), ("b", 2)):
        for _ in range(n):
            row = await store.create(owner, "m", "")
            store.upload_path(row.id).write_bytes(b"\n")
            await store.queue(row.id, total=1, input_bytes=1)
            claimed = await store.claim()
            assert claimed is not None and claimed.id == row.id
            clock[0] += 1
            await store.finish(claimed, "completed")
            ended[owner].append(row.id)
    open_one = await store.create("a", "m", "")  # not ended: never counted nor removed
    assert sorted(await store.trim("a", 3)) == sorted(ended["a"][:2])  # the oldest two
    assert {r.id for r in await store.select("a")} == {*ended["a"][2:], open_one.id}
    assert await store.trim("b", 3) == [] and await store.trim("a", 3) == []
    assert {r.id for r in await store.select("b")} == set(ended["b"])
    assert await store.expire(retention_s=1e9) == []  # (a start's expiry keeps them all)


def test_the_sqlite_store_keeps_each_owner_s_newest_ended_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    store = SqliteStore(tmp_path, clock=lambda: clock[0])
    try:
        run(lambda: keeps_each_owner_s_newest_ended_jobs(store, clock))
        # a lowered cap is reached over several submissions, TRIM_MOST a time: the expiry
        # query of every ended job once a minute, and 40,000 removals at once, held the
        # loop 0.7 s and 8 s (late review)
        monkeypatch.setattr(sqlite_module, "TRIM_MOST", 2)
        kept = [r.id for r in run(lambda: store.select("a")) if r.ended]
        assert len(run(lambda: store.trim("a", 0))) == 2
        assert len([r for r in run(lambda: store.select("a")) if r.ended]) == len(kept) - 2
        monkeypatch.setattr(sqlite_module, "EXPIRE_MOST", 1)  # and expiry, EXPIRE_MOST a run
        assert len(run(lambda: store.expire(retention_s=0))) == 1
        assert len(run(lambda: store.expire(retention_s=0))) == 1
    finally:
        store.close()


def test_a_job_s_files_are_the_server_user_s_alone(tmp_path: Path) -> None:
    """A job's folder (its input, its results) and a jobs directory batchd makes are 0700:
    they were 0755 and their files 0644, so any local user read every job's tensors."""
    old = os.umask(0o022)
    try:
        store = SqliteStore(tmp_path / "state" / "jobs")
        job = run(lambda: store.create("", "m", ""))
    finally:
        os.umask(old)
    try:
        assert (tmp_path / "state" / "jobs").stat().st_mode & 0o777 == 0o700
        assert store.folder(job.id).stat().st_mode & 0o777 == 0o700
    finally:
        store.close()


def test_a_job_deleted_by_a_process_that_ends_midway_leaves_no_folder_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row went first: a process ended before the folder went left a folder that no
    row named, never removed (an upload's input, up to --jobs-max-file-bytes). Now the
    folder is renamed aside first, then the row goes, then the folder is removed (on a
    thread): a process that ends before that leaves it aside, and the next start
    removes it."""
    store = SqliteStore(tmp_path)

    def ended(*args: Any, **kwargs: Any) -> None:
        pass  # the process ended before it removed anything

    async def body() -> None:
        cut = await store.create("", "m", "")  # an upload a crash cut short
        store.upload_path(cut.id).write_bytes(b"{}\n")
        monkeypatch.setattr(shutil, "rmtree", ended)
        assert await store.recover() == [cut.id]
        wait_for(lambda: not store_module._removing, 30, "the removal")  # (that removed none)
        monkeypatch.undo()
        assert not store.folder(cut.id).exists() and await store.get(cut.id) is None
        assert len(aside_left(tmp_path)) == 1  # left there
        assert await store.recover() == []  # (the next start's)
        assert not store.folder(cut.id).exists()

    run(body)
    store.close()
    wait_for(lambda: not store_module._removing, 30, "the removals")
    assert not aside_left(tmp_path)


def aside_left(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(".discarded-")]


# ---- a run cut short ----


class FakeCore:
    def __init__(self, cfg: ModelConfig) -> None:
        self.models: Mapping[str, ModelConfig] = {cfg.name: cfg}

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        f: asyncio.Future[list[Tensor]] = asyncio.get_running_loop().create_future()
        x = np.frombuffer(request.inputs[0].data, "<f4")
        f.set_result([Tensor("Y", "FP32", request.inputs[0].shape, (2 * x).tobytes())])
        return f

    def model_ready(self, name: str) -> bool:
        return name in self.models


def test_a_run_resumed_after_a_crash_answers_each_line_once(tmp_path: Path) -> None:
    """The crash left results written after the last checkpoint: they are cut off and
    those lines answered again, once."""
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    row = run(lambda: store.create("", cfg.name, ""))
    text = "".join(
        json.dumps({"custom_id": f"c{i}", "inputs": [{"name": "X", "datatype": "FP32",
                    "shape": [1, 1], "data": [i]}]}) + "\n"
        for i in range(1000)
    )  # fmt: skip
    store.upload_path(row.id).write_text(text)
    run(lambda: store.queue(row.id, 1000, len(text)))
    first_ten = text.splitlines(keepends=True)[:10]
    done = "".join(
        lines.encode_outputs(
            f"c{i}", [Tensor("Y", "FP32", (1, 1), np.float32([2 * i]).tobytes())]
        ).decode()
        for i in range(10)
    )
    store.results_path(row.id).write_text(done + '{"custom_id":"c10","outputs":[]}\n{"cust')
    offset = sum(len(x) for x in first_ten)
    claimed = run(store.claim)
    assert claimed is not None
    store._save(row.id, len(done), Progress(offset, 10, 10, 0))  # a checkpoint, then the crash
    claimed = dataclasses.replace(claimed, input_offset=offset, lines_read=10,
                                  results_bytes=len(done), completed=10)  # fmt: skip
    counted: list[tuple[str, int, int]] = []

    async def body() -> None:
        await JobRun(claimed, store, FakeCore(cfg), Limits(), lambda *a: counted.append(a)).run()

    run(body)
    got = [json.loads(x) for x in store.results_path(row.id).read_text().splitlines()]
    assert [r["custom_id"] for r in got] == [f"c{i}" for i in range(1000)]
    assert all(r["outputs"][0]["data"] == [2.0 * i] for i, r in enumerate(got))
    final = run(lambda: store.get(row.id))
    assert final is not None and (final.status, final.completed, final.failed) == (
        "completed",
        1000,
        0,
    )
    assert sum(c[1] for c in counted) == 990  # the ten answered before are not counted again
    assert chunks.CHUNK_LINES < 990  # several chunks ran
    assert not math.isnan(final.finished_at)


def test_a_line_over_the_limit_is_skipped_in_bounded_pieces() -> None:
    f = io.BytesIO(b"x" * 10 + b"\nok\n" + b"y" * 9)
    assert lines.read_line(f, limit=4) == (b"xxxx", 11, True)
    assert lines.read_line(f, limit=4) == (b"ok\n", 3, False)
    assert lines.read_line(f, limit=4) == (b"yyyy", 9, True)  # the last line has no newline
    assert lines.read_line(f, limit=4) == (b"", 0, False)


def test_a_duplicate_repeated_on_every_line_is_named_briefly(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join('{"custom_id": "same"}\n' for _ in range(10_000)) + '{"custom_id": "x"}\n'
    )
    with pytest.raises(BatchdError) as refused:
        check_ids(path, tmp_path / "ids.sqlite")
    assert refused.value.message == (
        "duplicate custom_id: 'same' on lines 1, 2, 3, 4, ... (10000 lines); each must be unique"
    )


def test_the_ids_are_checked_in_a_child_process_that_a_cancel_kills(tmp_path: Path) -> None:
    """On a thread of the frontend, the check of a few million-line uploads took the
    GIL from the event loop (online calls waited up to 1 s), parsed each line beside
    its memory, and held its exit until it ended."""
    good, twice = tmp_path / "good.jsonl", tmp_path / "twice.jsonl"
    good.write_text('{"custom_id": "a"}\n\n{"custom_id": "b"}\nnot json\n')
    twice.write_text('{"custom_id": "a"}\n{"custom_id": "a"}\n')
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        f.writelines(f'{{"custom_id": "r{i}"}}\n' for i in range(2_000_000))

    def checks() -> list[int]:
        def command(pid: int) -> bytes:
            with contextlib.suppress(OSError):
                return Path(f"/proc/{pid}/cmdline").read_bytes()
            return b""

        return [p for p in children(os.getpid()) if b"batchd.server.jobs.ids" in command(p)]

    async def body() -> None:
        assert await ids.checked(good, tmp_path / "1.sqlite") == 3  # (not JSON: an error line)
        with pytest.raises(BatchdError, match="duplicate custom_id: 'a' on lines 1, 2"):
            await ids.checked(twice, tmp_path / "2.sqlite")
        task = asyncio.create_task(ids.checked(big, tmp_path / "3.sqlite"))
        await asyncio.to_thread(wait_for, checks, 60, "the check's process")
        (child,) = checks()
        assert os.getsid(child) == child  # a group's SIGTERM (systemd, Ctrl-C) is not its
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not alive(child)

    asyncio.run(asyncio.wait_for(body(), 120))


def test_the_ids_check_leaves_once_its_asker_is_gone_whatever_the_lines_hold(
    tmp_path: Path,
) -> None:
    """It asked every 10,000 ids collected: a file of lines that hold none (not JSON)
    never asked, and its child outlived a killed server by minutes."""
    path = tmp_path / "junk.jsonl"
    path.write_bytes(b"x\n" * 30_000)
    with pytest.raises(SystemExit):
        check_ids(path, tmp_path / "ids.sqlite", alive=lambda: False)
    assert check_ids(path, tmp_path / "ids2.sqlite") == 30_000


def test_a_line_with_nan_or_infinity_is_read_as_on_http() -> None:
    """Python's json.dumps writes them (and results hold them): the line was 'not JSON',
    an error line with its custom_id lost, while HTTP infer took the same request."""
    doc = {"custom_id": "n", "inputs": [{"name": "X", "datatype": "FP32", "shape": [3],
                                         "data": [math.nan, math.inf, -math.inf]}]}  # fmt: skip
    raw = lines.parse(
        lines.load(json.dumps(doc).encode()), "m", "", DEFAULT_LIMITS
    ).raw_input_contents[0]
    assert np.frombuffer(raw, "<f4").tolist()[1:] == [math.inf, -math.inf]
    with pytest.raises(ValueError, match="a string holds a lone UTF-16 surrogate"):
        lines.load(b'{"custom_id": "\\ud800", "x": NaN}')
    # NaN nested past Python's json's depth: orjson's message pointed at the NaN. That
    # depth is 1,000 levels on 3.11 and 8,000 on 3.12 (2,000 parsed there): 100,000 is past both.
    n = 100_000
    deep = b'{"custom_id": "d", "data": ' + b"[" * n + b"NaN" + b"]" * n + b"}"
    for line in (deep, b"[" * n + b"NaN"):
        with pytest.raises(ValueError, match=r"holds NaN or Infinity, .* nests deeper than"):
            lines.load(line)
    with pytest.raises(ValueError, match="not JSON"):
        lines.load(b"[" * 5_000 + b"nan")


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"[1]", "a line must be a JSON object, got a list"),
        (b'{"custom_id": null}', 'a line needs "custom_id", a non-empty string, got null'),
        (b'{"custom_id": 5}', "got a number"),
        (b'{"x": 1}', "got none"),
        (b'{"custom_id": ""}', 'got ""'),
    ],
)
def test_a_line_with_no_custom_id_says_what_came(line: bytes, said: str) -> None:
    """In JSON's words: it said Python's type names (list, NoneType), or nothing."""
    with pytest.raises(ValueError) as e:
        lines.custom_id_of(lines.load(line))
    assert str(e.value).endswith(said)


ONE_LINE = json.dumps({"custom_id": "a", "inputs": [{"name": "X", "datatype": "FP32",
                      "shape": [1, 1], "data": [3]}]}) + "\n"  # fmt: skip


async def queued_one_line(store: SqliteStore, cfg: ModelConfig) -> Any:
    """A job of one line, uploaded and queued in `store`."""
    row = await store.create("", cfg.name, "")
    store.upload_path(row.id).write_text(ONE_LINE)
    await store.queue(row.id, 1, len(ONE_LINE))
    return row


def jobs_of(store: SqliteStore, cfg: ModelConfig, runs: bool = True) -> runner.Jobs:
    return runner.Jobs(store, FakeCore(cfg), Limits(), max_file_bytes=1 << 20, max_open=4,
                       retention_s=3600.0, min_upload_rate=0, upload_grace_s=0.0,
                       runs=runs)  # fmt: skip


class FailingStore(SqliteStore):
    """A jobs store whose database is down at the start, whose disk is then full for a
    claim, and (with `finish_fails`) full again when a job ends."""

    def __init__(self, directory: Path, finish_fails: bool = False) -> None:
        super().__init__(directory)
        self.failures = ["recover", "claim"]
        self.claims = 0
        self.finish_fails = finish_fails

    async def recover(self) -> list[str]:
        if "recover" in self.failures:
            self.failures.remove("recover")
            raise Unavailable("the jobs database is down")
        return await super().recover()

    async def claim(self, exclude_models: frozenset[str] = frozenset(),
                    only: Mapping[str, str] | None = None) -> Any:  # fmt: skip
        self.claims += 1
        if "claim" in self.failures:
            self.failures.remove("claim")
            raise sqlite3.OperationalError("database or disk is full")
        return await super().claim(exclude_models, only)

    async def finish(self, row: Any, status: str, error: str = "") -> None:
        if self.finish_fails:
            raise sqlite3.OperationalError("database or disk is full")
        await super().finish(row, status, error)


def test_a_jobs_store_that_fails_leaves_the_runner_and_the_server_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database down at the start, then a full disk: the runner waits, and takes the
    queued job once the store answers. Its error never ends the server's task group."""
    monkeypatch.setattr(runner, "POLL_S", 0.001)
    cfg = model(max_batch_size=4, shape=(1,))
    store = FailingStore(tmp_path)
    row = run(lambda: queued_one_line(store, cfg))
    jobs = jobs_of(store, cfg)

    async def body() -> None:
        task = asyncio.create_task(jobs.run())
        while (got := await store.get(row.id)) is None or got.status != "completed":
            assert not task.done(), task  # the store's errors did not end the runner
            await asyncio.sleep(0)  # (a scheduling point, not a wait for time)
        await jobs.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(lambda: asyncio.wait_for(body(), 30))
    assert store.failures == []


def test_a_job_whose_end_cannot_be_written_is_logged_not_raised_and_queued_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not left `running` with nothing running it till the next start (review 56b)."""
    cfg = model(max_batch_size=4, shape=(1,))
    store = FailingStore(tmp_path, finish_fails=True)
    row = run(lambda: queued_one_line(store, cfg))
    claimed = run(lambda: SqliteStore.claim(store))
    assert claimed is not None
    run(lambda: JobRun(claimed, store, FakeCore(cfg), Limits(), lambda *a: None).run())
    assert "its end (completed) could not be recorded (OperationalError" in caplog.text
    assert run(lambda: store.get(row.id)).status == "queued"


def test_an_upload_whose_frontend_died_is_removed_once_its_lease_runs_out(
    tmp_path: Path,
) -> None:
    """--frontends N: frontend 1 SIGKILLed mid-upload left its job validating till the
    server restarted, holding a --jobs-max-open place and its partial file (review 56j).
    An upload's frontend renews its lease each second; frontend 0's expiry removes one
    not renewed for UPLOAD_LEASE_S."""
    clock, wall = [1000.0], [1e9]
    store = SqliteStore(tmp_path, clock=lambda: wall[0])
    store.lease_clock = lambda: clock[0]  # type: ignore[method-assign]

    async def body() -> None:
        row = await store.create("", "m", "")
        store.upload_path(row.id).write_bytes(b"x" * 100)  # what came before the kill
        clock[0] += 20
        assert await store.uploading(row.id) == "validating"  # renewed: 30 s from now
        clock[0] += 20
        wall[0] += 3600  # the wall clock stepped (NTP): no lease runs out for it (review 56k)
        assert await store.expire(3600 * 24) == [] and await store.get(row.id) is not None
        clock[0] += sqlite_module.UPLOAD_LEASE_S  # no renewal since: its frontend is gone
        assert await store.expire(3600 * 24) == [row.id] and await store.get(row.id) is None

    run(body)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("job-")]  # (set aside)


def test_a_file_system_that_cannot_fsync_a_folder_still_runs_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL from a folder's fsync (some file systems): the results file's folder, at its
    first sync, raised it, and every job failed (review 56e)."""
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    row = run(lambda: queued_one_line(store, cfg))
    claimed = run(lambda: store.claim())
    run(lambda: JobRun(claimed, store, FakeCore(cfg), Limits(), lambda *a: None).run())
    assert run(lambda: store.get(row.id)).status == "completed"


def test_a_job_told_queued_and_a_checkpoint_shown_are_on_disk_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss took back neither: the input and its folders were never fsynced, and
    commits were synchronous=NORMAL (review 56b): a job answered `queued` could come back
    short, or be removed as an upload cut short. The WAL is fsynced after both commits."""
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    real, synced = os.fsync, []

    def fsync(fd: int) -> None:
        with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite")) as db:  # (a thread)
            status = db.execute("SELECT status FROM jobs").fetchone()
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, status[0]))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    row = run(lambda: queued_one_line(store, cfg))
    run(store.settle)  # (the submission's, before it is answered: JobsService.submit)
    assert synced == [("input.jsonl", "validating"), (row.id, "validating"),
                      (tmp_path.name, "validating"), ("jobs.sqlite-wal", "queued")]  # fmt: skip
    claimed = run(lambda: store.claim())
    synced.clear()
    results = store.open_results(claimed)
    for _ in range(2):  # the folder that names the results file, at its first sync
        run(lambda: store.checkpoint(claimed, results, Progress(1, 1, 1, 0)))
    results.close()
    assert [name for name, _ in synced] == [
        "results.jsonl", row.id, "jobs.sqlite-wal", "results.jsonl", "jobs.sqlite-wal",
    ]  # fmt: skip


def ended(store: SqliteStore, row: JobRow, jobs: runner.Jobs) -> JobRow:
    """`row` once it ended, `jobs` running it (and stopped after)."""

    async def body() -> JobRow:
        task = asyncio.create_task(jobs.run())
        while (got := await store.get(row.id)) is None or got.status not in store_module.ENDED:
            assert not task.done(), task
            await asyncio.sleep(0)  # (a scheduling point, not a wait for time)
        await jobs.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return got

    return run(lambda: asyncio.wait_for(body(), 30))  # type: ignore[no-any-return]


@pytest.mark.parametrize("fails", ["write", "torn", "sync", "read", "open"])
def test_a_full_disk_stops_a_job_where_it_was_checkpointed_and_it_runs_on_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fails: str
) -> None:
    """This server's storage failing (ENOSPC writing or syncing results, EIO reading the
    input) is not the job's fault: it failed for good, every line lost to its caller
    (review 56b). It is queued again, from its last checkpoint, after a rest."""
    monkeypatch.setattr(runner, "POLL_S", 0.001)
    monkeypatch.setattr(runner, "REST_S", 0.001)
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    row = run(lambda: queued_one_line(store, cfg))
    files = sqlite_module._ResultsFile
    where = {"write": (files, "write"), "torn": (files, "write"), "sync": (files, "sync"),
             "read": (chunks.Reader, "read"), "open": (files, "__init__")}[fails]  # fmt: skip
    real, full = getattr(*where), [1]

    def failing(self: Any, *args: Any) -> Any:
        if full[0]:
            full[0] -= 1
            if fails == "torn":  # half of it written, then the disk was full (review 56c)
                real(self, args[0][: len(args[0]) // 2])
                self.file.flush()
            raise OSError(errno.EIO if fails == "read" else errno.ENOSPC, "no room")
        return real(self, *args)

    monkeypatch.setattr(*where, failing)
    done = ended(store, row, jobs_of(store, cfg))
    assert full == [0] and (done.status, done.error, done.completed, done.failed) == (
        "completed", "", 1, 0,
    )  # fmt: skip
    assert [json.loads(x)["custom_id"] for x in store.results_path(row.id).read_text().split()] == [
        "a"
    ]
    assert "stopped by this server's storage (OSError" in caplog.text


def test_a_stalled_job_says_why_in_its_status_till_it_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued again after a full disk, its status said nothing: a job that waits out rests
    of up to 5 min looked merely queued (the log alone told why)."""
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    row = run(lambda: queued_one_line(store, cfg))

    def full(self: Any, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(sqlite_module._ResultsFile, "write", full)
        go = JobRun(run(lambda: store.claim()), store, FakeCore(cfg), Limits(), lambda *a: None)
        run(go.run)
    back = run(lambda: store.get(row.id))
    assert back is not None and back.status == "queued" and go.requeued
    assert back.error == (
        "stopped by this server's storage (OSError: [Errno 28] No space left on device); "
        "queued again, it runs on from its last checkpoint"
    )
    again = run(lambda: store.claim())
    assert again is not None and (again.status, again.error) == ("running", "")
    # cancelled while queued so, it says nothing of running on (review 57e)
    other = run(lambda: queued_one_line(store, cfg))
    claimed = run(lambda: store.claim())
    assert claimed is not None and claimed.id == other.id
    run(lambda: store.requeue(claimed, "stopped"))
    run(lambda: store.cancel(other.id))
    gone = run(lambda: store.get(other.id))
    assert gone is not None and (gone.status, gone.error) == ("cancelled", "")


def test_a_run_whose_job_was_removed_stops_at_its_next_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its row deleted under it (its submitter gone): it ran to the end, its model's job
    slot held, writing into a folder removed (review 56c)."""
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    row = run(lambda: queued_one_line(store, cfg))
    claimed = run(lambda: store.claim())
    store._db.execute("DELETE FROM jobs WHERE id = ?", (row.id,))
    run(JobRun(claimed, store, FakeCore(cfg), Limits(), lambda *a: None).run)
    assert f"job {row.id} was removed; nothing more of it runs" in caplog.text
    assert "completed" not in caplog.text


def test_a_job_whose_own_file_is_past_a_limit_fails_not_queued_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EFBIG (its results past the file size limit) is the job's, not the disk's: it ran
    again from its checkpoint for ever, failing each time (review 56c)."""
    monkeypatch.setattr(runner, "POLL_S", 0.001)
    monkeypatch.setattr(runner, "REST_S", 0.001)
    cfg = model(max_batch_size=4, shape=(1,))
    store = SqliteStore(tmp_path)
    row = run(lambda: queued_one_line(store, cfg))

    def too_big(self: Any, data: bytes) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(sqlite_module._ResultsFile, "write", too_big)
    done = ended(store, row, jobs_of(store, cfg))
    assert (done.status, done.error) == ("failed", "OSError: [Errno 27] File too large")


def test_a_stalled_job_the_store_cannot_queue_again_is_queued_once_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its end not written, and the database still full as it is queued again: the runner
    tries again after its rest (it stayed `running` with nothing running it)."""
    monkeypatch.setattr(runner, "POLL_S", 0.001)
    monkeypatch.setattr(runner, "REST_S", 0.001)
    cfg = model(max_batch_size=4, shape=(1,))
    fails = {"finish": 1, "requeue": 2}

    class Full(SqliteStore):
        async def finish(self, row: Any, status: str, error: str = "") -> None:
            await self._full("finish")
            await super().finish(row, status, error)

        async def requeue(self, row: JobRow, why: str) -> None:
            await self._full("requeue")
            await super().requeue(row, why)

        async def _full(self, call: str) -> None:
            if fails[call]:
                fails[call] -= 1
                raise sqlite3.OperationalError("database or disk is full")

    store = Full(tmp_path)
    row = run(lambda: queued_one_line(store, cfg))
    done = ended(store, row, jobs_of(store, cfg))
    assert fails == {"finish": 0, "requeue": 0}
    assert (done.status, done.completed, done.failed) == ("completed", 1, 0)


def test_taking_a_job_batch_does_not_walk_the_lane() -> None:
    """A line of many rows splits into many batches in the lane: each batch taken
    costs its own work, not the lane's (a walk would run thousands of lines)."""

    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
        cfg = model(max_batch_size=4, queue=16)
        s.add_model(cfg)
        for _ in range(5_000):
            s.submit(job_request(cfg))
        q = s._queues[cfg.key]
        plan = q.plan_jobs(0.0)
        assert plan is not None and len(plan.requests) == 4
        work, _ = lines_run(lambda: q.take_jobs(plan))
        assert work < 200, work
        assert len(q.jobs) == 4_996

    run(body)


def test_a_version_s_live_job_lane_counts_as_queued_for_its_retirement() -> None:
    """A reload retires the old version once nothing of it is queued: the running job's
    chunks in its lane count (before, they were failed UNAVAILABLE by the removal)."""

    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
        cfg = model(max_batch_size=4)
        s.add_model(cfg)
        lane = [job_request(cfg) for _ in range(3)]
        for r in lane:
            s.submit(r)
        assert s.queued_version(cfg.key) == 0  # online
        assert s.queued_version(cfg.key, jobs=True) == 3
        lane[0].future.cancel()  # a cancelled job's entry is not waited for
        assert s.queued_version(cfg.key, jobs=True) == 2

    run(body)


def test_a_blank_line_over_the_limit_counts_as_the_line_it_is_answered_as(
    tmp_path: Path,
) -> None:
    """The runner answers a line over the limit with an error line, blank or not: the
    job's total counts it too, so progress never passes 100%."""
    path = tmp_path / "in.jsonl"
    good = {"custom_id": "a", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3],
                                           "data": [1, 2, 3]}]}  # fmt: skip
    path.write_bytes(b" " * (lines.MAX_LINE_BYTES + 1) + b"\n" + json.dumps(good).encode() + b"\n")
    total = check_ids(path, tmp_path / "ids.sqlite")
    reader = chunks.Reader(path, 0, 0)
    read: list[chunks.Line] = []
    try:
        while not reader.eof:
            read += reader.read(fp32_model(), Limits()).lines
    finally:
        reader.close()
    assert total == len(read) == 2
    assert read[0].error is not None and read[1].request is not None


def test_reading_and_encoding_a_chunk_give_the_gil_up_as_they_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a thread, a chunk's lines are parsed and its results encoded between the event
    loop's system calls: each time the loop gave the GIL up it waited for the switch
    interval (5 ms) to get it back. They give it up every YIELD_S of work (0 here:
    after every line)."""
    good = {"custom_id": "a", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3],
                                           "data": [1, 2, 3]}]}  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(json.dumps({**good, "custom_id": f"c{k}"}).encode() + b"\n"
                              for k in range(10)))  # fmt: skip
    yields: list[float] = []
    monkeypatch.setattr(chunks, "YIELD_S", -1.0)
    monkeypatch.setattr(chunks.time, "sleep", yields.append)
    reader = chunks.Reader(path, 0, 0)
    try:
        chunk = reader.read(fp32_model(), Limits())
    finally:
        reader.close()
    assert len(chunk.lines) == 10 and yields == [0] * 10
    chunks.encode(chunk.lines, [lines.LineError(f"c{k}", "no") for k in range(10)])
    assert yields == [0] * 20


def test_a_running_job_s_rate_is_its_checkpoints_and_its_eta_counts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A status counts what the last checkpoint made durable; its rate is timed to that
    checkpoint, and its ETA counts down from it. (Timed to now, the rate fell between
    checkpoints and the ETA climbed while the job went on: 5.2, 6.4, 7.7, 8.9 s.) Past
    by OVERDUE_S (a stall), the ETA is not known, not 0 for as long as it stalls."""
    now = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])
    run = JobRun.__new__(JobRun)
    run._started, run._start_done = 990.0, 0
    run._saved, run._saved_at = Progress(0, 100, 90, 10), 1000.0
    assert run.pace(400) == (10.0, 40.0)
    now[0] += 2.0  # no checkpoint since
    assert run.pace(400) == (10.0, 38.0)
    now[0] += 39.0  # stalled: overdue by 1 s, then by 3
    assert run.pace(400) == (10.0, 0.0)
    now[0] += 2.0
    assert run.pace(400) == (10.0, -1.0) and run.pace(0) == (10.0, 0.0)
    run._saved_at = -math.inf  # none yet
    assert run.pace(400) == (0.0, -1.0)


def test_an_ended_job_whose_runner_lingers_reads_no_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between a job's end being written and its runner's removal, a status read the
    runner's rate (a failed job shown running at 10 lines a second)."""
    now = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])
    run = JobRun.__new__(JobRun)
    run._started, run._start_done = 990.0, 0
    run._saved, run._saved_at = Progress(0, 100, 90, 10), 1000.0
    row = JobRow("j", "", "m", "1", "failed", 500, 90, 10, *(0.0,) * 3, "gone", 0, 0, 0, 100,
                 0.0, 0)  # fmt: skip
    service = JobsService.__new__(JobsService)
    monkeypatch.setattr(service, "_on", lambda: SimpleNamespace(running={"j": run}))
    job = service._message(row)
    assert (job.rows_per_second, job.eta_seconds) == (0.0, 0.0)
    running = service._message(dataclasses.replace(row, status="running"))
    assert (running.rows_per_second, running.eta_seconds) == (10.0, 40.0)


def test_another_frontend_s_job_reads_its_rate_timed_to_its_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job run by another frontend or replica is read from its row: its rate is timed to
    its last checkpoint (checkpointed_at) and its ETA counts down from it, as for a job
    run here. (Timed to now, its rate fell and its ETA climbed between checkpoints.)"""
    now = [1000.0]
    monkeypatch.setattr(service_module.time, "time", lambda: now[0])
    row = JobRow("j", "", "m", "1", "running", 500, 90, 10, *(0.0,) * 3, "", 0, 0, 0, 100,
                 990.0, 0, 1000.0)  # fmt: skip
    service = JobsService.__new__(JobsService)
    monkeypatch.setattr(service, "_on", lambda: SimpleNamespace(running={}))
    assert (lambda j: (j.rows_per_second, j.eta_seconds))(service._message(row)) == (10.0, 40.0)
    now[0] += 2.0  # no checkpoint since
    assert (lambda j: (j.rows_per_second, j.eta_seconds))(service._message(row)) == (10.0, 38.0)
    resumed = dataclasses.replace(row, resumed_at=1001.0, resumed_done=100)  # none since
    assert (lambda j: (j.rows_per_second, j.eta_seconds))(service._message(resumed)) == (0.0, -1.0)


def test_a_checkpoint_saves_its_time_and_an_older_database_gets_the_column(
    tmp_path: Path,
) -> None:
    """SQLite: checkpointed_at is written by each checkpoint; a jobs.sqlite made by a
    batchd before it had the column gets it (0: no checkpoint known) when opened."""
    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, model TEXT NOT NULL, "
               "version TEXT NOT NULL, status TEXT NOT NULL, total INTEGER NOT NULL DEFAULT 0, "
               "completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0, "
               "created_at REAL NOT NULL, started_at REAL NOT NULL DEFAULT 0, finished_at REAL "
               "NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '', input_bytes INTEGER NOT NULL "
               "DEFAULT 0, results_bytes INTEGER NOT NULL DEFAULT 0, input_offset INTEGER NOT "
               "NULL DEFAULT 0, lines_read INTEGER NOT NULL DEFAULT 0, resumed_at REAL NOT NULL "
               "DEFAULT 0, resumed_done INTEGER NOT NULL DEFAULT 0, submission TEXT NOT NULL "
               "DEFAULT '')")  # fmt: skip
    db.execute("INSERT INTO jobs (id, owner, model, version, status, created_at) "
               "VALUES ('job-old', '', 'm', '1', 'completed', 5.0)")  # fmt: skip
    db.commit()
    db.close()
    clock = [2000.0]
    store = SqliteStore(tmp_path, clock=lambda: clock[0])
    old = asyncio.run(store.get("job-old"))
    assert old is not None and old.checkpointed_at == 0.0
    cfg = model(max_batch_size=4, shape=(1,))

    async def body() -> JobRow:
        row = await queued_one_line(store, cfg)
        claimed = await store.claim()
        assert claimed is not None and claimed.id == row.id
        clock[0] = 2003.5
        out = store.open_results(claimed)
        out.write(b"x\n")
        await store.checkpoint(claimed, out, Progress(10, 1, 1, 0))
        out.close()
        got = await store.get(row.id)
        assert got is not None
        return got

    saved = asyncio.run(body())
    assert (saved.checkpointed_at, saved.done) == (2003.5, 1)


def test_a_job_claimed_while_the_runner_stops_is_not_started(tmp_path: Path) -> None:
    """Started after the stop, its lines would meet the core failing everything queued,
    and those error lines would be kept in its results."""
    cfg = model(max_batch_size=4, shape=(1,))

    class SlowClaim(SqliteStore):
        claiming = asyncio.Event()
        answer = asyncio.Event()

        async def claim(self, exclude_models: frozenset[str] = frozenset(),
                        only: Mapping[str, str] | None = None) -> Any:  # fmt: skip
            self.claiming.set()
            await self.answer.wait()  # a database round trip, during which stop() comes
            return await super().claim(exclude_models, only)

    async def body() -> None:
        SlowClaim.claiming, SlowClaim.answer = asyncio.Event(), asyncio.Event()
        store = SlowClaim(tmp_path)
        row = await queued_one_line(store, cfg)
        jobs = jobs_of(store, cfg)
        task = asyncio.create_task(jobs.run())
        await store.claiming.wait()
        stopping = asyncio.create_task(jobs.stop())  # it waits for the claim in flight
        await asyncio.sleep(0)
        store.answer.set()
        await asyncio.wait_for(stopping, 10)
        await asyncio.wait_for(task, 10)  # the runner ends ...
        assert jobs.running == {}  # ... without starting the job it claimed
        got = await store.get(row.id)
        assert got is not None and got.completed == got.failed == 0

    run(body)


def test_an_upload_says_it_is_alive_while_its_client_pauses(tmp_path: Path) -> None:
    """A replica removes an upload whose lease ran out: it is renewed on a timer while
    the client pauses between pieces (before, only as pieces came)."""
    cfg = model(max_batch_size=4, shape=(1,))

    class Leased(SqliteStore):
        renew_every_s = 0.001
        renewed = asyncio.Event()
        renewals = 0

        async def uploading(self, job_id: str) -> str:
            Leased.renewals += 1
            if Leased.renewals >= 3:
                self.renewed.set()
            return await super().uploading(job_id)

    async def body() -> None:
        Leased.renewed = asyncio.Event()
        store = Leased(tmp_path)
        jobs = jobs_of(store, cfg, runs=False)
        line = ONE_LINE.encode()

        async def pieces() -> AsyncIterator[bytes]:
            yield line[:10]
            await Leased.renewed.wait()  # the client pauses until the lease was renewed
            yield line[10:]

        job = await asyncio.wait_for(
            JobsService(jobs).submit(("", True), cfg.name, "", pieces()), 10
        )
        assert job.status == "queued" and job.total == 1

    run(body)


def test_the_jobs_count_for_a_scrape_reads_off_the_event_loop(tmp_path: Path) -> None:
    """It reads every retained job (31 ms at 600,000): on a thread, over a connection
    of its own, it counts what is committed and holds no loop up."""
    store = SqliteStore(tmp_path)

    async def body() -> tuple[dict[str, int], set[str]]:
        for _ in range(3):
            row = await store.create("", "mlp", "1")
        store.upload_path(row.id).write_bytes(b"x" * 10)
        await store.queue(row.id, 1, 10)
        threads: set[str] = set()
        real = sqlite3.connect

        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            threads.add(threading.current_thread().name)
            return real(*args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sqlite3, "connect", connect)
            counts = await store.by_status()
        return counts, threads

    counts, threads = asyncio.run(body())
    assert (counts["validating"], counts["queued"], counts["running"]) == (2, 1, 0)
    assert threads and threading.main_thread().name not in threads
    store.close()


def test_a_job_line_of_a_bucketed_model_with_priority_levels_plans_in_its_lane() -> None:
    """A job line is decoded with its model's default priority level (the lowest: 2
    here), but the job lane has one level. Its bucketing ranked by that level and
    raised KeyError in every pump: the job hung, other jobs failed, and online calls
    of every model got UNKNOWN."""

    async def body() -> None:
        cfg = ragged_model(bucket_by_length=True, priority_levels=2, default_priority_level=2)
        dispatch = FakeDispatch(idle=0, credits=0)  # the worker is busy
        s = Scheduler(dispatch, Clock())
        s.add_model(cfg)
        decoded = [
            chunks.decode(json.dumps({"custom_id": f"c{n}", "inputs": [
                {"name": "IDS", "datatype": "INT64", "shape": [1, n], "data": [1] * n}
            ]}).encode(), n, cfg, Limits())
            for n in (3, 5, 4)
        ]  # fmt: skip
        for line in decoded:
            assert line.request is not None, line.error
            s.submit(line.request)
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert [[r.id for r in batch] for batch in dispatch.sent] == [["c3", "c4", "c5"]]

    run(body)


def test_results_to_a_path_that_is_not_a_regular_file_go_to_it_as_it_is(tmp_path: Path) -> None:
    """A download to /dev/null (or /dev/stdout, a FIFO) is written there, not to a
    .partial beside it; one to a symbolic link replaces the file the link names."""
    with ResultsFile("/dev/null") as f:
        f.write(b"a\n")
    assert f.lines == 1
    (tmp_path / "real.jsonl").write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    with ResultsFile(tmp_path / "link.jsonl") as f:
        f.write(b"new\n")
    assert (tmp_path / "link.jsonl").is_symlink()
    assert (tmp_path / "real.jsonl").read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real.jsonl"]


def test_results_are_not_written_through_what_is_planted_at_a_partial_path(
    tmp_path: Path,
) -> None:
    """In a shared folder (/tmp), another user's link at OUT.partial made a download
    truncate and overwrite the file it named, their FIFO hung it, their file took the
    results (and made OUT theirs). The download's file is its own, made beside OUT."""
    (tmp_path / "victim").write_text("theirs\n")
    (tmp_path / "out.jsonl.partial").symlink_to(tmp_path / "victim")
    os.mkfifo(tmp_path / "other.jsonl.partial")
    mask = os.umask(0)
    os.umask(mask)
    for name in ("out.jsonl", "other.jsonl"):
        with ResultsFile(tmp_path / name) as f:
            f.write(b"new\n")
        assert (tmp_path / name).read_text() == "new\n"
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask  # (as open() makes)
    assert (tmp_path / "victim").read_text() == "theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.jsonl",
        "other.jsonl.partial",
        "out.jsonl",
        "out.jsonl.partial",
        "victim",
    ]


def test_results_leave_no_partial_file_when_the_last_step_fails_and_take_a_long_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close or replace that failed (a full disk) left the download's file beside
    PATH; a name of 240 characters failed ("File name too long") once ".<random>.partial"
    was added to it."""
    long = tmp_path / ("r" * 240)
    with ResultsFile(long) as f:
        f.write(b"a\n")
    assert long.read_text() == "a\n"

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"), ResultsFile(tmp_path / "x") as f:
        f.write(b"b\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [long.name]
    assert not ResultsFile.writing
    refused = pytest.raises(IsADirectoryError, match="a folder, not a file")  # (AttributeError)
    with refused, ResultsFile(tmp_path / "missing" / ".." / ".."):
        pass
    monkeypatch.undo()

    def then_another(src: Path, dst: Path) -> None:  # (its name taken again at once)
        real_replace(src, dst)
        Path(src).write_text("another's\n")

    real_replace = os.replace
    monkeypatch.setattr(os, "replace", then_another)
    with ResultsFile(tmp_path / "y") as f:
        f.write(b"c\n")
    assert [p.read_text() for p in tmp_path.glob("*.partial")] == ["another's\n"]


def test_uploads_a_sigint_refused_before_the_stop_began_stay_refused(tmp_path: Path) -> None:
    """A SIGINT that ends the drain notice can come before the jobs' stop has begun
    (Python 3.12's wait_for returns without a switch when the signal is already in):
    stop() then took uploads again for the notice it was given (late review)."""
    store = SqliteStore(tmp_path)
    jobs = jobs_of(store, model(max_batch_size=4, shape=(1,)), runs=False)
    try:
        assert jobs.taking_uploads
        jobs.no_uploads()
        run(lambda: jobs.stop(timeout_s=1.0, notice_s=30.0))
        assert not jobs.taking_uploads
    finally:
        store.close()
