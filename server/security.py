"""What the security and connection settings (config.py) switch on.

    gRPC, HTTP    TLS (--tls-cert/--tls-key), mutual TLS (--tls-client-ca),
                  bearer tokens (--auth-token-file, server/auth.py),
                  connection reaping (idle, half-open, no handshake), backlog
    worker port   CURVE encryption + a ZAP allow-list of worker keys (--worker-keys);
                  a tcp:// endpoint off loopback without keys is refused

app.py calls `preflight`, `grpc_options`, `listen` and `WorkerAuth` only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import zmq
import zmq.asyncio
from aiohttp import web
from zmq.auth.asyncio import AsyncioAuthenticator

from batchd.protos import keys
from batchd.protos.model_config import ConfigError
from batchd.server.auth import TokenAuth, Tokens, load_tokens
from batchd.server.config import INT_MAX, STREAM_HEADROOM, Connections, Security, ServerConfig

log = logging.getLogger("batchd.server")


def _ms(s: float, zero: int) -> int:
    """Seconds (at most config.GRPC_S) as gRPC's milliseconds; 0 as `zero`."""
    return zero if s == 0 else max(1, round(s * 1000))


def connection_options(c: Connections) -> list[tuple[str, int]]:
    """gRPC's server options for the connection settings. Each takes 0 for "no limit",
    which gRPC says as INT_MAX ms ("never"): its own 0 means at once (its handshake and
    keepalive time: 1 ms). The ping interval a client may use is the one whose gRPC 0
    is "no limit"; INT_MAX there would forbid pings."""
    never = [
        ("grpc.server_handshake_timeout_ms", c.handshake_timeout_s),
        ("grpc.max_connection_idle_ms", c.max_idle_s),
        ("grpc.max_connection_age_ms", c.max_age_s),
        ("grpc.max_connection_age_grace_ms", c.max_age_grace_s),
        ("grpc.keepalive_time_ms", c.keepalive_time_s),
        ("grpc.keepalive_timeout_ms", c.keepalive_timeout_s),
        # The ping's own deadline: without it keepalive_timeout is not what closes
        # a dead peer, grpc's 60 s ping timeout is.
        ("grpc.http2.ping_timeout_ms", c.keepalive_timeout_s),
    ]
    return [(name, _ms(s, INT_MAX)) for name, s in never] + [
        # Clients (and balancers) may keep idle connections alive with pings this often.
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(c.keepalive_permit_s, 0)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.server.max_pending_requests", c.max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", 2 * c.max_pending_calls),
        # HTTP/2's own limit, a little above batchd's: a gRPC client queues its calls
        # beyond it itself, so one connection holds at most this many places in the
        # server-wide backlog above (another connection's call waits behind those,
        # not behind thousands), while the servicer still answers a call over
        # --max-concurrent-streams with RESOURCE_EXHAUSTED (calls.py).
        ("grpc.max_concurrent_streams", c.max_concurrent_streams + STREAM_HEADROOM),
        # Count a stream the client has reset as closed: else a client that cancels
        # calls gets REFUSED_STREAM (UNAVAILABLE) for new ones.
        ("grpc.http.overload_protection", 0),
    ]


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror}") from e


def _credentials(cfg: Security) -> grpc.ServerCredentials | None:
    if cfg.tls_cert is None or cfg.tls_key is None:  # ServerConfig.check: both or neither
        return None
    pair = (_read(cfg.tls_key, "TLS key"), _read(cfg.tls_cert, "TLS certificate"))
    ca = None if cfg.tls_client_ca is None else _read(cfg.tls_client_ca, "client CA")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


def _load(what: str, load: Callable[[], object]) -> None:
    try:
        load()
    except ssl.SSLError as e:  # "[X509: KEY_VALUES_MISMATCH] key values mismatch (_ssl.c:3926)"
        raise ConfigError(f"{what}: not usable for TLS: {str(e).split(' (_ssl.c:')[0]}") from e
    except OSError as e:
        raise ConfigError(f"{what}: cannot read it: {e.strerror}") from e


