"""Large JSON documents against everyone else's latency: what a parse of an inference
header or a job line of megabytes (the most either may be: 8 MiB) costs the other
callers of the same frontend (server/parser.py parses such documents in a child).

One server (one worker) over a model `bigsum` (FP32 [-1, 4], no batching: it sums
its input) and tiny. A probe calls tiny every 20 ms over gRPC on its own thread
while, in turn:
  1. --bodies HTTP inferences of bigsum, each a JSON body of --rows x 4 numbers in
     nested lists (~7 MB at 90,000 rows), one after another;
  2. a job of --bodies such lines.
Reported: the probe's p50, p99 and slowest call in each phase, with none as the
baseline, the phase's seconds (the bodies one after another; the job's run) and
the frontend's RSS after each.

    .venv/bin/python bench/big_json.py [--rows 90000] [--bodies 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from batchd.client import Client

ROOT = Path(__file__).resolve().parent.parent
PORT, HTTP_PORT = 18231, 18232
BIGSUM_TOML = """
[[input]]
name = "X"
datatype = "FP32"
shape = [-1, 4]

[[output]]
name = "SUM"
datatype = "FP32"
shape = [1]
"""
BIGSUM_PY = """
import numpy as np, torch

def load(device):
    return lambda x: {"SUM": torch.tensor([float(np.asarray(x).sum())])}
"""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


class Probe:
    """tiny every 20 ms on a thread; the latencies of the calls made while it ran."""

    def __init__(self, c: Client) -> None:
        self._c, self._stop, self.ms = c, threading.Event(), []
        self._x = np.arange(16, dtype=np.float32).reshape(1, 16)

    def __enter__(self) -> Probe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._c.infer("tiny", {"INPUT0": self._x}, timeout=5)
            took = time.perf_counter() - t0
            self.ms.append(1000 * took)
            self._stop.wait(max(0.0, 0.02 - took))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        ms = np.array(self.ms)
        return {"calls": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 1),
                "p99_ms": round(float(np.percentile(ms, 99)), 1),
                "max_ms": round(float(ms.max()), 1)}  # fmt: skip


def phases(c: Client, pid: int, body: bytes, job: Path, bodies: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Probe(c) as p:
        time.sleep(3)
    out["none"] = p.summary()
    url = f"http://127.0.0.1:{HTTP_PORT}/v2/models/bigsum/infer"
    t0 = time.monotonic()
    with Probe(c) as p:
        for _ in range(bodies):
            rq = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(rq, timeout=120) as r:
                r.read()
    out["http"] = {**p.summary(), "rss_mb": rss_mb(pid), "s": round(time.monotonic() - t0, 2)}
    j = c.submit_job("bigsum", job, timeout=300)  # (uploaded before the probe: it runs)
    with Probe(c) as p:
        while not (j := c.job(j.id)).ended:
            time.sleep(0.1)
    assert j.status == "completed" and j.done == bodies, j
    run_s = round(j.finished_at - j.started_at, 2)
    out["job"] = {**p.summary(), "rss_mb": rss_mb(pid), "s": run_s}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=90_000)
    ap.add_argument("--bodies", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="batchd-bigjson-"))
    try:
        repo = tmp / "models"
        shutil.copytree(ROOT / "examples/models/tiny", repo / "tiny")
        (repo / "bigsum").mkdir()
        (repo / "bigsum/model.toml").write_text(BIGSUM_TOML)
        (repo / "bigsum/model.py").write_text(BIGSUM_PY)
        rows = np.random.default_rng(0).random((args.rows, 4), np.float32).round(6).tolist()
        tensor = {"name": "X", "datatype": "FP32", "shape": [args.rows, 4], "data": rows}
        body = orjson.dumps({"inputs": [tensor]})
        job = tmp / "job.jsonl"
        job.write_bytes(b"".join(orjson.dumps({"custom_id": f"c{i}", "inputs": [tensor]}) + b"\n"
                                 for i in range(args.bodies)))  # fmt: skip
        serve = [sys.executable, "-m", "batchd.server", "--model-repository", str(repo),
                 "--workers", "1", "--grpc-port", str(PORT), "--http-port", str(HTTP_PORT),
                 "--metrics-port", "-1", "--log-level", "WARNING",
                 "--jobs-dir", str(tmp / "jobs")]  # fmt: skip
        proc = subprocess.Popen(serve, cwd=ROOT)
        try:
            with Client(f"127.0.0.1:{PORT}") as c:
                while not c.ready():
                    time.sleep(0.1)
                r = {"cpu": cpu_model(), "body_mb": round(len(body) / 1e6, 1),
                     "rounds": [phases(c, proc.pid, body, job, args.bodies)
                                for _ in range(args.rounds)]}  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(r, indent=1))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
