"""Client and AsyncClient: numpy in, numpy out, typed errors, for any OIP server.

with Client("127.0.0.1:8001") as c:
    out = c.infer("mlp", {"INPUT0": np.zeros((1, 512), np.float32)})
    out["OUTPUT0"]  # numpy array

Options (keyword-only), TLS, tokens and connections: client/channel.py.

Both clients are ClientCore's operations (client/core.py, written once as steps),
driven over a blocking gRPC channel (Client) or grpc.aio (AsyncClient).

A decoupled (step-wise) model's outputs, one dict per step, as they come:
    for out in c.stream("decoder", {"PROMPT": ids, "MAX_NEW_TOKENS": np.array([32])}):
        out["TOKEN"]
    async for out in ac.stream(...): ...
Leaving the loop early (break, an exception, close(), the iterator collected)
cancels the call, and with it the sequence on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, BinaryIO, Concatenate, ParamSpec, TypeVar

import grpc
import numpy as np

from batchd.client import jobs as job_ops
from batchd.client.channel import Pem, Security, channel_options, open_channel, when_closed
from batchd.client.core import (
    DEFAULT_MAX_MESSAGE_BYTES,
    END,
    ClientCore,
    Emit,
    End,
    Inputs,
    Open,
    Rpc,
    Steps,
    StreamSteps,
    Wait,
)
from batchd.client.retry import RetryPolicy
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos import jobs_pb2_grpc as jobs_grpc

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "AsyncClient", "Client", "Inputs", "Pem"]

P = ParamSpec("P")
T = TypeVar("T")


class _Connection:
    """The channel, its stub and the core: what both clients hold."""

    _grpc: Any = grpc  # the channel's kind: blocking (Client) or grpc.aio (AsyncClient)
    closed = False  # close() was called (channel.when_closed)

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
        security = Security(tls, ca_cert, client_cert, client_key, token)
        self.url = url
        self._core = ClientCore(timeout, retries, security.call_kwargs())
        options = channel_options(max_message_bytes, own_connection)
        self._opens = (url, security.credentials(), options)
        self._channel = open_channel(self._grpc, *self._opens)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._jobs_stub: Any = jobs_grpc.JobsStub(self._channel)

    @property
    def timeout(self) -> float | None:
        """The default timeout of a call, in seconds, all its attempts together."""
        return self._core.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._core.timeout = value

    @property
    def retry(self) -> RetryPolicy:
        """The default retry policy (`retries=` sets how many extra attempts)."""
        return self._core.retry

    @retry.setter
    def retry(self, value: RetryPolicy) -> None:
        self._core.retry = value

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """What a call through the raw `stub` passes to be let in (the token metadata)."""
        return self._core.call_kwargs

    @property
    def stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        """The raw generated stub, for callers that build messages themselves."""
        return self._stub


def _blocking(
    op: Callable[Concatenate[ClientCore, P], Steps[T]],
) -> Callable[Concatenate[Client, P], T]:
    """Client's method for one operation of the core."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with when_closed(self):
            return self._run(op(self._core, *args, **kwargs))

    functools.update_wrapper(method, op)
    return method


