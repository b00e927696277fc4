"""Step-wise models against real processes: streamed outputs and continuous
batching over ModelStreamInfer, on the `stepper` test model (its call log shows
which sequences stepped together) and the example `decoder`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import wire
from batchd.protos.model_config import ModelConfig
from batchd.server.errors import BatchdError
from batchd.server.flow import StepStream, StreamBudget
from batchd.server.pool import WorkerPool
from batchd.server.sequences import IDLE_WATCHES, Sequences
from batchd.server.stats import Stats
from tests.conftest import Gate, request, scrape, stepwise_model, stepwise_toml, value
from tests.servers import TEST_MODELS, ServerProcess, wait_for

OWN = [("grpc.use_local_subchannel_pool", 1)]


def stepper(seq: int, steps: int, empty_final: bool = True) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="stepper", id=str(seq))
    for name, number in (("ID", seq), ("STEPS", steps)):
        msg.inputs.add(name=name, datatype="INT64", shape=[1])
        msg.raw_input_contents.append(np.array([number], np.int64).tobytes())
    if empty_final:
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


def decoder(prompt: list[int], new: int, rid: str = "") -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="decoder", id=rid)
    msg.inputs.add(name="PROMPT", datatype="INT64", shape=[len(prompt)])
    msg.inputs.add(name="MAX_NEW_TOKENS", datatype="INT64", shape=[1])
    msg.raw_input_contents.extend(
        [np.array(prompt, np.int64).tobytes(), np.array([new], np.int64).tobytes()]
    )
    return msg


def values(response: pb.ModelStreamInferResponse) -> list[int]:
    raw = response.infer_response.raw_output_contents
    return [int(v) for r in raw for v in np.frombuffer(r, np.int64)]


def final(response: pb.ModelStreamInferResponse) -> bool:
    return response.infer_response.parameters["triton_final_response"].bool_param


@pytest.fixture
def stub(test_server: ServerProcess) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(test_server.url, options=OWN) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def records(gate: Gate, kind: str) -> list[dict[str, Any]]:
    return [r for r in gate.records("stepper") if kind in r]


def test_a_sequence_streams_each_step_and_marks_its_end(stub: Any, gate: Gate) -> None:
    out = list(stub.ModelStreamInfer(iter([stepper(7, 3)]), timeout=30))
    assert [values(r) for r in out] == [[7001], [7002], [7003], []]
    assert [final(r) for r in out] == [False, False, False, True]
    assert {r.infer_response.id for r in out} == {"7"}
    out = list(stub.ModelStreamInfer(iter([stepper(8, 2, empty_final=False)]), timeout=30))
    assert [(values(r), final(r)) for r in out] == [([8001], False), ([8002], True)]
    joined = stub.ModelInfer(stepper(9, 4), timeout=30)  # unary: every step, joined
    assert np.frombuffer(joined.raw_output_contents[0], np.int64).tolist() == [
        9001, 9002, 9003, 9004,
    ]  # fmt: skip
    assert list(joined.outputs[0].shape) == [4]
    config = stub.ModelConfig(pb.ModelConfigRequest(name="stepper")).config
    assert config.model_transaction_policy.decoupled
    wrong = stepper(10, 2, empty_final=False)  # "true" as a string was read as false
    wrong.parameters["triton_enable_empty_final_response"].string_param = "true"
    (refused,) = list(stub.ModelStreamInfer(iter([wrong]), timeout=30))
    assert refused.error_message == (
        "parameter 'triton_enable_empty_final_response': expected a boolean, got string_param"
    )


def active(server: ServerProcess) -> float:
    return value(scrape(server), "batchd_sequences_active", model="stepper", version="1")


@contextmanager
def held(gate: Gate, seq: int) -> Iterator[None]:
    """While in it, sequence `seq` (and the others on its worker) stops after two outputs."""
    hold = gate.state / f"hold-{seq}"
    hold.touch()
    try:
        yield
    finally:
        hold.unlink(missing_ok=True)


def queued(server: ServerProcess) -> float:
    """Sequences of stepper waiting for a slot."""
    labels = {"model": "stepper", "version": "1"}
    return value(scrape(server), "batchd_inference_pending_request_count", **labels)


def test_a_short_sequence_sent_after_a_long_one_started_finishes_first(
    stub: Any, gate: Gate, test_server: ServerProcess
) -> None:
    ends: list[str] = []

    def read(stream: Any, name: str) -> None:
        for _ in stream:
            pass
        ends.append(name)

    with held(gate, 21):  # 21's third step waits: 22 is sent and started meanwhile
        long_stream = stub.ModelStreamInfer(iter([stepper(21, 50)]), timeout=60)
        assert [values(next(long_stream)) for _ in range(2)] == [[21001], [21002]]
        short_stream = stub.ModelStreamInfer(iter([stepper(22, 2)]), timeout=60)
        short = threading.Thread(target=read, args=(short_stream, "short"))
        short.start()
        wait_for(lambda: active(test_server) == 2, 30, "22 in a slot beside 21")
    reader = threading.Thread(target=read, args=(long_stream, "long"))
    reader.start()
    short.join(60)
    reader.join(60)
    assert sorted(ends) == ["long", "short"]  # both streams read to their end
    # Which stream's reader thread ends first is the host's scheduling (on a loaded
    # host the short one's slept past the long one's 48 steps): the model's own record
    # of its rounds says which sequence finished first.
    rounds = [r["stepped"] for r in records(gate, "stepped") if {21, 22} & set(r["stepped"])]
    assert [r for r in rounds if 22 in r] == [[21, 22], [21, 22]]  # it joined the batch
    assert max(i for i, r in enumerate(rounds) if 22 in r) < len(rounds) - 1  # and ended
    assert rounds[-1] == [21]  # first: the long one stepped on alone


def test_a_cancelled_sequence_frees_its_slot_and_is_not_stepped_again(
    stub: Any, gate: Gate, test_server: ServerProcess
) -> None:
    """stepper has 3 slots: 3 long sequences fill them, held so none can end;
    cancelling one lets a fourth start, and the model never steps the cancelled
    one after it released it."""
    with held(gate, 31):  # 31's worker waits in 31's third step, the others with it
        first = stub.ModelStreamInfer(iter([stepper(31, 50)]), timeout=60)
        assert [values(next(first)) for _ in range(2)] == [[31001], [31002]]
        others = [stub.ModelStreamInfer(iter([stepper(s, 50)]), timeout=60) for s in (32, 33)]
        wait_for(lambda: active(test_server) == 3, 30, "3 sequences in the 3 slots")
        fourth = stub.ModelStreamInfer(iter([stepper(34, 2)]), timeout=60)
        wait_for(lambda: queued(test_server) == 1, 30, "34 waiting for a slot")
        first.cancel()
        # Only 31's slot can take 34 while nobody steps: the frontend starts it at once.
        wait_for(lambda: queued(test_server) == 0 and active(test_server) == 3, 30,
                 "34 to take 31's slot")  # fmt: skip
    assert [values(r) for r in fourth] == [[34001], [34002], []]
    wait_for(lambda: any(31 in r["released"] for r in records(gate, "released")), 30,
             "the worker to release sequence 31")  # fmt: skip
    log = gate.records("stepper")
    released = next(i for i, r in enumerate(log) if 31 in r.get("released", []))
    assert any(31 in r.get("stepped", []) for r in log[:released])
    assert not any(31 in r.get("stepped", []) for r in log[released:])
    assert any(34 in r.get("stepped", []) for r in log[released:])
    for s in others:
        s.cancel()
    wait_for(lambda: {32, 33} <= {i for r in records(gate, "released") for i in r["released"]},
             30, "the others released")  # fmt: skip


def test_a_full_queue_rejects_a_sequence_at_once(
    stub: Any, gate: Gate, test_server: ServerProcess
) -> None:
    gate.close()  # steps hold: 3 sequences fill the slots, 2 more fill the queue
    streams = [stub.ModelStreamInfer(iter([stepper(s, 2)]), timeout=60) for s in range(41, 46)]
    labels = {"model": "stepper", "version": "1"}
    queued = "batchd_inference_pending_request_count"
    wait_for(lambda: active(test_server) == 3 and value(scrape(test_server), queued, **labels) == 2,
             30, "3 sequences in their slots and 2 queued")  # fmt: skip
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(stepper(46, 2), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue_size 2" in (e.value.details() or "")
        # on a stream: the same refusal, with a pushback as the unary call's trailer has
        assert int(dict(e.value.trailing_metadata() or ())["grpc-retry-pushback-ms"]) > 0
        (refused,) = list(stub.ModelStreamInfer(iter([stepper(47, 2)]), timeout=30))
        params = refused.infer_response.parameters
        assert "max_queue_size 2" in refused.error_message
        assert params["error_code"].string_param == "RESOURCE_EXHAUSTED"
        assert params["retry_pushback_ms"].int64_param > 0
    finally:
        gate.open()
    assert all([values(r) for r in s][-1] == [] for s in streams)  # each ends normally


def test_model_errors_fail_only_their_sequences(stub: Any, gate: Gate) -> None:
    fine = stub.ModelStreamInfer(iter([stepper(51, 30)]), timeout=60)
    next(fine)
    (refused,) = list(stub.ModelStreamInfer(iter([stepper(-1, 3)]), timeout=30))
    assert "start() raised: ValueError: sequence -1 refuses to start" in refused.error_message
    assert refused.infer_response.id == "-1"
    assert values(next(fine)) != []  # 51 steps on: start() failed only the joiner
    with pytest.raises(grpc.RpcError) as e:  # its caller's inputs, refused by start()
        stub.ModelInfer(stepper(-3, 3), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "model 'stepper' refused the inputs: ID -3 is not a sequence this model runs"
    )
    assert values(next(fine)) != []
    fine.cancel()
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(stepper(-2, 5), timeout=30)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "step() raised: ValueError: sequence -2 fails at its second step" in (
        e.value.details() or ""
    )
    assert [values(r) for r in stub.ModelStreamInfer(iter([stepper(52, 1)]), timeout=30)] == [
        [52001], [],
    ]  # fmt: skip


def test_a_sequence_in_a_mixed_batch_equals_the_same_sequence_alone(
    example_server: ServerProcess,
) -> None:
    """The example decoder: continuous batching stacks the KV caches of sequences of
    every length, joining and leaving; each sequence's tokens are those it gets
    alone."""
    cases = [([5, 6, 7], 12), ([9], 3), ([40, 41, 42, 43, 44, 45], 20), ([200, 3], 7), ([17], 15)]
    with grpc.insecure_channel(example_server.url, options=OWN) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        alone = []
        for prompt, new in cases:
            r = stub.ModelInfer(decoder(prompt, new), timeout=60)
            alone.append(np.frombuffer(r.raw_output_contents[0], np.int64).tolist())
        requests = [decoder(p, n, str(i)) for i, (p, n) in enumerate(cases)]
        mixed: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
        for response in stub.ModelStreamInfer(iter(requests), timeout=120):
            assert not response.error_message, response.error_message
            mixed[response.infer_response.id] += values(response)
    assert [mixed[str(i)] for i in range(len(cases))] == alone
    assert [len(t) for t in alone] == [n for _, n in cases]


def test_tritonclient_streams_a_step_wise_model_unchanged(example_server: ServerProcess) -> None:
    """tritonclient's own streaming API, sync (start_stream, async_stream_infer) and
    asyncio (stream_infer), against the decoder: one response per token, the final
    flag on the empty last one, the decoupled policy in its config."""
    with warnings.catch_warnings():  # tritonclient's own imports warn on new Python/protobuf
        warnings.simplefilter("ignore")
        import tritonclient.grpc as triton
        import tritonclient.grpc.aio as triton_aio

    def inputs(module: Any, prompt: list[int], new: int) -> list[Any]:
        p = module.InferInput("PROMPT", [len(prompt)], "INT64")
        p.set_data_from_numpy(np.array(prompt, np.int64))
        n = module.InferInput("MAX_NEW_TOKENS", [1], "INT64")
        n.set_data_from_numpy(np.array([new], np.int64))
        return [p, n]

    with grpc.insecure_channel(example_server.url) as channel:
        alone = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(decoder([5, 6, 7], 6))
    want = np.frombuffer(alone.raw_output_contents[0], np.int64).tolist()
    client = triton.InferenceServerClient(example_server.url)
    config = client.get_model_config("decoder").config
    assert config.model_transaction_policy.decoupled
    got: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        got.append(error if error is not None else result)
        response = result.get_response() if error is None else None
        if response is not None and response.parameters["triton_final_response"].bool_param:
            done.set()

    client.start_stream(callback=callback)
    client.async_stream_infer(
        "decoder", inputs(triton, [5, 6, 7], 6), request_id="t1", enable_empty_final_response=True
    )
    assert done.wait(60)
    client.stop_stream()
    client.close()
    assert all(not isinstance(r, Exception) for r in got), got
    tokens = [int(r.as_numpy("TOKEN")[0]) for r in got if r.as_numpy("TOKEN") is not None]
    assert tokens == want and len(got) == len(want) + 1
    assert {r.get_response().id for r in got} == {"t1"}

    async def aio() -> list[int]:
        async with triton_aio.InferenceServerClient(example_server.url) as c:

            async def requests() -> AsyncIterator[dict[str, Any]]:
                yield {"model_name": "decoder", "inputs": inputs(triton_aio, [5, 6, 7], 6)}

            out = []
            async for result, error in c.stream_infer(requests()):
                assert error is None, error
                out.append(int(result.as_numpy("TOKEN")[0]))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            return out

    assert asyncio.run(aio()) == want


@pytest.fixture
def two_workers(state_dir: Any, tmp_path: Any) -> Iterator[ServerProcess]:
    server = ServerProcess(
        TEST_MODELS, log_dir=tmp_path, workers=2, env={"BATCHD_TEST_DIR": str(state_dir)}
    ).start()
    # Both workers have loaded their models (ServerReady needs only one per model).
    wait_for(lambda: server.log().count(" ready (pid ") >= 2, 60, "both workers ready")
    yield server
    assert server.stop() == 0, server.log()


def test_a_lost_worker_retries_sequences_that_streamed_nothing_and_fails_the_others(
    two_workers: ServerProcess, gate: Gate
) -> None:
    """Sequences go to the worker with the most free slots: 61 to the first, 62 to
    the second, 63 to the first again. 61 and 62 each stream two outputs, then
    their workers hold in the next step (hold-61, hold-62), so 63 waits behind 61.
    SIGKILL of the first worker: 61 has streamed and fails with UNAVAILABLE saying
    how much; 63 has streamed nothing and runs again on the live worker, to its
    end; 62 is untouched."""
    holds = [gate.state / "hold-61", gate.state / "hold-62"]  # each stops after 2 outputs
    for hold in holds:
        hold.touch()
    try:
        with grpc.insecure_channel(two_workers.url, options=OWN) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            streamed = stub.ModelStreamInfer(iter([stepper(61, 40)]), timeout=60)
            assert [values(next(streamed)), values(next(streamed))] == [[61001], [61002]]
            # 61's third step has begun, and holds its worker, before 63 is sent there
            # (on a loaded host the worker could be between steps when 63 came, and step it)
            wait_for(lambda: sum(61 in r["stepped"] for r in records(gate, "stepped")) >= 3,
                     30, "61's third step")  # fmt: skip
            other = stub.ModelStreamInfer(iter([stepper(62, 5)]), timeout=60)
            fresh = stub.ModelStreamInfer(iter([stepper(63, 3)]), timeout=60)
            active = {"model": "stepper", "version": "1"}
            wait_for(
                lambda: value(scrape(two_workers), "batchd_sequences_active", **active) == 3,
                30, "61, 62 and 63 in their slots",
            )  # fmt: skip
            (first,) = {r["pid"] for r in records(gate, "started") if 61 in r["started"]}
            os.kill(first, signal.SIGKILL)
            (failed,) = list(streamed)  # a stream carries errors as responses
            assert "after 2 output(s) were streamed" in failed.error_message
            code = failed.infer_response.parameters["error_code"].string_param
            assert code == "UNAVAILABLE" and failed.infer_response.id == "61"
            holds[1].unlink()
            assert [values(r) for r in fresh] == [[63001], [63002], [63003], []]
            assert [values(r) for r in other] == [[62000 + k] for k in range(1, 6)] + [[]]
    finally:
        for hold in holds:
            hold.unlink(missing_ok=True)
    ran = {r["pid"] for r in records(gate, "stepped") if 63 in r["stepped"]}
    assert first not in ran and ran  # it ran, on a live worker
    assert "1 request(s) requeued" in two_workers.log()  # 63: it had streamed nothing


def test_a_unary_sequence_whose_worker_was_lost_starts_over_and_answers_once(
    two_workers: ServerProcess, gate: Gate
) -> None:
    """A unary ModelInfer holds its outputs for one answer: its caller has seen none
    of them when the worker is lost, so the sequence starts over on the other worker
    (not UNAVAILABLE) and the answer holds the new run's outputs, each once."""
    hold = gate.state / "hold-71"  # 71 stops after 2 outputs, until it goes
    hold.touch()
    labels = {"model": "stepper", "version": "1"}
    try:
        with grpc.insecure_channel(two_workers.url, options=OWN) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answer = stub.ModelInfer.future(stepper(71, 5), timeout=60)
            wait_for(lambda: value(scrape(two_workers), "batchd_outputs_total", **labels) == 2,
                     30, "71's first two outputs at the frontend")  # fmt: skip
            (first,) = {r["pid"] for r in records(gate, "started") if 71 in r["started"]}
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: answer.done() or "1 request(s) requeued" in two_workers.log(),
                     30, "71 to be requeued")  # fmt: skip
            hold.unlink()
            joined = answer.result(timeout=60)
    finally:
        hold.unlink(missing_ok=True)
    assert np.frombuffer(joined.raw_output_contents[0], np.int64).tolist() == [
        71001, 71002, 71003, 71004, 71005,
    ]  # fmt: skip
    assert list(joined.outputs[0].shape) == [5]
    ran = {r["pid"] for r in records(gate, "started") if 71 in r["started"]}
    assert ran - {first}  # it started again, on a live worker


