"""OpenTelemetry traces: the span tree of one request, in memory and across the real
frontend and worker processes, exported by OTLP to a receiver and to a real collector."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from batchd.protos import traces, wire
from batchd.protos.model_config import ConfigError
from batchd.server import tracing
from tests.servers import EXAMPLES, ServerProcess, grpc_servicer, wait_for

PARENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
# The server's exporters send every 100 ms (the SDK's default is 5 s).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def _traceparent(trace_id: str = PARENT_TRACE, span: str = PARENT_SPAN, flags: str = "01") -> str:
    return f"00-{trace_id}-{span}-{flags}"


# ---- the span tree, in memory ----


@pytest.fixture
def memory() -> Iterator[tuple[traces.Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    t = traces.Tracing.start("frontend", "", exporter=exporter)
    yield t, exporter
    t.shutdown()


def test_a_batch_of_two_requests_gives_each_its_tree_and_links_them(
    memory: tuple[traces.Tracing, InMemorySpanExporter],
) -> None:
    t, exporter = memory
    first = tracing.begin(t, "tiny", "a", {"traceparent": _traceparent()})
    second = tracing.begin(t, "tiny", "b", None)
    assert first is not None and second is not None
    for r in (first, second):
        r.phase("admission")
    header = wire.Header(kind=wire.Header.BATCH, rows=3)
    span = tracing.start_batch([first, second], "tiny", 7, "w0#0", header)
    traceparent = header.traceparent
    tracing.end_batch(span, "", **{"batchd.compute_ns": 5})
    first.phase("response")
    first.end(None)
    second.end(ValueError("no"))
    t._provider.force_flush()
    finished = exporter.get_finished_spans()
    spans = {(s.name, s.attributes.get("batchd.request_id")): s for s in finished}
    root = spans["infer tiny", "a"]
    assert f"{root.context.trace_id:032x}" == PARENT_TRACE
    assert f"{root.parent.span_id:016x}" == PARENT_SPAN  # the caller's span
    children = [s for s in finished if s.parent and s.parent.span_id == root.context.span_id]
    assert sorted(s.name for s in children) == ["admission", "batch", "queue", "response"]
    batch = next(s for s in children if s.name == "batch")
    assert {link.context.span_id for link in batch.links} == {
        root.context.span_id,
        spans["infer tiny", "b"].context.span_id,
    }
    assert traceparent == _traceparent(PARENT_TRACE, f"{batch.context.span_id:016x}")
    queues = [s for s in finished if s.name == "queue"]
    assert len(queues) == 2
    assert all(q.links[0].context.span_id == batch.context.span_id for q in queues)
    other = spans["infer tiny", "b"]
    assert other.parent is None and other.context.trace_id != root.context.trace_id
    assert other.status.status_code is StatusCode.ERROR


def test_off_and_unsampled_requests_carry_no_trace(
    memory: tuple[traces.Tracing, InMemorySpanExporter],
) -> None:
    t, _ = memory
    assert tracing.begin(None, "tiny", "a", {"traceparent": _traceparent()}) is None
    # The caller sampled it out (flags 00): the default sampler follows its parent.
    assert tracing.begin(t, "tiny", "a", {"traceparent": _traceparent(flags="00")}) is None


@pytest.mark.parametrize(
    "url", ["http://[::1", "http://", "http://c:", "http://c:99999", "127.0.0.1:4317", "grpc://c:1"]
)
def test_an_endpoint_that_is_not_a_url_is_a_config_error_naming_it(url: str) -> None:
    with pytest.raises(ConfigError, match=r"is not a URL .*expected one like http://collector"):
        traces.endpoint(url, {})
    with pytest.raises(ConfigError, match="the OTLP endpoint"):
        traces.endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": url})


def test_a_bad_traceparent_or_tracestate_is_ignored_without_a_log_line(
    memory: tuple[traces.Tracing, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK logged a WARNING for every request carrying one, quoting up to 512
    characters of what the caller sent."""
    carriers = [
        {"traceparent": "00-" + "a" * 600},
        {"traceparent": _traceparent(), "tracestate": "x" * 400 + "!!"},
        {"traceparent": _traceparent(), "tracestate": ",".join(f"k{i}=v" for i in range(200))},
    ]
    with caplog.at_level(logging.DEBUG):
        contexts = [traces.extract(c) for c in carriers]
    assert [r.getMessage()[:60] for r in caplog.records if r.levelno >= logging.INFO] == []
    assert len(contexts) == 3


