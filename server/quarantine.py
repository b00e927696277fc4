"""Quarantine: inputs that ended their worker refused for a while, unrun.

A request whose worker is lost MAX_ATTEMPTS times fails (recovery.py); where its
last run was alone on its worker (nothing else in flight, nothing loading) and
ended the process, the loss is its own: core.lose tells only those (not one past
its execution_timeout_s: three slow but good inputs held a healthy model). Sent
again at once, by a caller or a client that retries, the same inputs end two more
workers each time: the pool is forever restarting and every model on it goes
unserved (one client resending a poison request took 0 of a bystander's 12 calls
in 60 s). So the failed request's
inputs are remembered, by digest, for HOLD_S per model version, and the same
inputs again fail at admission with the first failure's message, unrun. Other
inputs that end workers do the same (a model that crashes on a class of inputs:
a client sending a new one each time ended 98 workers in 60 s, and the bystander
got 0 of 12 answers), so a model version with BREAK such failures in the last
HOLD_S takes no online request (UNAVAILABLE, with a pushback) till the oldest of
them is HOLD_S old: at most BREAK a minute end workers, and the pool stays up for
the other models. Its batch jobs' lines wait in their lane meanwhile, not failed
(`paused_until`): a job of many poison lines ended a worker with each, every death
backed off, and online callers of every model got 1 answer in 13 for as long as it
ran. A new version (a reload) starts with none held. A step-wise model's sequences
are remembered as well.

Cost: a dict lookup per request while its model version holds none; else a
comparison of shapes, and a digest (SHA-256, about 2 GB/s, on the event loop)
only of a request whose shapes match a remembered one's, and of at most
DIGEST_MOST bytes (8 ms): larger inputs are not remembered, only counted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchd.server.errors import ModelFailed, Refused
from batchd.server.request import Request

HOLD_S, MOST = 60.0, 64  # how long inputs are remembered; how many, per model version
BREAK = 3  # failures in HOLD_S past which a model version takes no online request
DIGEST_MOST = 16 << 20  # bytes of input past which a request is not digested

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
        """Raise ModelFailed if the inputs of `request` are held, Refused if its model
        version is (an online request)."""
        if request.model.key not in self.held:
            return
        now = self._clock()
        self._expire(now)
        held = self.held.get(request.model.key, [])
        if len(held) >= BREAK and not request.background:
            left = HOLD_S - (now - held[-BREAK].since)
            refused = Refused(
                f"model {request.model.name!r} takes no requests for {left:.0f} s: {len(held)} "
                f"of its requests ended their workers in the last {HOLD_S:.0f} s, and it is "
                f"held back so that the workers stay up for the other models (last: {held[-1].why})"
            )
            refused.retry_after_ms = max(1, round(left * 1000))
            raise refused
        shapes, digest = _shapes(request), None
        for h in held:
            if h.shapes != shapes or not h.digest:
                continue
            digest = _digest(request) if digest is None else digest
            if h.digest == digest:
                raise ModelFailed(
                    f"refused unrun: the same inputs failed {now - h.since:.0f} s ago, and are "
                    f"refused for {HOLD_S - (now - h.since):.0f} s more: {h.why}"
                )

    def paused_until(self, key: str) -> float:
        """Till when model version `key` takes no batch job's lines (0.0: it does)."""
        self._expire(self._clock())
        held = self.held.get(key, ())
        return held[-BREAK].since + HOLD_S if len(held) >= BREAK else 0.0

    def _expire(self, now: float) -> None:
        for key, held in list(self.held.items()):
            if now - held[-1].since >= HOLD_S:
                del self.held[key]
            elif now - held[0].since >= HOLD_S:
                held[:] = [h for h in held if now - h.since < HOLD_S]


def _shapes(r: Request) -> Shapes:
    return tuple((t.name, t.datatype, t.shape) for t in r.inputs)


def _digest(r: Request) -> bytes:
    """Of its inputs' data (their shapes and types are compared apart); b"" past
    DIGEST_MOST bytes, which matches nothing."""
    if sum(len(t.data) for t in r.inputs) > DIGEST_MOST:
        return b""
    h = hashlib.sha256()
    for t in r.inputs:
        h.update(t.data)
    return h.digest()
