"""`batchd bench`: load-test any Open Inference Protocol server (batchd, Triton, ...).

    batchd bench --url 127.0.0.1:8001 --model mlp --concurrency 1,2,4,8,16,32,64
    batchd bench --model mlp --rate 500,1000,2000          # open loop: fixed request rates
    batchd bench --model mlp --input INPUT0=x.npy --json out.json --plot out.png

Closed loop (`--concurrency`): N callers, each sending its next request when
the last is answered. Open loop (`--rate`): requests leave on a fixed
schedule whether or not earlier ones were answered, so queueing shows
honestly. Load comes from `--processes` processes (default: the machine's
cores) so that the tool is not the bottleneck. Inputs are random, shaped from
the model's metadata (`--batch` rows, -1 dims as `--dim`), or read from .npy.
When the server reports statistics, the table shows its average batch size.
Failed requests are counted per status code, each with the first message the
server gave for it (in the table and in --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from batchd.client.client import AsyncClient, Client
from batchd.client.codec import build_request
from batchd.client.errors import BatchdClientError
from batchd.protos.datatypes import DATATYPES


@dataclass
class Level:
    """One measured load level."""

    mode: str  # "concurrency" or "rate"
    load: float
    seconds: float = 0.0
    ok: int = 0
    throughput: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    error_messages: dict[str, str] = field(default_factory=dict)  # the first one per code
    server_avg_batch: float | None = None


def random_tensor(datatype: str, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Random values of the numpy dtype that travels as `datatype` (BF16: uint16 bits)."""
    if datatype == "BYTES":
        return np.full(shape, b"batchd bench", dtype=object)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if datatype == "BF16":  # the upper half of FP32's bits
        return (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    dtype = DATATYPES[datatype].numpy
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)  # fits INT8 and every UINT


def make_inputs(
    meta: dict[str, Any], batch: int, dim: int, files: dict[str, str]
) -> dict[str, Any]:
    """One tensor per input of the model's metadata: read from its .npy file, or random,
    `batch` rows with every other -1 dim as `dim`."""
    inputs: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for t in meta["inputs"]:
        if t["name"] in files:
            inputs[t["name"]] = np.load(files[t["name"]], allow_pickle=False)
            continue
        shape = [
            batch if i == 0 and d == -1 else (dim if d == -1 else d)
            for i, d in enumerate(t["shape"])
        ]
        inputs[t["name"]] = random_tensor(t["datatype"], shape, rng)
    return inputs


def declared_datatypes(meta: dict[str, Any]) -> dict[str, str]:
    """The datatypes a numpy array cannot name by itself (BF16 travels as uint16)."""
    return {t["name"]: "BF16" for t in meta["inputs"] if t["datatype"] == "BF16"}


async def _drive(
    url: str,
    conn: dict[str, Any],
    connections: int,
    model: str,
    inputs: dict[str, Any],
    datatypes: dict[str, str],
    mode: str,
    load: float,
    seconds: float,
) -> tuple[list[float], Counter[str], dict[str, str]]:
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    messages: dict[str, str] = {}
    end = time.monotonic() + seconds
    # Built once and sent as is: the load generator spends its CPU on sending,
    # not on encoding the same tensors again (nor on decoding the answers).
    msg = build_request(model, inputs, datatypes=datatypes)

    async def once(client: AsyncClient) -> None:
        start = time.monotonic()
        try:
            await client.stub.ModelInfer(msg, timeout=30, **client.call_kwargs)
            latencies.append(time.monotonic() - start)
        except grpc.RpcError as e:
            errors[e.code().name] += 1
            messages.setdefault(e.code().name, e.details() or "")

    clients = [AsyncClient(url, own_connection=True, **conn) for _ in range(max(1, connections))]
    try:
        if mode == "concurrency":

            async def caller(c: AsyncClient) -> None:
                while time.monotonic() < end:
                    await once(c)

            await asyncio.gather(*(caller(clients[k % len(clients)]) for k in range(int(load))))
        else:
            start, pending = time.monotonic(), set()
            for i in range(int(load * seconds)):
                delay = start + i / load - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(once(clients[i % len(clients)]))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
    finally:
        for c in clients:
            await c.close()
    return latencies, errors, messages


