"""The health service (grpc.health.v1), kept in step with the server: "" is readiness
(every model ready, and not stopping), each model its own, LIVENESS the process.

The process is live from start-up until it stops, draining included, so that a liveness
failure never cuts a drain short; but a child frontend (`--frontends N`) whose frontend 0
answers no beat is not (frontends.watch_parent): nothing else restarts frontend 0, whose
own callers wait. ServerLive and /v2/health/live say the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from batchd.server.core import Core
from batchd.server.errors import clip
from batchd.server.service import InferenceService

LIVENESS = "batchd.liveness"  # the liveness probe's service name
MAX_SERVICE_CHARS = 200  # past any name it answers for: a model's has 128 at most
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
log = logging.getLogger("batchd.server")


class Health(HealthServicer):  # type: ignore[misc]
    """grpc.health.v1, which answers without a token (probes): a service name longer than
    any it answers for is refused at once. A Watch held its request, a name of up to
    --max-message-bytes, for the life of its stream: 20 streams of 16 MB names, sent
    with no token, held 1.4 GB of the frontend (review 53c)."""

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        await _bounded(request.service, context)
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        await _bounded(request.service, context)
        await super().Watch(request, context)


async def _bounded(service: str, context: Any) -> None:
    if len(service) > MAX_SERVICE_CHARS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
            f"service name {clip(service)}: expected '' (the server), {LIVENESS!r} or a "
            f"model's name, at most {MAX_SERVICE_CHARS} characters"))  # fmt: skip


async def track_health(health: HealthServicer, service: InferenceService, core: Core) -> None:
    """Say each change of readiness and liveness, as it comes (core.changed)."""
    said: dict[str, bool] = {}
    while True:
        if said.get(LIVENESS) != service.live:
            await health.set(LIVENESS, SERVING if service.live else NOT_SERVING)
            said[LIVENESS] = service.live
        for name in sorted(set(core.models) | said.keys() - {"", LIVENESS}):
            ready = core.model_ready(name) and not service.leaving
            if said.get(name) != ready:
                why = "stopping" if service.leaving else core.load_error(name) or "no live worker"
                log.info("model %s is %s", name, "ready" if ready else f"NOT ready ({why})",
                         extra={"model": name})  # fmt: skip
                await health.set(name, SERVING if ready else NOT_SERVING)
                said[name] = ready
        overall = service.ready()
        if said.get("") != overall:
            await health.set("", SERVING if overall else NOT_SERVING)
            said[""] = overall
        await core.changed.wait()
        core.changed.clear()


def liveness(service: InferenceService, changed: asyncio.Event) -> Callable[[bool], None]:
    """What sets the process's liveness (a child frontend's watch_parent: False while its
    frontend 0 is silent), for track_health() and the inference service's live checks."""

    def live(ok: bool) -> None:
        service.live = ok
        changed.set()

    return live
