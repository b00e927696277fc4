"""python -m batchd.worker: serve a frontend the models it asks for, from a repository."""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

import torch

from batchd.protos import keys, traces
from batchd.protos.logs import setup_logging
from batchd.protos.model_config import ConfigError
from batchd.protos.processes import descendants, kill_all
from batchd.worker.loader import leave
from batchd.worker.loading import is_own
from batchd.worker.log_tag import tag_log_lines
from batchd.worker.runner import Runner, RunnerOptions

log = logging.getLogger("batchd.worker")


def die_with_a_worker_thread(args: threading.ExceptHookArgs) -> None:
    """A thread of the worker's own (compute, loader: loading.own_thread) that dies takes
    the process with it: the I/O thread would heartbeat on for a worker that answers
    nothing, its batches waiting out `execution_timeout_s` and its loads for ever. A
    process that exits is seen at once (and restarted, if its frontend started it). A
    model's own exceptions, SystemExit too, never get here: they are reply data
    (runner.py, generate.py). A thread a model started is the model's: its exception is
    logged, as Python does, and the worker goes on (it exited, and every worker that
    loaded the model again exited too, over and over)."""
    thread = args.thread.name if args.thread is not None else "?"
    trace = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    if not is_own(args.thread):
        log.error("thread %s (a model's) died:\n%s", thread, trace.rstrip())
        return
    log.critical("thread %s died; exiting:\n%s", thread, trace.rstrip())
    logging.shutdown()
    kill_all(descendants(os.getpid()))  # (what a model started ends with it: processes.py)
    os._exit(70)  # EX_SOFTWARE


def install_signal_handlers(runner: Runner) -> None:
    """SIGTERM and SIGINT stop a worker started by hand. A worker its frontend started
    (--parent-pid) takes them and does nothing: a signal to every process of the server
    (systemd stopping the unit) must not take the worker away while the frontend
    drains; STOP, or its parent's exit, ends it. (Taken, not ignored: what a model's code
    runs in a new program, a spawned process, starts with SIGTERM's default, as a forked
    one gets back (_default_sigterm), so that terminate() ends it: a pool's processes
    that ignored it hung `with Pool()`, and outlived the worker.)"""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if runner.options.parent_pid is None:
            signal.signal(sig, lambda *_: runner.stop())
        else:
            signal.signal(sig, _taken)
    # (its frontend starts it with both blocked, so that none kills it before it gets here:
    # one that came meanwhile is dropped as ignored)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    os.register_at_fork(after_in_child=_default_sigterm)


def _taken(signum: int, frame: object) -> None:
    """A signal to a worker its frontend started: nothing to do (install_signal_handlers)."""


