"""Does `target_latency_ms` settle? Serve a model whose batch takes 2 ms + 1 ms
per row, drive it closed-loop with 32 callers, and print, second by second,
the batches' average size and the callers' p50/p99 latency. Run it with and
without a target to see the cap adapt:

    .venv/bin/python bench/latency_target.py --target-ms 20
    .venv/bin/python bench/latency_target.py --target-ms 0
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from batchd.client import AsyncClient, Client
from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

MODEL_PY = """
import time
import torch

def load(device):
    def run(x):
        time.sleep(0.002 + 0.001 * x.shape[0])  # a batch costs 2 ms + 1 ms per row
        return x
    return run
"""

MODEL_TOML = """
max_batch_size = 32
[[input]]
name = "X"
datatype = "FP32"
shape = [1]
[[output]]
name = "Y"
datatype = "FP32"
shape = [1]
[batching]
max_queue_delay_us = 5000
target_latency_ms = {target}
"""


def batch_sizes(stub: pb_grpc.GRPCInferenceServiceStub) -> dict[int, int]:
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="grows")).model_stats[0]
    return {b.batch_size: b.compute_infer.count for b in stats.batch_stats}


async def load(url: str, seconds: float, callers: int, latencies: list[list[float]]) -> None:
    x = np.zeros((1, 1), np.float32)
    start = time.monotonic()

    async def caller(client: AsyncClient) -> None:
        while (now := time.monotonic()) - start < seconds:
            await client.infer("grows", {"X": x}, timeout=10)
            latencies[int(now - start)].append(time.monotonic() - now)

    async with AsyncClient(url) as client:
        await asyncio.gather(*(caller(client) for _ in range(callers)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--seconds", type=int, default=12)
    p.add_argument("--callers", type=int, default=32)
    p.add_argument("--port", type=int, default=18011)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as repo:
        (Path(repo) / "grows").mkdir()
        (Path(repo) / "grows" / "model.py").write_text(MODEL_PY)
        (Path(repo) / "grows" / "model.toml").write_text(MODEL_TOML.format(target=args.target_ms))
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchd.server",
                "--model-repository",
                repo,
                "--workers",
                "1",
                "--grpc-port",
                str(args.port),
                "--log-level",
                "WARNING",
            ]
        )
        url = f"127.0.0.1:{args.port}"
        try:
            with Client(url) as c:
                while not c.ready():
                    time.sleep(0.1)
            stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
            latencies: list[list[float]] = [[] for _ in range(args.seconds + 1)]
            samples = []

            async def run() -> None:
                task = asyncio.create_task(load(url, args.seconds, args.callers, latencies))
                for _ in range(args.seconds):
                    samples.append(batch_sizes(stub))
                    await asyncio.sleep(1)
                await task

            asyncio.run(run())
            samples.append(batch_sizes(stub))
        finally:
            server.terminate()
            server.wait()
    print(f"target_latency_ms = {args.target_ms}, {args.callers} callers, model: 2 ms + 1 ms/row")
    print(f"{'second':>6} {'batches':>8} {'avg rows':>9} {'p50 ms':>8} {'p99 ms':>8}")
    settled = []
    for s in range(args.seconds):
        before, after = samples[s], samples[s + 1]
        batches = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        n = sum(batches.values())
        avg = sum(k * v for k, v in batches.items()) / n if n else 0.0
        lat = sorted(latencies[s])
        p50 = statistics.median(lat) * 1e3 if lat else 0.0
        p99 = lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else 0.0
        print(f"{s:>6} {n:>8} {avg:>9.1f} {p50:>8.1f} {p99:>8.1f}")
        if s >= args.seconds - 5:
            settled.append(avg)
    print(f"settled batch size (last 5 s): {statistics.mean(settled):.1f} rows")


if __name__ == "__main__":
    main()