def _awaitable(
    op: Callable[Concatenate[ClientCore, P], Steps[T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """AsyncClient's method for one operation of the core."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with when_closed(self):
            return await self._run(op(self._core, *args, **kwargs))

    functools.update_wrapper(method, op)
    return method


Outputs = dict[str, np.ndarray]
ResultsOut = str | os.PathLike[str] | BinaryIO  # where job_results writes: a path or a file


def _streaming(
    op: Callable[Concatenate[ClientCore, P], StreamSteps],
) -> Callable[Concatenate[Client, P], Iterator[Outputs]]:
    """Client's iterator for one stream operation of the core."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[Outputs]:
        return self._drive_stream(op(self._core, *args, **kwargs))

    functools.update_wrapper(method, op)
    return method


def _async_streaming(
    op: Callable[Concatenate[ClientCore, P], StreamSteps],
) -> Callable[Concatenate[AsyncClient, P], AsyncIterator[Outputs]]:
    """AsyncClient's async iterator for one stream operation of the core."""

    def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[Outputs]:
        return self._drive_stream(op(self._core, *args, **kwargs))

    functools.update_wrapper(method, op)
    return method


class Client(_Connection):
    """A blocking client. Thread-safe; reuse one per process."""

    def _run(self, steps: Steps[T]) -> T:
        """Drive an operation: make its calls, sleep its waits, return its result."""
        reply: Any = None
        while True:
            try:
                step = steps.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply = self._do(step)

    def _do(self, step: Rpc | Wait) -> Any:
        """Make one call (its reply, or the grpc.RpcError it raised), or sleep one wait."""
        if isinstance(step, Wait):
            time.sleep(step.seconds)
            return None
        stub = self._stub if step.service == "inference" else self._jobs_stub
        try:
            call = getattr(stub, step.method)
            return call(step.request, timeout=step.timeout, **self._core.call_kwargs)
        except grpc.RpcError as e:
            return e

    def _drive_stream(self, steps: StreamSteps) -> Iterator[Outputs]:
        """Drive a stream operation, yielding what it emits; cancel the call if it stops
        before its end (the consumer left, or an error)."""
        call: Any = None
        reply: Any = None
        with when_closed(self):  # (a stream under way as the client closes, or opened after)
            try:
                while True:
                    try:
                        step = steps.send(reply)
                    except StopIteration:
                        return
                    reply = None
                    if isinstance(step, Emit):
                        yield step.outputs
                    elif isinstance(step, Open):
                        requests = iter((step.request,))
                        method = getattr(self._stub, step.method)
                        call = method(requests, timeout=step.timeout, **self._core.call_kwargs)
                    elif isinstance(step, Rpc | Wait):
                        reply = self._do(step)
                    elif isinstance(step, End):
                        with contextlib.suppress(grpc.FutureTimeoutError):
                            call.exception(timeout=step.within)  # (its end, not its error)
                    else:  # Read
                        try:
                            reply = next(call)
                        except StopIteration:
                            reply = END
                        except grpc.RpcError as e:
                            reply = e
            finally:
                steps.close()
                if call is not None:
                    call.cancel()  # nothing once the call has ended

    def job_results(self, job_id: str, out: ResultsOut, *, give_up_s: float = 60.0) -> int:
        """Write the job's results (all of them once it has ended; those kept so far
        while it runs) to `out`, a path or a binary file. Returns the lines written.
        No deadline: a download takes as long as the results. Cut off, it goes on from
        where it got to, with backoff, until `give_up_s` pass without a byte (Resume)."""
        resume = job_ops.Resume(self._core, job_id, give_up_s)
        with when_closed(self), job_ops.ResultsFile(out) as f:
            while True:
                try:
                    for piece in resume.call(self._jobs_stub.JobResults, f.size):
                        f.write(job_ops.data(piece))
                    return f.whole()
                except grpc.RpcError as e:
                    time.sleep(resume.wait(e, f.size))

    submit_job = _blocking(job_ops.submit_job)
    job = _blocking(job_ops.job)
    jobs = _blocking(job_ops.jobs)
    cancel_job = _blocking(job_ops.cancel_job)
    infer = _blocking(ClientCore.infer)
    stream = _streaming(ClientCore.stream)
    live = _blocking(ClientCore.live)
    ready = _blocking(ClientCore.ready)
    model_ready = _blocking(ClientCore.model_ready)
    server_metadata = _blocking(ClientCore.server_metadata)
    model_metadata = _blocking(ClientCore.model_metadata)
    model_statistics = _blocking(ClientCore.model_statistics)
    load_model = _blocking(ClientCore.load_model)
    unload_model = _blocking(ClientCore.unload_model)
    repository_index = _blocking(ClientCore.repository_index)

    def close(self) -> None:
        self.closed = True
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Connection):
    """The asyncio twin of Client, over grpc.aio; same methods, awaited. Make it inside
    the event loop that uses it (grpc.aio binds its channel to the loop running when it
    is made: one made before asyncio.run() fails there, "attached to a different loop")."""

    _grpc = grpc.aio
    _uploads: grpc.Channel | None = None  # SubmitJob's (_upload)

    async def _run(self, steps: Steps[T]) -> T:
        """Drive an operation: await its calls and its waits, return its result."""
        reply: Any = None
        while True:
            try:
                step = steps.send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply = await self._do(step)

    async def _do(self, step: Rpc | Wait) -> Any:
        """Make one call (its reply, or the grpc.RpcError it raised), or sleep one wait."""
        if isinstance(step, Wait):
            await asyncio.sleep(step.seconds)
            return None
        if step.method == "SubmitJob":
            return await self._upload(step)
        stub = self._stub if step.service == "inference" else self._jobs_stub
        try:
            call = getattr(stub, step.method)
            return await call(step.request, timeout=step.timeout, **self._core.call_kwargs)
        except grpc.RpcError as e:
            return e

    async def _upload(self, step: Rpc) -> Any:
        """SubmitJob, over a blocking channel: grpc.aio reports a call the server ended as
        the client sent (refused, or answered by its key) as INTERNAL "Internal error from
        Core" if a write failed after (grpc/grpc#36066); and it read the file on the loop."""
        if self._uploads is None:
            self._uploads = open_channel(grpc, *self._opens)
        stub = jobs_grpc.JobsStub(self._uploads)
        loop, ended = asyncio.get_running_loop(), asyncio.Event()  # (no thread waits)
        call = stub.SubmitJob.future(step.request, timeout=step.timeout,
                                     **self._core.call_kwargs)  # fmt: skip
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(ended.set))
        try:
            await ended.wait()
            return call.result()
        except grpc.RpcError as e:
            return e
        finally:
            call.cancel()  # the awaiting task cancelled: the upload too (nothing once ended)
            step.request.stop()  # and no more of its source is read

    async def _drive_stream(self, steps: StreamSteps) -> AsyncIterator[Outputs]:
        """Client._drive_stream, awaited. An iterator left without aclose() is closed,
        and its call cancelled, by asyncio once it is collected."""
        call: Any = None
        reply: Any = None
        with when_closed(self):  # (a stream under way as the client closes, or opened after)
            try:
                while True:
                    try:
                        step = steps.send(reply)
                    except StopIteration:
                        return
                    reply = None
                    if isinstance(step, Emit):
                        yield step.outputs
                    elif isinstance(step, Open):
                        requests = iter((step.request,))
                        method = getattr(self._stub, step.method)
                        call = method(requests, timeout=step.timeout, **self._core.call_kwargs)
                    elif isinstance(step, Rpc | Wait):
                        reply = await self._do(step)
                    elif isinstance(step, End):
                        with contextlib.suppress(TimeoutError):  # (not wait_for: 3.11's
                            async with asyncio.timeout(step.within):  # can lose a cancel)
                                await call.code()
                    else:  # Read
                        try:
                            reply = await call.read()
                        except grpc.RpcError as e:
                            reply = e
                        if reply is grpc.aio.EOF:
                            reply = END
            finally:
                steps.close()
                if call is not None:
                    call.cancel()  # nothing once the call has ended

    async def job_results(self, job_id: str, out: ResultsOut, *, give_up_s: float = 60.0) -> int:
        """Client.job_results, awaited (the file is written from the event loop)."""
        resume = job_ops.Resume(self._core, job_id, give_up_s)
        with when_closed(self), job_ops.ResultsFile(out) as f:
            while True:
                try:
                    async for piece in resume.call(self._jobs_stub.JobResults, f.size):
                        f.write(job_ops.data(piece))
                    return f.whole()
                except grpc.RpcError as e:
                    await asyncio.sleep(resume.wait(e, f.size))

    submit_job = _awaitable(job_ops.submit_job)
    job = _awaitable(job_ops.job)
    jobs = _awaitable(job_ops.jobs)
    cancel_job = _awaitable(job_ops.cancel_job)
    infer = _awaitable(ClientCore.infer)
    stream = _async_streaming(ClientCore.stream)
    live = _awaitable(ClientCore.live)
    ready = _awaitable(ClientCore.ready)
    model_ready = _awaitable(ClientCore.model_ready)
    server_metadata = _awaitable(ClientCore.server_metadata)
    model_metadata = _awaitable(ClientCore.model_metadata)
    model_statistics = _awaitable(ClientCore.model_statistics)
    load_model = _awaitable(ClientCore.load_model)
    unload_model = _awaitable(ClientCore.unload_model)
    repository_index = _awaitable(ClientCore.repository_index)

    async def close(self) -> None:
        self.closed = True
        await self._channel.close()
        if self._uploads is not None:
            self._uploads.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
