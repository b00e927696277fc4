"""Padding-free (packed) batches against padded ones, on skewed lengths (issue 22).

One server (one worker, one torch thread) serves the same sentence-embedding
layers three ways, copied from the examples:

  padded_fifo      textpool with bucket_by_length off: a batch is padded to its
                   longest row, whoever is in it
  padded_buckets   textpool as shipped: rows of similar lengths batch together
  packed           textpool_packed: rows concatenated, no padding at all

All three have max_batch_size 32, max_batch_tokens 4096 (padded: rows x longest;
packed: the sum of the lengths) and max_queue_delay_us 2000. --callers
closed-loop callers send one row each, lengths drawn skewed: most short (4-32
tokens), a few long (--long-share of 200-400). Each model is driven for
--seconds in a new order each round (--rounds); reported per run: tokens per
second (the real tokens of the rows answered), requests per second, latency
p50/p99 from the caller's send, and padding efficiency (real tokens / tokens
the model computed, from batchd_padded_tokens_total).

    .venv/bin/python bench/packed.py [--seconds 10] [--rounds 2] [--callers 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from batchd.client import AsyncClient, Client

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
MODELS = ("padded_fifo", "padded_buckets", "packed")
PORT, METRICS = 18391, 18392


def repository(into: Path) -> Path:
    sources = {"padded_fifo": "textpool", "padded_buckets": "textpool", "packed": "textpool_packed"}
    for name, source in sources.items():
        shutil.copytree(EXAMPLES / source, into / name)
        toml = into / name / "model.toml"
        text = toml.read_text()
        if name == "padded_fifo":
            text = re.sub(r"(?m)^bucket_by_length = true.*$", "bucket_by_length = false", text)
        toml.write_text(text)
    return into


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def padded_tokens(model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=10).read()
    m = re.search(rf'^batchd_padded_tokens_total{{model="{model}",version="1"}} (\S+)$',
                  text.decode(), re.M)  # fmt: skip
    return float(m.group(1)) if m else 0.0


async def drive(model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    latencies: list[float] = []
    tokens = 0
    before = padded_tokens(model)
    end = time.monotonic() + args.seconds

    async def caller(client: AsyncClient) -> None:
        nonlocal tokens
        while time.monotonic() < end:
            long = rng.random() < args.long_share
            n = rng.randint(200, 400) if long else rng.randint(4, 32)
            row = np.array([[rng.randrange(1, 8000) for _ in range(n)]], np.int64)
            sent = time.perf_counter()
            await client.infer(model, {"TOKENS": row}, timeout=60)
            latencies.append(time.perf_counter() - sent)
            tokens += n

    async with AsyncClient(f"127.0.0.1:{PORT}") as client:
        started = time.monotonic()
        await asyncio.gather(*(caller(client) for _ in range(args.callers)))
        elapsed = time.monotonic() - started
    computed = padded_tokens(model) - before
    latencies.sort()
    return {
        "tokens_s": round(tokens / elapsed),
        "req_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1e3 * statistics.median(latencies), 1),
        "p99_ms": round(1e3 * latencies[int(0.99 * (len(latencies) - 1))], 1),
        "padding_efficiency": round(tokens / computed, 3) if computed else None,
    }


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"Packed against padded batches ({r['cpu']}, {r['cores']} cores, {r['when']}): "
        f"{r['callers']} closed-loop callers, one row each, {int(r['long_share'] * 100)}% long "
        "(200-400 tokens), the rest 4-32; one worker, one torch thread; runs alternating.",
        "",
        "| model | tokens/s | req/s | p50 ms | p99 ms | padding efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for name in MODELS:
        runs = [x[name] for x in r["rounds"]]

        def cell(key: str, runs: list[dict[str, Any]] = runs) -> str:
            return " / ".join(f"{x[key]:,}" for x in runs)

        lines.append(f"| {name} | {cell('tokens_s')} | {cell('req_s')} | {cell('p50_ms')} | "
                     f"{cell('p99_ms')} | {cell('padding_efficiency')} |")  # fmt: skip
    for key, better in (("tokens_s", "higher"), ("p50_ms", "lower"), ("p99_ms", "lower")):
        ratio = r["ratios"][key]
        lines.append(f"\npacked / padded_buckets, {key}: {ratio}x ({better} is better)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    r: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "callers": args.callers,
                         "when": time.strftime("%Y-%m-%d %H:%M"), "long_share": args.long_share,
                         "rounds": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchd-packed-") as tmp:
        repo = repository(Path(tmp) / "models")
        server = subprocess.Popen(
            [sys.executable, "-m", "batchd.server", "--model-repository", str(repo),
             "--grpc-port", str(PORT), "--metrics-port", str(METRICS), "--http-port", "-1",
             "--workers", "1", "--threads-per-worker", "1", "--log-level", "WARNING",
             "--jobs-dir", str(Path(tmp) / "jobs")],
        )  # fmt: skip
        try:
            with Client(f"127.0.0.1:{PORT}") as c:
                for _ in range(600):
                    if c.ready():
                        break
                    time.sleep(0.1)
            for name in MODELS:  # warm each once, unmeasured
                asyncio.run(drive(name, argparse.Namespace(**{**vars(args), "seconds": 2}), 0))
            for n in range(args.rounds):
                order = MODELS[n % 3 :] + MODELS[: n % 3]
                round_ = {}
                for name in order:
                    round_[name] = asyncio.run(drive(name, args, seed=1000 + n))
                    print(f"round {n + 1} {name}: {round_[name]}", flush=True)
                r["rounds"].append(round_)
        finally:
            server.terminate()
            server.wait(60)

    def mean(name: str, key: str) -> float:
        return statistics.mean(x[name][key] for x in r["rounds"])

    r["ratios"] = {
        key: round(mean("packed", key) / mean("padded_buckets", key), 2)
        for key in ("tokens_s", "p50_ms", "p99_ms")
    }
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(markdown(r))
    return r


if __name__ == "__main__":
    main()
