"""Prometheus metrics, read from the live state at scrape time.

Nothing is counted twice: the collector turns `Stats` (and the queues and
workers) into metric families when /metrics is scraped, so the request path
pays nothing for metrics. The collectors are created by the composition root and
passed in; nothing is registered globally. /metrics is served from the event
loop itself (a tiny HTTP/1.1 responder): the state is read there, never from
another thread, a few models a turn of the loop (exposition.py); scrapes that
arrive while one is rendered share it.

Names follow Triton's (`nv_` becomes `batchd_`) so dashboards port by a prefix
rename; batchd adds batch-size, padding and worker metrics.

With `--frontends N` each child frontend answers /metrics on a private Unix
socket, and frontend 0's /metrics gathers them on each scrape (siblings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from batchd.protos.model_config import ConfigError, ModelConfig
from batchd.server.exposition import Families, Family, Source, labels, render
from batchd.server.security import in_url
from batchd.server.siblings import gathered
from batchd.server.stats import LATENCY_BUCKETS_US, Duration, Histogram, ModelStats, Stats

log = logging.getLogger("batchd.metrics")
REFRESH_S = 2.0  # a scrape waits this long, at most, for the jobs store's counts
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
T = TypeVar("T")
Rows = list[tuple[str, str, ModelStats, str]]  # (model, version, its statistics, labels)
PART = 50  # models read and written per turn of the loop (exposition.py): 3-8 ms here


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
    """batchd's own state as metric families' text (exposition.py), a few models a part."""

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        stats: Stats,
        pending: Callable[[], Mapping[str, int]],  # requests waiting, by model
        workers: Callable[[], list[WorkerView]],
        restarts: Callable[[], Mapping[str, int]],
        loop_busy_s: Callable[[], float | None] = lambda: None,
        # step-wise sequences on workers, and how many of them are held for their callers
        active: Callable[[str], tuple[int, int]] = lambda model: (0, 0),
        jobs_pending: Callable[[], Mapping[str, int]] = dict,  # jobs' requests waiting, likewise
    ) -> None:
        self._jobs_pending = jobs_pending
        self._models, self._stats, self._pending = models, stats, pending
        self._active = active
        self._workers, self._restarts = workers, restarts
        self._loop_busy_s = loop_busy_s

    def parts(self, size: int = PART) -> Iterator[Families]:
        """The families of `size` models at a time (the workers' and the loop's in the first
        part), for a caller that lets the loop run between parts (exposition.render). A
        model unloaded meanwhile is left out, one reloaded read as it is now."""
        names, waiting = list(self._models), (self._pending(), self._jobs_pending())
        for i in range(0, max(len(names), 1), size):
            part = [(m, cfg) for m in names[i : i + size] if (cfg := self._models.get(m))]
            yield self._families(part, waiting, whole=i == 0)

    def _families(
        self, models: list[tuple[str, ModelConfig]],
        waiting: tuple[Mapping[str, int], Mapping[str, int]], whole: bool,
    ) -> Families:  # fmt: skip
        # (model, version, its statistics, its labels) of each version reported: every
        # loaded model's current version, and older ones still answering (Stats.versions)
        of = self._stats
        rows = [(m, v, of.model(m, v), labels(model=m, version=v))
                for m, cfg in models for v in of.versions(m, cfg.version)]  # fmt: skip
        out: Families = {}

        def family(name: str, kind: str, doc: str) -> Family:
            out[name] = made = Family.of(name, kind, doc)
            return made

        def per_model(name: str, doc: str, value: Callable[[ModelStats], float],
                      kind: str = "counter") -> None:  # fmt: skip
            f = family(name, kind, doc)
            for _, _, s, lab in rows:
                f.add(lab, value(s))

        def durations(name: str, doc: str, pick: Callable[[ModelStats], Duration]) -> None:
            per_model(name, doc, lambda s: pick(s).ns / 1000)

        per_model(
            "batchd_inference_request_success",
            "Requests answered successfully",
            lambda s: s.success.count,
        )
        failure = family(
            "batchd_inference_request_failure", "counter",
            "Requests answered with an error, by reason",
        )  # fmt: skip
        for m, version, stats, _ in rows:
            for reason, n in sorted(stats.rejected.items()):
                failure.add(labels(model=m, version=version, reason=reason), n)
        per_model(
            "batchd_inference_count",
            "Rows inferred (summed over batches)",
            lambda s: s.inference_count,
        )
        per_model("batchd_inference_exec_count", "Batches executed", lambda s: s.execution_count)
        per_model(
            "batchd_forward_rows",
            "Rows of the forwards that ran this frontend's batches (other frontends' merged in)",
            lambda s: s.forward_rows,
        )
        pending = family(
            "batchd_inference_pending_request_count", "gauge",
            "Requests waiting in the model's queue",
        )  # fmt: skip
        jobs = family(
            "batchd_job_pending_request_count", "gauge",
            "Batch jobs' requests waiting in the model's job lane, behind every online one",
        )  # fmt: skip
        for m, cfg in models:
            pending.add(labels(model=m, version=cfg.version), waiting[0].get(m, 0))
        for m, cfg in models:
            jobs.add(labels(model=m, version=cfg.version), waiting[1].get(m, 0))
        durations(
            "batchd_inference_request_duration_us",
            "Time from admission to answer, successful requests",
            lambda s: s.success,
        )
        durations("batchd_inference_queue_duration_us", "Time in the queue", lambda s: s.queue)
        durations(
            "batchd_inference_compute_input_duration_us",
            "Transfer to and from the worker",
            lambda s: s.compute_input,
        )
        durations(
            "batchd_inference_compute_infer_duration_us",
            "Model execution",
            lambda s: s.compute_infer,
        )
        durations(
            "batchd_inference_compute_output_duration_us",
            "Splitting outputs into responses",
            lambda s: s.compute_output,
        )
        sizes = family("batchd_batch_size", "histogram", "Rows per executed batch")
        for _, _, stats, lab in rows:
            counts = {size: b.compute_infer.count for size, b in stats.batches.items()}
            sizes.histogram(lab, _buckets(counts, BATCH_BUCKETS),
                            sum(s * n for s, n in counts.items()))  # fmt: skip
        per_model(
            "batchd_padding_efficiency",
            "Real tokens / padded tokens over all batches (ragged models)",
            lambda s: s.padding_efficiency(),
            "gauge",
        )
        per_model(
            "batchd_padded_tokens", "Tokens computed, padding included", lambda s: s.padded_tokens
        )
        per_model(
            "batchd_tokens_per_batch",
            "Tokens computed per batch, padding included (ragged models; packed: real tokens)",
            lambda s: s.padded_tokens / s.execution_count if s.execution_count else 0.0,
            "gauge",
        )
        self._stepwise(family, rows, models)
        if whole:
            self._whole(family)
        return out

    def _stepwise(
        self, family: Callable[[str, str, str], Family], rows: Rows,
        of: list[tuple[str, ModelConfig]],
    ) -> None:  # fmt: skip
        """Step-wise models (model.toml [generate]) only."""
        models = {m: cfg for m, cfg in of if cfg.generate is not None}
        rows = [row for row in rows if row[0] in models]
        active = family("batchd_sequences_active", "gauge", "Sequences in a slot on a worker")
        held = family(
            "batchd_sequences_held", "gauge",
            "Sequences in a slot held for their callers: flow control, the caller reads "
            "slower than the model",
        )  # fmt: skip
        outputs = family("batchd_outputs", "counter", "Outputs streamed by step-wise models")
        for m, cfg in models.items():
            running, waiting = self._active(m)
            active.add(labels(model=m, version=cfg.version), running)
            held.add(labels(model=m, version=cfg.version), waiting)
        for _, _, stats, lab in rows:
            outputs.add(lab, stats.outputs)
        pickers: list[tuple[str, str, Callable[[ModelStats], Histogram]]] = [
            ("batchd_time_to_first_output_us", "Admission to a sequence's first output",
             lambda s: s.first_output),
            ("batchd_inter_output_us", "One output of a sequence to its next",
             lambda s: s.between_outputs),
        ]  # fmt: skip
        tops = [str(float(le)) for le in LATENCY_BUCKETS_US] + ["+Inf"]
        for name, doc, pick in pickers:
            times = family(name, "histogram", doc)
            for _, _, stats, lab in rows:
                h = pick(stats)
                times.histogram(
                    lab, zip(tops, itertools.accumulate(h.counts), strict=True), h.sum_us
                )
        slots = family("batchd_step_slots", "histogram", "Sequences stepped together per step")
        for m, _, stats, lab in rows:
            counts, generate = stats.slots, models[m].generate
            bounds = [b for b in BATCH_BUCKETS if b <= 2 * generate.max_active] if generate else []
            slots.histogram(lab, _buckets(counts, bounds), sum(a * n for a, n in counts.items()))

    def _whole(self, family: Callable[[str, str, str], Family]) -> None:
        up = family(
            "batchd_worker_up", "gauge",
            "1 while the worker of this slot is registered, 0 while it is down or restarting",
        )  # fmt: skip
        for w in self._workers():
            up.add(labels(worker=w.slot, device=w.device), 1.0 if w.up else 0.0)
        restarts = family("batchd_worker_restarts", "counter", "Local worker restarts")
        for slot, n in sorted(self._restarts().items()):
            restarts.add(labels(slot=slot), n)
        if (busy := self._loop_busy_s()) is not None:
            family(
                "batchd_frontend_loop_busy_seconds", "counter",
                "Seconds this frontend's event loop spent working rather than waiting; its "
                "rate is the loop's utilization, the frontend's ceiling (near 1: saturated, "
                "and batches wait up to max_queue_delay_us to fill)",
            ).add("", busy)  # fmt: skip


def _buckets(counts: Mapping[int, int], bounds: Iterable[int]) -> list[tuple[str, float]]:
    """A histogram's buckets of `counts` (value: how many), up to each bound and +Inf."""
    buckets: list[tuple[str, float]] = [
        (str(float(le)), sum(n for s, n in counts.items() if s <= le)) for le in bounds
    ]
    return [*buckets, ("+Inf", sum(counts.values()))]


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
    sources: Sequence[Source], host: str, port: int,
    refresh: Callable[[], Awaitable[None]] | None = None,
    *, unix: str = "", siblings: Sequence[str] = (),
    statistics: Callable[[bytes], Awaitable[bytes]] | None = None,
) -> asyncio.Server:  # fmt: skip
    """Answer GET /metrics on host:port (or the Unix socket `unix`: a frontend's, for
    the others) with the families of `sources` (exposition.render: a part a turn),
    from now until the server returned is closed; `refresh` first, on
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
        try:
            await refreshed()
            own = await render(sources)
            return await gathered(own, siblings) if siblings else own
        except Exception:  # (a defect: said once, and answered 500 to each caller)
            log.exception("a /metrics scrape failed")
            raise

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
                try:
                    body, status = await scraped(), b"200 OK"
                    kind = b"text/plain; version=0.0.4; charset=utf-8"
                except Exception:  # (scrape() logged it)
                    body, status = b"the scrape failed: see batchd's log\n", b"500 Server Error"
                    kind = b"text/plain; charset=utf-8"
            elif statistics is not None and path.startswith(b"/statistics/"):
                body, status = await statistics(bytes.fromhex(path[12:].decode())), b"200 OK"
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
