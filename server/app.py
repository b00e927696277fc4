"""The composition root: build the pieces, run them, stop them.

    gRPC servicer (service.py) --submit / load / unload--> Core (core.py)
    health, metrics ------------------- read ------------> Core
    Core: Scheduler (batching/), WorkerPool, WorkerLink <--ZeroMQ--> workers,
          ModelControl, Supervisor (their processes)

Holds no logic of its own beyond start-up and shutdown order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import zmq
import zmq.asyncio
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from batchd.protos import inference_pb2, jobs_pb2, traces
from batchd.protos._pool import POOL, slow_backend
from batchd.protos.model_config import ConfigError, ModelConfig
from batchd.server import frontends, link, private, security, siblings
from batchd.server.auth import Tokens, load_tokens
from batchd.server.config import Limits, ServerConfig
from batchd.server.core import Core
from batchd.server.errors import Unavailable
from batchd.server.exposition import Source
from batchd.server.frontends import Children, Models, at_start, bind, endpoints, watch_parent
from batchd.server.handlers import add_service
from batchd.server.health import Health, liveness, track_health
from batchd.server.http_serve import serve_rest
from batchd.server.jobs.database import safe_url
from batchd.server.jobs.postgres import PostgresStore
from batchd.server.jobs.runner import Jobs
from batchd.server.jobs.service import JobsService
from batchd.server.jobs.sqlite import SqliteStore
from batchd.server.jobs.store import InUse, Store
from batchd.server.loopload import LoopLoad
from batchd.server.metrics import Collector, start_metrics, worker_views
from batchd.server.rest import RestApi
from batchd.server.security import grpc_options, in_url, listen, preflight, ssl_context
from batchd.server.service import InferenceService
from batchd.server.signals import STOPS, Signals, on_signals
from batchd.server.stats import Stats
from batchd.server.supervisor import Launch, plan_workers

log = logging.getLogger("batchd.server")


def _grpc_server(
    cfg: ServerConfig, service: InferenceService, health: HealthServicer,
    jobs: JobsService | None = None, tokens: Tokens | None = None,
) -> tuple[grpc.aio.Server, int]:  # fmt: skip
    most = cfg.network.max_message_bytes
    options = [("grpc.max_receive_message_length", most), ("grpc.max_send_message_length", most),
               ("grpc.so_reuseport", int(cfg.frontends.count > 1))]  # fmt: skip
    more_options, interceptors = grpc_options(cfg, tokens)
    server = grpc.aio.server(options=options + more_options, interceptors=interceptors)
    inference = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    jobs_service = jobs_pb2.DESCRIPTOR.services_by_name["Jobs"]
    add_service(server, service, inference)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    add_service(server, jobs or JobsService(None, "not set up"), jobs_service)
    with contextlib.suppress(TypeError):  # already there when serve() runs twice in one process
        POOL.AddSerializedFile(health_pb2.DESCRIPTOR.serialized_pb)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    names = (inference.full_name, health_name, jobs_service.full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=POOL)
    return server, listen(server, cfg)


@dataclass
class _Parts:
    """Everything serve() starts and later stops."""

    core: Core
    service: InferenceService
    health: HealthServicer
    server: grpc.aio.Server
    port: int
    sources: list[Source]  # what /metrics reads (exposition.py)
    jobs: Jobs | None
    rest: RestApi
    http: web.AppRunner | None = None  # serving `rest`, once started
    metrics: asyncio.Server | None = None  # serving /metrics, once started
    internal: list[asyncio.Server] = field(default_factory=list)  # its socket, for the others'
    kept: list[tuple[str, Callable[[], Any], str]] = field(default_factory=list)  # keep_bound's


def _build(
    cfg: ServerConfig,
    models: Models,  # the repository's at start, and their files
    tokens: Tokens | None,  # --auth-token-file's, as frontend 0 read them at start
    router: zmq.asyncio.Socket,
    endpoint: str,  # what workers connect to: every frontend's endpoint, comma-separated
) -> _Parts:
    (repository, files), specs, w = models, [], cfg.workers
    if w.local and (repository or cfg.models.explicit):
        specs = plan_workers(list(repository.values()), w.device_list(), w.threads)
    launch = Launch(
        cfg.model_repository, tuple(specs), endpoint, cfg.logging.level, cfg.logging.format,
        cfg.security.worker_keys, cfg.tracing.otlp_endpoint,
    )  # fmt: skip
    load = LoopLoad.current()
    core = Core(  # (a plain socket for the link: the asyncio one serves CURVE's authenticator)
        zmq.Socket.shadow(router.underlying), Stats(), cfg.model_repository,
        explicit=cfg.models.explicit, launch=launch, credits=w.credits, load=load,
        load_timeout_s=cfg.models.load_timeout_s, max_response_bytes=cfg.network.max_message_bytes,
    )  # fmt: skip
    core.control.start_with(_models_at_start(cfg, repository), files)
    limits = replace(cfg.limits, max_response_bytes=cfg.network.max_message_bytes)
    otlp = traces.endpoint(cfg.tracing.otlp_endpoint)
    service = InferenceService(
        core, limits=limits, calls_per_connection=cfg.connections.max_concurrent_streams,
        tracing=None if otlp is None else traces.Tracing.start("frontend", otlp),
    )  # fmt: skip
    health = Health()
    jobs, off = _jobs(cfg, core, limits)
    jobs_service = JobsService(jobs, off, tokens, cfg.network.max_message_bytes)
    server, port = _grpc_server(cfg, service, health, jobs_service, tokens)
    rest = RestApi(
        service, core, jobs_service, tokens, host=cfg.network.host,
        max_body_bytes=cfg.network.max_message_bytes, connections=cfg.connections,
    )  # fmt: skip
    sources: list[Source] = [] if jobs is None else [jobs]  # (nothing is registered globally)
    sources.append(Collector(
        core.models, core.stats, core.scheduler.pending,
        lambda: worker_views([(s.slot, s.device) for s in core.supervisor.specs],
                             [(w.name, w.info.device) for w in core.pool.workers()]),
        lambda: core.supervisor.restarts, load.busy_seconds, functools.partial(_sequences, core),
        core.scheduler.pending_jobs,
    ))  # fmt: skip
    return _Parts(core, service, health, server, port, sources, jobs, rest)


def _sequences(core: Core, model: str) -> tuple[int, int]:
    """`model`'s sequences in a slot on a worker, and those held there for their callers."""
    mine = [b for w in core.pool.workers() for b in w.sequences.values() if b.model.name == model]
    return len(mine), sum(bool(s and s.paused) for s in (b.requests[0].stream for b in mine))


