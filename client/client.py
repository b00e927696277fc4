"""Client and AsyncClient: numpy in, numpy out, typed errors, for any OIP server.

with Client("127.0.0.1:8001") as c:
    out = c.infer("mlp", {"INPUT0": np.zeros((1, 512), np.float32)})
    out["OUTPUT0"]  # numpy array

Security options (keyword-only, both clients):
    tls=True                  TLS, checking the server against the system's CAs
    ca_cert=PEM               ... or against this CA (implies tls)
    client_cert=, client_key= a client certificate for mutual TLS (implies tls)
    token="..."               sends `authorization: Bearer <token>` with every call
A PEM is bytes (the PEM itself) or a str / Path (a file holding it).
own_connection=True gives the client a TCP connection of its own (by default
gRPC shares one among a process's channels to the same server), which is what
spreads load over the processes of `batchd serve --frontends N`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from batchd.client.codec import build_request, parse_response
from batchd.client.errors import BatchdClientError, InvalidInput, from_rpc_error
from batchd.client.retry import RetryPolicy
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
Inputs = Mapping[str, Any] | np.ndarray
Pem = bytes | str | os.PathLike[str]


@dataclass(frozen=True)
class _Security:
    tls: bool = False
    ca_cert: Pem | None = None
    client_cert: Pem | None = None
    client_key: Pem | None = None
    token: str | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials, or None for a plaintext channel."""
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together")
        if not (self.tls or self.ca_cert or self.client_cert):
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca_cert),
            private_key=_pem(self.client_key),
            certificate_chain=_pem(self.client_cert),
        )

    def call_kwargs(self) -> dict[str, Any]:
        """What every call passes besides the message and the timeout: the token."""
        if self.token is None:
            return {}
        return {"metadata": (("authorization", f"Bearer {self.token}"),)}


def _pem(value: Pem | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def _channel_options(max_message_bytes: int, own_connection: bool) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # gRPC shares one connection among a process's channels to the same target
        # unless told otherwise; a server with --frontends N balances connections.
        ("grpc.use_local_subchannel_pool", int(own_connection)),
    ]


def _metadata(msg: pb.ModelMetadataResponse) -> dict[str, Any]:
    def tensors(ts: Sequence[pb.TensorMetadata]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]

    return {
        "name": msg.name,
        "versions": list(msg.versions),
        "platform": msg.platform,
        "inputs": tensors(msg.inputs),
        "outputs": tensors(msg.outputs),
    }


def _index_entry(m: pb.RepositoryIndexResponse.ModelIndex) -> dict[str, str]:
    return {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}


def _named(inputs: Inputs, meta: dict[str, Any] | None) -> Mapping[str, Any]:
    if not isinstance(inputs, np.ndarray):
        return inputs
    assert meta is not None
    if len(meta["inputs"]) != 1:
        names = [t["name"] for t in meta["inputs"]]
        raise InvalidInput(f"model {meta['name']!r} has inputs {names}; pass a dict name->array")
    return {meta["inputs"][0]["name"]: inputs}


