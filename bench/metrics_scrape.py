"""What a /metrics scrape costs the requests of a server with many models.

A server of `--models` small models (each doubles its input) takes an open-loop
load of `--rate` requests a second on one model (`batchd bench --rate`), while
another process scrapes /metrics every `--every` seconds, once the server is ready
and warmed by 3 s of a light load; then the same load with
no scrape. The two alternate, `--rounds` times. Each line gives the load's
latency and the scrapes' wall time. `--code DIR` (repeatable) also runs another
checkout's batchd (DIR holds its server/, worker/, protos/, client/), alternating
with this one, to compare revisions in one run.

    .venv/bin/python bench/metrics_scrape.py [--models 1500] [--rate 400] [--every 5] [--code DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

TOML = """max_batch_size = 32
[[input]]
name = "INPUT0"
datatype = "FP32"
shape = [16]
[[output]]
name = "OUTPUT0"
datatype = "FP32"
shape = [16]
"""
MODEL = "def load(device):\n    return lambda x: x * 2\n"
SCRAPER = """import sys, time, urllib.request
url, every, until = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
while time.time() < until:
    t = time.monotonic()
    n = len(urllib.request.urlopen(url, timeout=30).read())
    print(f"{time.monotonic() - t:.4f} {n}", flush=True)
    time.sleep(every)
"""


def ready(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    """Until ServerReady says every model is loaded on the worker."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(600):
            if server.poll() is not None:
                sys.exit(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    sys.exit(f"the server was not ready in 300 s: {log}")


def load(args: argparse.Namespace, env: dict[str, str], rate: float, seconds: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "batchd.client.bench", "--url", f"127.0.0.1:{args.port}",
             "--model", "m00001", "--rate", str(rate), "--connections", "4",
             "--duration", str(seconds), "--quiet", "--json", out.name],
            env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        level: dict = json.loads(Path(out.name).read_text())["levels"][0]
        return level


def run(args: argparse.Namespace, repo: Path, env: dict[str, str], scraping: bool) -> str:
    metrics, log = args.port + 2, repo.parent / "server.log"
    with open(log, "wb") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "batchd.server", "--model-repository", str(repo),
             "--grpc-port", str(args.port), "--metrics-port", str(metrics), "--http-port", "-1",
             "--workers", "1", "--log-level", "WARNING"],
            env=env, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    scraper = None
    try:
        ready(args.port, server, log)
        load(args, env, 50, 3)  # the worker's first calls, and the model's, out of the figures
        until = time.time() + args.duration
        scraper = subprocess.Popen(
            [sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{metrics}/metrics",
             str(args.every), str(until)],
            stdout=subprocess.PIPE, text=True,
        ) if scraping else None  # fmt: skip
        level = load(args, env, args.rate, args.duration)
        took = ""
        if scraper is not None:
            lines = [line.split() for line in scraper.communicate()[0].splitlines()]
            times = sorted(float(t) * 1000 for t, _ in lines) or [float("nan")]
            took = (f"; {len(lines)} scrapes of {int(lines[0][1]) / 1e6 if lines else 0:.1f} MB, "
                    f"{times[0]:.0f}-{times[-1]:.0f} ms")  # fmt: skip
        return (f"{'scraped' if scraping else 'none':7} {level['throughput']:,.0f} req/s, p50 "
                f"{level['p50_ms']:.1f} ms, p99 {level['p99_ms']:.1f} ms{took}")  # fmt: skip
    finally:
        if scraper is not None and scraper.poll() is None:
            scraper.kill()
        server.terminate()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=400)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between scrapes")
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18700, help="gRPC's; /metrics takes PORT+2")
    ap.add_argument("--code", type=Path, action="append", default=[],
                    help="another checkout's batchd to run too")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp, "models")
        for i in range(args.models):
            (repo / f"m{i:05}").mkdir(parents=True)
            (repo / f"m{i:05}" / "model.toml").write_text(TOML)
            (repo / f"m{i:05}" / "model.py").write_text(MODEL)
        systems = {"this": dict(os.environ)}
        for i, code in enumerate(args.code):  # (found on PYTHONPATH before the installed one)
            Path(tmp, f"code{i}").mkdir()
            Path(tmp, f"code{i}", "batchd").symlink_to(code.resolve())
            path = os.pathsep.join([str(Path(tmp, f"code{i}")), os.environ.get("PYTHONPATH", "")])
            systems[str(code)] = {**os.environ, "PYTHONPATH": path}
        print(f"{args.models} models, {args.rate:.0f} req/s offered for {args.duration:.0f} s, "
              f"a scrape every {args.every:g} s", flush=True)  # fmt: skip
        for _ in range(args.rounds):
            for name, env in systems.items():
                for scraping in (True, False):
                    print(f"{name}: {run(args, repo, env, scraping)}", flush=True)


if __name__ == "__main__":
    main()