def _jobs(cfg: ServerConfig, core: Core, limits: Limits) -> tuple[Jobs | None, str]:
    """The jobs of this server, or None and why they are off. The first frontend runs
    them and holds --jobs-dir; the others take jobs in and answer about them."""
    j = cfg.jobs
    first = cfg.frontends.index == 0
    store: Store
    try:
        if j.database:
            spool = j.directory / f"frontend-{cfg.frontends.index}"
            store = PostgresStore(j.database, spool, lease_s=j.lease_s, keep_inputs=first)
            log.info("batch jobs in %s, shared with the replicas that name it",
                     safe_url(j.database))  # fmt: skip
        else:
            if not first and SqliteStore.holder(j.directory) != os.getppid():
                raise InUse(f"{j.directory} is not held by this server's first frontend")
            store = SqliteStore(j.directory, lock=first)
    except (InUse, OSError, sqlite3.Error, Unavailable) as e:
        log.warning("batch jobs are off: %s", e)
        return None, str(e)
    jobs = Jobs(
        store, core, limits, max_file_bytes=j.max_file_bytes, max_open=j.max_open,
        retention_s=j.retention_hours * 3600, min_upload_rate=j.min_upload_rate,
        upload_grace_s=j.upload_grace_s, runs=first, max_kept=j.max_kept,
    )  # fmt: skip
    return jobs, ""


def _models_at_start(
    cfg: ServerConfig, repository: dict[str, ModelConfig]
) -> dict[str, ModelConfig]:
    if not cfg.models.explicit or "*" in cfg.models.load:
        return repository
    if unknown := [n for n in cfg.models.load if n not in repository]:
        raise ConfigError(
            f"--load-model {', '.join(unknown)}: not in {cfg.model_repository} "
            f"(it has: {', '.join(repository) or 'no models'})"
        )
    return {n: repository[n] for n in cfg.models.load}


def _refused(what: str, flag: str, host: str, port: int, e: OSError) -> ConfigError:
    why = os.strerror(e.errno) if e.errno else str(e)  # (an OSError(why): why)
    return ConfigError(f"cannot serve {what} on {host}:{port}: {why} ({flag}; -1 turns it off)")


