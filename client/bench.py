"""`batchd bench`: load-test any Open Inference Protocol server (batchd, Triton, ...).

    batchd bench --url 127.0.0.1:8001 --model mlp --concurrency 1,2,4,8,16,32,64
    batchd bench --model mlp --rate 500,1000,2000          # open loop: fixed request rates
    batchd bench --model mlp --input INPUT0=x.npy --json out.json --plot out.png
    batchd bench --model decoder --stream --input MAX_NEW_TOKENS=n.npy  # a step-wise model

Closed loop (`--concurrency`): N callers, each sending its next request when
the last is answered. Open loop (`--rate`): requests leave on a fixed
schedule whether or not earlier ones were answered, so queueing shows
honestly. Load comes from `--processes` processes (default: one per 4 cores)
so that the tool is not the bottleneck; a level is split whole over them (3
callers over 2 processes: 2 + 1; open loop: they take turns on one schedule,
so every request of the rate leaves, from one start instant; rate * duration
requests, rounded up). req/s is what was answered, over the time from the
level's start to its last answer (at least --duration, and at least the time
the schedule takes to send its requests, so never more than the rate): an
open loop faster than the server shows the server's rate. Inputs are random,
shaped from the model's metadata (`--batch` rows, -1 dims as `--dim`), or
read from .npy. When the server reports statistics, the table shows its
average batch size.
Failed requests are counted per status code, each with the first message the
server gave for it (in the table and in --json); percentiles without a sample
are "-" (null in --json). Exit status: 0, 1 when some requests failed, 2 when
the bench could not run (no server, an input it cannot build, a load process
that died, a level that sent nothing) or was asked a load it cannot run.

`--stream` sends each request alone over ModelStreamInfer and reads it to its
final response: for a step-wise (decoupled) model, whose outputs come one
response per step. Each level then reports outputs per second besides requests
per second, the time to first output (from sending the request) and the
inter-output latency (between two outputs of one request), p50 and p99; both
rates are over the time the level's load took, its last streams' tails
included. A stream's error response counts under its status code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from batchd.client.client import Client
from batchd.client.codec import build_request
from batchd.client.core import STREAM_PARAMETERS
from batchd.client.errors import BatchdClientError
from batchd.client.loadgen import Level, LoadFailed, random_tensor, run_level
from batchd.client.options import add_security, connection

SETUP_TIMEOUT_S = 30.0  # its own calls (metadata, statistics): a server that never answered
# them held the bench for ever, never `exit 2`


def _server_batches(client: Client, model: str) -> tuple[int, int] | None:
    """(rows, batches) the server has run for `model`, if it keeps statistics."""
    try:
        if "statistics" not in client.server_metadata()["extensions"]:
            return None
        stats = client.model_statistics(model)[0]
        return stats.inference_count, stats.execution_count
    except (BatchdClientError, IndexError):
        return None


def measure(args: argparse.Namespace, msg: Any, mode: str, load: float) -> Level:
    """One level, with the server's average batch size over it where it reports one."""

    def progress(elapsed: float) -> None:
        if not args.quiet:
            shown = min(elapsed, args.duration)
            line = f"\r  {mode} {load:g}: {shown:4.1f}/{args.duration:g} s"
            print(line, end="", file=sys.stderr, flush=True)

    with Client(args.url, timeout=SETUP_TIMEOUT_S, **connection(args)) as client:
        before = _server_batches(client, args.model)
        try:
            level = run_level(
                args.url,
                connection(args),
                args.connections,
                msg,
                mode,
                load,
                args.duration,
                args.processes,
                progress,
                stream=args.stream,
            )
        finally:
            if not args.quiet:
                print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
        after = _server_batches(client, args.model)
    if before and after and after[1] > before[1]:
        level.server_avg_batch = (after[0] - before[0]) / (after[1] - before[1])
    return level


def _ms(value: float | None) -> str:
    """A percentile's cell: "-" when it had no sample (no request answered)."""
    text = "-" if value is None else f"{value:.2f}"
    return f"{text:>9}"