def _default_sigterm() -> None:
    """(In a process a model's code forked.) SIGTERM's default, so that terminate() ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchd worker", description=__doc__)
    p.add_argument("--connect", help="frontend endpoint, e.g. tcp://10.0.0.5:5555")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda:0, ... (default cpu)")
    p.add_argument(
        "--model-repository",
        type=Path,
        default=Path("models"),
        help="directory of <model>/model.toml (default ./models); the frontend says which to load",
    )
    p.add_argument("--models", default="", help="comma-separated models it may load (default: any)")
    p.add_argument("--id", help="worker id (default <hostname>-<device>-<pid>)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default torch's)"
    )
    p.add_argument("--parent-pid", type=int, help="exit when this parent process goes away")
    p.add_argument(
        "--worker-keys",
        type=Path,
        metavar="DIR",
        help="CURVE keys (worker.key_secret, server.key) for a frontend started with --worker-keys",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export compute spans by OTLP/gRPC (also OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    p.add_argument(
        "--check",
        type=Path,
        metavar="DIR",
        help="load every model of DIR on the CPU, run a batch of zeros, report",
    )
    p.add_argument(
        "--list-devices",
        action="store_true",
        help="print the visible accelerator devices as JSON and exit",
    )
    return p.parse_args(argv)


IPC_PATH_MAX = 107  # bytes of a Unix socket's path


def _endpoints(connect: str | None) -> str:
    """--connect's endpoints, a relative ipc:// one made absolute where that fits (past
    IPC_PATH_MAX, the worker never connected and said nothing: late review 57g);
    ConfigError if there are none, or an ipc:// path does not fit (it printed ZMQError's
    traceback, and the worker hung: late review 57h)."""
    if not connect:
        raise ConfigError("--connect is required")
    endpoints = []
    for e in connect.split(","):
        path = e.removeprefix("ipc://")
        if path == e or path.startswith("@"):  # (not ipc://, or an abstract name)
            endpoints.append(e)
            continue
        whole = path if path.startswith("/") else os.path.abspath(path)
        if len(os.fsencode(whole)) <= IPC_PATH_MAX:
            endpoints.append(f"ipc://{whole}")
        elif len(os.fsencode(path)) <= IPC_PATH_MAX:  # (relative, from a deep directory)
            endpoints.append(e)
        else:
            raise ConfigError(f"--connect {e[:60]!r}...: an ipc:// path holds at most "
                              f"{IPC_PATH_MAX} bytes (a Unix socket's)")  # fmt: skip
    return ",".join(endpoints)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_devices:
        print(json.dumps([f"cuda:{i}" for i in range(torch.cuda.device_count())]))
        return 0
    if args.check:
        from batchd.worker.check import check_repository

        return 1 if check_repository(args.check) else 0
    # Anchored now: the working directory is the whole process's, and a model's load()
    # that changed it (os.chdir to its own folder) left a relative --model-repository
    # unreadable for every other model of the worker, at each restart (review 57f), and
    # its reconnects and keys looking elsewhere.
    args.model_repository = args.model_repository.absolute()
    args.worker_keys = args.worker_keys and args.worker_keys.absolute()
    try:
        args.connect = _endpoints(args.connect)
        endpoint = traces.endpoint(args.otlp_endpoint)
    except ConfigError as e:
        print(f"batchd worker: {e}", file=sys.stderr)
        return 2
    worker_id = args.id or f"{socket.gethostname()}-{args.device}-{os.getpid()}"
    setup_logging(args.log_level, args.log_format)
    tag_log_lines(worker_id)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"this host has {torch.cuda.device_count()} CUDA device(s)")
    except RuntimeError as e:
        print(f"batchd worker: --device {args.device[:40]!r}: {e}", file=sys.stderr)
        return 2
    if not args.model_repository.is_dir():
        print(f"batchd worker: {args.model_repository}: not a directory", file=sys.stderr)
        return 2
    try:
        if args.worker_keys is not None:
            keys.load_pair(args.worker_keys, keys.WORKER)  # a bad key fails here, loudly
            keys.load_public(args.worker_keys, keys.SERVER)
            keys.warn_loose(log, args.worker_keys / f"{keys.WORKER}.key_secret")
    except ConfigError as e:
        print(f"batchd worker: {e}", file=sys.stderr)
        return 2
    options = RunnerOptions(
        worker_id,
        args.connect,
        device,
        args.model_repository,
        tuple(m for m in args.models.split(",") if m),
        args.parent_pid,
        args.worker_keys,
        None if endpoint is None else traces.Tracing.start("worker", endpoint),
    )
    runner = Runner(options)
    install_signal_handlers(runner)
    threading.excepthook = die_with_a_worker_thread
    if options.tracing is not None:  # (at exit: a worker leaving a hung model leaves
        atexit.register(options.tracing.shutdown)  # at once, loader.leave)
    runner.serve()
    return 0


def run() -> NoReturn:
    """main(), then out (loader.leave)."""
    code = 1
    try:
        code = main()
    except SystemExit as e:  # (argparse's)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    leave(code)


if __name__ == "__main__":
    run()
