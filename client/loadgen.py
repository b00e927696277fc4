"""The load `batchd bench` sends: synthetic inputs, and one level measured by
load processes whose results the parent collects.

A load process reports exactly once: its latencies, its error counts and the
first message of each error code, or why it could not run. The parent ends a
level with LoadFailed, and stops the other load processes, as soon as one
dies (killed, crashed) or fails, or when none has reported long after the
level should have ended; it never waits for a result that cannot come.

With `stream`, each request goes over ModelStreamInfer alone and is read to
its final response (a decoupled model's outputs, one response per step). A
load process also measures the time to each request's first output, the gaps
between its outputs, and how many came; the rates of a streamed level are over
the time its load took, its last streams' tails included (an open loop's: at
least its schedule's). The load processes of a level keep one schedule: the
parent gives them one start instant once every one of them is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import queue
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import grpc
import numpy as np

from batchd.client.client import AsyncClient
from batchd.client.codec import parse_response
from batchd.client.core import END, END_GRACE_S, stream_read
from batchd.client.errors import BadResponse, BatchdClientError, undecodable
from batchd.protos.datatypes import DATATYPES

REQUEST_TIMEOUT_S = 30.0  # each request's deadline
START_GRACE_S = 60.0  # how long a load process may take to start and to hand its results over
START_LEAD_S = 0.1  # from the parent's go to the level's start: each process reads it by then


class LoadFailed(Exception):
    """A load process died or failed: the level has no result."""


@dataclass
class StreamMetrics:
    """What a streamed level measures besides its requests."""

    outputs: int = 0  # output responses received (the empty final ones not counted)
    outputs_per_s: float = 0.0
    ttfo_p50_ms: float | None = None  # time to first output: from sending the request
    ttfo_p99_ms: float | None = None  # (percentiles: None when there is no sample)
    inter_output_p50_ms: float | None = None  # between two outputs of one request
    inter_output_p99_ms: float | None = None
    elapsed_s: float = 0.0  # the longest load process's time, the last streams' tails included


@dataclass
class Level:
    """One measured load level."""

    mode: str  # "concurrency" or "rate"
    load: float  # callers, or the offered rate (requests/s)
    seconds: float = 0.0
    ok: int = 0
    throughput: float = 0.0  # achieved: ok over max(elapsed_s, seconds, the schedule's span)
    p50_ms: float | None = None  # None when no request was answered
    p90_ms: float | None = None
    p99_ms: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    error_messages: dict[str, str] = field(default_factory=dict)  # the first one per code
    server_avg_batch: float | None = None
    stream: StreamMetrics | None = None  # --stream only; then throughput is over elapsed_s
    elapsed_s: float = 0.0  # from the level's start to its last answer, the slowest process's


def random_tensor(datatype: str, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Random values of the numpy dtype that travels as `datatype` (BF16: uint16 bits)."""
    if datatype == "BYTES":
        return np.full(shape, b"batchd bench", dtype=object)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if datatype == "BF16":  # the upper half of FP32's bits
        return (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    dtype = DATATYPES[datatype].numpy
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)  # fits INT8 and every UINT


@dataclass
class _Report:
    latencies: np.ndarray  # of the requests answered (streamed: to their final response)
    errors: dict[str, int]
    messages: dict[str, str]
    elapsed: float  # from the level's start (its first request sent) to the last one answered
    outputs: int  # streamed: output responses
    ttfo: np.ndarray  # streamed: to each request's first output
    gaps: np.ndarray  # streamed: between outputs of one request


