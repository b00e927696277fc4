"""ModelStatistics and /metrics against real servers: what a request split into
chunks, a batch job's lines, a reload, a stream's deadline and a restarted worker
count, and under which labels."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from batchd.client import Client, LimitExceeded, ModelNotFound
from batchd.client.views import ModelStats
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from tests.conftest import MODEL_TOML, Gate, batch_gate, make_model, model_log, scrape, value
from tests.servers import FIRST_SLOT, TEST_DEVICE, ServerProcess, wait_for


def counts(s: ModelStats) -> dict[str, int]:
    return {
        "success": s.success.count, "fail": s.fail.count, "queue": s.queue.count,
        "compute_input": s.compute_input.count, "compute_infer": s.compute_infer.count,
        "compute_output": s.compute_output.count, "rows": s.inference_count,
    }  # fmt: skip


def test_a_split_request_counts_once_and_a_job_s_lines_not_as_requests(
    test_server: ServerProcess,
) -> None:
    """`limited` takes batches of 4: 10 rows are 3 chunks, one request for ModelStatistics
    (perf_analyzer divides the queue and compute times by success.count). A job of 3
    lines adds its rows, and no request: its lines are counted by the job metrics."""
    with Client(test_server.url) as c:
        (before,) = c.model_statistics("limited")
        c.infer("limited", {"X": np.ones((10, 1), np.float32)}, timeout=30)
        (after,) = c.model_statistics("limited")
        grew = {k: v - counts(before)[k] for k, v in counts(after).items()}
        assert grew == {"success": 1, "fail": 0, "queue": 1, "compute_input": 1,
                        "compute_infer": 1, "compute_output": 1, "rows": 10}  # fmt: skip
        assert after.execution_count - before.execution_count == 3

        lines = [
            {"custom_id": f"l{i}",
             "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
            for i in range(3)
        ]  # fmt: skip
        job = c.submit_job("limited", lines)
        wait_for(lambda: c.job(job.id).ended, 60, "the job to end")
        assert (c.job(job.id).status, c.job(job.id).completed) == ("completed", 3)
        (done,) = c.model_statistics("limited")
        grew = {k: v - counts(after)[k] for k, v in counts(done).items()}
        assert grew == {"success": 0, "fail": 0, "queue": 0, "compute_input": 0,
                        "compute_infer": 0, "compute_output": 0, "rows": 3}  # fmt: skip
        assert done.queue.ns == after.queue.ns and done.compute_infer.ns == after.compute_infer.ns


WIDE_PY = """
import time, torch
def load(device):
    def run(x):  # Y: X[0, 0] zeros a row; 375 takes 0.5 s
        if int(x[0, 0]) == 375:
            time.sleep(0.5)
        return torch.zeros(x.shape[0], int(x[0, 0]))
    return run
