"""Batch jobs (issue 18): a job's rows per second against the same rows sent by
`batchd bench`, the online p99 with and without a job running, and the
frontend's memory as a job grows from 100k to 1M lines.

One server over examples/models (one worker, one torch thread, as in make bench)
with its own --jobs-dir. In order, alternating the systems --rounds times:
  1. `batchd bench` mlp at --concurrency (its best is taken), then a --lines mlp
     job alone: rows/s is its lines over its finished - started time;
  2. the online mlp p99 at a moderate open-loop rate (--moderate of the best
     req/s): alone, with an mlp job running in the lane behind it, and with no
     job but a busy-loop process (what taking the spare core alone costs);
  3. the frontend's RSS (the server process, not its worker) sampled every
     100 ms through a tiny job of 100k lines and one of 1M lines.

    .venv/bin/python bench/jobs.py [--lines 100000] [--rounds 2] [--json out.json]

With --soak MINUTES it does none of that: it runs tiny jobs of --soak-lines
lines one after another for that long, each beside a trickle of online calls,
and reports the frontend's RSS after each (whether memory grows with the jobs a
server has run: each is kept --jobs-retention-hours, its record in SQLite).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from batchd.client import Client

ROOT = Path(__file__).resolve().parent.parent
PORT = 18195


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_job(path: Path, name: str, width: int, lines: int) -> Path:
    """`lines` request lines of one FP32 row each, values with 3 decimals."""
    rng = np.random.default_rng(0)
    with path.open("wb") as f:
        for start in range(0, lines, 10_000):
            rows = np.round(rng.random((min(10_000, lines - start), width), np.float32), 3)
            f.write(b"".join(
                orjson.dumps({"custom_id": f"r{start + i}", "inputs": [{"name": name,
                              "datatype": "FP32", "shape": [1, width], "data": row}]},
                             option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
                for i, row in enumerate(rows)
            ))  # fmt: skip
    return path


def vm_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Peak:
    """The highest RSS of `pid` while the block runs, sampled every 100 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.mb, self._stop = pid, 0.0, threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.mb = max(self.mb, vm_kb(self.pid, "VmRSS") / 1024)

    def __enter__(self) -> Peak:
        self.mb = vm_kb(self.pid, "VmRSS") / 1024
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_job(c: Client, model: str, path: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    job = c.submit_job(model, path, timeout=600)
    submitted = time.monotonic() - t0
    while not (job := c.job(job.id)).ended:
        time.sleep(0.2)
    rows_s = job.done / max(job.finished_at - job.started_at, 1e-9)
    run_s = round(job.finished_at - job.started_at, 2)
    return {"lines": job.total, "status": job.status, "submit_s": round(submitted, 2),
            "run_s": run_s, "rows_s": round(rows_s)}  # fmt: skip


def bench(url: str, args: list[str], seconds: float) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "batchd.client.bench", "--url", url, "--model", "mlp", *args,
             "--duration", str(seconds), "--warmup", "1", "--json", out.name, "--quiet"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return list(json.loads(Path(out.name).read_text())["levels"])


def online_with_job(c: Client, url: str, job_file: Path, rate: float, seconds: float) -> float:
    """The online p99 at `rate` while an mlp job runs behind it (cancelled after)."""
    job = c.submit_job("mlp", job_file, timeout=600)
    while c.job(job.id).status != "running":
        time.sleep(0.05)
    level = bench(url, ["--rate", str(rate)], seconds)[0]
    running = c.job(job.id)
    c.cancel_job(job.id)
    assert running.status == "running", "the job ended before the online load did"
    return float(level["p99_ms"])


def busy_loop(url: str, rate: float, seconds: float) -> float:
    """The online p99 at `rate` with no job, while another process spins on a core."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        return float(bench(url, ["--rate", str(rate)], seconds)[0]["p99_ms"])
    finally:
        hog.kill()
        hog.wait()


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    mlp = write_job(tmp / "mlp.jsonl", "INPUT0", 512, args.lines)
    r: dict[str, Any] = {
        "cpu": cpu_model(),
        "lines": args.lines,
        "mlp_file_mb": round(mlp.stat().st_size / 2**20),
    }
    serve = [
        sys.executable, "-m", "batchd.server", "--model-repository", "examples/models",
        "--workers", "1", "--threads-per-worker", "1", "--grpc-port", str(PORT),
        "--metrics-port", "-1", "--log-level", "WARNING", "--jobs-dir", str(tmp / "jobs"),
        "--jobs-max-file-bytes", str(8 * 2**30),
    ]  # fmt: skip
    url = f"127.0.0.1:{PORT}"
    proc = subprocess.Popen(serve, cwd=ROOT)
    try:
        with Client(url) as c:
            while not c.ready():
                time.sleep(0.1)
            rounds = []
            for _ in range(args.rounds):
                levels = bench(url, ["--concurrency", args.concurrency], args.seconds)
                best = max(levels, key=lambda lv: lv["throughput"])
                with Peak(proc.pid) as peak:
                    job = run_job(c, "mlp", mlp)
                ratio = round(job["rows_s"] / best["throughput"], 3)
                rounds.append({"bench_best_req_s": round(best["throughput"]), "job": job,
                               "bench_best_concurrency": best["load"], "ratio": ratio,
                               "job_rss_peak_mb": round(peak.mb)})  # fmt: skip
            r["throughput"] = rounds
            best = statistics.mean(x["bench_best_req_s"] for x in rounds)
            rate = round(best * args.moderate)
            online = []
            for _ in range(args.rounds):
                alone = bench(url, ["--rate", str(rate)], args.seconds)[0]["p99_ms"]
                with_job = online_with_job(c, url, mlp, rate, args.seconds)
                hogged = busy_loop(url, rate, args.seconds)
                online.append({"alone_p99_ms": alone, "with_job_p99_ms": with_job,
                               "with_busy_loop_p99_ms": hogged})  # fmt: skip
            r["online"] = {"rate": rate, "rounds": online}
            idle = vm_kb(proc.pid, "VmRSS") / 1024
            memory = {"idle_mb": round(idle)}
            for lines in (100_000, 1_000_000):
                tiny = write_job(tmp / f"tiny{lines}.jsonl", "INPUT0", 16, lines)
                with Peak(proc.pid) as peak:
                    job = run_job(c, "tiny", tiny)
                memory[str(lines)] = {"peak_mb": round(peak.mb), "rows_s": job["rows_s"],
                                      "file_mb": round(tiny.stat().st_size / 2**20)}  # fmt: skip
                tiny.unlink()
            r["memory"] = memory
    finally:
        proc.terminate()
        proc.wait(60)
    return r


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Jobs back to back for args.soak minutes; the frontend's RSS after each."""
    tiny = write_job(tmp / "tiny.jsonl", "INPUT0", 16, args.soak_lines)
    serve = [
        sys.executable, "-m", "batchd.server", "--model-repository", "examples/models",
        "--workers", "1", "--grpc-port", str(PORT), "--metrics-port", "-1",
        "--log-level", "WARNING", "--jobs-dir", str(tmp / "jobs"),
    ]  # fmt: skip
    proc = subprocess.Popen(serve, cwd=ROOT)
    samples: list[dict[str, float]] = []
    try:
        with Client(f"127.0.0.1:{PORT}") as c:
            while not c.ready():
                time.sleep(0.1)
            x = {"INPUT0": np.ones((1, 16), np.float32)}
            start = time.monotonic()
            while time.monotonic() - start < args.soak * 60:
                job = c.submit_job("tiny", tiny, timeout=600)
                while not (job := c.job(job.id)).ended:
                    c.infer("tiny", x)  # the online trickle beside it
                    time.sleep(0.05)
                assert job.status == "completed", job
                samples.append({"minute": round((time.monotonic() - start) / 60, 2),
                                "rss_mb": round(vm_kb(proc.pid, "VmRSS") / 1024, 1)})  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    return {"cpu": cpu_model(), "lines": args.soak_lines, "jobs": len(samples),
            "samples": samples}  # fmt: skip


def soak_markdown(r: dict[str, Any]) -> str:
    s = r["samples"]
    picks = sorted({0, len(s) // 4, len(s) // 2, 3 * len(s) // 4, len(s) - 1})
    rows = [f"| {s[i]['minute']:.1f} | {i + 1} | {s[i]['rss_mb']} |" for i in picks]
    return "\n".join([f"Frontend RSS over {r['jobs']} tiny jobs of {r['lines']:,} lines on "
                      f"{r['cpu']}:", "", "| minute | jobs run | RSS MB |", "|---|---|---|",
                      *rows])  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"Batch jobs on {r['cpu']}: an mlp job of {r['lines']:,} lines ({r['mlp_file_mb']} MB) "
        "against `batchd bench` at its best concurrency, alternating:",
        "",
        "| round | bench best req/s (c) | job rows/s | job / bench | job submit s "
        "| frontend RSS peak MB |",
        "|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(r["throughput"], 1):
        job = x["job"]
        lines.append(
            f"| {i} | {x['bench_best_req_s']:,} ({x['bench_best_concurrency']:g}) | "
            f"{job['rows_s']:,} | {x['ratio']:.2f} | {job['submit_s']} | {x['job_rss_peak_mb']} |"
        )
    o = r["online"]
    lines += ["", f"Online mlp p99 at {o['rate']:,} req/s (open loop): alone, with a job "
              "running, and with no job but a busy-loop process taking a core:", "",
              "| round | alone p99 ms | with a job p99 ms | with a busy loop p99 ms |",
              "|---|---|---|---|"]  # fmt: skip
    for i, x in enumerate(o["rounds"], 1):
        lines.append(
            f"| {i} | {x['alone_p99_ms']:.2f} | {x['with_job_p99_ms']:.2f} "
            f"| {x['with_busy_loop_p99_ms']:.2f} |"
        )
    m = r["memory"]
    lines += ["", f"Frontend RSS, idle {m['idle_mb']} MB; peak during a tiny job of:", "",
              "| lines | file MB | peak RSS MB | rows/s |", "|---|---|---|---|"]  # fmt: skip
    for n in ("100000", "1000000"):
        lines.append(f"| {int(n):,} | {m[n]['file_mb']} | {m[n]['peak_mb']} | {m[n]['rows_s']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=100_000, help="lines of the mlp job")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0, help="per batchd bench level")
    p.add_argument("--concurrency", default="16,32,64", help="batchd bench levels")
    p.add_argument("--moderate", type=float, default=0.5, help="share of the best req/s")
    p.add_argument("--json", type=Path)
    p.add_argument("--soak", type=float, help="minutes of jobs back to back, RSS after each")
    p.add_argument("--soak-lines", type=int, default=20_000, help="lines of each --soak job")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchd-jobs-bench-") as tmp:
        r = soak(args, Path(tmp)) if args.soak else measure(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(soak_markdown(r) if args.soak else markdown(r))
    return r


if __name__ == "__main__":
    main()
