"""The frontend's security settings and the pieces they switch on.

    gRPC port     TLS (--tls-cert/--tls-key), mutual TLS (--tls-client-ca),
                  bearer tokens (--auth-token-file, server/auth.py), limits,
                  connection reaping (idle, half-open, no handshake)
    worker port   CURVE encryption + a ZAP allow-list of worker keys (--worker-keys);
                  a tcp:// endpoint off loopback without keys is refused

Kept apart from app.py and cli.py: they call `add_arguments`, `from_args`,
`preflight`, `grpc_options`, `listen` and `WorkerAuth` only.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from batchd.protos import keys
from batchd.protos.model_config import ConfigError
from batchd.server.auth import TokenAuth, load_tokens
from batchd.server.calls import DEFAULT_MAX_CONCURRENT_STREAMS
from batchd.server.codec import DEFAULT_LIMITS, Limits

log = logging.getLogger("batchd.server")


STREAM_HEADROOM = 64  # HTTP/2 streams a connection may open beyond --max-concurrent-streams


@dataclass(frozen=True)
class Connections:
    """How long a client connection may hold the server's resources doing nothing,
    and how many calls may wait to be taken. Each a flag; 0 turns a timeout off."""

    handshake_timeout_s: float = 20.0  # TCP accepted -> HTTP/2 (and TLS) set up, or closed
    max_idle_s: float = 300.0  # no RPC open for this long: GOAWAY (clients reconnect)
    keepalive_time_s: float = 60.0  # ping a connection silent this long...
    keepalive_timeout_s: float = 20.0  # ...and close it if the ping goes unanswered
    # Calls that have arrived but that the event loop has not taken yet, server-wide.
    # gRPC sheds that backlog itself, answering CANCELLED (its own word, not ours):
    # at random above this many, all of them above twice as many. Its default, 1000,
    # shed calls of well-behaved clients whenever the loop fell behind a burst.
    max_pending_calls: int = 16384

    def grpc_options(self, streams_per_connection: int) -> list[tuple[str, int]]:
        ms = [
            ("grpc.server_handshake_timeout_ms", self.handshake_timeout_s),
            ("grpc.max_connection_idle_ms", self.max_idle_s),
            ("grpc.keepalive_time_ms", self.keepalive_time_s),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_s),
            # The ping's own deadline: without it keepalive_timeout is not what closes
            # a dead peer, grpc's 60 s ping timeout is.
            ("grpc.http2.ping_timeout_ms", self.keepalive_timeout_s),
        ]
        return [(name, int(s * 1000)) for name, s in ms if s > 0] + [
            ("grpc.server.max_pending_requests", self.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", 2 * self.max_pending_calls),
            # HTTP/2's own limit, a little above batchd's: a gRPC client queues its
            # calls beyond it itself, so one connection holds at most this many places
            # in the server-wide backlog above (another connection's call waits behind
            # those, not behind thousands), while the servicer still answers a call
            # over --max-concurrent-streams with RESOURCE_EXHAUSTED (streams.py).
            ("grpc.max_concurrent_streams", streams_per_connection + STREAM_HEADROOM),
            # Count a stream the client has reset as closed: else a client that
            # cancels calls gets REFUSED_STREAM (UNAVAILABLE) for new ones.
            ("grpc.http.overload_protection", 0),
        ]


@dataclass(frozen=True)
class SecurityConfig:
    tls_cert: Path | None = None  # PEM certificate chain of the gRPC port
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients must present a certificate it signed
    auth_token_file: Path | None = None
    worker_keys: Path | None = None  # CURVE key directory (protos/keys.py)
    limits: Limits = field(default_factory=Limits)
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS  # per client connection
    connections: Connections = field(default_factory=Connections)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


_CONNECTIONS = Connections()


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (see README, Security)")
    g.add_argument("--tls-cert", type=Path, help="PEM certificate (chain): serve gRPC over TLS")
    g.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca", type=Path, help="PEM CA: require client certificates it signed (mTLS)"
    )
    g.add_argument(
        "--auth-token-file",
        type=Path,
        help="require bearer tokens: lines 'infer: <token>' / 'admin: <token>'",
    )
    g.add_argument(
        "--worker-keys",
        type=Path,
        metavar="DIR",
        help="CURVE keys from `batchd keys generate DIR`: only authorized workers may join",
    )
    g.add_argument(
        "--max-tensor-elements",
        type=_positive,
        default=DEFAULT_LIMITS.max_tensor_elements,
        help=f"elements per input tensor (default {DEFAULT_LIMITS.max_tensor_elements})",
    )
    g.add_argument(
        "--max-inputs-per-request",
        type=_positive,
        default=DEFAULT_LIMITS.max_inputs,
        help=f"inputs per request (default {DEFAULT_LIMITS.max_inputs})",
    )
    g.add_argument(
        "--max-concurrent-streams",
        type=_positive,
        default=DEFAULT_MAX_CONCURRENT_STREAMS,
        help=f"open RPCs per client connection (default {DEFAULT_MAX_CONCURRENT_STREAMS})",
    )
    for flag, attr, what in (
        ("--handshake-timeout", "handshake_timeout_s", "close a connection not set up (HTTP/2 "
         "preface, TLS) within S seconds"),
        ("--max-connection-idle", "max_idle_s", "GOAWAY to a connection with no RPC for S seconds"),
        ("--keepalive-time", "keepalive_time_s", "ping a connection silent for S seconds"),
        ("--keepalive-timeout", "keepalive_timeout_s", "close it if the ping is not answered "
         "within S seconds"),
    ):  # fmt: skip
        default = getattr(_CONNECTIONS, attr)
        g.add_argument(
            flag,
            type=_seconds,
            default=default,
            metavar="S",
            help=f"{what} (default {default:g}; 0: never)",
        )
    g.add_argument(
        "--max-pending-calls",
        type=_positive,
        default=_CONNECTIONS.max_pending_calls,
        metavar="N",
        help="calls arrived but not yet taken, server-wide, before gRPC sheds them with "
        f"CANCELLED (default {_CONNECTIONS.max_pending_calls})",
    )


def from_args(args: argparse.Namespace) -> SecurityConfig:
    return SecurityConfig(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        auth_token_file=args.auth_token_file,
        worker_keys=args.worker_keys,
        limits=Limits(args.max_inputs_per_request, args.max_tensor_elements),
        max_concurrent_streams=args.max_concurrent_streams,
        connections=Connections(
            args.handshake_timeout,
            args.max_connection_idle,
            args.keepalive_time,
            args.keepalive_timeout,
            args.max_pending_calls,
        ),
    )


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror}") from e


def _credentials(cfg: SecurityConfig) -> grpc.ServerCredentials | None:
    if cfg.tls_cert is None and cfg.tls_key is None:
        if cfg.tls_client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cfg.tls_cert is None or cfg.tls_key is None:
        raise ConfigError("--tls-cert and --tls-key go together")
    pair = (_read(cfg.tls_key, "TLS key"), _read(cfg.tls_cert, "TLS certificate"))
    ca = None if cfg.tls_client_ca is None else _read(cfg.tls_client_ca, "client CA")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


def grpc_options(cfg: SecurityConfig) -> tuple[list[tuple[str, Any]], list[Any]]:
    """Channel options and interceptors of the gRPC server."""
    interceptors: list[Any] = (
        [] if cfg.auth_token_file is None else [TokenAuth(load_tokens(cfg.auth_token_file))]
    )
    return cfg.connections.grpc_options(cfg.max_concurrent_streams), interceptors


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", "0.0.0.0" is an address; interface names: not loopback


def listen(server: grpc.aio.Server, host: str, port: int, cfg: SecurityConfig) -> int:
    """Open the gRPC port, over TLS when configured; warn when it is exposed in the clear."""
    address = f"{host}:{port}"
    creds = _credentials(cfg)
    if not _loopback(host):
        if creds is None:
            log.warning(
                "gRPC on %s without TLS: requests and tokens cross the network in clear", host
            )
        if cfg.auth_token_file is None and cfg.tls_client_ca is None:
            log.warning(
                "gRPC on %s without --auth-token-file: anyone who reaches it may call it", host
            )
    if creds is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, creds))


def check_worker_endpoint(endpoint: str, worker_keys: Path | None) -> None:
    """Refuse a tcp:// worker endpoint off loopback without CURVE keys: whoever connects
    there could register as a worker and read every batch."""
    if worker_keys is not None or not endpoint.startswith("tcp://"):
        return
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    if not _loopback(host):
        raise ConfigError(
            f"--worker-endpoint {endpoint} is reachable from other hosts, and without "
            "--worker-keys any peer could register as a worker; generate keys with "
            "`batchd keys generate DIR` and pass --worker-keys DIR (or bind to 127.0.0.1)"
        )
    log.warning("worker endpoint %s has no --worker-keys: any local process may join", endpoint)


def preflight(cfg: SecurityConfig, worker_endpoint: str | None) -> WorkerAuth | None:
    """Check every security setting before anything starts: a bad file or a refused
    endpoint stops start-up with a ConfigError. Returns the worker authentication to start."""
    _credentials(cfg)
    if cfg.auth_token_file is not None:
        load_tokens(cfg.auth_token_file)
        if cfg.auth_token_file.stat().st_mode & 0o077:
            log.warning(
                "token file %s is readable by other users: chmod 600 it", cfg.auth_token_file
            )
    check_worker_endpoint(worker_endpoint or "", cfg.worker_keys)
    return None if cfg.worker_keys is None else WorkerAuth(cfg.worker_keys)


class _AllowList:
    """The ZAP callback: a worker key is let in only if it is in DIR/authorized/."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.keys = keys.load_authorized(directory)
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self.refused and len(self.refused) < 1024:  # one line per key
            self.refused.add(key)
            log.warning(
                "refused a worker whose CURVE key %s is not in %s",
                key.decode(),
                self.directory / keys.AUTHORIZED,
            )
        return False


class WorkerAuth:
    """CURVE on the frontend's ROUTER, with a ZAP handler on the event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._allow = _AllowList(directory)
        keys.load_pair(directory, keys.SERVER)  # fail at start-up, not at bind
        self._zap: AsyncioAuthenticator | None = None

    def start(self, ctx: zmq.asyncio.Context, router: zmq.asyncio.Socket) -> None:
        """Call before router.bind(); needs the running event loop."""
        self._zap = AsyncioAuthenticator(ctx)
        self._zap.start()
        self._zap.configure_curve_callback("batchd", self._allow)
        keys.make_curve_server(router, self.directory)
        log.info("worker endpoint: CURVE, %d authorized worker key(s)", len(self._allow.keys))

    def stop(self) -> None:
        if self._zap is not None:
            self._zap.stop()
