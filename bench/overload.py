"""Overload: what happens at N x capacity, open loop (requests keep coming at a
fixed rate whether or not earlier ones were answered, as real traffic does).

1. Serve a model (default: a built-in `slow` model, 20 ms per batch of up to
   8 rows, so one worker's capacity is ~400 req/s and a Python load generator
   can reach 4x that on two cores).
2. Measure the closed-loop peak (32 callers, 5 s).
3. Send at `--overload` x that peak for `--seconds`, open loop.
4. Report accepted throughput vs the peak, latency of accepted requests,
   latency of rejections (RESOURCE_EXHAUSTED) as the generator sees them and
   the server's own time per failed request (ModelStatistics), errors by
   code, and the RSS of the frontend + its workers (peak, and its slope).

    .venv/bin/python bench/overload.py --overload 4 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from batchd.client import AsyncClient, Client
from batchd.client.codec import build_request
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

SLOW_PY = """
import time

def load(device):
    def run(x):
        time.sleep(0.020)  # 20 ms a batch, whatever its size (up to 8 rows)
        return x
    return run
"""
SLOW_TOML = """
max_batch_size = 8
[[input]]
name = "X"
datatype = "FP32"
shape = [16]
[[output]]
name = "Y"
datatype = "FP32"
shape = [16]
[batching]
max_queue_delay_us = 1000
max_queue_size = 64
"""


def rss_mb(pid: int) -> float:
    """RSS of `pid` and its children, in MB (from /proc)."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (from /proc), and of a worker zygote's among
    them (server/zygote.py): the server's workers, forked from it."""
    found = _children(pid)
    zygotes = [z for z in found if b"batchd.worker.zygote" in _cmdline(z)]
    return found + [w for z in zygotes for w in _children(z)]


def _children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def cpu_s(pid: int, main_thread: bool = False) -> float:
    """CPU seconds (user + system) used so far by process `pid`, all its threads, or
    only its main thread (a Python server's event loop: the one that cannot spread)."""
    try:
        fields = _stat(Path(f"/proc/{pid}/task/{pid}" if main_thread else f"/proc/{pid}"))
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have exited and
    been waited for (a load generator run to its end)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ppid(proc: Path) -> int:
    try:
        return int(_stat(proc)[1])
    except (OSError, IndexError, ValueError):
        return -1


def _stat(proc: Path) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def one_request(url: str, model: str, x: np.ndarray) -> pb.ModelInferRequest:
    """Built once and sent as is, so the load generator's CPU goes to sending."""
    with Client(url) as c:
        name = c.model_metadata(model)["inputs"][0]["name"]
    return build_request(model, {name: x})


def failures(url: str, model: str) -> tuple[int, int]:
    """The server's own count of failed requests and their summed time in it (ns):
    from the handler's start to its answer, without gRPC's transport."""
    with grpc.insecure_channel(url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    fail = stats.model_stats[0].inference_stats.fail
    return fail.count, fail.ns


async def closed_loop(url: str, msg: pb.ModelInferRequest, callers: int, seconds: float) -> float:
    done = 0
    end = time.monotonic() + seconds

    async def caller(c: AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < end:
            try:
                await c.stub.ModelInfer(msg, timeout=10)
                done += 1
            except grpc.RpcError:
                pass

    async with AsyncClient(url) as c:
        start = time.monotonic()
        await asyncio.gather(*(caller(c) for _ in range(callers)))
        return done / (time.monotonic() - start)


async def open_loop(
    url: str, msg: pb.ModelInferRequest, rate: float, seconds: float, server_pid: int
) -> dict[str, object]:
    ok: list[float] = []
    rejected: list[float] = []
    errors: Counter[str] = Counter()
    rss: list[tuple[float, float]] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(c: AsyncClient) -> None:
        t = time.monotonic()
        try:
            await c.stub.ModelInfer(msg, timeout=10)
            ok.append(time.monotonic() - t)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                rejected.append(time.monotonic() - t)
            else:
                errors[f"{e.code().name}: {(e.details() or '')[:80]}"] += 1

    async def sample_rss(start: float) -> None:
        while True:
            rss.append((time.monotonic() - start, rss_mb(server_pid)))
            await asyncio.sleep(0.5)

    async with AsyncClient(url) as c:
        start = time.monotonic()
        sampler = asyncio.create_task(sample_rss(start))
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(c))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        sent_for = time.monotonic() - start
        await asyncio.gather(*tasks)
        sampler.cancel()
    times = [t for t, _ in rss]
    mbs = [m for _, m in rss]
    slope = float(np.polyfit(times, mbs, 1)[0]) if len(rss) > 2 else 0.0
    return {
        "offered_rps": round(n / sent_for, 1),
        "accepted_rps": round(len(ok) / sent_for, 1),
        "rejected_rps": round(len(rejected) / sent_for, 1),
        "accepted_p50_ms": round(percentile(ok, 0.5) * 1e3, 2),
        "accepted_p99_ms": round(percentile(ok, 0.99) * 1e3, 2),
        "rejection_mean_ms": round(statistics.mean(rejected) * 1e3, 3) if rejected else None,
        "rejection_p99_ms": round(percentile(rejected, 0.99) * 1e3, 3),
        "other_errors": dict(errors),
        "rss_start_mb": round(mbs[0], 1) if mbs else None,
        "rss_peak_mb": round(max(mbs), 1) if mbs else None,
        "rss_slope_mb_per_s": round(slope, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-repository", type=Path, help="default: a built-in `slow` model")
    p.add_argument("--model", default="slow")
    p.add_argument("--overload", type=float, default=4.0, help="offered load / closed-loop peak")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--port", type=int, default=18021)
    p.add_argument("--width", type=int, default=16, help="the model's FP32 input width")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.model_repository
        if repo is None:
            repo = Path(tmp)
            (repo / "slow").mkdir()
            (repo / "slow" / "model.py").write_text(SLOW_PY)
            (repo / "slow" / "model.toml").write_text(SLOW_TOML)
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchd.server",
                "--model-repository",
                str(repo),
                "--workers",
                "1",
                "--threads-per-worker",
                "1",
                "--grpc-port",
                str(args.port),
                "--log-level",
                "WARNING",
                "--metrics-port",
                "-1",
            ]
        )
        url = f"127.0.0.1:{args.port}"
        try:
            with Client(url) as c:
                end = time.monotonic() + 120
                while not c.ready():
                    if time.monotonic() > end or server.poll() is not None:
                        sys.exit("server did not become ready")
                    time.sleep(0.1)
            msg = one_request(url, args.model, np.zeros((1, args.width), np.float32))
            peak = asyncio.run(closed_loop(url, msg, 32, 5.0))
            count, ns = failures(url, args.model)
            result = asyncio.run(
                open_loop(url, msg, peak * args.overload, args.seconds, server.pid)
            )
            count, ns = (a - b for a, b in zip(failures(url, args.model), (count, ns), strict=True))
            result["server_side_failure_mean_us"] = round(ns / count / 1e3, 1) if count else None
        finally:
            server.terminate()
            server.wait()
    result = {
        "model": args.model,
        "closed_loop_peak_rps": round(peak, 1),
        "overload": args.overload,
        "seconds": args.seconds,
        **result,
    }
    result["accepted_over_peak"] = round(result["accepted_rps"] / peak, 3)  # type: ignore[operator]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