def rows(lv: Level) -> list[str]:
    """A level's line of the table, then the first message of each error code under it."""
    load = f"{'c=' if lv.mode == 'concurrency' else 'r='}{lv.load:g}"
    errs = ", ".join(f"{k} {v}" for k, v in sorted(lv.errors.items())) or "none"
    if (s := lv.stream) is not None:
        line = (
            f"{load:>10} {lv.throughput:>9.1f} {s.outputs_per_s:>10.1f} {_ms(s.ttfo_p50_ms)} "
            f"{_ms(s.ttfo_p99_ms)} {_ms(s.inter_output_p50_ms)} "
            f"{_ms(s.inter_output_p99_ms)}  {errs}"
        )
    else:
        batch = f"{lv.server_avg_batch:.1f}" if lv.server_avg_batch else "-"
        line = (
            f"{load:>10} {lv.throughput:>10.1f} {_ms(lv.p50_ms)} {_ms(lv.p90_ms)} "
            f"{_ms(lv.p99_ms)} {batch:>10}  {errs}"
        )
    return [line] + [f"{'':>10}   {k}: {m}" for k, m in sorted(lv.error_messages.items())]


def table(levels: Sequence[Level]) -> str:
    if levels and levels[0].stream is not None:
        head = (
            f"{'load':>10} {'req/s':>9} {'outputs/s':>10} {'TTFO p50':>9} {'TTFO p99':>9} "
            f"{'ITL p50':>9} {'ITL p99':>9}  errors   (ms; ITL: between outputs)"
        )
    else:
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

    def y(v: float | None) -> float:
        return math.nan if v is None else v  # a percentile with no sample: a gap

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [lv.load for lv in levels]
    ax.set_xlabel("concurrency" if levels[0].mode == "concurrency" else "offered rate (req/s)")
    ax2 = ax.twinx()
    streams = [lv.stream for lv in levels if lv.stream is not None]
    if len(streams) == len(levels):  # outputs/s, and the time to first output
        ax.plot(x, [s.outputs_per_s for s in streams], "o-", color="tab:blue")
        ax.set_ylabel("outputs / s", color="tab:blue")
        ax2.plot(x, [y(s.ttfo_p50_ms) for s in streams], "^:", color="tab:red", label="p50")
        ax2.plot(x, [y(s.ttfo_p99_ms) for s in streams], "s--", color="tab:red", label="p99")
        ax2.set_ylabel("time to first output (ms)", color="tab:red")
        ax2.legend(loc="upper left")
    else:
        ax.plot(x, [lv.throughput for lv in levels], "o-", color="tab:blue", label="throughput")
        ax.set_ylabel("requests / s", color="tab:blue")
        ax2.plot(x, [y(lv.p99_ms) for lv in levels], "s--", color="tab:red", label="p99")
        ax2.set_ylabel("p99 latency (ms)", color="tab:red")
    if levels[0].mode == "concurrency":
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
        "--stream",
        action="store_true",
        help="each request over ModelStreamInfer, read to its final response (a step-wise "
        "model): adds outputs/s, time to first output and inter-output latency",
    )
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
    add_security(p)
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write the results as JSON ('-': stdout, the table then on stderr)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw throughput and p99 (--stream: outputs/s and time to first output) "
        "against the load",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    if not 0 < args.duration < math.inf:
        p.error(f"argument --duration: {args.duration:g}: must be a positive number of seconds")
    if not 0 <= args.warmup < math.inf:  # 0: no warmup
        p.error(f"argument --warmup: {args.warmup:g}: must be 0 or a positive number of seconds")
    # 0 processes or connections would quietly run 1; a batch of 0 rows, requests all refused.
    for name in ("batch", "processes", "connections"):
        if (value := getattr(args, name)) < 1:
            p.error(f"argument --{name}: {value}: must be at least 1")
    try:
        loads(args)
    except ValueError as e:
        p.error(str(e))
    args.quiet = args.quiet or not sys.stderr.isatty()  # progress only on a terminal
    return args


def loads(args: argparse.Namespace) -> tuple[str, list[float]]:
    """The mode and its levels; ValueError for a level that cannot run (parse_args says it)."""
    mode = "rate" if args.rate else "concurrency"
    spec = args.rate or args.concurrency
    try:
        if args.rate:
            out = [float(r) for r in spec.split(",")]
        elif ":" in spec:
            lo, hi = (int(v) for v in spec.split(":")[:2])
            if not 1 <= lo <= hi:  # c = 0 would double forever
                raise ValueError("a range start:end needs 1 <= start <= end")
            out, c = [], lo
            while c <= hi:
                out.append(float(c))
                c *= 2
        else:
            out = [float(int(c)) for c in spec.split(",")]  # whole callers
    except ValueError as e:
        raise ValueError(f"argument --{mode}: {spec}: {e}") from None
    if not all(0 < v < math.inf for v in out):
        raise ValueError(f"argument --{mode}: {spec}: each level must be positive and finite")
    return mode, out


