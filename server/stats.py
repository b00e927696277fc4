"""Per-model-version inference statistics, in the shape of Triton's ModelStatistics.

    success / fail   requests answered, and their time from admission to answer
    queue            time from admission until its batch was sent to a worker, and
                     then until the worker began its forward (staged behind another)
    compute_input    send -> result round trip minus the model's own time and that
                     wait (ZeroMQ transfer, worker-side tensor conversion)
    compute_infer    the model's forward time as the worker measured it
    compute_output   time to split a batch's outputs back into responses
    inference_count  rows inferred; execution_count: batches run;
                     their ratio is the average batch size (a request run again,
                     alone, after a neighbour widened its answer counts in both)
    batch_stats      per batch size (rows): batches and their compute times,
                     the histogram of batch sizes
    padding          ragged models: real tokens / padded tokens
    rejected         failed requests by reason (queue_full, invalid, deadline, ...)
    step-wise models: each step round is an execution of its active sequences
                     (so average batch size = average slots in use per step);
                     outputs streamed, time to first output and between outputs
                     (histograms), slots in use per step (histogram)

Counts are per client request, as Triton's: a request answered successfully adds
one to success, queue and the three compute counts together, and its own
durations to theirs (perf_analyzer divides each duration by its count): its wait,
and its batches' compute times (Request.took: a request split into chunks waited
as long as its longest-waiting chunk, and took its chunks' compute times
together). A request that fails adds to fail alone, whatever its batches took
(they were added as its batch came back, and a response refused as too large
left 522 ms of compute with no count beside an answer of 15 ms: review 58a).
A batch job's lines are no client requests: their rows and batches count
(inference, execution, batch_stats), their waits and answers do not (the job
metrics count them). A step-wise model's sequence waits once, for its first
slot, and computes in each step round it is stepped in (the round's time): so
its compute count is its request's, one, and perf_analyzer's breakdown of a
streamed request adds up (counted per sequence-step, it showed one step's time
beside a whole sequence's latency: review 58a).

Statistics are kept per model version (one ModelStats each): a reload starts the
new version at zero while the old one drains under its own. Reported are each
model's current version and older ones still answering requests or that answered
one within RETIRED_KEEP_S (Triton reports loaded versions only; forgotten as its
last request was answered, an old version's last answers were never seen: review
58a); then it is forgotten. One Stats object is
created by the composition root and passed to the core (batches) and the
servicer (answers).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from batchd.protos import inference_pb2 as pb


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def pb(self) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=self.count, ns=self.ns)


LATENCY_BUCKETS_US = (500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000,
                      500_000, 1_000_000, 2_000_000, 5_000_000)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Counts by upper bound (LATENCY_BUCKETS_US), with their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_US) + 1))
    sum_us: float = 0.0

    def add(self, ns: int) -> None:
        us = ns / 1000
        self.sum_us += us
        for i, le in enumerate(LATENCY_BUCKETS_US):
            if us <= le:
                self.counts[i] += 1
                return
        self.counts[-1] += 1


@dataclass(slots=True)
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class ModelStats:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, BatchDurations] = field(default_factory=lambda: defaultdict(BatchDurations))
    real_tokens: int = 0  # ragged models: tokens that carry data ...
    padded_tokens: int = 0  # ... and tokens the model computed (rows x longest length)
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # by reason
    outputs: int = 0  # step-wise: outputs streamed
    first_output: Histogram = field(default_factory=Histogram)  # admission -> first output
    between_outputs: Histogram = field(default_factory=Histogram)  # one output -> the next
    slots: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # active -> steps
    # Rows of the forwards that ran this frontend's batches: with --frontends N a
    # worker merges the batches of several frontends (worker/merge.py).
    forward_rows: int = 0

    def average_batch_size(self) -> float:
        return self.inference_count / self.execution_count if self.execution_count else 0.0

    def padding_efficiency(self) -> float:
        """Real tokens / padded tokens over every batch (1.0 when nothing was padded)."""
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


RETIRED_KEEP_S = 60.0  # an old version is reported this long after its last answer
REPORT_SLICE = 50  # models whose statistics one turn of the event loop builds


class Stats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._models: defaultdict[str, dict[str, ModelStats]] = defaultdict(dict)
        self._open: dict[tuple[str, str], int] = {}  # requests being answered, by version
        self._last: dict[tuple[str, str], float] = {}  # when each last had none open
        self._answered = 0
        self._clock = clock

    def model(self, name: str, version: str = "1") -> ModelStats:
        versions = self._models[name]
        m = versions.get(version)
        if m is None:
            m = versions[version] = ModelStats()
        return m

    def versions(self, name: str, current: str) -> list[str]:
        """The versions of model `name` to report: the older ones still answering
        requests (draining after a reload) or that answered one within RETIRED_KEEP_S,
        oldest first, then `current`. Any other version's statistics are forgotten."""
        versions, now = self._models[name], self._clock()
        for v in [v for v in versions if v != current and (name, v) not in self._open]:
            if now - self._last.get((name, v), -math.inf) > RETIRED_KEEP_S:
                del versions[v]
                self._last.pop((name, v), None)
        return [*sorted((v for v in versions if v != current), key=lambda v: (len(v), v)), current]

    def answered_total(self) -> int:
        """Inference requests answered, successfully or not, over every model."""
        return self._answered

    def batch_done(self, model: str, version: str, rows: int, input_ns: int, infer_ns: int,
                   output_ns: int, forward_rows: int = 0) -> None:  # fmt: skip
        """A batch came back with results (its requests' durations are counted as they
        are answered). `forward_rows`: the rows of the forward that ran it (0: its own)."""
        m = self.model(model, version)
        m.forward_rows += forward_rows or rows
        m.inference_count += rows
        m.execution_count += 1
        m.last_inference_ms = time.time_ns() // 1_000_000
        b = m.batches[rows]
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def step(self, model: str, version: str, active: int) -> None:
        """A step-wise model's step round ran `active` sequences (what it took is each
        one's: Request.took)."""
        m = self.model(model, version)
        m.execution_count += 1
        m.inference_count += active
        m.forward_rows += active  # (its sequences, every frontend's: a batch's forward_rows)
        m.slots[active] += 1
        m.last_inference_ms = time.time_ns() // 1_000_000

    def output(self, model: str, version: str, waited_ns: int, first: bool) -> None:
        """A sequence's output reached the frontend `waited_ns` after its previous one
        (or, `first`, after its admission)."""
        m = self.model(model, version)
        m.outputs += 1
        (m.first_output if first else m.between_outputs).add(waited_ns)

    def padding(self, model: str, version: str, real_tokens: int, padded_tokens: int) -> None:
        m = self.model(model, version)
        m.real_tokens += real_tokens
        m.padded_tokens += padded_tokens

    def opened(self, model: str, version: str) -> None:
        """A request of `version` is being answered (answered() closes it)."""
        key = (model, version)
        self._open[key] = self._open.get(key, 0) + 1

    def answering(self, model: str, version: str) -> int:
        """Requests of `version` opened and not yet answered."""
        return self._open.get((model, version), 0)

    def answered(self, model: str, version: str, duration_ns: int, failure: str | None = None,
                 timing: list[int] | None = None) -> None:  # fmt: skip
        """A request was answered: successfully (one more for success, queue and compute,
        with its `timing`: Request.took's), or with the failure's reason."""
        key = (model, version)
        if (n := self._open.get(key)) is not None:
            if n > 1:
                self._open[key] = n - 1
            else:
                del self._open[key]
                self._last[key] = self._clock()
        self._answered += 1
        m = self.model(model, version)
        if failure is not None:
            m.fail.add(duration_ns)
            m.rejected[failure] += 1
            return
        m.success.add(duration_ns)
        queue_ns, input_ns, infer_ns, output_ns = timing or (0, 0, 0, 0)
        m.queue.add(queue_ns)
        m.compute_input.add(input_ns)
        m.compute_infer.add(infer_ns)
        m.compute_output.add(output_ns)

    async def report(
        self, current: Iterable[tuple[str, str]], only: str = ""
    ) -> list[pb.ModelStatistics]:
        """ModelStatistics of each (model, current version): of the versions reported
        (versions()), or with `only` (a version asked for), of that one where it is among
        them (a version no model has made an entry for every model, for every string a
        caller sent: memory without bound). Built REPORT_SLICE models a turn of the loop:
        1,500 models of 32 batch sizes each held it 188 ms (review 58a)."""
        out: list[pb.ModelStatistics] = []
        for i, (n, c) in enumerate(current):
            if i and not i % REPORT_SLICE:
                await asyncio.sleep(0)
            out.extend(self.to_pb(n, v) for v in self.versions(n, c) if v == only or not only)
        return out

    def to_pb(self, name: str, version: str) -> pb.ModelStatistics:
        m = self.model(name, version)
        return pb.ModelStatistics(
            name=name,
            version=version,
            last_inference=m.last_inference_ms,
            inference_count=m.inference_count,
            execution_count=m.execution_count,
            inference_stats=pb.InferStatistics(
                success=m.success.pb(),
                fail=m.fail.pb(),
                queue=m.queue.pb(),
                compute_input=m.compute_input.pb(),
                compute_infer=m.compute_infer.pb(),
                compute_output=m.compute_output.pb(),
                cache_hit=pb.StatisticDuration(),  # (no cache: zeros, written as Triton's)
                cache_miss=pb.StatisticDuration(),
            ),
            batch_stats=[
                pb.InferBatchStatistics(
                    batch_size=size,
                    compute_input=b.compute_input.pb(),
                    compute_infer=b.compute_infer.pb(),
                    compute_output=b.compute_output.pb(),
                )
                for size, b in sorted(m.batches.items())
            ],
        )
