"""Prometheus metrics, read from the live state at scrape time.

Nothing is counted twice: the collector turns `Stats` (and the queues and
workers) into metric families when /metrics is scraped, so the request path
pays nothing for metrics. The registry is created by the composition root and
passed in; nothing is registered globally. /metrics is served from the event
loop itself (a tiny HTTP/1.1 responder), so the state is never read from
another thread; scrapes that arrive while one is rendered share it.

Names follow Triton's (`nv_` becomes `batchd_`) so dashboards port by a prefix
rename; batchd adds batch-size, padding and worker metrics.

With `--frontends N` each child frontend answers /metrics on a private Unix
socket, and frontend 0's /metrics gathers them on each scrape (siblings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from batchd.protos.model_config import ConfigError, ModelConfig
from batchd.server.security import in_url
from batchd.server.siblings import gathered
from batchd.server.stats import LATENCY_BUCKETS_US, Duration, Histogram, ModelStats, Stats

log = logging.getLogger("batchd.metrics")
REFRESH_S = 2.0  # a scrape waits this long, at most, for the jobs store's counts
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerView:
    worker_id: str  # the process registered ("cpu0#2"), "" while none is
    slot: str  # the label: a local worker's slot ("cpu0"), which its restarts keep
    device: str
    up: bool


def worker_views(
    slots: Iterable[tuple[str, str]], registered: Iterable[tuple[str, str]]
) -> list[WorkerView]:
    """One view per local worker slot (`slot`, `device`): up while a worker of that slot
    (`slot#n`, its n-th start) is registered, down in between. A registered worker of
    no slot (`batchd worker` started by hand, another host's) is up under its own id."""
    devices = dict(slots)
    up: dict[str, tuple[str, str]] = {}  # label -> (worker id, device)
    for name, device in registered:
        slot = name.rpartition("#")[0]
        up[slot if slot in devices else name] = (name, device)
    views = [WorkerView(up.get(s, ("",))[0], s, d, s in up) for s, d in devices.items()]
    return views + [WorkerView(n, k, d, True) for k, (n, d) in up.items() if k not in devices]


class Collector:
    """A prometheus_client collector over batchd's own state."""

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        stats: Stats,
        pending: Callable[[str], int],
        workers: Callable[[], list[WorkerView]],
        restarts: Callable[[], Mapping[str, int]],
        loop_busy_s: Callable[[], float | None] = lambda: None,
        # step-wise sequences on workers, and how many of them are held for their callers
        active: Callable[[str], tuple[int, int]] = lambda model: (0, 0),
        jobs_pending: Callable[[str], int] = lambda model: 0,  # batch jobs' requests waiting
    ) -> None:
        self._jobs_pending = jobs_pending
        self._models, self._stats, self._pending = models, stats, pending
        self._active = active
        self._workers, self._restarts = workers, restarts
        self._loop_busy_s = loop_busy_s
        self._rows: list[tuple[str, str, ModelStats]] = []  # this scrape's (_reported)

    def _reported(self) -> list[tuple[str, str, ModelStats]]:
        """(model, version, its statistics) of each version reported: every loaded
        model's current version, and older ones still answering (Stats.versions)."""
        stats = self._stats
        return [
            (m, v, stats.model(m, v))
            for m, cfg in list(self._models.items())
            for v in stats.versions(m, cfg.version)
        ]

    def _per_model(
        self,
        name: str,
        doc: str,
        value: Callable[[ModelStats], float],
        kind: type = CounterMetricFamily,
    ) -> Metric:
        family = kind(name, doc, labels=["model", "version"])
        for m, version, stats in self._rows:
            family.add_metric([m, version], value(stats))
        return family  # type: ignore[no-any-return]

    def _durations(self, name: str, doc: str, pick: Callable[[ModelStats], Duration]) -> Metric:
        return self._per_model(name, doc, lambda s: pick(s).ns / 1000)

    def collect(self) -> Iterator[Metric]:
        self._rows = self._reported()
        yield self._per_model(
            "batchd_inference_request_success",
            "Requests answered successfully",
            lambda s: s.success.count,
        )
        failure = CounterMetricFamily(
            "batchd_inference_request_failure",
            "Requests answered with an error, by reason",
            labels=["model", "version", "reason"],
        )
        for m, version, stats in self._rows:
            for reason, n in sorted(stats.rejected.items()):
                failure.add_metric([m, version, reason], n)
        yield failure
        yield self._per_model(
            "batchd_inference_count",
            "Rows inferred (summed over batches)",
            lambda s: s.inference_count,
        )
        yield self._per_model(
            "batchd_inference_exec_count", "Batches executed", lambda s: s.execution_count
        )
        yield self._per_model(
            "batchd_forward_rows",
            "Rows of the forwards that ran this frontend's batches (other frontends' merged in)",
            lambda s: s.forward_rows,
        )
        pending = GaugeMetricFamily(
            "batchd_inference_pending_request_count",
            "Requests waiting in the model's queue",
            labels=["model", "version"],
        )
        for m, cfg in self._models.items():
            pending.add_metric([m, cfg.version], self._pending(m))
        yield pending
        jobs = GaugeMetricFamily(
            "batchd_job_pending_request_count",
            "Batch jobs' requests waiting in the model's job lane, behind every online one",
            labels=["model", "version"],
        )
        for m, cfg in self._models.items():
            jobs.add_metric([m, cfg.version], self._jobs_pending(m))
        yield jobs
        yield self._durations(
            "batchd_inference_request_duration_us",
            "Time from admission to answer, successful requests",
            lambda s: s.success,
        )
        yield self._durations(
            "batchd_inference_queue_duration_us", "Time in the queue", lambda s: s.queue
        )
        yield self._durations(
            "batchd_inference_compute_input_duration_us",
            "Transfer to and from the worker",
            lambda s: s.compute_input,
        )
        yield self._durations(
            "batchd_inference_compute_infer_duration_us",
            "Model execution",
            lambda s: s.compute_infer,
        )
        yield self._durations(
            "batchd_inference_compute_output_duration_us",
            "Splitting outputs into responses",
            lambda s: s.compute_output,
        )
        yield self._batch_sizes()
        yield self._per_model(
            "batchd_padding_efficiency",
            "Real tokens / padded tokens over all batches (ragged models)",
            lambda s: s.padding_efficiency(),
            GaugeMetricFamily,
        )
        yield self._per_model(
            "batchd_padded_tokens", "Tokens computed, padding included", lambda s: s.padded_tokens
        )
        yield self._per_model(
            "batchd_tokens_per_batch",
            "Tokens computed per batch, padding included (ragged models; packed: real tokens)",
            lambda s: s.padded_tokens / s.execution_count if s.execution_count else 0.0,
            GaugeMetricFamily,
        )
        yield from self._stepwise()
        yield from self._worker_metrics()
        busy = self._loop_busy_s()
        if busy is not None:
            yield CounterMetricFamily(
                "batchd_frontend_loop_busy_seconds",
                "Seconds this frontend's event loop spent working rather than waiting; its "
                "rate is the loop's utilization, the frontend's ceiling (near 1: saturated, "
                "and batches wait up to max_queue_delay_us to fill)",
                value=busy,
            )

    def _stepwise(self) -> Iterator[Metric]:
        """Step-wise models (model.toml [generate]) only."""
        models = {m: cfg for m, cfg in self._models.items() if cfg.generate is not None}
        rows = [(m, v, s) for m, v, s in self._rows if m in models]
        active = GaugeMetricFamily(
            "batchd_sequences_active",
            "Sequences in a slot on a worker",
            labels=["model", "version"],
        )
        held = GaugeMetricFamily(
            "batchd_sequences_held",
            "Sequences in a slot held for their callers: flow control, the caller reads "
            "slower than the model",
            labels=["model", "version"],
        )
        outputs = CounterMetricFamily(
            "batchd_outputs", "Outputs streamed by step-wise models", labels=["model", "version"]
        )
        for m, cfg in models.items():
            running, waiting = self._active(m)
            active.add_metric([m, cfg.version], running)
            held.add_metric([m, cfg.version], waiting)
        for m, version, stats in rows:
            outputs.add_metric([m, version], stats.outputs)
        yield active
        yield held
        yield outputs
        pickers: list[tuple[str, str, Callable[[ModelStats], Histogram]]] = [
            ("batchd_time_to_first_output_us", "Admission to a sequence's first output",
             lambda s: s.first_output),
            ("batchd_inter_output_us", "One output of a sequence to its next",
             lambda s: s.between_outputs),
        ]  # fmt: skip
        for name, doc, pick in pickers:
            family = HistogramMetricFamily(name, doc, labels=["model", "version"])
            for m, version, stats in rows:
                h = pick(stats)
                tops = [str(float(le)) for le in LATENCY_BUCKETS_US] + ["+Inf"]
                running, buckets = 0, []
                for le, n in zip(tops, h.counts, strict=True):
                    running += n
                    buckets.append((le, running))
                family.add_metric([m, version], buckets, h.sum_us)
            yield family
        slots = HistogramMetricFamily(
            "batchd_step_slots", "Sequences stepped together per step", labels=["model", "version"]
        )
        for m, version, stats in rows:
            counts, generate = stats.slots, models[m].generate
            bounds = [b for b in BATCH_BUCKETS if b <= 2 * generate.max_active] if generate else []
            buckets = [
                (str(float(le)), sum(n for a, n in counts.items() if a <= le)) for le in bounds
            ]
            buckets.append(("+Inf", sum(counts.values())))
            slots.add_metric([m, version], buckets, sum(a * n for a, n in counts.items()))
        yield slots

    def _batch_sizes(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "batchd_batch_size", "Rows per executed batch", labels=["model", "version"]
        )
        for m, version, stats in self._rows:
            counts = {size: b.compute_infer.count for size, b in stats.batches.items()}
            buckets = [
                (str(float(le)), sum(n for s, n in counts.items() if s <= le))
                for le in BATCH_BUCKETS
            ]
            buckets.append(("+Inf", sum(counts.values())))
            family.add_metric([m, version], buckets, sum(s * n for s, n in counts.items()))
        return family

    def _worker_metrics(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "batchd_worker_up",
            "1 while the worker of this slot is registered, 0 while it is down or restarting",
            labels=["worker", "device"],
        )
        for w in self._workers():
            up.add_metric([w.slot, w.device], 1.0 if w.up else 0.0)
        yield up
        restarts = CounterMetricFamily(
            "batchd_worker_restarts", "Local worker restarts", labels=["slot"]
        )
        for slot, n in sorted(self._restarts().items()):
            restarts.add_metric([slot], n)
        yield restarts


