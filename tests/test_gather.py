"""worker/gather.py: what one forward takes, and whom a worker of several frontends
waits for. The work queue is scripted: what is there at once, and what comes
while a forward waits; each ask is recorded."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np

from batchd.protos import wire
from batchd.worker.gather import GATHER_WAIT_S, Gatherer
from batchd.worker.merge import Item
from tests.conftest import model, ragged_model
from tests.test_merge import batch_header

CFG = model(max_batch_size=8, shape=(2,))


class Script:
    """A work queue: `now` is there at once, `later` comes only to a forward that
    waits (a get with a timeout); an empty script is a wait that ran out."""

    def __init__(self, now: list[Item] | None = None, later: list[Item] | None = None) -> None:
        self.now, self.later = list(now or []), list(later or [])
        self.asks: list[str] = []
        self.timeouts: list[float] = []

    def get_nowait(self) -> Item:
        self.asks.append("now")
        if self.now:
            return self.now.pop(0)
        raise queue.Empty

    def get(self, block: bool = True, timeout: float | None = None) -> Item:
        self.asks.append("wait")
        self.timeouts.append(timeout if timeout is not None else float("inf"))
        if self.now:
            return self.now.pop(0)
        if self.later:
            return self.later.pop(0)
        raise queue.Empty

    def put(self, item: Item) -> None:
        self.now.insert(0, item)


def batch(frontend: int, rows: int = 1, **kw: Any) -> Item:
    header, frames = batch_header(np.zeros((rows, 2), np.float32), **kw)
    return frontend, header, frames


def passed(frontend: int) -> Item:
    return frontend, wire.Header(kind=wire.Header.PASS), []


def gatherer(script: Script, shared: bool = True) -> Gatherer:
    return Gatherer(script, shared=shared)  # type: ignore[arg-type]


def frontends_of(group: list[Item]) -> list[int]:
    return [f for f, _, _ in group]


def test_a_forward_waits_for_each_frontend_of_the_last_forward_of_its_model() -> None:
    """Frontends 0 and 1 ran together; 0's next batch comes first: the forward
    waits for 1's, which comes while it waits, and takes both (bounded wait)."""
    script = Script(now=[batch(1, 2)])
    g = gatherer(script)
    group, held = g.gather(CFG, batch(0))
    assert frontends_of(group) == [0, 1] and held is None
    script.asks.clear()
    script.later = [batch(1, 3)]
    group, held = g.gather(CFG, batch(0))
    assert frontends_of(group) == [0, 1] and held is None
    assert script.asks == ["wait", "now"]  # waited for 1; then took what was there
    assert all(0 <= t <= GATHER_WAIT_S for t in script.timeouts)


def test_a_pass_ends_the_wait_and_a_passed_frontend_is_not_awaited_again() -> None:
    script = Script(now=[batch(1)])
    g = gatherer(script)
    g.gather(CFG, batch(0))  # 0 and 1 ran together
    script.asks.clear()
    script.later = [passed(1), batch(1)]  # 1 has nothing; its batch comes only later
    group, _ = g.gather(CFG, batch(0))
    assert frontends_of(group) == [0] and script.asks == ["wait", "now"]
    script.asks.clear()
    group, _ = g.gather(CFG, batch(0))  # 1 was not in that forward: no wait for it
    assert frontends_of(group) == [0] and script.asks == ["now"]


def test_a_wait_that_runs_out_runs_the_forward_without_the_silent_frontend() -> None:
    script = Script(now=[batch(1)])
    g = gatherer(script)
    g.gather(CFG, batch(0))
    script.asks.clear()
    group, held = g.gather(CFG, batch(0))  # 1 sends nothing at all (it died, say)
    assert frontends_of(group) == [0] and held is None and script.asks == ["wait"]
    script.asks.clear()
    g.gather(CFG, batch(0))
    assert script.asks == ["now"]  # waited for once, not again


def test_what_cannot_join_ends_the_wait_and_is_done_next() -> None:
    script = Script(now=[batch(1)])
    g = gatherer(script)
    g.gather(CFG, batch(0))
    load = (1, wire.Header(kind=wire.Header.LOAD, model="other", version="1"), [])
    script.later = [load]
    group, held = g.gather(CFG, batch(0))
    assert frontends_of(group) == [0] and held is load


def test_no_wait_on_a_worker_of_one_frontend_for_a_full_forward_or_an_unmergeable_model() -> None:
    script = Script(later=[batch(0)])
    g = gatherer(script, shared=False)
    g.gather(CFG, batch(0))
    group, _ = g.gather(CFG, batch(0))
    assert frontends_of(group) == [0] and "wait" not in script.asks
    shared = Script(now=[batch(1)])
    g = gatherer(shared)
    g.gather(CFG, batch(0))
    shared.asks.clear()
    group, _ = g.gather(CFG, batch(0, rows=8))  # full: nothing more fits
    assert frontends_of(group) == [0] and shared.asks == []
    script = Script(now=[batch(1)])
    g = gatherer(script)
    g.gather(CFG, batch(0))
    script.asks.clear()
    script.later = [batch(1)]
    group, _ = g.gather(CFG, batch(0), wait=False)  # step-wise sequences are stepping
    assert frontends_of(group) == [0] and script.asks == ["now"]
    for cfg, first in [(ragged_model(), batch(0)), (CFG, batch(0, alone=True))]:
        script = Script(now=[batch(1)])
        g = gatherer(script)
        g.gather(CFG, batch(0))  # 0 and 1 ran together
        script.asks.clear()
        script.later = [batch(1)]
        group, _ = g.gather(cfg, first)  # padded per batch, or a retry: runs alone
        assert frontends_of(group) == [0] and script.asks == []
