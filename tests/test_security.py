"""Security at the gRPC edge: TLS and mutual TLS, bearer tokens, request
limits. Every refusal is shown, next to the case that works.

Certificates come from the `openssl` CLI at test time (tests/certs.py). The
tests run the real gRPC server of app.py in this process (no workers needed:
ServerLive, metadata, health and validation answer without one). The
repository and the workers: tests/test_security_workers.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchd.client import AsyncClient, Client, Unauthenticated
from batchd.client.errors import BatchdClientError
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import keys
from batchd.protos.model_config import ConfigError, ModelConfig
from batchd.protos.repository import load_repository
from batchd.server import siblings
from batchd.server.app import _grpc_server
from batchd.server.auth import DENIED, load_tokens, scope_of
from batchd.server.config import (
    INT_MAX,
    Connections,
    Frontends,
    Limits,
    Network,
    Security,
    ServerConfig,
    add_arguments,
    from_arguments,
)
from batchd.server.errors import NotAllowed
from batchd.server.frontends import bind, endpoints
from batchd.server.index import IndexEntry
from batchd.server.request import Request, Tensor
from batchd.server.security import connection_options, listen, preflight
from batchd.server.service import InferenceService
from batchd.server.stats import Stats
from tests.certs import ADMIN_TOKEN, INFER_TOKEN, openssl
from tests.servers import EXAMPLES, TEST_MODELS, ServerProcess, wait_for

# ---- the real gRPC server, in this process ----


class _NoWorkers:
    """The core behind the servicer: no worker, so nothing is ever ready."""

    def __init__(self) -> None:
        self.models = load_repository(EXAMPLES)
        self.stats = Stats()

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        raise AssertionError("validation should have refused this request")

    def check_room(self, model: str) -> None:
        pass

    def model_ready(self, name: str) -> bool:
        return False

    def load_error(self, name: str) -> str | None:
        return None

    async def load(self, name: str) -> ModelConfig:
        raise NotAllowed("model control is disabled")

    async def unload(self, name: str) -> None:
        raise NotAllowed("model control is disabled")

    async def index(self) -> list[IndexEntry]:
        return [IndexEntry("tiny", "1", "UNAVAILABLE", "no live worker serves it")]

    def cancel(self, request: Request) -> None:
        raise AssertionError("nothing is ever admitted here")


class GrpcServer:
    """app._grpc_server (options, interceptors, TLS) on a loop in a thread."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._run(self._start(cfg))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self, cfg: ServerConfig) -> int:
        service = InferenceService(
            _NoWorkers(),
            limits=cfg.limits,
            calls_per_connection=cfg.connections.max_concurrent_streams,
        )
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        token_file = cfg.security.auth_token_file
        tokens = None if token_file is None else load_tokens(token_file)
        self.server, port = _grpc_server(cfg, service, health, tokens=tokens)
        await self.server.start()
        return port

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def grpc_server(request: pytest.FixtureRequest) -> Iterator[GrpcServer]:
    server = GrpcServer(request.param)
    yield server
    server.stop()


def server_config(**sections: Any) -> ServerConfig:
    """The examples on a free port, with these sections of the config."""
    return ServerConfig(model_repository=EXAMPLES, network=Network(grpc_port=0), **sections)


def _with(**sections: Any) -> Any:
    return pytest.mark.parametrize("grpc_server", [server_config(**sections)], indirect=True)


# ---- tokens ----


