"""A retry after a failure runs alone on a worker that several frontends share.

A frontend retries each request of a batch that lost its worker (or made the model
raise in company) alone (server/recovery.py): if one of them is a poison that ends
the process, it takes down no innocent request with it. A frontend keeps its own
batches off a worker running such a retry, but with `--frontends N` the others know
nothing of it, and their batches queued behind it died with the worker: an
innocent retry of theirs, lost a second time, failed.

So the worker keeps the others off itself: while a frontend's `alone` batch is here
(queued or running), a batch of another frontend is bounced at once, unrun (ERROR
with `bounced`: the frontend sends it elsewhere, no attempt counted), and each
heartbeat to the others says `alone`, so they send nothing more till it has gone.
An alone batch that finds other batches here (queued or running) is bounced too,
since a poison among them would take it down: the worker is then kept for it for
RESERVE_S (the others' batches bounced), so that it drains and the retry, sent again
after its frontend's next heartbeat, finds it free. Sequences do not count, as on a
frontend (pool.py): under continuous batching a worker is never without them, and a
retry would wait for ever. The I/O thread counts a batch in as it arrives, the
compute thread out once it has run.
"""

from __future__ import annotations

import threading
from typing import Any

from batchd.protos import wire

RESERVE_S = 2 * wire.HEARTBEAT_INTERVAL_S  # kept for a bounced retry: its frontend's next beat


class Alone:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._here: dict[int, int] = {}  # frontend index -> its alone batches here
        self._kept: dict[int, float] = {}  # frontend index -> kept for its retry until
        self._batches = 0  # queued or running, every frontend's

    def admit(self, frontend: int, header: wire.Header, now: float) -> bool:
        """A BATCH from `frontend` arrived (I/O thread): whether it may be queued; not
        while another frontend's alone batch is here or the worker is kept for one, nor
        an alone one while other batches are here."""
        with self._lock:
            if self._others(frontend, now):
                return False
            if header.alone:
                if self._batches:
                    self._kept[frontend] = now + RESERVE_S
                    return False
                self._kept.pop(frontend, None)
                self._here[frontend] = self._here.get(frontend, 0) + 1
            self._batches += 1
            return True

    def ran(self, frontend: int, header: wire.Header) -> None:
        """A BATCH of `frontend` has run, or failed before it could (compute thread)."""
        with self._lock:
            self._batches = max(0, self._batches - 1)
            if header.alone:
                if (left := self._here.get(frontend, 0) - 1) > 0:
                    self._here[frontend] = left
                else:
                    self._here.pop(frontend, None)

    def others(self, frontend: int, now: float) -> bool:
        """Whether another frontend's alone batch is here, or the worker is kept for one
        (a heartbeat's `alone`)."""
        with self._lock:
            return self._others(frontend, now)

    def _others(self, frontend: int, now: float) -> bool:
        if self._kept:  # (on every batch's arrival: nothing built when none is kept)
            self._kept = {f: until for f, until in self._kept.items() if until > now}
        return any(f != frontend for f in (*self._here, *self._kept))


def bounce(header: wire.Header) -> list[Any]:
    """The reply to a batch not run because another frontend's alone batch is here."""
    why = "bounced: another frontend's retry runs alone here"
    return wire.pack(wire.Header(kind=wire.Header.ERROR, batch_id=header.batch_id,
                                 bounced=True, error=why))  # fmt: skip
