"""Quarantine: inputs that ended their worker refused for a while, unrun.

A request whose worker is lost MAX_ATTEMPTS times fails (recovery.py); its last
run was alone, so the loss is its own. Sent again at once, by a caller or a
client that retries, the same inputs end two more workers each time: the pool is
forever restarting and every model on it goes unserved (one client resending a
poison request took 0 of a bystander's 12 calls in 60 s). So the failed request's
inputs are remembered, by digest, for HOLD_S per model version, and the same
inputs again fail at admission with the first failure's message, unrun. A new
version (a reload) starts with none. A step-wise model's sequences are not
remembered: one that started beside a poison can be counted with it.

Cost: a dict lookup per request while its model version holds none; else a
comparison of shapes, and a digest (blake2b, about 1 GB/s) only of a request
whose shapes match a remembered one's.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchd.server.errors import ModelFailed
from batchd.server.request import Request

HOLD_S, MOST = 60.0, 64  # how long inputs are remembered; how many, per model version

Shapes = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class _Held:
    shapes: Shapes
    digest: bytes
    since: float
    why: str


class Quarantine:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.held: dict[str, list[_Held]] = {}  # model version key -> inputs held, oldest first

    def add(self, request: Request, why: str) -> None:
        """Remember the inputs of `request` (a chunk's: of the request it came from),
        which failed with `why`."""
        r = request.whole or request
        now = self._clock()
        self._expire(now)
        held = self.held.setdefault(r.model.key, [])
        held.append(_Held(_shapes(r), _digest(r), now, why))
        del held[:-MOST]

    def check(self, request: Request) -> None:
        """Raise ModelFailed if the inputs of `request` are held."""
        if request.model.key not in self.held:
            return
        now = self._clock()
        self._expire(now)
        shapes, digest = _shapes(request), b""
        for h in self.held.get(request.model.key, ()):
            if h.shapes == shapes and h.digest == (digest := digest or _digest(request)):
                raise ModelFailed(
                    f"refused unrun: the same inputs failed {now - h.since:.0f} s ago, and are "
                    f"refused for {HOLD_S - (now - h.since):.0f} s more: {h.why}"
                )

    def _expire(self, now: float) -> None:
        for key, held in list(self.held.items()):
            if now - held[-1].since >= HOLD_S:
                del self.held[key]
            elif now - held[0].since >= HOLD_S:
                held[:] = [h for h in held if now - h.since < HOLD_S]


def _shapes(r: Request) -> Shapes:
    return tuple((t.name, t.datatype, t.shape) for t in r.inputs)


def _digest(r: Request) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in r.inputs:
        h.update(t.data)
    return h.digest()
