"""Model control with real processes: RepositoryModelLoad swaps a serving model
with no failed request, a broken version changes nothing, Unload drains.

`scaled` multiplies X by the number in its scale.txt, read when it loads, so
each version answers differently; a negative scale refuses to load.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd.client import AsyncClient, Client, InferenceFailed, InvalidInput, ModelNotFound
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from tests.servers import ServerProcess, wait_for

MODEL_TOML = """
max_batch_size = 8

[[input]]
name = "X"
datatype = "FP32"
shape = [1]

[[output]]
name = "Y"
datatype = "FP32"
shape = [1]

[batching]
max_queue_delay_us = 2000
"""

MODEL_PY = """
import time
from pathlib import Path

SCALE = float((Path(__file__).parent / "scale.txt").read_text())


def load(device):
    if SCALE < 0:
        raise RuntimeError(f"scale {SCALE} refuses to load")

    def run(x):
        time.sleep(0.005)  # a batch takes a while: a swap happens with batches in flight
        return x * SCALE

    return run
"""


def make_model(repo: Path, name: str, scale: float) -> Path:
    d = repo / name
    d.mkdir(parents=True)
    (d / "model.toml").write_text(MODEL_TOML)
    (d / "model.py").write_text(MODEL_PY)
    (d / "scale.txt").write_text(str(scale))
    return d


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
        log_dir=tmp_path_factory.mktemp("logs"),
        workers=2,
    ).start()
    with Client(s.url) as c:
        assert c.model_ready("scaled") and c.model_ready("spare")
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


def test_reload_under_load_fails_no_request(server: ServerProcess, repo: Path) -> None:
    (repo / "scaled" / "scale.txt").write_text("2.0")
    answers: list[tuple[bool, float, float]] = []  # (sent after the swap, x, y)
    warm, swapped = asyncio.Event(), asyncio.Event()

    async def caller(c: AsyncClient, k: int) -> None:
        i = sent_after = 0
        while sent_after < 10:
            after = swapped.is_set()
            v = float(k * 1000 + i)
            out = await c.infer("scaled", {"X": np.array([[v]], np.float32)}, timeout=10)
            answers.append((after, v, float(out["Y"][0, 0])))
            if len(answers) >= 80:  # the old version served under load first
                warm.set()
            i += 1
            sent_after += after

    async def scenario() -> None:
        async with AsyncClient(server.url) as c:
            callers = [asyncio.create_task(caller(c, k)) for k in range(8)]
            await warm.wait()
            await c.load_model("scaled")
            swapped.set()
            await asyncio.gather(*callers)  # any failed request raises here

    asyncio.run(scenario())
    before = [(v, out) for after, v, out in answers if not after]
    after = [(v, out) for after, v, out in answers if after]
    assert len(before) >= 80 and len(after) >= 80
    assert all(out == 2 * v for v, out in after)  # only the new version answers after Load
    assert any(out == v for v, out in before)
    with Client(server.url) as c:
        assert c.model_metadata("scaled")["versions"] == ["2"]
    wait_for(lambda: "model scaled version 1 unloaded" in server.log(), 10, "the old to drain")


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
                with pytest.raises(Exception, match="--model-control explicit") as e:
                    call("idle")
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
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


def test_one_model_that_fails_to_load_leaves_the_others_serving(tmp_path: Path) -> None:
    """In the default mode, a model whose load() raises is unready on its own: the
    server stays ready for the healthy one, the index names the load error, and a
    request to it (with no deadline) gets UNAVAILABLE at once, naming the error."""
    make_model(tmp_path / "repo", "scaled", 2.0)
    make_model(tmp_path / "repo", "broken", -1.0)
    s = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start(ready=False)
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