POISONED = """
import os, signal, time
import torch

class Counter:
    def start(self, requests):
        if any(int(r["N"][0]) < 0 for r in requests):
            os.kill(os.getpid(), signal.SIGKILL)  # a poison: it ends the worker's process
        return [{"n": int(r["N"][0]), "k": 0} for r in requests]

    def step(self, states):
        time.sleep(0.02)  # 150 steps: 3 s a sequence
        for s in states:
            s["k"] += 1
        return [({"OUT": torch.tensor([s["n"] * 1000 + s["k"]])}, s["k"] >= 150) for s in states]

    def release(self, state):
        pass

def load(device):
    return Counter()
"""


def test_a_sequence_that_ends_its_worker_fails_alone_not_its_neighbours(tmp_path: Path) -> None:
    """A poison sequence (N < 0 ends its worker's process as it starts) beside innocent
    ones on every worker: those that shared its process went back to the queue, and one
    started again on the other worker, the others on the first's replacement beside the
    poison, which ended it again: they were lost twice and failed. Those that had
    stepped when something new began there are not counted the first time; the poison
    alone fails. (One that starts in the same call to start() as a poison is charged
    with it: nothing tells them apart.)"""
    (d := tmp_path / "repo" / "counter").mkdir(parents=True)
    (d / "model.toml").write_text(stepwise_toml(3, 200))
    (d / "model.py").write_text(POISONED)
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path, workers=2).start()
    active = {"model": "counter", "version": "1"}

    def call(stub: Any, n: int) -> Any:
        msg = pb.ModelInferRequest(model_name="counter")
        msg.inputs.add(name="N", datatype="INT64", shape=[1])
        msg.raw_input_contents.append(np.array([n], np.int64).tobytes())
        return stub.ModelInfer.future(msg, timeout=120)

    try:
        wait_for(lambda: server.log().count(" ready (pid ") >= 2, 60, "both workers ready")
        with grpc.insecure_channel(server.url, options=OWN) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answers = {n: call(stub, n) for n in range(1, 5)}
            wait_for(  # each has stepped (steps go by rounds, 2 sequences a worker)
                lambda: value(scrape(server), "batchd_outputs_total", **active) >= 16,
                30, "two innocents on each worker, stepping",
            )  # fmt: skip
            poison = call(stub, -1)
            for n, answer in answers.items():
                got = np.frombuffer(answer.result().raw_output_contents[0], np.int64).tolist()
                assert got == [n * 1000 + k for k in range(1, 151)], (n, got[:3])
            with pytest.raises(grpc.RpcError) as failed:
                poison.result()
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "was lost 2 times" in str(failed.value.details())
    finally:
        assert server.stop() == 0, server.log()


