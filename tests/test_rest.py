"""The KServe v2 REST edge (server/rest.py) against real servers over real sockets.

Everything HTTP answers is compared with what gRPC answers on the same server:
tritonclient.http (JSON and binary tensors) against tritonclient.grpc for every
example model, hand-written curl-style bodies, metadata and model control, every
error's status and message, Server-Sent Events against the gRPC stream, batch jobs,
and hostile bodies and connections (the server answers 4xx and keeps serving).

Servers: the shared `example_server` and `test_server` (conftest.py), a `strict`
one (tokens, a 64 KiB message limit, a 1 s handshake timeout, explicit model
control) and, for draining, one of the test's own.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import ssl
import time
import tracemalloc
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import json_format

from batchd.client import Client
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import jobs_pb2, jobs_pb2_grpc
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import TensorSpec
from batchd.protos.tensors import serialize_bytes, set_parameter
from batchd.protos.to_json import as_json
from batchd.server.config import Limits
from batchd.server.errors import CLIP_ITEMS, InvalidInput, ModelNotFound, ResponseTooLarge
from batchd.server.jobs import chunks, lines
from batchd.server.jobs.chunks import ModelGone
from batchd.server.jobs.rest import JobRoutes
from batchd.server.json_data import to_raw
from batchd.server.rest_codec import Wanted, json_room, parse_infer, parse_load
from batchd.server.service import InferenceService
from batchd.server.stats import Stats
from tests.certs import ADMIN_TOKEN, INFER_TOKEN, openssl
from tests.conftest import Gate, scrape, value
from tests.conftest import model as fake_model
from tests.servers import (
    EXAMPLES,
    TEST_DEVICE,
    TEST_MODELS,
    ServerProcess,
    alive,
    children,
    listening,
    wait_for,
)

with warnings.catch_warnings():  # tritonclient's own imports warn on new Python/protobuf
    warnings.simplefilter("ignore")
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

HEADER_LENGTH = "Inference-Header-Content-Length"
INFER = {"Authorization": f"Bearer {INFER_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_BODY = 65536  # the strict server's --max-message-bytes
DENIED = "missing or invalid token"
INFER_MD = [("authorization", f"Bearer {INFER_TOKEN}")]  # as gRPC metadata
ADMIN_MD = [("authorization", f"Bearer {ADMIN_TOKEN}")]

# ---- HTTP and gRPC helpers ----


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> str:
        """The `{"error": ...}` message of a refusal (and that it is JSON)."""
        assert self.headers["Content-Type"] == "application/json", self.headers
        message = self.json()["error"]
        assert isinstance(message, str)
        return message


def call(
    server: ServerProcess,
    method: str,
    path: str,
    body: bytes | str | dict[str, Any] | list[Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> Reply:
    """One request on its own connection; a dict or list body is sent as JSON."""
    if isinstance(body, dict | list):
        body = json.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Reply(r.status, r.headers, r.read())
    finally:
        conn.close()


def grpc_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The error a gRPC call fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, timeout=60, **kwargs)
    return info.value


def tensor(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def tiny_body(v: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"inputs": [tensor("INPUT0", "FP32", [1, 16], [v] * 16)], **extra}


def x_body(v: float, **extra: Any) -> dict[str, Any]:
    """A body for the gated test models (X FP32 [1, 1])."""
    return {"inputs": [tensor("X", "FP32", [1, 1], [v])], **extra}


def x_request(model: str, v: float, **params: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model)
    msg.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    msg.raw_input_contents.append(np.array([[v]], np.float32).tobytes())
    for key, number in params.items():
        msg.parameters[key].int64_param = number
    return msg


def bin_input(name: str, datatype: str, shape: list[int], size: Any) -> dict[str, Any]:
    """An input whose bytes follow the JSON header (Triton's binary extension)."""
    return {"name": name, "datatype": datatype, "shape": shape,
            "parameters": {"binary_data_size": size}}  # fmt: skip


def binary_body(head: dict[str, Any], *parts: bytes) -> tuple[bytes, dict[str, str]]:
    """Triton's binary extension: the JSON header, then the tensors' bytes."""
    text = json.dumps(head).encode()
    return text + b"".join(parts), {HEADER_LENGTH: str(len(text))}


def assert_serving(server: ServerProcess, headers: dict[str, str] | None = None) -> None:
    """A normal request is answered: the server is up and well."""
    if server.repo == TEST_MODELS or (server.repo / "gated").exists():
        r = call(server, "POST", "/v2/models/gated/infer", x_body(21.0), headers)
        assert r.status == 200, r.body
        assert r.json()["outputs"][0]["data"] == [42.0]
    else:
        r = call(server, "POST", "/v2/models/tiny/infer", tiny_body(), headers)
        assert r.status == 200, r.body
        assert r.json()["outputs"][0]["shape"] == [1, 16]


def events(body: bytes) -> list[tuple[str, Any]]:
    """Server-Sent Events: (event name, its JSON data) in order."""
    out = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        kind, data = "message", []
        for line in block.split("\n"):
            field, _, text = line.partition(": ")
            if field == "event":
                kind = text
            elif field == "data":
                data.append(text)
        out.append((kind, json.loads("\n".join(data))))
    return out


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response read off a raw socket: its status and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a whole response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    return int(head.split()[1]), body


def until_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


# ---- servers ----


@pytest.fixture(scope="module")
def stub(example_server: ServerProcess) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(example_server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def models_stub(test_server: ServerProcess) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(test_server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def small_repo(root: Path, *models: str) -> Path:
    """A repository holding copies of some tests/models (those that stand alone)."""
    for m in models:
        shutil.copytree(TEST_MODELS / m, root / m)
    return root


@pytest.fixture(scope="module")
def strict(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tokens, --max-message-bytes 64 KiB, --handshake-timeout 1 and explicit model
    control over `gated` (loaded) and `echo` (not)."""
    state = tmp_path_factory.mktemp("strict-state")
    server = ServerProcess(
        small_repo(tmp_path_factory.mktemp("strict-repo"), "gated", "echo"),
        "--auth-token-file", str(token_file), "--max-message-bytes", str(MAX_BODY),
        "--handshake-timeout", "1", "--model-control", "explicit", "--load-model", "gated",
        log_dir=tmp_path_factory.mktemp("logs"), env={"BATCHD_TEST_DIR": str(state)},
    ).start(token=INFER_TOKEN)  # fmt: skip
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def strict_stub(strict: ServerProcess) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(strict.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


# ==== 1. tritonclient.http gets what tritonclient.grpc gets, for every example ====

RNG = np.random.default_rng(11)
EXAMPLE_CALLS: list[tuple[str, dict[str, tuple[str, np.ndarray]], list[str]]] = [
    ("tiny", {"INPUT0": ("FP32", RNG.standard_normal((3, 16), dtype=np.float32))}, ["OUTPUT0"]),
    ("mlp", {"INPUT0": ("FP32", RNG.standard_normal((2, 512), dtype=np.float32))}, ["OUTPUT0"]),
    (
        "embed",
        {"TEXT": ("BYTES", np.array([[b"hello"], ["ünïcode ✓".encode()], [b""]], dtype=object))},
        ["EMBEDDING", "LENGTH"],
    ),
    *[
        (model, {"TOKENS": ("INT64", RNG.integers(1, 8000, (rows, n)))}, ["EMBEDDING"])
        for model in ("textpool", "textpool_packed")
        for rows, n in ((1, 1), (1, 7), (2, 5), (1, 40))
    ],
    *[
        (
            "decoder",
            {
                "PROMPT": ("INT64", np.array(prompt, np.int64)),
                "MAX_NEW_TOKENS": ("INT64", np.array([new], np.int64)),
            },
            ["TOKEN"],
        )
        for prompt, new in (([5, 6, 7], 6), ([200], 3))
    ],
]


@pytest.fixture(scope="module")
def tritons(example_server: ServerProcess) -> Iterator[tuple[Any, Any]]:
    h = triton_http.InferenceServerClient(f"127.0.0.1:{example_server.http_port}")
    g = triton_grpc.InferenceServerClient(example_server.url)
    yield h, g
    h.close()
    g.close()


@pytest.mark.parametrize(
    ("binary_in", "binary_out"),
    [(False, False), (True, True), (False, True), (True, False)],
    ids=["json", "binary", "json-in-binary-out", "binary-in-json-out"],
)
def test_tritonclient_http_equals_grpc_for_every_example_model(
    tritons: tuple[Any, Any], binary_in: bool, binary_out: bool
) -> None:
    """Every example model (textpool at several ragged lengths, the step-wise decoder
    joined by a unary infer) answers tritonclient.http exactly what it answers
    tritonclient.grpc, with tensors as JSON or binary in each direction."""
    h, g = tritons
    assert h.is_server_live() and h.is_server_ready()
    for i, (model, arrays, outputs) in enumerate(EXAMPLE_CALLS):
        http_inputs, grpc_inputs = [], []
        for name, (datatype, array) in arrays.items():
            hi = triton_http.InferInput(name, list(array.shape), datatype)
            hi.set_data_from_numpy(array, binary_data=binary_in)
            http_inputs.append(hi)
            gi = triton_grpc.InferInput(name, list(array.shape), datatype)
            gi.set_data_from_numpy(array)
            grpc_inputs.append(gi)
        wanted = [triton_http.InferRequestedOutput(o, binary_data=binary_out) for o in outputs]
        got = h.infer(model, http_inputs, outputs=wanted, request_id=f"r{i}")
        want = g.infer(model, grpc_inputs, request_id=f"r{i}")
        assert got.get_response()["id"] == f"r{i}"
        assert got.get_response()["model_name"] == model
        for o in outputs:
            sent = got.get_output(o)
            assert ("binary_data_size" in sent.get("parameters", {})) == binary_out, sent
            assert ("data" in sent) != binary_out
            a, b = got.as_numpy(o), want.as_numpy(o)
            assert a.dtype == b.dtype and a.shape == b.shape, (model, o, a.shape, b.shape)
            if TEST_DEVICE and a.dtype.kind == "f":  # a GPU's atomic sums vary in the last bits
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{model} {o}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{model} {o}")


# ==== 2. curl-style JSON, metadata, model control ====


def test_hand_written_json_nested_and_flat_and_binary_output(
    example_server: ServerProcess, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """Plain JSON bodies as curl would send them: `data` nested or flat gives the same
    answer as gRPC; `outputs` filters; the request-level binary_data_output parameter
    answers with the JSON header and raw bytes, as gRPC's raw_output_contents."""
    rows = np.arange(32, dtype=np.float32).reshape(2, 16) / 7
    grpc_answer = stub.ModelInfer(
        pb.ModelInferRequest(
            model_name="tiny",
            inputs=[pb.InferInputTensor(name="INPUT0", datatype="FP32", shape=[2, 16])],
            raw_input_contents=[rows.tobytes()],
        )
    )
    want = np.frombuffer(grpc_answer.raw_output_contents[0], np.float32).reshape(2, 16)
    for data in (rows.tolist(), rows.ravel().tolist()):
        r = call(example_server, "POST", "/v2/models/tiny/infer", {
            "id": "curl-1", "inputs": [tensor("INPUT0", "FP32", [2, 16], data)],
        })  # fmt: skip
        assert r.status == 200 and r.headers["Content-Type"] == "application/json", r.body
        answer = r.json()
        assert (answer["model_name"], answer["model_version"], answer["id"]) == (
            "tiny", "1", "curl-1",
        )  # fmt: skip
        (out,) = answer["outputs"]
        assert (out["name"], out["datatype"], out["shape"]) == ("OUTPUT0", "FP32", [2, 16])
        np.testing.assert_array_equal(np.array(out["data"], np.float32).reshape(2, 16), want)
    versioned = call(example_server, "POST", "/v2/models/tiny/versions/1/infer", {
        "inputs": [tensor("INPUT0", "FP32", [2, 16], rows.tolist())],
        "parameters": {"binary_data_output": True},
    })  # fmt: skip
    assert versioned.status == 200, versioned.body
    assert versioned.headers["Content-Type"] == "application/octet-stream"
    length = int(versioned.headers[HEADER_LENGTH])
    head = json.loads(versioned.body[:length])
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 128}
    assert versioned.body[length:] == grpc_answer.raw_output_contents[0]

    texts = [["hello"], ["a longer sentence"]]
    r = call(example_server, "POST", "/v2/models/embed/infer", {
        "inputs": [tensor("TEXT", "BYTES", [2, 1], texts)], "outputs": [{"name": "LENGTH"}],
    })  # fmt: skip
    assert r.status == 200, r.body
    assert r.json()["outputs"] == [
        {"name": "LENGTH", "datatype": "INT64", "shape": [2, 1], "data": [5, 17]}
    ]
    r = call(example_server, "POST", "/v2/models/textpool/infer", {
        "inputs": [tensor("TOKENS", "INT64", [2, 3], [[1, 2, 3], [4, 5, 6]])],
    })  # fmt: skip
    assert r.status == 200 and r.json()["outputs"][0]["shape"] == [2, 64], r.body


ECHO_TYPES: dict[str, list[Any]] = {
    "BOOL": [True, False, True],
    "UINT8": [0, 255, 7],
    "UINT16": [0, 65535, 7],
    "UINT32": [0, 2**32 - 1, 7],
    "UINT64": [2**64 - 1, 2**63, 2**64 - 2],
    "INT8": [-128, 127, 0],
    "INT16": [-32768, 32767, 0],
    "INT32": [-(2**31), 2**31 - 1, 0],
    "INT64": [-(2**63), 2**63 - 1, 0],
    "FP16": [0.5, -2.0, 65504.0],
    "FP32": [0.25, 1e30, -3.5],
    "FP64": [1e-300, -3.5, 1e300],
    "BF16": [1, 2, 3],  # whole numbers only: see test_bf16_json_data_takes_fractions_and_signs
}


def echo(server: ServerProcess, **data: list[Any]) -> Reply:
    """The `echo` test model, every input as JSON; `data` replaces some datatypes' values."""
    values = {**ECHO_TYPES, **data}
    inputs = [tensor(f"IN_{k}", k, [1, 3], v) for k, v in values.items()]
    inputs.append(tensor("IN_BYTES", "BYTES", [1, 2], ["héllo ✓", ""]))
    return call(server, "POST", "/v2/models/echo/infer", {"inputs": inputs})


def test_every_datatype_round_trips_through_json(test_server: ServerProcess) -> None:
    """JSON values of every datatype, at their limits, come back as they went (the echo
    model returns its inputs), BYTES as UTF-8 strings."""
    r = echo(test_server)
    assert r.status == 200, r.body
    got = {o["name"]: o for o in r.json()["outputs"]}
    for datatype, sent in [*ECHO_TYPES.items(), ("BYTES", ["héllo ✓", ""])]:
        out = got[f"OUT_{datatype}"]
        assert out["datatype"] == datatype
        assert out["data"] == sent, datatype


def test_uint64_json_data_above_int64_beside_small_values(test_server: ServerProcess) -> None:
    """UINT64 values spanning the whole range ([0, 2**64-1, 7]) are valid data."""
    r = echo(test_server, UINT64=[0, 2**64 - 1, 7])
    assert r.status == 200, r.body
    got = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert got["OUT_UINT64"] == [0, 2**64 - 1, 7]


def test_bf16_json_data_takes_fractions_and_signs(test_server: ServerProcess) -> None:
    """BF16 JSON data are numbers, as the JSON answer gives them back."""
    r = echo(test_server, BF16=[1.0, -2.0, 0.5])
    assert r.status == 200, r.body
    got = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert got["OUT_BF16"] == [1.0, -2.0, 0.5]


def echo_inputs(words: list[Any]) -> list[dict[str, Any]]:
    """echo's inputs as JSON: ECHO_TYPES, and `words` as IN_BYTES."""
    inputs = [tensor(f"IN_{k}", k, [1, 3], v) for k, v in ECHO_TYPES.items()]
    return [*inputs, tensor("IN_BYTES", "BYTES", [1, len(words)], words)]


def parser_children(server: ServerProcess) -> list[int]:
    """The server's JSON parser processes (server/parser.py)."""
    assert server.proc is not None
    return [p for p in children(server.proc.pid)
            if b"batchd.server.parser" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip


def test_a_large_json_body_is_parsed_in_the_parser_process(test_server: ServerProcess) -> None:
    """A body whose JSON passes parser.ASIDE_BYTES is parsed in the server's JSON parser
    process, whose parse holds no GIL of the event loop's: it is answered as any other,
    and a refusal found inside it says what was wrong."""
    words = [f"w{i}" for i in range(60_000)]  # 560 KB of JSON
    r = call(test_server, "POST", "/v2/models/echo/infer", {"inputs": echo_inputs(words)})
    assert r.status == 200, r.body[:200]
    got = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert got["OUT_BYTES"] == words and got["OUT_INT64"] == ECHO_TYPES["INT64"]
    assert parser_children(test_server), "no parser process beside the server"
    bad = call(test_server, "POST", "/v2/models/echo/infer",
               {"inputs": echo_inputs([*words[:-1], 7])})  # fmt: skip
    assert bad.status == 400
    assert "BYTES data holds strings, got" in bad.error, bad.error


def test_a_job_s_long_lines_are_parsed_in_the_parser_process(
    test_server: ServerProcess, tmp_path: Path
) -> None:
    """A job's lines past parser.ASIDE_BYTES are parsed in the parser process: their
    results are those of short lines, a bad one's error line keeps its custom_id, and
    a parser process that was killed is replaced for the next line."""
    words = [f"w{i}" for i in range(60_000)]
    lines = [
        {"custom_id": "long", "inputs": echo_inputs(words)},
        {"custom_id": "bad", "inputs": echo_inputs([*words[:-1], 7])},
        {"custom_id": "short", "inputs": echo_inputs(["a", "b"])},
    ]
    assert call(test_server, "POST", "/v2/models/echo/infer", lines[0]).status == 200
    [killed] = parser_children(test_server)
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: not alive(killed), 10, "the parser process to die")
    with Client(test_server.url) as c:
        job = c.submit_job("echo", lines)
        wait_for(lambda: c.job(job.id).ended, 60, "the job to end")
        assert c.job(job.id).status == "completed"
        out = tmp_path / "results.jsonl"
        c.job_results(job.id, out)
    got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {o["name"]: o["data"] for o in got["long"]["outputs"]}["OUT_BYTES"] == words
    assert {o["name"]: o["data"] for o in got["short"]["outputs"]}["OUT_BYTES"] == ["a", "b"]
    assert got["bad"]["error"]["code"] == "INVALID_ARGUMENT"
    assert "BYTES data holds strings, got" in got["bad"]["error"]["message"]
    assert parser_children(test_server) not in ([], [killed])


def msg_with_all(msg: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """`msg` for echo, completed with every other input (raw), from ECHO_TYPES."""
    for k, v in ECHO_TYPES.items():
        if k == "FP32":
            continue
        msg.inputs.add(name=f"IN_{k}", datatype=k, shape=[1, 3])
        msg.raw_input_contents.append(np.array([v], DATATYPES[k].numpy).tobytes())
    msg.inputs.add(name="IN_BYTES", datatype="BYTES", shape=[1, 1])
    msg.raw_input_contents.append(serialize_bytes([b"x"]))
    return msg


def test_json_output_of_infinities_is_not_silently_changed(
    test_server: ServerProcess, models_stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """An FP32 output holding inf, -inf and nan is given as gRPC gives it, or refused with
    a message naming binary_data (as a BYTES output that is not UTF-8 is): never changed."""
    special = np.array([[np.inf, -np.inf, np.nan]], np.float32)
    inputs = [tensor(f"IN_{k}", k, [1, 3], v) for k, v in ECHO_TYPES.items() if k != "FP32"]
    inputs.append(tensor("IN_BYTES", "BYTES", [1, 1], ["x"]))
    inputs.append(bin_input("IN_FP32", "FP32", [1, 3], 12))
    body, headers = binary_body({"inputs": inputs, "outputs": [{"name": "OUT_FP32"}]},
                                special.tobytes())  # fmt: skip
    r = call(test_server, "POST", "/v2/models/echo/infer", body, headers)
    msg = pb.ModelInferRequest(
        model_name="echo", outputs=[pb.InferRequestedOutputTensor(name="OUT_FP32")]
    )
    msg.inputs.add(name="IN_FP32", datatype="FP32", shape=[1, 3])
    msg.raw_input_contents.append(special.tobytes())
    want = np.frombuffer(models_stub.ModelInfer(msg_with_all(msg)).raw_output_contents[0], "<f4")
    if r.status != 200:
        assert r.status == 400 and "binary_data" in r.error
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32)
    np.testing.assert_array_equal(got, want)


def test_metadata_config_ready_live_and_stats_match_grpc(
    example_server: ServerProcess, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """Server metadata, health, model metadata (also by version), config, readiness,
    statistics (one model's and all) and the repository index are gRPC's answers as
    JSON; an HTTP inference is counted in the statistics gRPC reports."""
    meta = call(example_server, "GET", "/v2").json()
    grpc_meta = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert (meta["name"], meta["version"]) == (grpc_meta.name, grpc_meta.version)
    assert set(meta["extensions"]) == {*grpc_meta.extensions, "binary_tensor_data", "generate"}
    assert call(example_server, "GET", "/v2/health/live").json() == {"live": True}
    ready = call(example_server, "GET", "/v2/health/ready")
    assert (ready.status, ready.json()) == (200, {"ready": True})

    for model in ("tiny", "mlp", "embed", "textpool", "textpool_packed", "decoder"):
        for prefix in (f"/v2/models/{model}", f"/v2/models/{model}/versions/1"):
            got = json_format.ParseDict(
                call(example_server, "GET", prefix).json(), pb.ModelMetadataResponse()
            )
            assert got == stub.ModelMetadata(pb.ModelMetadataRequest(name=model)), model
            raw = call(example_server, "GET", f"{prefix}/config").json()
            want = stub.ModelConfig(pb.ModelConfigRequest(name=model)).config
            assert json_format.ParseDict(raw, pb.ModelConfig()) == want  # (sections as set)
            # every field, zeros and falses too, as Triton's JSON has them (code reads
            # config["max_batch_size"] of a model that batches nothing); a section not
            # set is left out (dynamic_batching of a model that batches nothing)
            plain = {f.name for f in pb.ModelConfig.DESCRIPTOR.fields if not f.message_type}
            assert plain <= set(raw) and all("allow_ragged_batch" in i for i in raw["input"])
            assert ("dynamic_batching" in raw) == want.HasField("dynamic_batching") == (
                model != "decoder")  # fmt: skip
            r = call(example_server, "GET", f"{prefix}/ready")
            assert (r.status, r.json()) == (200, {"name": model, "ready": True})

    def stats(path: str, name: str = "") -> tuple[pb.ModelStatisticsResponse, ...]:
        via_grpc = stub.ModelStatistics(pb.ModelStatisticsRequest(name=name))
        return tuple(  # (both parsed from JSON with every field: empty messages are set)
            json_format.ParseDict(d, pb.ModelStatisticsResponse())
            for d in (call(example_server, "GET", path).json(), as_json(via_grpc, True))
        )

    before, _ = stats("/v2/models/tiny/stats", "tiny")
    raw = call(example_server, "GET", "/v2/models/tiny/stats").json()["model_stats"][0]
    assert raw["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0}  # zeros are written
    assert call(example_server, "POST", "/v2/models/tiny/infer", tiny_body()).status == 200
    wait_for(lambda: (s := stats("/v2/models/tiny/stats", "tiny"))[0] == s[1], 10,
             "HTTP and gRPC statistics to agree")  # fmt: skip
    after, _ = stats("/v2/models/tiny/versions/1/stats", "tiny")
    old, new = before.model_stats[0], after.model_stats[0]
    assert new.inference_stats.success.count == old.inference_stats.success.count + 1
    assert new.inference_count == old.inference_count + 1
    wait_for(lambda: (s := stats("/v2/models/stats"))[0] == s[1], 10, "all models' statistics")
    every, _ = stats("/v2/models/stats")
    assert sorted(m.name for m in every.model_stats) == [
        "decoder", "embed", "mlp", "textpool", "textpool_packed", "tiny",
    ]  # fmt: skip

    for body, ready_only in ((None, False), ({"ready": True}, True)):
        index = call(example_server, "POST", "/v2/repository/index", body).json()
        grpc_index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=ready_only))
        assert index == [
            {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
            for m in grpc_index.models
        ]
        assert len(index) == 6


def test_unknown_routes_and_methods_answer_json(example_server: ServerProcess) -> None:
    """aiohttp's own refusals come as `{"error": ...}` too: 404 for a route that is not
    there, 405 with Allow for a method a route does not take."""
    missing = call(example_server, "GET", "/v2/nowhere")
    assert missing.status == 404 and "Not Found" in missing.error
    wrong = call(example_server, "DELETE", "/v2/models/tiny")
    assert wrong.status == 405 and "Method Not Allowed" in wrong.error
    assert set(wrong.headers["Allow"].split(",")) == {"GET", "HEAD"}


def test_expect_100_continue_asks_for_the_token_first(strict: ServerProcess) -> None:
    """The Expect handler runs before the middlewares: a caller without a token was told
    413 (naming the limit) or 100 Continue, never 401, before it sent its body; a job's
    upload (its limit --jobs-max-file-bytes) was told 100 Continue, then 401."""
    token = INFER["Authorization"].encode()
    for path, auth, first in (
        (b"/v2/models/gated/infer", b"", b"HTTP/1.1 401"),
        (b"/v2/models/gated/infer", token, b"HTTP/1.1 413"),
        (b"/v2/jobs?model=gated", b"", b"HTTP/1.1 401"),
        (b"/v2/jobs?model=gated", token, b"HTTP/1.1 100 Continue"),
    ):
        head = b"Authorization: " + auth + b"\r\n" if auth else b""
        with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
            expect = b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: [::1]\r\n" + head + expect)
            answer = s.recv(4096)
        refused_and_closed = b"Connection: close" in answer or first.endswith(b"Continue")
        assert answer.startswith(first) and refused_and_closed, (path, answer[:300])
    # A job file declared over --jobs-max-file-bytes (1 GiB) is refused before it is
    # sent (it was told 100 Continue, and refused once 1 GiB of it had come)
    with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/jobs?model=gated HTTP/1.1\r\nHost: [::1]\r\nAuthorization: " + token
                  + b"\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % 2**31)  # fmt: skip
        status, answer = read_response(s)
    too_large = f"the body is {2**31} bytes, more than {2**30} (--jobs-max-file-bytes)"
    assert (status, json.loads(answer)) == (413, {"error": too_large})
    # An expectation it does not understand is 417 saying so, whatever the body's size
    with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
        s.sendall(
            b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: [::1]\r\nAuthorization: "
            + token
            + b"\r\nExpect: foo\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
        )
        status, answer = read_response(s)
    assert (status, json.loads(answer)) == (
        417,
        {"error": "Expect: only 100-continue is understood; came 'foo'"},
    )


def test_load_and_unload_over_http_with_an_admin_token(
    strict: ServerProcess, strict_stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """With --model-control explicit: the index (as gRPC's), load, unload; model control
    needs an admin token, an infer token gets gRPC's refusal."""

    def index() -> list[dict[str, str]]:
        r = call(strict, "POST", "/v2/repository/index", None, ADMIN)
        grpc_index = strict_stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=ADMIN_MD)
        assert r.json() == [
            {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
            for m in grpc_index.models
        ]
        return r.json()  # type: ignore[no-any-return]

    assert {m["name"]: m["state"] for m in index()} == {"echo": "UNAVAILABLE", "gated": "READY"}
    refused = call(strict, "POST", "/v2/repository/models/echo/load", None, INFER)
    e = grpc_error(strict_stub.RepositoryModelLoad,
                   pb.RepositoryModelLoadRequest(model_name="echo"), metadata=INFER_MD)  # fmt: skip
    assert (refused.status, refused.error) == (401, e.details())
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert call(strict, "GET", "/v2/models/echo", None, INFER).status == 404

    loaded = call(strict, "POST", "/v2/repository/models/echo/load", None, ADMIN)
    assert (loaded.status, loaded.json()) == (200, {})
    assert {m["name"]: m["state"] for m in index()} == {"echo": "READY", "gated": "READY"}
    r = call(strict, "GET", "/v2/models/echo/ready", None, INFER)
    assert (r.status, r.json()) == (200, {"name": "echo", "ready": True})
    assert call(strict, "POST", "/v2/repository/index", {"ready": True}, ADMIN).json() == [
        m for m in index() if m["state"] == "READY"
    ]

    unloaded = call(strict, "POST", "/v2/repository/models/echo/unload", None, ADMIN)
    assert (unloaded.status, unloaded.json()) == (200, {})
    gone = call(strict, "GET", "/v2/models/echo", None, INFER)
    e = grpc_error(strict_stub.ModelMetadata, pb.ModelMetadataRequest(name="echo"),
                   metadata=INFER_MD)  # fmt: skip
    assert (gone.status, gone.error) == (404, e.details())
    missing = call(strict, "POST", "/v2/repository/models/nope/load", None, ADMIN)
    e = grpc_error(strict_stub.RepositoryModelLoad,
                   pb.RepositoryModelLoadRequest(model_name="nope"), metadata=ADMIN_MD)  # fmt: skip
    assert (missing.status, missing.error) == (400, e.details())


def test_a_load_with_parameters_gets_the_grpc_message(
    strict: ServerProcess, strict_stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """A load that carries parameters is refused over HTTP with gRPC's message."""
    r = call(strict, "POST", "/v2/repository/models/echo/load",
             {"parameters": {"file:x": "y", "config": "{}"}}, ADMIN)  # fmt: skip
    msg = pb.RepositoryModelLoadRequest(model_name="echo")
    msg.parameters["file:x"].string_param = "y"
    msg.parameters["config"].string_param = "{}"
    e = grpc_error(strict_stub.RepositoryModelLoad, msg, metadata=ADMIN_MD)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert r.status == 400
    assert r.error == e.details()


NO_PARAMETERS = (
    "RepositoryModelLoad takes no parameters: batchd loads models only from its "
    "repository on disk, never from the request; got "
)


class _NoModels:
    """A core that nothing may reach: a load with parameters is refused before it."""

    models: dict[str, Any] = {}
    stats = Stats()

    async def load(self, name: str) -> Any:
        raise AssertionError("a load with parameters reached the core")


def test_an_unknown_model_names_the_first_32_the_server_serves() -> None:
    """Every call to an unknown model sorted every model's name and sent them all: a
    server of 3,000 models answered each such call with 18 KB."""
    core = _NoModels()
    core.models = {f"m{i:04d}": None for i in reversed(range(3000))}
    service = InferenceService(core)  # type: ignore[arg-type]
    with pytest.raises(ModelNotFound) as e:
        service.model("nope")
    assert e.value.message.endswith("m0030, m0031, ... (3000 models)")
    assert "unknown model 'nope'; this server serves: m0000, m0001," in e.value.message
    with pytest.raises(ModelGone) as gone:  # a job's model: the same list
        chunks.job_model(core.models, "nope", "")
    assert str(gone.value).endswith("m0031, ... (3000 models))")
    core.models.clear()
    with pytest.raises(ModelNotFound, match=r"this server serves: none$"):
        service.model("nope")


def test_a_load_with_200000_parameters_is_refused_reading_a_few() -> None:
    """Refused from the first CLIP_ITEMS keys the map yields: the keys are neither all
    made Python strings nor sorted (4 million of them held the event loop for seconds)."""
    entry = b"\x12\x02\x08\x01"  # value: InferParameter(bool_param=true)
    wire = b"".join(b"\x1a\x0f\x0a\x09" + b"k%08d" % i + entry for i in range(200_000))
    msg = pb.RepositoryModelLoadRequest.FromString(
        pb.RepositoryModelLoadRequest(model_name="echo").SerializeToString() + wire
    )
    assert len(msg.parameters) == 200_000
    service = InferenceService(_NoModels())  # type: ignore[arg-type]
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput) as e:
            asyncio.run(service.load(msg))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 500_000, peak
    assert e.value.message.startswith(NO_PARAMETERS + "'k") and e.value.message.endswith(", ...")
    assert e.value.message.count("'k") == CLIP_ITEMS and len(e.value.message) < 300


def test_a_load_body_with_many_parameters_carries_a_few_for_the_refusal() -> None:
    """REST: the protobuf map of a huge `parameters` object is never built; the refusal
    quotes CLIP_ITEMS of them, and one more says there are more."""
    body = json.dumps({"parameters": {f"k{i:06d}": True for i in range(100_000)}}).encode()
    msg = parse_load(body, "echo")
    assert sorted(msg.parameters) == [f"k{i:06d}" for i in range(CLIP_ITEMS + 1)]
    few = parse_load(b'{"parameters": {"config": "{}"}}', "echo")
    assert list(few.parameters) == ["config"]


def test_model_control_when_disabled_is_409_with_the_grpc_message(
    example_server: ServerProcess, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """Without --model-control explicit, load and unload are FAILED_PRECONDITION: 409."""
    e = grpc_error(stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name="tiny"))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    for action in ("load", "unload"):
        r = call(example_server, "POST", f"/v2/repository/models/tiny/{action}")
        assert (r.status, r.error) == (409, e.details())
    assert call(example_server, "GET", "/v2/models/tiny/ready").status == 200


# ==== 3. every error: its HTTP status and gRPC's message ====

ZEROS = np.zeros((1, 16), np.float32).tobytes()


def _tiny(shape: list[int], datatype: str = "FP32", raw: bytes = ZEROS, name: str = "INPUT0",
          **fields: Any) -> pb.ModelInferRequest:  # fmt: skip
    return pb.ModelInferRequest(
        model_name="tiny",
        inputs=[pb.InferInputTensor(name=name, datatype=datatype, shape=shape)],
        raw_input_contents=[raw],
        **fields,
    )


TRUNCATED = serialize_bytes([b"hello"])[:-2]  # a BYTES element 2 bytes short

# case: (model, HTTP body (JSON, or binary and its headers), the same request for gRPC)
# fmt: off
INVALID: dict[str, tuple[str, Any, pb.ModelInferRequest]] = {
    "unknown input": ("tiny", {"inputs": [tensor("INPUT9", "FP32", [1, 16], [0.0] * 16)]},
                      _tiny([1, 16], name="INPUT9")),
    "missing input": ("tiny", {"inputs": []}, pb.ModelInferRequest(model_name="tiny")),
    "wrong datatype": ("tiny", {"inputs": [tensor("INPUT0", "FP64", [1, 16], [0.0] * 16)]},
                       _tiny([1, 16], "FP64", np.zeros(16, np.float64).tobytes())),
    "wrong shape": ("tiny", {"inputs": [tensor("INPUT0", "FP32", [1, 15], [0.0] * 15)]},
                    _tiny([1, 15], raw=ZEROS[:60])),
    "zero rows": ("tiny", {"inputs": [tensor("INPUT0", "FP32", [0, 16], [])]},
                  _tiny([0, 16], raw=b"")),
    "unknown output": ("tiny", tiny_body(0.0, outputs=[{"name": "OUT9"}]),
                       _tiny([1, 16], outputs=[pb.InferRequestedOutputTensor(name="OUT9")])),
    "timeout of wrong type": (
        "tiny", tiny_body(0.0, parameters={"timeout": "1s"}),
        _tiny([1, 16], parameters={"timeout": pb.InferParameter(string_param="1s")})),
    "priority out of range": (
        "tiny", tiny_body(0.0, parameters={"priority": -3}),
        _tiny([1, 16], parameters={"priority": pb.InferParameter(int64_param=-3)})),
    "binary bytes do not match the shape": (
        "tiny", binary_body({"inputs": [bin_input("INPUT0", "FP32", [2, 16], 64)]}, ZEROS),
        _tiny([2, 16])),
    "binary BYTES element truncated": (
        "embed", binary_body({"inputs": [bin_input("TEXT", "BYTES", [1, 1], 7)]}, TRUNCATED),
        pb.ModelInferRequest(
            model_name="embed", raw_input_contents=[TRUNCATED],
            inputs=[pb.InferInputTensor(name="TEXT", datatype="BYTES", shape=[1, 1])])),
}
# fmt: on


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_are_400_with_the_grpc_message(
    example_server: ServerProcess, stub: pb_grpc.GRPCInferenceServiceStub, case: str
) -> None:
    """The same bad request over gRPC (INVALID_ARGUMENT) and over HTTP (400, JSON or
    binary): the HTTP error is gRPC's details, word for word, and each counts as one
    `invalid` failure of the model, however far the HTTP body got in its parsing."""
    model, body, msg = INVALID[case]
    before = invalid(example_server, model)
    e = grpc_error(stub.ModelInfer, msg)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert invalid(example_server, model) == before + 1
    if isinstance(body, tuple):
        r = call(example_server, "POST", f"/v2/models/{model}/infer", body[0], body[1])
    else:
        r = call(example_server, "POST", f"/v2/models/{model}/infer", body)
    assert (r.status, r.error) == (400, e.details())
    assert invalid(example_server, model) == before + 2


def invalid(server: ServerProcess, model: str) -> float:
    """The model's requests answered `invalid` (the failures are counted before the
    answer goes out)."""
    labels = {"model": model, "version": "1", "reason": "invalid"}
    return value(scrape(server), "batchd_inference_request_failure_total", **labels)


@pytest.mark.parametrize("route", ["infer", "generate", "generate_stream"])
def test_an_http_body_that_does_not_parse_counts_as_a_failed_request(
    example_server: ServerProcess, route: str
) -> None:
    """Refused while the body is parsed (not JSON, values that are no FP32, too many of
    them, binary bytes past the body's end, a header length that is no number): each
    is an `invalid` failure of the model its URL names, as a gRPC message that does
    not decode is."""
    bodies: list[tuple[bytes | dict[str, Any], dict[str, str] | None]] = [
        (b"{not json", None),
        ({"INPUT0": ["a"] * 16} if route != "infer" else
         {"inputs": [tensor("INPUT0", "FP32", [1, 16], ["a"] * 16)]}, None),
    ]  # fmt: skip
    if route == "infer":
        bodies += [
            ({"inputs": [tensor("INPUT0", "FP32", [1, 16], [0.0] * 17)]}, None),
            binary_body({"inputs": [bin_input("INPUT0", "FP32", [1, 16], 64)]}),  # no bytes
            (tiny_body(), {HEADER_LENGTH: "twelve"}),
        ]
    for body, headers in bodies:
        before = invalid(example_server, "tiny")
        r = call(example_server, "POST", f"/v2/models/tiny/{route}", body, headers)
        assert r.status == 400, r.body
        assert invalid(example_server, "tiny") == before + 1, r.error


def test_an_extension_batchd_does_not_serve_is_refused_as_over_grpc(
    example_server: ServerProcess, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """An output asking for classification or a shared-memory region, or an input in
    one, is refused, never ignored (gRPC sent the plain output back), with the same
    message both ways."""
    for param, given in (("classification", 3), ("shared_memory_region", "out0")):
        msg = pb.ModelInferRequest(model_name="tiny", raw_input_contents=[bytes(64)])
        msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        out = msg.outputs.add(name="OUTPUT0")
        set_parameter(out.parameters[param], given)
        e = grpc_error(stub.ModelInfer, msg)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(param) in e.details()
        wanted = [{"name": "OUTPUT0", "parameters": {param: given}}]
        r = call(example_server, "POST", "/v2/models/tiny/infer", tiny_body(outputs=wanted))
        assert (r.status, r.error) == (400, e.details()), param
    # an input in shared memory, as tritonclient sends it (no data) and with data too
    # (its data was served, and without it the message spoke of empty contents)
    for raw in ([], [bytes(64)]):
        msg = pb.ModelInferRequest(model_name="tiny", raw_input_contents=raw)
        tensor = msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        set_parameter(tensor.parameters["shared_memory_region"], "in0")
        e = grpc_error(stub.ModelInfer, msg)
        assert e.details() == ("input 'INPUT0': parameter 'shared_memory_region' asks for a "
                               "Triton extension batchd does not serve")  # fmt: skip
    body = tiny_body()
    body["inputs"][0]["parameters"] = {"shared_memory_region": "in0"}
    r = call(example_server, "POST", "/v2/models/tiny/infer", body)
    assert (r.status, r.error) == (400, e.details())


def test_unknown_model_and_version_are_404_with_the_grpc_message(
    example_server: ServerProcess, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """Every route naming a model that is not served, or a version it does not have, is
    404 with gRPC's NOT_FOUND details (a long name quoted short); gRPC's ModelReady
    answers it not ready."""
    long_name = "n" * 1000
    for name, version in (("nope", ""), ("tiny", "7"), (long_name, "")):
        prefix = f"/v2/models/{name}" + (f"/versions/{version}" if version else "")
        msg = pb.ModelInferRequest(model_name=name, model_version=version)
        infer = grpc_error(stub.ModelInfer, msg)
        assert infer.code() == grpc.StatusCode.NOT_FOUND
        assert len(infer.details()) < 300
        for route in ("infer", "generate", "generate_stream"):
            r = call(example_server, "POST", f"{prefix}/{route}", tiny_body())
            assert (r.status, r.error) == (404, infer.details()), route
        for path, rpc, request in (
            (prefix, stub.ModelMetadata, pb.ModelMetadataRequest),
            (f"{prefix}/config", stub.ModelConfig, pb.ModelConfigRequest),
            (f"{prefix}/stats", stub.ModelStatistics, pb.ModelStatisticsRequest),
        ):
            e = grpc_error(rpc, request(name=name, version=version))
            r = call(example_server, "GET", path)
            assert (r.status, r.error) == (404, e.details()), path
        # ModelReady is no error over gRPC, as Triton's (tritonclient's is_model_ready
        # returns False for it; over HTTP it does so for any status but 200)
        assert not stub.ModelReady(pb.ModelReadyRequest(name=name, version=version)).ready
        r = call(example_server, "GET", f"{prefix}/ready")
        assert (r.status, r.error) == (404, infer.details()), prefix
    assert stub.ModelReady(pb.ModelReadyRequest(name="tiny", version="1")).ready


def test_a_model_failure_is_500_with_the_grpc_message(
    test_server: ServerProcess, models_stub: pb_grpc.GRPCInferenceServiceStub, gate: Gate
) -> None:
    """The model raising is INTERNAL over gRPC and 500 over HTTP, the same message."""
    e = grpc_error(models_stub.ModelInfer, x_request("gated", -1.0))
    assert e.code() == grpc.StatusCode.INTERNAL
    assert "ValueError: negative input -1.0" in e.details()
    r = call(test_server, "POST", "/v2/models/gated/infer", x_body(-1.0))
    assert (r.status, r.error) == (500, e.details())
    assert_serving(test_server)


def test_inputs_the_model_refused_are_400_with_the_grpc_message(
    test_server: ServerProcess, models_stub: pb_grpc.GRPCInferenceServiceStub, gate: Gate
) -> None:
    """A model raising batchd.worker.InputRefused is INVALID_ARGUMENT over gRPC and 400
    over HTTP: the caller's fault, not the server's."""
    e = grpc_error(models_stub.ModelInfer, x_request("gated", 2e6))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "model 'gated' refused the inputs: X must be below 1e6, got 2000000.0"
    r = call(test_server, "POST", "/v2/models/gated/infer", x_body(2e6))
    assert (r.status, r.error) == (400, e.details())
    assert_serving(test_server)


def pending(server: ServerProcess, model: str) -> float:
    labels = {"model": model, "version": "1"}
    return value(scrape(server), "batchd_inference_pending_request_count", **labels)


def test_a_full_queue_is_429_with_retry_after_and_the_grpc_message(
    test_server: ServerProcess, models_stub: pb_grpc.GRPCInferenceServiceStub, gate: Gate
) -> None:
    """`isolate` (max_queue_size 4): its worker held at the gate on one request, four
    more queued over HTTP; the next is RESOURCE_EXHAUSTED over gRPC and 429 over HTTP,
    the same message, Retry-After the pushback in whole seconds. Opened, every admitted
    request is answered."""
    gate.close()
    with ThreadPoolExecutor(5) as pool:
        try:

            def send(v: float) -> Future[Reply]:
                return pool.submit(call, test_server, "POST", "/v2/models/isolate/infer",
                                   x_body(v))  # fmt: skip

            first = send(1000.0)
            wait_for(lambda: gate.calls("isolate", "entered") == [[1000.0]], 30, "the first batch")
            queued = [send(float(v)) for v in range(1, 5)]
            wait_for(lambda: pending(test_server, "isolate") == 4, 30, "4 queued")
            e = grpc_error(models_stub.ModelInfer, x_request("isolate", 9.0))
            r = call(test_server, "POST", "/v2/models/isolate/infer", x_body(9.0))
        finally:
            gate.open()
        answers = [f.result(60) for f in (first, *queued)]
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (r.status, r.error) == (429, e.details())
    assert "max_queue_size 4" in r.error
    pushback_ms = int(dict(e.trailing_metadata())["grpc-retry-pushback-ms"])
    retry_after = int(r.headers["Retry-After"])
    assert retry_after >= 1 and abs(retry_after - max(1, math.ceil(pushback_ms / 1000))) <= 1
    assert [a.status for a in answers] == [200] * 5
    assert [a.json()["outputs"][0]["data"] for a in answers] == [
        [2000.0], [2.0], [4.0], [6.0], [8.0],
    ]  # fmt: skip


def test_the_timeout_parameter_expires_in_the_queue_as_504_with_the_grpc_message(
    test_server: ServerProcess, models_stub: pb_grpc.GRPCInferenceServiceStub, gate: Gate
) -> None:
    """The `timeout` parameter (µs) on a request queued behind a held batch: gRPC says
    DEADLINE_EXCEEDED, HTTP 504 with the same message (but for the milliseconds it
    waited), and neither reached the model."""
    gate.close()
    with ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(call, test_server, "POST", "/v2/models/gated/infer",
                                x_body(1.0))  # fmt: skip
            wait_for(lambda: gate.calls("gated", "entered") == [[1.0]], 30, "the first batch")
            msg = x_request("gated", 2.0, timeout=50_000)
            msg.id = "late"
            e = grpc_error(models_stub.ModelInfer, msg)
            r = call(test_server, "POST", "/v2/models/gated/infer",
                     x_body(3.0, id="late", parameters={"timeout": 50_000}))  # fmt: skip
        finally:
            gate.open()
        assert first.result(60).json()["outputs"][0]["data"] == [2.0]
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert r.status == 504

    def waited(message: str) -> str:
        return re.sub(r"after [0-9.]+ ms", "after N ms", message)

    assert "reached its deadline" in r.error
    assert waited(r.error) == waited(e.details())
    assert_serving(test_server)
    assert gate.calls("gated") == [[1.0], [21.0]]


def test_tokens_are_401_with_the_grpc_message_and_health_stays_open(
    strict: ServerProcess, strict_stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """With --auth-token-file: no token, a wrong one or another scheme is 401 with
    WWW-Authenticate and gRPC's UNAUTHENTICATED details, on every route but health;
    /v2/health/live and /ready answer without one; the infer token is served."""
    e = grpc_error(strict_stub.ModelInfer, x_request("gated", 1.0))
    assert (e.code(), e.details()) == (grpc.StatusCode.UNAUTHENTICATED, DENIED)
    wrong = grpc_error(strict_stub.ModelInfer, x_request("gated", 1.0),
                       metadata=[("authorization", "Bearer not-the-token-0123456789")])  # fmt: skip
    assert wrong.details() == e.details()
    refusals: list[Any] = ["", "Bearer not-the-token-0123456789", f"Basic {INFER_TOKEN}", "Bearer"]
    refusals += [b"Bearer \xff\xfe" + b"x" * 20, "Bearer caf\xe9-0123456789abcdef"]  # not UTF-8
    for headers in [{"Authorization": a} if a else {} for a in refusals]:
        for method, path, body in (
            ("POST", "/v2/models/gated/infer", x_body(1.0)),
            ("POST", "/v2/models/gated/generate", {"X": 1.0}),
            ("GET", "/v2", None),
            ("GET", "/v2/models/gated", None),
            ("GET", "/v2/models/stats", None),
            ("GET", "/v2/jobs", None),
            ("POST", "/v2/repository/index", None),
        ):
            r = call(strict, method, path, body, headers)
            assert (r.status, r.error) == (401, e.details()), (headers, path)
            assert r.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert call(strict, "GET", path).status == 200
    assert_serving(strict, INFER)
    assert call(strict, "GET", "/v2/models/gated/ready", None, ADMIN).status == 200


def test_a_draining_server_is_503_with_the_grpc_message(tmp_path: Path) -> None:
    """SIGTERM while a request is held: the ports close and gRPC connections get GOAWAY,
    so that clients connect anew (behind a balancer, to another replica); a request on a
    connection still open is UNAVAILABLE over gRPC (in its stream) and 503 over HTTP with
    the same message, its connection closed; the held request is still answered before
    the server exits cleanly. (Connections stayed, so a client pinned to a draining
    replica by an L4 balancer had every call and retry refused for the whole drain.)"""
    state = tmp_path / "state"
    state.mkdir()
    gate = Gate(state)
    server = ServerProcess(small_repo(tmp_path / "repo", "gated"), log_dir=tmp_path,
                           env={"BATCHD_TEST_DIR": str(state)}).start()  # fmt: skip
    kept = [http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60) for _ in "ab"]
    try:
        gate.close()
        for conn in kept:  # open before the SIGTERM, kept alive
            conn.request("GET", "/v2/health/live")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b'{"live":true}')
        requests: queue.SimpleQueue[pb.ModelInferRequest | None] = queue.SimpleQueue()
        with ThreadPoolExecutor(2) as pool, grpc.insecure_channel(server.url) as channel:
            stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter(requests.get, None), timeout=60
            )
            states: list[grpc.ChannelConnectivity] = []
            channel.subscribe(states.append, try_to_connect=False)
            held = pool.submit(call, server, "POST", "/v2/models/gated/infer", x_body(5.0))
            wait_for(lambda: gate.calls("gated", "entered") == [[5.0]], 30, "the held batch")
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: not any(listening(p) for p in (server.port, server.http_port)),
                     30, "the ports to close")  # fmt: skip
            # (a call sent before the client reads the GOAWAY can be CANCELLED by gRPC itself,
            # which takes no call once its stop began: the README's Status codes)
            wait_for(lambda: states[-1] != grpc.ChannelConnectivity.READY, 30, "the GOAWAY")
            e = grpc_error(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer,
                           x_request("gated", 6.0))  # fmt: skip
            requests.put(x_request("gated", 7.0))
            in_stream = next(stream).error_message
            kept[0].request("POST", "/v2/models/gated/infer", json.dumps(x_body(6.0)))
            r = kept[0].getresponse()
            refused = Reply(r.status, r.headers, r.read())
            kept[1].request("GET", "/v2/models/gated/ready")
            r = kept[1].getresponse()
            ready = Reply(r.status, r.headers, r.read())
            gate.open()
            requests.put(None)
            answer = held.result(60)
        assert e.code() == grpc.StatusCode.UNAVAILABLE  # (its connection: GOAWAY, then refused)
        assert (refused.status, refused.error) == (503, in_stream)
        assert "shutting down" in in_stream and refused.headers["Connection"] == "close"
        assert (ready.status, ready.json()) == (503, {"name": "gated", "ready": False})
        assert (answer.status, answer.json()["outputs"][0]["data"]) == (200, [10.0])
        assert server.proc.wait(60) == 0, server.log()
    finally:
        gate.open()
        for conn in kept:
            conn.close()
        server.stop()
    assert gate.calls("gated") == [[5.0]]


# ==== 4. generate and Server-Sent Events ====


def test_generate_stream_gives_the_grpc_streams_tokens(example_server: ServerProcess) -> None:
    """/generate_stream on the decoder: one `data:` event per TOKEN, the tokens of the
    gRPC stream for each prompt, and nothing else (Triton's form: no named event, which
    SSE readers would take as one more response); /generate gives them joined; a
    one-shot model streams its one answer."""
    cases = [([5, 6, 7], 6), ([9], 3), ([40, 41, 42, 43, 44, 45], 10)]
    with Client(example_server.url) as c:
        for i, (prompt, new) in enumerate(cases):
            inputs = {"PROMPT": np.array(prompt, np.int64),
                      "MAX_NEW_TOKENS": np.array([new], np.int64)}  # fmt: skip
            want = [int(o["TOKEN"][0]) for o in c.stream("decoder", inputs, timeout=60)]
            assert len(want) == new
            body = {"id": f"g{i}", "PROMPT": prompt, "MAX_NEW_TOKENS": new}
            r = call(example_server, "POST", "/v2/models/decoder/generate_stream", body)
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            got = events(r.body)
            assert [k for k, _ in got] == ["message"] * new
            assert [d["TOKEN"] for _, d in got] == want
            assert all((d["model_name"], d["id"]) == ("decoder", f"g{i}") for _, d in got)
            assert all(line.startswith(b"data: ") for line in r.body.split(b"\n") if line)
            joined = call(example_server, "POST", "/v2/models/decoder/generate", body)
            assert joined.status == 200, joined.body
            assert joined.json() == {
                "model_name": "decoder", "model_version": "1", "id": f"g{i}", "TOKEN": want,
            }  # fmt: skip
        x = np.linspace(-1, 1, 16, dtype=np.float32)
        want_tiny = c.infer("tiny", x[None], timeout=60)["OUTPUT0"][0]
    one = call(example_server, "POST", "/v2/models/tiny/generate_stream", {"INPUT0": x.tolist()})
    assert [k for k, _ in events(one.body)] == ["message"]
    np.testing.assert_array_equal(np.float32(events(one.body)[0][1]["OUTPUT0"]), want_tiny)
    plain = call(example_server, "POST", "/v2/models/tiny/generate", {"INPUT0": x.tolist()})
    np.testing.assert_array_equal(np.float32(plain.json()["OUTPUT0"]), want_tiny)
    unknown = call(example_server, "POST", "/v2/models/decoder/generate", {"PROMT": [1]})
    assert unknown.status == 400
    assert unknown.error == (
        "unknown input 'PROMT' for model 'decoder'; expected 'PROMPT', 'MAX_NEW_TOKENS'"
    )


def test_a_sequence_failing_after_its_first_output_ends_with_an_error_event(
    test_server: ServerProcess, models_stub: pb_grpc.GRPCInferenceServiceStub, gate: Gate
) -> None:
    """`stepper` sequence -2 fails at its second step: the SSE stream has its first
    output, then a `data:` event with gRPC's stream error (and its code), as Triton
    sends a failure after the first response; sequence -1 fails before any output,
    which is a plain HTTP 500 with gRPC's message."""

    def stepper(seq: int) -> pb.ModelInferRequest:
        msg = pb.ModelInferRequest(model_name="stepper")
        for name, number in (("ID", seq), ("STEPS", 5)):
            msg.inputs.add(name=name, datatype="INT64", shape=[1])
            msg.raw_input_contents.append(np.array([number], np.int64).tobytes())
        return msg

    grpc_stream = list(models_stub.ModelStreamInfer(iter([stepper(-2)]), timeout=60))
    assert [bool(m.error_message) for m in grpc_stream] == [False, True]
    r = call(test_server, "POST", "/v2/models/stepper/generate_stream", {"ID": -2, "STEPS": 5})
    assert r.status == 200
    got = events(r.body)
    assert [k for k, _ in got] == ["message", "message"]
    assert got[0][1]["VALUE"] == -1999
    assert got[1][1] == {"error": grpc_stream[1].error_message, "code": "INTERNAL"}
    (refused,) = list(models_stub.ModelStreamInfer(iter([stepper(-1)]), timeout=60))
    r = call(test_server, "POST", "/v2/models/stepper/generate_stream", {"ID": -1, "STEPS": 5})
    assert (r.status, r.error) == (500, refused.error_message)
    assert "refuses to start" in r.error


# ==== 5. batch jobs over HTTP ====


def job_line(cid: str, data: Any) -> str:
    return json.dumps({"custom_id": cid, "inputs": [tensor("INPUT0", "FP32", [1, 16], data)]})


def test_a_job_over_http_matches_the_grpc_view_of_it(
    example_server: ServerProcess, tmp_path: Path
) -> None:
    """POST /v2/jobs takes a JSONL file (201); GET polls it to completed; the job, the
    listing and the results are what the gRPC Jobs service gives; cancelling an ended
    job leaves it; an unknown job or model is 404 with gRPC's message."""
    lines = [job_line(f"j{i}", [float(i)] * 16) for i in range(6)]
    lines.insert(3, job_line("bad", [1.0, 2.0]))
    body = "\n".join(lines) + "\n"
    submitted = call(example_server, "POST", "/v2/jobs?model=tiny", body)
    assert submitted.status == 201, submitted.body
    job = submitted.json()
    assert (job["model_name"], job["total"], job["status"]) == ("tiny", 7, "queued")
    path = f"/v2/jobs/{job['id']}"
    wait_for(lambda: call(example_server, "GET", path).json()["status"] == "completed", 60,
             "the job to complete")  # fmt: skip
    with grpc.insecure_channel(example_server.url) as channel:
        jobs = jobs_pb2_grpc.JobsStub(channel)
        done = call(example_server, "GET", path).json()
        assert json_format.ParseDict(done, jobs_pb2.Job()) == jobs.GetJob(
            jobs_pb2.GetJobRequest(id=job["id"])
        )
        assert (done["completed"], done["failed"]) == (6, 1)
        listed = call(example_server, "GET", "/v2/jobs?status=completed&limit=1000").json()
        grpc_listed = jobs.ListJobs(jobs_pb2.ListJobsRequest(status="completed"))
        assert [j["id"] for j in listed["jobs"]] == [j.id for j in grpc_listed.jobs]
        assert job["id"] in [j["id"] for j in listed["jobs"]]
        e = grpc_error(jobs.GetJob, jobs_pb2.GetJobRequest(id="job-nope"))
        for method, route in (("GET", ""), ("POST", "/cancel"), ("GET", "/results")):
            r = call(example_server, method, f"/v2/jobs/job-nope{route}")
            assert (r.status, r.error) == (404, e.details()), route
        e = grpc_error(jobs.SubmitJob, iter([jobs_pb2.SubmitJobRequest(model_name="nope")]))
        r = call(example_server, "POST", "/v2/jobs?model=nope", body)
        assert (r.status, r.error) == (404, e.details())
    results = call(example_server, "GET", f"{path}/results")
    assert results.status == 200
    assert results.headers["Content-Type"] == "application/x-ndjson"
    with Client(example_server.url) as c:
        c.job_results(job["id"], tmp_path / "via-grpc.jsonl")
    assert results.body == (tmp_path / "via-grpc.jsonl").read_bytes()
    got = {r["custom_id"]: r for r in map(json.loads, results.body.splitlines())}
    assert got["bad"]["error"]["code"] == "INVALID_ARGUMENT"
    assert got["j2"]["outputs"][0]["shape"] == [1, 16]
    tail = call(example_server, "GET", f"{path}/results?offset=10").body
    assert tail == results.body[10:]
    negative = call(example_server, "GET", f"{path}/results?offset=-5")  # (was the whole file)
    assert (negative.status, negative.error) == (400, "offset must be a byte offset >= 0, got -5")
    assert call(example_server, "GET", f"{path}/results?offset={'0' * 40}10").body == tail
    for odd in ("5_0", "+5", "%205%20", "%D9%A5"):  # int() took them all (as 50, 5, 5, 5)
        r = call(example_server, "GET", f"{path}/results?offset={odd}")
        assert (r.status, r.error.split(", got ")[0]) == (400, "offset must be an integer"), odd
    assert call(example_server, "GET", "/v2/jobs?limit=1_0").status == 400
    head = call(example_server, "HEAD", f"{path}/results")  # (was 405: every GET route takes HEAD)
    assert (head.status, head.body, head.headers["Content-Type"]) == (
        200, b"", "application/x-ndjson")  # fmt: skip
    assert call(example_server, "HEAD", "/v2/jobs/job-nope/results").status == 404
    stepwise = call(example_server, "POST", "/v2/jobs?model=decoder", body)  # (was 404)
    assert (stepwise.status, stepwise.error) == (
        400, "model 'decoder' is step-wise (decoupled); jobs run one-shot models only")  # fmt: skip
    cancelled = call(example_server, "POST", f"{path}/cancel")
    assert (cancelled.status, cancelled.json()["status"]) == (200, "completed")


def test_cancel_a_running_job_over_http(test_server: ServerProcess, gate: Gate) -> None:
    """A job held at the gate mid-way is cancelled over HTTP; it ends `cancelled` with
    the results it had, fewer than its lines."""
    lines = "".join(json.dumps({"custom_id": f"c{v}", "inputs": [tensor("X", "FP32", [1, 1],
                    [float(v)])]}) + "\n" for v in range(1, 201))  # fmt: skip
    gate.close()
    try:
        submitted = call(test_server, "POST", "/v2/jobs?model=gated", lines)
        assert submitted.status == 201, submitted.body
        path = f"/v2/jobs/{submitted.json()['id']}"
        wait_for(lambda: gate.calls("gated", "entered"), 30, "a batch of the job")
        cancelling = call(test_server, "POST", f"{path}/cancel")
        assert cancelling.status == 200
        assert cancelling.json()["status"] in ("cancelling", "cancelled")
    finally:
        gate.open()
    wait_for(lambda: call(test_server, "GET", path).json()["status"] == "cancelled", 60,
             "the job to end cancelled")  # fmt: skip
    done = call(test_server, "GET", path).json()
    assert done["completed"] < 200 and done["failed"] == 0
    results = call(test_server, "GET", f"{path}/results").body.splitlines()
    assert len(results) == done["completed"]


# ==== 6. hostile input: a 4xx with a clear message, and the server keeps serving ====

TINY, TEXTPOOL = "/v2/models/tiny/infer", "/v2/models/textpool/infer"
HEAD = json.dumps({"inputs": [bin_input("INPUT0", "FP32", [1, 16], 64)]}).encode()
AT = {HEADER_LENGTH: str(len(HEAD))}  # the header's true length


def one(name: str, datatype: str, shape: list[int], data: Any) -> str:
    """A body of one JSON input."""
    return json.dumps({"inputs": [tensor(name, datatype, shape, data)]})


def nested(depth: int) -> str:
    """A body of one FP32 input whose `data` nests `depth` lists deep."""
    data = "[" * depth + "1" + "]" * depth
    return f'{{"inputs": [{{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": {data}}}]}}'


# orjson refuses it; Python's json recurses out (past 8,000 levels on 3.12, 1,000 on 3.11)
NAN_DEEP = "[" * 100_000 + "NaN" + "]" * 100_000
NAN_TOO_DEEP = "is not valid JSON: it holds NaN or Infinity, read by Python's json, and nests"
LONE = "a string holds a lone UTF-16 surrogate"  # Python's json reads it, for a NaN
DIGITS = "9" * 4000  # Python's json (read for a NaN) takes integers of 4,000 digits
BIG_SIZE_HEAD = (
    '{"parameters": {"x": NaN}, "inputs": [{"name": "INPUT0", "datatype": "FP32", '
    f'"shape": [1, 16], "parameters": {{"binary_data_size": {DIGITS}}}}}]}}'
).encode()

# case: (path, body, headers, a part of the error message)
# fmt: off
HOSTILE: dict[str, tuple[str, bytes | str, dict[str, str], str]] = {
    "malformed JSON": (TINY, '{"inputs": [}', {}, "the inference header is not valid JSON"),
    "truncated JSON": (TINY, json.dumps(tiny_body())[:-7], {}, "is not valid JSON"),
    "empty body": (TINY, b"", {}, "the inference header is not valid JSON"),
    "not an object": (TINY, "[1, 2]", {}, "must be a JSON object, got a list"),
    "inputs not a list": (TINY, '{"inputs": 3}', {}, "'inputs' must be a list, got a number"),
    "strings in FP32": (TINY, one("INPUT0", "FP32", [1, 2], ["a", "b"]), {},
                        "input 'INPUT0': FP32 data holds numbers only, got a string"),
    "floats in INT64": (TEXTPOOL, one("TOKENS", "INT64", [1, 3], [1.5, 2, 3]), {},
                        "input 'TOKENS': INT64 data holds integers only, got 1.5 (not an"),
    "out-of-range INT8": (TEXTPOOL, one("TOKENS", "INT8", [1, 2], [300, 2]), {},
                          "input 'TOKENS': INT8 holds -128 to 127, got 300"),
    "FP32 past its range": (TINY, one("INPUT0", "FP32", [1, 16], [1.0] * 15 + [-1e39]), {},
                            "FP32 holds numbers of magnitude up to 3.4028e+38, got -1e+39"),
    "shape and data disagree": (TINY, one("INPUT0", "FP32", [1, 16], [1.0] * 15), {},
                                "shape [1, 16] needs 16 values, 'data' holds 15"),
    "rows of unequal length": (TINY, one("INPUT0", "FP32", [2, 2], [[1.0, 2.0], [3.0]]), {},
                               "'data' nests lists of unequal lengths"),
    "nesting 100 levels": (TINY, nested(100), {}, "'data' nests deeper than 32 levels"),
    "nesting 100000 levels": (TINY, nested(100_000), {}, "is not valid JSON: depth limit"),
    "header length past the body": (
        TINY, HEAD + ZEROS, {HEADER_LENGTH: str(len(HEAD) + 65)},
        f"{HEADER_LENGTH} is {len(HEAD) + 65}, but the body holds {len(HEAD) + 64} bytes"),
    "negative header length": (TINY, HEAD + ZEROS, {HEADER_LENGTH: "-5"},
                               f"{HEADER_LENGTH} must be a number of bytes, got '-5'"),
    "non-numeric header length": (TINY, HEAD + ZEROS, {HEADER_LENGTH: "lots"},
                                  f"{HEADER_LENGTH} must be a number of bytes, got 'lots'"),
    # (int() read these as 10 and 12: review 57c)
    "header length with an underscore": (TINY, HEAD + ZEROS, {HEADER_LENGTH: "1_0"},
                                         f"{HEADER_LENGTH} must be a number of bytes, got '1_0'"),
    "header length of 5,000 digits": (TINY, HEAD + ZEROS, {HEADER_LENGTH: "9" * 5000},
                                      f"{HEADER_LENGTH} must be a number of bytes, got '999"),
    "header length in other digits": (TINY, HEAD + ZEROS, {HEADER_LENGTH: "١٢".encode()},
                                      f"{HEADER_LENGTH} must be a number of bytes, got"),
    "header length cutting the JSON": (TINY, HEAD + ZEROS, {HEADER_LENGTH: "10"},
                                       "the inference header is not valid JSON"),
    "binary_data_size past the body": (
        TINY, HEAD + ZEROS[:60], AT,
        "binary_data_size 64 does not fit the 60 binary bytes left after the header"),
    "binary bytes left over": (
        TINY, HEAD + ZEROS + b"tail", AT, "the body holds 68 bytes after the header; the "
        "inputs' binary_data_size parameters add up to 64"),
    "NaN nesting 100,000 levels": (TINY, one("INPUT0", "FP32", [1], []).replace("[]", NAN_DEEP),
                                {}, NAN_TOO_DEEP),
    "NaN nesting 100,000 levels, generate": (
        "/v2/models/tiny/generate", f'{{"INPUT0": {NAN_DEEP}}}', {}, NAN_TOO_DEEP),
    "NaN nesting 100,000 levels, index": (
        "/v2/repository/index", f'{{"ready": {NAN_DEEP}}}', {}, NAN_TOO_DEEP),
    "true beside numbers": (TINY, one("INPUT0", "FP32", [1, 16], [True] + [0.5] * 15), {},
                            "FP32 data holds numbers only, got a boolean"),
    "true beside integers": (TEXTPOOL, one("TOKENS", "INT64", [1, 2], [True, 5]), {},
                             "INT64 data holds integers only, got a boolean"),
    "an integer past 64 bits": (  # (it said "not an integer")
        TEXTPOOL, one("TOKENS", "INT64", [1, 2], [1, 2**64]), {},
        "INT64 data holds integers only, got 1.8446744073709552e+19 (an integer past 64 bits)"),
    "a shape of 32 dimensions of 2**62": (
        TINY, one("INPUT0", "FP32", [2**62] * 32, [1]), {},
        "needs 1751908409537131537220509645351687597690... (598 digits) values"),
    "index: ready not a boolean": (
        "/v2/repository/index", '{"ready": "yes"}', {},
        "the request: 'ready' must be true or false, got a string"),
    "binary_data_size of 4000 digits": (
        TINY, BIG_SIZE_HEAD + ZEROS, {HEADER_LENGTH: str(len(BIG_SIZE_HEAD))},
        f"binary_data_size {'9' * 40}... (4000 digits) does not fit the 64 binary bytes"),
    "an INT8 of 4000 digits": (
        TEXTPOOL, '{"parameters": {"x": NaN}, "inputs": [{"name": "TOKENS", "datatype": "INT8", '
        f'"shape": [1, 2], "data": [1, {DIGITS}]}}]}}', {},
        f"INT8 holds -128 to 127, got {'9' * 40}... (4000 digits)"),
    "a lone surrogate in the id, beside a NaN": (
        TINY, '{"id": "\\ud800", "parameters": {"x": NaN}, "inputs": []}', {}, LONE),
    "a lone surrogate in an input name, beside Infinity": (
        TINY, one("\udfff", "FP32", [1], [math.inf]), {}, LONE),
    "a lone surrogate in a parameter key, generate": (
        "/v2/models/tiny/generate", '{"\\ud800x": NaN}', {}, LONE),
    "a timeout of true": (  # (it said "got bool_param", then "got a boolean True")
        TINY, tiny_body(parameters={"timeout": True}), {},
        "parameter 'timeout': expected an integer of microseconds, got a boolean true"),
    "2**40 rows in 64 bytes, outputs in JSON": (  # (it was told to ask for binary outputs)
        TINY, *binary_body({"inputs": [bin_input("INPUT0", "FP32", [2**40, 16], 64)]}, ZEROS),
        "1099511627776 rows would need more batches of 32 than model 'tiny' queues"),
    "2**40 rows of no element, outputs in JSON": (  # (its outputs' room was not decoding's)
        TINY, one("INPUT0", "FP32", [2**40, 0], []), {},
        "expected shape [-1, 16] (batch dim first), got [1099511627776, 0]"),
    "negative binary_data_size": (
        TINY, *binary_body({"inputs": [bin_input("INPUT0", "FP32", [1, 16], -1)]}, ZEROS),
        "binary_data_size must be a non-negative integer, got a number '-1'"),
    # each walked in Python before (600,000 parameters held the loop ~0.7 s, then a 200)
    "257 request parameters": (
        TINY, tiny_body(parameters={f"k{i}": i for i in range(257)}), {},
        "the request has 257 parameters, at most 256"),
    "257 parameters of an input": (
        TINY, {"inputs": [{**tensor("INPUT0", "FP32", [1, 16], [0.5] * 16),
                           "parameters": {f"k{i}": i for i in range(257)}}]}, {},
        "input 'INPUT0' has 257 parameters, at most 256"),
    "257 outputs": (
        TINY, tiny_body(outputs=[{"name": "OUTPUT0"}] * 257), {},
        "the request has 257 outputs, at most 256"),
    # read as false before; Triton refuses it
    "binary_data not a boolean": (
        TINY, tiny_body(outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": "yes"}}]), {},
        "output 'OUTPUT0': parameter 'binary_data' must be true or false, got a string"),
    "binary_data_output not a boolean": (
        TINY, tiny_body(parameters={"binary_data_output": 1}), {},
        "the request: parameter 'binary_data_output' must be true or false, got a number"),
    # (read as inf where the text "NaN" was anywhere in the body, even in the id)
    "1e999 beside a NaN": (
        TINY, '{"id": "NaN", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], '
        '"data": [1, 1e999]}]}', {}, "number is infinity when parsed as double"),
}
# fmt: on


def test_rows_of_no_element_have_their_json_outputs_room_checked_before_the_model_runs() -> None:
    """[64, 0] of a model whose outputs hold 256 KiB a row: refused before it runs, as
    [64, 1] is (counting no rows for any shape with a 0 let the model run, and the answer
    was refused once made); [2**40, 0], more rows than the model queues, is decoding's."""
    cfg = replace(fake_model(max_batch_size=64, shape=(-1,)),
                  outputs=(TensorSpec("Y", "FP32", (65536,)),))  # fmt: skip
    wanted = Wanted(False, {})
    for rows, refused in ((64, True), (2**40, False)):
        msg = pb.ModelInferRequest(model_name="m")
        msg.inputs.add(name="X", datatype="FP32", shape=[rows, 0])
        msg.raw_input_contents.append(b"")
        if refused:
            with pytest.raises(ResponseTooLarge, match="would hold 16777216 bytes"):
                json_room(msg, cfg, wanted)
        else:
            json_room(msg, cfg, wanted)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_get_400_and_the_server_keeps_serving(
    example_server: ServerProcess, case: str
) -> None:
    """Each malformed body is a 400 naming what is wrong; the next request is served."""
    path, body, headers, message = HOSTILE[case]
    r = call(example_server, "POST", path, body, headers)
    assert r.status == 400, r.body[:300]
    assert message in r.error
    assert len(r.error) < 300  # quoted short, never echoed whole
    assert_serving(example_server)


@pytest.mark.parametrize(
    ("datatype", "values", "message"),
    [
        ("FP16", [1.0, 65520.0], "FP16 holds numbers of magnitude up to 65504, got 65520.0"),
        ("FP16", [70000], "FP16 holds numbers of magnitude up to 65504, got 70000"),
        ("BF16", [3.4e38], "BF16 holds numbers of magnitude up to 3.3895e+38, got 3.4e+38"),
        ("FP32", [1e39], "FP32 holds numbers of magnitude up to 3.4028e+38, got 1e+39"),
    ],
)
def test_a_json_number_past_a_float_type_s_range_is_refused_not_made_inf(
    datatype: str, values: list[float], message: str
) -> None:
    """A finite number too large for its datatype is refused, as an integer past its
    type's range is, where numpy would have turned it into inf; inf itself, and the
    largest finite numbers, pass."""
    with pytest.raises(InvalidInput, match=re.escape(message)):
        to_raw(datatype, values, "input 'X'")
    assert to_raw("FP16", [65504.0, -math.inf], "x") == np.array([65504, -np.inf], "<f2").tobytes()
    assert to_raw("BF16", [3.3895e38, math.inf], "x") == bytes.fromhex("7f7f807f")


@pytest.mark.parametrize("datatype", ["FP32", "INT64", "BOOL"])
def test_numbers_beside_one_long_string_are_refused_building_no_array_of_strings(
    datatype: str,
) -> None:
    """numpy made [0, ..., 0, "xxx..."] an array of 20,000 strings each 100,000 wide:
    a 140 KB body took 8 GB (1.8 GB and 4.5 s of the event loop at 120,000 wide), and
    past the memory it had, a 500. The values' types are looked at first."""
    values: list[Any] = [False if datatype == "BOOL" else 0] * 20_000 + ["x" * 100_000]
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="only, got a string") as e:
            to_raw(datatype, values, "input 'X'")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert len(e.value.message) < 200


def test_too_many_inputs_are_refused_before_any_is_read() -> None:
    """--max-inputs-per-request was checked only once every input's JSON data had been
    converted: 4,700 inputs in a 254 KB body held the event loop 53 ms each, eight
    such bodies 0.3-0.6 s. Here the first input's data is bad: it is not read."""
    inputs = [{"name": f"X{i}", "datatype": "FP32", "shape": [1], "data": ["no"]}
              for i in range(200)]  # fmt: skip
    body = json.dumps({"inputs": inputs}).encode()
    with pytest.raises(InvalidInput) as e:
        parse_infer(body, None, "m", "1", Limits(max_inputs=128))
    assert e.value.message == (
        "the request has 200 inputs, more than the server's limit of 128 (--max-inputs-per-request)"
    )
    with pytest.raises(ValueError, match="200 inputs, more than the server's limit of 128"):
        lines.parse(json.loads(body), "m", "1", Limits(max_inputs=128))


def test_a_header_length_of_0_is_refused_saying_what_triton_means_by_it(
    example_server: ServerProcess,
) -> None:
    """Triton reads 0 as a raw binary request (the body: the one input's bytes); batchd
    said "the inference header is not valid JSON: ... zero-length"."""
    r = call(example_server, "POST", TINY, ZEROS, {HEADER_LENGTH: "0"})
    assert r.status == 400, r.body[:300]
    assert f"{HEADER_LENGTH} 0 asks for Triton's raw binary request" in r.error


def test_an_answer_is_weighed_by_the_outputs_it_writes_as_json() -> None:
    """What sends an answer's writing off the loop: its outputs written as JSON, not its
    binary ones (every mlp answer of 9 rows or more, binary, went to the decode
    thread, behind the bodies it parses: 259 ms, against 12 ms), or all its bytes."""
    answer = pb.ModelInferResponse()
    for name in ("A", "B"):
        answer.outputs.add(name=name, datatype="FP32", shape=[1, 10])
    answer.raw_output_contents.extend([bytes(40), bytes(400)])
    assert Wanted(False, {}).heavy(answer, 400, 1000)
    assert not Wanted(False, {"B": True}).heavy(answer, 400, 1000)
    assert not Wanted(True, {"A": False}).heavy(answer, 400, 1000)
    assert Wanted(True, {}).heavy(answer, 400, 439)  # (a large binary answer: its copy)


def test_a_model_of_more_outputs_than_the_cap_may_be_asked_for_each() -> None:
    """The cap on the outputs a request names is its model's number where larger: a
    model of 300 outputs had each asked for over gRPC, and was refused over HTTP."""
    head = {"inputs": [], "outputs": [{"name": f"Y{i}"} for i in range(300)]}
    body = json.dumps(head).encode()
    msg, _ = parse_infer(body, None, "m", "1", Limits(), 300)
    assert len(msg.outputs) == 300
    with pytest.raises(InvalidInput, match="the request has 300 outputs, at most 256"):
        parse_infer(body, None, "m", "1", Limits(), 3)


@pytest.mark.parametrize("size", ["64", 64.0])
def test_a_binary_data_size_of_the_wrong_type_says_so(
    example_server: ServerProcess, size: Any
) -> None:
    """A binary_data_size that is no integer is refused as such, not as too long."""
    head = {"inputs": [bin_input("INPUT0", "FP32", [1, 16], size)]}
    r = call(example_server, "POST", TINY, *binary_body(head, ZEROS))
    assert r.status == 400
    assert "integer" in r.error and "does not fit" not in r.error


@pytest.mark.parametrize("leave", ["half-close", "close"])
def test_a_content_length_longer_than_the_body_then_the_client_leaves(
    example_server: ServerProcess, leave: str
) -> None:
    """A request promising 1000 bytes that sends 12 and leaves (half-closing or closing):
    the server closes, or answers 400/408, and stays up for everyone else."""
    before = len(example_server.log())
    with socket.create_connection(("127.0.0.1", example_server.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: [::1]\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"inputs\": [")  # fmt: skip
        if leave == "half-close":
            s.shutdown(socket.SHUT_WR)
            answer = until_eof(s)
            assert answer == b"" or answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 408")), answer
    assert_serving(example_server)
    assert "Traceback" not in example_server.log()[before:]


def test_malformed_http_from_a_client_is_not_logged_as_a_server_error(
    example_server: ServerProcess,
) -> None:
    """Garbage on the wire is the client's error: 400, and no traceback in the log."""
    before = len(example_server.log())
    for raw in (b"GARBAGE\r\n\r\n",
                b"POST /v2 HTTP/1.1\r\nHost: [::1]\r\nContent-Length: -5\r\n\r\n"):  # fmt: skip
        with socket.create_connection(("127.0.0.1", example_server.http_port), timeout=30) as s:
            s.sendall(raw)
            assert until_eof(s).startswith((b"HTTP/1.0 400", b"HTTP/1.1 400"))
    assert_serving(example_server)
    log = example_server.log()[before:]
    assert "Traceback" not in log and " ERROR " not in log, log[-2000:]


def test_a_request_the_parser_refuses_is_a_json_400_quoting_none_of_it(
    example_server: ServerProcess,
) -> None:
    """A header over 8190 bytes (or a malformed line) that aiohttp's parser refuses was a
    text/plain 400 quoting the start of what came: an Authorization header's token too.
    It is `{"error": ...}` as every other error, names the fault, and quotes nothing."""
    secret = b"Bearer secret-0123456789abcdef " + b"x" * 9000
    for raw, said in (
        (b"GET /v2 HTTP/1.1\r\nHost: [::1]\r\nAuthorization: " + secret + b"\r\n\r\n",
         "not a request HTTP/1.1 can carry (a request line or header over 8190 bytes)"),
        (b"GET /v2/" + b"x" * 9000 + b" HTTP/1.1\r\nHost: [::1]\r\n\r\n",
         "not a request HTTP/1.1 can carry (a request line or header over 8190 bytes)"),
        (b"GET /v2 HTTP/1.1\r\nHost: [::1]\r\nX: a\x01secret\r\n\r\n",
         "not a request HTTP/1.1 can carry (Invalid header value char)"),
        (b"GET /v2 HTTP/1.1\r\nHost: [::1]\r\nContent-Length: 5\r\nTransfer-Encoding: chunked"
         b"\r\n\r\n", "not a request HTTP/1.1 can carry (Transfer-Encoding can't be present "
         "with Content-Length)"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03secret\r\n\r\n",  # https to http
         "not a request HTTP/1.1 can carry (Received HTTPS traffic on an HTTP port)"),
        (b"GET /v2/health/live HTTP/9.9\r\n\r\n",
         "not a request HTTP/1.1 can carry (Bad status line: Invalid HTTP version)"),
    ):  # fmt: skip
        with socket.create_connection(("127.0.0.1", example_server.http_port), timeout=30) as s:
            s.sendall(raw)
            answer = until_eof(s)  # (and the connection closed)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:300]
        assert b"Content-Type: application/json" in head, head
        assert json.loads(body) == {"error": said} and b"secret" not in answer
    assert_serving(example_server)


def test_a_body_over_max_message_bytes_is_413(
    strict: ServerProcess, strict_stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """--max-message-bytes 65536: a larger body is 413 with a message naming the limit,
    refused before it is read whole; gRPC refuses the same size too."""
    big = json.dumps(x_body(1.0, id="x" * (MAX_BODY * 2)))
    r = call(strict, "POST", "/v2/models/gated/infer", big, INFER)
    over = f"more than {MAX_BODY} bytes (--max-message-bytes)"  # (aiohttp's text named no flag)
    assert (r.status, r.error) == (413, f"the body is {len(big)} bytes, {over}"), r.body
    with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
        piece = b"x" * 40000  # chunked: no length said, so it is found over as it is read
        s.sendall(b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: [::1]\r\nAuthorization: Bearer "
                  + INFER_TOKEN.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + (b"%x\r\n" % len(piece) + piece + b"\r\n") * 2 + b"0\r\n\r\n")  # fmt: skip
        status, answer = read_response(s)
    assert (status, json.loads(answer)) == (413, {"error": f"the body is {over}"})
    e = grpc_error(strict_stub.ModelInfer, pb.ModelInferRequest(model_name="gated", id="x" * (
        MAX_BODY * 2)), metadata=INFER_MD)  # fmt: skip
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_serving(strict, INFER)


def test_a_body_that_stops_arriving_is_408(strict: ServerProcess) -> None:
    """--handshake-timeout 1: headers promising 1000 bytes, 12 sent, then nothing: 408
    with a message once the second is up, and the connection closed (it stayed open 10 s
    more, aiohttp waiting for the rest of the body); another client is served meanwhile."""
    with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
        started = time.monotonic()
        auth = f"Authorization: Bearer {INFER_TOKEN}\r\n".encode()
        s.sendall(b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: [::1]\r\n" + auth
                  + b"Content-Length: 1000\r\n\r\n{\"inputs\": [")  # fmt: skip
        assert_serving(strict, INFER)
        status, body = read_response(s)
        elapsed = time.monotonic() - started
        s.settimeout(5)  # closed at once: not after aiohttp's 10 s of lingering
        assert until_eof(s) == b""
    assert status == 408 and json.loads(body) == {
        "error": "the request body did not arrive in time"
    }
    assert "Traceback" not in strict.log(), strict.log()
    assert 0.9 <= elapsed < 10
    assert_serving(strict, INFER)


def test_a_large_body_that_keeps_coming_is_read_whole(tmp_path: Path) -> None:
    """--handshake-timeout 1: a body of 1 MB sent in 20 pieces over 3 s is answered, as
    it brings 64 KiB a second, each second. Before, the whole body had to come within the
    second: 408, so a large body over a slow link never could. A body that trickles, 100
    bytes every 0.1 s, is 408 still, about a second in; and one that sends 2 MB at once,
    then nothing, in the second after (its burst bought it 32 s of silence: review 54d)."""
    state = tmp_path / "state"
    state.mkdir()
    server = ServerProcess(
        small_repo(tmp_path / "repo", "gated"), "--handshake-timeout", "1",
        "--max-message-bytes", str(4 << 20), log_dir=tmp_path, env={"BATCHD_TEST_DIR": str(state)},
    ).start()  # fmt: skip
    post = b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: [::1]\r\nContent-Length: %d\r\n\r\n"
    try:
        body = json.dumps(x_body(21.0)).encode() + b" " * (1 << 20)
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            started = time.monotonic()
            s.sendall(post % len(body))
            for i in range(20):
                s.sendall(body[i * len(body) // 20 : (i + 1) * len(body) // 20])
                time.sleep(0.15)  # (pacing the sender: no assertion waits on it)
            assert time.monotonic() - started > 2  # past the second the old rule gave
            status, answer = read_response(s)
        assert (status, json.loads(answer)["outputs"][0]["data"]) == (200, [42.0]), answer
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            started = time.monotonic()
            s.sendall(post % 100_000)
            s.settimeout(0.1)
            while time.monotonic() - started < 10:
                s.sendall(b" " * 100)
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break
                except TimeoutError:
                    pass
            s.settimeout(30)
            status, answer = read_response(s)
            elapsed = time.monotonic() - started
        assert (status, json.loads(answer)) == (
            408,
            {"error": "the request body did not arrive in time"},
        )
        assert elapsed < 5
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            started = time.monotonic()
            s.sendall(post % (3 << 20) + b" " * (2 << 20))
            status, answer = read_response(s)
            assert (status, time.monotonic() - started < 10) == (408, True), answer
        assert_serving(server)
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("part", ["request line", "headers"])
def test_slow_loris_is_closed_after_the_handshake_timeout(strict: ServerProcess, part: str) -> None:
    """--handshake-timeout 1: a client that keeps sending its request line or headers a
    few bytes at a time, never finishing them, is disconnected about a second in, though
    it never went quiet; another client is served normally meanwhile."""
    with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
        started = time.monotonic()
        if part == "headers":
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: [::1]\r\n")
            pieces = (b"X-Slow-%d: y\r\n" % i for i in range(1_000_000))
        else:
            s.sendall(b"GET /v2/health/live?")
            pieces = (b"a" for _ in range(1_000_000))
        s.settimeout(0.05)  # pacing: a piece every 50 ms, far inside the 1 s timeout
        sent, served, closed = 0, False, None
        while closed is None and time.monotonic() - started < 15:
            try:
                s.sendall(next(pieces))
                sent += 1
                data = s.recv(4096)
            except TimeoutError:
                data = None
            except OSError:  # reset, or a broken pipe: closed by the server
                data = b""
            if data == b"":
                closed = time.monotonic() - started
            assert not data, f"the server answered an unfinished request: {data!r}"
            if not served:
                assert_serving(strict, INFER)
                served = True
    assert closed is not None, "the server kept a slow-loris connection open 15 s"
    assert 0.9 <= closed < 6 and sent >= 10, (closed, sent)
    assert_serving(strict, INFER)


# ---- TLS ----


@openssl
def test_http_takes_the_grpc_port_s_tls_and_client_certificates(
    certs: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--tls-cert/--tls-key/--tls-client-ca apply to HTTP as to gRPC: HTTPS with the CA
    works, a client certificate is required, plaintext and strangers are refused."""
    server = ServerProcess(
        EXAMPLES, "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
        "--tls-client-ca", str(certs / "ca.pem"), log_dir=tmp_path_factory.mktemp("tls"),
    ).start(ready=False)  # fmt: skip
    try:
        url = f"https://localhost:{server.http_port}/v2/health/ready"
        context = ssl.create_default_context(cafile=certs / "ca.pem")
        context.load_cert_chain(certs / "client.pem", certs / "client.key")

        def ready() -> bool:
            try:
                with urllib.request.urlopen(url, context=context, timeout=10) as r:
                    return bool(json.loads(r.read())["ready"])
            except urllib.error.HTTPError as e:
                if e.code == 503:  # until the models are loaded
                    return False
                raise

        wait_for(ready, 90, "HTTPS readiness")
        no_client_cert = ssl.create_default_context(cafile=certs / "ca.pem")
        stranger = ssl.create_default_context(cafile=certs / "ca.pem")
        stranger.load_cert_chain(certs / "stranger.pem", certs / "stranger.key")
        for refused in (no_client_cert, stranger, ssl.create_default_context()):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                urllib.request.urlopen(url, context=refused, timeout=10).read()
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(url.replace("https", "http"), timeout=10).read()
    finally:
        server.stop()


# ---- found in review: costs that a small request must not be able to cause ----


def test_a_shape_of_many_huge_dimensions_is_refused_unread(example_server: ServerProcess) -> None:
    """40,000 dimensions of 2**62 (an 840 KB body): multiplied out, a product of 750,000
    digits that froze the process for seconds. Refused on the dimension count, over
    HTTP and over gRPC (BYTES, whose decode cost is estimated from the shape)."""
    dims = [1 << 62] * 40_000
    r = call(example_server, "POST", TINY, {"inputs": [tensor("INPUT0", "FP32", dims, [1])]})
    assert r.status == 400 and "40000 dimensions, at most 32" in r.error, r.error
    msg = pb.ModelInferRequest(model_name="embed")
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=dims)
    msg.raw_input_contents.append(b"")
    with grpc.insecure_channel(example_server.url) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(msg, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(example_server)


def test_json_over_8_mib_is_refused_and_binary_is_the_way(example_server: ServerProcess) -> None:
    """Parsing JSON holds the GIL: a body of more than 8 MiB of it is refused with a message
    pointing to the binary form, which carries the same tensor."""
    rows = 9 * 1024 * 1024 // (16 * 4)  # > 8 MiB of "0.5, "
    big = {"inputs": [tensor("INPUT0", "FP32", [rows, 16], [0.5] * (rows * 16))]}
    r = call(example_server, "POST", TINY, big)
    assert r.status == 400 and "binary form" in r.error, r.error
    assert_serving(example_server)


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(strict: ServerProcess) -> None:
    """Content-Length of 1 GB: 413 at once, not after reading (or waiting for) the body."""
    with socket.create_connection(("127.0.0.1", strict.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: [::1]\r\n"
                  b"Authorization: Bearer " + INFER_TOKEN.encode() + b"\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")  # fmt: skip
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_nan_and_infinity_in_json_input_are_read(test_server: ServerProcess) -> None:
    """tritonclient.http writes NaN and Infinity (Python's json) in JSON tensors; they are
    read as the floats they are, as gRPC carries them."""
    values = {**ECHO_TYPES, "FP32": ["nan", "inf", "-inf"]}
    inputs = [tensor(f"IN_{k}", k, [1, 3], v) for k, v in values.items()]
    inputs.append(tensor("IN_BYTES", "BYTES", [1, 1], ["x"]))
    body = json.dumps({"inputs": inputs})
    for word, token in (('"nan"', "NaN"), ('"-inf"', "-Infinity"), ('"inf"', "Infinity")):
        body = body.replace(word, token)
    r = call(test_server, "POST", "/v2/models/echo/infer", body)
    assert r.status == 200, r.body
    got = {o["name"]: o["data"] for o in json.loads(r.body)["outputs"]}["OUT_FP32"]
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf]


# ---- --handshake-timeout 0, and over TLS ----


def _continue(sock: socket.socket) -> bytes:
    """The interim answer to `Expect: 100-continue`, read whole."""
    data = b""
    while len(data) < len(b"HTTP/1.1 100 Continue\r\n\r\n"):
        chunk = sock.recv(25 - len(data))
        assert chunk, f"closed before 100 Continue: {data!r}"
        data += chunk
    return data


def test_handshake_timeout_0_waits_for_a_body_and_for_the_next_request(tmp_path: Path) -> None:
    """0 turns the limit off. A body that is not there when the handler reads it is
    waited for (asyncio.timeout(0) gave 408 at the first wait): `Expect: 100-continue`
    holds the body back until the server is on its way into the handler, which reads
    before it yields. A keep-alive connection then stays open for its next request."""
    server = ServerProcess(
        EXAMPLES, "--handshake-timeout", "0", "--no-local-workers", log_dir=tmp_path
    ).start(ready=False)
    try:
        body = b'{"ready": false}'
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: [::1]\r\nExpect: 100-continue"
                      b"\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
            assert _continue(s) == b"HTTP/1.1 100 Continue\r\n\r\n"
            s.sendall(body)
            status, answer = read_response(s)
            assert status == 200, answer
            assert "tiny" in {m["name"] for m in json.loads(answer)}
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: [::1]\r\n\r\n")
            assert read_response(s) == (200, b'{"live":true}')
    finally:
        assert server.stop() == 0, server.log()


def test_handshake_timeout_0_waits_for_each_piece_of_a_job_upload() -> None:
    """The same for a job's upload, read a piece at a time: a piece not there yet is
    waited for (one wait under asyncio.timeout(0) raised TimeoutError: a 408)."""

    class Content:
        pieces = [b'{"inputs": {"INPUT0": [[0.0]]}}\n', b""]

        async def read(self, n: int) -> bytes:
            await asyncio.sleep(0)  # the piece is still on its way: the reader waits once
            return self.pieces.pop(0)

    class Jobs:
        def caller(self, token: bytes | None) -> tuple[str, bool]:
            return "owner", False

        async def submit(self, caller: Any, model: str, version: str, pieces: Any, key: str) -> Any:
            got = [piece async for piece in pieces]
            return jobs_pb2.Job(id="j", model_name=model, total=len(got))

    request = SimpleNamespace(query={"model": "tiny"}, headers={}, content=Content())
    response = asyncio.run(JobRoutes(Jobs(), body_timeout_s=0, grace_s=0).submit(request))  # type: ignore[arg-type]
    assert response.status == 201 and json.loads(response.body)["total"] == 1


@openssl
@pytest.mark.parametrize("sent", [b"", b"\x16\x03\x01\x02\x00"], ids=["nothing", "5 bytes"])
def test_a_tls_handshake_not_finished_is_closed_after_the_handshake_timeout(
    certs: Path, tmp_path: Path, sent: bytes
) -> None:
    """--handshake-timeout bounds the TLS handshake of the HTTP port too (it was asyncio's
    60 s): a connection that sends nothing, or a TLS record header and no more, is closed
    well within 30 s with --handshake-timeout 1."""
    server = ServerProcess(
        EXAMPLES, "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
        "--handshake-timeout", "1", "--no-local-workers", log_dir=tmp_path,
    ).start(ready=False)  # fmt: skip
    try:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
            s.sendall(sent)
            try:
                assert until_eof(s) == b""
            except TimeoutError:
                pytest.fail("the server held a connection without a TLS handshake for 30 s")
    finally:
        assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()
