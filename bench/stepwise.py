"""Continuous against static batching of the same step-wise model, on skewed lengths.

Serves the example `decoder` twice from a copy of its folder: as shipped
(`admission = "continuous"`: sequences join and leave between steps) and with
`admission = "static"` (a batch starts together and admits nobody until its
longest member ends), same `max_active` (8), one worker with one torch thread.
Each run drives it with --callers closed-loop callers over ModelStreamInfer for
--seconds: every request has a prompt of 4-16 tokens and MAX_NEW_TOKENS drawn
skewed, most short and a few long (--short 8, --long 256, --long-share 0.05).
It reports outputs per second, requests per second, time to first output
(p50/p99, from the caller's send) and the sequences stepped together per step
(ModelStatistics), alternating the two modes --rounds times, and the ratios
continuous / static. 8 callers keep 8 slots busy; 16 (twice the slots) add
the wait for a slot to the time to first output.

    .venv/bin/python bench/stepwise.py [--seconds 15] [--rounds 2] [--callers 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
DECODER = ROOT / "examples" / "models" / "decoder"


def repository(admission: str, into: Path) -> Path:
    repo = into / admission
    shutil.copytree(DECODER, repo / "decoder")
    toml = repo / "decoder" / "model.toml"
    text = re.sub(r'admission = "\w+"', f'admission = "{admission}"', toml.read_text())
    toml.write_text(text)
    return repo


def serve(repo: Path, port: int, threads: int = 1) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchd.server", "--model-repository", str(repo),
         "--grpc-port", str(port), "--metrics-port", "-1", "--workers", "1",
         "--threads-per-worker", str(threads), "--log-level", "WARNING"],
    )  # fmt: skip


def request(rng: random.Random, args: argparse.Namespace) -> pb.ModelInferRequest:
    new = args.long if rng.random() < args.long_share else args.short
    prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(4, 17))]
    msg = pb.ModelInferRequest(model_name="decoder")
    msg.inputs.add(name="PROMPT", datatype="INT64", shape=[len(prompt)])
    msg.inputs.add(name="MAX_NEW_TOKENS", datatype="INT64", shape=[1])
    msg.raw_input_contents.extend(
        [np.array(prompt, np.int64).tobytes(), np.array([new], np.int64).tobytes()]
    )
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


async def drive(port: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(600):  # ready: one short sequence answered
            try:
                await stub.ModelInfer(request(random.Random(0), args), timeout=30)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)
        first: list[float] = []
        outputs = requests = 0
        start = time.perf_counter()
        end = start + args.seconds

        async def caller(i: int) -> None:
            nonlocal outputs, requests
            rng = random.Random(seed * 1000 + i)
            while time.perf_counter() < end:
                sent = time.perf_counter()
                got = 0
                async for response in stub.ModelStreamInfer(iter([request(rng, args)])):
                    if response.error_message:
                        raise RuntimeError(response.error_message)
                    if response.infer_response.raw_output_contents:
                        if not got:
                            first.append(time.perf_counter() - sent)
                        got += 1
                outputs += got
                requests += 1

        before = await slots_per_step(stub)
        await asyncio.gather(*(caller(i) for i in range(args.callers)))
        took = time.perf_counter() - start
        after = await slots_per_step(stub)
    first.sort()
    steps = after[0] - before[0]
    return {
        "slots_per_step": round((after[1] - before[1]) / steps, 2) if steps else 0.0,
        "outputs_s": round(outputs / took, 1),
        "requests_s": round(requests / took, 2),
        "ttfo_p50_ms": round(statistics.median(first) * 1e3, 1),
        "ttfo_p99_ms": round(first[min(len(first) - 1, int(0.99 * len(first)))] * 1e3, 1),
        "requests": requests,
    }


async def slots_per_step(stub: pb_grpc.GRPCInferenceServiceStub) -> tuple[int, int]:
    """The decoder's step rounds so far, and the sequence-steps they ran."""
    reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="decoder"), timeout=30)
    stats = reply.model_stats[0]
    return stats.execution_count, stats.inference_count


def run(admission: str, tmp: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    port = args.port + seed
    server = serve(repository(admission, tmp / f"{admission}{seed}"), port, args.threads)
    try:
        return asyncio.run(drive(port, args, seed))
    finally:
        server.terminate()
        server.wait(60)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--callers", type=int, default=8, help="closed-loop callers (max_active 8)")
    ap.add_argument("--short", type=int, default=8, help="MAX_NEW_TOKENS of most requests")
    ap.add_argument("--long", type=int, default=256, help="MAX_NEW_TOKENS of the few")
    ap.add_argument("--long-share", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    ap.add_argument("--port", type=int, default=18700, help="first of 2 x rounds ports")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")), platform.processor(),
    )  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"continuous": [], "static": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for admission in ("continuous", "static"):
                result = run(admission, Path(tmp), args, 2 * r + (admission == "static"))
                runs[admission].append(result)
                print(admission, result, flush=True)

    def mean(admission: str, key: str) -> float:
        return statistics.mean(x[key] for x in runs[admission])

    ratios = {
        "outputs_s": round(mean("continuous", "outputs_s") / mean("static", "outputs_s"), 2),
        "ttfo_p99": round(mean("continuous", "ttfo_p99_ms") / mean("static", "ttfo_p99_ms"), 3),
    }
    workload = (
        f"{args.callers} callers, MAX_NEW_TOKENS {args.short} ({1 - args.long_share:.0%}) or "
        f"{args.long} ({args.long_share:.0%}), prompts of 4-16 tokens, {args.seconds:g} s a run, "
        f"{args.threads} torch thread(s)"
    )
    print(f"CPU: {cpu}; {workload}")
    result = {"cpu": cpu, "workload": workload, "runs": runs, "ratios": ratios}
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"CPU: {result['cpu']}; {result['workload']}",
        "",
        "| admission | outputs/s | requests/s | TTFO p50 ms | TTFO p99 ms | slots per step |",
        "|---|---|---|---|---|---|",
    ]
    for admission, results in result["runs"].items():
        for x in results:
            keys = ("outputs_s", "requests_s", "ttfo_p50_ms", "ttfo_p99_ms", "slots_per_step")
            lines.append(f"| {admission} | " + " | ".join(str(x[k]) for k in keys) + " |")
    ratios = result["ratios"]
    lines += [
        "",
        f"continuous / static: outputs/s {ratios['outputs_s']}x (goal >= 2), "
        f"TTFO p99 {ratios['ttfo_p99']}x (goal <= 0.1)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
