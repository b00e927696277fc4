"""The serving path end to end: real server, real workers, real gRPC and ZeroMQ."""

from __future__ import annotations

import importlib.util
import warnings

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchd.client import Client, ModelNotFound
from batchd.client.codec import build_request, parse_response
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos.tensors import serialize_bytes
from tests.servers import EXAMPLES, ServerProcess


def _mlp() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("example_mlp", EXAMPLES / "mlp" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stub(example_server: ServerProcess):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(example_server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def test_health_metadata_and_config(example_server: ServerProcess, stub) -> None:  # type: ignore[no-untyped-def]
    with Client(example_server.url) as c:
        assert c.live() and c.ready() and c.model_ready("mlp")
        assert c.server_metadata()["name"] == "batchd"
        meta = c.model_metadata("mlp")
        assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 512]}]
        assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 512]}]
        known = r"embed, mlp, textpool, textpool_packed, tiny"
        with pytest.raises(ModelNotFound, match=rf"unknown model 'nope'.*{known}"):
            c.model_metadata("nope")
    config = stub.ModelConfig(pb.ModelConfigRequest(name="mlp")).config
    assert config.max_batch_size == 32
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("INPUT0", pb.TYPE_FP32, [512])
    ]
    assert not config.model_transaction_policy.decoupled


def test_mlp_returns_what_torch_returns(example_server: ServerProcess) -> None:
    x = np.random.default_rng(0).standard_normal((3, 512), dtype=np.float32)
    with Client(example_server.url) as c:
        got = c.infer("mlp", x, timeout=30)["OUTPUT0"]
    with torch.inference_mode():
        want = _mlp()(torch.from_numpy(x)).numpy()
    assert got.shape == (3, 512)
    assert np.abs(got - want).max() <= 1e-5


def test_tritonclient_works_unchanged(example_server: ServerProcess) -> None:
    with warnings.catch_warnings():  # tritonclient's own imports warn on new Python/protobuf
        warnings.simplefilter("ignore")
        import tritonclient.grpc as triton

    client = triton.InferenceServerClient(example_server.url)
    assert client.is_server_ready() and client.is_model_ready("mlp")
    assert client.get_model_config("mlp").config.max_batch_size == 32
    x = np.random.default_rng(1).standard_normal((2, 512), dtype=np.float32)
    inp = triton.InferInput("INPUT0", [2, 512], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("mlp", [inp], request_id="req-7")
    with torch.inference_mode():
        want = _mlp()(torch.from_numpy(x)).numpy()
    assert result.get_response().id == "req-7"
    assert np.abs(result.as_numpy("OUTPUT0") - want).max() <= 1e-5
    # not served is not ready, no error; an extension batchd lacks is refused, never
    # ignored (class_count=3 got the plain FP32 output back where Triton sends top-3)
    assert not client.is_model_ready("nosuch") and not client.is_model_ready("mlp", "7")
    top3 = triton.InferRequestedOutput("OUTPUT0", class_count=3)
    with pytest.raises(triton.InferenceServerException, match="'classification'") as e:
        client.infer("mlp", [inp], outputs=[top3])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.close()


def test_bytes_input_and_outputs_filter(stub) -> None:  # type: ignore[no-untyped-def]
    texts = np.array([[b"hello"], [b"a longer sentence"]], dtype=object)
    both = parse_response(stub.ModelInfer(build_request("embed", {"TEXT": texts})))
    assert both["EMBEDDING"].shape == (2, 64)
    assert np.allclose(np.linalg.norm(both["EMBEDDING"], axis=1), 1.0, atol=1e-5)
    assert both["LENGTH"].tolist() == [[5], [17]]
    only = stub.ModelInfer(build_request("embed", {"TEXT": texts}, ["LENGTH"], request_id="x1"))
    assert [o.name for o in only.outputs] == ["LENGTH"] and only.id == "x1"


def test_typed_contents_are_accepted(stub) -> None:  # type: ignore[no-untyped-def]
    values = [float(i) for i in range(16)]
    msg = pb.ModelInferRequest(
        model_name="tiny",
        inputs=[
            pb.InferInputTensor(
                name="INPUT0",
                datatype="FP32",
                shape=[1, 16],
                contents=pb.InferTensorContents(fp32_contents=values),
            )
        ],
    )
    typed = parse_response(stub.ModelInfer(msg))["OUTPUT0"]
    raw = parse_response(
        stub.ModelInfer(build_request("tiny", {"INPUT0": np.array([values], dtype=np.float32)}))
    )["OUTPUT0"]
    assert np.array_equal(typed, raw)


def test_stream_infer_answers_each_request(stub) -> None:  # type: ignore[no-untyped-def]
    x = np.ones((1, 16), dtype=np.float32)
    requests = [build_request("tiny", {"INPUT0": x * i}, request_id=str(i)) for i in range(5)]
    requests.append(build_request("nope", {"INPUT0": x}, request_id="bad"))
    answers = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    ids = sorted(a.infer_response.id for a in answers if not a.error_message)
    assert ids == ["0", "1", "2", "3", "4"]
    errors = [a for a in answers if a.error_message]
    assert len(errors) == 1 and errors[0].infer_response.id == "bad"
    assert "unknown model 'nope'" in errors[0].error_message


def test_repository_index_lists_every_model(stub) -> None:  # type: ignore[no-untyped-def]
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest())
    assert [(m.name, m.version, m.state) for m in index.models] == [
        ("decoder", "1", "READY"),
        ("embed", "1", "READY"),
        ("mlp", "1", "READY"),
        ("textpool", "1", "READY"),
        ("textpool_packed", "1", "READY"),
        ("tiny", "1", "READY"),
    ]
    ready_only = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
    assert len(ready_only.models) == 6


