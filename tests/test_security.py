"""Security: TLS and mutual TLS, bearer tokens, request limits, repository
confinement, CURVE-authenticated workers. Every refusal is shown, next to the
case that works.

Certificates come from the `openssl` CLI at test time. The gRPC tests run the
real gRPC server of app.py in this process (no workers needed: ServerLive,
metadata, health and validation answer without one); the worker tests start
real processes, the remote worker in its own network namespace when `ip netns`
is allowed (else from another loopback address).
"""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
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

from batchd.client import AsyncClient, Client, DeadlineExceeded, Unauthenticated
from batchd.client.errors import BatchdClientError
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import keys, wire
from batchd.protos.model_config import (
    ConfigError,
    ModelConfig,
    confined,
    load_repository,
    model_directory,
)
from batchd.server.app import ServerConfig, _grpc_server
from batchd.server.auth import DENIED, load_tokens, scope_of
from batchd.server.codec import Limits
from batchd.server.control import IndexEntry
from batchd.server.errors import NotAllowed
from batchd.server.request import Request, Tensor
from batchd.server.security import SecurityConfig, check_worker_endpoint
from batchd.server.service import InferenceService
from batchd.server.stats import Stats
from tests.servers import EXAMPLES, ROOT, ServerProcess, wait_for

INFER_TOKEN = "infer-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


# ---- certificates ----


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-set_serial", str(time.monotonic_ns()), "-days", "1", "-out", f"{name}.pem",
        "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem signs server.pem (127.0.0.1, localhost) and client.pem; stranger-ca signs
    stranger.pem, a client certificate the server must not accept."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "stranger-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "stranger", "stranger-ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(f"# batchd tokens\ninfer: {INFER_TOKEN}\n\nadmin: {ADMIN_TOKEN}  # ops\n")
    path.chmod(0o600)
    return path


# ---- the real gRPC server, in this process ----


class _NoWorkers:
    """The core behind the servicer: no worker, so nothing is ever ready."""

    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]:
        raise AssertionError("validation should have refused this request")

    def check_room(self, model: str) -> None:
        pass

    def model_ready(self, name: str) -> bool:
        return False

    async def load(self, name: str) -> ModelConfig:
        raise NotAllowed("model control is disabled")

    async def unload(self, name: str) -> None:
        raise NotAllowed("model control is disabled")

    def index(self) -> list[IndexEntry]:
        return [IndexEntry("tiny", "1", "UNAVAILABLE", "no live worker serves it")]


class GrpcServer:
    """app._grpc_server (options, interceptors, TLS) on a loop in a thread."""

    def __init__(self, security: SecurityConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._run(self._start(security))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self, security: SecurityConfig) -> int:
        cfg = ServerConfig(model_repository=EXAMPLES, grpc_port=0, security=security)
        models = load_repository(EXAMPLES)
        service = InferenceService(models, _NoWorkers(), Stats(), limits=security.limits)
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server, port = _grpc_server(cfg, service, health)
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


def _with(**kw: Any) -> Any:
    return pytest.mark.parametrize("grpc_server", [SecurityConfig(**kw)], indirect=True)


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
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=expected) as e:
            load_tokens(bad)
        assert secret not in str(e.value)  # errors never echo a token


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
    server = GrpcServer(SecurityConfig(auth_token_file=token_file))
    yield server
    server.stop()