@pytest.mark.parametrize(
    ("environment", "name"),
    [
        ({}, "batchd"),
        ({"OTEL_SERVICE_NAME": "inference"}, "inference"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=prod,deployment.environment=eu"}, "prod"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=prod", "OTEL_SERVICE_NAME": "x"}, "x"),
    ],
)
def test_the_service_name_is_the_environment_s_and_else_batchd(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], name: str
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES' service.name was overridden by batchd's (review 57c);
    OTEL_SERVICE_NAME wins over it, as the specification says."""
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    exporter = InMemorySpanExporter()
    t = traces.Tracing.start("frontend", "", exporter)
    try:
        with t.tracer.start_as_current_span("s"):
            pass
        t.shutdown()
        (span,) = exporter.get_finished_spans()
        assert span.resource.attributes["service.name"] == name
        assert span.resource.attributes["batchd.process"] == "frontend"
    finally:
        t.shutdown()


def test_tracing_is_on_only_with_an_endpoint() -> None:
    assert traces.endpoint(None, {}) is None
    for insecure in ("OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE"):
        bare = {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317", insecure: "true"}
        assert traces.endpoint(None, bare) == "127.0.0.1:4317"  # (the spec's HOST:PORT form)
    assert traces.endpoint("http://c:4317", {}) == "http://c:4317"
    assert traces.endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:4317"}) == (
        "http://e:4317"
    )
    disabled = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:4317"}
    assert traces.endpoint("http://c:4317", disabled) is None


# ---- across processes: a real server exporting by OTLP ----


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span with its resource's batchd.process."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans += [(attrs.get("batchd.process", ""), s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[tuple[str, Any]]:
        with self._lock:
            return [(p, s) for p, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    found = Receiver()
    with grpc_servicer(trace_service_pb2_grpc.add_TraceServiceServicer_to_server, found) as port:
        yield found, port


@pytest.fixture(scope="module")
def traced(
    receiver: tuple[Receiver, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(
        EXAMPLES,
        *("--otlp-endpoint", f"http://127.0.0.1:{receiver[1]}"),
        log_dir=tmp_path_factory.mktemp("traced"),
        env=FAST_EXPORT,
    ).start()
    yield server
    server.stop()


def _tree(receiver: Receiver, trace_id: str) -> dict[str, tuple[str, Any]]:
    """The spans of one request's trace by name, once the worker's has come."""
    wait_for(
        lambda: any(s.name == "compute" for _, s in receiver.of_trace(trace_id)), 30,
        "the worker's compute span",
    )  # fmt: skip
    wait_for(
        lambda: any(s.name == "response" for _, s in receiver.of_trace(trace_id)), 30,
        "the frontend's spans",
    )  # fmt: skip
    return {s.name: (p, s) for p, s in receiver.of_trace(trace_id)}


def _check_tree(tree: dict[str, tuple[str, Any]], trace_id: str) -> None:
    assert set(tree) == {"infer tiny", "admission", "queue", "batch", "response", "compute"}
    process, root = tree["infer tiny"]
    assert process == "frontend" and root.parent_span_id.hex() == PARENT_SPAN
    for name in ("admission", "queue", "batch", "response"):
        assert tree[name][0] == "frontend"
        assert tree[name][1].parent_span_id == root.span_id, name
    process, compute = tree["compute"]
    assert process == "worker"  # recorded in the worker process
    assert compute.parent_span_id == tree["batch"][1].span_id
    assert tree["queue"][1].links[0].span_id == tree["batch"][1].span_id
    assert root.start_time_unix_nano <= compute.start_time_unix_nano <= root.end_time_unix_nano


def test_one_request_over_http_is_one_trace_through_frontend_and_worker(
    traced: ServerProcess, receiver: tuple[Receiver, int]
) -> None:
    trace_id = os.urandom(16).hex()
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]
    }
    request = urllib.request.Request(
        f"{traced.http_url}/v2/models/tiny/infer",
        data=json.dumps(body).encode(),
        headers={"traceparent": _traceparent(trace_id), "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
    _check_tree(_tree(receiver[0], trace_id), trace_id)


@pytest.mark.parametrize(
    ("body", "error"),
    [(b'{"inputs": [', "InvalidInput"), (b'{"inputs": [{"name": "INPUT0"}]}', "InvalidInput")],
    ids=["not JSON", "no datatype"],
)
def test_an_http_body_that_does_not_parse_is_traced_as_an_error(
    traced: ServerProcess, receiver: tuple[Receiver, int], body: bytes, error: str
) -> None:
    """The trace began after the parse: a body that failed it left no span, though
    the same mistake over gRPC was traced, and both were counted."""
    trace_id = os.urandom(16).hex()
    conn = http.client.HTTPConnection("127.0.0.1", traced.http_port, timeout=30)
    try:
        conn.request("POST", "/v2/models/tiny/infer", body, {"traceparent": _traceparent(trace_id)})
        assert conn.getresponse().status == 400
    finally:
        conn.close()
    wait_for(lambda: receiver[0].of_trace(trace_id), 30, "the request's span")
    [(process, root)] = receiver[0].of_trace(trace_id)
    assert (process, root.name, root.parent_span_id.hex()) == (
        "frontend",
        "infer tiny",
        PARENT_SPAN,
    )
    assert root.status.code == 2  # ERROR
    assert {a.key: a.value.string_value for a in root.attributes}["batchd.error"] == error


STATE = "vendor=abc,other=x1"


def _infer_over_grpc(url: str) -> str:
    """One tiny request by tritonclient with a traceparent and a tracestate in its
    metadata; its trace id."""
    trace_id = os.urandom(16).hex()
    client = tc_grpc.InferenceServerClient(url)
    x = tc_grpc.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    headers = {"traceparent": _traceparent(trace_id), "tracestate": STATE}
    client.infer("tiny", [x], headers=headers)
    client.close()
    return trace_id


def test_one_request_over_grpc_takes_its_traceparent_from_metadata(
    traced: ServerProcess, receiver: tuple[Receiver, int]
) -> None:
    trace_id = _infer_over_grpc(traced.url)
    tree = _tree(receiver[0], trace_id)
    _check_tree(tree, trace_id)
    # the caller's tracestate, in every span, the worker's too (its compute span lost it)
    assert {name: s.trace_state for name, (_, s) in tree.items()} == dict.fromkeys(tree, STATE)


# ---- a real collector ----


def _rotel() -> Path | None:
    try:
        import rotel
    except ImportError:
        return None
    agent = Path(rotel.__file__).parent / "rotel-agent"
    return agent if agent.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SIX = ("infer tiny", "admission", "queue", "batch", "compute", "response")


@pytest.mark.skipif(_rotel() is None, reason="rotel (a collector from PyPI) is not installed")
def test_a_real_otlp_collector_receives_the_spans_of_both_processes(
    tmp_path: Path,
) -> None:
    """rotel, an OpenTelemetry collector (pip install rotel; Linux x86-64), prints what it
    receives with its debug exporter."""
    agent = _rotel()
    assert agent is not None
    port = _free_port()
    out = tmp_path / "rotel.out"
    with out.open("wb") as f:
        collector = subprocess.Popen(
            [
                str(agent), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{port}",
                "--otlp-http-endpoint", f"127.0.0.1:{_free_port()}", "--exporter", "blackhole",
                "--debug-log", "traces", "--debug-log-verbosity", "detailed",
            ],
            stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = None
    try:
        server = ServerProcess(
            EXAMPLES, "--otlp-endpoint", f"http://127.0.0.1:{port}", log_dir=tmp_path,
            env=FAST_EXPORT,
        ).start()  # fmt: skip
        trace_id = _infer_over_grpc(server.url)

        def received() -> bool:  # (not a count of the trace id: a batch's links name it too,
            text = out.read_text(errors="replace")  # and it was reached before the last span)
            return all(f"Name           : {name}" in text for name in SIX) and (
                "batchd.process: Str(worker)" in text
            )

        wait_for(received, 30, "rotel to print the request's six spans")
        assert trace_id in out.read_text(errors="replace")
    finally:
        if server is not None:
            server.stop()
        collector.terminate()
        collector.wait(10)


def test_a_server_without_an_endpoint_never_loads_the_sdk(tmp_path: Path) -> None:
    """Off costs nothing: the frontend does not even import the OpenTelemetry SDK."""
    code = (
        "import sys, asyncio\n"
        "from batchd.server import app\n"
        "from batchd.server.config import ServerConfig, Network\n"
        "from batchd.protos import traces\n"
        "assert traces.endpoint(None) is None\n"
        "print('opentelemetry.sdk.trace' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "False"


def _infer_rows(url: str, rows: int) -> str:
    """One request of `rows` rows of tiny, by tritonclient with a traceparent: its trace id."""
    trace_id = os.urandom(16).hex()
    client = tc_grpc.InferenceServerClient(url)
    x = tc_grpc.InferInput("INPUT0", [rows, 16], "FP32")
    x.set_data_from_numpy(np.ones((rows, 16), np.float32))
    client.infer("tiny", [x], headers={"traceparent": _traceparent(trace_id)})
    client.close()
    return trace_id


def test_a_request_split_into_batches_traces_each_batch(
    traced: ServerProcess, receiver: tuple[Receiver, int]
) -> None:
    """40 rows of tiny (max_batch_size 32) go as two batches: both are in the request's
    trace, each with the worker's compute span under it."""
    trace_id = _infer_rows(traced.url, 40)

    def both() -> bool:
        names = [s.name for _, s in receiver[0].of_trace(trace_id)]
        return names.count("compute") == 2 and "response" in names

    wait_for(both, 30, "two batches' spans")
    spans = [s for _, s in receiver[0].of_trace(trace_id)]
    batches = {s.span_id for s in spans if s.name == "batch"}
    assert len(batches) == 2
    assert {s.parent_span_id for s in spans if s.name == "compute"} == batches


