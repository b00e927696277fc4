"""The hostile requests of issue 15, each against a real `batchd serve --workers 2`,
with a probe client on its own connection calling `tiny` (1 s deadline) alongside.

For each attack it reports what the attacker got (code, time, size of the error
detail), what the probe saw meanwhile (calls, errors, slowest answer), worker
restarts (lost workers in the server's log) and the growth of the server's RSS
(frontend + workers). Attacks that freeze the server are cut at --cap seconds;
a server that does not answer again within --cap is restarted for the next.

    .venv/bin/python bench/attacks.py                     # this tree's server
    .venv/bin/python bench/attacks.py --server-python /tmp/before/.venv/bin/python
    .venv/bin/python bench/attacks.py --only bytes_rows,idle --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from overload import rss_mb  # noqa: E402

_LISTENING = re.compile(r"serving gRPC on [^:]+:(\d+)")


def infer(
    model: str, name: str, datatype: str, shape: list[int], raw: bytes
) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model)
    msg.inputs.add(name=name, datatype=datatype, shape=shape)
    msg.raw_input_contents.append(raw)
    return msg


def tiny_request() -> pb.ModelInferRequest:
    return infer("tiny", "INPUT0", "FP32", [1, 16], bytes(64))


class Server:
    def __init__(self, python: str, cwd: Path, args: list[str], log: Path) -> None:
        self.python, self.cwd, self.args, self.log_path = python, cwd, args, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> Server:
        cmd = [
            self.python, "-m", "batchd.server", "--model-repository",
            str(self.cwd / "examples" / "models"), "--grpc-port", "0", "--metrics-port", "-1",
            "--workers", "2", "--threads-per-worker", "1", *self.args,
        ]  # fmt: skip
        self.log_path = self.log_path.with_name(f"server-{time.monotonic_ns()}.log")
        out = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT)
        end = time.monotonic() + 120
        while not (m := _LISTENING.search(self.log_path.read_text(errors="replace"))):
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError(f"server did not start:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        self.port = int(m.group(1))
        self.wait_ready(120)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with grpc.insecure_channel(self.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            while time.monotonic() < end:
                try:
                    if stub.ServerReady(pb.ServerReadyRequest(), timeout=2).ready:
                        stub.ModelInfer(tiny_request(), timeout=2)
                        return True
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        return False

    def lost_workers(self) -> int:
        return len(re.findall(r"worker \S+ lost", self.log()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _probe(url: str, up: Any, stop: Any, out: Any) -> None:
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    opts = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(url, options=opts) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        msg = tiny_request()
        stub.ModelInfer(msg, timeout=30)  # connected and answered: the attack may start
        up.set()
        while not stop.is_set():
            t = time.perf_counter()
            try:
                stub.ModelInfer(msg, timeout=1.0)
            except grpc.RpcError as e:
                errors[e.code().name] += 1
            latencies.append(time.perf_counter() - t)
            time.sleep(0.01)
    out.put(
        {
            "calls": len(latencies),
            "errors": dict(errors),
            "slowest_ms": round(max(latencies, default=0) * 1e3, 1),
        }
    )


class Probe:
    """Calls tiny in a loop on its own connection with a 1 s deadline, from a
    process of its own (the attack's client would otherwise take its CPU)."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._up, self._stop, self._out = ctx.Event(), ctx.Event(), ctx.Queue()
        args = (url, self._up, self._stop, self._out)
        self._proc = ctx.Process(target=_probe, args=args, daemon=True)

    def start(self) -> Probe:
        self._proc.start()
        if not self._up.wait(120):
            raise RuntimeError("the probe got no first answer")
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        result: dict[str, Any] = self._out.get(timeout=60)
        self._proc.join(30)
        return result


def call(url: str, msg: pb.ModelInferRequest, timeout: float) -> dict[str, Any]:
    opts = [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
    ]
    t = time.perf_counter()
    with grpc.insecure_channel(url, options=opts) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        try:
            stub.ModelInfer(msg, timeout=timeout)
            code, detail = "OK", ""
        except grpc.RpcError as e:
            code, detail = e.code().name, e.details() or ""
    return {
        "code": code,
        "seconds": round(time.perf_counter() - t, 3),
        "detail_chars": len(detail),
        "detail": detail[:160],
    }


# ---- the attacks ----


def bytes_rows(url: str, cap: float) -> dict[str, Any]:
    """1. embed with 65,536 empty BYTES rows (262 KB)."""
    n = 65_536
    return call(url, infer("embed", "TEXT", "BYTES", [n, 1], b"\0\0\0\0" * n), cap)


def bytes_huge(url: str, cap: float) -> dict[str, Any]:
    """2. 60 MB: 15.7 M empty BYTES rows; and 60 MB packed under a shape of [1, 1]."""
    n = 15_728_640
    raw = b"\0\0\0\0" * n
    rows = call(url, infer("embed", "TEXT", "BYTES", [n, 1], raw), cap)
    one = call(url, infer("embed", "TEXT", "BYTES", [1, 1], raw), cap)
    return {"rows": rows, "shape_1x1": one}


def outputs_repeated(url: str, cap: float) -> dict[str, Any]:
    """3. mlp, 32 rows, OUTPUT0 asked for 3,000 times (98 KB)."""
    msg = infer("mlp", "INPUT0", "FP32", [32, 512], bytes(32 * 512 * 4))
    for _ in range(3000):
        msg.outputs.add(name="OUTPUT0")
    out = call(url, msg, cap)
    out["request_bytes"] = msg.ByteSize()
    return out


def ragged_long(url: str, cap: float) -> dict[str, Any]:
    """4. textpool, one row of 12,000 tokens, and one of 100,000."""
    res = {}
    for n in (12_000, 100_000):
        raw = np.ones(n, np.int64).tobytes()
        res[str(n)] = call(url, infer("textpool", "TOKENS", "INT64", [1, n], raw), cap)
    return res


def long_names(url: str, cap: float) -> dict[str, Any]:
    """5. a model name and an input name of 4 MB each."""
    big = "m" * (4 << 20)
    res = {"model": call(url, infer(big, "INPUT0", "FP32", [1, 16], bytes(64)), cap)}
    res["input"] = call(url, infer("tiny", big, "FP32", [1, 16], bytes(64)), cap)
    return res


async def _many(url: str, n: int, deadline_s: float) -> Counter[str]:
    opts = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(url, options=opts) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        msg = tiny_request()

        async def one() -> str:
            try:
                await stub.ModelInfer(msg, timeout=deadline_s)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        return Counter(await asyncio.gather(*(one() for _ in range(n))))


def many_calls(url: str, cap: float) -> dict[str, Any]:
    """6a. 6,000 concurrent calls on one connection (limit: 4,096 open RPCs)."""
    return dict(asyncio.run(_many(url, 6000, cap)))


async def _storm(url: str, seconds: float) -> int:
    opts = [("grpc.use_local_subchannel_pool", 1)]
    cancelled = 0
    async with grpc.aio.insecure_channel(url, options=opts) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        msg = infer("mlp", "INPUT0", "FP32", [1, 512], bytes(2048))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            calls = [stub.ModelInfer(msg, timeout=10) for _ in range(200)]
            await asyncio.sleep(0.002)
            for c in calls:
                c.cancel()
                cancelled += 1
            await asyncio.sleep(0)
    return cancelled


def cancel_storm(url: str, cap: float) -> dict[str, Any]:
    """6b. a client starting and cancelling calls in a loop for 10 s."""
    return {"cancelled_by_attacker": asyncio.run(_storm(url, 10))}


async def _flood(url: str, rate: float, seconds: float) -> Counter[str]:
    opts = [("grpc.use_local_subchannel_pool", 1)]
    codes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(url, options=opts) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        msg = infer("mlp", "INPUT0", "FP32", [1, 512], bytes(2048))

        async def one() -> None:
            try:
                await stub.ModelInfer(msg, timeout=10)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

        tasks = []
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return codes


def overload(url: str, cap: float) -> dict[str, Any]:
    """6c. mlp at 3,000 req/s for 10 s with 10 s deadlines, no cancels."""
    return dict(asyncio.run(_flood(url, 3000, 10)))


def idle(url: str, cap: float) -> dict[str, Any]:
    """7. 250 TCP connections that never send the HTTP/2 preface and 250 HTTP/2
    connections that make one call and idle; how many the server still holds
    after --idle-wait seconds."""
    host, port = url.rsplit(":", 1)
    raw = [socket.create_connection((host, int(port))) for _ in range(250)]
    channels = []
    for _ in range(250):
        ch = grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])
        pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest(), timeout=10)
        channels.append(ch)
    time.sleep(IDLE_WAIT_S)  # the measurement is what is open after this long

    def still_open(s: socket.socket) -> bool:
        s.setblocking(False)
        try:
            while s.recv(65536):  # what the server sent before closing (a GOAWAY)
                pass
            return False  # end of stream: the server closed it
        except BlockingIOError:
            return True  # nothing more to read, and not closed
        except OSError:
            return False

    def open_raw() -> int:
        return sum(still_open(s) for s in raw)

    result = {
        "waited_s": IDLE_WAIT_S,
        "no_preface_open": open_raw(),
        "idle_http2_open": sum(
            ch._channel.check_connectivity_state(False) == 2  # type: ignore[attr-defined]
            for ch in channels
        ),
    }
    for s in raw:
        s.close()
    for ch in channels:
        ch.close()
    return result