def test_health_service_and_reflection(example_server: ServerProcess) -> None:
    with grpc.insecure_channel(example_server.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mlp"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        # A name past any it answers for is refused at once: a Watch held it (up to
        # --max-message-bytes, with no token) for the life of its stream.
        long = health_pb2.HealthCheckRequest(service="m" * (1 << 20))
        for call in (health.Check, lambda r, **kw: next(health.Watch(r, **kw))):
            with pytest.raises(grpc.RpcError) as e:
                call(long, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == (
                f"service name {'m' * 40!r}... (1048576 characters): expected '' (the "
                "server), 'batchd.liveness' or a model's name, at most 200 characters")  # fmt: skip
        with pytest.raises(grpc.RpcError) as e:  # (a name of its length still: not found)
            health.Check(health_pb2.HealthCheckRequest(service="m" * 200), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {
            "inference.GRPCInferenceService", "grpc.health.v1.Health", "batchd.jobs.v1.Jobs"
        } <= names  # fmt: skip
        for symbol in ("inference.GRPCInferenceService", "batchd.jobs.v1.Jobs"):
            ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
            reply = next(refl.ServerReflectionInfo(iter([ask])))
            assert reply.file_descriptor_response.file_descriptor_proto


def _input(
    name: str = "INPUT0", datatype: str = "FP32", shape: tuple[int, ...] = (1, 16), **kw
) -> pb.InferInputTensor:  # type: ignore[no-untyped-def]
    return pb.InferInputTensor(name=name, datatype=datatype, shape=shape, **kw)


GOOD = np.zeros((1, 16), dtype=np.float32).tobytes()
BAD_REQUESTS = {
    "unknown input": (
        dict(inputs=[_input("INPUT9")], raw_input_contents=[GOOD]),
        "unknown input 'INPUT9' for model 'tiny'; expected 'INPUT0'",
    ),
    "missing input": (dict(inputs=[]), "needs input(s) ['INPUT0']"),
    "wrong datatype": (
        dict(inputs=[_input(datatype="FP64")], raw_input_contents=[GOOD]),
        "expected datatype FP32, got 'FP64'",
    ),
    "wrong shape": (
        dict(inputs=[_input(shape=(1, 15))], raw_input_contents=[GOOD]),
        "expected shape [-1, 16] (batch dim first), got [1, 15]",
    ),
    "zero rows": (
        dict(inputs=[_input(shape=(0, 16))], raw_input_contents=[b""]),
        "the batch dim must be at least 1, got 0",
    ),
    "negative dim": (
        dict(inputs=[_input(shape=(-1, 16))], raw_input_contents=[GOOD]),
        "negative dimension",
    ),
    "bytes do not match shape": (
        dict(inputs=[_input(shape=(2, 16))], raw_input_contents=[GOOD]),
        "needs 128 bytes (32 x 4), raw contents hold 64",
    ),
    "raw count mismatch": (
        dict(inputs=[_input()], raw_input_contents=[GOOD, GOOD]),
        "raw_input_contents has 2 entries, expected one per input (1)",
    ),
    "raw and typed mixed": (
        dict(
            inputs=[_input(contents=pb.InferTensorContents(fp32_contents=[0.0] * 16))],
            raw_input_contents=[GOOD],
        ),
        "use one form for all inputs",
    ),
    "typed count": (
        dict(inputs=[_input(contents=pb.InferTensorContents(fp32_contents=[1.0]))]),
        "needs 16 values, contents.fp32_contents holds 1",
    ),
    "typed wrong field": (
        dict(inputs=[_input(contents=pb.InferTensorContents(int_contents=[1] * 16))]),
        "reads contents.fp32_contents, but the request fills int_contents",
    ),
    "unknown output": (
        dict(
            inputs=[_input()],
            raw_input_contents=[GOOD],
            outputs=[pb.InferRequestedOutputTensor(name="OUT9")],
        ),
        "unknown output 'OUT9'",
    ),
    "timeout of wrong type": (
        dict(
            inputs=[_input()],
            raw_input_contents=[GOOD],
            parameters={"timeout": pb.InferParameter(string_param="1s")},
        ),
        # (it said "got string_param": protobuf's field, not what came)
        "parameter 'timeout': expected an integer of microseconds, got a string '1s'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_invalid_argument(stub, case: str) -> None:  # type: ignore[no-untyped-def]
    fields, message = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(model_name="tiny", **fields), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_truncated_bytes_element(stub) -> None:  # type: ignore[no-untyped-def]
    raw = serialize_bytes([b"hello"])[:-2]
    msg = pb.ModelInferRequest(
        model_name="embed", inputs=[_input("TEXT", "BYTES", (1, 1))], raw_input_contents=[raw]
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(msg, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "BYTES element 0 is truncated: its prefix says 5 bytes, 3 remain" in info.value.details()


def test_unknown_model_and_version(stub) -> None:  # type: ignore[no-untyped-def]
    for name, version in (("nope", ""), ("tiny", "7")):
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(pb.ModelInferRequest(model_name=name, model_version=version))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_oversized_message_is_refused(stub) -> None:  # type: ignore[no-untyped-def]
    big = b"\0" * (65 * 1024 * 1024)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(model_name="tiny", raw_input_contents=[big]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_request_bigger_than_a_batch_is_split_and_joined(example_server: ServerProcess) -> None:
    """tiny's max_batch_size is 32: 70 rows ride three batches and come back as one answer."""
    x = np.random.default_rng(2).standard_normal((70, 16), dtype=np.float32)
    with Client(example_server.url) as c:
        whole = c.infer("tiny", x, timeout=30)["OUTPUT0"]
        pieces = [c.infer("tiny", x[i : i + 30], timeout=30)["OUTPUT0"] for i in (0, 30, 60)]
    assert whole.shape == (70, 16)
    assert np.allclose(whole, np.concatenate(pieces), atol=1e-6)
