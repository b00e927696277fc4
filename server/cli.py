"""The `batchd` command: `batchd serve ...` and `batchd worker ...`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from batchd.protos import keys
from batchd.protos.logs import setup_logging
from batchd.protos.model_config import ConfigError, load_repository
from batchd.server import __version__, security
from batchd.server.app import ServerConfig, serve
from batchd.server.loopload import new_loop


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve a model repository over gRPC")
    p.add_argument(
        "--model-repository", type=Path, required=True, help="directory holding <model>/model.toml"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it)",
    )
    p.add_argument("--grpc-port", type=int, default=8001, help="default 8001; 0 picks a free one")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N", help="run N CPU worker processes")
    where.add_argument(
        "--devices",
        default="auto",
        help="auto (every visible GPU, else one CPU worker) or a list: cuda:0,cuda:1",
    )
    p.add_argument(
        "--threads-per-worker",
        type=int,
        help="torch threads per CPU worker (default: cores / workers)",
    )
    p.add_argument(
        "--credits-per-worker",
        type=int,
        help="batches a worker holds at once: one running, the rest staged (default: 1 on "
        "a CPU, where every batch then forms from the whole queue; 2 on a GPU, which "
        "then never waits for its next batch)",
    )
    p.add_argument(
        "--worker-endpoint",
        help="ZeroMQ endpoint workers connect to (default a private ipc:// socket; "
        "tcp://0.0.0.0:5555 lets `batchd worker` join from other hosts)",
    )
    p.add_argument(
        "--no-local-workers",
        action="store_true",
        help="start no workers; wait for `batchd worker --connect`",
    )
    p.add_argument(
        "--frontends",
        type=int,
        default=1,
        metavar="N",
        help="gRPC frontend processes sharing the port (SO_REUSEPORT) in front of the same "
        "workers, for when one event loop is the ceiling (default 1)",
    )
    p.add_argument("--frontend-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--model-control",
        default="none",
        choices=["none", "explicit"],
        help="none: serve every model of the repository, no load/unload RPCs (default); "
        "explicit: start with the --load-model ones, RepositoryModelLoad/Unload allowed",
    )
    p.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="with --model-control explicit: load NAME at start (repeatable; '*': all)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest gRPC message accepted or sent (default 64 MiB)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to finish admitted requests on SIGTERM (default 30)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8002,
        help="Prometheus /metrics port on --host (default 8002; 0 picks a free one; -1: off)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text, or one JSON object per line with model/worker/batch fields",
    )
    security.add_arguments(p)


def _keys_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("keys", help="CURVE keys for workers on other hosts")
    verbs = p.add_subparsers(dest="verb", required=True)
    gen = verbs.add_parser("generate", help="write a server and a worker key pair into DIR")
    gen.add_argument("directory", type=Path, metavar="DIR")


def _generate_keys(directory: Path) -> int:
    try:
        written = keys.generate(directory)
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in written))
    print(
        "frontend: batchd serve --worker-keys DIR ...; worker hosts need worker.key, "
        "worker.key_secret and server.key (never server.key_secret)"
    )
    return 0


def _models(directory: Path, check: bool) -> int:
    if check:  # loading models needs torch: the worker's interpreter does it
        os.execv(sys.executable, [sys.executable, "-m", "batchd.worker", "--check", str(directory)])
    try:
        models = load_repository(directory)
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    for cfg in models.values():
        ins = ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in cfg.inputs)
        outs = ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in cfg.outputs)
        batch = f"max_batch_size {cfg.max_batch_size:<4}"
        print(f"{cfg.name:16} {cfg.platform:17} {batch} {ins} -> {outs}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchd", description="batchd model server")
    parser.add_argument("--version", action="version", version=f"batchd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _keys_parser(sub)
    sub.add_parser("worker", help="run a worker (see `batchd worker --help`)", add_help=False)
    sub.add_parser(
        "bench", help="load-test an OIP server (see `batchd bench --help`)", add_help=False
    )
    models = sub.add_parser("models", help="list a model repository, or --check it")
    models.add_argument("directory", type=Path)
    models.add_argument(
        "--check",
        action="store_true",
        help="also load every model on the CPU and run a batch of zeros",
    )
    raw = sys.argv[1:] if argv is None else argv
    args, rest = parser.parse_known_args(raw)
    if args.command in ("worker", "bench"):
        # Their own interpreters: the frontend never imports torch, nor the client.
        module = "batchd.worker" if args.command == "worker" else "batchd.client.bench"
        os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "models":
        return _models(args.directory, args.check)
    if args.command == "keys":
        return _generate_keys(args.directory)
    setup_logging(args.log_level, args.log_format)
    cfg = ServerConfig(
        model_repository=args.model_repository,
        host=args.host,
        grpc_port=args.grpc_port,
        workers=args.workers,
        devices=args.devices,
        threads_per_worker=args.threads_per_worker,
        credits_per_worker=args.credits_per_worker,
        worker_endpoint=args.worker_endpoint,
        local_workers=not args.no_local_workers,
        max_message_bytes=args.max_message_bytes,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        log_format=args.log_format,
        metrics_port=args.metrics_port,
        frontends=args.frontends,
        frontend_index=args.frontend_index,
        argv=tuple(raw[1:]),  # without "serve"
        model_control=args.model_control,
        load_models=tuple(args.load_model),
        security=security.from_args(args),
    )
    if args.load_model and args.model_control != "explicit":
        parser.error("--load-model needs --model-control explicit")
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve(cfg))
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    return 0