def test_token_file_format(tmp_path: Path, token_file: Path) -> None:
    tokens = load_tokens(token_file)
    assert tokens.allows("infer", INFER_TOKEN.encode())
    assert tokens.allows("infer", ADMIN_TOKEN.encode())  # admin may infer too
    assert tokens.allows("admin", ADMIN_TOKEN.encode())
    assert not tokens.allows("admin", INFER_TOKEN.encode())
    assert not tokens.allows("infer", INFER_TOKEN[:-1].encode())
    assert not tokens.allows("infer", None)
    bad = tmp_path / "bad"
    secret = "x" * 40
    for text, expected in (
        (f"root: {secret}\n", "bad:1: expected 'infer: <token>'"),
        (f"infer {secret}\n", "bad:1: expected 'infer: <token>'"),
        ("# nothing\n\n", "holds no token"),
        ("infer: short\n", "at least 16 characters"),
        (f"\ninfer: {secret} {secret}\n", "bad:2: a token must be"),
        # gRPC metadata carries printable ASCII only: such a token worked on HTTP alone
        (f"infer: {secret}\u00e9\n", "bad:1: a token must be at least 16 characters of "
         "printable ASCII"),
        (f"infer: {secret}\x01\n", "bad:1: a token must be"),
    ):  # fmt: skip
        bad.write_text(text)
        with pytest.raises(ConfigError, match=expected) as e:
            load_tokens(bad)
        assert secret not in str(e.value)  # errors never echo a token
    bad.write_bytes(b"infer: " + secret.encode() + b"\xe9\n")  # Latin-1, say
    with pytest.raises(ConfigError, match=r"bad: not UTF-8 \(byte 47 of the file\)"):
        load_tokens(bad)


def test_a_hash_inside_a_token_is_the_token_s(tmp_path: Path) -> None:
    """`#` began a comment anywhere: `0123456789abcdef#rest` let its first 16
    characters pass for it. A comment is a line from `#`, or `#` after a space."""
    path = tmp_path / "tokens"
    path.write_text("# tokens\ninfer: 0123456789abcdef#rest-of-it   # the CI's\n")
    tokens = load_tokens(path)
    assert tokens.allows("infer", b"0123456789abcdef#rest-of-it")
    assert not tokens.allows("infer", b"0123456789abcdef")


def test_scopes() -> None:
    assert scope_of("/grpc.health.v1.Health/Check") is None
    assert scope_of("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is None
    for method in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"):
        assert scope_of(f"/inference.GRPCInferenceService/{method}") == "admin"
    for method in ("ModelInfer", "ModelStreamInfer", "ModelStatistics", "ServerLive"):
        assert scope_of(f"/inference.GRPCInferenceService/{method}") == "infer"
    assert scope_of("/some.Other/Method") == "infer"  # unknown: not open


def _raw_call(url: str, method: str, msg: Any, token: str | None = None, **kw: Any) -> Any:
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(url) as channel:
        return getattr(pb_grpc.GRPCInferenceServiceStub(channel), method)(
            msg, metadata=metadata, timeout=10, **kw
        )


@pytest.fixture(scope="module")
def token_server(token_file: Path) -> Iterator[GrpcServer]:
    server = GrpcServer(server_config(security=Security(auth_token_file=token_file)))
    yield server
    server.stop()


def test_missing_or_wrong_token_is_unauthenticated_with_one_generic_detail(
    token_server: GrpcServer,
) -> None:
    for token in (None, "wrong-token-0123456789", INFER_TOKEN + "x"):
        with Client(token_server.url, token=token) as c, pytest.raises(Unauthenticated) as e:
            c.live()
        assert e.value.message == DENIED
    with grpc.insecure_channel(token_server.url) as channel:  # not "Bearer", or empty: refused
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for header in (INFER_TOKEN, "Bearer "):  # (batchd's client sends neither)
            with pytest.raises(grpc.RpcError) as rpc:
                stub.ServerLive(pb.ServerLiveRequest(), metadata=(("authorization", header),))
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the first authorization entry alone counts, as HTTP reads its first header (a
        # Bearer after another passed here, and failed there)
        with pytest.raises(grpc.RpcError) as rpc:
            stub.ServerLive(pb.ServerLiveRequest(), metadata=(
                ("authorization", "Basic Zm9vOmJhcg=="), ("authorization", f"Bearer {INFER_TOKEN}"),
            ))  # fmt: skip
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="tiny")]))
        with pytest.raises(grpc.RpcError) as rpc:
            list(stream)
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rpc.value.details() == DENIED