def ssl_context(cfg: Security) -> ssl.SSLContext | None:
    """The HTTP port's TLS, from the same files as gRPC's (mutual when --tls-client-ca).
    Also preflight's check of those files: gRPC takes any bytes, then cannot bind."""
    cert, key, ca = cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    # The certificates alone first: ssl blames either file of a pair as "PEM lib".
    alone = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _load(f"--tls-cert {cert}", lambda: alone.load_verify_locations(cert))

    def encrypted() -> str:  # (OpenSSL would prompt on a terminal: start-up hung there)
        raise ConfigError(f"--tls-key {key}: it is encrypted, and batchd asks for no "
                          "passphrase: decrypt it (openssl pkey -in KEY -out PLAIN) and let "
                          "only batchd's user read it")  # fmt: skip

    _load(f"--tls-key {key} (the key of --tls-cert)",
          lambda: context.load_cert_chain(cert, key, password=encrypted))  # fmt: skip
    if ca is not None:
        _load(f"--tls-client-ca {ca}", lambda: context.load_verify_locations(ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_options(
    cfg: ServerConfig, tokens: Tokens | None
) -> tuple[list[tuple[str, Any]], list[Any]]:
    """Channel options and interceptors of the gRPC server (`tokens`: --auth-token-file's,
    read once for gRPC and HTTP)."""
    interceptors: list[Any] = [] if tokens is None else [TokenAuth(tokens)]
    return connection_options(cfg.connections), interceptors


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", "0.0.0.0" is an address; interface names: not loopback


def in_url(host: str) -> str:
    """`host` (--host: an IPv6 address bare or in brackets) as an address or URL takes it."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare


def listen(server: grpc.aio.Server, cfg: ServerConfig) -> int:
    """Open the gRPC port, over TLS when configured; warn when it is exposed in the clear."""
    host, security = cfg.network.host, cfg.security
    address = f"{in_url(host)}:{cfg.network.grpc_port}"
    creds = _credentials(security)
    if not _loopback(host):
        if creds is None:
            log.warning(
                "gRPC and HTTP on %s without TLS: requests and tokens cross the network in clear",
                host,
            )
        if security.auth_token_file is None and security.tls_client_ca is None:
            log.warning(
                "gRPC and HTTP on %s without --auth-token-file: anyone who reaches them may call "
                "them",
                host,
            )
        if cfg.network.metrics_port >= 0:  # (TLS and tokens guard gRPC and HTTP only)
            log.warning(
                "/metrics on %s (--metrics-port %d) is in clear and open to anyone who reaches "
                "it: keep that network trusted, or --metrics-port -1", host,
                cfg.network.metrics_port,
            )  # fmt: skip
    # Asked first (gRPC logs a line of its own), but by a child frontend: its port is shared
    why = None if cfg.frontends.index else taken(host, cfg.network.grpc_port)
    try:  # grpc raises RuntimeError (older versions returned 0), saying only "failed"
        port = 0 if why else server.add_insecure_port(address) if creds is None else (
            server.add_secure_port(address, creds))  # fmt: skip
    except RuntimeError:
        port = 0
    if not port:
        why = why or taken(host, cfg.network.grpc_port) or "gRPC could not bind it"
        raise ConfigError(f"cannot serve gRPC on {address}: {why} (--grpc-port; 0: a free one)")
    return int(port)


async def stop_listening(
    server: grpc.aio.Server, http: web.AppRunner | None, grace_s: float
) -> asyncio.Task[None]:
    """Once the drain notice is over: GOAWAY to every gRPC connection, and the gRPC and HTTP
    listeners closed, so that a client's next call, its retry of a refusal too, connects
    anew: through a balancer, to another replica (it came back on the same connection for
    the whole drain). Calls under way go on, up to `grace_s` (a later stop may end them
    sooner); HTTP's 503s close their connections (http_site.bounded_send). Returns the
    gRPC stop, to await."""
    goaway = asyncio.create_task(server.stop(grace_s))
    for site in list(http.sites) if http is not None else []:
        await site.stop()  # (its connections stay)
    return goaway


def shared_port(cfg: ServerConfig) -> bool:
    """Whether this process binds its ports with SO_REUSEPORT for frontends to come (frontend
    0 of several): a port another such server holds would then be shared, not refused, and
    the kernel would spread the callers over two servers. taken() asks first."""
    return cfg.frontends.count > 1 and cfg.frontends.index == 0


def taken(host: str, port: int) -> str | None:
    """Why `port` cannot be bound, as the OS says (gRPC says only that it failed); None if
    it can. Port 0 can."""
    try:
        family, kind, _, _, where = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            probe.bind(where)
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_worker_endpoint(endpoint: str, worker_keys: Path | None) -> None:
    """Refuse a tcp:// worker endpoint off loopback without CURVE keys: whoever connects
    there could register as a worker and read every batch. On loopback, or an abstract
    ipc://@NAME socket (no file, so no permissions), warn that any local process may."""
    if endpoint.startswith("ipc://@") and worker_keys is None:
        log.warning("worker endpoint %s has no --worker-keys, and an abstract socket has no "
                    "permissions: any local process may join", endpoint[:80])  # fmt: skip
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if port != "*" and not (port.isdigit() and int(port) <= 65535):  # (ZeroMQ wraps 99999)
        raise ConfigError(f"--worker-endpoint {endpoint[:80]}: a tcp:// endpoint ends in a "
                          f"port from 0 to 65535 (or *), got {port[:20]!r}")  # fmt: skip
    if worker_keys is not None:
        return
    if not _loopback(host):
        raise ConfigError(
            f"--worker-endpoint {endpoint} is reachable from other hosts, and without "
            "--worker-keys any peer could register as a worker; generate keys with "
            "`batchd keys generate DIR` and pass --worker-keys DIR (or bind to 127.0.0.1)"
        )
    log.warning("worker endpoint %s has no --worker-keys: any local process may join", endpoint)


def preflight(cfg: ServerConfig) -> WorkerAuth | None:
    """Check every security setting before anything starts: a bad file or a refused
    endpoint stops start-up with a ConfigError. Returns the worker authentication to start."""
    security, net = cfg.security, cfg.network
    given = [("--grpc-port", net.grpc_port), ("--http-port", net.http_port),
             ("--metrics-port", net.metrics_port)]  # fmt: skip
    for i, (flag, port) in enumerate(given):  # (refused as "in use", that said nothing of it;
        for other, same in given[i + 1 :]:  # with --frontends N, the kernel would spread one
            if port > 0 and same == port:  # port's calls over two servers of it)
                raise ConfigError(f"{flag} and {other} both take port {port}: give each "
                                  "its own (0 picks a free one)")  # fmt: skip
    _credentials(security)
    ssl_context(security)
    key_dir = security.worker_keys
    secrets = [] if key_dir is None else [key_dir / f"{n}.key_secret" for n in keys.PAIRS]
    if security.auth_token_file is not None:
        if cfg.frontends.index == 0:  # (a child holds frontend 0's: frontends.at_start)
            load_tokens(security.auth_token_file)
        secrets.append(security.auth_token_file)
    if cfg.frontends.index == 0:  # (said once, not by each of --frontends N)
        keys.warn_loose(log, *secrets)  # (a missing key secret fails at WorkerAuth, naming it)
        if key_dir is not None:
            keys.warn_writable(log, key_dir)
    check_worker_endpoint(cfg.workers.endpoint or "", security.worker_keys)
    if key_dir is not None and cfg.workers.local:  # each would exit, again and again
        try:
            keys.load_pair(key_dir, keys.WORKER)
        except ConfigError as e:
            raise ConfigError(f"{e}: the local workers use --worker-keys DIR's worker pair "
                              "(or start none: --no-local-workers)") from None  # fmt: skip
    return None if key_dir is None else WorkerAuth(key_dir)


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