def test_perf_analyzer_streams_against_the_example(example_server: ServerProcess,
                                                   tmp_path: Any) -> None:  # fmt: skip
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    got = subprocess.run(
        [str(root / "bench" / "get-perf-analyzer"), str(root / ".perf_analyzer")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if got.returncode != 0 or not shutil.which(got.stdout.strip().splitlines()[-1]):
        pytest.skip(f"perf_analyzer could not be installed here: {got.stderr[-300:]}")
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [{"PROMPT": [5, 6, 7], "MAX_NEW_TOKENS": [8]}]}))
    done = subprocess.run(
        [
            got.stdout.strip().splitlines()[-1], "-i", "grpc", "--streaming",
            "-u", example_server.url, "-m", "decoder", "--input-data", str(data),
            "--shape", "PROMPT:3", "--concurrency-range", "2", "--measurement-interval", "1000",
            "--stability-percentage", "100",  # it runs, whatever else the machine does
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Concurrency: 2" in done.stdout and "throughput" in done.stdout


def test_metrics_and_statistics_count_steps_outputs_and_latencies(
    stub: Any, gate: Gate, test_server: ServerProcess
) -> None:
    labels = {"model": "stepper", "version": "1"}

    def counts() -> dict[str, float]:
        m = scrape(test_server)
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="stepper")).model_stats[0]
        return {
            "outputs": value(m, "batchd_outputs_total", **labels),
            "first": value(m, "batchd_time_to_first_output_us_count", **labels),
            "between": value(m, "batchd_inter_output_us_count", **labels),
            "between_us": value(m, "batchd_inter_output_us_sum", **labels),
            "steps": value(m, "batchd_step_slots_count", **labels),
            "slots": value(m, "batchd_step_slots_sum", **labels),
            "executions": stats.execution_count,
            "sequence_steps": stats.inference_count,
        }

    before = counts()
    assert [values(r) for r in stub.ModelStreamInfer(iter([stepper(91, 3)]), timeout=30)] == [
        [91001], [91002], [91003], [],
    ]  # fmt: skip
    after = counts()
    grew = {k: after[k] - before[k] for k in after}
    assert grew["between_us"] > 0
    del grew["between_us"]
    assert grew == {
        "outputs": 3, "first": 1, "between": 2, "steps": 3, "slots": 3,
        "executions": 3, "sequence_steps": 3,
    }  # fmt: skip
    assert active(test_server) == 0


