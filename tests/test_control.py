"""Model control with real processes: RepositoryModelLoad swaps a serving model
with no failed request, a broken version changes nothing, Unload drains.

`scaled` multiplies X by the number in its scale.txt, read when it loads, so
each version answers differently; a negative scale refuses to load. Files in
its folder hold its load() and each version's batches (conftest.make_model).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd.client import (
    AsyncClient,
    BatchdClientError,
    Client,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    ModelNotFound,
    ServerUnavailable,
)
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import wire
from batchd.protos.model_config import ConfigError, load_model_config
from batchd.protos.repository import digest, files_of, find_model, identity
from batchd.server import control
from batchd.server.errors import Unavailable
from batchd.server.pool import WorkerPool
from tests.conftest import (
    MODEL_PY,
    MODEL_TOML,
    batch_gate,
    load_gate,
    make_model,
    model_log,
    reset_model_logs,
    scrape,
    total,
    workers_up,
)
from tests.servers import ServerProcess, free_port, wait_for

WORKERS = 2


def loaded_by(model_dir: Path, scale: float | None = None) -> int:
    """How many worker processes called the model's load() (for this scale)."""
    loads = model_log(model_dir, "loads.log")
    return len({r["pid"] for r in loads if scale is None or r["scale"] == scale})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    make_model(root, "scaled", 1.0)
    make_model(root, "spare", 3.0)
    make_model(root, "idle", 5.0)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(
        repo,
        "--model-control",
        "explicit",
        "--load-model",
        "scaled",
        "--load-model",
        "spare",
        "--credits-per-worker",
        "1",  # one batch staged per worker, as on CPU by default: the swap test counts on it
        log_dir=tmp_path_factory.mktemp("logs"),
        workers=WORKERS,
    ).start()
    with Client(s.url) as c:
        assert c.model_ready("scaled") and c.model_ready("spare")
    # ServerReady needs one worker per model; the tests rewrite scale.txt, which every
    # worker must have read first (it is read before load() logs its call).
    for d in (repo / "scaled", repo / "spare"):
        wait_for(lambda d=d: loaded_by(d) == WORKERS, 60, f"every worker to load {d.name}")
    yield s
    assert s.stop() == 0, s.log()


def y(client: Client, model: str, v: float) -> float:
    out = client.infer(model, {"X": np.array([[v]], np.float32)}, timeout=10)
    return float(out["Y"][0, 0])


def test_explicit_mode_loads_only_what_was_asked(server: ServerProcess) -> None:
    with Client(server.url) as c:
        index = {m["name"]: m for m in c.repository_index()}
        assert index["idle"]["state"] == "UNAVAILABLE" and index["idle"]["reason"] == "not loaded"
        assert index["scaled"]["state"] == "READY"
        with pytest.raises(ModelNotFound, match="idle"):
            y(c, "idle", 1.0)
        assert [m["name"] for m in c.repository_index(ready=True)] == ["scaled", "spare"]
        assert "model_repository" in c.server_metadata()["extensions"]


def test_reload_lands_while_old_batches_are_in_flight(server: ServerProcess, repo: Path) -> None:
    """A load under load: the swap happens while requests admitted to the old
    version are unanswered; the old version answers them after the swap, the new
    one answers everything sent after it, and no request fails."""
    d = repo / "scaled"
    reset_model_logs(d)
    (d / "scale.txt").write_text("2.0")
    old_batches, new_load = batch_gate(d, 1.0), load_gate(d)
    answers: dict[float, tuple[bool, float]] = {}  # x -> (sent after the swap, y)
    warm, swapped = asyncio.Event(), asyncio.Event()
    held_from: list[int] = []  # entered.log's length when the old version's gate closed
    queued_at_swap: list[float] = []
    callers = 40
    with Client(server.url) as c:
        (version,) = c.model_metadata("scaled")["versions"]
    assert workers_up(server) == WORKERS

    def queued() -> float:
        return total(scrape(server), "batchd_inference_pending_request_count", model="scaled")

    async def caller(c: AsyncClient, k: int) -> None:
        i = sent_after = 0
        while sent_after < 10:
            after = swapped.is_set()
            v = float(k * 1000 + i)
            out = await c.infer("scaled", {"X": np.array([[v]], np.float32)}, timeout=60)
            answers[v] = (after, float(out["Y"][0, 0]))
            if len(answers) >= 80:  # the old version served under load first
                warm.set()
            i += 1
            sent_after += after

    async def scenario() -> None:
        async with AsyncClient(server.url) as c:
            tasks = [asyncio.create_task(caller(c, k)) for k in range(callers)]
            await asyncio.wait_for(warm.wait(), 60)
            new_load.touch()
            load = asyncio.create_task(c.load_model("scaled"))
            await asyncio.to_thread(
                wait_for, lambda: loaded_by(d, 2.0) == WORKERS, 60, "every worker in the new load()"
            )
            # Nothing of the old version can finish from now until the swap is done.
            old_batches.touch()
            held_from.append(len(model_log(d, "entered.log")))
            # Each caller has a request at the server: one batch (at most 8 rows) is
            # staged behind each worker's load, the rest wait in the old version's queue.
            enough = callers - WORKERS * 8
            await asyncio.to_thread(wait_for, lambda: queued() >= enough, 60, "a queue")
            assert not load.done()  # the swap waits for every worker's load
            (entry,) = [e for e in await c.repository_index(ready=True) if e["name"] == "scaled"]
            assert (entry["version"], entry["state"]) == (version, "READY")  # it serves on
            assert entry["reason"] == f"version {int(version) + 1} loading; serving"
            queued_at_swap.append(queued())  # old requests; none can leave before the swap
            new_load.unlink()
            await asyncio.wait_for(load, 60)
            swapped.set()
            old_batches.unlink()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)  # a failed request raises

    try:
        asyncio.run(scenario())
    finally:
        old_batches.unlink(missing_ok=True)
        new_load.unlink(missing_ok=True)
    # Batches that started once the old gate was closed finished after the swap.
    # The old version's were admitted before it, and it answered them: not moved, not failed.
    late = model_log(d, "entered.log")[held_from[0] :]
    late_old = [v for r in late if r["scale"] == 1.0 for v in r["values"]]
    assert len(late_old) >= queued_at_swap[0] > 0, "the old version's queue did not stay with it"
    assert all(answers[v] == (False, v) for v in late_old)
    after = [(v, y) for v, (sent_after, y) in answers.items() if sent_after]
    assert len(after) == callers * 10
    assert all(y == 2 * v for v, y in after)  # only the new version answers after Load
    new = str(int(version) + 1)
    with Client(server.url) as c:
        assert c.model_metadata("scaled")["versions"] == [new]
    wait_for(
        lambda: f"model scaled version {version} unloaded" in server.log(), 30, "the old to drain"
    )


def test_a_version_that_fails_to_load_changes_nothing(server: ServerProcess, repo: Path) -> None:
    with Client(server.url) as c:
        version = c.model_metadata("spare")["versions"]
        (repo / "spare" / "scale.txt").write_text("-1")
        with pytest.raises(InferenceFailed, match="refuses to load") as e:
            c.load_model("spare")
        assert f"version {version[0]} serving before stays" in str(e.value)
        assert y(c, "spare", 2.0) == 6.0
        assert c.model_metadata("spare")["versions"] == version
        (repo / "spare" / "scale.txt").write_text("3.0")


def test_a_load_of_a_name_two_folders_declare_fails_and_changes_nothing(
    server: ServerProcess, repo: Path
) -> None:
    """A folder added beside the one serving, declaring the same name (and sorting
    first): start-up and the index refuse such a repository, but a load took the first
    folder, answered OK, and swapped the model served for the other's."""
    copy = repo / "a-copy"
    shutil.copytree(repo / "spare", copy)
    (copy / "model.toml").write_text('name = "spare"\n' + (copy / "model.toml").read_text())
    (copy / "scale.txt").write_text("1000.0")
    try:
        with Client(server.url) as c:
            with pytest.raises(InvalidInput, match=r"model name 'spare' is declared by a-copy/ "
                               "and spare/; rename one"):  # fmt: skip
                c.load_model("spare")
            assert y(c, "spare", 2.0) == 6.0
            index = {m["name"]: m for m in c.repository_index()}  # both folders, as the load
            assert "a-copy" not in index and index["spare"]["state"] == "READY", index
            assert "declared by a-copy/ and spare/" in index["spare"]["reason"], index
    finally:
        shutil.rmtree(copy)


