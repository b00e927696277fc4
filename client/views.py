"""What the clients return besides tensors: protobuf answers as plain Python values. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchd.protos import inference_pb2 as pb


def model_metadata(msg: pb.ModelMetadataResponse) -> dict[str, Any]:
    def tensors(ts: Sequence[pb.TensorMetadata]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]

    return {
        "name": msg.name,
        "versions": list(msg.versions),
        "platform": msg.platform,
        "inputs": tensors(msg.inputs),
        "outputs": tensors(msg.outputs),
    }


def server_metadata(msg: pb.ServerMetadataResponse) -> dict[str, Any]:
    return {"name": msg.name, "version": msg.version, "extensions": list(msg.extensions)}


def repository_index(msg: pb.RepositoryIndexResponse) -> list[dict[str, str]]:
    return [
        {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
        for m in msg.models
    ]


@dataclass(frozen=True, slots=True)
class Duration:
    """How many things were timed, and their total time."""

    count: int
    ns: int

    @property
    def mean_ms(self) -> float | None:
        """The mean in milliseconds; None when nothing was timed."""
        return self.ns / self.count / 1e6 if self.count else None

    @classmethod
    def from_pb(cls, d: pb.StatisticDuration) -> Duration:
        return cls(int(d.count), int(d.ns))


@dataclass(frozen=True, slots=True)
class BatchStats:
    """The compute times of the batches of one size (`batch_size` rows)."""

    batch_size: int
    count: int  # batches of this size
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One model version's ModelStatistics (Triton's schema): per request, the
    successes, failures, queue time and compute time; per batch size, the
    batches and their compute time. `raw` is the message itself."""

    name: str
    version: str
    last_inference_ms: int  # ms since the epoch; 0: none yet
    inference_count: int  # rows inferred
    execution_count: int  # batches run
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    batches: tuple[BatchStats, ...]
    raw: pb.ModelStatistics

    @property
    def average_batch_size(self) -> float | None:
        """Rows per batch run; None before the first batch."""
        return self.inference_count / self.execution_count if self.execution_count else None


def model_stats(msg: pb.ModelStatisticsResponse) -> list[ModelStats]:
    out = []
    for m in msg.model_stats:
        s = m.inference_stats
        batches = tuple(
            BatchStats(
                int(b.batch_size),
                int(b.compute_infer.count),
                Duration.from_pb(b.compute_input),
                Duration.from_pb(b.compute_infer),
                Duration.from_pb(b.compute_output),
            )
            for b in m.batch_stats
        )
        out.append(
            ModelStats(
                name=m.name,
                version=m.version,
                last_inference_ms=int(m.last_inference),
                inference_count=int(m.inference_count),
                execution_count=int(m.execution_count),
                success=Duration.from_pb(s.success),
                fail=Duration.from_pb(s.fail),
                queue=Duration.from_pb(s.queue),
                compute_input=Duration.from_pb(s.compute_input),
                compute_infer=Duration.from_pb(s.compute_infer),
                compute_output=Duration.from_pb(s.compute_output),
                batches=batches,
                raw=m,
            )
        )
    return out