def _process(
    url: str,
    conn: dict[str, Any],
    connections: int,
    model: str,
    inputs: dict[str, Any],
    datatypes: dict[str, str],
    mode: str,
    load: float,
    seconds: float,
    out: Any,
) -> None:
    latencies, errors, messages = asyncio.run(
        _drive(url, conn, connections, model, inputs, datatypes, mode, load, seconds)
    )
    out.put((np.asarray(latencies, np.float64), dict(errors), messages))


def _server_batches(client: Client, model: str) -> tuple[int, int] | None:
    """(rows, batches) the server has run for `model`, if it keeps statistics."""
    try:
        if "statistics" not in client.server_metadata()["extensions"]:
            return None
        stats = client.model_statistics(model)[0]
        return stats.inference_count, stats.execution_count
    except (BatchdClientError, IndexError):
        return None


def measure(args: argparse.Namespace, inputs: dict[str, Any], mode: str, load: float) -> Level:
    procs = max(1, min(args.processes, int(load) if mode == "concurrency" else args.processes))
    share = load / procs
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with Client(args.url, **connection(args)) as client:
        before = _server_batches(client, args.model)
        workers = [
            ctx.Process(
                target=_process,
                args=(
                    *(args.url, connection(args), args.connections, args.model, inputs),
                    args.datatype,
                    *(mode, share, args.duration, out),
                ),
            )
            for _ in range(procs)
        ]
        started = time.monotonic()
        for w in workers:
            w.start()
        results: list[tuple[np.ndarray, dict[str, int], dict[str, str]]] = []
        while len(results) < procs:
            elapsed = time.monotonic() - started
            if not args.quiet:
                print(
                    f"\r  {mode} {load:g}: {min(elapsed, args.duration):4.1f}/{args.duration:g} s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            try:
                results.append(out.get(timeout=0.5))
            except Exception:  # queue.Empty: still running, show progress again
                continue
        for w in workers:
            w.join()
        after = _server_batches(client, args.model)
    if not args.quiet:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    lat = np.sort(np.concatenate([r[0] for r in results])) * 1e3
    errors: Counter[str] = Counter()
    messages: dict[str, str] = {}
    for _, e, m in results:
        errors.update(e)
        for code, message in m.items():
            messages.setdefault(code, message)
    level = Level(mode, load, args.duration, len(lat), len(lat) / args.duration)
    if len(lat):
        level.p50_ms, level.p90_ms, level.p99_ms = (
            float(np.percentile(lat, q)) for q in (50, 90, 99)
        )
    level.errors = dict(errors)
    level.error_messages = messages
    if before and after and after[1] > before[1]:
        level.server_avg_batch = (after[0] - before[0]) / (after[1] - before[1])
    return level


def rows(lv: Level) -> list[str]:
    """A level's line of the table, then the first message of each error code under it."""
    load = f"{'c=' if lv.mode == 'concurrency' else 'r='}{lv.load:g}"
    batch = f"{lv.server_avg_batch:.1f}" if lv.server_avg_batch else "-"
    errs = ", ".join(f"{k} {v}" for k, v in sorted(lv.errors.items())) or "none"
    line = (
        f"{load:>10} {lv.throughput:>10.1f} {lv.p50_ms:>9.2f} {lv.p90_ms:>9.2f} "
        f"{lv.p99_ms:>9.2f} {batch:>10}  {errs}"
    )
    return [line] + [f"{'':>10}   {k}: {m}" for k, m in sorted(lv.error_messages.items())]


def table(levels: Sequence[Level]) -> str:
    head = (
        f"{'load':>10} {'req/s':>10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} "
        f"{'avg batch':>10}  errors"
    )
    lines = [head, "-" * len(head)]
    for lv in levels:
        lines += rows(lv)
    return "\n".join(lines)


def plot(levels: Sequence[Level], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [lv.load for lv in levels]
    ax.plot(x, [lv.throughput for lv in levels], "o-", color="tab:blue", label="throughput")
    ax.set_xlabel("concurrency" if levels[0].mode == "concurrency" else "offered rate (req/s)")
    ax.set_ylabel("requests / s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(x, [lv.p99_ms for lv in levels], "s--", color="tab:red", label="p99")
    ax2.set_ylabel("p99 latency (ms)", color="tab:red")
    if levels[0].mode == "concurrency":
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def connection(args: argparse.Namespace) -> dict[str, Any]:
    """Client keyword arguments for the server's TLS and token settings."""
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    return {
        "tls": args.tls,
        "ca_cert": args.ca_cert,
        "client_cert": args.client_cert,
        "client_key": args.client_key,
        "token": token,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchd bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--model", required=True)
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        default="1,2,4,8,16,32,64",
        help="callers, a list (1,4,16) or a range start:end (doubling)",
    )
    load.add_argument("--rate", help="open loop: request rates per second, a list")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per level (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring")
    p.add_argument("--batch", type=int, default=1, help="rows per request (default 1)")
    p.add_argument("--dim", type=int, default=16, help="size of a -1 dim in random inputs")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    p.add_argument(
        "--processes",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 4),
        help="load processes (default one per 4 cores: on small machines more "
        "processes take CPU from the server under test)",
    )
    p.add_argument(
        "--connections",
        type=int,
        default=1,
        help="TCP connections per load process (default 1; a server with --frontends N "
        "spreads connections, not requests, over its processes)",
    )
    sec = p.add_argument_group("a secured server (see README, Security)")
    sec.add_argument("--tls", action="store_true", help="TLS, verified against the system's CAs")
    sec.add_argument("--ca-cert", help="PEM CA to verify the server against (implies --tls)")
    sec.add_argument("--client-cert", help="PEM client certificate (mutual TLS)")
    sec.add_argument("--client-key", help="PEM key of --client-cert")
    sec.add_argument("--token-file", help="file holding the bearer token to send")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="FILE.png", help="draw throughput and p99 against the load")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    args.quiet = args.quiet or not sys.stderr.isatty()  # progress only on a terminal
    return args


def loads(args: argparse.Namespace) -> tuple[str, list[float]]:
    if args.rate:
        return "rate", [float(r) for r in args.rate.split(",")]
    spec = args.concurrency
    if ":" in spec:
        lo, hi = (int(v) for v in spec.split(":")[:2])
        out, c = [], lo
        while c <= hi:
            out.append(float(c))
            c *= 2
        return "concurrency", out
    return "concurrency", [float(c) for c in spec.split(",")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode, levels_to_run = loads(args)
    try:
        with Client(args.url, **connection(args)) as client:
            meta = client.model_metadata(args.model)
    except (BatchdClientError, OSError) as e:
        print(f"batchd bench: {args.url}: {e}", file=sys.stderr)
        return 2
    files = dict(item.split("=", 1) for item in args.input)
    inputs = make_inputs(meta, args.batch, args.dim, files)
    args.datatype = declared_datatypes(meta)
    if args.warmup > 0:
        measure(
            argparse.Namespace(**{**vars(args), "duration": args.warmup, "quiet": True}),
            inputs,
            mode,
            levels_to_run[0],
        )
    results = []
    for load in levels_to_run:
        results.append(measure(args, inputs, mode, load))
        if not args.quiet:
            print("\n".join(rows(results[-1])), file=sys.stderr)
    print(
        f"\n{args.model} @ {args.url}, {args.duration:g} s per level, "
        f"{args.batch} row(s) per request\n"
    )
    print(table(results))
    if args.json:
        text = json.dumps(
            {"model": args.model, "url": args.url, "levels": [asdict(r) for r in results]}, indent=2
        )
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.plot:
        plot(results, args.plot, f"{args.model} @ {args.url}")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