def test_missing_or_wrong_token_is_unauthenticated_with_one_generic_detail(
    token_server: GrpcServer,
) -> None:
    for token in (None, "wrong-token-0123456789", INFER_TOKEN + "x", ""):
        with Client(token_server.url, token=token) as c, pytest.raises(Unauthenticated) as e:
            c.live()
        assert e.value.message == DENIED
    with grpc.insecure_channel(token_server.url) as channel:  # not "Bearer": refused
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as rpc:
            stub.ServerLive(pb.ServerLiveRequest(), metadata=(("authorization", INFER_TOKEN),))
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="tiny")]))
        with pytest.raises(grpc.RpcError) as rpc:
            list(stream)
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rpc.value.details() == DENIED


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
    server = GrpcServer(SecurityConfig(tls_cert=certs / "server.pem", tls_key=certs / "server.key"))
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
        SecurityConfig(
            tls_cert=certs / "server.pem",
            tls_key=certs / "server.key",
            tls_client_ca=certs / "ca.pem",
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
    from batchd.server.security import preflight

    for cfg, expected in (
        (SecurityConfig(tls_cert=tmp_path / "c.pem"), "go together"),
        (SecurityConfig(tls_client_ca=tmp_path / "ca.pem"), "needs --tls-cert"),
        (SecurityConfig(tls_cert=tmp_path / "c", tls_key=tmp_path / "k"), "cannot read"),
        (SecurityConfig(auth_token_file=tmp_path / "none"), "cannot read the token file"),
    ):
        with pytest.raises(ConfigError, match=expected):
            preflight(cfg, None)


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
    server = GrpcServer(SecurityConfig())
    cfg_bytes = ServerConfig(model_repository=EXAMPLES).max_message_bytes
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


@_with(max_concurrent_streams=1)
def test_max_concurrent_streams(grpc_server: GrpcServer) -> None:
    """A connection holding its one stream makes its next call wait; another connection
    is served."""
    own = [("grpc.use_local_subchannel_pool", 1)]  # each channel a connection of its own
    with grpc.insecure_channel(grpc_server.url, options=own) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live  # settings known
        held = threading.Event()

        def requests() -> Iterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="nonexistent")
            held.wait(30)

        stream = stub.ModelStreamInfer(requests())
        assert "unknown model" in next(stream).error_message  # the stream is open
        with pytest.raises(grpc.RpcError) as rpc:
            stub.ServerLive(pb.ServerLiveRequest(), timeout=0.5)
        assert rpc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with grpc.insecure_channel(grpc_server.url, options=own) as other:
            live = pb_grpc.GRPCInferenceServiceStub(other).ServerLive
            assert live(pb.ServerLiveRequest(), timeout=10).live
        held.set()
        assert list(stream) == []


# ---- the model repository ----


def _model(d: Path, name: str = "", artifact: str = "model.py") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    head = f'name = "{name}"\n' if name else ""
    (d / "model.toml").write_text(
        head + 'max_batch_size = 4\n[[input]]\nname = "X"\ndatatype = "FP32"\nshape = [1]\n'
        '[[output]]\nname = "Y"\ndatatype = "FP32"\nshape = [1]\n'
    )
    (d / artifact).write_text("def load(device):\n    return lambda x: x\n")
    return d