class Shared(Generic[T]):
    """An async call whose callers, while one runs, share its result (or error)."""

    def __init__(self, make: Callable[[], Awaitable[T]]) -> None:
        self._make = make
        self._running: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._make())
            self._running.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read)
        return await asyncio.shield(self._running)  # (one caller gone stops no other's)


async def start_metrics(
    registry: CollectorRegistry, host: str, port: int,
    refresh: Callable[[], Awaitable[None]] | None = None,
    *, unix: str = "", siblings: Sequence[str] = (),
    statistics: Callable[[bytes], bytes] | None = None,
) -> asyncio.Server:  # fmt: skip
    """Answer GET /metrics on host:port (or the Unix socket `unix`: a frontend's, for
    the others), from now until the server returned is closed; `refresh` first, on
    each scrape (what a collector must not read on the loop: the jobs store), waited
    for REFRESH_S at most: a refresh that does not come in time (a database that hangs)
    goes on alone, one at a time, and the scrape is answered with what the last one
    read. With `siblings` (the other frontends' sockets), theirs too (`gathered`).
    With `statistics`, GET /statistics/<a ModelStatisticsRequest, hex> answers its
    ModelStatisticsResponse, serialized (for the other frontends, siblings.py).
    Binding raises OSError (a port in use) before anything is served."""
    pending: asyncio.Future[None] | None = None  # the refresh in flight

    async def refreshed() -> None:
        nonlocal pending
        if refresh is None:
            return
        if pending is None or pending.done():
            pending = asyncio.ensure_future(refresh())
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        await asyncio.wait([pending], timeout=REFRESH_S)

    async def scrape() -> bytes:
        await refreshed()
        return await gathered(registry, siblings)

    # (each scrape rendered its own: 20 sent and closed held the loop 7 s, 1,500 models)
    scraped = Shared(scrape)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A request that is not one (no blank line within the stream's 64 KiB limit, or
        # none within 10 s) is closed without an answer, and without a log line.
        quietly = (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)
        with contextlib.suppress(*quietly, TimeoutError, ValueError):  # (ValueError: not hex)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if path.split(b"?")[0] == b"/metrics":
                body, status = await scraped(), b"200 OK"
                kind = b"text/plain; version=0.0.4; charset=utf-8"
            elif statistics is not None and path.startswith(b"/statistics/"):
                body, status = statistics(bytes.fromhex(path[12:].decode())), b"200 OK"
                kind = b"application/octet-stream"
            else:
                body, status, kind = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
                status, kind, len(body))  # fmt: skip
            writer.write(head + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    if unix:  # (an OSError would be reported as --metrics-port's, which may be off)
        try:
            return await asyncio.start_unix_server(handle, unix)
        except OSError as e:
            raise ConfigError(f"cannot serve this frontend's socket for the others, {unix}: "
                              f"{e.strerror or e}") from None  # fmt: skip
    server = await asyncio.start_server(handle, host, port)
    log.info("metrics on http://%s:%d/metrics", in_url(host), server.sockets[0].getsockname()[1])
    return server