def test_a_call_without_a_token_is_refused_before_its_message_is_read(token_file: Path) -> None:
    """A unary call was refused by a handler that read (and copied) its message first:
    each such 60 MB call cost the frontend 167 MB (review 57b). Unread, a message past
    --max-message-bytes is refused for its token, not its size."""
    network = Network(grpc_port=0, max_message_bytes=1 << 20)
    server = GrpcServer(ServerConfig(model_repository=EXAMPLES, network=network,
                                     security=Security(auth_token_file=token_file)))  # fmt: skip
    big = pb.ModelInferRequest(model_name="tiny", raw_input_contents=[bytes(2 << 20)])
    try:
        index = pb.RepositoryIndexRequest(repository_name="x" * (2 << 20))
        for method, msg in (("ModelInfer", big), ("RepositoryIndex", index)):
            with pytest.raises(grpc.RpcError) as rpc:
                _raw_call(server.url, method, msg)
            assert (rpc.value.code(), rpc.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, DENIED), method  # fmt: skip
        with pytest.raises(grpc.RpcError) as rpc:  # (with its token, its size is refused)
            _raw_call(server.url, "ModelInfer", big, INFER_TOKEN)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop()


def test_infer_and_admin_tokens(token_server: GrpcServer) -> None:
    for token in (INFER_TOKEN, ADMIN_TOKEN):
        with Client(token_server.url, token=token) as c:
            assert c.live()
            assert c.model_metadata("tiny")["inputs"][0]["name"] == "INPUT0"
    index = pb.RepositoryIndexRequest()
    with pytest.raises(grpc.RpcError) as rpc:
        _raw_call(token_server.url, "RepositoryIndex", index, INFER_TOKEN)
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rpc.value.details() == DENIED
    models = _raw_call(token_server.url, "RepositoryIndex", index, ADMIN_TOKEN).models
    assert "tiny" in [m.name for m in models]


def test_health_and_reflection_need_no_token(token_server: GrpcServer) -> None:
    with grpc.insecure_channel(token_server.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([ask]), timeout=10
        )
        names = [s.name for a in answers for s in a.list_services_response.service]
        assert "inference.GRPCInferenceService" in names


# ---- TLS ----


@openssl
def test_tls(certs: Path) -> None:
    server = GrpcServer(
        server_config(
            security=Security(tls_cert=certs / "server.pem", tls_key=certs / "server.key")
        )
    )
    try:
        with Client(server.url, ca_cert=certs / "ca.pem") as c:
            assert c.live()
        with Client(server.url, ca_cert=(certs / "ca.pem").read_bytes()) as c:
            assert c.live()
        for refused in (
            {"tls": True},  # the system's CAs do not know ours
            {"ca_cert": certs / "stranger-ca.pem"},
            {},  # plaintext to a TLS port
        ):
            with Client(server.url, timeout=5, **refused) as c, pytest.raises(BatchdClientError):
                c.live()
    finally:
        server.stop()


@openssl
def test_mutual_tls(certs: Path) -> None:
    server = GrpcServer(
        server_config(
            security=Security(
                tls_cert=certs / "server.pem",
                tls_key=certs / "server.key",
                tls_client_ca=certs / "ca.pem",
            )
        )
    )
    ca = certs / "ca.pem"
    try:
        with Client(
            server.url,
            ca_cert=ca,
            client_cert=certs / "client.pem",
            client_key=certs / "client.key",
        ) as c:
            assert c.live()
        stranger = {"client_cert": certs / "stranger.pem", "client_key": certs / "stranger.key"}
        for mine in ({}, stranger):  # no client certificate; one the CA did not sign
            client = Client(server.url, timeout=5, ca_cert=ca, **mine)
            with client, pytest.raises(BatchdClientError):
                client.live()

        async def async_client() -> bool:
            async with AsyncClient(
                server.url,
                ca_cert=ca,
                client_cert=certs / "client.pem",
                client_key=certs / "client.key",
            ) as c:
                return await c.live()

        assert asyncio.run(async_client())
    finally:
        server.stop()