class _Tally:
    """What one load process sees of its requests, each sent by `unary` or `streamed`."""

    def __init__(self, msg: Any) -> None:
        self.msg = msg
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.messages: dict[str, str] = {}
        self.outputs = 0
        self.ttfo: list[float] = []
        self.gaps: list[float] = []

    def failed(self, code: str, message: str) -> None:
        self.errors[code] += 1
        self.messages.setdefault(code, message)

    def bad(self, e: BadResponse) -> None:
        self.failed("BAD_RESPONSE", e.message)  # (not the server's INTERNAL: the client's)

    async def unary(self, client: AsyncClient) -> None:
        """One ModelInfer; an answer counts once it decodes as Client.infer's would (5 µs
        for tiny's): a server sending garbage, or empty answers, benchmarked as healthy."""
        start = time.monotonic()
        try:
            reply = await client.stub.ModelInfer(
                self.msg, timeout=REQUEST_TIMEOUT_S, **client.call_kwargs
            )
            took = time.monotonic() - start
            if reply is None:  # (grpc.aio's answer that did not parse)
                raise undecodable()
            parse_response(reply)
            self.latencies.append(took)
        except grpc.RpcError as e:
            self.failed(e.code().name, e.details() or "")
        except BadResponse as e:
            self.bad(e)

    async def streamed(self, client: AsyncClient) -> None:
        """The request alone on a ModelStreamInfer call, read to its final response."""
        n, start = 0, time.monotonic()
        last = start
        call = client.stub.ModelStreamInfer(
            iter((self.msg,)), timeout=REQUEST_TIMEOUT_S, **client.call_kwargs
        )
        try:
            while True:
                try:
                    reply = await call.read()
                except grpc.RpcError as e:
                    reply = e
                try:
                    response, final = stream_read(END if reply is grpc.aio.EOF else reply)
                    now = time.monotonic()
                    if response is not None:
                        parse_response(response)
                except BadResponse as e:
                    self.bad(e)
                    return
                except BatchdClientError as e:
                    self.failed(e.code.name, e.message)
                    return
                if response is not None:
                    (self.gaps if n else self.ttfo).append(now - last)
                    n, last = n + 1, now
                if final:
                    self.latencies.append(now - start)
                    with contextlib.suppress(TimeoutError):  # its end follows, or is cancelled
                        await asyncio.wait_for(call.code(), END_GRACE_S)  # (as Client.stream)
                    return
        finally:
            self.outputs += n
            call.cancel()

    def report(self, elapsed: float) -> _Report:
        values = (self.latencies, self.ttfo, self.gaps)
        lat, ttfo, gaps = (np.asarray(v, np.float64) for v in values)
        return _Report(lat, dict(self.errors), self.messages, elapsed, self.outputs, ttfo, gaps)


async def _drive(
    at: float,
    url: str,
    conn: dict[str, Any],
    connections: int,
    msg: Any,
    mode: str,
    load: float,
    seconds: float,
    stream: bool,
    share: range,
) -> _Report:
    """One load process: `share` (split_level) of a level of `load` callers or requests/s,
    from `at`, the start instant (time.time()) every load process of the level shares."""
    tally = _Tally(msg)
    once = tally.streamed if stream else tally.unary
    # Wall time is what processes can compare (time.monotonic's zero is undefined across
    # processes, in Python's words); read once, then the schedule runs on time.monotonic.
    start = time.monotonic() + (at - time.time())
    end = start + seconds

    clients = [AsyncClient(url, own_connection=True, **conn) for _ in range(max(1, connections))]
    try:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        if mode == "concurrency":

            async def caller(c: AsyncClient) -> None:
                while time.monotonic() < end:
                    await once(c)

            await asyncio.gather(*(caller(clients[k % len(clients)]) for k in range(len(share))))
        else:
            pending = set()
            for k, i in enumerate(share):
                delay = start + i / load - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(once(clients[k % len(clients)]))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
        elapsed = time.monotonic() - start
    finally:
        for c in clients:
            await c.close()
    return tally.report(elapsed)


def _process(out: Any, go: Any, *drive_args: Any) -> None:
    """A load process: put None (ready), take the level's start instant from `go`, drive
    the load, then put one _Report, or a str saying why not."""
    try:
        out.put(None)  # imported: what makes a spawned process slow to start is behind it
        report: _Report | str = asyncio.run(_drive(go.get(timeout=START_GRACE_S), *drive_args))
    except Exception as e:
        traceback.print_exc()
        report = f"{type(e).__name__}: {e}"
    out.put(report)


def _death(p: BaseProcess) -> str:
    code = p.exitcode
    assert code is not None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _collect(
    procs: Sequence[BaseProcess], out: Any, give_up_at: float, progress: Callable[[], None]
) -> list[Any]:
    """One item (None: ready, then a report) from each load process, or LoadFailed as
    soon as one cannot come."""
    reports: list[Any] = []
    while len(reports) < len(procs):
        progress()
        try:
            item = out.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                p = dead[0]
                raise LoadFailed(f"load process {p.pid} died ({_death(p)})") from None
            if all(p.exitcode == 0 for p in procs):
                try:  # a report written just before the exit is in the pipe by now
                    item = out.get(timeout=0.5)
                except queue.Empty:
                    raise LoadFailed("a load process exited without reporting") from None
            elif time.monotonic() > give_up_at:
                late = [p.pid for p in procs if p.exitcode is None]
                raise LoadFailed(f"load process(es) {late} did not report in time") from None
            else:
                continue
        if isinstance(item, str):
            raise LoadFailed(f"a load process failed: {item}")
        reports.append(item)
    return reports


