"""What Client and AsyncClient do, written once and free of I/O.

Each operation is a generator of steps: it yields an `Rpc` (call this method
with this message and this timeout; send me back the reply, or the
grpc.RpcError it raised) or a `Wait` (sleep this long, then resume me), and
returns the operation's result. The core owns everything else: building the
requests, the operation's deadline shared by all its calls and attempts (a
bare array's metadata lookup included), the retry policy
(client/retry.py), turning a failed call into its typed error
(client/errors.py), the metadata cache, and the token metadata.

`stream` (a decoupled model's outputs, over ModelStreamInfer) has four more
steps: `Open` (start the stream call with this one request), `Read` (resume me
with its next response, END when it closed, or its grpc.RpcError), `Emit`
(hand these outputs to the caller, then resume me) and `End` (wait a moment for
the call's end). It ends at the response flagged `triton_final_response`; the
driver cancels the call whenever it stops before that (the caller left the loop,
or an error), so the server frees the sequence, and after it if the call has not
ended within END_GRACE_S (a server or proxy holding the stream open).

Client drives the steps with blocking gRPC and time.sleep, AsyncClient with
grpc.aio and asyncio.sleep (client/client.py); neither holds any other logic.
Why not one client over the other: a blocking wrapper that hands each call to
an event loop in a background thread paid ~10% of Client.infer's calls/s
against tiny, and the blocking channel costs nothing over the steps.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import numpy as np

from batchd.client import views
from batchd.client.codec import build_request, parse_response
from batchd.client.errors import (
    BadResponse,
    BatchdClientError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    ServerUnavailable,
    from_rpc_error,
    from_status_name,
    undecodable,
)
from batchd.client.retry import RetryPolicy
from batchd.protos import inference_pb2 as pb

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
Inputs = Mapping[str, Any] | np.ndarray
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Rpc:
    """Call `method` of `service` ("inference", or "jobs": batchd's jobs service); resume
    with its reply or its grpc.RpcError. A client-streaming method's `request` is an
    iterator of messages."""

    method: str
    request: Any
    timeout: float | None
    service: str = "inference"


@dataclass(frozen=True, slots=True)
class Wait:
    """Sleep `seconds`, then resume with None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Open:
    """Start the streaming call `method` sending `request` alone, with `timeout` for
    the whole call; resume with None. The driver cancels it if the steps stop early."""

    method: str
    request: Any
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Read:
    """Resume with the open stream's next response, END once it closed, or its grpc.RpcError."""


@dataclass(frozen=True, slots=True)
class End:
    """Resume with None once the open stream's call has ended, or `within` seconds
    passed (what it sends meanwhile is not read)."""

    within: float


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand `outputs` to the caller; resume with None once it asks for the next."""

    outputs: dict[str, np.ndarray]


END = object()  # what a Read resumes with when the stream closed normally
READ = Read()
Steps = Generator[Rpc | Wait, Any, T]
StreamSteps = Generator[Rpc | Wait | Open | Read | End | Emit, Any, None]
END_GRACE_S = 1.0  # for the call's end after the final response, before it is cancelled

# Triton's decoupled protocol: the last response of a request says so; with the
# request parameter set, the last one carries no outputs, so the end is always known.
FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
STREAM_PARAMETERS: dict[str, bool] = {EMPTY_FINAL_RESPONSE: True}
# An error response may name its gRPC status (a string parameter of its infer_response),
# and the pushback of a request not run, to send again (as a unary call's trailer).
ERROR_CODE, PUSHBACK = "error_code", "retry_pushback_ms"


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _unexpired(deadline: float | None, what: str, done: str) -> float | None:
    """The time left to a call or stream about to start; DeadlineExceeded if none is:
    sent with 0 s, gRPC raced the deadline against the reply (14-52 of 100 ran)."""
    if (left := _remaining(deadline)) is not None and left <= 0:
        raise DeadlineExceeded(f"the {what}'s timeout passed before it was {done}")
    return left


def _named(inputs: Inputs, meta: dict[str, Any] | None) -> Mapping[str, Any]:
    if isinstance(inputs, Mapping):
        return inputs
    assert meta is not None
    if len(meta["inputs"]) != 1:
        names = [t["name"] for t in meta["inputs"]]
        raise InvalidInput(f"model {meta['name']!r} has inputs {names}; pass a dict name->array")
    return {meta["inputs"][0]["name"]: inputs}


def _pushback_param(param: pb.InferParameter) -> int:
    """A stream error's pushback: its int64_param; -1 (do not retry, as a malformed
    trailer is read on a unary call) where it is not one (a string "never" read as 0 ms,
    retry at once: a caller looping on retry_after_ms would hammer the server)."""
    return param.int64_param if param.WhichOneof("parameter_choice") == "int64_param" else -1


def stream_error(msg: pb.ModelStreamInferResponse) -> BatchdClientError:
    """The typed error of a stream response carrying `error_message`. Its status is the
    response's `error_code` parameter, or a leading "STATUS_NAME: " in the message;
    InferenceFailed when neither names one."""
    text = msg.error_message
    params = msg.infer_response.parameters
    if ERROR_CODE in params:
        pushback = _pushback_param(params[PUSHBACK]) if PUSHBACK in params else None
        return from_status_name(params[ERROR_CODE].string_param, text, pushback)
    name, sep, rest = text.partition(": ")
    if sep and name != "OK" and name in grpc.StatusCode.__members__:
        return from_status_name(name, rest)
    return InferenceFailed(text)


def stream_read(reply: Any) -> tuple[pb.ModelInferResponse | None, bool]:
    """What one Read of a stream resumed with, as (the response if it carries outputs,
    whether it is the request's last). Raises the typed error of an error response, of
    a failed call, or of a stream that closed before its final response."""
    if reply is END:
        raise InferenceFailed("the stream closed before the final response")
    if reply is None:  # (grpc.aio's answer that did not parse)
        raise undecodable()
    if isinstance(reply, grpc.RpcError):
        raise from_rpc_error(reply)
    if reply.error_message:
        raise stream_error(reply)
    response = reply.infer_response
    params = response.parameters
    final = FINAL_RESPONSE in params and params[FINAL_RESPONSE].bool_param
    return (response if response.outputs else None), final


class ClientCore:
    """The operations of both clients, as steps (see the module docstring)."""

    def __init__(self, timeout: float | None, retries: int, call_kwargs: dict[str, Any]) -> None:
        self.timeout = timeout  # seconds per call, all attempts together; None: no limit
        self.retry = RetryPolicy(retries)
        self.call_kwargs = call_kwargs  # passed with every RPC: the token metadata
        self.rng = random.Random()  # the retries' jitter
        self._meta: dict[str, dict[str, Any]] = {}

    def results_kwargs(self) -> dict[str, Any]:
        """What a job's download passes: the token, and no deadline (it takes as long as
        the results; a connection gone silent fails by keepalive, channel_options)."""
        return {"timeout": None, **self.call_kwargs}

    def call(
        self,
        method: str,
        msg: Any,
        timeout: float | None = None,
        retries: int | None = None,
        service: str = "inference",
    ) -> Steps[Any]:
        """One RPC, retried by the policy within one deadline; its typed error if it fails."""
        return (yield from self._call(method, msg, self.deadline(timeout), retries, service))

    def call_by(self, method: str, msg: Any, deadline: float | None, service: str) -> Steps[Any]:
        """One RPC, not retried, under `deadline` (an operation's, fixed before it)."""
        return (yield from self._call(method, msg, deadline, 0, service))

    def deadline(self, timeout: float | None) -> float | None:
        """The monotonic deadline of an operation starting now: `timeout`, or the default
        (inf, as None: none; gRPC failed a call given an infinite timeout at once)."""
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None and math.isnan(timeout):
            raise ValueError("a timeout is a number of seconds or None, got nan")
        # (gRPC fails a call of ~1e10 s at once: a timeout of years is none)
        return None if timeout is None or timeout > 1e8 else time.monotonic() + timeout

    def _call(
        self,
        method: str,
        msg: Any,
        deadline: float | None,
        retries: int | None = None,
        service: str = "inference",
    ) -> Steps[Any]:
        """`call` under a deadline fixed before it: the one all an operation's calls share."""
        policy = self.retry if retries is None else replace(self.retry, retries=retries)
        attempt = 0
        while True:
            reply = yield Rpc(method, msg, _unexpired(deadline, "call", "sent"), service)
            if reply is None:  # (grpc.aio's answer that did not parse)
                raise undecodable()
            if not isinstance(reply, grpc.RpcError):
                return reply
            error = from_rpc_error(reply, of_job=method in ("GetJob", "CancelJob"))
            remaining = None if deadline is None else deadline - time.monotonic()
            wait = policy.delay(attempt, error, remaining, self.rng)
            if wait is None:
                raise error from reply  # (gRPC's own error, its trailers and debug string)
            yield Wait(wait)
            attempt += 1

    def _request(
        self,
        model: str,
        inputs: Inputs,
        outputs: Sequence[str] | None,
        request_id: str,
        datatypes: Mapping[str, str] | None,
        parameters: Mapping[str, Any] | None,
        deadline: float | None,
        retries: int | None = None,
    ) -> Steps[pb.ModelInferRequest]:
        """The ModelInferRequest for `inputs`; a bare array is named from the model's
        metadata (one input), looked up within the operation's `deadline`."""
        meta = None
        if not isinstance(inputs, Mapping):  # one array (a list, a numpy scalar): its name
            meta = yield from self._metadata(model, deadline, retries)
        return build_request(
            model,
            _named(inputs, meta),
            outputs,
            request_id=request_id,
            datatypes=datatypes,
            parameters=parameters,
        )

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
    ) -> Steps[dict[str, np.ndarray]]:
        """Run `model` on `inputs` (name->array, or one array for a one-input model)."""
        deadline = self.deadline(timeout)  # the metadata lookup's and the call's
        msg = yield from self._request(
            model, inputs, outputs, request_id, datatypes, parameters, deadline, retries
        )
        out = parse_response((yield from self._call("ModelInfer", msg, deadline, retries)))
        if outputs is not None and (missing := [o for o in outputs if o not in out]):
            raise BadResponse(f"the answer lacks output(s) {missing[:8]} the call asked for; "
                              f"it holds {list(out)[:8]}")  # fmt: skip
        return out

    def stream(
        self,
        model: str,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        outputs: Sequence[str] | None = None,
        request_id: str = "",
        datatypes: Mapping[str, str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> StreamSteps:
        """Send one request to a decoupled (step-wise) model over ModelStreamInfer and emit
        each response's outputs, until its final response. `timeout`: the whole stream.
        Not retried: outputs may have reached the caller."""
        deadline = self.deadline(timeout)  # the metadata lookup's and the stream's
        parameters = {**STREAM_PARAMETERS, **(parameters or {})}
        msg = yield from self._request(
            model, inputs, outputs, request_id, datatypes, parameters, deadline
        )
        yield Open("ModelStreamInfer", msg, _unexpired(deadline, "stream", "opened"))
        while True:
            response, final = stream_read((yield READ))
            if response is not None:
                yield Emit(parse_response(response))
            if final:
                # The call's end follows at once (our one request is answered and we
                # half-closed): wait for it, so that a finished call is not cancelled;
                # one held open past it is, and the caller has every output meanwhile.
                yield End(END_GRACE_S)
                return

    def live(self) -> Steps[bool]:
        return bool((yield from self.call("ServerLive", pb.ServerLiveRequest())).live)

    def ready(self) -> Steps[bool]:
        """True when the server is ready; False when it is not, or cannot be reached (in
        time); any other failure (a wrong token) raises, or a wait for it spins for ever."""
        try:
            return bool((yield from self.call("ServerReady", pb.ServerReadyRequest())).ready)
        except (ServerUnavailable, DeadlineExceeded):
            return False

    def model_ready(self, model: str) -> Steps[bool]:
        msg = pb.ModelReadyRequest(name=model)
        return bool((yield from self.call("ModelReady", msg)).ready)

    def server_metadata(self) -> Steps[dict[str, Any]]:
        """name, version and the protocol extensions the server supports."""
        return views.server_metadata(
            (yield from self.call("ServerMetadata", pb.ServerMetadataRequest()))
        )

    def model_metadata(self, model: str) -> Steps[dict[str, Any]]:
        """name, versions, platform, inputs and outputs (name, datatype, shape), as the
        server says now (a bare array's infer names it from a cached copy)."""
        self._meta.pop(model, None)
        return copy.deepcopy((yield from self._metadata(model, self.deadline(None))))

    def _metadata(
        self, model: str, deadline: float | None, retries: int | None = None
    ) -> Steps[dict[str, Any]]:
        if model not in self._meta:
            msg = pb.ModelMetadataRequest(name=model)
            reply = yield from self._call("ModelMetadata", msg, deadline, retries)
            self._meta[model] = views.model_metadata(reply)
        return self._meta[model]

    def model_statistics(self, model: str = "", version: str = "") -> Steps[list[views.ModelStats]]:
        """The server's statistics of `model` ("": every model), one ModelStats per version:
        requests, batches, queue and compute times, and the batch sizes it ran."""
        msg = pb.ModelStatisticsRequest(name=model, version=version)
        return views.model_stats((yield from self.call("ModelStatistics", msg)))

    def load_model(self, model: str, timeout: float | None = None) -> Steps[None]:
        """Load, or load again, `model` from the server's repository (explicit model control).
        Returns once the new version serves; the old one drains behind it."""
        msg = pb.RepositoryModelLoadRequest(model_name=model)
        yield from self.call("RepositoryModelLoad", msg, timeout)
        self._meta.pop(model, None)

    def unload_model(self, model: str, timeout: float | None = None) -> Steps[None]:
        """Stop serving `model`; returns once its admitted requests are answered."""
        msg = pb.RepositoryModelUnloadRequest(model_name=model)
        yield from self.call("RepositoryModelUnload", msg, timeout)
        self._meta.pop(model, None)

    def repository_index(self, ready: bool = False) -> Steps[list[dict[str, str]]]:
        """Every model of the server's repository: name, version, state, reason."""
        index = yield from self.call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready))
        return views.repository_index(index)
