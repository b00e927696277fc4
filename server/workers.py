"""What the dispatcher knows of each worker and each batch it sent, and the
events it raises for the rest of the frontend."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig
from batchd.server.request import Request


class Events(Protocol):
    """What the dispatcher tells the rest of the frontend."""

    def pump(self) -> None: ...  # capacity changed

    def requeue(self, requests: list[Request]) -> None: ...  # a lost batch comes back

    def workers_changed(self) -> None: ...  # readiness may have changed

    def worker_ready(self, worker: Worker) -> None: ...  # a worker registered: load its models

    # stuck: its process may live on, useless (kill it if it is local)
    def worker_lost(self, worker_id: str, reason: str, stuck: bool) -> None: ...

    def batch_done(self, model: str, rows: int, compute_s: float) -> None: ...


@dataclass(eq=False)
class Worker:
    identity: bytes
    info: wire.WorkerInfo
    last_seen: float
    models: set[str] = field(default_factory=set)  # ModelConfig.key of each loaded version
    inflight: dict[int, Batch] = field(default_factory=dict)
    loads: dict[str, asyncio.Future[str]] = field(default_factory=dict)  # key -> error or ""
    credits: int = 1  # batches it may hold at once

    @property
    def name(self) -> str:
        return self.info.worker_id

    def accepts(self, model: str) -> bool:
        return not self.info.models or model in self.info.models

    @property
    def exclusive(self) -> bool:
        """It runs a suspect: no other batch may be staged beside it."""
        return any(b.suspect for b in self.inflight.values())


@dataclass(eq=False, slots=True)
class Batch:
    id: int
    model: ModelConfig
    requests: list[Request]
    sent_at: float
    suspect: bool = False  # a retry after a failure: its worker takes nothing else meanwhile
