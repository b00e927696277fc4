"""HTTP beside gRPC (issue 20): what REST costs per request, that an idle HTTP port
costs gRPC nothing, and what tracing costs off and on, in one run, alternating.

Servers, each serving examples/models with one worker and one torch thread:

    grpc-only   this build, --http-port -1
    default     this build as shipped: HTTP on (idle while gRPC is measured)
    http        the same server, measured over HTTP (perf_analyzer -i http)
    traced      this build, tracing on (OTEL_EXPORTER_OTLP_ENDPOINT) to a collector
                (rotel, with its blackhole exporter) when one is installed, every
                request sampled
    traced-1%   the same, sampling 1% of requests (OTEL_TRACES_SAMPLER=traceidratio)
    base        with --baseline REV: that revision (before HTTP and tracing existed),
                run from a git worktree; the "off costs nothing" comparison

perf_analyzer is the closed-loop load for both protocols (tiny at c=1 and c=32),
with the CPU each request cost the server process.

    .venv/bin/python bench/rest.py --pa PATH [--baseline ac98742] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from run import cpu_model_name, perf_analyzer, running

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
POINTS = (("tiny", 32), ("tiny", 1))
TIMES = "\u00d7"


def _serve(port: int, http_port: int | None, jobs: Path) -> list[str]:
    """The server's command; `http_port` None: a build that has no such flag."""
    http = () if http_port is None else ("--http-port", str(http_port))
    return [
        *(PY, "-m", "batchd.server", "--model-repository", "examples/models"),
        *("--workers", "1", "--threads-per-worker", "1", "--grpc-port", str(port), *http),
        *("--metrics-port", "-1", "--log-level", "WARNING", "--jobs-dir", str(jobs)),
    ]


def _baseline(rev: str, into: Path) -> dict[str, str]:
    """A worktree of `rev` and the environment that makes `batchd` import from it."""
    tree, pkg = into / "tree", into / "pkg" / "batchd"
    subprocess.run(["git", "worktree", "add", "-f", "--detach", str(tree), rev], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    pkg.mkdir(parents=True)
    for d in ("protos", "server", "worker", "client"):
        (pkg / d).symlink_to(tree / d)
    return {"PYTHONPATH": str(into / "pkg")}


def _collector(port: int, log: Path) -> subprocess.Popen[bytes] | None:
    try:
        import rotel
    except ImportError:
        return None
    agent = Path(rotel.__file__).parent / "rotel-agent"
    return subprocess.Popen(
        [str(agent), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{port}",
         "--otlp-http-endpoint", f"127.0.0.1:{port + 1}", "--exporter", "blackhole"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pa", required=True, help="perf_analyzer")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval-ms", type=int, default=4000)
    p.add_argument("--baseline", metavar="REV", help="also measure this git revision")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    r: dict[str, Any] = {"cpu": cpu_model_name(), "cores": os.cpu_count(),
                         "when": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchd-http-") as t, contextlib.ExitStack() as stack:
        tmp = Path(t)
        collector = _collector(18290, tmp / "collector.log")
        if collector is not None:
            stack.callback(collector.terminate)
        traced_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:18290"}
        servers: dict[str, tuple[list[str], int, dict[str, str] | None]] = {
            "grpc-only": (_serve(18281, -1, tmp / "j1"), 18281, None),
            "default": (_serve(18282, 18283, tmp / "j2"), 18282, None),
            "traced": (_serve(18284, -1, tmp / "j3"), 18284, traced_env),
            "traced-1%": (_serve(18286, -1, tmp / "j5"), 18286, {
                **traced_env, "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.01"}),
        }  # fmt: skip
        if args.baseline:
            env = _baseline(args.baseline, tmp / "base")
            stack.callback(lambda: subprocess.run(
                ["git", "worktree", "remove", "--force", str(tmp / "base" / "tree")], cwd=ROOT,
                capture_output=True))  # fmt: skip
            servers["base"] = (_serve(18285, None, tmp / "j4"), 18285, env)
        if collector is None:
            del servers["traced"], servers["traced-1%"]
        pids: dict[str, int] = {}
        for name, (cmd, port, env) in servers.items():
            pids[name] = stack.enter_context(running(cmd, port, env=env)).pid
        systems = {name: (f"127.0.0.1:{port}", pids[name], "grpc")
                   for name, (_, port, _) in servers.items()}  # fmt: skip
        systems["http"] = ("127.0.0.1:18283", pids["default"], "http")
        for n in range(args.rounds):
            names = list(systems)
            order = names[n % len(names) :] + names[: n % len(names)]
            round_: dict[str, Any] = {}
            for model, c in POINTS:
                point = round_.setdefault(f"{model}_c{c}", {})
                for name in order:
                    url, pid, protocol = systems[name]
                    point[name] = perf_analyzer(args.pa, url, model, c, args.interval_ms, pid,
                                                protocol)  # fmt: skip
                    print(f"round {n + 1} {model} c={c} {name}: {point[name]['req_s']:,.0f} "
                          f"req/s p50 {point[name]['p50_ms']:.2f} ms", flush=True)  # fmt: skip
            r["rounds"].append(round_)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(markdown(r))
    return r


def _mean(r: dict[str, Any], point: str, system: str, key: str) -> float:
    values = [x[point][system][key] for x in r["rounds"] if system in x[point]]
    return sum(values) / len(values) if values else 0.0


def markdown(r: dict[str, Any]) -> str:
    systems = list(r["rounds"][0]["tiny_c32"])
    lines = [
        f"HTTP and tracing on tiny (examples/models), perf_analyzer closed loop; {r['cpu']}, "
        f"{r['cores']} cores; {len(r['rounds'])} rounds alternating. req/s per round, p50 and "
        "the server process's CPU per request (µs, first round); ratios against grpc-only.",
        "",
        "| system | tiny c=32 req/s | ratio | CPU µs/req | tiny c=1 p50 ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    base32, base1 = _mean(r, "tiny_c32", "grpc-only", "req_s"), _mean(r, "tiny_c1", "grpc-only",
                                                                        "p50_ms")  # fmt: skip
    for s in systems:
        got = " / ".join(f"{x['tiny_c32'][s]['req_s']:,.0f}" for x in r["rounds"])
        p50 = " / ".join(f"{x['tiny_c1'][s]['p50_ms']:.2f}" for x in r["rounds"])
        cpu = r["rounds"][0]["tiny_c32"][s].get("cpu_us_per_request", {}).get("frontend", "-")
        t, l1 = _mean(r, "tiny_c32", s, "req_s"), _mean(r, "tiny_c1", s, "p50_ms")
        lines.append(f"| {s} | {got} | {t / base32:.2f}{TIMES} | {cpu} | {p50} | "
                     f"{l1 / base1:.2f}{TIMES} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
