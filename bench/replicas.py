"""Replicas behind haproxy (issue 21): throughput of three against one, and what each
failure scenario costs, in one run.

Each replica is `batchd serve` over examples/models (one worker, one torch thread)
in its own cgroup-v1 CPU group capped at --cpu cores (0: uncapped), so that the
scaling shows on a small machine; haproxy and nginx use deploy/render.py's
configurations. perf_analyzer drives tiny at concurrency 32 through haproxy.
Scenarios, under 8 callers sharing one channel: spread of 300 sequential calls,
SIGKILL of a replica (haproxy, then nginx), SIGTERM of a replica (drain time =
SIGTERM to exit).

    .venv/bin/python bench/replicas.py --pa PATH [--cpu 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from batchd.client import BatchdClientError, Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deploy"))
import render
from run import cpu_model_name, perf_analyzer

ROOT = Path(__file__).resolve().parent.parent
CGROUP = Path("/sys/fs/cgroup/cpu")
TINY = np.zeros((1, 16), np.float32)
TIMES = "\u00d7"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    def __init__(self, port: int, cpu: float, tmp: Path, name: str) -> None:
        self.port, self.url = port, f"127.0.0.1:{port}"
        serve = [sys.executable, "-m", "batchd.server", "--model-repository", "examples/models",
                 "--grpc-port", str(port), "--http-port", "-1", "--metrics-port", "-1",
                 "--workers", "1", "--threads-per-worker", "1", "--log-level", "WARNING",
                 "--jobs-dir", str(tmp / f"jobs-{name}")]  # fmt: skip
        self.group = None
        if cpu > 0:
            self.group = CGROUP / f"batchd-bench-{name}"
            self.group.mkdir(exist_ok=True)
            (self.group / "cpu.cfs_period_us").write_text("100000")
            (self.group / "cpu.cfs_quota_us").write_text(str(int(cpu * 100000)))
            procs = self.group / "cgroup.procs"
            serve = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *serve]
        self.proc = subprocess.Popen(serve, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip

    def ready(self) -> None:
        end = time.monotonic() + 120
        with Client(self.url) as c:
            while True:
                with contextlib.suppress(BatchdClientError):
                    if c.ready():
                        return
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError(f"replica on {self.port} did not get ready")
                time.sleep(0.1)

    def count(self) -> int:
        with Client(self.url) as c:
            return c.model_statistics("tiny")[0].inference_count

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        if self.group is not None:
            with contextlib.suppress(OSError):
                self.group.rmdir()


@contextlib.contextmanager
def balancer(kind: str, replicas: list[Replica], tmp: Path) -> Iterator[str]:
    port = _port()
    urls = [r.url for r in replicas]
    if kind == "haproxy":
        (tmp / "haproxy.cfg").write_text(render.haproxy(f"127.0.0.1:{port}", urls))
        cmd = [
            shutil.which("haproxy") or "/usr/sbin/haproxy",
            "-db",
            "-f",
            str(tmp / "haproxy.cfg"),
        ]
    else:
        (tmp / "nginx.conf").write_text(render.nginx(f"127.0.0.1:{port}", urls))
        cmd = [shutil.which("nginx") or "/usr/sbin/nginx", "-p", str(tmp), "-c",
               str(tmp / "nginx.conf"), "-g", "daemon off;"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"127.0.0.1:{port}"
    try:
        with Client(url) as c:
            end = time.monotonic() + 30
            while True:  # every replica UP: a call lands on each in turn
                with contextlib.suppress(BatchdClientError):
                    if all(c.live() for _ in range(2 * len(replicas))):
                        break
                if time.monotonic() > end:
                    raise RuntimeError(f"{kind} did not pass calls")
                time.sleep(0.2)
        time.sleep(1.5)  # health checks: every replica seen UP (rise 2 x 500 ms)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def under_load(url: str, seconds: float, act: Any) -> tuple[Counter[str], float]:
    """8 callers on one channel for `seconds`; `act()` after 1.5 s. Outcomes by status."""
    out: Counter[str] = Counter()
    with Client(url) as client:
        client.infer("tiny", TINY)
        end = time.monotonic() + seconds

        def caller() -> None:
            while time.monotonic() < end:
                try:
                    client.infer("tiny", TINY, timeout=20)
                    out["OK"] += 1
                except BatchdClientError as e:
                    out[e.code.name] += 1

        threads = [threading.Thread(target=caller) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        took = act()
        for t in threads:
            t.join()
    return out, took


def throughput(pa: str, url: str, ms: int) -> float:
    return float(perf_analyzer(pa, url, "tiny", 32, ms)["req_s"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pa", required=True)
    p.add_argument("--cpu", type=float, default=0.5, help="cores per replica (0: uncapped)")
    p.add_argument("--interval-ms", type=int, default=4000)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.cpu and not os.access(CGROUP, os.W_OK):
        raise SystemExit(f"cannot create cgroups under {CGROUP}: run as root, or --cpu 0")
    r: dict[str, Any] = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "cap": args.cpu,
                         "when": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchd-replicas-") as t:
        tmp = Path(t)
        replicas = [Replica(_port(), args.cpu, tmp, f"r{i}") for i in range(3)]
        try:
            for rep in replicas:
                rep.ready()
            with balancer("haproxy", replicas[:1], tmp) as url:
                r["one_req_s"] = throughput(args.pa, url, args.interval_ms)
            with balancer("haproxy", replicas, tmp) as url:
                r["three_req_s"] = throughput(args.pa, url, args.interval_ms)
                before = [x.count() for x in replicas]
                with Client(url) as c:
                    for _ in range(300):
                        c.infer("tiny", TINY)
                r["spread_300"] = [x.count() - b for x, b in zip(replicas, before, strict=True)]

                def kill() -> float:
                    replicas[2].proc.kill()
                    return 0.0

                r["haproxy_sigkill"], _ = under_load(url, 5.0, kill)

                def term() -> float:
                    start = time.monotonic()
                    replicas[1].proc.send_signal(signal.SIGTERM)
                    replicas[1].proc.wait(60)
                    return time.monotonic() - start

                r["haproxy_sigterm"], r["drain_s"] = under_load(url, 8.0, term)
            replicas[1] = Replica(replicas[1].port, args.cpu, tmp, "r1b")
            replicas[2] = Replica(replicas[2].port, args.cpu, tmp, "r2b")
            for rep in replicas:
                rep.ready()
            if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
                with balancer("nginx", replicas, tmp) as url:
                    r["nginx_sigkill"], _ = under_load(url, 5.0, kill)
        finally:
            for rep in replicas:
                rep.stop()
    r = {k: dict(v) if isinstance(v, Counter) else v for k, v in r.items()}
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(markdown(r))
    return r


def markdown(r: dict[str, Any]) -> str:
    cap = f"{r['cap']} core each (cgroup v1 CPU quota)" if r["cap"] else "uncapped"
    lines = [
        f"Replicas behind haproxy; {r['cpu']}, {r['cores']} cores; replicas {cap}.",
        "",
        f"- tiny c=32 through haproxy: one replica {r['one_req_s']:,.0f} req/s, three "
        f"{r['three_req_s']:,.0f} req/s ({r['three_req_s'] / r['one_req_s']:.2f}{TIMES})",
        f"- 300 calls over one channel: {r['spread_300']} per replica",
    ]
    for key, what in (("haproxy_sigkill", "SIGKILL of a replica, haproxy"),
                      ("haproxy_sigterm", "SIGTERM (drain) of a replica, haproxy"),
                      ("nginx_sigkill", "SIGKILL of a replica, nginx")):  # fmt: skip
        if key in r:
            got = r[key]
            failed = sum(n for k, n in got.items() if k != "OK")
            total = sum(got.values())
            kinds = ", ".join(f"{k} {n}" for k, n in got.items() if k != "OK") or "none"
            lines.append(f"- {what}: {failed} failed of {total:,} ({kinds})")
    if "drain_s" in r:
        lines.append(f"- drain: SIGTERM to exit {r['drain_s']:.1f} s (--drain-notice 3 s)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
