"""The HTTP edge: the KServe v2 REST protocol, served by aiohttp on the frontend's
own event loop, beside grpc.aio (one process, one core, no proxy).

Each route converts and calls the same code the gRPC servicer does: an inference
body becomes a ModelInferRequest (rest_codec.py) and goes through
InferenceService.infer, so validation, limits, queues, statistics and messages
are gRPC's. A BatchdError is answered `{"error": "<the gRPC message>"}` (its status:
errors.http_status of its gRPC code).

    GET  /v2                                     server metadata
    GET  /v2/health/live | /v2/health/ready      open, for load balancers
    GET  /v2/models/{m}[/versions/{v}]           metadata; .../ready, .../config, .../stats
    POST /v2/models/{m}[/versions/{v}]/infer     JSON tensors, or Triton's binary extension
    POST /v2/models/{m}[/versions/{v}]/generate  JSON in and out; /generate_stream: SSE
    GET  /v2/models/stats                        every model's statistics
    POST /v2/repository/index                    model control (admin token)
    POST /v2/repository/models/{m}/load | /unload
    /v2/jobs...                                  batch jobs (jobs/rest.py)

Bodies over --max-message-bytes are refused (413) before they are read whole, and
inflated ones at that size; a body must arrive within --handshake-timeout. The
bounds on connections (headers, TLS, answers not read) are http_site.py's.
A body above INLINE_BYTES or INLINE_VALUES is parsed on the decode thread, as a heavy
gRPC request is decoded, so the loop serves everyone else (one of 227 KiB held it for
90 ms); past parser.ASIDE_BYTES of JSON in the parser process: no parse holds the GIL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from batchd.protos import inference_pb2 as pb
from batchd.protos.model_config import ModelConfig
from batchd.protos.to_json import as_json
from batchd.server import __version__, parser
from batchd.server.auth import ADMIN, DENIED, INFER, Tokens, bearer_header
from batchd.server.config import Connections, Limits
from batchd.server.describe import model_config, model_metadata
from batchd.server.errors import BatchdError, InvalidInput, Unauthenticated, clip
from batchd.server.flow import StepStream, stream_budget
from batchd.server.http_site import (
    INFLATED_BODIES,
    RECEIVED_BODIES,
    BodyBytes,
    Handler,
    InflateBudget,
    Inflating,
    accepted,
    bounded_send,
    coded,
    deflated,
    encoding,
    error_response,
    errors_as_json,
    read_body,
    same_site,
)
from batchd.server.jobs.rest import JobRoutes
from batchd.server.jobs.service import JobsService
from batchd.server.json_body import MAX_JSON_BYTES
from batchd.server.pace import PatientStream
from batchd.server.rest_codec import (
    HEADER_LENGTH,
    generate_response,
    infer_response,
    json_room,
    parse_generate,
    parse_index,
    parse_infer,
    parse_load,
    tensors,
)
from batchd.server.service import EXTENSIONS, Body, Core, InferenceService

log = logging.getLogger("batchd.server")
INLINE_BYTES, INLINE_VALUES = 256 * 1024, 4096  # more: off the loop (values: its , and [)
# An answer's outputs past these (written as JSON, in all) are written off the loop; less
# when the answer is compressed too (Accept-Encoding): 16 KiB at level 1 take ~0.1 ms
INLINE, INLINE_DEFLATED = (4 * INLINE_VALUES, INLINE_BYTES), (INLINE_VALUES, 16 * 1024)
REST_EXTENSIONS = sorted([*EXTENSIONS, "binary_tensor_data", "generate"])
JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"  # as Triton's /generate_stream


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type=JSON)


def _bytes(header: str) -> bool:  # ASCII digits, at most 19 (int() took "1_0"; past 4,300
    return header.isascii() and header.isdigit() and len(header) < 20  # it raised: 57c, 57d)


def _json_part(size: int, header: str | None) -> int:
    """How many of a body's `size` bytes are JSON, as Inference-Header-Content-Length
    `header` says (all, where it says none or nonsense: _infer_body refuses that)."""
    length = int(header) if header is not None and _bytes(header) else -1
    return length if 0 <= length <= size else size


def _infer_body(body: bytes, header: str | None, cfg: ModelConfig, limits: Limits) -> Any:
    """parse_infer, its header's length read from `header` (Inference-Header-Content-Length)."""
    if header is not None and not _bytes(header):
        raise InvalidInput(f"{HEADER_LENGTH} must be a number of bytes, got {clip(header)}")
    length, size = None if header is None else int(header), _json_part(len(body), header)
    msg, wanted = parser.run(parse_infer, _json_bytes(size), body, length, cfg.name, cfg.version,
                             limits, len(cfg.outputs))  # fmt: skip
    json_room(msg, cfg, wanted)  # before the model runs for an answer refused once made
    return msg, wanted