def test_an_empty_step_keeps_a_frontend_s_waiting_sequences_from_being_overdue() -> None:
    """Its sequences wait in a shared worker's loop (another frontend holds the slots):
    the worker's empty STEP says the loop steps, so this frontend does not STOP it."""
    cfg = stepwise_model()
    now = [0.0]
    pool = WorkerPool()
    _, worker = pool.join(b"w", wire.WorkerInfo(worker_id="w", device="cpu", pid=1))
    worker.models.add(cfg.key)
    r = request(cfg)
    r.stream = StepStream()
    pool.start(worker, cfg, r, 0.0)
    sequences = Sequences(pool, None, None, None, lambda: now[0], lambda: None, None)  # type: ignore[arg-type]
    limit = cfg.instances.execution_timeout_s
    now[0] = limit * 0.9
    sequences.on_step(worker, wire.Header(kind=wire.Header.STEP, model=cfg.name), [])
    assert pool.overdue(limit * 1.5) == []  # judged from the loop's last step, not the START
    assert pool.overdue(limit * 2) != []  # and a loop that stops stepping is still found


def test_the_backstop_waits_out_the_slowest_model_of_the_stream() -> None:
    """A fast model's sequence held with nothing for its caller may wait for a loan held
    by a slow model's step on the same stream, which comes within the slow model's
    execution_timeout_s: it is stopped only after IDLE_WATCHES of that (before, of its
    own 1 s: stopped with INTERNAL after 4 s while the slow step had 30 s to come),
    while that sequence runs (not once it ended: a limit of inf kept the backstop off)."""

    def timed(name: str, seconds: float) -> ModelConfig:
        cfg = stepwise_model(name=name)
        return dataclasses.replace(
            cfg, instances=dataclasses.replace(cfg.instances, execution_timeout_s=seconds)
        )

    async def body() -> None:
        fast, slow = timed("fast", 1.0), timed("slow", 10.0)
        pool, budget = WorkerPool(), StreamBudget(1 << 20)
        _, worker = pool.join(b"w", wire.WorkerInfo(worker_id="w", device="cpu", pid=1))
        worker.models |= {fast.key, slow.key}
        link = SimpleNamespace(send=lambda identity, parts, copy=False: None)
        ends = SimpleNamespace(ended=lambda key, seconds: None)  # (the scheduler's part)
        sequences = Sequences(pool, link, ends, Stats(), time.monotonic, lambda: None, None)  # type: ignore[arg-type]
        started = []
        for cfg in (fast, slow):
            r = request(cfg)
            r.future = asyncio.get_running_loop().create_future()
            r.stream = StepStream(budget=budget)
            sequences.start(cfg, [r])
            started.append(r)
        assert sorted(budget.running.values()) == [1.0, 10.0]
        waiting = started[0]
        assert waiting.stream is not None
        sequence = worker.sequences[waiting.stream.seq_id]
        waiting.stream.credit = 0  # held for credit, its caller owed nothing
        for _ in range(IDLE_WATCHES * 10):  # 30 watches of 1 s: the slow step's 3 x 10 s
            sequences._stalled(worker.identity, sequence)
            assert not waiting.future.done()
        sequences._stalled(worker.identity, sequence)
        error = waiting.future.exception()
        assert isinstance(error, BatchdError) and "made no progress for 31 s" in error.message
        # once the slow one ended, no output of it is waited for: a fast one's own limit
        assert started[1].stream is not None
        started[1].stream.close()  # (its last step came)
        again = request(fast)
        again.future = asyncio.get_running_loop().create_future()
        again.stream = StepStream(budget=budget)
        sequences.start(fast, [again])
        sequence = worker.sequences[again.stream.seq_id]
        again.stream.credit = 0
        for _ in range(IDLE_WATCHES):
            sequences._stalled(worker.identity, sequence)
        assert not again.future.done()
        sequences._stalled(worker.identity, sequence)
        assert "made no progress for 4 s" in again.future.exception().message  # type: ignore[union-attr]

    asyncio.run(body())


