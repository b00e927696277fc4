"""batchd against other OIP servers in one run (issue 19), with untuned models.

Serves examples' mlp and tiny from a copy WITHOUT their `[batching]` tables (a
user's model.toml, not one tuned for this benchmark) with batchd's default flags,
beside the echo ceiling (bench/echo_server.py) and every `--peer NAME=URL`
already serving the same models (PyTriton: ../shared/peers/pytriton/serve.sh).
For each point (tiny c=32, mlp c=64, mlp c=1) the systems are measured one after
another under perf_analyzer, in a new order each round, --rounds times. With
each figure: the CPU each process used per request (the server, its children,
perf_analyzer), and the CPU limit those figures imply on this machine:
cores / (CPU per request of all processes together). And the server's main thread
alone: a Python server's event loop runs on one core whatever the machine has, so
1 / (its CPU per request) is a second limit, the one a closed loop meets first.

    .venv/bin/python bench/peers.py --pa PATH [--peer pytriton=127.0.0.1:18001] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from overload import children, children_cpu_s, cpu_s
from run import cpu_model_name, perf_analyzer, running

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
POINTS = (("tiny", 32), ("mlp", 64), ("mlp", 1))
CPU_BY = ("frontends", "worker", "load")
TIMES = "\u00d7"  # the multiplication sign of "1.2x" in the tables


def untuned(into: Path) -> Path:
    """examples' mlp and tiny, their `[batching]` tables removed."""
    for name in ("mlp", "tiny"):
        shutil.copytree(ROOT / "examples" / "models" / name, into / name)
        toml = into / name / "model.toml"
        text = re.sub(r"(?ms)^\[batching\].*?(?=^\[|\Z)", "", toml.read_text())
        toml.write_text(text)
    return into


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:`port` (from `ss`), if any."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True)
    m = re.search(r"pid=(\d+)", out.stdout)
    return int(m.group(1)) if m else None


def measure(pa: str, url: str, model: str, c: int, ms: int, pid: int | None) -> dict[str, Any]:
    r = perf_analyzer(pa, url, model, c, ms, pid)
    if pid is not None:
        cpu = r["cpu_us_per_request"]
        total = sum(cpu.values())
        r["cpu_limit_req_s"] = round((os.cpu_count() or 1) * 1e6 / total) if total else None
        loop = r["loop_us_per_request"]
        r["loop_limit_req_s"] = round(1e6 / loop) if loop else None
    return r


