"""What one forward takes: the batch at hand, the batches waiting behind it that
merge with it (merge.py), and, on a worker that serves several frontends, the
next batch of every frontend that had one in the model's previous forward.

With `batchd serve --frontends N` each frontend sends the batch it formed
while its last one ran as soon as that one's reply comes. Taking only what
waited at the instant the model was free ran those batches one by one, each
with a frontend's share of the requests: tiny at 32 callers made forwards of
3 rows with two frontends where one frontend made 15-18. So a forward waits
for each frontend that was in the model's last forward (it was answered, and
its next batch is on its way) until that frontend's batch comes or it says
PASS (its reply left it nothing to send), the forward is full, something that
cannot join comes, or GATHER_WAIT_S passes (a frontend that died or stalls
costs one forward that long, once: it is not awaited again until it sends).
A worker of one frontend never waits: its frontend's next batch is already
sent or does not exist yet.
"""

from __future__ import annotations

import queue
import time

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig, model_key
from batchd.worker import merge
from batchd.worker.merge import Item

GATHER_WAIT_S = 0.002  # the most a forward waits for a frontend it awaits


class Gatherer:
    """Owned by the worker's compute thread; reads the work queue it is given."""

    def __init__(
        self, work: queue.SimpleQueue[Item | None], shared: bool, wait_s: float = GATHER_WAIT_S
    ) -> None:
        self._work = work
        self._shared = shared  # the worker serves several frontends
        self._wait_s = wait_s
        self._awaited: dict[str, set[int]] = {}  # model key -> frontends a forward waits for

    def passed(self, frontend: int) -> None:
        """`frontend` has nothing to send now: no forward waits for it."""
        for frontends in self._awaited.values():
            frontends.discard(frontend)

    def gather(
        self, cfg: ModelConfig | None, first: Item, wait: bool = True
    ) -> tuple[list[Item], Item | None]:
        """The batches of one forward, `first` leading; and an item taken that could
        not join, to do next. `wait`: False while step-wise sequences step (their
        next round must not wait for another model's batches)."""
        group, header = [first], first[1]
        if cfg is None or not merge.mergeable(cfg, header):
            return group, None
        key = model_key(header.model, header.version)
        awaited = self._awaited.pop(key, set()) - {first[0]} if wait else set()
        rows, held = merge.rows_of(header), None
        deadline = time.monotonic() + self._wait_s
        while rows < cfg.max_batch_size:
            try:
                if awaited:
                    item = self._work.get(timeout=max(0.0, deadline - time.monotonic()))
                else:
                    item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is None:  # a stop: it comes back after this forward
                self._work.put(None)
                break
            frontend, other, _ = item
            awaited.discard(frontend)
            if other.kind == wire.Header.PASS:
                self.passed(frontend)
            elif merge.can_merge(cfg, header, other, rows):
                group.append(item)
                rows += merge.rows_of(other)
            else:
                held = item
                break
        if self._shared:
            self._awaited[key] = {f for f, _, _ in group}
        return group, held