def test_a_sequence_held_with_nothing_for_its_caller_is_stopped_not_hung() -> None:
    """A backstop for flow control: a sequence held for credit while its caller has
    nothing to take waits for a loan another's output holds, which comes within that
    worker's execution_timeout_s. Still so after IDLE_WATCHES watches of its own limit,
    it is a defect: the sequence is stopped with INTERNAL, not left to hang its caller
    (a fourth review's own-loan deadlock did, for ever)."""

    async def body() -> None:
        cfg = stepwise_model()
        pool = WorkerPool()
        _, worker = pool.join(b"w", wire.WorkerInfo(worker_id="w", device="cpu", pid=1))
        worker.models.add(cfg.key)
        r = request(cfg)
        r.future = asyncio.get_running_loop().create_future()
        r.stream = StepStream(budget=StreamBudget(1 << 20))
        sequence = pool.start(worker, cfg, r, 0.0)
        link = SimpleNamespace(send=lambda identity, parts, copy=False: None)
        ends = SimpleNamespace(ended=lambda key, seconds: None)  # (the scheduler's part)
        sequences = Sequences(pool, link, ends, None, time.monotonic, lambda: None, None)  # type: ignore[arg-type]
        r.stream.credit = 0  # held for credit, its caller owed nothing
        for _ in range(IDLE_WATCHES):
            sequences._stalled(worker.identity, sequence)
            assert not r.future.done()
        sequences._stalled(worker.identity, sequence)
        error = r.future.exception()
        assert isinstance(error, BatchdError) and "made no progress" in error.message

    asyncio.run(body())