async def _open_ports(cfg: ServerConfig, p: _Parts, children: Children | None) -> int:
    """Serve /metrics on --metrics-port (and with --frontends N this one's socket for the
    others), then the REST API on --http-port, before gRPC: a port in use stops start-up
    before any request is served. The HTTP port, or -1 when it is off."""
    net = cfg.network
    host, port, metrics = net.host.strip("[]"), net.http_port, net.metrics_port  # (IPv6: bare)
    sockets = children.sockets if children else []  # (--frontends N: each one's, 0 first)
    try:
        if metrics >= 0:
            counts = None if p.jobs is None else p.jobs.count_statuses  # (the jobs store's)
            p.metrics = await start_metrics(p.sources, host, metrics, counts, siblings=sockets[1:])
        if unix := os.environ.get(frontends.SOCKET) or (sockets[0] if sockets else ""):
            own = siblings.answering(p.service.statistics)  # (for the others: theirs they add)
            internal = functools.partial(start_metrics, p.sources, "", -1, unix=unix,
                                         statistics=own)  # fmt: skip
            p.internal.append(await internal())

            async def again() -> None:  # (its file removed: a listener more, see keep_bound)
                p.internal.append(await internal())

            p.kept.append((unix, again, "this frontend's socket for the others"))
            others = siblings.others(unix, cfg.frontends.count)
            p.service.siblings = functools.partial(siblings.statistics, paths=others)
    except OSError as e:
        raise _refused("metrics", "--metrics-port", host, metrics, e) from e
    if port >= 0:
        if security.shared_port(cfg) and (why := security.taken(host, port)):
            raise _refused("HTTP", "--http-port", host, port, OSError(why))
        try:
            p.http, port = await serve_rest(
                p.rest.app, host, port, ssl_context=ssl_context(cfg.security),
                reuse_port=cfg.frontends.count > 1, connections=cfg.connections,
            )  # fmt: skip
        except OSError as e:
            raise _refused("HTTP", "--http-port", host, port, e) from e
        log.info("serving HTTP on %s:%d", in_url(host), port)
    return port


async def _close_ports(p: _Parts) -> None:
    """What _open_ports and the gRPC server opened, after a failed start."""
    await p.server.stop(None)
    if p.http is not None:
        await p.http.cleanup()
    for listening in (p.metrics, *p.internal):
        if listening is not None:
            listening.close()


async def _shutdown(cfg: ServerConfig, p: _Parts, children: Children | None, notice: float,
                    again: asyncio.Event) -> None:  # fmt: skip
    """Say not ready and keep serving for `notice` seconds (balancers stop sending; a SIGINT,
    `again`, ends them at once), then GOAWAY and close the ports, refuse new work,
    drain the admitted, answer leftovers, then stop workers (after the other frontends,
    which need them to drain)."""
    notice = min(notice, cfg.drain_timeout_s)
    log.info("stopping: not ready; serving new requests %.1f s more (--drain-notice), then "
             "draining for up to %.1f s", notice, cfg.drain_timeout_s - notice)  # fmt: skip
    # Readiness and health say so at once, before a jobs database that hangs (track_health:
    # every service NOT_SERVING but LIVENESS); loads and unloads are refused.
    p.service.leaving = p.core.control.closed = True
    p.core.changed.set()
    jobs = asyncio.create_task(p.jobs.stop(cfg.drain_timeout_s, notice)) if p.jobs else None
    sig = signal.SIGTERM if notice else signal.SIGINT  # children: this one's notice (SIGINT: 0)
    others = asyncio.create_task(children.stop(cfg.drain_timeout_s + 10, sig)) if children else None
    began = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(again.wait(), notice)
    if notice and again.is_set():  # (Ctrl-C after a SIGTERM)
        notice = time.monotonic() - began
        log.info("SIGINT: the drain notice ends after %.1f s; draining for up to %.1f s",
                 notice, cfg.drain_timeout_s - notice)  # fmt: skip
        if p.jobs is not None:
            p.jobs.no_uploads()
        if children is not None:
            children.send(signal.SIGINT)  # (theirs end too)
    goaway = await security.stop_listening(p.server, p.http, cfg.drain_timeout_s + 10)
    left = await p.service.drain(cfg.drain_timeout_s - notice)
    if left:
        log.warning("drain timeout: answering %d open request(s) UNAVAILABLE", left)
    if jobs is not None:  # before the queues fail below, which would answer their lines
        await jobs
    p.core.fail_all(Unavailable("the server stopped before this request could finish"))
    await p.server.stop(grace=1.0)
    await goaway
    if p.http is not None:
        await p.http.cleanup()
    if others is not None:
        await others
    if cfg.frontends.index == 0:  # the others share its workers
        p.core.stop_workers()
    await p.core.supervisor.stop()  # (a batch's span ends with its reply, meanwhile)
    for listening in (p.metrics, *p.internal):
        if listening is not None:
            listening.close()
    if p.service.tracing is not None:  # export the spans left
        await asyncio.to_thread(p.service.tracing.shutdown)
    log.info("answered %d inference request(s)", p.core.stats.answered_total())