def make_inputs(
    meta: dict[str, Any], batch: int, dim: int, files: Mapping[str, str]
) -> dict[str, Any]:
    """One tensor per input of the model's metadata: read from its .npy file, or random,
    `batch` rows (a file's, where one gives a batched input) with every other -1 dim as
    `dim`. ValueError for a file named for an input the model does not have."""
    names = [t["name"] for t in meta["inputs"]]
    if unknown := sorted(set(files) - set(names)):
        raise ValueError(f"argument --input: model {meta.get('name', '')!r} has no input "
                         f"{', '.join(unknown)} (its inputs: {', '.join(names)})")  # fmt: skip
    loaded = {name: np.load(path, allow_pickle=False) for name, path in files.items()}
    inputs: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for t in meta["inputs"]:
        if (given := loaded.get(t["name"])) is not None and t["shape"][:1] == [-1] and given.ndim:
            batch = len(given)  # the rows the request carries
    for t in meta["inputs"]:
        if t["name"] in loaded:
            inputs[t["name"]] = loaded[t["name"]]
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


def request_for(args: argparse.Namespace, meta: dict[str, Any]) -> Any:
    """The one request every load process sends, built from the model's metadata."""
    if bad := [item for item in args.input if "=" not in item]:
        raise ValueError(f"argument --input: expected NAME=FILE.npy, got {bad[0][:60]!r}")
    files = dict(item.split("=", 1) for item in args.input)
    inputs = make_inputs(meta, args.batch, args.dim, files)
    batched = [t["name"] for t in meta["inputs"] if t["shape"][:1] == [-1]]
    if batched and np.ndim(inputs[batched[0]]):
        args.batch = len(inputs[batched[0]])  # the rows sent (a file's), as the report says
    parameters = STREAM_PARAMETERS if args.stream else None
    return build_request(
        args.model, inputs, datatypes=declared_datatypes(meta), parameters=parameters
    )


def run_levels(
    args: argparse.Namespace, msg: Any, mode: str, levels_to_run: Sequence[float]
) -> list[Level]:
    if args.warmup > 0:
        warmup = argparse.Namespace(**{**vars(args), "duration": args.warmup, "quiet": True})
        measure(warmup, msg, mode, levels_to_run[0])
    results = []
    for load in levels_to_run:
        try:
            results.append(measure(args, msg, mode, load))
        except LoadFailed as e:
            raise LoadFailed(f"{mode} {load:g}: {e}") from None
        if not args.quiet:
            print("\n".join(rows(results[-1])), file=sys.stderr)
    return results


def report(args: argparse.Namespace, results: Sequence[Level]) -> None:
    how = ", streamed: each request read to its final response" if args.stream else ""
    out = sys.stderr if args.json == "-" else sys.stdout  # --json -: stdout is the JSON alone
    print(
        f"\n{args.model} @ {args.url}, {args.duration:g} s per level, "
        f"{args.batch} row(s) per request{how}\n",
        file=out,
    )
    print(table(results), file=out)
    if args.json:
        text = json.dumps(
            {
                "model": args.model,
                "url": args.url,
                "stream": args.stream,
                "levels": [asdict(r) for r in results],
            },
            indent=2,
        )
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.plot:
        plot(results, args.plot, f"{args.model} @ {args.url}")


def main(argv: list[str] | None = None) -> int:
    """0: every request answered; 1: some failed (see the table); 2: the bench could not run."""
    args = parse_args(argv)
    mode, levels_to_run = loads(args)
    try:
        with Client(args.url, timeout=SETUP_TIMEOUT_S, **connection(args)) as client:
            meta = client.model_metadata(args.model)
    except (BatchdClientError, OSError, ValueError) as e:  # (ValueError: a URL)
        print(f"batchd bench: {args.url}: {e}", file=sys.stderr)
        return 2
    try:
        msg = request_for(args, meta)
        results = run_levels(args, msg, mode, levels_to_run)
    except (LoadFailed, OSError, ValueError) as e:
        print(f"batchd bench: {e}", file=sys.stderr)
        return 2
    report(args, results)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