IDLE_WAIT_S = 30.0
ATTACKS: dict[str, Callable[[str, float], dict[str, Any]]] = {
    "bytes_rows": bytes_rows,
    "bytes_huge": bytes_huge,
    "outputs_repeated": outputs_repeated,
    "ragged_long": ragged_long,
    "long_names": long_names,
    "many_calls": many_calls,
    "cancel_storm": cancel_storm,
    "overload": overload,
    "idle": idle,
}


def run_one(server: Server, name: str, cap: float) -> dict[str, Any]:
    lost, rss0 = server.lost_workers(), rss_mb(server.proc.pid)  # type: ignore[union-attr]
    peak = [rss0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(server.proc.pid))  # type: ignore[union-attr]
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    probe = Probe(server.url).start()
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(result=ATTACKS[name](server.url, cap)))
    t = time.perf_counter()
    worker.start()
    worker.join(cap + 30)
    result = box.get("result", {"cut": f"no answer in {cap + 30:.0f} s"})
    seen = probe.stop()
    done.set()
    watcher.join()
    return {
        "attack": name,
        "seconds": round(time.perf_counter() - t, 2),
        "result": result,
        "probe": seen,
        "workers_lost": server.lost_workers() - lost,
        "rss_growth_mb": round(peak[0] - rss0, 1),
        "recovered": server.wait_ready(cap),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-python", default=sys.executable)
    ap.add_argument("--server-root", type=Path, default=ROOT, help="tree the server runs from")
    ap.add_argument("--only", default="", help="comma-separated attacks (default: all)")
    ap.add_argument("--cap", type=float, default=60.0, help="seconds an attack may take")
    ap.add_argument("--idle-wait", type=float, default=IDLE_WAIT_S)
    ap.add_argument("--server-args", default="", help="extra `batchd serve` flags")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    globals()["IDLE_WAIT_S"] = args.idle_wait
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    log = Path(tempfile.mkdtemp(prefix="batchd-attacks-")) / "server.log"
    server = Server(args.server_python, args.server_root, args.server_args.split(), log).start()
    results = []
    try:
        for name in names:
            r = run_one(server, name, args.cap)
            print(json.dumps(r), flush=True)
            results.append(r)
            if not r["recovered"]:
                server.stop()
                server = Server(
                    args.server_python, args.server_root, args.server_args.split(), log
                ).start()
    finally:
        server.stop()
    print(f"server logs: {log.parent}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
