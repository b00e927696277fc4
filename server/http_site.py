"""The HTTP edge's connections: aiohttp serving an application on a port, with the
bounds a hostile client meets before and after its request runs.

    before   a TLS handshake, the request line and headers: --handshake-timeout
             (aiohttp's keep-alive timer, armed when a connection opens)
    body     gzip and deflate bodies inflated, at most the body limit (a small
             bomb inflates no further): the first INLINE_BYTES on the event loop,
             any more on the decode thread; all of them at most INFLATED_BODIES
             limits at once (InflateBudget); other encodings, 415
    after    an answer its caller does not read within --max-connection-age-grace
             is dropped with its connection, as gRPC ends a connection past its age
             and grace: a client that never reads held the answer's memory for ever

aiohttp reports every malformed request a client sends (bad request line, a
negative Content-Length) as an ERROR with a traceback: a log flood any client can
cause. The client gets its 400; here such a report is one DEBUG line.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
import weakref
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from batchd.server.errors import BatchdError, QueueFull, clip, http_status

log = logging.getLogger("batchd.server")
protocol_log = logging.getLogger("batchd.server.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENCODINGS = ("gzip", "x-gzip", "deflate")
BodyBytes = bytes | bytearray  # a body as it came, or inflated (http_site.Inflated)


def _client_error(record: logging.LogRecord) -> bool:
    if not log.isEnabledFor(logging.DEBUG):
        return False
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    record.exc_info = record.exc_text = None
    return True


protocol_log.addFilter(_client_error)


def encoding(request: web.Request) -> str:
    """The body's Content-Encoding, "" for none; one batchd cannot read: 415 at once,
    before a byte of the body is read. A Transfer-Encoding but chunked: 501 (aiohttp
    took `gzip, chunked` as chunked, and read the gzip bytes as JSON: review 57c)."""
    transfer = request.headers.get("Transfer-Encoding", "").lower()
    if any(c.strip() not in ("", "chunked") for c in transfer.split(",")):
        why = f"Transfer-Encoding {transfer[:40]!r} is not supported: send it chunked, or sized"
        raise web.HTTPNotImplemented(text=why)
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding in ("", "identity"):
        return ""
    if coding not in ENCODINGS:
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Encoding {coding[:40]!r} is not supported: send identity, gzip or "
            "deflate"
        )
    return coding


def accepted(request: web.Request) -> str:
    """The coding an answer goes in: gzip or deflate, whichever the caller's
    Accept-Encoding weighs more (q > 0; one not named weighs what `*` does, and less), as
    Triton answers tritonclient's response_compression_algorithm; "" (identity) for
    neither, or where it names identity weighing more."""
    weights: dict[str, float] = {}
    for item in request.headers.get("Accept-Encoding", "").lower().split(","):
        name, *params = (part.strip() for part in item.split(";"))
        q = next((p[2:] for p in params if p.startswith("q=")), "1")
        with contextlib.suppress(ValueError):  # (a q past 1 weighs 1; nan, or below 0, nothing)
            value = float(q)
            weights.setdefault(
                name.removeprefix("x-"), value if 0 <= value <= 1 else float(value > 1)
            )
    star = weights.get("*", 0.0)
    best = max(("gzip", "deflate"), key=lambda c: (weights.get(c, star), c in weights))
    weight = weights.get(best, star)
    return best if weight > 0 and weight >= weights.get("identity", 0.0) else ""


def deflated(data: bytes, coding: str) -> bytes:
    """`data` as `coding` (accepted()): gzip, or deflate in zlib's wrapper as Triton and
    tritonclient read it; level 1, the cheapest (zlib frees the GIL as it works)."""
    out = zlib.compressobj(1, zlib.DEFLATED, zlib.MAX_WBITS + (16 if coding == "gzip" else 0))
    return out.compress(data) + out.flush()


def coded(coding: str) -> dict[str, str]:
    """The headers of an answer in `coding` (deflated())."""
    return {"Content-Encoding": coding, "Vary": "Accept-Encoding"} if coding else {}


MAX_MEMBERS = 64  # gzip members of one body: each costs a decompressor, even an empty one
STEP = 64 * 1024  # compressed bytes given zlib at a time: what it hands back stays small
PIECE = 1024 * 1024  # ... and inflated bytes at most: each is copied into the body with
# the GIL held (60 MB at once held it 38 ms, a stall of the event loop)
HOSTS = "/etc/hosts"  # its loopback names are this machine's (same_site)
INFLATED_BODIES = 4  # what inflated bodies may hold at once, over all requests, in body limits
RECEIVED_BODIES = 16  # ... and bodies as they came (read_body), till each is freed


class Inflated(bytearray):
    """A body, inflated or as it came: its bytes count against a budget till it is freed."""

    __slots__ = ("__weakref__",)


class InflateBudget:
    """The bytes that inflated bodies hold, over all requests, until each is freed (its
    request ended). A body of 60 KB can inflate to 60 MB: forty of them, 2.4 MB sent,
    held 2.7 GB. Past `most`, a body is refused as a full queue is (429), to retry."""

    def __init__(self, most: int, what: str = "inflated request bodies") -> None:
        self.most, self.held, self.what = most, 0, what
        self._lock = threading.Lock()  # taken on the loop (a body's first step) and aside

    def take(self, n: int, taken: list[int]) -> None:
        with self._lock:
            if self.held + n > self.most:
                raise QueueFull(f"{self.what} hold {self.held} bytes, the most "
                                f"they may ({self.most}); retry", retry_after_ms=1000)  # fmt: skip
            self.held += n
            taken[0] += n

    def give(self, taken: list[int]) -> None:
        with self._lock:
            self.held -= taken[0]


class Inflating:
    """A gzip or deflate body, inflated in steps (run) to at most `limit` + 1 bytes: the
    caller refuses more, and a bomb costs no more than that. gzip may hold several
    members, one after the other; "deflate" is zlib's format, or raw deflate (as some
    clients send it). zlib holds no GIL while it works. What it makes counts against
    `budget` until `out` is freed."""

    def __init__(
        self, body: BodyBytes, coding: str, limit: int, budget: InflateBudget | None = None
    ) -> None:
        self.coding, self.limit, self.out = coding, limit, Inflated()
        self._body, self._at = memoryview(body), 0  # not yet inflated: body[at:]
        self._d: Any = None  # the member being inflated
        self._members = 0
        self._budget = budget or InflateBudget(limit + 1)
        self._taken = [0]  # bytes of `out` taken from the budget: given back once it is freed
        weakref.finalize(self.out, self._budget.give, self._taken)

    def run(self, budget: int) -> bool:
        """Inflate, spending about `budget` (bytes read or made, whichever is more); True
        once all is (or more than `limit`). Linear in the body, whatever its members."""
        while len(self.out) <= self.limit and budget > 0:
            if self._d is None:
                if self._at >= len(self._body):
                    return True  # every member inflated (or an empty body)
                self._members += 1
                if self._members > MAX_MEMBERS:
                    raise web.HTTPBadRequest(text=f"the {self.coding} body holds more than "
                                             f"{MAX_MEMBERS} members")  # fmt: skip
                self._d = zlib.decompressobj(self._wbits(self._body[self._at : self._at + 2]))
            chunk = self._body[self._at : self._at + STEP]
            want = min(budget, self.limit + 1 - len(self.out), PIECE)
            try:
                got = self._d.decompress(chunk, want)
            except zlib.error as e:
                why = f"the {self.coding} body does not inflate: {e}"
                raise web.HTTPBadRequest(text=why) from None
            left = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            used = len(chunk) - len(left)
            self._at += used
            self._budget.take(len(got), self._taken)
            self.out += got
            budget -= max(len(got), used, 1)
            if self._d.eof:  # a member ends: another may follow (gzip), else nothing may
                self._d = None
                if self._at < len(self._body) and self.coding == "deflate":
                    raise web.HTTPBadRequest(text="the deflate body has bytes after its end")
            elif not got and not used:  # no input left, and the stream goes on
                why = f"the {self.coding} body ends inside its compressed stream"
                raise web.HTTPBadRequest(text=why)
        return len(self.out) > self.limit or (self._d is None and self._at >= len(self._body))

    def finish(self) -> None:
        """Inflate the rest, however much is left (bounded by `limit` and the body)."""
        while not self.run(self.limit + 1):
            pass

    def _wbits(self, data: memoryview) -> int:
        if self.coding != "deflate":
            return 16 + zlib.MAX_WBITS  # a gzip member
        zlib_header = len(data) > 1 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        return zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS


def bounded_send(seconds: float) -> Middleware:
    """A middleware: a whole answer (not a stream) is sent here, within `seconds`, or its
    connection is closed (0: no bound). A 503 (stopping, no worker) closes its connection:
    its client connects anew, through a balancer to another replica, not to this one."""

    @web.middleware
    async def send(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if response.status == 503 and not response.prepared:
            response.force_close()
        if seconds and isinstance(response, web.Response) and not response.prepared:
            try:
                async with asyncio.timeout(seconds):
                    await response.prepare(request)
                    await response.write_eof()
            except TimeoutError:
                log.info("HTTP %s %s: its answer was not read within %g s; connection "
                         "closed", request.method, request.path[:100], seconds)  # fmt: skip
                if request.transport is not None:
                    request.transport.abort()
        return response

    return send


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None,
                   ) -> web.Response:  # fmt: skip
    body = orjson.dumps({"error": message})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as `{"error": ...}` with its status: a BatchdError's from its
    gRPC code, aiohttp's own (404 route, 405, 413 body) with their text."""
    try:
        return await handler(request)
    except BatchdError as e:
        status, headers = http_status(e)
        return error_response(status, e.message, headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        allow = e.headers.get("Allow")
        return error_response(e.status, e.text or e.reason, {"Allow": allow} if allow else None)
    except TimeoutError:  # (what is left of the body is not waited for)
        late = error_response(408, "the request body did not arrive in time")
        return await sent_then_closed(request, late)
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("HTTP %s %s failed", request.method, clip(request.path))
        return error_response(500, "internal error; the server log has the details")


BODY_RATE = 64 * 1024  # bytes a second a body must bring, each --handshake-timeout


async def read_body(
    request: web.Request, limit: int, timeout_s: float | None, budget: InflateBudget | None = None
) -> bytearray:
    """The whole body, at most `limit` bytes (HTTPRequestEntityTooLarge past it, a
    chunked one too). In each `timeout_s` (--handshake-timeout; None: no bound) it must
    end or bring BODY_RATE bytes a second: one that stops or trickles is TimeoutError
    (408) at the end of that window, and a large one over a slow link is read whole (it
    had to come within `timeout_s`: 64 MB over a 20 Mbit/s link never could). Window by
    window, not in all (as Apache's mod_reqtimeout MinRate): 32 MB sent at once bought
    its sender 8 minutes of silence, 20 connections held 660 MB (review 54d). Its bytes
    count against `budget` till it is freed: past it, QueueFull (429, to retry), where
    slow connections, each within its rate, pinned memory without bound (review 54g)."""
    body, loop, taken = Inflated(), asyncio.get_running_loop(), [0]
    if budget is not None:
        weakref.finalize(body, budget.give, taken)
    window = int(BODY_RATE * (timeout_s or 0))  # the bytes each window brings at least
    until = None if timeout_s is None else loop.time() + timeout_s  # this window's end
    need = window  # what the body holds by then, or it ends
    while True:
        try:
            async with asyncio.timeout_at(until):
                piece = await request.content.readany()
        except TimeoutError:
            piece = None  # (the window ended: judged below)
        if piece == b"":
            return body  # (not copied into bytes, as aiohttp's read() did: 64 MB on the loop)
        if piece is not None:
            if len(body) + len(piece) > limit:
                raise web.HTTPRequestEntityTooLarge(limit, len(body) + len(piece))
            if budget is not None:
                budget.take(len(piece), taken)
            body += piece
        if timeout_s is not None and until is not None and (now := loop.time()) >= until:
            if len(body) < need:
                raise TimeoutError
            until, need = now + timeout_s, len(body) + window


async def sent_then_closed(request: web.Request, response: web.Response) -> web.Response:
    """`response` sent now, then its connection closed, after what is buffered (so that
    it reaches its caller): for a body that did not come, aiohttp read on for the rest of
    it 10 s more (its lingering), holding the socket past --handshake-timeout."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()
    return response


def same_site(listening_on: str) -> Middleware:
    """A middleware: what a web page in a browser sends batchd of its own accord is refused
    (403). A request whose `Origin` (every browser POST has one) names another host than
    its `Host` came from another site's page: infer, a job or an unload, sent by a page the
    user merely visited. On a loopback `--host`, a `Host` that is no loopback name (nor
    this machine's) came through a name that page's site resolved to 127.0.0.1 (DNS
    rebinding), which lets it read the answers too. Programs send neither."""
    own = {socket.gethostname().lower(), *_hosts_loopback_names()}
    listening_on = _name(f"[{listening_on.strip('[]')}]" if ":" in listening_on else listening_on)
    local = _loopback_name(listening_on) or listening_on in own  # (--host vm: /etc/hosts')

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = _name(request.headers.get("Host", ""))
        origin = request.headers.get("Origin")
        if origin is not None and _name(origin.partition("://")[2]) != host:
            raise web.HTTPForbidden(text=f"a request from a web page of another site (Origin "
                                    f"{origin[:60]!r}, Host {host[:60]!r}) is refused")  # fmt: skip
        if local and host and not (_loopback_name(host) or host in own):
            raise web.HTTPForbidden(
                text=f"Host {host[:60]!r} is not a name of this server, which listens on "
                "loopback (a web page may be reaching it through a name of its own): send "
                "Host: localhost or 127.0.0.1, or serve on another --host"
            )
        return await handler(request)

    return check


def _name(authority: str) -> str:
    """The host name of HOST[:PORT] or [IPV6][:PORT], lowercase, without a final dot."""
    if authority.startswith("["):
        return authority[1:].partition("]")[0].lower()
    name = authority.rpartition(":")[0] if ":" in authority else authority
    return name.lower().rstrip(".")


def _loopback_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost") or _loopback_ip(name)


def _loopback_ip(text: str) -> bool:
    """Whether `text` is a loopback address (::ffff:127.0.0.1 too); a name is not."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _hosts_loopback_names() -> set[str]:
    """The names /etc/hosts gives a loopback address (localhost.localdomain, ip6-localhost,
    this machine's own): no web page can make those resolve elsewhere."""
    names: set[str] = set()
    with contextlib.suppress(OSError), open(HOSTS, errors="replace") as hosts:
        for line in hosts:  # (a byte not UTF-8 spoils its own line, not the others)
            address, *aliases = line.partition("#")[0].split() or [""]
            # an address, as glibc reads it: a line led by a name is none of its
            if _loopback_ip(address.partition("%")[0]):
                names.update(a.lower().rstrip(".") for a in aliases)
    return names