def test_a_load_error_of_any_length_or_script_reaches_its_caller(
    server: ServerProcess, repo: Path
) -> None:
    """A status's details over gRPC's 16 KiB of metadata (each byte past ASCII goes as
    three characters) failed the call as RESOURCE_EXHAUSTED 'Stream removed': here a
    load() raising 4,000 CJK characters (a model's message is kept to 4,096), and a
    model.toml quoting an output's name of 5,000."""
    raising, named = repo / "cjk-load", repo / "cjk-name"
    make_model(repo, raising.name, 1.0)
    (raising / "model.py").write_text(
        "def load(device):\n    raise ValueError('\u4e2d' * 4000)\n")  # fmt: skip
    named.mkdir()
    wide = "\u4e2d" * 5000
    toml = MODEL_TOML.replace('name = "Y"', f'name = "{wide}"\nragged_like = "X"')
    (named / "model.toml").write_text(toml.replace("[1]\n\n[batching]", "[-1]\n\n[batching]"))
    (named / "model.py").write_text("def load(device):\n    return lambda x: x\n")
    try:
        with Client(server.url) as c:
            with pytest.raises(InferenceFailed, match="ValueError: \u4e2d") as e:
                c.load_model("cjk-load")
            assert 2000 < len(e.value.message.encode()) <= 2400
            with pytest.raises(InvalidInput, match="key 'ragged_like': expected a ragged") as i:
                c.load_model("cjk-name")
            assert len(i.value.message.encode()) <= 2400
    finally:
        shutil.rmtree(raising)
        shutil.rmtree(named)