"""


def test_a_request_that_fails_after_its_batch_ran_adds_none_of_its_times(tmp_path: Path) -> None:
    """4 rows of 1,500 bytes under --max-message-bytes 4096: each row fits (the worker's
    check), the answer does not, and the frontend refuses it. Its batch's 0.5 s of
    compute stayed in compute_infer with no count beside it: the one request answered,
    in a few ms, showed 0.5 s of compute (review 58a). A failure adds to fail alone."""
    (d := tmp_path / "repo" / "wide").mkdir(parents=True)
    (d / "model.toml").write_text(MODEL_TOML.replace("shape = [1]\n\n[batching]",
                                                     "shape = [-1]\n\n[batching]"))  # fmt: skip
    (d / "model.py").write_text(WIDE_PY)
    args = ("--max-message-bytes", "4096")
    server = ServerProcess(tmp_path / "repo", *args, log_dir=tmp_path).start()
    try:
        with Client(server.url) as c:
            with pytest.raises(LimitExceeded, match="more than a response may carry"):
                c.infer("wide", {"X": np.full((4, 1), 375, np.float32)}, timeout=30)
            assert c.infer("wide", {"X": np.ones((1, 1), np.float32)}, timeout=30)["Y"].shape == (
                1,
                1,
            )
            (s,) = c.model_statistics("wide")
        assert (s.success.count, s.fail.count, s.compute_infer.count, s.queue.count) == (1, 1, 1, 1)
        assert s.compute_infer.ns + s.queue.ns <= s.success.ns  # (the 0.5 s is not in it)
        assert (s.execution_count, s.inference_count) == (2, 5)  # (its batch ran: rows count)
    finally:
        assert server.stop() == 0, server.log()


def success(server: ServerProcess) -> dict[str, float]:
    """batchd_inference_request_success_total of `scaled`, by version label."""
    return {
        dict(labels)["version"]: v
        for (name, labels), v in scrape(server).items()
        if name == "batchd_inference_request_success_total" and ("model", "scaled") in labels
    }


def test_each_version_counts_its_own_requests(tmp_path: Path) -> None:
    """3 requests on version 1; a reload while a fourth is held in version 1's model:
    version 2 starts at zero, version 1 drains under its own counts (reported beside
    version 2 while it does, and asked for by number: NOT_FOUND before), and its last
    answer is seen after (it was never: the version went as it was counted, review 58a);
    an unload and a load start version 3 at zero. (Old versions go RETIRED_KEEP_S
    after their last answer: tests/test_stats.py.)"""
    repo = tmp_path / "repo"
    d = make_model(repo, "scaled", 2.0)
    server = ServerProcess(repo, "--model-control", "explicit", "--load-model", "scaled",
                           log_dir=tmp_path).start()  # fmt: skip
    x = {"X": np.ones((1, 1), np.float32)}
    try:
        with Client(server.url) as c, ThreadPoolExecutor(1) as pool:
            for _ in range(3):
                c.infer("scaled", x, timeout=30)
            held = batch_gate(d, 2.0)
            held.touch()
            try:
                late = pool.submit(c.infer, "scaled", x, timeout=60)
                wait_for(lambda: len(model_log(d, "entered.log")) == 4, 60, "the held batch")
                (d / "scale.txt").write_text("3.0")
                c.load_model("scaled", timeout=60)
                stats = {s.version: counts(s) for s in c.model_statistics("scaled")}
                assert sorted(stats) == ["1", "2"]  # version 1 still answers one
                assert stats["1"]["success"] == 3 and stats["1"]["rows"] == 3
                assert stats["2"]["success"] == stats["2"]["rows"] == 0
                assert success(server) == {"1": 3.0, "2": 0.0}
                (v1,) = c.model_statistics("scaled", "1")
                assert (v1.version, v1.success.count) == ("1", 3)
            finally:
                held.unlink()
            assert late.result(60)["Y"][0, 0] == 2.0  # version 1 answered it
            v1, v2 = c.model_statistics("scaled")
            assert (v1.version, v1.success.count, v1.inference_count) == ("1", 4, 4)
            assert (v2.version, v2.success.count, v2.inference_count) == ("2", 0, 0)
            assert c.infer("scaled", x, timeout=30)["Y"][0, 0] == 3.0
            assert success(server) == {"1": 4.0, "2": 1.0}
            c.unload_model("scaled", timeout=60)
            c.load_model("scaled", timeout=60)
            *older, v3 = c.model_statistics("scaled")
            assert (v3.version, v3.success.count, v3.inference_count) == ("3", 0, 0)
            assert [v.version for v in older] == ["1", "2"] and success(server)["3"] == 0.0
            with pytest.raises(
                ModelNotFound, match="has no version '7'; available: \\['1', '2', '3'\\]"
            ):
                c.model_statistics("scaled", "7")
    finally:
        assert server.stop() == 0, server.log()


def test_a_stream_request_ended_by_its_deadline_counts_as_deadline(
    unstaged_server: ServerProcess, gate: Gate
) -> None:
    """Its batch is held in the model past the call's deadline: the failure is the
    deadline's, as a unary call's is, not `cancelled`."""
    m = {"model": "gated", "version": "1"}

    def failed(reason: str) -> float:
        return value(scrape(unstaged_server), "batchd_inference_request_failure_total",
                     reason=reason, **m)  # fmt: skip

    before = {r: failed(r) for r in ("deadline", "cancelled")}
    msg = pb.ModelInferRequest(model_name="gated")
    msg.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    msg.raw_input_contents.append(np.array([[7.0]], np.float32).tobytes())
    gate.close()
    with grpc.insecure_channel(unstaged_server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ModelStreamInfer(iter([msg]), timeout=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: sum(failed(r) - n for r, n in before.items()) == 1, 30, "it counted")
    assert failed("deadline") - before["deadline"] == 1
    gate.open()
    wait_for(lambda: [7.0] in gate.calls(), 30, "the held batch to finish")


def test_worker_up_is_0_while_its_slot_restarts_under_one_label(tmp_path: Path) -> None:
    """A killed worker: its slot's series drops to 0 until the restarted process
    registers, then is 1 again; the label is the slot's, so no series is left behind."""
    repo = tmp_path / "repo"
    make_model(repo, "scaled", 2.0)
    server = ServerProcess(repo, log_dir=tmp_path).start()

    def up() -> dict[tuple[tuple[str, str], ...], float]:
        return {k[1]: v for k, v in scrape(server).items() if k[0] == "batchd_worker_up"}

    slot = (("device", TEST_DEVICE or "cpu"), ("worker", FIRST_SLOT))
    try:
        assert up() == {slot: 1.0}
        for pid in server.worker_pids():
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: up() == {slot: 0.0}, 30, "worker_up 0 while it restarts")
        wait_for(lambda: up() == {slot: 1.0}, 60, "worker_up 1 again")
        assert value(scrape(server), "batchd_worker_restarts_total", slot=FIRST_SLOT) == 1
    finally:
        assert server.stop() == 0, server.log()