def test_tls_settings_are_checked_at_start_up(tmp_path: Path) -> None:
    for security, expected in (
        (Security(tls_cert=tmp_path / "c.pem"), "go together"),
        (Security(tls_client_ca=tmp_path / "ca.pem"), "needs --tls-cert"),
        (Security(tls_cert=tmp_path / "c", tls_key=tmp_path / "k"), "cannot read"),
        (Security(auth_token_file=tmp_path / "none"), "cannot read the token file"),
    ):
        cfg = server_config(security=security)
        with pytest.raises(ConfigError, match=expected):
            cfg.check()
            preflight(cfg)


def test_one_port_given_to_two_flags_is_refused_naming_both() -> None:
    """It was refused as "Address already in use", which sent the operator looking for
    another process; with --frontends N both servers bound it with SO_REUSEPORT."""
    for network, expected in (
        (Network(grpc_port=18501, http_port=18501), "--grpc-port and --http-port both take"),
        (Network(http_port=9000, metrics_port=9000), "--http-port and --metrics-port both"),
    ):
        with pytest.raises(ConfigError, match=expected):
            preflight(ServerConfig(model_repository=EXAMPLES, network=network))
    free = Network(grpc_port=0, http_port=0, metrics_port=-1)  # (0: each a free one)
    preflight(ServerConfig(model_repository=EXAMPLES, network=free))


# ---- limits ----


def _tiny(rows: int, inputs: int = 1) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="tiny")
    for _ in range(inputs):
        msg.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 16])
        msg.raw_input_contents.append(np.zeros((rows, 16), np.float32).tobytes())
    return msg


@_with(limits=Limits(max_inputs=2, max_tensor_elements=100))
def test_request_limits_name_the_limit_and_the_value(grpc_server: GrpcServer) -> None:
    with pytest.raises(grpc.RpcError) as rpc:
        _raw_call(grpc_server.url, "ModelInfer", _tiny(7))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "[7, 16] has 112 elements" in rpc.value.details()
    assert "limit of 100 (--max-tensor-elements)" in rpc.value.details()
    with pytest.raises(grpc.RpcError) as rpc:
        _raw_call(grpc_server.url, "ModelInfer", _tiny(1, inputs=3))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 inputs, more than the server's limit of 2" in rpc.value.details()
    with pytest.raises(grpc.RpcError) as rpc:  # within the limits: it gets as far as the queue
        _raw_call(grpc_server.url, "ModelInfer", _tiny(6, inputs=2))
    assert "appears twice" in rpc.value.details()