SLOW_CALLS_PY = '''
import time

import torch


class Slow:
    """Each start(), step() and release() takes 2.6 s, under its 3 s execution_timeout_s."""

    def start(self, requests):
        time.sleep(2.6)
        return [{"n": int(r["N"][0]), "k": 0} for r in requests]

    def step(self, states):
        time.sleep(2.6)
        for s in states:
            s["k"] += 1
        return [({"OUT": torch.tensor([s["k"]])}, s["k"] >= s["n"]) for s in states]

    def release(self, state):
        time.sleep(2.6)


def load(device):
    return Slow()
'''


def test_each_model_call_of_a_step_round_is_held_to_the_limit_alone(tmp_path: Path) -> None:
    """A round's start() and step() were held to execution_timeout_s together: one of
    each, 1.7 s under a 2 s limit (a sequence's first round), took 3.4 s and the worker
    was killed, its callers failing (review 57f); so were a step() and the release()
    of the sequence it ended (late review 57h). A one-step sequence's round here: a
    start(), a step() and a release() of 2.6 s each, under 3 s."""
    d = tmp_path / "repo" / "slow"
    d.mkdir(parents=True)
    (d / "model.toml").write_text(stepwise_toml(2, 8) + "[instances]\nexecution_timeout_s = 3\n")
    (d / "model.py").write_text(SLOW_CALLS_PY)
    s = ServerProcess(d.parent, log_dir=tmp_path).start()
    try:
        with grpc.insecure_channel(s.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answer = stub.ModelInfer(_n("slow", 1), timeout=60)
            assert list(answer.outputs[0].shape) == [1]
        assert "lost" not in s.log(), s.log()
    finally:
        assert s.stop() == 0, s.log()


def _n(model: str, n: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model)
    msg.inputs.add(name="N", datatype="INT64", shape=[1])
    msg.raw_input_contents.append(np.array([n], np.int64).tobytes())
    return msg
