"""Per-model inference statistics, in the shape of Triton's ModelStatistics.

    success / fail   requests answered, and their time from admission to answer
    queue            time from admission until its batch was sent to a worker
    compute_input    send -> result round trip minus the model's own time
                     (ZeroMQ transfer, worker-side tensor conversion)
    compute_infer    the model's forward time as the worker measured it
    compute_output   time to split a batch's outputs back into responses
    inference_count  rows inferred; execution_count: batches run;
                     their ratio is the average batch size
    batch_stats      per batch size (rows): batches and their compute times,
                     the histogram of batch sizes
    padding          ragged models: real tokens / padded tokens
    rejected         failed requests by reason (queue_full, invalid, deadline, ...)
    step-wise models: each step round is an execution of its active sequences
                     (so average batch size = average slots in use per step);
                     outputs streamed, time to first output and between outputs
                     (histograms), slots in use per step (histogram)

Counts are per request for the per-request durations and per batch in
batch_stats. One Stats object is created by the composition root and
passed to the dispatcher (batches) and the servicer (answers).
"""

from __future__ import annotations

import time
from collections import defaultdict
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


class Stats:
    def __init__(self) -> None:
        self._models: dict[str, ModelStats] = defaultdict(ModelStats)

    def model(self, name: str) -> ModelStats:
        return self._models[name]

    def answered_total(self) -> int:
        """Inference requests answered, successfully or not, over every model."""
        return sum(m.success.count + m.fail.count for m in self._models.values())

    def batch_done(
        self,
        model: str,
        rows: int,
        requests: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        forward_rows: int = 0,
    ) -> None:
        """A batch came back with results; `queue_ns` is summed over its requests;
        `forward_rows`: the rows of the forward that ran it (0: its own)."""
        m = self._models[model]
        m.forward_rows += forward_rows or rows
        m.inference_count += rows
        m.execution_count += 1
        m.last_inference_ms = time.time_ns() // 1_000_000
        m.queue.add(queue_ns, requests)
        m.compute_input.add(input_ns * requests, requests)
        m.compute_infer.add(infer_ns * requests, requests)
        m.compute_output.add(output_ns * requests, requests)
        b = m.batches[rows]
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def started(self, model: str, queue_ns: int) -> None:
        """A step-wise model's sequence left the queue for a slot after `queue_ns`."""
        self._models[model].queue.add(queue_ns)

    def step(self, model: str, active: int, infer_ns: int) -> None:
        """A step-wise model's step round ran `active` sequences in `infer_ns`."""
        m = self._models[model]
        m.execution_count += 1
        m.inference_count += active
        m.compute_infer.add(infer_ns * active, active)  # per sequence-step, as batches
        m.compute_input.add(0, active)  # (the three counts must agree: perf_analyzer)
        m.compute_output.add(0, active)
        m.slots[active] += 1
        m.last_inference_ms = time.time_ns() // 1_000_000

    def output(self, model: str, waited_ns: int, first: bool) -> None:
        """A sequence's output reached the frontend `waited_ns` after its previous one
        (or, `first`, after its admission)."""
        m = self._models[model]
        m.outputs += 1
        (m.first_output if first else m.between_outputs).add(waited_ns)

    def padding(self, model: str, real_tokens: int, padded_tokens: int) -> None:
        m = self._models[model]
        m.real_tokens += real_tokens
        m.padded_tokens += padded_tokens

    def answered(self, model: str, duration_ns: int, failure: str | None = None) -> None:
        """A request was answered: successfully, or with the failure's reason."""
        m = self._models[model]
        if failure is None:
            m.success.add(duration_ns)
        else:
            m.fail.add(duration_ns)
            m.rejected[failure] += 1

    def to_pb(self, name: str, version: str) -> pb.ModelStatistics:
        m = self._models[name]
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
