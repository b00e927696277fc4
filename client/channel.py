"""How a client reaches its server: TLS, the bearer token, the channel and its
options. Checked as the client is built: a setting that would send the token in
the clear, or one a header cannot carry, is a ValueError then, not a failed call.

The clients' options (keyword-only, both clients):
    tls=True                  TLS, checking the server against the system's CAs
    ca_cert=PEM               ... or against this CA (implies tls)
    client_cert=, client_key= a client certificate for mutual TLS (implies tls)
    token="..."               sends `authorization: Bearer <token>` with every call
A PEM is bytes (the PEM itself) or a str / Path (a file holding it).
own_connection=True gives the client a TCP connection of its own (by default
gRPC shares one among a process's channels to the same server), which is what
spreads load over the processes of `batchd serve --frontends N`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from batchd.client.errors import BatchdClientError

Pem = bytes | str | os.PathLike[str]
_TOKEN = re.compile(r"[\x21-\x7e]+")  # what an authorization header carries after "Bearer "


@dataclass(frozen=True)
class Security:
    tls: bool = False
    ca_cert: Pem | None = None
    client_cert: Pem | None = None
    client_key: Pem | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca_cert", "client_cert", "client_key"):
            if getattr(self, name) in ("", b""):  # (an unset variable: plaintext, with the token)
                raise ValueError(f"{name} is empty: give a PEM file's path or its bytes, "
                                 "or leave it out")  # fmt: skip
        if self.token is not None and not _TOKEN.fullmatch(self.token):
            raise ValueError("the token holds characters a header cannot carry (printable "
                             "ASCII only, no spaces): is it the file's whole text?")  # fmt: skip

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials, or None for a plaintext channel."""
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together")
        if not self.tls and self.ca_cert is None and self.client_cert is None:
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
    return value if value is None or isinstance(value, bytes) else Path(value).read_bytes()


def open_channel(kind: Any, url: str, credentials: grpc.ChannelCredentials | None,
                 options: list[tuple[str, int]]) -> Any:  # fmt: skip
    """A channel of `kind` (grpc: blocking; grpc.aio), over TLS with `credentials`."""
    if url.startswith(("http://", "https://")):  # gRPC said "Misformatted domain name"
        raise ValueError(f"url {url[:60]!r}: a gRPC target is HOST:PORT, no http:// (tls=True)")
    if credentials is None:
        return kind.insecure_channel(url, options=options)
    return kind.secure_channel(url, credentials, options=options)


def channel_options(max_message_bytes: int, own_connection: bool) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # gRPC shares one connection among a process's channels to the same target
        # unless told otherwise; a server with --frontends N balances connections.
        ("grpc.use_local_subchannel_pool", int(own_connection)),
        # A call with no deadline (a job's upload or download) on a connection gone
        # silent (a cut network): pinged after 5 min, failed 20 s later. No sooner: a
        # stock gRPC server (Triton too) takes pings every 5 min at most, and answers
        # more with GOAWAY too_many_pings, failing the call UNAVAILABLE (then retried:
        # its model ran twice). batchd permits one every 10 s (--keepalive-permit-time).
        ("grpc.keepalive_time_ms", 300_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # A server gone (restarting): gRPC connects again after 1 s, then 1.6 times longer
        # each time, up to 2 min, and meanwhile fails every call at once with the last
        # error, retries= too. Up to 2 s here, as the retries' own backoff: a call with
        # retries and a 3 s timeout failed 0.75 s after the server was back.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


@contextlib.contextmanager
def when_closed(client: Any) -> Iterator[None]:
    """A call made after `client.close()`, or under way then, fails alike in both clients:
    the client was closed (CANCELLED). gRPC's own were a ValueError, grpc.aio's UsageError,
    and an asyncio.CancelledError in a task nobody had cancelled."""
    try:
        yield
    except (ValueError, grpc.aio.UsageError, asyncio.CancelledError, BatchdClientError) as e:
        mine = isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling()  # type: ignore[union-attr]
        gone = not isinstance(e, BatchdClientError) or e.code == grpc.StatusCode.CANCELLED
        if not client.closed or mine or not gone:  # (blocking: gRPC's "Channel closed!")
            raise
        raise BatchdClientError("the client was closed", grpc.StatusCode.CANCELLED) from None