def test_unload_drains_then_load_brings_it_back(server: ServerProcess) -> None:
    with Client(server.url) as c:
        assert y(c, "spare", 1.0) == 3.0
        c.unload_model("spare")
        with pytest.raises(ModelNotFound, match="spare"):
            y(c, "spare", 1.0)
        assert {m["name"]: m["state"] for m in c.repository_index()}["spare"] == "UNAVAILABLE"
        with grpc.insecure_channel(server.url) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            reply = health.Check(health_pb2.HealthCheckRequest(service="spare"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert c.ready()  # the server serves what it has loaded
        c.load_model("spare")
        assert y(c, "spare", 1.0) == 3.0


def test_every_unload_of_a_draining_model_waits_for_its_drain(
    server: ServerProcess, repo: Path
) -> None:
    """A second unload, sent while the first waited for the model's held batch, found
    it unloaded already and returned at once, long before that batch was answered."""
    d = make_model(repo, "twice", 8.0)
    held = batch_gate(d, 8.0)
    try:
        with Client(server.url) as c, ThreadPoolExecutor(2) as pool:
            c.load_model("twice", timeout=30)
            held.touch()
            in_flight = pool.submit(y, c, "twice", 1.0)
            wait_for(lambda: len(model_log(d, "entered.log")) >= 1, 60, "the held batch")
            first = pool.submit(Client(server.url).unload_model, "twice", timeout=60)
            wait_for(lambda: "model twice version 1 unloading" in server.log(), 60, "unloading")
            with pytest.raises(DeadlineExceeded):  # (the batch is held until the gate goes)
                c.unload_model("twice", timeout=2)
            held.unlink()
            assert in_flight.result(60) == 8.0
            first.result(60)
            c.unload_model("twice", timeout=5)  # nothing loaded, nothing draining: at once
    finally:
        held.unlink(missing_ok=True)


def test_a_server_shutting_down_loads_and_unloads_no_model(tmp_path: Path, repo: Path) -> None:
    """SIGTERM: during its notice and drain the server still loaded a model on workers
    about to stop (and unloaded one a balancer still sent requests for)."""
    shutil.copytree(repo / "idle", tmp_path / "repo" / "idle")
    args = ("--model-control", "explicit", "--load-model", "idle", "--drain-notice", "30")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    try:
        with Client(s.url) as c:
            assert s.proc is not None
            s.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "stopping: not ready" in s.log(), 30, "the notice")
            for call in (c.load_model, c.unload_model):
                with pytest.raises(ServerUnavailable, match="shutting down: it loads and unl"):
                    call("idle", timeout=10)
            assert y(c, "idle", 1.0) == 5.0  # (it serves what it has until the notice ends)
    finally:
        assert s.stop(signal.SIGINT) == 0, s.log()


def test_load_refuses_unknown_names_escapes_and_uploads(server: ServerProcess) -> None:
    with Client(server.url) as c:
        with pytest.raises(InvalidInput, match="no model named 'nope'"):
            c.load_model("nope")
        with pytest.raises(InvalidInput, match="not a model name"):
            c.load_model("../scaled")
        msg = pb.RepositoryModelLoadRequest(model_name="scaled")
        msg.parameters["file:1/model.py"].bytes_param = b"import os"
        with grpc.insecure_channel(server.url) as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.GRPCInferenceServiceStub(ch).RepositoryModelLoad(msg, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "only from its repository" in (e.value.details() or "")


def test_model_control_is_off_unless_enabled(tmp_path: Path, repo: Path) -> None:
    shutil.copytree(repo / "idle", tmp_path / "repo" / "idle")
    s = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(s.url) as c:
            assert y(c, "idle", 1.0) == 5.0
            for call in (c.load_model, c.unload_model):
                with pytest.raises(BatchdClientError, match="--model-control explicit") as e:
                    call("idle")
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert y(c, "idle", 1.0) == 5.0
    finally:
        assert s.stop() == 0, s.log()


def test_load_model_needs_explicit_model_control(repo: Path) -> None:
    cmd = [sys.executable, "-m", "batchd.server", "--model-repository", str(repo)]
    done = subprocess.run([*cmd, "--load-model", "idle"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--load-model needs --model-control explicit" in done.stderr
    done = subprocess.run(
        [*cmd, "--model-control", "explicit", "--load-model", "nope"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--load-model nope: not in" in done.stderr


def test_a_broken_folder_beside_the_named_models_does_not_stop_an_explicit_start(
    tmp_path: Path,
) -> None:
    """A running server lists a folder broken since as unavailable, saying why; restarted
    with the same flags it exited (2, "not valid TOML"), every model down with it (review
    57b). It starts with the models it names; the broken one is refused as it was. A
    start that loads every model ('*', or without explicit control) still stops."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    (broken := tmp_path / "repo" / "other").mkdir()
    (broken / "model.toml").write_text("max_batch_size = [\n")
    args = ("--model-control", "explicit", "--load-model", "scaled")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    try:
        with Client(s.url) as c:
            assert y(c, "scaled", 1.0) == 2.0
            other = {m["name"]: m for m in c.repository_index()}["other"]
            assert other["state"] == "UNAVAILABLE" and "not valid TOML" in other["reason"]
            with pytest.raises(BatchdClientError, match="not valid TOML"):
                c.load_model("other")
        assert "other/model.toml: not valid TOML" in s.log() and "not loaded" in s.log()
    finally:
        assert s.stop() == 0, s.log()
    cmd = [sys.executable, "-m", "batchd.server", "--model-repository", str(tmp_path / "repo")]
    for every in (
        (),
        ("--model-control", "explicit", "--load-model", "*"),
        ("--model-control", "explicit", "--load-model", "other"),  # its own error, not "not
    ):  # in the repository (it has: scaled)" (late review 57d)
        done = subprocess.run([*cmd, *every, "--grpc-port", "0"], capture_output=True, text=True)
        said = done.stderr.strip().splitlines()[-1]  # (why it exits: what it says last)
        assert done.returncode == 2 and "other/model.toml: not valid TOML" in said, every


def test_a_model_that_changes_the_working_directory_as_it_loads_harms_no_other(
    tmp_path: Path,
) -> None:
    """The working directory is the worker's, not a model's: one whose load() went to its
    own folder (os.chdir) left a relative --model-repository unreadable, so every other
    model of that worker failed ("the model repository cannot be read"), it failed too
    ("its files changed as it loaded"), and each restart did the same (review 57f)."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    mover = make_model(tmp_path / "repo", "mover", 3.0)
    (mover / "model.py").write_text(
        MODEL_PY.replace("def load(device):", "def load(device):\n    os.chdir(HERE)")
    )
    s = ServerProcess(Path("repo"), log_dir=tmp_path, cwd=tmp_path).start()
    try:
        with Client(s.url) as c:
            assert y(c, "scaled", 1.0) == 2.0 and y(c, "mover", 1.0) == 3.0
    finally:
        assert s.stop() == 0, s.log()


@pytest.mark.parametrize(
    "change", ["set_default_dtype(torch.float64)", "set_default_device('meta')"]
)
def test_a_model_that_changes_torch_s_defaults_harms_no_other(tmp_path: Path, change: str) -> None:
    """torch.set_default_dtype is the whole process's: one model's float64 made every
    later tensor of another model on that worker float64, which then failed as not the
    FP32 it declared, till the worker restarted (review 57f). The default device is the
    compute thread's: one model's 'meta' made the next one's tensors meta ones."""
    for name, body in (
        ("widens", f"    torch.{change}\n    return {{'Y': x}}"),
        ("adds", "    return {'Y': x + torch.tensor([[1.0]])}"),
    ):
        (d := tmp_path / "repo" / name).mkdir(parents=True)
        (d / "model.toml").write_text(MODEL_TOML)
        (d / "model.py").write_text(
            f"import torch\ndef load(device):\n  return run\ndef run(x):\n{body}\n"
        )
    s = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(s.url) as c:
            assert y(c, "widens", 1.0) == 1.0 and y(c, "adds", 1.0) == 2.0
    finally:
        assert s.stop() == 0, s.log()


@pytest.mark.parametrize(
    "change", ["set_default_dtype(torch.float64)", "set_default_device('meta')"]
)
def test_a_model_whose_load_changes_torch_s_defaults_harms_no_other(
    tmp_path: Path, change: str
) -> None:
    """The same in load(), run on the loader thread: its float64 stayed the process's
    (each forward kept the defaults it found, float64 by then), and its 'meta' the
    loader thread's, so the next model loaded made its weights meta tensors."""
    for name, load_body, run_body in (
        ("widens", f"    torch.{change}\n    return run", "    return {'Y': x}"),
        ("adds", "    global w\n    w = torch.ones(1, 1)\n    return run",
         "    return {'Y': x + w + torch.tensor([[0.0]])}"),
    ):  # fmt: skip
        (d := tmp_path / "repo" / name).mkdir(parents=True)
        (d / "model.toml").write_text(MODEL_TOML)
        (d / "model.py").write_text(f"import torch\ndef load(device):\n{load_body}\n"
                                    f"def run(x):\n{run_body}\n")  # fmt: skip
    args = ("--model-control", "explicit")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start(ready=False)
    try:
        wait_for(lambda: "worker cpu0#0 ready" in s.log(), 60, "a worker")
        with Client(s.url) as c:
            for name in ("widens", "adds"):  # (in turn: the second after the first's load)
                c.load_model(name, timeout=60)
            assert y(c, "widens", 1.0) == 1.0 and y(c, "adds", 1.0) == 2.0
    finally:
        assert s.stop() == 0, s.log()


def test_the_index_says_why_a_model_s_last_load_failed_till_one_passes(tmp_path: Path) -> None:
    """A load that failed was answered with why, but the index then said "not loaded"
    alone; Triton keeps the last load error there (review 57b)."""
    model = make_model(tmp_path / "repo", "refuser", -1.0)
    s = ServerProcess(tmp_path / "repo", "--model-control", "explicit", log_dir=tmp_path)
    s.start(ready=False)
    try:
        wait_for(lambda: "worker cpu0#0 ready" in s.log(), 60, "a worker")
        with Client(s.url) as c:
            reason = lambda: {m["name"]: m for m in c.repository_index()}["refuser"]["reason"]  # noqa: E731
            assert reason() == "not loaded"
            with pytest.raises(InferenceFailed):
                c.load_model("refuser")
            said = reason()
            assert said.startswith("not loaded: model 'refuser' failed to load") and (
                "scale -1.0 refuses to load" in said), said  # fmt: skip
            (model / "scale.txt").write_text("2.0")
            c.load_model("refuser")
            assert reason() == "" and y(c, "refuser", 1.0) == 2.0
    finally:
        assert s.stop() == 0, s.log()


def test_one_model_that_fails_to_load_leaves_the_others_serving(tmp_path: Path) -> None:
    """A model whose load() raises at start is unready on its own: the server stays
    ready for the healthy one, the index names the load error, and a request to it
    (with no deadline) gets UNAVAILABLE at once, naming the error. A load of it that
    fails again does not claim the version before serves."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    make_model(tmp_path / "repo", "broken", -1.0)
    args = ("--model-control", "explicit", "--load-model", "scaled", "--load-model", "broken")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start(ready=False)
    try:
        with Client(s.url) as c, grpc.insecure_channel(s.url) as ch:
            index = lambda: {m["name"]: m for m in c.repository_index()}  # noqa: E731
            wait_for(lambda: index()["broken"]["reason"] != "no live worker serves it", 60,
                     "the failed load to be known")  # fmt: skip
            wait_for(c.ready, 60, "ServerReady")
            assert y(c, "scaled", 1.0) == 2.0
            assert index()["broken"]["state"] == "UNAVAILABLE"
            assert "refuses to load" in index()["broken"]["reason"]
            assert not c.model_ready("broken") and c.model_ready("scaled")
            health = health_pb2_grpc.HealthStub(ch)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
            assert health.Check(health_pb2.HealthCheckRequest(service="broken")).status != serving
            msg = pb.ModelInferRequest(model_name="broken", raw_input_contents=[bytes(4)])
            msg.inputs.add(name="X", datatype="FP32", shape=[1, 1])
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(msg)  # no deadline
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "refuses to load" in (e.value.details() or "")
            with pytest.raises(InferenceFailed) as failed:
                c.load_model("broken")
            assert "version 1 stays, and it does not serve either (model 'broken' could not" in (
                str(failed.value)
            )
    finally:
        assert s.stop() == 0, s.log()


def test_a_repository_moved_away_makes_the_index_and_loads_unavailable_naming_it(
    tmp_path: Path,
) -> None:
    """A deploy may move the repository's folder: the index and a load answer UNAVAILABLE
    naming the folder (UNKNOWN "Unexpected FileNotFoundError", a traceback logged per
    call, before; HTTP 500), and it all works once it is back."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    args = ("--model-control", "explicit", "--load-model", "scaled")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    try:
        with Client(s.url) as c:
            (tmp_path / "repo").rename(tmp_path / "away")
            for ask in (c.repository_index, lambda: c.load_model("scaled")):
                with pytest.raises(ServerUnavailable, match="the model repository cannot be read"):
                    ask()
            (tmp_path / "away").rename(tmp_path / "repo")
            c.load_model("scaled")
            assert [m["name"] for m in c.repository_index()] == ["scaled"]
            assert y(c, "scaled", 1.0) == 2.0
        assert "Traceback" not in s.log()
    finally:
        assert s.stop() == 0, s.log()


def test_a_first_load_that_fails_does_not_speak_of_a_version_before(
    server: ServerProcess, repo: Path
) -> None:
    make_model(repo, "fresh", -1.0)
    with Client(server.url) as c, pytest.raises(InferenceFailed) as e:
        c.load_model("fresh")
    assert "refuses to load" in str(e.value) and "serving before" not in str(e.value)
    assert "no version of it serves" in str(e.value)


def serving(c: Client, model: str) -> bool:
    return model in [m["name"] for m in c.repository_index(ready=True)]


def test_a_load_or_unload_whose_caller_left_still_ends(server: ServerProcess, repo: Path) -> None:
    """Half done, either would leave a copy of the model on the workers that nothing
    serves and nothing unloads: both go on to their end without their caller."""
    d = repo / "idle"
    reset_model_logs(d)
    gate = load_gate(d)
    gate.touch()
    try:
        with Client(server.url) as c:
            with pytest.raises(BatchdClientError) as e:
                c.load_model("idle", timeout=1.0)  # every worker's load() is held
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            gate.unlink()
            wait_for(lambda: serving(c, "idle"), 60, "the load to end without its caller")
            (version,) = c.model_metadata("idle")["versions"]
            assert y(c, "idle", 1.0) == 5.0
            held = batch_gate(d, 5.0)
            held.touch()
            with ThreadPoolExecutor(1) as pool:
                in_flight = pool.submit(y, c, "idle", 2.0)
                wait_for(lambda: len(model_log(d, "entered.log")) >= 2, 60, "the held batch")
                with pytest.raises(BatchdClientError) as e:
                    c.unload_model("idle", timeout=1.0)  # it waits for the held batch
                assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                held.unlink()
                assert in_flight.result(60) == 10.0
            wait_for(
                lambda: f"model idle version {version} unloaded" in server.log(),
                60,
                "the unload to end without its caller",
            )
            assert not serving(c, "idle")
    finally:
        gate.unlink(missing_ok=True)
        batch_gate(d, 5.0).unlink(missing_ok=True)


def test_loads_whose_callers_left_while_one_waits_are_that_one_load(
    server: ServerProcess, repo: Path
) -> None:
    """A caller that retried its load on a short deadline (as a deploy script does) while
    a load was held queued a load for each try, and each ran in turn, to its end: 5
    retries made 5 loads more. A load not yet begun serves every load asked for after
    it (it reads the files when it begins); one asked for after an unload follows it."""
    d = make_model(repo, "retried", 3.0)
    gate = load_gate(d)
    gate.touch()
    try:
        with Client(server.url) as c:
            for timeout in (1.0, 0.3, 0.3, 0.3, 0.3, 0.3):  # the first held, the rest queued
                with pytest.raises(BatchdClientError) as e:
                    c.load_model("retried", timeout=timeout)
                assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for(lambda: len(model_log(d, "loads.log")) == WORKERS, 60, "the held loads")

            def versions() -> list[str]:
                with contextlib.suppress(ModelNotFound):  # (none loaded yet)
                    return list(c.model_metadata("retried")["versions"])
                return []

            gate.unlink()
            wait_for(lambda: versions() == ["2"], 60, "the queued load, run once")
            c.load_model("retried", timeout=60)  # the next: version 3 (8 before)
            assert versions() == ["3"] and len(model_log(d, "loads.log")) == 3 * WORKERS
            gate.touch()
            waits = lambda: server.log().count("model retried: waits")  # noqa: E731
            before = waits()
            for timeout in (1.0, 0.3):  # version 4, held; 5, queued behind it
                with pytest.raises(BatchdClientError):
                    c.load_model("retried", timeout=timeout)
            wait_for(lambda: waits() == before + 1, 30, "the second load to queue")
            with ThreadPoolExecutor(2) as pool:
                unloaded = pool.submit(c.unload_model, "retried", timeout=60)
                wait_for(lambda: waits() == before + 2, 30, "the unload to queue")
                loaded = pool.submit(c.load_model, "retried", timeout=60)  # not 5: after it
                wait_for(lambda: waits() == before + 3, 30, "the last load to queue")
                gate.unlink()
                unloaded.result(60)
                loaded.result(60)
            assert versions() == ["6"] and len(model_log(d, "loads.log")) == 6 * WORKERS
            c.unload_model("retried", timeout=60)
    finally:
        gate.unlink(missing_ok=True)


def test_models_answer_while_another_loads_and_a_drain_holds_up_no_load(
    server: ServerProcess, repo: Path
) -> None:
    """Workers load on a thread of their own: while every worker's load() of one model
    is held, the models they hold answer (a load on the compute thread held every
    batch behind it), and another model unloads (one lock for all held every load
    and unload behind a hung load()). An unload waiting for its model's held batch holds up no load
    of another model (it held the control lock while it drained)."""
    d = make_model(repo, "beside", 7.0)
    gate, held = load_gate(d), batch_gate(d, 7.0)
    make_model(repo, "meanwhile", 4.0)
    try:
        with Client(server.url) as c, ThreadPoolExecutor(2) as pool:
            c.load_model("meanwhile", timeout=30)
            gate.touch()
            loading = pool.submit(Client(server.url).load_model, "beside", timeout=60)
            wait_for(lambda: loaded_by(d) == WORKERS, 60, "every worker in the held load()")
            assert y(c, "spare", 1.0) == 3.0  # while both workers load
            c.unload_model("meanwhile", timeout=30)  # waits for no other model's load
            assert not loading.done()  # (one lock for all: for ever, behind a hung load())
            gate.unlink()
            loading.result(60)
            assert y(c, "beside", 1.0) == 7.0

            held.touch()
            in_flight = pool.submit(y, c, "beside", 2.0)
            wait_for(lambda: len(model_log(d, "entered.log")) >= 2, 60, "the held batch")
            unloading = pool.submit(Client(server.url).unload_model, "beside", timeout=60)
            wait_for(lambda: "model beside version 1 unloading" in server.log(), 60, "unloading")
            make_model(repo, "after", 9.0)
            c.load_model("after", timeout=30)  # while beside drains
            assert y(c, "after", 1.0) == 9.0 and not unloading.done()
            held.unlink()
            assert in_flight.result(60) == 14.0
            unloading.result(60)
            c.unload_model("after")
    finally:
        gate.unlink(missing_ok=True)
        held.unlink(missing_ok=True)


def test_a_restarted_worker_does_not_load_files_changed_since_the_version_loaded(
    tmp_path: Path,
) -> None:
    """A version is the files it was loaded from: a worker started after they changed
    (edited in place, no load call) does not load them under the old number, which
    would answer with other weights as that version. Its requests get UNAVAILABLE
    naming the files; a load serves the new files as a new version."""
    d = make_model(tmp_path / "repo", "edited", 2.0)
    args = ("--model-control", "explicit", "--load-model", "edited")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path, workers=1).start()
    try:
        with Client(s.url) as c:
            assert y(c, "edited", 1.0) == 2.0
            (d / "scale.txt").write_text("7.0")  # new weights, no load call yet
            (worker,) = s.worker_pids()
            os.kill(worker, signal.SIGKILL)
            wait_for(lambda: "changed since version 1 was loaded (scale.txt)" in s.log(), 60,
                     "the restarted worker to refuse version 1")  # fmt: skip
            with pytest.raises(BatchdClientError) as e:
                y(c, "edited", 1.0)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert "the files of model 'edited' changed since version 1" in str(e.value)
            c.load_model("edited")
            assert y(c, "edited", 1.0) == 7.0
    finally:
        assert s.stop() == 0, s.log()


def test_a_restarted_worker_keeps_no_version_whose_files_changed_while_it_loaded(
    tmp_path: Path,
) -> None:
    """The files are checked when a worker registers, but it loads its models one by
    one: a version's files may change before it reads them. The LOAD names them
    (their digest), and a worker that would read other files does not load them,
    rather than answer with other weights under that version's number."""
    repo = tmp_path / "repo"
    first, edited = make_model(repo, "first", 1.0), make_model(repo, "edited", 2.0)
    args = ("--model-control", "explicit", "--load-model", "first", "--load-model", "edited")
    s = ServerProcess(repo, *args, log_dir=tmp_path, workers=1).start()
    gate = load_gate(first)
    try:
        with Client(s.url) as c:
            assert y(c, "edited", 1.0) == 2.0
            gate.touch()  # the restarted worker's load of `first` waits here...
            (worker,) = s.worker_pids()
            os.kill(worker, signal.SIGKILL)
            wait_for(lambda: loaded_by(first) == 2, 60, "the restarted worker in first's load()")
            (edited / "scale.txt").write_text("7.0")  # ... while `edited` is edited
            gate.unlink()
            wait_for(lambda: "could not load model edited version 1: the files of model "
                     "'edited' changed since they were read for version 1" in s.log(), 60,
                     "the restarted worker to refuse version 1 of edited")  # fmt: skip
            assert loaded_by(edited, 7.0) == 0  # it did not read the new files
            with pytest.raises(BatchdClientError) as e:
                y(c, "edited", 1.0)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert y(c, "first", 1.0) == 1.0
    finally:
        gate.unlink(missing_ok=True)
        assert s.stop() == 0, s.log()


def test_a_load_that_never_returns_fails_at_the_load_timeout_and_its_worker_restarts(
    tmp_path: Path,
) -> None:
    """A worker loads one model at a time, and only a new process ends a load() that
    never returns: past --load-timeout the load fails, naming the limit, and the
    worker is restarted (the models it held load again); the next load is served."""
    repo = tmp_path / "repo"
    make_model(repo, "serving", 2.0)
    stuck = make_model(repo, "stuck", 3.0)
    args = ("--model-control", "explicit", "--load-model", "serving", "--load-timeout", "2")
    s = ServerProcess(repo, *args, log_dir=tmp_path, workers=1).start()
    gate = load_gate(stuck)
    gate.touch()
    try:
        with Client(s.url) as c:
            before = s.worker_pids()
            with pytest.raises(InferenceFailed) as e:
                c.load_model("stuck", timeout=60)
            assert "its load of model 'stuck' version 1 ran past --load-timeout 2 s" in str(e.value)
            gate.unlink()
            wait_for(lambda: s.worker_pids() and s.worker_pids() != before, 60, "a new worker")
            wait_for(lambda: c.model_ready("serving"), 60, "the new worker to load serving")
            assert y(c, "serving", 1.0) == 2.0
            c.load_model("stuck", timeout=60)
            assert y(c, "stuck", 1.0) == 3.0
    finally:
        gate.unlink(missing_ok=True)
        assert s.stop() == 0, s.log()


def test_a_model_whose_load_ends_its_worker_is_broken_and_the_others_serve(
    tmp_path: Path,
) -> None:
    """A model.py that ends its process as it loads (os._exit, a crash in native code)
    took every restart of its worker with it: each new worker loaded it first again,
    and the other models never loaded (the server never ready). Lost twice in a row
    while loading it, a worker slot is not sent it again: it is broken, saying why."""
    repo = tmp_path / "repo"
    make_model(repo, "good", 2.0)
    bad = make_model(repo, "a_bad", 3.0)  # (loaded first: the names' order)
    (bad / "model.py").write_text("import os\nos._exit(0)\n")
    s = ServerProcess(repo, log_dir=tmp_path, workers=1).start(ready=False)
    try:
        with Client(s.url) as c:
            wait_for(c.ready, 90, "ServerReady, without a_bad")
            assert y(c, "good", 1.0) == 2.0
            with pytest.raises(ServerUnavailable, match="was lost 2 times as it loaded it"):
                y(c, "a_bad", 1.0)
    finally:
        assert s.stop() == 0, s.log()


def test_a_model_whose_load_never_returns_is_broken_not_retried_by_each_new_worker(
    tmp_path: Path,
) -> None:
    """--model-control none: past --load-timeout the worker is restarted, and the new
    one was sent the same load, hung again, and was killed again, for ever: the server
    was never ready, and the healthy model on that worker went down each time. The
    new worker loads the others; the hung version is broken, saying why."""
    repo = tmp_path / "repo"
    make_model(repo, "good", 2.0)
    hung = make_model(repo, "hung", 3.0)
    gate = load_gate(hung)
    gate.touch()
    s = ServerProcess(repo, "--load-timeout", "2", log_dir=tmp_path, workers=1)
    try:
        s.start()  # ready: one broken model does not hold the server out of service
        with Client(s.url) as c:
            assert y(c, "good", 1.0) == 2.0
            (entry,) = [m for m in c.repository_index() if m["name"] == "hung"]
            assert entry["state"] == "UNAVAILABLE" and re.fullmatch(
                r"model 'hung' could not be loaded: (\w+)#1: not sent: its load on \1#0 ran "
                r"past --load-timeout 2 s",
                entry["reason"],
            ), entry  # (the worker's name: cpu0#1, or cuda0#1 on a GPU)
        assert loaded_by(hung) == 1  # the new worker was not sent it
    finally:
        gate.unlink(missing_ok=True)
        assert s.stop() == 0, s.log()


def test_a_model_edited_while_loads_wait_is_served_as_its_files_are(tmp_path: Path) -> None:
    """Load 1 runs (held in load()), load 2 waits for it, and model.toml changes Y's
    shape: load 2 read model.toml when called, its files only once load 1 ended, so
    its version was READY with the old shape in its metadata, the new one on the
    workers, and every call failed. Load 1, whose files changed as it loaded, fails;
    load 2 serves the files as they are, metadata and outputs alike."""
    repo = tmp_path / "repo"
    d = make_model(repo, "edited", 2.0)
    args = ("--model-control", "explicit", "--load-model", "edited")
    s = ServerProcess(repo, *args, log_dir=tmp_path, workers=1).start()
    gate = load_gate(d)
    try:
        with ThreadPoolExecutor(2) as pool:
            reset_model_logs(d)
            gate.touch()
            first = pool.submit(Client(s.url).load_model, "edited", timeout=60)
            wait_for(lambda: loaded_by(d) == 1, 60, "the first load in load()")
            second = pool.submit(Client(s.url).load_model, "edited", timeout=60)
            waits = "model edited: waits for the load or unload under way"
            wait_for(lambda: waits in s.log(), 30, "the second load to wait")
            (d / "model.toml").write_text(MODEL_TOML.replace("shape = [1]", "shape = [2]"))
            gate.unlink()
            with pytest.raises(
                InferenceFailed, match=r"the files of model .edited. changed .*model\.toml"
            ):
                first.result(60)
            second.result(60)
        with Client(s.url) as c:
            assert c.model_metadata("edited")["inputs"][0]["shape"] == [-1, 2]
            out = c.infer("edited", {"X": np.array([[1.0, 2.0]], np.float32)}, timeout=10)
            assert out["Y"].tolist() == [[2.0, 4.0]]
    finally:
        gate.unlink(missing_ok=True)
        assert s.stop() == 0, s.log()


ONCE_HUNG = r"""
import os
import time
from pathlib import Path

HERE = Path(__file__).parent

def load(device):
    try:  # the first load() ever stalls (a slow disk, a lock): the others do not
        os.close(os.open(HERE / ".stalled", os.O_CREAT | os.O_EXCL))
        time.sleep(3600)
    except FileExistsError:
        pass
    with open(HERE / ".loaded-by", "a") as f:
        f.write(f"{os.getpid()}\n")
    return lambda x: x * 2
"""


def test_a_load_that_hung_on_one_worker_is_still_loaded_by_the_others(tmp_path: Path) -> None:
    """A hung load marks the version for the worker slot it hung on, not for every
    worker: marked for all, the version was gone for good once the worker that had
    loaded it was lost, as no new worker would load it."""
    d = tmp_path / "repo" / "flaky"
    d.mkdir(parents=True)
    (d / "model.toml").write_text(MODEL_TOML)
    (d / "model.py").write_text(ONCE_HUNG)
    s = ServerProcess(tmp_path / "repo", "--load-timeout", "2", log_dir=tmp_path, workers=2)
    try:
        s.start()
        wait_for(lambda: "ran past --load-timeout 2 s" in s.log(), 60, "the stalled load's end")
        (healthy,) = {int(p) for p in (d / ".loaded-by").read_text().split()}
        os.kill(healthy, signal.SIGKILL)  # the worker that holds it is lost (OOM, a crash)
        with Client(s.url) as c:
            wait_for(lambda: healthy not in s.worker_pids() and c.model_ready("flaky"), 60,
                     "the new worker in its slot to load it")  # fmt: skip
            assert y(c, "flaky", 1.0) == 2.0
    finally:
        assert s.stop() == 0, s.log()


def test_a_load_whose_weights_change_as_its_workers_read_them_fails(tmp_path: Path) -> None:
    """Only model.toml was checked after a load: weights rewritten while two workers
    loaded gave one version number two sets of weights, by worker, without a word.
    Now the load fails naming the file, and the version serving before stays."""
    repo = tmp_path / "repo"
    d = make_model(repo, "weights", 2.0)
    args = ("--model-control", "explicit", "--load-model", "weights")
    s = ServerProcess(repo, *args, log_dir=tmp_path, workers=1).start()
    gate = load_gate(d)
    try:
        reset_model_logs(d)
        gate.touch()
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(Client(s.url).load_model, "weights", timeout=60)
            wait_for(lambda: loaded_by(d) == 1, 60, "the load in load()")
            (d / "scale.txt").write_text("5.0")
            gate.unlink()
            changed = r"weights. changed as version 2 loaded \(scale\.txt\).*hidden or \*\.log"
            with pytest.raises(InferenceFailed, match=changed):
                load.result(60)
        with Client(s.url) as c:
            assert y(c, "weights", 1.0) == 2.0  # version 1, as it was loaded
    finally:
        gate.unlink(missing_ok=True)
        assert s.stop() == 0, s.log()


def _serving_scaled(tmp_path: Path) -> tuple[control.ModelControl, WorkerPool, str, list[str]]:
    """Model control serving `scaled` with no worker yet, over a pool, a link that sends
    nowhere and queues that keep what they fail: it, its pool, the version, the fails."""
    failed: list[str] = []

    class Queues:
        add_model = staticmethod(lambda cfg: None)
        has = staticmethod(lambda key: True)
        fail_queued = staticmethod(lambda key, error: failed.append(str(error)))

    class Link:
        send = staticmethod(lambda identity, parts: None)

    pool = WorkerPool()
    ctl = control.ModelControl(tmp_path, pool, Link(), Queues(), False, time.monotonic,  # type: ignore[arg-type]
                               lambda: None, lambda: None)  # fmt: skip
    ctl.start_with({"scaled": load_model_config(make_model(tmp_path, "scaled", 2.0))})
    return ctl, pool, ctl.current["scaled"].key, failed


def test_a_loss_heard_of_after_its_replacement_failed_the_load_fails_the_model(
    tmp_path: Path,
) -> None:
    """With --frontends N, a frontend other than the first hears of a worker's death only
    after 3 missed heartbeats: by then its replacement had registered and said it could
    not load the model. The late loss marked the model as waiting for a worker to come
    back, which no later word cleared: its requests waited for their deadlines (or for
    ever) and the frontend said not ready, while the first failed them at once."""

    async def body() -> None:
        ctl, pool, key, failed = _serving_scaled(tmp_path)

        def worker(name: str, pid: int) -> Any:
            info = wire.WorkerInfo(worker_id=name, device="cpu", pid=pid, instance=name,
                                   protocol=wire.PROTOCOL_VERSION)  # fmt: skip
            return pool.join(name.encode(), info)[1]

        def loaded(worker: Any, error: str) -> None:  # asked to load it, and said
            ctl.worker_ready(worker)
            ctl.on_loaded(worker, wire.Header(kind=wire.Header.LOADED, model="scaled",
                                              version="1", error=error))  # fmt: skip

        old = worker("cpu0#1", 1)
        loaded(old, "")
        assert key in old.models
        new = worker("cpu0#2", 2)  # the replacement, first heard of here
        loaded(new, "boom")
        assert key not in ctl.broken  # the old one still holds it, as far as this one knows
        pool.leave(old)
        ctl.worker_lost(old, "silent for 3.0 s")  # ... heard of now
        assert "boom" in ctl.broken.get(key, "") and failed

    asyncio.run(body())


def test_a_version_a_slot_s_workers_died_loading_twice_after_it_served_fails_at_once(
    tmp_path: Path,
) -> None:
    """A worker that held a version is lost (the model waits for one back), then its
    slot's next two are lost as they load it (an operator's or the memory killer's
    SIGKILLs, review 58c): the slot is not sent it again, and the model waited for a
    worker to come back for ever: unready, its requests waiting for their deadlines,
    nothing said. The worker back on that slot that will not load it is the word
    waited for: the version is broken, saying why, and its queued requests fail."""

    async def body() -> None:
        ctl, pool, key, failed = _serving_scaled(tmp_path)

        async def worker(pid: int) -> Any:
            info = wire.WorkerInfo(worker_id=f"cpu0#{pid}", device="cpu", pid=pid,
                                   instance=str(pid), protocol=wire.PROTOCOL_VERSION)  # fmt: skip
            w = pool.join(b"cpu0", info)[1]
            ctl.worker_ready(w)
            for _ in range(500):  # (its LOAD goes once its files are read, off the loop)
                if key in w.load_sent or key in w.load_errors:
                    break
                await asyncio.sleep(0.01)
            return w

        held = await worker(1)
        ctl.on_loaded(held, wire.Header(kind=wire.Header.LOADED, model="scaled", version="1"))
        assert key in held.models
        for pid in (2, 3, 4):  # 2, 3: lost as they load it
            pool.leave(held)
            ctl.worker_lost(held, "process exited (killed by SIGKILL)")
            held = await worker(pid)
        assert key not in held.loads  # 4: not sent, it would die again
        assert "was lost 2 times as it loaded it" in ctl.broken.get(key, "") and failed

    asyncio.run(body())


class _Sent:
    """A WorkerLink that keeps what it was asked to send, and wakes whoever waits."""

    def __init__(self) -> None:
        self.headers: list[wire.Header] = []
        self.heard = asyncio.Event()

    def send(self, identity: bytes, parts: list[Any]) -> None:
        self.headers.append(wire.unpack(parts)[0])
        self.heard.set()


def _worker(pool: WorkerPool) -> Any:
    info = wire.WorkerInfo(worker_id="cpu0#1", device="cpu", pid=1, instance="cpu0#1",
                           protocol=wire.PROTOCOL_VERSION)  # fmt: skip
    return pool.join(b"cpu0#1", info)[1]


def test_a_file_touched_once_a_worker_loaded_its_version_leaves_the_copy_served(
    tmp_path: Path,
) -> None:
    """A frontend checked a version's files again after its worker said LOADED: a touch
    just after the load (here model.py's mtime) read as a change made while it loaded,
    and the frontend sent UNLOAD. With --frontends N that dropped the copy every
    frontend served: the model went NOT ready on all of them for good (a test that
    touched model.py once both frontends said ready failed so). The worker checks the
    files it reads now (wire.Header.files): the LOAD names them, and a copy is kept."""
    failed: list[str] = []

    class Queues:
        add_model = staticmethod(lambda cfg: None)
        has = staticmethod(lambda key: True)
        fail_queued = staticmethod(lambda key, error: failed.append(str(error)))

    async def body() -> None:
        pool, link = WorkerPool(), _Sent()
        ctl = control.ModelControl(tmp_path, pool, link, Queues(), False, time.monotonic,  # type: ignore[arg-type]
                                   lambda: None, lambda: None)  # fmt: skip
        d = make_model(tmp_path, "scaled", 2.0)
        ctl.start_with({"scaled": load_model_config(d)})
        worker = _worker(pool)
        ctl.worker_ready(worker)
        await link.heard.wait()  # (the files are read off the loop first)
        (load,) = sent = link.headers
        assert (load.kind, load.model, load.version) == (wire.Header.LOAD, "scaled", "1")
        assert (load.files, load.folder) == (digest(files_of(d)), identity(tmp_path))
        assert not load.held
        os.utime(d / "model.py", ns=(1, 1))  # touched as soon as it was loaded
        ctl.on_loaded(worker, wire.Header(kind=wire.Header.LOADED, model="scaled", version="1"))
        await asyncio.gather(*ctl._tasks)
        assert [h.kind for h in sent] == [wire.Header.LOAD]  # no UNLOAD
        assert ctl.ready("scaled") and "scaled@1" in worker.models and not failed

    asyncio.run(body())


def test_a_load_names_the_folder_its_files_were_read_in_then_not_at_start(
    tmp_path: Path,
) -> None:
    """The frontend took its repository folder's identity once, at start: after a deploy
    flipped the repository's symlink to a new release, a worker reading it seemed to read
    a copy elsewhere, and was not held to the files its version was read from."""

    class Queues:
        add_model = staticmethod(lambda cfg: None)

    async def body() -> None:
        make_model(tmp_path / "release-1", "scaled", 2.0)
        (current := tmp_path / "current").symlink_to(tmp_path / "release-1")
        pool, link = WorkerPool(), _Sent()
        ctl = control.ModelControl(current, pool, link, Queues(), True, time.monotonic,  # type: ignore[arg-type]
                                   lambda: None, lambda: None)  # fmt: skip
        worker = _worker(pool)
        d = make_model(tmp_path / "release-2", "scaled", 3.0)
        current.unlink()
        current.symlink_to(tmp_path / "release-2")  # the deploy
        load = asyncio.create_task(ctl.load("scaled"))
        await link.heard.wait()
        sent = link.headers
        new, old = identity(tmp_path / "release-2"), identity(tmp_path / "release-1")
        assert sent[-1].folder == new != old
        assert sent[-1].files == digest(files_of(d))
        ctl.on_loaded(worker, wire.Header(kind=wire.Header.LOADED, model="scaled", version="1"))
        assert (await load).version == "1"

    asyncio.run(body())


def test_a_load_no_worker_may_take_keeps_no_version_number_nor_file_list(
    tmp_path: Path,
) -> None:
    """Each failed load kept its model's file list (1.3 MB a load for a folder of 5,000
    files, for ever), and a load refused for want of a worker used up a version."""
    make_model(tmp_path, "first", 6.0)

    async def body() -> None:
        ctl = control.ModelControl(tmp_path, WorkerPool(), None, None, True, time.monotonic,  # type: ignore[arg-type]
                                   lambda: None, lambda: None)  # fmt: skip
        for _ in range(3):
            with pytest.raises(Unavailable, match="no live worker may load model 'first'"):
                await ctl.load("first")
        assert ctl._files == {} and ctl._versions == {}

    asyncio.run(body())


SLOW_LOAD = """
import time

def load(device):
    time.sleep(1.5)
    return lambda x: x * 2
"""


def test_the_load_timeout_counts_each_load_from_its_start_not_from_the_load_call(
    tmp_path: Path,
) -> None:
    """A worker loads its models one at a time: three loads of 1.5 s each under a 2 s
    limit all land (counted from when each was sent, the worker was killed and
    restarted for ever, and the server was never ready)."""
    for name in ("a", "b", "c"):
        d = tmp_path / "repo" / name
        d.mkdir(parents=True)
        (d / "model.toml").write_text(MODEL_TOML)
        (d / "model.py").write_text(SLOW_LOAD)
    s = ServerProcess(tmp_path / "repo", "--load-timeout", "2", log_dir=tmp_path, workers=1)
    s.start()
    try:
        with Client(s.url) as c:
            assert [y(c, name, 1.0) for name in "abc"] == [2.0, 2.0, 2.0]
        assert "ran past --load-timeout" not in s.log()
    finally:
        assert s.stop() == 0, s.log()


def test_an_unload_during_a_model_s_first_load_unloads_it_once_loaded(
    server: ServerProcess, repo: Path
) -> None:
    """It waits for the load, then unloads (it used to return at once, a silent
    success, and the load installed the model after it)."""
    d = make_model(repo, "first", 6.0)
    gate = load_gate(d)
    gate.touch()
    try:
        with Client(server.url) as c, ThreadPoolExecutor(2) as pool:
            loading = pool.submit(Client(server.url).load_model, "first", timeout=60)
            wait_for(lambda: loaded_by(d) == WORKERS, 60, "every worker in first's load()")
            unloading = pool.submit(Client(server.url).unload_model, "first", timeout=60)
            waits = "model first: waits for the load or unload under way"
            wait_for(lambda: waits in server.log(), 30, "the unload to wait for the load")
            assert not unloading.done()  # (before: done at once, a silent success)
            gate.unlink()
            loading.result(60)
            unloading.result(60)
            with pytest.raises(ModelNotFound):
                y(c, "first", 1.0)
    finally:
        gate.unlink(missing_ok=True)


def test_a_load_asking_for_more_instances_than_started_says_so(
    server: ServerProcess, repo: Path
) -> None:
    """Worker processes are planned when the server starts: a model loaded later with
    [instances] count = 3 ran on the workers there were, and nothing said so."""
    make_model(repo, "copies", 7.0, MODEL_TOML + "\n[instances]\ncount = 3\n")
    with Client(server.url) as c:
        c.load_model("copies", timeout=60)
        assert y(c, "copies", 1.0) == 7.0
        c.unload_model("copies", timeout=60)
    assert "[instances] count takes effect at start-up: restart for more" in server.log()


def test_the_index_reads_nothing_outside_the_repository(
    server: ServerProcess, repo: Path, tmp_path: Path
) -> None:
    """RepositoryIndex parsed each folder's model.toml itself, a folder linked from
    outside the repository too (loading refuses it); it reads the repository as loading
    does now, off the event loop: that folder is listed, refused, saying why."""
    outside = make_model(tmp_path, "elsewhere", 1.0)
    (repo / "linked").symlink_to(outside)
    try:
        with Client(server.url) as c:
            entry = {m["name"]: m for m in c.repository_index()}["linked"]
        assert entry["state"] == "UNAVAILABLE" and "outside the model repository" in entry["reason"]
    finally:
        (repo / "linked").unlink()


def test_a_folder_whose_name_is_not_utf8_is_listed_escaped_not_failing_the_index(
    server: ServerProcess, repo: Path
) -> None:
    """Its name, with a lone surrogate, failed RepositoryIndex for every caller (gRPC
    UNKNOWN, HTTP 500, a traceback each time); it is listed, escaped, saying why."""
    odd = Path(os.fsdecode(bytes(repo) + b"/caf\xe9"))
    shutil.copytree(make_model(repo, "plain", 1.0), odd)
    try:
        with Client(server.url) as c:
            listed = {m["name"]: m for m in c.repository_index()}
        assert listed["caf\\udce9"]["reason"] == "its folder's name is not UTF-8"
        assert listed["plain"]["state"] == "UNAVAILABLE"  # (not loaded: the rest is listed)
    finally:
        shutil.rmtree(odd)


def test_an_http_body_that_arrives_across_a_reload_is_served_by_the_new_version(
    server: ServerProcess, repo: Path
) -> None:
    """The route resolved the version before the body came, then refused the request
    (404, "model has no version '1'") when a reload had replaced it meanwhile, though
    its URL named no version."""
    make_model(repo, "uploaded", 3.0)
    body = json.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32",
                                   "data": [1.0]}]}).encode()  # fmt: skip
    with Client(server.url) as c:
        c.load_model("uploaded", timeout=60)
        s = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
        try:
            s.sendall(b"POST /v2/models/uploaded/infer HTTP/1.1\r\nHost: [::1]\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))  # fmt: skip
            c.load_model("uploaded", timeout=60)  # version 2, while the body comes
            s.sendall(body[10:])
            answer = s.recv(65536)
        finally:
            s.close()
        c.unload_model("uploaded", timeout=60)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert b'"model_version":"2"' in answer


def test_a_version_retires_once_the_requests_admitted_to_it_are_answered(
    tmp_path: Path,
) -> None:
    """A request decoded off the loop (over 16k typed values) is admitted, but not yet
    queued: a reload retired its version meanwhile, and it failed UNAVAILABLE (13 of
    6,674 in a review's 100 reloads under load). The retirement waits for it."""
    cfg = load_model_config(make_model(tmp_path, "wide", 1.0))
    removed: list[str] = []
    asked = [0]
    seen_twice = asyncio.Event()

    class Pool:  # its workers hold the version and run nothing of it
        model_ready = staticmethod(lambda key: True)
        inflight = staticmethod(lambda key: 0)
        forget_hung = staticmethod(lambda key: None)
        workers = staticmethod(lambda: [])

    class Queues:  # nothing of it queued
        queued_version = staticmethod(lambda key, jobs=False: 0)
        remove_model = staticmethod(removed.append)

    def answering(name: str, version: str) -> int:  # one request of it still decoding
        asked[0] += 1
        if asked[0] == 2:
            seen_twice.set()
        return 1 if asked[0] <= 2 else 0

    async def body() -> None:
        ctl = control.ModelControl(tmp_path, Pool(), None, Queues(), True, time.monotonic,  # type: ignore[arg-type]
                                   lambda: None, lambda: None, answering)  # fmt: skip
        retire = asyncio.create_task(ctl._retire(cfg))
        await asyncio.wait_for(seen_twice.wait(), 10)
        assert not removed  # polled twice, with the request open: the version stays
        await asyncio.wait_for(retire, 10)  # answered: then it goes
        assert removed == [cfg.key]

    asyncio.run(body())


def test_an_unload_sent_while_a_first_load_reads_its_files_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load reads the repository (off the loop) before it says it loads: an unload
    then found nothing loaded nor loading, returned at once, and the model loaded after
    it served (a review's model folder of 30,000 files gave it the time)."""
    make_model(tmp_path, "first", 6.0)
    reading, go_on = threading.Event(), threading.Event()

    def slow_find(root: Path, name: str, unique: bool = False) -> Any:
        reading.set()
        go_on.wait(30)
        return find_model(root, name, unique)

    monkeypatch.setattr(control.repo, "find_model", slow_find)

    async def body() -> list[str]:
        ctl = control.ModelControl(tmp_path, WorkerPool(), None, None, True, time.monotonic,  # type: ignore[arg-type]
                                   lambda: None, lambda: None)  # fmt: skip
        order: list[str] = []
        load = asyncio.ensure_future(ctl.load("first"))
        # (a find_model of another signature failed the load unread: 30 s, and passed)
        assert await asyncio.to_thread(reading.wait, 30), load
        unload = asyncio.ensure_future(ctl.unload("first"))
        unload.add_done_callback(lambda _: order.append("unload"))
        load.add_done_callback(lambda _: order.append("load"))
        for _ in range(20):  # (the unload's chance to return at once, as it did)
            await asyncio.sleep(0)
        go_on.set()
        await asyncio.wait([load, unload])
        return order

    assert asyncio.run(body()) == ["load", "unload"]


def test_a_worker_cut_off_while_its_version_retired_unloads_it_on_its_return(
    tmp_path: Path,
) -> None:
    """A remote worker the frontend lost (silent: cut off, here SIGSTOP) and that came
    back held the version retired meanwhile for good: the frontend had sent its
    UNLOAD only to the workers it knew. Its READY now says what it holds."""
    d = make_model(tmp_path / "repo", "scaled", 1.0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    args = ("--model-control", "explicit", "--load-model", "scaled", "--no-local-workers",
            "--worker-endpoint", endpoint)  # fmt: skip
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start(ready=False)
    logs = {w: tmp_path / f"{w}.log" for w in ("W1", "W2")}

    def worker(name: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "batchd.worker", "--connect", endpoint, "--id", name,
               "--model-repository", str(tmp_path / "repo"), "--threads", "1"]  # fmt: skip
        with logs[name].open("wb") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    workers = {name: worker(name) for name in logs}
    try:
        wait_for(lambda: loaded_by(d, 1.0) == 2, 60, "both workers to load version 1")
        with Client(server.url) as c:
            wait_for(c.ready, 60, "ServerReady")
            workers["W2"].send_signal(signal.SIGSTOP)
            wait_for(lambda: "worker W2 lost" in server.log(), 60, "W2 to be lost")
            (d / "scale.txt").write_text("2.0")
            c.load_model("scaled", timeout=60)  # on W1 alone; version 1 retires there
            wait_for(lambda: "model scaled version 1 unloaded" in server.log(), 60, "retired")
            workers["W2"].send_signal(signal.SIGCONT)
            wait_for(lambda: server.log().count("worker W2 registered") == 2, 60, "W2 back")
            wait_for(lambda: loaded_by(d, 2.0) == 2, 60, "W2 to load version 2")
            gone = "unloaded model scaled version 1"
            wait_for(lambda: gone in logs["W2"].read_text(), 60, "W2 to drop version 1")
            assert y(c, "scaled", 1.0) == 2.0
    finally:
        for p in workers.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
        assert server.stop() == 0, server.log()


def test_an_unload_waits_for_the_drains_under_way_not_for_those_reloads_start_after_it(
    tmp_path: Path,
) -> None:
    """It waited for every drain of its model, and each reload under way added one: a
    reload a second kept an unload waiting 21 s, its own version drained in 1 ms. A name
    no model may have is refused, as a load refuses it, not answered OK."""

    async def body() -> None:
        ctl = control.ModelControl(tmp_path, WorkerPool(), None, None, True, time.monotonic,  # type: ignore[arg-type]
                                   lambda: None, lambda: None)  # fmt: skip
        now, later = asyncio.Event(), asyncio.Event()
        ctl._retiring["m"] = {asyncio.create_task(now.wait())}
        unload = asyncio.create_task(ctl.unload("m"))
        for _ in range(5):
            await asyncio.sleep(0)
        ctl._retiring["m"].add(asyncio.create_task(later.wait()))  # a reload's, after it
        now.set()
        await asyncio.wait_for(unload, 10)
        assert not later.is_set()
        later.set()
        for name in ("", "../x", "a\x00b", "x" * 100_000):
            with pytest.raises(control.InvalidInput, match=r"not starting with '\.' or '-'\)"):
                await ctl.unload(name)

    asyncio.run(body())


def test_a_symlink_loop_in_the_repository_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """RuntimeError ("Symlink loop"), answered UNKNOWN with a traceback in the log."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ConfigError, match=r"loop: cannot be resolved: Symlink loop"):
        find_model(tmp_path, "loop")


def test_a_loaded_answered_out_of_turn_leaves_the_running_load_s_clock(tmp_path: Path) -> None:
    """A worker loads one model at a time, so its LOADED for the load it ran restarts the
    clock of the next (--load-timeout: pool.overdue). A LOADED for a later one, answered at
    once (a model the worker held: worker/loading.py at_once), restarted it too: each such
    answer put off the flagging of a hung load by the full timeout (review 54k)."""
    now = [0.0]

    async def body() -> None:
        pool = WorkerPool()
        ctl = control.ModelControl(tmp_path, pool, _Sent(), object(), False, lambda: now[0],  # type: ignore[arg-type]
                                   lambda: None, lambda: None)  # fmt: skip
        worker = _worker(pool)
        worker.load_sent = {"hung@1": 0.0, "held@1": 0.0, "next@1": 0.0}
        now[0] = 100.0
        ctl.on_loaded(worker, wire.Header(kind=wire.Header.LOADED, model="held", version="1"))
        assert worker.load_sent == {"hung@1": 0.0, "next@1": 0.0}  # (out of turn: at once)
        ctl.on_loaded(worker, wire.Header(kind=wire.Header.LOADED, model="hung", version="1"))
        assert worker.load_sent == {"next@1": 100.0}  # (its turn: the worker starts the next)

    asyncio.run(body())


HANGING_FINALIZER = """
import time
class _Held:  # what load() returns; dropping it (or collecting it: `cycle`) never ends
    def __init__(self, fn, cycle):
        self.fn, self.me = fn, self if cycle else None
    def __call__(self, x):
        return self.fn(x)
    def __del__(self):
        time.sleep(3600)
_load = load
def load(device):
    return _Held(_load(device), CYCLE)
"""


@pytest.mark.parametrize("cycle", [False, True], ids=["freed", "collected"])
def test_an_unloaded_model_s_finalizer_that_hangs_is_its_own_fault_within_its_limit(
    tmp_path: Path, cycle: bool
) -> None:
    """An unloaded model's finalizer (a __del__ run as its last reference goes, or as the
    collection after the unload frees its cycle) that never returned held the worker,
    its heartbeats saying idle: the next batch of another model was blamed, after that
    model's 60 s (review 57f). Dropping a model is held to its own execution_timeout_s
    (2 s here), the collection after (every model's objects) to 10 s at least: the
    worker is replaced, the other model's call answered."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    toml = MODEL_TOML + "\n[instances]\nexecution_timeout_s = 2\n"
    stuck = make_model(tmp_path / "repo", "stuck", 3.0, toml)
    with (stuck / "model.py").open("a") as f:
        f.write(f"\nCYCLE = {cycle}\n{HANGING_FINALIZER}")
    args = ("--model-control", "explicit", "--load-model", "*", "--workers", "1")
    s = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    try:
        with Client(s.url) as c:
            assert y(c, "stuck", 1.0) == 3.0
            c.unload_model("stuck")
            lost = f"finalizer) ran past execution_timeout_s {10.0 if cycle else 2.0}"
            wait_for(lambda: lost in s.log(), 40, "the worker found stuck in the finalizer")
            assert "model 'scaled'" not in s.log().split(lost)[0].splitlines()[-1]
            assert c.infer("scaled", {"X": np.ones((1, 1), np.float32)}, timeout=30)["Y"][0, 0] == 2
    finally:
        assert s.stop() == 0, s.log()
