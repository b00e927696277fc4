"""A poison storm: one client resends a request that ends its worker's process, as
soon as it fails, while a bystander calls another model on the same workers.

Serves two models of its own (a temporary repository): `crashy`, which SIGKILLs
its worker on any X in [600, 700) and doubles X otherwise, and `steps`, a
step-wise bystander of 2 steps. For `--seconds`, the poisoner sends `crashy`
X = 666 (`--inputs same`) or a new X in [600, 700) each time (`--inputs new`);
the bystander calls `steps` every 0.2 s with a 5 s deadline. Reported: the
bystander's calls answered, the workers restarted (`batchd_worker_restarts_total`),
and how the poison requests were answered. `--inputs job` sends the poison as a
batch job instead: `--job-lines` lines, each a new X in [600, 700), and reports
how many lines the job had answered (failed) by the end.

    .venv/bin/python bench/poison_storm.py [--inputs new] [--workers 1] [--json F]

`--server-path DIR` runs the server from another checkout's code (a directory
holding `batchd/`: `git archive REV server worker protos client`), to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

from batchd.client import AsyncClient, Client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from big_json import cpu_model  # noqa: E402

CRASHY = """
import os, signal

def load(device):
    def run(x):
        if ((x >= 600) & (x < 700)).any():
            os.kill(os.getpid(), signal.SIGKILL)
        return x * 2
    return run
"""
CRASHY_TOML = """max_batch_size = 8
[[input]]
name = "X"
datatype = "FP32"
shape = [1]
[[output]]
name = "Y"
datatype = "FP32"
shape = [1]
"""
STEPS = """
import torch

class Steps:
    def start(self, requests):
        return [{"n": int(r["N"][0]), "k": 0} for r in requests]

    def step(self, states):
        out = []
        for s in states:
            s["k"] += 1
            out.append(({"K": torch.tensor([s["k"]])}, s["k"] >= s["n"]))
        return out

def load(device):
    return Steps()
"""
STEPS_TOML = """[[input]]
name = "N"
datatype = "INT64"
shape = [1]
[[output]]
name = "K"
datatype = "INT64"
shape = [1]
[generate]
max_active = 8
max_steps = 16
"""


def repository(root: Path) -> Path:
    for name, code, toml in (("crashy", CRASHY, CRASHY_TOML), ("steps", STEPS, STEPS_TOML)):
        (root / name).mkdir(parents=True)
        (root / name / "model.py").write_text(code)
        (root / name / "model.toml").write_text(toml)
    return root


def restarts(metrics_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(int(float(v)) for v in re.findall(r"^batchd_worker_restarts_total\S* (\S+)$",
                                                  text, re.M))  # fmt: skip


async def storm(url: str, inputs: str, seconds: float, job_lines: int,
                ) -> tuple[Counter[str], Counter[str]]:  # fmt: skip
    poison: Counter[str] = Counter()
    bystander: Counter[str] = Counter()
    end = time.monotonic() + seconds
    new_inputs = inputs == "new"
    async with AsyncClient(url) as c:

        async def poisoner() -> None:
            if inputs == "job":  # every line a new poison
                x = [{"name": "X", "datatype": "FP32", "shape": [1, 1]}]
                lines = [{"custom_id": f"p{i}", "inputs": [{**x[0], "data": [600 + i / 1000]}]}
                         for i in range(job_lines)]  # fmt: skip
                job = await c.submit_job("crashy", lines)
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                job = await c.job(job.id)
                poison.update({f"job {job.status}": 1, "lines failed": job.failed,
                               "lines answered": job.completed})  # fmt: skip
                return
            n = 0
            while time.monotonic() < end:
                x = 600.0 + n % 100 if new_inputs else 666.0
                n += 1
                try:
                    await c.infer("crashy", {"X": np.array([[x]], np.float32)}, timeout=60)
                    poison["answered"] += 1
                except Exception as e:
                    code = getattr(getattr(e, "code", None), "name", type(e).__name__)
                    unrun = "refused unrun" in str(e) or code == "UNAVAILABLE"
                    poison[f"{code} ({'refused unrun' if unrun else 'ran'})"] += 1

        async def caller() -> None:
            while time.monotonic() < end:
                try:
                    out = await c.infer("steps", {"N": np.array([2])}, timeout=5)
                    bystander["answered" if int(out["K"][-1]) == 2 else "wrong"] += 1
                except Exception as e:
                    bystander[getattr(getattr(e, "code", None), "name", type(e).__name__)] += 1
                await asyncio.sleep(0.2)

        await asyncio.gather(poisoner(), caller())
    return poison, bystander


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=18061, help="gRPC; metrics on port + 2")
    ap.add_argument("--inputs", choices=("same", "new", "job"), default="same")
    ap.add_argument("--job-lines", type=int, default=200, help="with --inputs job")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--server-path", type=Path, help="run the server's code from here")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    url, metrics = f"127.0.0.1:{args.port}", args.port + 2
    env = dict(os.environ)
    if args.server_path:
        env["PYTHONPATH"] = str(args.server_path.resolve())
    with tempfile.TemporaryDirectory(prefix="batchd-storm-") as tmp:
        repo = repository(Path(tmp) / "models")
        server = subprocess.Popen(
            [sys.executable, "-m", "batchd.server", "--model-repository", str(repo),
             "--grpc-port", str(args.port), "--http-port", "0", "--metrics-port", str(metrics),
             "--workers", str(args.workers), "--log-level", "ERROR",
             "--jobs-dir", str(Path(tmp) / "jobs")],
            cwd=tmp, env=env,
        )  # fmt: skip
        try:
            with Client(url) as c:
                end = time.monotonic() + 120
                while not (_ready(c, "crashy") and _ready(c, "steps")):
                    if time.monotonic() > end:
                        raise TimeoutError("the models were not ready in 120 s")
                    time.sleep(0.1)
            before = restarts(metrics)
            poison, bystander = asyncio.run(storm(url, args.inputs, args.seconds, args.job_lines))
            ended = restarts(metrics) - before
        finally:
            server.terminate()
            server.wait()
    result = {
        "cpu": cpu_model(), "inputs": args.inputs, "workers": args.workers,
        "seconds": args.seconds, "server": str(args.server_path or "this checkout"),
        "workers_restarted": ended, "bystander_calls": sum(bystander.values()),
        "bystander": dict(bystander), "poison": dict(poison),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _ready(c: Client, model: str) -> bool:
    try:
        return c.model_ready(model)
    except Exception:  # not up yet
        return False


if __name__ == "__main__":
    main()