def test_a_request_of_many_batches_traces_the_first_64_and_counts_the_rest(
    traced: ServerProcess, receiver: tuple[Receiver, int]
) -> None:
    """2,240 rows of tiny go as 70 batches of 32: three spans each filled the exporter's
    queue (2,048 for every request together) with one request. 64 are traced; the
    root says how many were not."""
    trace_id = _infer_rows(traced.url, 2240)

    def names() -> list[str]:
        return [s.name for _, s in receiver[0].of_trace(trace_id)]

    wait_for(lambda: names().count("compute") == 64 and "infer tiny" in names(), 30, "spans")
    assert names().count("batch") == names().count("queue") == 64
    [root] = [s for _, s in receiver[0].of_trace(trace_id) if s.name == "infer tiny"]
    assert {a.key: a.value.int_value for a in root.attributes}["batchd.batches_untraced"] == 6


def test_a_collector_that_is_down_does_not_hold_the_stop(tmp_path: Path) -> None:
    """Spans that cannot be exported are given up at shutdown (a few seconds), not
    retried while the process is asked to stop; serving is unaffected meanwhile."""
    server = ServerProcess(
        EXAMPLES, "--otlp-endpoint", f"http://127.0.0.1:{_free_port()}", log_dir=tmp_path,
        env=FAST_EXPORT,
    ).start()  # fmt: skip
    _infer_over_grpc(server.url)
    assert server.stop(timeout=20) == 0, server.log()