def test_repository_paths_stay_inside(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    _model(repo / "ok")
    _model(outside / "evil")
    (repo / "linked").symlink_to(repo / "ok")  # a symlink inside the repository is fine
    assert set(load_repository(repo)) == {"ok", "linked"}

    (repo / "escape").symlink_to(outside / "evil")
    with pytest.raises(ConfigError, match="outside the model repository"):
        load_repository(repo)
    (repo / "escape").unlink()

    _model(repo / "sneaky")
    (repo / "sneaky" / "model.py").unlink()
    (repo / "sneaky" / "model.py").symlink_to(outside / "evil" / "model.py")
    with pytest.raises(ConfigError, match=r"sneaky/model.py: resolves to .*outside"):
        load_repository(repo)
    shutil.rmtree(repo / "sneaky")

    _model(repo / "named", name="../evil")
    with pytest.raises(ConfigError, match="key 'name': expected letters"):
        load_repository(repo)
    shutil.rmtree(repo / "named")

    assert model_directory(repo, "ok") == (repo / "ok").resolve()
    for name in ("../outside", "..", "/etc", "ok/../../outside", ".hidden", ""):
        with pytest.raises(ConfigError, match="not a model name"):
            model_directory(repo, name)
    (repo / "out").symlink_to(outside)
    with pytest.raises(ConfigError, match="outside the model repository"):
        model_directory(repo, "out")
    with pytest.raises(ConfigError, match="outside"):
        confined(repo, repo / ".." / "outside")


def test_worker_loader_refuses_an_artifact_outside_the_repository(tmp_path: Path) -> None:
    from dataclasses import replace

    import torch

    from batchd.worker.loader import load_model

    repo = tmp_path / "repo"
    cfg = load_repository(_model(repo / "m").parent)["m"]
    assert load_model(cfg, torch.device("cpu"))(1) == 1
    evil = _model(tmp_path / "evil") / "model.py"
    with pytest.raises(ConfigError, match="outside the model repository"):
        load_model(replace(cfg, artifact=evil), torch.device("cpu"))


def test_every_torch_load_is_weights_only() -> None:
    """torch.load unpickles: wherever batchd calls it, it must pass weights_only=True."""
    for folder in ("server", "worker", "protos", "client", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                    flag = [k.value for k in node.keywords if k.arg == "weights_only"]
                    assert flag and ast.literal_eval(flag[0]) is True, (
                        f"{path}:{node.lineno}: torch.load without weights_only=True"
                    )


# ---- worker keys ----


def test_keys_generate_and_load(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    keys.generate(d)
    assert (d / "server.key_secret").stat().st_mode & 0o777 == 0o600
    assert (d / "worker.key_secret").stat().st_mode & 0o777 == 0o600
    assert keys.load_authorized(d) == {keys.load_public(d, "worker")}
    assert keys.load_pair(d, "worker").public == keys.load_public(d, "worker")
    with pytest.raises(ConfigError, match="not overwriting"):
        keys.generate(d)
    public_only = tmp_path / "public-only"
    public_only.mkdir()
    shutil.copyfile(d / "worker.key", public_only / "worker.key_secret")
    with pytest.raises(ConfigError, match="holds no secret key"):
        keys.load_pair(public_only, "worker")
    with pytest.raises(ConfigError, match="cannot read a CURVE key"):
        keys.load_pair(tmp_path, "worker")
    (d / "authorized" / "worker.key").unlink()
    with pytest.raises(ConfigError, match="no worker public keys"):
        keys.load_authorized(d)


def test_worker_endpoint_off_loopback_needs_keys(tmp_path: Path) -> None:
    for endpoint in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:1"):
        with pytest.raises(ConfigError, match="--worker-keys"):
            check_worker_endpoint(endpoint, None)
        check_worker_endpoint(endpoint, tmp_path)
    for endpoint in ("tcp://127.0.0.1:5555", "tcp://127.0.0.2:1", "tcp://[::1]:1", "ipc:///x", ""):
        check_worker_endpoint(endpoint, None)  # loopback: allowed, with a warning
    result = subprocess.run(
        [sys.executable, "-m", "batchd.server", "--model-repository", str(EXAMPLES),
         "--no-local-workers", "--worker-endpoint", "tcp://0.0.0.0:5555"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--worker-keys" in result.stderr and "batchd keys generate" in result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def remote_host() -> Iterator[tuple[str, list[str]]]:
    """(the frontend's address as a worker elsewhere sees it, the command prefix that runs
    a process there): a network namespace joined by a veth pair when `ip netns` is
    allowed, else another loopback address."""
    n = os.getpid() % 200 + 20
    ns, host_if, ns_if = f"batchd-sec-{os.getpid()}", f"bdh{os.getpid()}", f"bdn{os.getpid()}"
    ok = shutil.which("ip") is not None and _run("ip", "netns", "add", ns)
    try:
        ok = ok and all(
            _run(*cmd.split())
            for cmd in (
                f"ip link add {host_if} type veth peer name {ns_if}",
                f"ip link set {ns_if} netns {ns}",
                f"ip addr add 10.213.{n}.1/30 dev {host_if}",
                f"ip link set {host_if} up",
                f"ip netns exec {ns} ip addr add 10.213.{n}.2/30 dev {ns_if}",
                f"ip netns exec {ns} ip link set {ns_if} up",
                f"ip netns exec {ns} ip link set lo up",
            )
        )
        yield (f"10.213.{n}.1", ["ip", "netns", "exec", ns]) if ok else ("127.0.0.2", [])
    finally:
        _run("ip", "netns", "del", ns)
        _run("ip", "link", "del", host_if)


def _rogue(ctx: zmq.Context[Any], endpoint: str, name: str, key_dir: Path | None) -> Any:
    """A raw DEALER that says READY for `tiny`, with keys of `key_dir` (or no CURVE at all)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    if key_dir is not None:
        keys.make_curve_client(dealer, key_dir)
    dealer.connect(endpoint)
    info = wire.WorkerInfo(worker_id=name, models=["tiny"], protocol=wire.PROTOCOL_VERSION)
    dealer.send_multipart(wire.pack(wire.Header(kind=wire.Header.READY, worker=info)))
    return dealer


def _tiny_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "tiny", repo / "tiny")
    return repo


@openssl
def test_only_workers_with_authorized_keys_join(
    tmp_path: Path, certs: Path, token_file: Path, remote_host: tuple[str, list[str]]
) -> None:
    """A frontend with every option: TLS, tokens, CURVE workers on a non-local address.
    Peers without CURVE or with unknown keys never register nor see a batch; a worker
    with the keys, started from the other host, serves."""
    address, elsewhere = remote_host
    repo, key_dir, strangers = _tiny_repo(tmp_path), tmp_path / "keys", tmp_path / "strangers"
    keys.generate(key_dir)
    keys.generate(strangers)
    shutil.copyfile(key_dir / "server.key", strangers / "server.key")  # knows the server's key
    endpoint = f"tcp://{address}:{free_port()}"
    server = ServerProcess(
        repo,
        "--no-local-workers",
        "--worker-endpoint", endpoint,
        "--worker-keys", str(key_dir),
        "--tls-cert", str(certs / "server.pem"),
        "--tls-key", str(certs / "server.key"),
        "--auth-token-file", str(token_file),
        log_dir=tmp_path,
    ).start(ready=False)  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    worker = None
    try:
        plain = _rogue(ctx, endpoint, "rogue-plain", None)
        stranger = _rogue(ctx, endpoint, "rogue-stranger", strangers)
        with Client(server.url, ca_cert=certs / "ca.pem", token=INFER_TOKEN) as c:
            wait_for(lambda: "refused a worker whose CURVE key" in server.log(), 30, "ZAP")
            assert not c.model_ready("tiny")
            with pytest.raises(DeadlineExceeded):  # queued: no worker took it
                c.infer("tiny", np.ones((1, 16), np.float32), timeout=1.0)
            assert not plain.poll(0) and not stranger.poll(0)  # no batch, no heartbeat
            assert "rogue" not in server.log()

            worker = subprocess.Popen(
                [*elsewhere, sys.executable, "-m", "batchd.worker", "--connect", endpoint,
                 "--model-repository", str(repo), "--worker-keys", str(key_dir),
                 "--threads", "1", "--id", "trusted"],
            )  # fmt: skip
            wait_for(lambda: c.model_ready("tiny"), 90, "the worker with the keys")
            out = c.infer("tiny", np.ones((2, 16), np.float32), timeout=30)
            assert out["OUTPUT0"].shape == (2, 16)
            assert not plain.poll(0) and not stranger.poll(0)
        assert "worker trusted ready" in server.log()
        assert "rogue" not in server.log()
        with Client(server.url, ca_cert=certs / "ca.pem") as c, pytest.raises(Unauthenticated):
            c.model_ready("tiny")
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
        ctx.destroy(linger=0)
        assert server.stop() == 0, server.log()


def test_local_workers_get_the_keys(tmp_path: Path) -> None:
    key_dir = tmp_path / "keys"
    keys.generate(key_dir)
    server = ServerProcess(_tiny_repo(tmp_path), "--worker-keys", str(key_dir), log_dir=tmp_path)
    server.start()  # returns once ServerReady: the local worker joined through CURVE
    try:
        with Client(server.url) as c:
            assert c.infer("tiny", np.ones((1, 16), np.float32), timeout=30)["OUTPUT0"].shape
        assert "1 authorized worker key(s)" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_keys_cli(tmp_path: Path) -> None:
    batchd = str(Path(sys.executable).parent / "batchd")
    out = subprocess.run([batchd, "keys", "generate", str(tmp_path / "k")], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "server.key_secret" in out.stdout and (tmp_path / "k" / "authorized").is_dir()
    again = subprocess.run([batchd, "keys", "generate", str(tmp_path / "k")], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert again.returncode == 2 and "not overwriting" in again.stderr