def _stop(procs: Sequence[BaseProcess], grace: float) -> None:
    """Let the load processes exit for `grace` seconds, then end them."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(5)
        if p.exitcode is None:
            p.kill()
            p.join()


def split_level(mode: str, load: float, seconds: float, processes: int) -> list[range]:
    """Each load process's share of a level: the callers it runs (closed loop), or the
    numbers of the requests it sends, request i leaving i / load seconds in (open loop).
    Process k of n takes every n-th from k: the shares differ by one at most and add up
    to the whole level, and open-loop processes take turns rather than send together.
    A rate sends rate * seconds requests rounded up, so at least one (less 1e-12 of it:
    float noise, 0.1 * 30 is 3.0000000000000004)."""
    total = int(load) if mode == "concurrency" else math.ceil(load * seconds * (1 - 1e-12))
    n = max(1, min(processes, total))
    return [range(k, total, n) for k in range(n)]


def run_level(
    url: str,
    conn: dict[str, Any],
    connections: int,
    msg: Any,
    mode: str,
    load: float,
    seconds: float,
    processes: int,
    progress: Callable[[float], None],
    stream: bool = False,
) -> Level:
    """Measure one level with `processes` load processes sharing `load`; with `stream`,
    over ModelStreamInfer (`msg` must then ask for the empty final response)."""
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Queue()
    drive = (url, conn, connections, msg, mode, load, seconds, stream)
    shares = split_level(mode, load, seconds, processes)
    procs = [ctx.Process(target=_process, args=(out, go, *drive, s)) for s in shares]
    started = time.monotonic()
    give_up_at = started + seconds + REQUEST_TIMEOUT_S + START_GRACE_S
    reported = False
    try:
        for p in procs:
            p.start()
        _collect(procs, out, give_up_at, lambda: progress(time.monotonic() - started))
        at = time.time() + START_LEAD_S  # all ready: one start, in wall time (see _drive)
        for _ in procs:
            go.put(at)
        reports = _collect(procs, out, give_up_at, lambda: progress(time.monotonic() - started))
        reported = True
    finally:
        _stop(procs, grace=5.0 if reported else 0.0)
    return _summary(mode, load, seconds, reports, stream)


def _summary(
    mode: str, load: float, seconds: float, reports: Sequence[_Report], stream: bool = False
) -> Level:
    lat = np.concatenate([r.latencies for r in reports])
    errors: Counter[str] = sum((Counter(r.errors) for r in reports), Counter())
    messages = {c: m for r in reversed(reports) for c, m in r.messages.items()}  # first wins
    if not len(lat) and not errors:
        raise LoadFailed(f"no request was sent in {seconds:g} s")
    # Achieved, not offered: the answers over the time they took, the level's start to its
    # last answer (an overloaded server's backlog included), at least the level's length and
    # the schedule's span (0.3/s for 1 s sends 1 request, over 3.3 s): never above the rate.
    elapsed = max(r.elapsed for r in reports)
    span = (len(lat) + errors.total()) / load if mode == "rate" else 0.0
    window = max(seconds, span, elapsed)
    level = Level(mode, load, seconds, len(lat), len(lat) / window if window > 0 else 0.0)
    level.p50_ms, level.p90_ms, level.p99_ms = (_ms([lat], q) for q in (50, 90, 99))
    level.errors, level.error_messages, level.elapsed_s = dict(errors), messages, elapsed
    if stream:
        level.throughput, level.stream = _stream_summary(reports, span)
    return level


def _ms(samples: Sequence[np.ndarray], q: float) -> float | None:
    values = np.concatenate(samples)
    return float(np.percentile(values, q)) * 1e3 if len(values) else None


def _stream_summary(reports: Sequence[_Report], span: float) -> tuple[float, StreamMetrics]:
    """Requests/s, and outputs and their timing; the rates add up each load process's own,
    over its time, at least `span` (its share of an open loop leaves over all of it)."""

    def per_s(count: Callable[[_Report], int]) -> float:
        return sum(count(r) / t for r in reports if (t := max(r.elapsed, span)) > 0)

    ttfo, gaps = [r.ttfo for r in reports], [r.gaps for r in reports]
    return per_s(lambda r: len(r.latencies)), StreamMetrics(
        outputs=sum(r.outputs for r in reports),
        outputs_per_s=per_s(lambda r: r.outputs),
        ttfo_p50_ms=_ms(ttfo, 50),
        ttfo_p99_ms=_ms(ttfo, 99),
        inter_output_p50_ms=_ms(gaps, 50),
        inter_output_p99_ms=_ms(gaps, 99),
        elapsed_s=max(r.elapsed for r in reports),
    )
