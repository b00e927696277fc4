"""Bearer-token authentication for the gRPC edge (`--auth-token-file`).

The token file holds one `<scope>: <token>` per line; `#` starts a comment:

    infer: 3f1c...   # may call the inference RPCs
    admin: 9b7e...   # may call those and the Repository* RPCs

Every RPC of GRPCInferenceService and of batchd.jobs.v1.Jobs needs
`authorization: Bearer <token>` in its metadata: the Repository* RPCs (model
control) an admin token, all others an infer or an admin token (jobs/service.py
then keeps a job to the token that submitted it). The health service and server
reflection stay open, for orchestrators' probes. A missing, malformed or wrong token is
UNAUTHENTICATED with the same detail every time. Tokens are compared as
SHA-256 digests with hmac.compare_digest: the time taken says nothing about
how much of a token was right, nor its length.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from batchd.protos.model_config import ConfigError
from batchd.server.errors import Unauthenticated, grpc_status

INFER, ADMIN = "infer", "admin"
MIN_TOKEN_CHARS = 16
DENIED = "missing or invalid token"  # the only detail a refused caller gets
_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_ADMIN = "/inference.GRPCInferenceService/Repository"


def scope_of(method: str) -> str | None:
    """The scope an RPC needs: None (open), "infer" or "admin". Unknown services need infer."""
    if method.startswith(_OPEN):
        return None
    return ADMIN if method.startswith(_ADMIN) else INFER


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


@dataclass(frozen=True)
class Tokens:
    """Digests of the tokens allowed per scope."""

    infer: tuple[bytes, ...]
    admin: tuple[bytes, ...]

    def allows(self, scope: str, token: bytes | None) -> bool:
        allowed = self.admin if scope == ADMIN else self.infer + self.admin
        if token is None:
            return False
        given = _digest(token)
        found = False
        for d in allowed:  # no early exit
            found |= hmac.compare_digest(given, d)
        return found


def load_tokens(path: Path) -> Tokens:
    """Parse a token file; errors name the file and the line, never the token."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the token file: {e.strerror}") from e
    except UnicodeDecodeError as e:  # (the bytes may be a token: not quoted)
        raise ConfigError(f"{path}: not UTF-8 (byte {e.start} of the file)") from None
    scopes: dict[str, list[bytes]] = {INFER: [], ADMIN: []}
    for n, line in enumerate(text.splitlines(), 1):
        # A comment: a line from `#`, or `#` after a space; a `#` in a token is the token's
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if not line:
            continue
        scope, sep, token = (s.strip() for s in line.partition(":"))
        if not sep or scope not in scopes:
            raise ConfigError(f"{path}:{n}: expected 'infer: <token>' or 'admin: <token>'")
        if len(token) < MIN_TOKEN_CHARS or not re.fullmatch(r"[\x21-\x7e]+", token):
            raise ConfigError(  # (gRPC metadata carries no other: one worked on HTTP only)
                f"{path}:{n}: a token must be at least {MIN_TOKEN_CHARS} characters of "
                "printable ASCII without spaces (e.g. `openssl rand -hex 32`)"
            )
        scopes[scope].append(_digest(token))
    if not any(scopes.values()):
        raise ConfigError(f"{path}: holds no token")
    return Tokens(tuple(scopes[INFER]), tuple(scopes[ADMIN]))


def bearer(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    """The token of the first `authorization` entry, if it is `Bearer <token>`: only the
    first counts, as HTTP reads its first Authorization header (a Bearer entry after
    another passed on gRPC, and failed on HTTP)."""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else str(value).encode()
            kind, _, token = raw.partition(b" ")
            return token.strip() if kind.lower() == b"bearer" and token.strip() else None
    return None


def bearer_header(value: str) -> bytes | None:
    """The token of an HTTP `Authorization: Bearer <token>` header, if any."""
    kind, _, token = value.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return None
    # aiohttp decodes a header as UTF-8 with surrogate escapes: encoded back, the bytes sent
    return token.strip().encode("utf-8", "surrogateescape")


async def _deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    with grpc_status(context):
        raise Unauthenticated(DENIED)


# Refusals of each RPC shape; no request deserializer, so the message is never parsed
# (and as a request stream, never read: TokenAuth).
_REFUSE = {
    (False, False): grpc.unary_unary_rpc_method_handler(_deny),
    (False, True): grpc.unary_stream_rpc_method_handler(_deny),
    (True, False): grpc.stream_unary_rpc_method_handler(_deny),
    (True, True): grpc.stream_stream_rpc_method_handler(_deny),
}

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        scope = scope_of(details.method)
        token = bearer(details.invocation_metadata)
        if handler is None or scope is None or self._tokens.allows(scope, token):
            return handler
        # (as a request stream, never read: a unary handler read and copied the message
        return _REFUSE[True, handler.response_streaming]  # first, 60 MB cost 167: 57b)
