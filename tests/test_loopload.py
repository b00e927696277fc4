"""The event loop's load, as the scheduler reads it (server/loopload.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchd.server import loopload
from batchd.server.loopload import LoopLoad, TimedSelector, new_loop


class FakeSelector(TimedSelector):
    def select(self, timeout: float | None = None) -> list:  # type: ignore[type-arg]
        return []


def test_saturation_turns_on_at_90_percent_busy_and_off_below_70() -> None:
    now, selector = [0.0], FakeSelector()
    load = LoopLoad(selector, clock=lambda: now[0])

    def window(busy: float) -> bool:
        now[0] += 0.1
        selector.idle_s += 0.1 * (1 - busy)
        return load()

    assert not window(0.5)
    assert not window(0.85)
    assert window(0.95)
    assert window(0.75)  # still busy enough: no flapping at the threshold
    assert not window(0.6)
    assert load.busy == pytest.approx(0.6)


def test_batching_turns_patient_at_65_percent_busy_and_eager_below_50() -> None:
    now, selector = [0.0], FakeSelector()
    load = LoopLoad(selector, clock=lambda: now[0])

    def window(busy: float) -> tuple[bool, bool]:
        now[0] += 0.1
        selector.idle_s += 0.1 * (1 - busy)
        return load.patient(), load()

    assert window(0.3) == (False, False)
    assert window(0.6) == (False, False)
    assert window(0.7) == (True, False)  # patient long before the loop needs its core
    assert window(0.55) == (True, False)  # no flapping at the threshold
    assert window(0.45) == (False, False)


def test_the_load_is_measured_once_per_window() -> None:
    now, selector = [0.0], FakeSelector()
    load = LoopLoad(selector, clock=lambda: now[0])
    now[0] += loopload.WINDOW_S / 2
    assert not load()  # half a window, all of it busy: not measured yet
    now[0] += loopload.WINDOW_S / 2
    assert load()


def test_idle_seconds_are_the_selectors_or_on_a_loop_that_does_not_count_the_clock() -> None:
    now, selector = [5.0], FakeSelector()
    selector.idle_s = 1.25
    assert LoopLoad(selector, clock=lambda: now[0]).idle_s() == 1.25
    assert LoopLoad(None, clock=lambda: now[0]).idle_s() == 5.0


def test_a_loop_without_a_timed_selector_never_reads_saturated() -> None:
    async def body() -> bool:
        load = LoopLoad.current()
        end = time.perf_counter() + 2 * loopload.WINDOW_S
        while time.perf_counter() < end:
            pass
        return load()

    assert asyncio.run(body()) is False


def test_a_real_loop_reads_busy_while_it_computes_and_idle_while_it_waits() -> None:
    async def body() -> tuple[bool, bool]:
        load = LoopLoad.current()
        loop, end = asyncio.get_running_loop(), time.perf_counter() + 3 * loopload.WINDOW_S
        done = loop.create_future()

        def spin() -> None:  # a callback that reschedules itself: the loop is never idle
            if time.perf_counter() < end:
                loop.call_soon(spin)
            else:
                done.set_result(None)

        spin()
        await done
        busy = load()
        await asyncio.sleep(3 * loopload.WINDOW_S)
        return busy, load()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        assert runner.run(body()) == (True, False)