def scrape(port: int, name: str, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^{name}{{model="{model}",version="1"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def frontends(repo: Path, tmp: Path, count: int, seconds: float, rate: int) -> list[dict[str, Any]]:
    """tiny over 8 connections (the kernel spreads connections over the frontends)
    with `--frontends count`, at 32 closed-loop callers, then open-loop at `rate`
    req/s (the same offered load for every N; 0: from this run's closed loop).
    Batches as the first frontend saw them: its own rows per batch, and the rows of
    the forwards that ran them."""
    serve = [PY, "-m", "batchd.server", "--model-repository", str(repo), "--grpc-port",
             "18191", "--metrics-port", "18192", "--log-level", "WARNING",
             "--jobs-dir", str(tmp / f"jobs-f{count}"), "--frontends", str(count)]  # fmt: skip
    names = ("inference_count", "inference_exec_count", "forward_rows")
    got = []
    with running(serve, 18191) as p, tempfile.NamedTemporaryFile(suffix=".json") as out:
        workers = [k for k in children(p.pid) if b"batchd.worker" in _cmdline(k)]
        fronts = [p.pid, *(k for k in children(p.pid) if k not in workers)]
        for load in (["--concurrency", "32"], ["--rate", str(rate)]):
            if load == ["--rate", "0"]:  # half the closed loop's, in hundreds
                rate = max(100, round(got[0]["req_s"] / 200) * 100)
                load[1] = str(rate)
            before = [scrape(18192, f"batchd_{n}_total", "tiny") for n in names]
            cpu = [sum(map(cpu_s, fronts)), sum(map(cpu_s, workers)), children_cpu_s()]
            subprocess.run(
                [PY, "-m", "batchd.client.bench", "--url", "127.0.0.1:18191", "--model", "tiny",
                 *load, "--connections", "8", "--duration", str(seconds),
                 "--json", out.name, "--quiet"],
                cwd=ROOT, check=True, capture_output=True,
            )  # fmt: skip
            rows, batches, forward = (
                scrape(18192, f"batchd_{n}_total", "tiny") - b
                for n, b in zip(names, before, strict=True)
            )
            level = json.loads(Path(out.name).read_text())["levels"][0]
            cpu = [sum(map(cpu_s, fronts)) - cpu[0], sum(map(cpu_s, workers)) - cpu[1],
                   children_cpu_s() - cpu[2]]  # fmt: skip
            us = [round(c * 1e6 / max(1, level["ok"])) for c in cpu]
            got.append({"frontends": count, "load": " ".join(load).lstrip("-"), "rate": rate,
                        "req_s": round(level["throughput"]), "own_batch": round(rows / batches, 1),
                        "forward_batch": round(forward / batches, 1),
                        "cpu_us_per_request": dict(zip(CPU_BY, us, strict=True))})  # fmt: skip
    return got


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def systems_rounds(
    args: argparse.Namespace, peers: dict[str, str], repo: Path, tmp: Path
) -> list[dict[str, Any]]:
    """Each point under perf_analyzer for the echo server, batchd and every peer, in a
    new order each round."""
    rounds: list[dict[str, Any]] = []
    serve = [PY, "-m", "batchd.server", "--model-repository", str(repo), "--grpc-port",
             "18191", "--metrics-port", "-1", "--log-level", "WARNING",
             "--jobs-dir", str(tmp / "jobs")]  # fmt: skip
    echo = [PY, "bench/echo_server.py", "--port", "18190"]
    with running(echo, 18190) as e, running(serve, 18191) as b:
        systems = {"echo": ("127.0.0.1:18190", e.pid), "batchd": ("127.0.0.1:18191", b.pid)}
        for name, url in peers.items():
            systems[name] = (url, listening_pid(int(url.rsplit(":", 1)[1])))
        for n in range(args.rounds):
            order = list(systems)[n % len(systems) :] + list(systems)[: n % len(systems)]
            round_: dict[str, Any] = {}
            for model, c in POINTS:
                point = round_.setdefault(f"{model}_c{c}", {})
                for name in order:
                    if name == "echo" and c == 1:
                        continue
                    url, pid = systems[name]
                    point[name] = measure(args.pa, url, "echo" if name == "echo" else model,
                                          c, args.interval_ms, pid)  # fmt: skip
                    print(f"round {n + 1} {model} c={c} {name}: {point[name]['req_s']:,.0f} "
                          f"req/s p50 {point[name]['p50_ms']:.2f} ms", flush=True)  # fmt: skip
            rounds.append(round_)
    return rounds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pa", required=True, help="perf_analyzer")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval-ms", type=int, default=4000)
    p.add_argument("--frontends", default="1,2,4", help="--frontends N to measure tiny with")
    p.add_argument("--frontends-only", action="store_true", help="measure only --frontends N")
    p.add_argument("--json", type=Path)
    p.add_argument("--md", type=Path, help="also write the tables here (bench/results/peers.md)")
    args = p.parse_args(argv)
    peers = dict(x.split("=", 1) for x in args.peer)
    r: dict[str, Any] = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "when":
                         time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchd-peers-") as tmp:
        repo = untuned(Path(tmp) / "models")
        if not args.frontends_only:
            r["rounds"] = systems_rounds(args, peers, repo, Path(tmp))
        counts = [int(n) for n in args.frontends.split(",") if n]
        r["frontends"], rate = [], 0
        for _ in range(args.rounds):
            for n in counts:
                r["frontends"] += frontends(repo, Path(tmp), n, 5.0, rate)
                rate = rate or r["frontends"][-1]["rate"]
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(text := markdown(r))
    if args.md:
        args.md.write_text(text + "\n")
    return r


def _mean(r: dict[str, Any], point: str, system: str, key: str) -> float | None:
    values = [x[point][system][key] for x in r["rounds"] if system in x[point]]
    return sum(values) / len(values) if values else None


def markdown(r: dict[str, Any]) -> str:
    lines = _systems(r) if r["rounds"] else [f"{r['cpu']}, {r['cores']} cores"]
    if r.get("frontends"):
        lines += ["", "tiny over 8 connections (`batchd bench`), `--frontends N`, 32 closed-loop "
                  "callers and then one open-loop rate for every N; rows per batch as the first "
                  "frontend sent them, and per forward (a worker of several frontends runs "
                  "their batches as one: worker/gather.py); the last column: rows per forward "
                  "against N = 1 at the same load, same round:", "",
                  "| N | load | req/s | rows per batch | rows per forward | forward / N = 1 "
                  "| CPU µs/request: frontends / worker / load |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        one: dict[str, float] = {}
        for f in r["frontends"]:
            if f["frontends"] == 1:
                one[f["load"]] = f["forward_batch"]
            base = one.get(f["load"])
            ratio = f"{f['forward_batch'] / base:.2f}{TIMES}" if base else "-"
            cpu = " / ".join(str(v) for v in f["cpu_us_per_request"].values())
            lines.append(f"| {f['frontends']} | {f['load']} | {f['req_s']:,} | {f['own_batch']} "
                         f"| {f['forward_batch']} | {ratio} | {cpu} |")  # fmt: skip
    return "\n".join(lines)


def _systems(r: dict[str, Any]) -> list[str]:
    systems = list(dict.fromkeys(s for x in r["rounds"] for p in x.values() for s in p))
    peers = [s for s in systems if s not in ("echo", "batchd")]
    lines = [
        f"batchd (untuned models: no `[batching]` table; default flags) against "
        f"{', '.join(peers) or 'no peer'} and the echo ceiling; {r['cpu']}, {r['cores']} "
        f"cores; {len(r['rounds'])} rounds, alternating; req/s per round (p50 ms at c=1).",
        "",
        "| point | " + " | ".join(systems) + " | batchd / echo | "
        + " | ".join(f"batchd / {p}" for p in peers) + " |",
        "|---" * (len(systems) + 2 + len(peers)) + "|",
    ]  # fmt: skip
    for point in r["rounds"][0]:
        key = "p50_ms" if point.endswith("_c1") else "req_s"
        cells = []
        for s in systems:
            got = [x[point][s][key] for x in r["rounds"] if s in x[point]]
            cells.append(
                " / ".join(f"{v:,.2f}" if key == "p50_ms" else f"{v:,.0f}" for v in got) or "-"
            )
        b, e = _mean(r, point, "batchd", key), _mean(r, point, "echo", key)
        ratios = [f"{b / e:.2f}{TIMES}" if b and e else "-"]
        ratios += [
            f"{b / m:.2f}{TIMES}" if b and (m := _mean(r, point, p, key)) else "-" for p in peers
        ]
        lines.append(f"| {point.replace('_c', ' c=')} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "CPU per request (µs: server / its children / perf_analyzer) and the limit it "
              "implies (cores / their sum); then the server's main thread (its event loop) "
              "alone, the limit it implies (1 / its CPU per request) and the share of that "
              "limit reached; first round:", "",
              "| point | " + " | ".join(systems) + " |",
              "|---" * (len(systems) + 1) + "|"]  # fmt: skip
    for point, by in r["rounds"][0].items():
        cells = []
        for s in systems:
            m = by.get(s)
            cpu = m and m.get("cpu_us_per_request")
            if not cpu:
                cells.append("-")
                continue
            cell = f"{cpu['frontend']} / {cpu['worker']} / {cpu['load']} "
            cell += f"(limit {m['cpu_limit_req_s']:,})"
            loop = m.get("loop_limit_req_s")
            if loop and 2 * m["loop_us_per_request"] >= cpu["frontend"]:  # not Triton's C++
                cell += f"; loop {m['loop_us_per_request']} (limit {loop:,}, "
                cell += f"{m['req_s'] / loop:.0%})"
            cells.append(cell)
        lines.append(f"| {point.replace('_c', ' c=')} | " + " | ".join(cells) + " |")
    for point, by in r["rounds"][0].items():
        b, e = by.get("batchd"), by.get("echo")
        if b and e and b.get("loop_limit_req_s") and e.get("loop_limit_req_s"):
            lines += ["", f"{point.replace('_c', ' c=')}: batchd's loop thread busy all the "
                      f"time would give {b['loop_limit_req_s'] / e['req_s']:.2f}{TIMES} the echo "
                      f"server's req/s; as busy as echo's ({e['req_s'] / e['loop_limit_req_s']:.0%}"
                      f" of its limit), {e['loop_us_per_request'] / b['loop_us_per_request']:.2f}"
                      f"{TIMES}."]  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
