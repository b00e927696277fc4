"""Reloads beside serving: how much one model's throughput loses while another
model on the same worker is reloaded over and over (model control, explicit).

Serves the example models (`--model-control explicit`, one worker), then runs
`--callers` closed-loop callers of `--model` for `--seconds`: once quiet, once
while another thread reloads `--reload` (a new version each time) at `--rate`
loads a second, and quiet again. A reload's new version loads on the worker's
loader thread, and the old one's unload frees its memory; both share the
worker's cores (and GIL) with the batches being served.

    .venv/bin/python bench/reloads.py [--rate 5] [--seconds 8] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from batchd.client import AsyncClient, Client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from big_json import cpu_model  # noqa: E402


def serve(port: int, models: list[str], jobs: str) -> subprocess.Popen[bytes]:
    loads = [arg for m in models for arg in ("--load-model", m)]
    return subprocess.Popen(
        [sys.executable, "-m", "batchd.server", "--model-repository",
         str(ROOT / "examples" / "models"), "--grpc-port", str(port), "--http-port", "0",
         "--metrics-port", "0", "--model-control", "explicit", "--log-level", "WARNING",
         "--jobs-dir", jobs, *loads],
        cwd=ROOT,
    )  # fmt: skip


def wait_ready(url: str, models: list[str], timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    with Client(url) as c:
        while time.monotonic() < end:
            try:
                if all(c.model_ready(m) for m in models):
                    return
            except Exception:  # not up yet
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{models} not ready after {timeout} s")


async def closed_loop(url: str, model: str, callers: int, seconds: float) -> float:
    """Requests a second from `callers` callers, one row each, for `seconds`."""
    x = np.random.default_rng(0).random((1, 512), dtype=np.float32)
    done = 0
    async with AsyncClient(url) as c:

        async def caller() -> None:
            nonlocal done
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await c.infer(model, {"INPUT0": x})
                done += 1

        await asyncio.gather(*(caller() for _ in range(callers)))
    return done / seconds


def reload_at(url: str, model: str, rate: float, stop: threading.Event, made: list[int]) -> None:
    with Client(url) as c:
        while not stop.is_set():
            began = time.monotonic()
            c.load_model(model)
            made[0] += 1
            stop.wait(max(0.0, 1 / rate - (time.monotonic() - began)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=18051)
    ap.add_argument("--model", default="mlp", help="the model served (its input: INPUT0, 512)")
    ap.add_argument("--reload", default="tiny", help="the model reloaded")
    ap.add_argument("--rate", type=float, default=5.0, help="reloads a second")
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    url = f"127.0.0.1:{args.port}"
    jobs = tempfile.TemporaryDirectory(prefix="batchd-reloads-")
    server = serve(args.port, [args.model, args.reload], jobs.name)
    try:
        wait_ready(url, [args.model, args.reload])
        quiet = asyncio.run(closed_loop(url, args.model, args.callers, args.seconds))
        stop, made = threading.Event(), [0]
        reloading = (url, args.reload, args.rate, stop, made)
        reloader = threading.Thread(target=reload_at, args=reloading)
        began = time.monotonic()
        reloader.start()
        try:
            busy = asyncio.run(closed_loop(url, args.model, args.callers, args.seconds))
        finally:
            stop.set()
            reloader.join()
        rate = made[0] / (time.monotonic() - began)
        after = asyncio.run(closed_loop(url, args.model, args.callers, args.seconds))
    finally:
        server.terminate()
        server.wait()
        jobs.cleanup()
    result = {
        "cpu": cpu_model(),
        "model": args.model, "callers": args.callers, "quiet_req_s": round(quiet, 1),
        "reloading_req_s": round(busy, 1), "reloads_per_s": round(rate, 2),
        "quiet_after_req_s": round(after, 1), "ratio": round(busy / quiet, 3),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
