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

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from batchd.server.core import Core
from batchd.server.service import InferenceService

LIVENESS = "batchd.liveness"  # the liveness probe's service name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
log = logging.getLogger("batchd.server")


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
