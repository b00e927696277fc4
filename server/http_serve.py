"""Serving the HTTP endpoint: aiohttp's runner on batchd's own site and handler.

`_Site` is aiohttp's TCPSite with a TLS handshake timeout; `_JsonErrors` answers a
request aiohttp's own parser refuses (a request line or header over 8,190 bytes, too
many headers, a malformed line) with `{"error": ...}` as every other error is, and
quotes none of it: aiohttp's text/plain 400 echoed the start of the line it refused,
an Authorization header's token included.
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from batchd.server.config import Connections
from batchd.server.http_site import error_response, protocol_log

MAX_LINE_BYTES = 8190  # a request line, or a header, past this is refused


async def serve_rest(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None,
    reuse_port: bool,
    connections: Connections,
) -> tuple[web.AppRunner, int]:
    """Start serving `app` on host:port; returns the runner (to stop it) and the port."""
    header_timeout_s = connections.handshake_timeout_s or math.inf
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        logger=protocol_log,
        # A caller that leaves cancels its request, as a gRPC cancel does.
        handler_cancellation=True,
        # On shutdown, after the drain: a caller that does not read its answer holds
        # the stop at most this long (aiohttp's default: 60 s, twice).
        shutdown_timeout=1.0,
        # Closes a connection that has not sent a whole request by then (counted from its
        # start since aiohttp 3.14.4): slow loris and idle keep-alive connections alike.
        keepalive_timeout=header_timeout_s,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_LINE_BYTES,
        # Bodies are inflated by RestApi, off the loop and bounded: aiohttp inflates on
        # the loop, even a body it then refuses (a 1 MB gzip held it 0.5 s per GB).
        auto_decompress=False,
    )
    await runner.setup()
    site = _Site(runner, host, port, ssl_context, reuse_port=reuse_port,
                 ssl_handshake_timeout=header_timeout_s if ssl_context else None)  # fmt: skip
    await site.start()
    sockets = getattr(site._server, "sockets", None)
    assert sockets
    return runner, int(sockets[0].getsockname()[1])


class _Site(web.BaseSite):
    """aiohttp's TCPSite, which takes no TLS handshake timeout (aiohttp 3.14): asyncio's
    default, 60 s, let a connection that never finishes its handshake hold a socket."""

    __slots__ = ("_host", "_options", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, ssl_context: ssl.SSLContext | None,
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._options = host, port, options

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        assert self._runner.server is not None
        server = self._runner.server

        def connection() -> web_protocol.RequestHandler:
            handler = server()
            handler.__class__ = _JsonErrors  # (aiohttp makes its own: no hook for the class)
            return handler

        self._server = await asyncio.get_running_loop().create_server(
            connection, self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, **self._options,
        )  # fmt: skip


class _JsonErrors(web_protocol.RequestHandler):
    """aiohttp's handler, but for a request its parser refused: a JSON error naming the
    kind of fault, none of what came, and the connection closed."""

    __slots__ = ()

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)  # (not the parser's)
        protocol_log.debug("HTTP request from %s refused by the parser: %s", request.remote,
                           type(exc).__name__)  # fmt: skip
        response = error_response(status, f"not a request HTTP/1.1 can carry ({_fault(exc)})")
        response.force_close()
        return response


def _fault(exc: HttpProcessingError) -> str:
    """What the parser found wrong, without what came. The C parser's message names the
    fault, then, after a blank line, quotes the bytes: the name is said; a few fixed
    messages are said whole; any other (the pure-Python parser's quote what came bare,
    a bad chunk size's as the whole message) by the exception's class alone."""
    kind = type(exc).__name__
    if kind == "LineTooLong":
        return f"a request line or header over {MAX_LINE_BYTES} bytes"
    text = str(exc.message)
    head, blank, _ = text.partition("\n\n")
    said = " ".join(head.split()).rstrip(":")
    quotes = "b'" in said or re.search(r"'[^']*'|\"", said)  # (a message that quotes what came)
    if (blank or text in _FIXED) and said.isascii() and not quotes and 0 < len(said) <= 100:
        return said
    return kind


_FIXED = {"Received HTTPS traffic on an HTTP port", "Too many headers received"}
