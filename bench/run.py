"""`make bench`: batchd measured beside its own limits, in one run.

1. The echo ceiling: bench/echo_server.py (a bare grpc.aio server that answers
   ModelInfer with its input) under perf_analyzer at concurrency 32 and 64.
2. The unbatched floor: the same server running mlp inline, one request at
   a time (what c=1 latency cannot beat). The raw-model limit: examples'
   mlp called directly in torch, one thread, at batch 1, 32 and 64 (rows/s).
3. batchd serving examples/models (one CPU worker, one torch thread, as
   ../shared/BENCH.md prescribes) under perf_analyzer: mlp at concurrency 1
   and 64, tiny at 32; the RSS of the frontend and its worker; then a
   `batchd bench` concurrency sweep of mlp (1..64) with its plot; then tiny
   with `--frontends 1` and `--frontends max(2, cores/2)`.
4. bench/idle_latency.py: where one mlp caller's time goes outside gRPC, and
   from it and the echo server what a server with no code of its own would
   reach here (the limits the targets cannot beat on this machine).
5. bench/stepwise.py: the step-wise decoder with continuous against static
   batching on skewed lengths (issue 17), with 8 callers (its max_active) and
   with 16.
6. bench/jobs.py: batch jobs (issue 18): a 100,000-line mlp job's rows/s
   against `batchd bench` at its best concurrency, the online mlp p99 with and
   without a job running, and the frontend's RSS through 100k- and 1M-line jobs.
7. bench/peers.py: batchd with UNTUNED models (no `[batching]` table) and default
   flags against the echo ceiling and every `--peer NAME=URL` (e.g. PyTriton from
   ../shared/peers/pytriton/serve.sh), alternating, 2 rounds, CPU per request by
   process; and tiny with `--frontends 1, 2, 4`: batch and forward sizes.
8. bench/rest.py: HTTP against gRPC on tiny (perf_analyzer -i http and -i grpc),
   gRPC with the HTTP port off and on (idle), tracing on; with `--http-baseline
   REV`, also that revision from a git worktree (what tracing costs when off).
9. bench/replicas.py, where haproxy is installed: three replicas against one through
   haproxy (each capped at half a core when cgroups can be written), and what a
   SIGKILL or a drain costs through haproxy and nginx.
10. bench/packed.py: packed ragged batches against padded ones (FIFO and length
   buckets) on skewed lengths: tokens/s, p50/p99, padding efficiency (issue 22).

Writes OUT/results.json, OUT/results.md (the ratios against the targets of
issue 6) and OUT/mlp_sweep.png. The machine is shared and absolute numbers
drift, so compare ratios within one run.

    .venv/bin/python bench/run.py [--out bench/results] [--pa PATH] [--interval-ms 4000]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jobs
import stepwise
from overload import children, children_cpu_s, cpu_s, rss_mb

from batchd.client import Client

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def perf_analyzer(
    pa: str, port: int | str, model: str, concurrency: int, interval_ms: int,
    server: int | None = None, protocol: str = "grpc",
) -> dict:  # fmt: skip
    """One perf_analyzer measurement; its CSV row as numbers (latencies in ms).

    With `server` (a pid): also the CPU each side used per request, in microseconds:
    the server process ("frontend"), its children ("worker"), perf_analyzer itself
    ("load"), and apart from those the server's main thread alone ("loop_us_per_request":
    a Python server's event loop, which no second core can help). Requests are counted
    as throughput x the whole run (perf_analyzer's trials included), so these are
    close, not exact."""
    out = Path(f"/tmp/batchd-pa-{str(port).replace(':', '_')}-{model}-{concurrency}-{protocol}.csv")
    kids = children(server) if server else []
    before = [cpu_s(p) for p in (server, *kids)] if server else []
    loop_before = cpu_s(server, main_thread=True) if server else 0.0
    load_before = children_cpu_s()
    start = time.monotonic()
    done = subprocess.run(
        [
            pa,
            "-i",
            protocol,
            "-u",
            port if isinstance(port, str) else f"127.0.0.1:{port}",  # a URL, or a local port
            "-m",
            model,
            "--concurrency-range",
            f"{concurrency}:{concurrency}",
            "--measurement-interval",
            str(interval_ms),
            *("--stability-percentage", "25", "--max-trials", "20"),  # a shared 2-core machine
            "-f",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - start
    if done.returncode:
        raise RuntimeError(f"perf_analyzer failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    row = next(csv.DictReader(out.open()))
    result = {
        "concurrency": concurrency,
        "req_s": round(float(row["Inferences/Second"]), 1),
        "p50_ms": float(row["p50 latency"]) / 1e3,
        "p99_ms": float(row["p99 latency"]) / 1e3,
    }
    if server:
        after = [cpu_s(p) for p in (server, *kids)]
        per_request = 1e6 / (result["req_s"] * wall)
        result["cpu_us_per_request"] = {
            "frontend": round((after[0] - before[0]) * per_request),
            "worker": round((sum(after[1:]) - sum(before[1:])) * per_request),
            "load": round((children_cpu_s() - load_before) * per_request),
        }
        result["loop_us_per_request"] = round(
            (cpu_s(server, main_thread=True) - loop_before) * per_request
        )
    return result


@contextmanager
def running(
    cmd: list[str], port: int, timeout: float = 120.0, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    try:
        with Client(f"127.0.0.1:{port}") as c:
            end = time.monotonic() + timeout
            while not c.ready():
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"{cmd[:4]} did not get ready")
                time.sleep(0.1)
        yield proc
    finally:
        # SIGTERM, not SIGINT: a shell starts background jobs with SIGINT ignored, and
        # Python then never installs its handler, so `make bench &` would hang here.
        proc.terminate()
        proc.wait(30)


RAW_MODEL = """
import json, sys, time, torch
sys.path.insert(0, "examples/models/mlp")
from model import build
torch.set_num_threads(1)
m = build()
out = {}
with torch.inference_mode():
    for rows in (1, 32, 64):
        x = torch.rand(rows, 512)
        for _ in range(5):
            m(x)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < 2:
            m(x)
            n += 1
        out[rows] = round(n * rows / (time.perf_counter() - start))
print(json.dumps(out))
"""


def raw_model() -> dict[str, int]:
    text = subprocess.run(
        [PY, "-c", RAW_MODEL], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return {f"batch_{k}": v for k, v in json.loads(text).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--pa", help="perf_analyzer (default: installed into .perf_analyzer)")
    p.add_argument("--interval-ms", type=int, default=4000, help="perf_analyzer window")
    p.add_argument("--sweep-seconds", type=float, default=4.0, help="batchd bench per level")
    p.add_argument("--stepwise-seconds", type=float, default=10.0, help="bench/stepwise.py runs")
    p.add_argument("--job-lines", type=int, default=100_000, help="bench/jobs.py's mlp job")
    p.add_argument(
        "--peer", action="append", default=[], metavar="NAME=URL",
        help="another OIP server serving mlp and tiny, measured beside batchd (repeatable)",
    )  # fmt: skip
    p.add_argument("--http-baseline", metavar="REV", help="bench/rest.py --baseline REV")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pa = (
        args.pa
        or subprocess.run(
            [
                str(ROOT / "bench" / "get-perf-analyzer"),
                str(ROOT / ".perf_analyzer"),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    ms = args.interval_ms
    r: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine_cores": os.cpu_count()}

    print("echo ceiling ...", flush=True)
    with running([PY, "bench/echo_server.py", "--port", "18190"], 18190) as echo:
        r["echo"] = {c: perf_analyzer(pa, 18190, "echo", c, ms, echo.pid) for c in (1, 32, 64)}
    print("unbatched floor ...", flush=True)
    with running([PY, "bench/echo_server.py", "--port", "18193", "--mlp"], 18193):
        r["unbatched_mlp"] = {c: perf_analyzer(pa, 18193, "mlp", c, ms) for c in (1, 64)}
    print("raw model ...", flush=True)
    r["raw_model_mlp_rows_s"] = raw_model()
    print("idle latency parts ...", flush=True)
    idle_json = args.out / "idle_latency.json"
    subprocess.run(
        [PY, "bench/idle_latency.py", "--json", str(idle_json)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    r["idle_mlp"] = json.loads(idle_json.read_text())

    print("batchd ...", flush=True)
    serve = [
        *(PY, "-m", "batchd.server", "--model-repository", "examples/models"),
        *("--workers", "1", "--threads-per-worker", "1", "--grpc-port", "18191"),
        *("--metrics-port", "-1", "--log-level", "WARNING"),
    ]
    with running(serve, 18191) as server:
        r["rss_idle_mb"] = rss_mb(server.pid)
        r["mlp_c1"] = perf_analyzer(pa, 18191, "mlp", 1, ms, server.pid)
        r["mlp_c64"] = perf_analyzer(pa, 18191, "mlp", 64, ms, server.pid)
        r["tiny_c32"] = perf_analyzer(pa, 18191, "tiny", 32, ms, server.pid)
        r["rss_after_load_mb"] = rss_mb(server.pid)
        sweep_json = args.out / "mlp_sweep.json"
        subprocess.run(
            [
                *(PY, "-m", "batchd.client.bench", "--url", "127.0.0.1:18191", "--model", "mlp"),
                *("--concurrency", "1:64", "--duration", str(args.sweep_seconds)),
                *("--json", str(sweep_json), "--plot", str(args.out / "mlp_sweep.png")),
                "--quiet",
            ],
            cwd=ROOT,
            check=True,
        )
        r["batchd_bench_mlp_sweep"] = json.loads(sweep_json.read_text())
    print("frontends ...", flush=True)
    r["frontends_tiny_c32"] = {
        f: frontends_tiny(serve, f, args.out)
        for f in sorted({1, max(2, (os.cpu_count() or 2) // 2)})
    }
    print("step-wise: continuous against static batching ...", flush=True)
    r["stepwise"] = {
        callers: stepwise.main(["--callers", str(callers), "--seconds", str(args.stepwise_seconds)])
        for callers in (8, 16)
    }
    print("batch jobs ...", flush=True)
    r["jobs"] = jobs.main(["--lines", str(args.job_lines)])
    print("untuned models against the peers ...", flush=True)
    import peers  # it imports this module's perf_analyzer and running

    peer_args = [x for peer in args.peer for x in ("--peer", peer)]
    r["peers"] = peers.main(["--pa", pa, *peer_args, "--json", str(args.out / "peers.json"),
                             "--md", str(args.out / "peers.md")])  # fmt: skip
    print("HTTP and tracing ...", flush=True)
    import rest

    base = ["--baseline", args.http_baseline] if args.http_baseline else []
    r["rest"] = rest.main(["--pa", pa, *base, "--json", str(args.out / "rest.json")])
    if shutil.which("haproxy") or Path("/usr/sbin/haproxy").exists():
        print("replicas behind haproxy ...", flush=True)
        import replicas

        cap = "0.5" if os.access("/sys/fs/cgroup/cpu", os.W_OK) else "0"
        out = str(args.out / "replicas.json")
        r["replicas"] = replicas.main(["--pa", pa, "--cpu", cap, "--json", out])
    print("packed against padded batches ...", flush=True)
    import packed

    r["packed"] = packed.main(["--json", str(args.out / "packed.json")])
    echo64, echo32 = r["echo"][64]["req_s"], r["echo"][32]["req_s"]
    r["ratios"] = {
        "mlp_c64_vs_echo_c64": round(r["mlp_c64"]["req_s"] / echo64, 3),
        "tiny_c32_vs_echo_c32": round(r["tiny_c32"]["req_s"] / echo32, 3),
        "mlp_c64_vs_pytriton_1922": round(r["mlp_c64"]["req_s"] / 1922, 2),
        "mlp_c1_p50_vs_unbatched": round(
            r["mlp_c1"]["p50_ms"] / r["unbatched_mlp"][1]["p50_ms"], 2
        ),
        # mlp is compute-bound: its own limit is the model at max_batch_size on one thread.
        "mlp_c64_vs_raw_model_batch32": round(
            r["mlp_c64"]["req_s"] / r["raw_model_mlp_rows_s"]["batch_32"], 3
        ),
    }
    r["cpu_bound_req_s"] = {
        name: cpu_bound(r[name], r["machine_cores"]) for name in ("mlp_c64", "tiny_c32")
    }
    r["limits_without_batchd"] = limits_without_batchd(r)
    (args.out / "results.json").write_text(json.dumps(r, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(r))
    print(markdown(r))


def frontends_tiny(serve: list[str], frontends: int, out: Path) -> float:
    """tiny at concurrency 32 over 8 connections (the kernel balances connections over
    frontends), with `--frontends N`; batchd bench is the load, for both."""
    with running([*serve, "--frontends", str(frontends)], 18191):
        result = out / f"frontends_{frontends}.json"
        subprocess.run(
            [
                *(PY, "-m", "batchd.client.bench", "--url", "127.0.0.1:18191", "--model", "tiny"),
                *("--concurrency", "32", "--connections", "8", "--duration", "5"),
                *("--json", str(result), "--quiet"),
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        return float(json.loads(result.read_text())["levels"][0]["throughput"])


def limits_without_batchd(r: dict) -> dict:
    """What a server with no code of its own would reach on this machine: gRPC as
    the echo server costs it, the model as it runs alone, ZeroMQ bare."""
    echo, idle = r["echo"][64]["cpu_us_per_request"], r["idle_mlp"]
    per_row_us = 1e6 / r["raw_model_mlp_rows_s"]["batch_32"]
    mlp_c64 = r["machine_cores"] * 1e6 / (echo["frontend"] + echo["load"] + per_row_us)
    c1_ms = (
        r["echo"][1]["p50_ms"]
        + (idle["model_alone"]["after_idle_us"] + idle["bare_zeromq_round_trip_us"]) / 1e3
    )
    echo_bound = r["machine_cores"] * 1e6 / (echo["frontend"] + echo["load"])
    return {
        "mlp_c64_req_s": round(mlp_c64),
        "mlp_c64_vs_echo_c64": round(mlp_c64 / r["echo"][64]["req_s"], 3),
        # the echo server itself leaves the cores partly idle: compare bound with bound
        "mlp_c64_vs_echo_c64_bound": round(mlp_c64 / echo_bound, 3),
        "mlp_c1_p50_ms": round(c1_ms, 2),
    }


def cpu_bound(m: dict, cores: int) -> int:
    """The req/s at which the measured CPU per request would keep every core busy."""
    return round(cores * 1e6 / sum(m["cpu_us_per_request"].values()))


def markdown(r: dict) -> str:
    ratios = r["ratios"]
    rows = [
        ("mlp c=64 req/s vs echo c=64", ratios["mlp_c64_vs_echo_c64"], "≥ 0.7"),
        ("tiny c=32 req/s vs echo c=32", ratios["tiny_c32_vs_echo_c32"], "≥ 0.8"),
        ("mlp c=64 p99 ms", r["mlp_c64"]["p99_ms"], "< 40"),
        ("mlp c=1 p50 ms", r["mlp_c1"]["p50_ms"], "≤ 2"),
        ("mlp c=1 p50 vs unbatched floor p50", ratios["mlp_c1_p50_vs_unbatched"], "—"),
        (
            "mlp c=64 req/s vs the model alone at batch 32",
            ratios["mlp_c64_vs_raw_model_batch32"],
            "—",
        ),
        ("frontend + worker RSS MB", round(r["rss_after_load_mb"], 1), "≤ 500"),
    ]
    lines = [
        f"# batchd bench, {r['when']} ({r['machine_cores']} cores)",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        *(f"| {name} | {value} | {target} |" for name, value, target in rows),
        "",
        "| server, load | req/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for label, m in [
        *((f"echo c={c}", r["echo"][c]) for c in r["echo"]),
        *((f"unbatched grpc.aio + mlp c={c}", r["unbatched_mlp"][c]) for c in r["unbatched_mlp"]),
        ("batchd mlp c=1", r["mlp_c1"]),
        ("batchd mlp c=64", r["mlp_c64"]),
        ("batchd tiny c=32", r["tiny_c32"]),
    ]:
        lines.append(f"| {label} | {m['req_s']:,.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} |")
    lines.append("")
    lines.append(
        "tiny c=32 over 8 connections (batchd bench), by --frontends: "
        + ", ".join(f"{f}: {v:,.0f} req/s" for f, v in r["frontends_tiny_c32"].items())
    )
    lines += [
        "",
        "CPU per request, microseconds (the frontend process, its worker, perf_analyzer), and the",
        "throughput at which they would keep every core busy:",
        "",
        "| load | frontend | worker | load tool | bound req/s | measured |",
        "|---|---|---|---|---|---|",
    ]
    for label, m in [
        ("echo c=32", r["echo"][32]),
        ("batchd mlp c=64", r["mlp_c64"]),
        ("batchd tiny c=32", r["tiny_c32"]),
        ("batchd mlp c=1", r["mlp_c1"]),
    ]:
        cpu = m["cpu_us_per_request"]
        lines.append(
            f"| {label} | {cpu['frontend']} | {cpu['worker']} | {cpu['load']} "
            f"| {cpu_bound(m, r['machine_cores']):,} | {m['req_s']:,.0f} |"
        )
    lines += [
        "",
        f"mlp c=64 by Little's law: 64 callers at {r['mlp_c64']['req_s']:,.0f} req/s wait "
        f"{64e3 / r['mlp_c64']['req_s']:.1f} ms on average; a p99 under 40 ms needs more "
        "than 1,600 req/s.",
    ]
    bare, idle = r["limits_without_batchd"], r["idle_mlp"]
    worker = idle["worker"]
    lines += [
        "",
        "Without any code of batchd's own (gRPC as the echo server's CPU, mlp as alone, every",
        f"core busy), mlp c=64 would reach {bare['mlp_c64_req_s']:,} req/s, "
        f"{bare['mlp_c64_vs_echo_c64']}x echo ({bare['mlp_c64_vs_echo_c64_bound']}x the echo "
        "server's own bound); one mlp caller would wait",
        f"{bare['mlp_c1_p50_ms']} ms (echo c=1 + the model after "
        f"{idle['idle_ms']:g} ms idle + a bare ZeroMQ round trip).",
        "",
        f"mlp at one caller (bench/idle_latency.py, {idle['idle_ms']:g} ms between requests): "
        f"the model alone {idle['model_alone']['after_idle_us']:,.0f} µs "
        f"({idle['model_alone']['back_to_back_us']:,.0f} back to back); through a worker "
        f"{worker['round_trip_us']:,.0f} µs round trip = compute "
        f"{worker['worker_compute_us']:,.0f} + ZeroMQ and hand-offs "
        f"{worker['transport_and_handoffs_us']:,.0f} (bare ZeroMQ "
        f"{idle['bare_zeromq_round_trip_us']:,.0f}); parsing one wire header "
        f"{idle['cold_python']['parse_header_back_to_back_us']} µs warm, "
        f"{idle['cold_python']['parse_header_after_idle_us']} µs after the idle gap.",
    ]
    raw = r["raw_model_mlp_rows_s"]
    lines += [
        "",
        "mlp alone in torch, one thread (rows/s): "
        + ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in raw.items()),
        "",
    ]
    for callers, result in r.get("stepwise", {}).items():
        lines += [f"Step-wise decoder, continuous against static batching, {callers} callers:", ""]
        lines += [stepwise.markdown(result), ""]
    if "jobs" in r:
        lines += [jobs.markdown(r["jobs"]), ""]
    if "peers" in r:
        import peers

        lines += [peers.markdown(r["peers"]), ""]
    if "rest" in r:
        import rest

        lines += [rest.markdown(r["rest"]), ""]
    if "replicas" in r:
        import replicas

        lines += [replicas.markdown(r["replicas"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