class _Base:
    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        *,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = 0,
        tls: bool = False,
        ca_cert: Pem | None = None,
        client_cert: Pem | None = None,
        client_key: Pem | None = None,
        token: str | None = None,
        own_connection: bool = False,
    ) -> None:
        security = _Security(tls, ca_cert, client_cert, client_key, token)
        self.url = url
        self._call_kwargs = security.call_kwargs()
        self.timeout = timeout
        self.retry = RetryPolicy(retries)
        self._rng = random.Random()
        self._options = _channel_options(max_message_bytes, own_connection)
        self._meta: dict[str, dict[str, Any]] = {}
        self._channel = self._open(url, security.credentials())
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)

    def _open(self, url: str, credentials: grpc.ChannelCredentials | None) -> Any:
        raise NotImplementedError  # a blocking or an asyncio channel

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """What a call through the raw `stub` passes to be let in (the token metadata)."""
        return self._call_kwargs

    def _plan(self, timeout: float | None, retries: int | None) -> tuple[float | None, RetryPolicy]:
        """The call's absolute deadline (monotonic) and its retry policy."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        policy = self.retry if retries is None else replace(self.retry, retries=retries)
        return deadline, policy

    def _next_wait(
        self, attempt: int, error: BatchdClientError, deadline: float | None, policy: RetryPolicy
    ) -> float | None:
        remaining = None if deadline is None else deadline - time.monotonic()
        return policy.delay(attempt, error, remaining, self._rng)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Client(_Base):
    """A blocking client. Thread-safe; reuse one per process."""

    def _open(self, url: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(url, options=self._options)
        return grpc.secure_channel(url, credentials, options=self._options)

    def _call(
        self, method: str, msg: Any, timeout: float | None = None, retries: int | None = None
    ) -> Any:
        deadline, policy = self._plan(timeout, retries)
        attempt = 0
        while True:
            try:
                return getattr(self._stub, method)(
                    msg, timeout=_remaining(deadline), **self._call_kwargs
                )
            except grpc.RpcError as e:
                error = from_rpc_error(e)
            wait = self._next_wait(attempt, error, deadline, policy)
            if wait is None:
                raise error
            time.sleep(wait)
            attempt += 1

    def infer(
        self,
        model: str,
        inputs: Inputs,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
        *,
        request_id: str = "",
        datatypes: Mapping[str, str] | None = None,
        parameters: Mapping[str, Any] | None = None,
        retries: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Run `model` on `inputs` (name->array, or one array for a one-input model)."""
        meta = self.model_metadata(model) if isinstance(inputs, np.ndarray) else None
        msg = build_request(
            model,
            _named(inputs, meta),
            outputs,
            request_id=request_id,
            datatypes=datatypes,
            parameters=parameters,
        )
        return parse_response(self._call("ModelInfer", msg, timeout, retries))

    def live(self) -> bool:
        return bool(self._call("ServerLive", pb.ServerLiveRequest()).live)

    def ready(self) -> bool:
        """True when the server is ready; False when it is not, or cannot be reached."""
        try:
            return bool(self._call("ServerReady", pb.ServerReadyRequest()).ready)
        except BatchdClientError:
            return False

    def model_ready(self, model: str) -> bool:
        return bool(self._call("ModelReady", pb.ModelReadyRequest(name=model)).ready)

    def server_metadata(self) -> dict[str, Any]:
        m = self._call("ServerMetadata", pb.ServerMetadataRequest())
        return {"name": m.name, "version": m.version, "extensions": list(m.extensions)}

    def model_metadata(self, model: str) -> dict[str, Any]:
        if model not in self._meta:
            self._meta[model] = _metadata(
                self._call("ModelMetadata", pb.ModelMetadataRequest(name=model))
            )
        return self._meta[model]

    def load_model(self, model: str, timeout: float | None = None) -> None:
        """Load, or load again, `model` from the server's repository (explicit model control).
        Returns once the new version serves; the old one drains behind it."""
        self._call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=model), timeout)
        self._meta.pop(model, None)

    def unload_model(self, model: str, timeout: float | None = None) -> None:
        """Stop serving `model`; returns once its admitted requests are answered."""
        msg = pb.RepositoryModelUnloadRequest(model_name=model)
        self._call("RepositoryModelUnload", msg, timeout)
        self._meta.pop(model, None)

    def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        """Every model of the server's repository: name, version, state, reason."""
        index = self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready))
        return [_index_entry(m) for m in index.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio twin of Client, over grpc.aio; same methods, awaited."""

    def _open(self, url: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(url, options=self._options)
        return grpc.aio.secure_channel(url, credentials, options=self._options)

    @property
    def stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        """The raw generated stub, for callers that build messages themselves."""
        return self._stub

    async def _call(
        self, method: str, msg: Any, timeout: float | None = None, retries: int | None = None
    ) -> Any:
        deadline, policy = self._plan(timeout, retries)
        attempt = 0
        while True:
            try:
                return await getattr(self._stub, method)(
                    msg, timeout=_remaining(deadline), **self._call_kwargs
                )
            except grpc.RpcError as e:
                error = from_rpc_error(e)
            wait = self._next_wait(attempt, error, deadline, policy)
            if wait is None:
                raise error
            await asyncio.sleep(wait)
            attempt += 1

    async def infer(
        self,
        model: str,
        inputs: Inputs,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
        *,
        request_id: str = "",
        datatypes: Mapping[str, str] | None = None,
        parameters: Mapping[str, Any] | None = None,
        retries: int | None = None,
    ) -> dict[str, np.ndarray]:
        meta = await self.model_metadata(model) if isinstance(inputs, np.ndarray) else None
        msg = build_request(
            model,
            _named(inputs, meta),
            outputs,
            request_id=request_id,
            datatypes=datatypes,
            parameters=parameters,
        )
        return parse_response(await self._call("ModelInfer", msg, timeout, retries))

    async def live(self) -> bool:
        return bool((await self._call("ServerLive", pb.ServerLiveRequest())).live)

    async def ready(self) -> bool:
        try:
            return bool((await self._call("ServerReady", pb.ServerReadyRequest())).ready)
        except BatchdClientError:
            return False

    async def model_ready(self, model: str) -> bool:
        return bool((await self._call("ModelReady", pb.ModelReadyRequest(name=model))).ready)

    async def server_metadata(self) -> dict[str, Any]:
        m = await self._call("ServerMetadata", pb.ServerMetadataRequest())
        return {"name": m.name, "version": m.version, "extensions": list(m.extensions)}

    async def model_metadata(self, model: str) -> dict[str, Any]:
        if model not in self._meta:
            self._meta[model] = _metadata(
                await self._call("ModelMetadata", pb.ModelMetadataRequest(name=model))
            )
        return self._meta[model]

    async def load_model(self, model: str, timeout: float | None = None) -> None:
        msg = pb.RepositoryModelLoadRequest(model_name=model)
        await self._call("RepositoryModelLoad", msg, timeout)
        self._meta.pop(model, None)

    async def unload_model(self, model: str, timeout: float | None = None) -> None:
        msg = pb.RepositoryModelUnloadRequest(model_name=model)
        await self._call("RepositoryModelUnload", msg, timeout)
        self._meta.pop(model, None)

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        index = await self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready))
        return [_index_entry(m) for m in index.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
