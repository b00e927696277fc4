"""The gRPC edge: `inference.GRPCInferenceService` methods, each convert -> core -> convert.

A BatchdError becomes the call's status through errors.grpc_status, for every
unary RPC (`_status`), the stream and the token check alike; a request of the
stream that fails becomes that response's `error_message`, as the protocol has it.

A request whose decoding walks many elements one by one in Python (BYTES, typed
contents: codec.decode_work) is decoded on one helper thread, not on the event
loop: the loop then keeps the GIL for all but one switch interval (5 ms) at a
time, and every other caller keeps being served while it runs. At most
HEAVY_WAITING such requests wait for that thread; more are refused with
RESOURCE_EXHAUSTED, as a full queue is.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import wraps
from itertools import islice
from typing import Any, Protocol, TypeVar, cast

import grpc

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc
from batchd.protos.model_config import ModelConfig
from batchd.protos.traces import Tracing
from batchd.server import __version__, tracing
from batchd.server.calls import CallLimiter
from batchd.server.codec import DEFAULT_LIMITS, decode_request, decode_work, encode_response
from batchd.server.config import Connections, Limits
from batchd.server.describe import model_config, model_metadata
from batchd.server.errors import (
    CLIP_ITEMS,
    BatchdError,
    InvalidInput,
    ModelNotFound,
    QueueFull,
    Unavailable,
    clip,
    first_names,
    grpc_status,
)
from batchd.server.flow import StepStream, stream_budget
from batchd.server.index import IndexEntry
from batchd.server.request import Request, Tensor
from batchd.server.stats import Stats
from batchd.server.streaming import respond, write_all
from batchd.server.tracing import RequestTrace
from batchd.server.unary_steps import follow, join_sequence

T = TypeVar("T")
Carrier = Mapping[str, str]  # where a call's W3C trace context is: HTTP headers, gRPC metadata
# An HTTP body: its URL's model version and how to parse it, the request's first step,
# so a body that does not parse is a failed request of that model, as a gRPC message
# that does not decode is.
Body = tuple[ModelConfig, Callable[[], Awaitable[pb.ModelInferRequest]]]
Encode = Callable[[pb.ModelInferResponse], Awaitable[Any]]  # an answer -> an HTTP body
EXTENSIONS = ["model_configuration", "model_repository", "parameters", "statistics"]
# Elements walked one by one (~0.1 us each) above which decoding leaves the event
# loop: below it, a request costs the loop at most ~2 ms, less than the hand-off.
INLINE_WORK = 16_384
# A call ended this close to its deadline was ended by it: the client's own timer
# cancels it first and the cancel crosses the wire, while this side's deadline
# counts from the request's arrival (measured: 1 to 20 ms apart under load).
DEADLINE_SLACK_S = 0.05
HEAVY_WAITING = 64  # heavy requests waiting for the decode thread; more: RESOURCE_EXHAUSTED


class Core(Protocol):
    """What the servicer needs from the core (core.Core; a fake in tests)."""

    @property
    def models(self) -> Mapping[str, ModelConfig]: ...  # loaded, by name; changes on load
    @property
    def stats(self) -> Stats: ...
    def submit(self, request: Request) -> asyncio.Future[list[Tensor]]: ...
    def check_room(self, key: str) -> None: ...  # raises QueueFull, before any decoding
    def model_ready(self, name: str) -> bool: ...
    def load_error(self, name: str) -> str | None: ...  # why no worker could load it
    async def load(self, name: str) -> ModelConfig: ...
    async def unload(self, name: str) -> None: ...
    async def index(self) -> list[IndexEntry]: ...
    def cancel(self, request: Request) -> None: ...  # a step-wise request's caller left


def _status(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T | None]]:
    """A unary RPC of the inference service: counted against its connection's
    limit, its BatchdError answered as a status."""

    @wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T | None:
        with grpc_status(context):
            peer: str = context.peer()
            self._calls.enter(peer)
            try:
                return await method(self, request, context)
            finally:
                self._calls.leave(peer)
        return None

    return wrapper


class _Answering:
    """One inference request being answered: counted open while it runs (a drain
    waits for it), and counted in the statistics of its model version when it ends,
    with its failure's reason: its error's (`unavailable`: refused by a drain),
    `deadline` when gRPC ended it at its deadline, `cancelled` when its caller left."""

    __slots__ = ("_service", "cfg", "deadline", "now", "request", "trace")

    def __init__(self, service: InferenceService, msg: pb.ModelInferRequest | Body,
                 time_remaining: float | None) -> None:  # fmt: skip
        self._service = service  # (a model not loaded: ModelNotFound, counted nowhere)
        m = msg  # (a tuple: an HTTP body)
        self.cfg = m[0] if isinstance(m, tuple) else service.model(m.model_name, m.model_version)
        self.trace: RequestTrace | None = None
        self.request: Request | None = None  # once decoded (its durations: stats.py)
        self.now = service._clock()
        self.deadline = math.inf if time_remaining is None else self.now + time_remaining

    async def __aenter__(self) -> _Answering:
        self._service._open += 1
        self._service._stats.opened(self.cfg.name, self.cfg.version)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: Any) -> None:  # fmt: skip
        service, ended = self._service, self._service._clock()
        if isinstance(error, BatchdError):
            reason: str | None = error.reason
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # gRPC ended it
            reason = "deadline" if ended >= self.deadline - DEADLINE_SLACK_S else "cancelled"
        else:
            reason = None if error is None else "internal"
        duration_ns, timing = int((ended - self.now) * 1e9), getattr(self.request, "timing", None)
        service._stats.answered(self.cfg.name, self.cfg.version, duration_ns, reason, timing)
        if self.trace is not None:
            self.trace.end(error)
        service._open -= 1
        if service.draining and not service._open:
            service._drained.set()


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        core: Core,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits = DEFAULT_LIMITS,
        calls_per_connection: int = Connections().max_concurrent_streams,
        tracing: Tracing | None = None,
    ) -> None:
        self.limits, self.tracing = limits, tracing
        self._calls = CallLimiter(calls_per_connection)
        self._core, self._models, self._stats = core, core.models, core.stats
        self._open = 0  # inference requests admitted and not yet answered
        self._drained = asyncio.Event()
        self._clock = clock
        self.draining = False  # new requests are refused
        self.leaving = False  # stopping: unready to health checks (still admitting at first)
        self.live = True  # False: a child frontend's frontend 0 is silent (health.liveness)
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="batchd-decode")
        self._heavy = 0  # requests waiting for or on the decode thread
        self.siblings: Callable[..., Awaitable[pb.ModelStatisticsResponse]] | None = None

    def model(self, name: str, version: str = "") -> ModelConfig:
        cfg = self._models.get(name)
        if cfg is None:
            raise ModelNotFound(
                f"unknown model {clip(name)}; this server serves: {first_names(self._models)}"
            )
        if version and version != cfg.version:
            raise ModelNotFound(f"model {name!r} has no version {clip(version)}; "
                                f"available: {cfg.version!r}")  # fmt: skip
        return cfg

    def served(self, msg: pb.ModelInferRequest) -> ModelConfig | None:
        return self._models.get(msg.model_name)  # (what a stream's request is for)

    def max_response_bytes(self) -> int:
        return self.limits.max_response_bytes

    def ready(self) -> bool:
        """The server is ready when every model is ready or has failed to load for
        good (it is unready on its own, in ModelReady and its health service): one
        broken model must not take the healthy ones out of a load balancer."""
        core = self._core
        return not self.leaving and all(core.model_ready(n) or core.load_error(n) is not None
                                        for n in self._models)  # fmt: skip

    async def infer(self, msg: pb.ModelInferRequest | Body, time_remaining: float | None,
                    carrier: Carrier | None = None, encode: Encode | None = None,
                    ) -> Any:  # a ModelInferResponse; with `encode`, what it returned  # fmt: skip
        """One request, one answer; a step-wise model's every output, joined. `encode`:
        what the answer becomes (HTTP's body), counted and traced as part of it."""
        async with _Answering(self, msg, time_remaining) as a:
            request = a.request = await self._admit(a, msg, carrier)
            cfg, trace = a.cfg, a.trace
            if cfg.generate is None:
                results = await self._core.submit(request)
            else:
                results = await join_sequence(self._core, request, self.max_response_bytes())
            if trace is not None:
                trace.mark = tracing.now_ns()
            response = encode_response(request, results, self.limits.max_response_bytes)
            answer = response if encode is None else await encode(response)
            if trace is not None:
                trace.phase("response")
            return answer

    async def sequence(self, msg: pb.ModelInferRequest | Body, time_remaining: float | None,
                       carrier: Carrier | None = None, stream: StepStream | None = None,
                       ) -> AsyncGenerator[tuple[Request, list[Tensor], bool]]:  # fmt: skip
        """A step-wise model's request: each output as it comes, and whether it is the
        last. Leaving early (the caller went) frees its slot. `stream`: where its outputs
        go, its caller's stream's (flow.StepStream, handed on); none given: its own."""
        async with _Answering(self, msg, time_remaining) as a:
            request = a.request = await self._admit(a, msg, carrier)
            own = StepStream(budget=stream_budget(self.max_response_bytes()))
            request.stream = stream if stream is not None else own
            async with contextlib.aclosing(follow(self._core, request)) as steps:
                async for outputs, final in steps:
                    yield request, outputs, final

    async def _admit(self, a: _Answering, msg: pb.ModelInferRequest | Body,
                     carrier: Carrier | None) -> Request:  # fmt: skip
        """The request, admitted: refused while draining, parsed (an HTTP body), decoded."""
        cfg = a.cfg
        if self.draining:
            raise Unavailable("the server is shutting down and takes no new requests")
        if isinstance(msg, tuple):  # an HTTP body: traced from before its parse, which can fail
            a.trace = trace = tracing.begin(self.tracing, cfg.name, "", carrier)
            msg = await msg[1]()  # (a reload meanwhile: the version `a` holds answers it)
            if trace is not None and msg.id:
                trace.span.set_attribute("batchd.request_id", msg.id[:64])
        else:
            a.trace = trace = tracing.begin(self.tracing, cfg.name, msg.id, carrier)
        self._core.check_room(cfg.key)
        if decode_work(msg, self.limits) > INLINE_WORK:
            request = await self.aside(decode_request, msg, cfg, a.now, a.deadline, self.limits)
        else:
            request = decode_request(msg, cfg, a.now, a.deadline, self.limits)
        if trace is not None:
            trace.phase("admission")
            request.trace = trace
        return request

    async def aside(self, fn: Callable[..., T], *args: Any, bounded: bool = True,
                    pool: Executor | None = None) -> T:  # fmt: skip
        """`fn(*args)` on the decode thread (heavy decoding, a large REST body), or `pool`;
        `bounded`: refused past HEAVY_WAITING (False: an answer computed must go out)."""
        if bounded and self._heavy >= HEAVY_WAITING:
            raise QueueFull(f"{self._heavy} large requests are being decoded (the most that "
                            f"wait, {HEAVY_WAITING}); retry later", retry_after_ms=100)  # fmt: skip
        self._heavy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool or self._decoder, fn,
                                                                    *args)  # fmt: skip
        finally:
            self._heavy -= 1

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests; wait up to `timeout_s` for the admitted ones; how many are open."""
        self.leaving = self.draining = True
        if self._open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout_s)
        return self._open

    # ---- RPCs ----

    @_status
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        remaining, carrier = context.time_remaining(), self._carrier(context)
        return cast(pb.ModelInferResponse, await self.infer(request, remaining, carrier))

    def _carrier(self, context: grpc.aio.ServicerContext) -> Carrier | None:  # traceparent
        return None if self.tracing is None else dict(context.invocation_metadata() or ())

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        with grpc_status(context):
            peer: str = context.peer()
            self._calls.enter(peer)
            try:
                carrier, remaining = self._carrier(context), context.time_remaining
                await write_all(context, respond(self, request_iterator, carrier, remaining))
            finally:
                self._calls.leave(peer)

    @_status
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.live)

    @_status
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.ready())

    @_status
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.model_ready(request.name, request.version))

    def model_ready(self, name: str, version: str = "") -> bool:  # not served: False, as Triton
        ok = (cfg := self._models.get(name)) is not None and version in ("", cfg.version)
        return ok and not self.leaving and self._core.model_ready(name)

    @_status
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="batchd", version=__version__, extensions=EXTENSIONS)

    @_status
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        return model_metadata(self.model(request.name, request.version))

    @_status
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        return model_config(self.model(request.name, request.version))

    @_status
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        return await self.every_statistics(request, context.time_remaining())

    async def every_statistics(self, r: pb.ModelStatisticsRequest, remaining: float | None = None
                               ) -> pb.ModelStatisticsResponse:  # fmt: skip
        """This frontend's statistics, and with --frontends N every other's added (within
        half the call's `remaining` time, if it has a deadline)."""
        own = await self.statistics(r)
        return own if self.siblings is None else await self.siblings(r, own, remaining)

    async def statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        """Each model's current version, and older ones still reported (Stats.versions)."""
        named = [self.model(request.name)] if request.name else None
        current = [(cfg.name, cfg.version) for cfg in named or self._models.values()]
        if not (found := await self._stats.report(current, request.version)) and request.name:
            raise ModelNotFound(f"model {request.name!r} has no version {clip(request.version)}; "
                                f"available: {self._stats.versions(*current[0])}")  # fmt: skip
        return pb.ModelStatisticsResponse(model_stats=found)

    @_status
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        return await self.index(request)

    async def index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        index = pb.RepositoryIndexResponse()
        for e in await self._core.index():
            if not request.ready or e.state == "READY":
                index.models.add(name=e.name, version=e.version, state=e.state, reason=e.reason)
        return index

    @_status
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        await self.load(request)
        return pb.RepositoryModelLoadResponse()

    async def load(self, request: pb.RepositoryModelLoadRequest) -> None:
        if params := request.parameters:  # a few keys are quoted, never all of millions sorted
            shown = sorted(clip(k) for k in islice(params, CLIP_ITEMS))
            raise InvalidInput(
                "RepositoryModelLoad takes no parameters: batchd loads models only from its "
                f"repository on disk, never from the request; got {', '.join(shown)}"
                + (", ..." if len(params) > CLIP_ITEMS else "")
            )
        await self._core.load(request.model_name)

    @_status
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        await self._core.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()