async def _run(cfg: ServerConfig, p: _Parts, children: Children | None, endpoint: str,
               signals: Signals) -> None:  # fmt: skip
    """Open the ports, HTTP and metrics first (one in use stops start-up before anything
    serves, nor any worker starts), serve until SIGINT/SIGTERM, then drain and stop."""
    got, stop, again = signals
    try:
        http_port = await _open_ports(cfg, p, children)
        await p.server.start()
    except BaseException:
        await _close_ports(p)
        raise
    # Everything built so far (modules, configs, grpc's and protobuf's objects) lives
    # as long as the process: out of the collector's sight, a full collection walks
    # only what requests create. Measured under load: 15 full collections in 35 s,
    # up to 22 ms each (a stall every caller sees); frozen, ~1.3 ms each.
    gc.collect()
    gc.freeze()
    fronts = cfg.frontends
    which = f"; frontend {fronts.index} of {fronts.count}" if fronts.count > 1 else ""
    local = len(p.core.supervisor.specs)
    log.info("serving gRPC on %s:%d; workers connect to %s; %d local worker(s)%s",
             in_url(cfg.network.host), p.port, endpoint, local, which)  # fmt: skip
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(p.core.run(), name="core"),
            tg.create_task(track_health(p.health, p.service, p.core), name="health"),
        ]
        bound = [tg.create_task(private.keep_bound(*k), name=k[2]) for k in p.kept]
        if children is not None:
            tasks.append(tg.create_task(children.run(p.port, http_port), name="frontends"))
        if p.jobs is not None:
            tasks.append(tg.create_task(p.jobs.run(), name="jobs"))
        if fronts.index:
            live = liveness(p.service, p.core.changed)
            orphaned = watch_parent(stop, p.core.pool.workers, p.core.fail_all, live,
                                    fronts.hung_s)  # fmt: skip
            tasks.append(tg.create_task(orphaned, name="parent"))
        await stop.wait()
        for t in bound:  # (its listeners close: on Python 3.13, unlinking their sockets)
            t.cancel()
        notice = cfg.drain_notice_s if got[:1] == [signal.SIGTERM] else 0.0  # (the first)
        await _shutdown(cfg, p, children, notice, again)
        for t in tasks:
            t.cancel()


async def serve(cfg: ServerConfig) -> None:
    """Run until SIGINT/SIGTERM (or cancellation), then drain and stop. The signals are
    ours from the start: a SIGTERM as the ports opened ended it, undrained (58c)."""
    signals = on_signals()
    file, child = cfg.security.auth_token_file, cfg.frontends.index > 0
    read_tokens = lambda: None if file is None else load_tokens(file)  # noqa: E731
    models, tokens = at_start(cfg.model_repository, child, read_tokens, cfg.models)  # (child: 0's)
    log.info("model repository %s: %s%s", cfg.model_repository, ", ".join(models[0])
             or "no models", "; model control explicit" if cfg.models.explicit else "")  # fmt: skip
    if (slow := slow_backend()) is not None:
        log.warning("%s", slow)
    cfg.check()
    worker_auth = preflight(cfg)
    fronts = cfg.frontends
    private = tempfile.TemporaryDirectory(prefix="batchd-") if fronts.index == 0 else None
    with private or contextlib.nullcontext() as tmp:  # (frontend 0's: a child's was left)
        every = endpoints(tmp, fronts.count) if tmp is not None else []
        endpoint = cfg.workers.endpoint or every[0]
        children = (
            Children(fronts.argv, every, (models, tokens), tmp, fronts.hung_s)
            if tmp and len(every) > 1
            else None
        )
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        for option, value in link.ROUTER_OPTIONS:
            router.setsockopt(option, value)
        p: _Parts | None = None
        try:
            if worker_auth is not None:
                worker_auth.start(ctx, router)
            bind(router, endpoint, given=bool(cfg.workers.endpoint) and not fronts.index)
            if every and cfg.workers.endpoint:  # local workers join where it listens too
                every[0] = router.get_string(zmq.LAST_ENDPOINT)
            p = _build(cfg, models, tokens, router, ",".join(every) or endpoint)
            if (bound := router.get_string(zmq.LAST_ENDPOINT)).startswith("ipc://"):
                rebind = functools.partial(router.bind, bound)
                p.kept.append((bound.removeprefix("ipc://"), rebind, "the workers' socket"))
            await _run(cfg, p, children, bound, signals)
        finally:
            for sig in STOPS:  # (a stop is under way: one more
                asyncio.get_running_loop().remove_signal_handler(sig)  # as it ends, killed
                signal.signal(sig, signal.SIG_IGN)  # it, -15, with what was left undone)
            if worker_auth is not None:
                worker_auth.stop()
            router.close(linger=0)
            ctx.term()
            if p is not None and p.jobs is not None:
                p.jobs.store.close()
            log.info("stopped (pid %d)", os.getpid())
