"""The server's configuration: nested frozen dataclasses, the one source of every
default. Each setting that is a flag says so on its field (`setting`), and the
`batchd serve` command line is built from these fields (`add_arguments`,
`from_arguments`); `ServerConfig.check` validates the whole, in one place: each
value in its field's `bounds`, then the rules that span fields.

    ServerConfig    model_repository, drain_timeout_s
    ├── network     host, ports, message size
    ├── workers     how many, where, threads, credits, remote endpoint
    ├── models      model control
    ├── frontends   --frontends N
    ├── logging     level, format
    ├── security    TLS, tokens, CURVE keys (security.py puts them to work)
    ├── limits      what one request may carry (codec.py checks them)
    ├── jobs        batch jobs: where they are kept, how many, how long
    └── connections what one client connection may hold (security.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchd.protos.model_config import ConfigError

MiB = 1024 * 1024
INT_MAX = 2**31 - 1  # gRPC takes its options as C ints: sizes, counts, milliseconds
GRPC_S = INT_MAX / 1000  # the longest duration gRPC takes (INT_MAX ms: it reads "never")
STREAM_HEADROOM = 64  # HTTP/2 streams a connection may open beyond --max-concurrent-streams


def setting(default: Any, flag: str, help: str, **argparse_kw: Any) -> Any:
    """A field that is also a `batchd serve` flag; `help` gets the default added.
    `bounds=(lo, hi, what it takes)`: ServerConfig.check refuses a value outside."""
    meta = {"flag": flag, "help": help, **argparse_kw}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type) -> Any:
    return field(default_factory=cls, metadata={"section": cls})


def positive(hi: float = math.inf) -> dict[str, Any]:
    """The keywords of a setting taking an integer from 1 to `hi`."""
    what = "a positive integer" if hi == math.inf else f"an integer from 1 to {hi}"
    return {"type": int, "bounds": (1, hi, what)}


def port(off: bool) -> dict[str, Any]:
    """The keywords of a port setting: 0 picks a free one; with `off`, -1 turns it off."""
    what = "a port from 0 to 65535 (0: a free one)" + (", or -1 (off)" if off else "")
    return {"type": int, "bounds": (-1 if off else 0, 65535, what)}


def duration(default: float, flag: str, help: str) -> Any:
    """A setting in seconds, from 0 to GRPC_S (gRPC's longest; every one, alike)."""
    what = f"seconds from 0 to {GRPC_S}"
    return setting(default, flag, help, type=float, metavar="S", bounds=(0, GRPC_S, what))


@dataclass(frozen=True)
class Network:
    """network"""

    host: str = setting("127.0.0.1", "--host", "address to listen on (0.0.0.0 exposes it)")
    grpc_port: int = setting(8001, "--grpc-port", "gRPC port; 0 picks a free one", **port(False))
    http_port: int = setting(
        8000, "--http-port", "KServe v2 REST port, served by the same process; 0: a free one; "
        "-1: off", **port(True),
    )  # fmt: skip
    metrics_port: int = setting(
        8002, "--metrics-port", "Prometheus /metrics port on --host; 0: a free one; -1: off",
        **port(True),
    )  # fmt: skip
    max_message_bytes: int = setting(64 * MiB, "--max-message-bytes",
        "largest gRPC message accepted or sent", **positive(INT_MAX))  # fmt: skip


@dataclass(frozen=True)
class Workers:
    """workers"""

    count: int | None = setting(None, "--workers", "run N CPU worker processes (instead of "
                                "--devices)", **positive(), metavar="N")  # fmt: skip
    devices: str = setting("auto", "--devices", "auto (every visible GPU, else one CPU worker) "
                           "or a list: cuda:0,cuda:1")  # fmt: skip
    threads: int | None = setting(
        None, "--threads-per-worker", "torch threads per CPU worker (none: cores / workers)",
        **positive(),
    )  # fmt: skip
    credits: int | None = setting(
        None, "--credits-per-worker", "batches a worker holds at once: one running, the rest "
        "staged (none: 1 on a CPU, where every batch then forms from the whole queue; 2 on a "
        "GPU, which then never waits for its next batch)", **positive(),
    )  # fmt: skip
    endpoint: str | None = setting(
        None, "--worker-endpoint", "ZeroMQ endpoint workers connect to (none: a private "
        "ipc:// socket; tcp://0.0.0.0:5555 lets `batchd worker` join from other hosts)",
    )  # fmt: skip
    local: bool = setting(True, "--no-local-workers", "start no workers; wait for `batchd "
                          "worker --connect`", action="store_false")  # fmt: skip

    def device_list(self) -> list[str]:
        if self.count is not None:
            return ["cpu"] * self.count
        if self.devices == "auto":
            return _visible_gpus() or ["cpu"]
        listed = [d.strip() for d in self.devices.split(",") if d.strip()]
        # (a worker restarted forever on "gpu0"; on "cuda:0" here, every call failed)
        gpus = _visible_gpus() if set(listed) - {"cpu"} else []
        if unknown := [d for d in listed if d not in ("cpu", *gpus, *("cuda",) * bool(gpus))]:
            raise ConfigError(f"--devices: {unknown[0][:40]!r} is not a device of this host; it "
                              f"has {', '.join(['cpu', *gpus])}")  # fmt: skip
        return listed


@functools.cache
def _visible_gpus() -> list[str]:
    """Asked of a worker interpreter: the frontend never imports torch."""
    out = subprocess.run([sys.executable, "-m", "batchd.worker", "--list-devices"], check=True,
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    return [str(d) for d in json.loads(out)]


@dataclass(frozen=True)
class Models:
    """model control"""

    control: str = setting(
        "none", "--model-control", "none: serve every model of the repository, no "
        "load/unload RPCs; explicit: start with the --load-model ones, RepositoryModelLoad/"
        "Unload allowed", choices=["none", "explicit"],
    )  # fmt: skip
    load: tuple[str, ...] = setting(
        (), "--load-model", "with --model-control explicit: load NAME at start (repeatable; "
        "'*': all)", action="append", metavar="NAME",
    )  # fmt: skip
    load_timeout_s: float = duration(
        600.0, "--load-timeout", "a worker in a model's load() for S s is restarted")  # fmt: skip

    @property
    def explicit(self) -> bool:
        return self.control == "explicit"


@dataclass(frozen=True)
class Frontends:
    """frontends"""

    count: int = setting(1, "--frontends", "gRPC frontend processes sharing the port "
        "(SO_REUSEPORT) in front of the same workers, for when one event loop is the ceiling",
        **positive(256), metavar="N")  # fmt: skip  # (256: a worker's frames name one in a byte)
    hung_s: float = setting(10.0, "--frontend-timeout", "a frontend answering no heartbeat "
        "for S seconds is hung: frontend 0 restarts another; the others say not live while "
        "0 is", type=float, metavar="S", bounds=(1, 3600, "seconds from 1 to 3600"))  # fmt: skip
    index: int = setting(0, "--frontend-index", argparse.SUPPRESS, type=int)
    argv: tuple[str, ...] = ()  # the serve arguments, for starting frontends 1..N-1


@dataclass(frozen=True)
class Logging:
    """logging"""

    level: str = setting("INFO", "--log-level", "log level",
                         choices=["DEBUG", "INFO", "WARNING", "ERROR"])  # fmt: skip
    format: str = setting("text", "--log-format", "text, or one JSON object per line with "
        "model/worker/batch fields", choices=["text", "json"])  # fmt: skip


@dataclass(frozen=True)
class Security:
    """security (see README, Security)"""

    tls_cert: Path | None = setting(
        None, "--tls-cert", "PEM certificate (chain): serve gRPC over TLS", type=Path
    )
    tls_key: Path | None = setting(None, "--tls-key", "PEM private key of --tls-cert", type=Path)
    tls_client_ca: Path | None = setting(
        None, "--tls-client-ca", "PEM CA: require client certificates it signed (mTLS)",
        type=Path)  # fmt: skip
    auth_token_file: Path | None = setting(
        None, "--auth-token-file", "require bearer tokens: lines 'infer: <token>' / "
        "'admin: <token>'", type=Path)  # fmt: skip
    worker_keys: Path | None = setting(
        None, "--worker-keys", "CURVE keys from `batchd keys generate DIR`: only authorized "
        "workers may join", type=Path, metavar="DIR")  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """limits of one request, checked from its header before its tensors are read"""

    max_inputs: int = setting(128, "--max-inputs-per-request", "inputs per request", **positive())
    max_tensor_elements: int = setting(64 * MiB, "--max-tensor-elements",
                                       "elements per input tensor", **positive())  # fmt: skip
    max_response_bytes: int = 64 * MiB  # the server sets it to --max-message-bytes


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "batchd" / "jobs"


@dataclass(frozen=True)
class Jobs:
    """batch jobs"""

    directory: Path = setting(
        _state_dir(), "--jobs-dir", "where jobs, their inputs and results are kept (one "
        "server per directory); with --jobs-db, where uploads and inputs are spooled", type=Path,
    )  # fmt: skip
    database: str | None = setting(
        None, "--jobs-db", "postgresql://USER@HOST/DB (a password from PGPASSWORD or ~/.pgpass): "
        "jobs kept there, shared by every replica naming it; unset: SQLite in --jobs-dir",
        metavar="URL",
    )  # fmt: skip
    lease_s: float = duration(
        15.0, "--jobs-lease", "with --jobs-db: how long a job stays with a replica that stopped "
        "renewing its claim (killed, cut off) before another takes it over")  # fmt: skip
    retention_hours: float = setting(168.0, "--jobs-retention-hours", "remove a job this long "
        "after it ended", type=float, bounds=(0, math.inf, "finite hours >= 0"))  # fmt: skip
    max_file_bytes: int = setting(
        1024 * MiB, "--jobs-max-file-bytes", "largest job file accepted", **positive())  # fmt: skip
    max_open: int = setting(64, "--jobs-max-open", "jobs validating, queued or running at once",
                            **positive())  # fmt: skip
    max_kept: int = setting(10_000, "--jobs-max-kept", "ended jobs kept per token (no tokens: "
        "in all); a submission removes its oldest past it", **positive(INT_MAX))  # fmt: skip
    # An upload holds a --jobs-max-open place: one that dripped could hold it for ever.
    min_upload_rate: int = setting(
        64 * 1024, "--jobs-min-upload-rate", "end an upload that falls behind B bytes per second "
        "once its --jobs-upload-grace is over, freeing its --jobs-max-open place; 0: off",
        type=int, metavar="B", bounds=(0, INT_MAX, "bytes per second from 0 (off) to 2147483647"),
    )  # fmt: skip
    upload_grace_s: float = duration(
        20.0, "--jobs-upload-grace", "an upload's head start on --jobs-min-upload-rate: by T s "
        "after it began it must have sent (T - S) x the rate")  # fmt: skip


@dataclass(frozen=True)
class Connections:
    """client connections: what one may hold, and how long idle (a duration of 0: no limit)"""

    max_concurrent_streams: int = setting(1024, "--max-concurrent-streams",
        "open RPCs per client connection", **positive(INT_MAX - STREAM_HEADROOM))  # fmt: skip
    # Calls that have arrived but that the event loop has not taken yet, per process.
    # gRPC sheds that backlog itself, answering CANCELLED (its own word, not ours):
    # at random above this many, all of them above twice as many. Its default, 1000,
    # shed calls of well-behaved clients whenever the loop fell behind a burst.
    max_pending_calls: int = setting(
        16384, "--max-pending-calls", "calls arrived but not yet taken, per frontend process "
        "(all its connections), before gRPC sheds them with CANCELLED",
        **positive(INT_MAX // 2), metavar="N",
    )  # fmt: skip
    handshake_timeout_s: float = duration(
        20.0, "--handshake-timeout", "close a connection not set up (HTTP/2 preface, TLS) "
        "within S seconds")  # fmt: skip
    max_idle_s: float = duration(300.0, "--max-connection-idle",
                                 "GOAWAY to a connection with no RPC for S seconds")  # fmt: skip
    max_age_s: float = duration(
        300.0, "--max-connection-age", "GOAWAY to a connection S seconds old (gRPC adds +-10%% "
        "jitter): its client reconnects, so load spreads onto replicas started since")  # fmt: skip
    max_age_grace_s: float = duration(
        120.0, "--max-connection-age-grace", "then S more seconds for its open calls before "
        "it closes")  # fmt: skip
    keepalive_permit_s: float = duration(
        10.0, "--keepalive-permit-time", "the shortest keepalive ping interval a client may "
        "use (more often: GOAWAY too_many_pings)")  # fmt: skip
    keepalive_time_s: float = duration(
        60.0, "--keepalive-time", "ping a connection silent for S seconds")  # fmt: skip
    keepalive_timeout_s: float = duration(20.0, "--keepalive-timeout",
        "close it if the ping is not answered within S seconds")  # fmt: skip


@dataclass(frozen=True)
class Tracing:
    """OpenTelemetry traces, off unless an endpoint is given here or in OTEL_EXPORTER_OTLP_*"""

    otlp_endpoint: str | None = setting(
        None, "--otlp-endpoint", "export traces by OTLP/gRPC to this collector, e.g. "
        "http://127.0.0.1:4317 (also: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; sampling: "
        "OTEL_TRACES_SAMPLER)", metavar="URL",
    )  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    model_repository: Path = setting(
        dataclasses.MISSING, "--model-repository", "directory holding <model>/model.toml",
        type=Path, required=True,
    )  # fmt: skip
    drain_timeout_s: float = duration(30.0, "--drain-timeout",
                                      "seconds to finish admitted requests on SIGTERM")  # fmt: skip
    drain_notice_s: float = duration(3.0, "--drain-notice", "on SIGTERM, first S seconds (of "
        "--drain-timeout) still serving new requests while health and readiness say not "
        "ready, so balancers stop sending first (SIGINT: none; one during it ends it)")  # fmt: skip
    network: Network = section(Network)
    workers: Workers = section(Workers)
    models: Models = section(Models)
    frontends: Frontends = section(Frontends)
    logging: Logging = section(Logging)
    security: Security = section(Security)
    limits: Limits = section(Limits)
    connections: Connections = section(Connections)
    jobs: Jobs = section(Jobs)
    tracing: Tracing = section(Tracing)

    def check(self) -> None:
        """Each setting in its bounds, then each rule across settings; ConfigError if not."""
        for path, leaf in _leaves(ServerConfig):
            lo, hi, what = leaf.metadata.get("bounds", (0, 0, ""))
            value: Any = functools.reduce(getattr, path.split("."), self)
            if what and value is not None and (not lo <= value <= hi or value == math.inf):
                raise ConfigError(f"{leaf.metadata['flag']} takes {what}, got {value}")
        w, m, f, s = self.workers, self.models, self.frontends, self.security
        if w.count is not None and w.devices != "auto":
            raise ConfigError("--workers and --devices exclude each other: give one")
        if w.local and w.devices != "auto" and not w.device_list():  # e.g. "," or ""
            raise ConfigError(f"--devices takes a list such as cpu or cuda:0,cuda:1, got "
                              f"{w.devices[:40]!r} (no workers: --no-local-workers)")  # fmt: skip
        if m.load and not m.explicit:
            raise ConfigError("--load-model needs --model-control explicit")
        if (s.tls_cert is None) != (s.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if s.tls_client_ca is not None and s.tls_cert is None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        if (db := self.jobs.database) and not db.startswith(("postgresql://", "postgres://")):
            scheme = db.split("://")[0][:20] if "://" in db else "none"  # never a password
            raise ConfigError(f"--jobs-db takes a PostgreSQL URL, got one with scheme {scheme!r}")
        if db and self.jobs.lease_s < 1:
            raise ConfigError(f"--jobs-lease must be at least 1 s, got {self.jobs.lease_s}")
        if f.count > 1 and not f.index:
            clash = (
                "--model-control explicit (each frontend would load its own versions)" if m.explicit
                else "--worker-endpoint (frontends use private ipc:// endpoints)" if w.endpoint
                else "--no-local-workers (the first frontend starts the workers)" if not w.local
                else None
            )  # fmt: skip
            if clash:
                raise ConfigError(f"--frontends {f.count} does not work with {clash}")


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any]]]:
    found = []
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            found += _leaves(f.metadata["section"], f"{prefix}{f.name}.")
        elif "flag" in f.metadata:
            found.append((prefix + f.name, f))
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per setting of ServerConfig, grouped by section."""
    groups: dict[str, Any] = {}
    for path, f in _leaves(ServerConfig):
        owner = path.rpartition(".")[0]
        if owner and owner not in groups:
            cls = ServerConfig.__dataclass_fields__[owner].metadata["section"]
            groups[owner] = parser.add_argument_group((cls.__doc__ or owner).strip())
        target = groups.get(owner, parser)
        kw = {k: v for k, v in f.metadata.items() if k not in ("flag", "help", "bounds")}
        text = f.metadata["help"]
        shown = f.default not in (dataclasses.MISSING, None, ())
        if shown and text is not argparse.SUPPRESS and kw.get("action") != "store_false":
            text = f"{text} (default {f.default})"
        if "action" not in kw and "choices" not in kw:
            kw.setdefault("metavar", f.metadata["flag"].lstrip("-").upper().replace("-", "_"))
        default = f.default if f.default is not dataclasses.MISSING else None
        default = None if kw.get("action") == "append" else default
        target.add_argument(f.metadata["flag"], dest=path, default=default, help=text, **kw)


def from_arguments(args: argparse.Namespace, argv: tuple[str, ...] = ()) -> ServerConfig:
    """The ServerConfig the parsed `batchd serve` arguments describe (not yet checked)."""
    values = vars(args)

    def build(cls: type, prefix: str) -> Any:
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if "section" in f.metadata:
                kw[f.name] = build(f.metadata["section"], f"{prefix}{f.name}.")
            elif "flag" in f.metadata:
                value = values.get(prefix + f.name)
                kw[f.name] = tuple(value or ()) if f.metadata.get("action") == "append" else value
        return cls(**kw)

    cfg: ServerConfig = build(ServerConfig, "")
    return dataclasses.replace(cfg, frontends=dataclasses.replace(cfg.frontends, argv=argv))