def test_message_size_limit() -> None:
    server = GrpcServer(server_config())
    cfg_bytes = Network().max_message_bytes
    try:
        with (
            Client(server.url, max_message_bytes=2 * cfg_bytes) as c,
            pytest.raises(BatchdClientError) as e,
        ):
            c.infer("tiny", {"INPUT0": np.zeros((cfg_bytes // 64 + 1, 16), np.float32)})
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(cfg_bytes) in e.value.message
    finally:
        server.stop()


@_with(connections=Connections(max_concurrent_streams=1))
def test_max_concurrent_streams(grpc_server: GrpcServer) -> None:
    """A connection holding its one stream gets RESOURCE_EXHAUSTED for the next call,
    naming the limit; another connection is served, and so is this one once free."""
    own = [("grpc.use_local_subchannel_pool", 1)]  # each channel a connection of its own
    with grpc.insecure_channel(grpc_server.url, options=own) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        held = threading.Event()

        def requests() -> Iterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="nonexistent")
            held.wait(30)

        stream = stub.ModelStreamInfer(requests())
        assert "unknown model" in next(stream).error_message  # the stream is open
        with pytest.raises(grpc.RpcError) as rpc:
            stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-streams 1" in (rpc.value.details() or "")
        # the call would pass once one ends: clients that retry only with a pushback do
        assert ("grpc-retry-pushback-ms", "100") in (rpc.value.trailing_metadata() or ())
        with grpc.insecure_channel(grpc_server.url, options=own) as other:
            live = pb_grpc.GRPCInferenceServiceStub(other).ServerLive
            assert live(pb.ServerLiveRequest(), timeout=10).live
        held.set()
        assert list(stream) == []
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live  # its count went back


# ---- settings refused at start-up, and what 0 means ----


def _parsed(*argv: str) -> ServerConfig:
    """The config `batchd serve` builds from these flags."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(["--model-repository", str(EXAMPLES), *argv]))


SECONDS = "seconds from 0 to 2147483.647"
PORT = "a port from 0 to 65535 (0: a free one)"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--keepalive-time", "inf", f"{SECONDS}, got inf"),  # was an OverflowError
        ("--drain-timeout", "inf", f"{SECONDS}, got inf"),
        ("--handshake-timeout", "nan", f"{SECONDS}, got nan"),
        ("--keepalive-time", "3000000", f"{SECONDS}, got 3000000.0"),  # a C int of ms in gRPC
        ("--max-message-bytes", "3000000000", "an integer from 1 to 2147483647, got 3000000000"),
        # gRPC takes twice as many as a hard limit, and 64 more streams than calls
        ("--max-pending-calls", "2000000000", "an integer from 1 to 1073741823, got 2000000000"),
        ("--max-concurrent-streams", "2147483647", "an integer from 1 to 2147483583, got "
         "2147483647"),
        ("--workers", "0", "a positive integer, got 0"),
        ("--frontends", "257", "an integer from 1 to 256, got 257"),  # workers crash-looped
        ("--grpc-port", "-5", f"{PORT}, got -5"),  # gRPC served on 65531
        ("--grpc-port", "-1", f"{PORT}, got -1"),  # gRPC is never off
        ("--http-port", "70000", f"{PORT}, or -1 (off), got 70000"),
        ("--metrics-port", "70000", f"{PORT}, or -1 (off), got 70000"),
        ("--jobs-retention-hours", "inf", "finite hours >= 0, got inf"),
    ],
)  # fmt: skip
def test_a_setting_out_of_its_range_is_refused_naming_the_flag(
    flag: str, value: str, message: str
) -> None:
    """What would crash later (an OverflowError, gRPC's C ints, a bind) is refused by
    ServerConfig.check, saying the flag, what it takes and what came."""
    with pytest.raises(ConfigError) as e:
        _parsed(flag, value).check()
    assert str(e.value) == f"{flag} takes {message}"


def test_the_ends_of_each_range_are_taken() -> None:
    _parsed(
        "--grpc-port", "65535", "--http-port", "-1", "--metrics-port", "0",
        "--keepalive-time", "2147483.647", "--max-message-bytes", "2147483647",
        "--max-pending-calls", "1073741823", "--max-concurrent-streams", "2147483583",
        "--drain-timeout", "0", "--jobs-retention-hours", "1e300",
    ).check()  # fmt: skip


CONNECTION_SECONDS = [
    *("handshake_timeout_s", "max_idle_s", "max_age_s", "max_age_grace_s"),
    *("keepalive_permit_s", "keepalive_time_s", "keepalive_timeout_s"),
]


def test_0_turns_each_connection_limit_off_as_grpc_reads_it() -> None:
    """0 is "no limit" for each connection setting. gRPC says "never" with INT_MAX ms, its
    own 0 being "at once" (a handshake timeout or keepalive time of 0: 1 ms), except for
    the ping interval a client may use, where gRPC's 0 is "no limit" (the option left
    out meant its 5 minutes: a client pinging every 3 s was sent GOAWAY too_many_pings)."""
    options = dict(connection_options(Connections(**dict.fromkeys(CONNECTION_SECONDS, 0.0))))
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 0
    never = [
        *("grpc.server_handshake_timeout_ms", "grpc.max_connection_idle_ms"),
        *("grpc.max_connection_age_ms", "grpc.max_connection_age_grace_ms"),
        *("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms"),
    ]
    assert {name: options[name] for name in never} == dict.fromkeys(never, INT_MAX)
    defaults = dict(connection_options(Connections()))
    assert defaults["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert defaults["grpc.server_handshake_timeout_ms"] == 20_000


@_with(connections=Connections(**dict.fromkeys(CONNECTION_SECONDS, 0.0)))
def test_a_server_with_every_connection_limit_off_serves(grpc_server: GrpcServer) -> None:
    with Client(grpc_server.url, timeout=10) as c:
        assert c.live()


@openssl
def test_tls_files_that_ssl_cannot_load_are_named_at_start_up(certs: Path, tmp_path: Path) -> None:
    """gRPC takes any bytes for PEM and then cannot bind ("Failed to bind to address"):
    preflight loads the files with ssl first, naming the one refused and ssl's reason."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("garbage\n")
    cert, key, other_key = certs / "server.pem", certs / "server.key", certs / "client.key"
    for security, expected, reason in (
        (Security(tls_cert=garbage, tls_key=key), f"--tls-cert {garbage}", "NO_CERTIFICATE"),
        (Security(tls_cert=cert, tls_key=other_key), f"--tls-key {other_key} (the key of "
         "--tls-cert)", "KEY_VALUES_MISMATCH"),
        (Security(tls_cert=cert, tls_key=garbage), f"--tls-key {garbage} (the key of "
         "--tls-cert)", "PEM"),
        (Security(tls_cert=cert, tls_key=key, tls_client_ca=garbage),
         f"--tls-client-ca {garbage}", "NO_CERTIFICATE"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            preflight(server_config(security=security))
        assert str(e.value).startswith(f"{expected}: not usable for TLS: ["), str(e.value)
        assert reason in str(e.value) and "_ssl.c" not in str(e.value)
    # an encrypted key: OpenSSL prompted on a terminal for its passphrase (start-up hung),
    # else failed as "cannot read it: Invalid argument"
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(encrypted), "-aes256",
                    "-passout", "pass:secret"], check=True, capture_output=True)  # fmt: skip
    with pytest.raises(ConfigError, match=r"is encrypted, and batchd asks for no passphrase"):
        preflight(server_config(security=Security(tls_cert=cert, tls_key=encrypted)))
    good = Security(tls_cert=cert, tls_key=key, tls_client_ca=certs / "ca.pem")
    assert preflight(server_config(security=good)) is None


def test_a_worker_endpoint_that_cannot_be_bound_is_refused_naming_the_flag() -> None:
    """ZeroMQ's ZMQError came out of `batchd serve` as a traceback."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        with socket.create_server(("127.0.0.1", 0)) as busy:
            port = busy.getsockname()[1]
            for endpoint, why in ((f"tcp://127.0.0.1:{port}", "Address already in use"),
                                  ("garbage://x", "Protocol not supported")):  # fmt: skip
                with pytest.raises(
                    ConfigError, match=f"^cannot bind --worker-endpoint {endpoint}: {why}"
                ):
                    bind(router, endpoint, given=True)
        private = "ipc:///" + "x" * 200 + "/workers.sock"  # past a socket path's length
        with pytest.raises(ConfigError, match=r"^cannot bind the workers' socket \(under TMPDIR\)"):
            bind(router, private, given=False)
    finally:
        router.close(linger=0)
        ctx.term()


def test_a_temporary_directory_too_long_for_the_workers_sockets_is_refused_at_once() -> None:
    """--frontends 2 under a TMPDIR where workers.sock fits a socket path and
    workers-1.sock does not: frontend 1 failed to bind, naming --worker-endpoint (which
    frontend 0 passes it), and was started again and again. Frontend 0 refuses it."""
    tmp = "/tmp/" + "t" * (zmq.IPC_PATH_MAX_LEN - len("/tmp//workers.sock"))
    assert len(endpoints(tmp, 1)) == 1
    with pytest.raises(ConfigError, match=r"workers-1\.sock is longer than a socket path"):
        endpoints(tmp, 2)
    # where the check passes, every frontend's socket for the others fits as well
    for count in (1, 2, 12):
        longest = endpoints("", count)[-1].removeprefix("ipc:///")  # workers-11.sock
        fits = "/tmp/" + "t" * (zmq.IPC_PATH_MAX_LEN - len("/tmp//") - len(longest))
        assert len(endpoints(fits, count)[-1]) - len("ipc://") == zmq.IPC_PATH_MAX_LEN
        assert max(map(len, siblings.sockets(fits, count))) <= zmq.IPC_PATH_MAX_LEN


def test_a_grpc_port_in_use_is_refused_naming_the_address(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """gRPC raises a bare RuntimeError ("Failed to bind to address"): listen names the
    address and the OS's reason in a ConfigError, which `batchd serve` prints without a
    traceback (as it does for a busy HTTP port), in one line: the port is asked first,
    so gRPC does not log one of its own ("add_port.cc ... Failed to add port")."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        cfg = ServerConfig(model_repository=EXAMPLES, network=Network(grpc_port=port))

        async def bind() -> None:
            server = grpc.aio.server()
            try:
                listen(server, cfg)
            finally:
                await server.stop(None)

        with pytest.raises(ConfigError) as e:
            asyncio.run(bind())
    assert str(e.value) == (
        f"cannot serve gRPC on 127.0.0.1:{port}: Address already in use (--grpc-port; 0: a "
        "free one)"
    )
    assert "Failed to add port" not in capfd.readouterr().err


def test_a_server_off_loopback_warns_of_each_port_in_clear(tmp_path: Path) -> None:
    """--host 0.0.0.0 with TLS and tokens guards gRPC and HTTP; /metrics is neither, and
    nothing said so."""
    server = ServerProcess(TEST_MODELS, "--host", "0.0.0.0", log_dir=tmp_path).start()
    try:
        log = server.log()
        assert "gRPC and HTTP on 0.0.0.0 without TLS" in log
        assert "/metrics on 0.0.0.0 (--metrics-port 0)" in log and "or --metrics-port -1" in log
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_serves_grpc_and_http(tmp_path: Path, host: str) -> None:
    """--host ::1 failed to bind gRPC (it took "::1:0"), --host [::1] failed HTTP and
    /metrics (aiohttp took the brackets): either form serves all three."""
    server = ServerProcess(TEST_MODELS, "--host", host, log_dir=tmp_path).start(ready=False)
    try:
        with Client(f"[::1]:{server.port}") as c:
            wait_for(c.ready, 60, "ServerReady over IPv6")
        with urllib.request.urlopen(f"http://[::1]:{server.http_port}/v2/health/ready") as r:
            assert r.status == 200
        with urllib.request.urlopen(server.metrics_url()) as r:
            assert b"batchd_" in r.read()
        # the log gives each address as a client takes it (it said ::1:PORT)
        assert f"serving gRPC on [::1]:{server.port};" in server.log()
        assert f"serving HTTP on [::1]:{server.http_port}" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_secrets_readable_by_others_are_warned_of(
    tmp_path: Path, token_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The token file was checked; the CURVE secrets (the frontend's, the local
    workers') were not."""
    key_dir = tmp_path / "keys"
    keys.generate(key_dir)
    secrets = [token_file, key_dir / "server.key_secret", key_dir / "worker.key_secret"]
    for path in secrets:
        path.chmod(0o644)
    security = Security(auth_token_file=token_file, worker_keys=key_dir)
    with caplog.at_level(logging.WARNING, "batchd.server"):
        preflight(server_config(security=security))
    warned = {r.getMessage() for r in caplog.records if "readable by other users" in r.message}
    assert warned == {f"{p} is readable by other users: chmod 600 it" for p in secrets}
    caplog.clear()  # frontend 0 says so; the others of --frontends N do not say it again
    with caplog.at_level(logging.WARNING, "batchd.server"):
        preflight(server_config(security=security, frontends=Frontends(count=2, index=1)))
    assert not [r for r in caplog.records if "other users" in r.message]
    # `batchd worker` on another host, its secret copied there (cp, scp: 0644): it said nothing
    worker = subprocess.Popen(
        [sys.executable, "-m", "batchd.worker", "--connect", f"ipc://{tmp_path}/none.sock",
         "--worker-keys", str(key_dir), "--model-repository", str(EXAMPLES)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stderr is not None
        first = worker.stderr.readline()  # (the warning comes before it tries to connect)
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
    assert f"{key_dir / 'worker.key_secret'} is readable by other users: chmod 600 it" in first
