"""Where one request's time goes when batchd is idle (concurrency 1).

At one caller nothing is batched and nothing is amortized: every request pays
the whole path, and the machine sleeps between requests, so the code runs with
cold caches. This measures the parts that do not depend on gRPC:

  model        the model alone at batch 1, one torch thread: back to back, and
               after `--idle-ms` of sleep (as between a lone caller's requests)
  worker       a real `batchd worker` process on a private ipc:// socket, sent
               one-row BATCH messages `--idle-ms` apart: the round trip, the
               worker's own compute time (run_batch, as it reports it) and the
               difference (ZeroMQ both ways and the worker's thread hand-offs)
  zeromq       a bare DEALER echo process on the same kind of socket: the round
               trip ZeroMQ itself costs, which no worker design removes
  cold python  parsing one wire header, back to back and after the idle gap

Compare with `make bench`: its echo server at concurrency 1 is the gRPC part,
its unbatched floor the model inline in that server.

    .venv/bin/python bench/idle_latency.py [--model mlp] [--idle-ms 3] [--count 400] [--json F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zmq

from batchd.protos import wire
from batchd.protos.repository import find_model
from batchd.worker.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "examples" / "models"
ns = time.perf_counter_ns
TIMEOUT_MS = 60_000  # a worker or echo process that never answers fails the run, not hangs it


def p50_us(samples: list[int]) -> float:
    return round(statistics.median(samples) / 1e3, 1)


def timed(fn: Callable[[], object], count: int, idle_s: float) -> float:
    """Median µs of fn(), called `count` times with `idle_s` of sleep before each."""
    for _ in range(10):
        fn()
    samples = []
    for _ in range(count):
        if idle_s:
            time.sleep(idle_s)
        start = ns()
        fn()
        samples.append(ns() - start)
    return p50_us(samples)


def model_alone(name: str, count: int, idle_s: float) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = find_model(REPOSITORY, name)
    fn = load_model(cfg, torch.device("cpu"))
    x = torch.rand(1, *cfg.inputs[0].shape)
    with torch.inference_mode():
        return {
            "back_to_back_us": timed(lambda: fn(x), count, 0.0),
            "after_idle_us": timed(lambda: fn(x), count, idle_s),
        }


def _batch(name: str, batch_id: int, shape: list[int], row: bytes) -> list[object]:
    header = wire.Header(
        kind=wire.Header.BATCH,
        batch_id=batch_id,
        model=name,
        version="1",
        tensors=[wire.Tensor(name="INPUT0", datatype="FP32", shape=shape)],
    )
    return wire.pack(header, [row])


def _until(router: zmq.Socket, kind: int) -> tuple[bytes, wire.Header]:
    while True:  # heartbeats and the READY may come first
        identity, *parts = router.recv_multipart()
        header, _ = wire.unpack(parts)
        if header.kind == kind:
            return identity, header


def through_worker(name: str, count: int, idle_s: float, endpoint: str) -> dict[str, float]:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    router.bind(endpoint)
    cmd = [sys.executable, "-m", "batchd.worker", "--connect", endpoint, "--threads", "1"]
    cmd += ["--model-repository", str(REPOSITORY), "--log-level", "WARNING"]
    worker = subprocess.Popen(cmd, cwd=ROOT)
    try:
        identity, _ = _until(router, wire.Header.READY)
        load = wire.Header(kind=wire.Header.LOAD, model=name, version="1")
        router.send_multipart([identity, *wire.pack(load)])
        _, loaded = _until(router, wire.Header.LOADED)
        if loaded.error:
            raise RuntimeError(f"the worker could not load {name}: {loaded.error}")
        cfg = find_model(REPOSITORY, name)
        shape = [1, *cfg.inputs[0].shape]
        row = np.random.rand(*shape).astype(np.float32).tobytes()
        trips, computes = [], []
        for i in range(count + 10):
            time.sleep(idle_s)
            start = ns()
            router.send_multipart([identity, *_batch(name, i, shape, row)])
            _, result = _until(router, wire.Header.RESULT)
            if i >= 10:
                trips.append(ns() - start)
                computes.append(result.compute_ns)
        router.send_multipart([identity, *wire.pack(wire.Header(kind=wire.Header.STOP))])
        worker.wait(30)
    finally:
        if worker.poll() is None:
            worker.kill()
        router.close(linger=0)
    return {
        "round_trip_us": p50_us(trips),
        "worker_compute_us": p50_us(computes),
        "transport_and_handoffs_us": p50_us([t - c for t, c in zip(trips, computes, strict=True)]),
    }


def _echo(endpoint: str) -> None:
    dealer = zmq.Context().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send(b"ready")
    while (msg := dealer.recv_multipart()) != [b"stop"]:
        dealer.send_multipart(msg)


def bare_zeromq(count: int, idle_s: float, endpoint: str, size: int) -> float:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    router.bind(endpoint)
    echo = mp.get_context("spawn").Process(target=_echo, args=(endpoint,))
    echo.start()
    identity, _ = router.recv_multipart()
    payload = b"x" * size

    def trip() -> None:
        router.send_multipart([identity, payload])
        router.recv_multipart()

    try:
        return timed(trip, count, idle_s)
    finally:
        router.send_multipart([identity, b"stop"])
        echo.join(10)
        router.close(linger=0)


def cold_python(count: int, idle_s: float) -> dict[str, float]:
    header = wire.Header(
        kind=wire.Header.RESULT,
        batch_id=1,
        model="mlp",
        tensors=[wire.Tensor(name="OUTPUT0", datatype="FP32", shape=[1, 512])],
    )
    parts = [bytes(p) for p in wire.pack(header, [b"\0" * 2048])]
    return {
        "parse_header_back_to_back_us": timed(lambda: wire.unpack(parts), count, 0.0),
        "parse_header_after_idle_us": timed(lambda: wire.unpack(parts), count, idle_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", help="a model of examples/models with one input")
    p.add_argument("--idle-ms", type=float, default=3.0, help="sleep before each request")
    p.add_argument("--count", type=int, default=400, help="requests per measure")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    idle_s = args.idle_ms / 1e3
    with tempfile.TemporaryDirectory(prefix="batchd-idle-") as tmp:
        out = {
            "model": args.model,
            "idle_ms": args.idle_ms,
            "model_alone": model_alone(args.model, args.count, idle_s),
            "worker": through_worker(args.model, args.count, idle_s, f"ipc://{tmp}/w.sock"),
            "bare_zeromq_round_trip_us": bare_zeromq(
                args.count, idle_s, f"ipc://{tmp}/z.sock", size=2048
            ),
            "cold_python": cold_python(args.count, idle_s),
        }
    out["cores"] = os.cpu_count()
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