def _aside(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(body, *args)`, a body of JSON only, parsed in the parser process when large."""
    return lambda body, *args: parser.run(fn, _json_bytes(len(body)), body, *args)


def _json_bytes(size: int) -> int:
    """What parser.run is told `size` bytes of JSON are: over the limit, 0 (refused at once)."""
    return 0 if size > MAX_JSON_BYTES else size


class RestApi:
    """The routes; everything they call is the gRPC edge's."""

    def __init__(
        self,
        service: InferenceService,
        core: Core,
        jobs: JobsService,
        tokens: Tokens | None,
        max_body_bytes: int,
        connections: Connections,
        host: str = "127.0.0.1",  # --host: on loopback, only loopback names (same_site)
    ) -> None:
        self._service, self._core, self._tokens = service, core, tokens
        body_timeout_s = connections.handshake_timeout_s  # 0: none (asyncio's 0: "at once")
        self._body_timeout_s = body_timeout_s or None
        self._max_body = max_body_bytes
        self._inflated = InflateBudget(INFLATED_BODIES * max_body_bytes)
        self._received = InflateBudget(RECEIVED_BODIES * max_body_bytes, "request bodies")
        sent = bounded_send(connections.max_age_grace_s)  # outermost: error answers too
        self.app = web.Application(
            client_max_size=max_body_bytes,
            middlewares=[sent, errors_as_json, same_site(host), self._auth],
        )
        get = self.app.router.add_get  # GET: HEAD too

        def post(path: str, handler: Handler) -> None:
            self.app.router.add_post(path, handler, expect_handler=self._expect)

        get("/v2", self.server_metadata)
        get("/v2/health/live", self.live)
        get("/v2/health/ready", self.ready)
        get("/v2/models/stats", self.stats)
        for m in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            get(m, self.metadata)
            get(m + "/ready", self.model_ready)
            get(m + "/config", self.config)
            get(m + "/stats", self.stats)
            post(m + "/infer", self.infer)
            post(m + "/generate", self.generate)
            post(m + "/generate_stream", self.generate_stream)
        post("/v2/repository/index", self.index)
        post("/v2/repository/models/{model}/load", self.load)
        post("/v2/repository/models/{model}/unload", self.unload)
        limit = (jobs.max_file_bytes, "--jobs-max-file-bytes")  # (inf: jobs are off)
        routes = JobRoutes(jobs, body_timeout_s, connections.max_age_grace_s)
        routes.add_to(self.app.router, functools.partial(self._expect, limit=limit))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """--auth-token-file, as on gRPC: health is open, model control needs an admin
        token, the rest an infer or admin one; one answer for every refusal."""
        if not self._allowed(request):
            raise Unauthenticated(DENIED)
        return await handler(request)

    def _allowed(self, request: web.Request) -> bool:
        path = request.path
        if self._tokens is None or path.startswith("/v2/health/"):
            return True
        scope = ADMIN if path.startswith("/v2/repository") else INFER
        return self._tokens.allows(scope, bearer_header(request.headers.get("Authorization", "")))

    # ---- helpers ----

    async def _expect(
        self, request: web.Request, limit: tuple[float, str] | None = None
    ) -> web.StreamResponse | None:
        """`Expect: 100-continue` (it comes before the middlewares): a caller without its
        token, or a body declared over the limit, is refused before the body is sent
        (aiohttp said 100 Continue, then refused it), and the connection closed. Any
        other expectation is 417 (it was 413 for a large body, aiohttp's text/plain else)."""
        expect = request.headers.get("Expect", "")
        most, flag = limit or (self._max_body, "--max-message-bytes")
        if expect.lower() != "100-continue":
            refused = error_response(417, f"Expect: only 100-continue is understood; came "
                                     f"{clip(expect)}")  # fmt: skip
        elif not self._allowed(request):
            refused = error_response(401, DENIED, {"WWW-Authenticate": "Bearer"})
        elif (declared := request.content_length or 0) > most:
            refused = error_response(413, f"the body is {declared} bytes, more than {most:.0f} "
                                     f"({flag})")  # fmt: skip
        else:
            await _default_expect_handler(request)  # 100 Continue
            return None
        refused.force_close()  # the body it announced never came: no next request
        return refused

    async def _body(self, request: web.Request) -> BodyBytes:
        """The whole body: one that says it is over the limit is refused before a byte
        of it is read; one that does not keep coming (read_body), 408."""
        limit, coding = self._max_body, encoding(request)
        over = f"more than {limit} bytes (--max-message-bytes)"  # (aiohttp's text named neither)
        if (declared := request.content_length or 0) > limit:
            raise web.HTTPRequestEntityTooLarge(limit, text=f"the body is {declared} bytes, {over}")
        try:
            body = await read_body(request, limit, self._body_timeout_s, self._received)
        except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past it
            raise web.HTTPRequestEntityTooLarge(limit, text=f"the body is {over}") from None
        if not coding:
            return body
        inflating = Inflating(body, coding, limit, self._inflated)  # a small one on the loop
        if not inflating.run(INLINE_BYTES):
            await self._service.aside(inflating.finish)
        if len(inflating.out) > limit:
            too_big = f"the {coding} body inflates to more than {limit} bytes (--max-message-bytes)"
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=limit + 1, text=too_big)
        return inflating.out  # (no copy on the loop: 44 ms for 60 MB; held, it is counted)

    async def _model_body(self, request: web.Request) -> tuple[ModelConfig, BodyBytes]:
        self._model(request)  # (not served: refused before a byte of the body is read)
        body = await self._body(request)
        return self._model(request), body  # as it serves once the body came (a reload)

    def _model(self, request: web.Request) -> ModelConfig:
        info = request.match_info
        return self._service.model(info["model"], info.get("version", ""))

    async def _parse(self, body: BodyBytes, fn: Callable[..., Any], *args: Any,
                     json_bytes: int | None = None) -> Any:  # fmt: skip
        """`fn(body, *args)` on the loop, the decode thread if many values, or where its JSON
        (`json_bytes`, or all) is the parser process's, a thread that waits for it (57c)."""
        if (len(body) if json_bytes is None else json_bytes) > parser.ASIDE_BYTES:
            return await self._service.aside(fn, body, *args, pool=parser.WAITING)
        if len(body) > INLINE_BYTES or body.count(b",") + body.count(b"[") > INLINE_VALUES:
            return await self._service.aside(fn, body, *args)
        return fn(body, *args)

    def _request(self, cfg: ModelConfig, body: BodyBytes, fn: Callable[..., Any], *args: Any,
                 json_bytes: int | None = None) -> tuple[Body, list[Any]]:  # fmt: skip
        """The request `fn(body, *args)` makes (or one and more), parsed as its first step
        (service.Body: a body refused counts as over gRPC); what `fn` returned: in the list."""
        got: list[Any] = []

        async def parse() -> pb.ModelInferRequest:
            got.append(await self._parse(body, fn, *args, json_bytes=json_bytes))
            return got[0][0] if isinstance(got[0], tuple) else got[0]  # type: ignore[no-any-return]

        return (cfg, parse), got

    # ---- health and metadata ----

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response(
            {"name": "batchd", "version": __version__, "extensions": REST_EXTENSIONS}
        )

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": self._service.live}, 200 if self._service.live else 503)

    async def ready(self, request: web.Request) -> web.Response:
        ready = self._service.ready()
        return json_response({"ready": ready}, 200 if ready else 503)

    async def model_ready(self, request: web.Request) -> web.Response:
        cfg = self._model(request)
        ready = self._service.model_ready(cfg.name)
        return json_response({"name": cfg.name, "ready": ready}, 200 if ready else 503)

    async def metadata(self, request: web.Request) -> web.Response:
        return json_response(as_json(model_metadata(self._model(request)), defaults=True))

    async def config(self, request: web.Request) -> web.Response:
        return json_response(as_json(model_config(self._model(request)).config, defaults=True))

    async def stats(self, request: web.Request) -> web.Response:
        """Its JSON is made off the loop (1,500 models' held it 0.6 s: review 58a)."""
        m = request.match_info
        wanted = pb.ModelStatisticsRequest(name=m.get("model", ""), version=m.get("version", ""))
        found = await self._service.every_statistics(wanted)
        return json_response(await self._service.aside(as_json, found, True, bounded=False))

    # ---- inference ----

    async def infer(self, request: web.Request) -> web.Response:
        cfg, body = await self._model_body(request)
        length = request.headers.get(HEADER_LENGTH)
        parsed, got = self._request(cfg, body, _infer_body, length, cfg, self._service.limits,
                                    json_bytes=_json_part(len(body), length))  # fmt: skip

        coding = accepted(request)

        def answer(response: pb.ModelInferResponse) -> tuple[bytes, int | None]:
            text, json_length = infer_response(response, got[0][1])
            return deflated(text, coding) if coding else text, json_length

        async def encode(response: pb.ModelInferResponse) -> tuple[bytes, int | None]:
            """In the request's scope: a failure here is counted and traced as one."""
            if got[0][1].heavy(response, *(INLINE_DEFLATED if coding else INLINE)):
                return await self._service.aside(answer, response, bounded=False)
            return answer(response)

        text, json_length = await self._service.infer(parsed, None, request.headers, encode)
        headers = coded(coding)
        if json_length is None:
            return web.Response(body=text, content_type=JSON, headers=headers)
        return web.Response(
            body=text,
            content_type="application/octet-stream",
            headers={**headers, HEADER_LENGTH: str(json_length)},
        )

    async def generate(self, request: web.Request) -> web.Response:
        cfg, body = await self._model_body(request)
        parsed, _ = self._request(cfg, body, _aside(parse_generate), cfg)
        coding = accepted(request)

        async def encode(response: pb.ModelInferResponse) -> bytes:
            text = generate_response(cfg, response.id, tensors(response))
            if coding and len(text) > INLINE_DEFLATED[1]:
                return await self._service.aside(deflated, text, coding, bounded=False)
            return deflated(text, coding) if coding else text

        body = await self._service.infer(parsed, None, request.headers, encode)
        headers = coded(coding)
        return web.Response(body=body, content_type=JSON, headers=headers)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events as Triton sends them: one `data:` event per output, and
        the body's end after the last; a failure after the first output is a `data:`
        event with `error` (and its `code`). A failure before the first output is an
        HTTP error, as on /generate; a sequence that yields no output, an empty body."""
        cfg, body = await self._model_body(request)
        parsed, _ = self._request(cfg, body, _aside(parse_generate), cfg)
        budget = stream_budget(self._service.max_response_bytes())  # (its caller's Pace)
        events = self._events(cfg, parsed, request.headers, StepStream(budget=budget))
        first = await anext(events, None)  # raises before any byte is sent
        stream = PatientStream(request, cfg.instances.execution_timeout_s, budget, headers={
            "Content-Type": SSE, "Cache-Control": "no-cache"})  # fmt: skip
        await stream.prepare(request)
        try:
            event: bytes | None = first
            while event is not None:
                await stream.write(b"data: " + event + b"\n\n")
                event = await anext(events, None)
        except BatchdError as e:
            error = {"error": e.message, "code": e.code.name}
            await stream.write(b"data: " + orjson.dumps(error) + b"\n\n")
        finally:
            await events.aclose()
        await stream.write_eof()
        return stream

    async def _events(self, cfg: ModelConfig, parsed: Body, headers: Mapping[str, str],
                      stream: StepStream) -> AsyncGenerator[bytes]:  # fmt: skip
        if cfg.generate is None:  # a one-shot model: one output

            async def encode(response: pb.ModelInferResponse) -> bytes:
                return generate_response(cfg, response.id, tensors(response))

            yield await self._service.infer(parsed, None, headers, encode)
            return
        async for r, outputs, _final in self._service.sequence(parsed, None, headers, stream):
            chosen = [t for t in outputs if t.name in r.outputs]
            yield generate_response(cfg, r.id, chosen)

    # ---- model control ----

    async def index(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        index = await self._service.index(await self._parse(body, _aside(parse_index)))
        return json_response([as_json(m, defaults=True) for m in index.models])

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        await self._service.load(
            await self._parse(body, _aside(parse_load), request.match_info["model"])
        )
        return json_response({})

    async def unload(self, request: web.Request) -> web.Response:
        await self._core.unload(request.match_info["model"])
        return json_response({})
