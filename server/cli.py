"""The `batchd` command: `batchd serve ...`, and `worker`, `bench`, `jobs`, `models`, `keys`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import signal
import sys
from pathlib import Path

from batchd.protos import keys
from batchd.protos.logs import setup_logging
from batchd.protos.model_config import ConfigError
from batchd.protos.repository import NO_MODELS, load_repository, strays
from batchd.server import __version__, config
from batchd.server.app import serve
from batchd.server.loopload import new_loop

_ELSEWHERE = {
    "worker": "batchd.worker",
    "bench": "batchd.client.bench",
    "jobs": "batchd.client.jobs_cli",
}


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve a model repository over gRPC")
    config.add_arguments(p)  # every flag and its default come from config.py


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


def more_files() -> tuple[int, int]:
    """Raise this process's open-file limit to its hard limit, as Go's runtime does (its
    frontends and workers inherit it): at the usual soft 1,024, that many idle connections
    locked every new client out, and asyncio logged each accept refused, 138,000 times
    in 30 s. Returns the soft limit before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
    with contextlib.suppress(ValueError, OSError):  # (a container may refuse it)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _models(directory: Path, check: bool) -> int:
    if check:  # loading models needs torch: the worker's interpreter does it
        os.execv(sys.executable, [sys.executable, "-m", "batchd.worker", "--check", str(directory)])
    try:
        models = load_repository(directory)
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    for stray in strays(directory) + ([] if models else [NO_MODELS]):
        print(f"batchd: {stray}", file=sys.stderr)
    for cfg in models.values():
        ins = ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in cfg.inputs)
        outs = ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in cfg.outputs)
        batch = f"max_batch_size {cfg.max_batch_size:<4}"
        print(f"{cfg.name:16} {cfg.platform:17} {batch} {ins} -> {outs}")
    return 0 if models else 1


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
    sub.add_parser(
        "jobs", help="submit, watch and fetch batch jobs (see `batchd jobs --help`)",
        add_help=False,
    )  # fmt: skip
    models = sub.add_parser("models", help="list a model repository, or --check it")
    models.add_argument("directory", type=Path)
    models.add_argument(
        "--check",
        action="store_true",
        help="also load every model on the CPU and run a batch of zeros",
    )
    raw = sys.argv[1:] if argv is None else argv
    args, rest = parser.parse_known_args(raw)
    if args.command in _ELSEWHERE:
        # Their own interpreters: the frontend never imports torch, nor the client.
        os.execv(sys.executable, [sys.executable, "-m", _ELSEWHERE[args.command], *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "models":
        return _models(args.directory, args.check)
    if args.command == "keys":
        return _generate_keys(args.directory)
    cfg = config.from_arguments(args, argv=tuple(raw[1:]))  # without "serve"
    try:
        cfg.check()
    except ConfigError as e:
        parser.error(str(e))
    setup_logging(cfg.logging.level, cfg.logging.format)
    # (a child frontend started while frontend 0 started a worker inherited both blocked)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if (files := more_files())[1] > files[0]:
        logging.getLogger("batchd.server").info("open files: up to %d (was %d)", *files[::-1])
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve(cfg))
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    return 0
