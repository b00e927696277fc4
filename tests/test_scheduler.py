"""scheduler.py: admission, the bounded queues and the shell around plan and
decision, with a fake clock, fake timers and a fake core: no processes, no
sleeps."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from batchd.protos.model_config import ModelConfig
from batchd.server.batching.lanes import SETTLE_S
from batchd.server.batching.plan import PAD_FREE
from batchd.server.batching.queues import ModelQueue
from batchd.server.batching.scheduler import Scheduler
from batchd.server.errors import DeadlineExceeded, InvalidInput, QueueFull, Unavailable
from batchd.server.flow import StepStream
from batchd.server.request import Request
from tests.conftest import (
    Clock,
    FakeDispatch,
    FakeTimer,
    model,
    ragged_model,
    request,
    run,
    stepwise_model,
    text,
)
from tests.test_fuzz_codec import lines_run


def test_scheduler_sends_to_an_idle_worker_at_once_and_grows_batches_behind_it() -> None:
    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=2)
        s = Scheduler(dispatch, clock)
        cfg = model(max_batch_size=4, delay_us=10_000)
        s.add_model(cfg)
        first = request(cfg)
        s.submit(first)
        assert dispatch.sent == [[first]]
        backlog = [request(cfg) for _ in range(3)]
        for r in backlog:
            s.submit(r)
        assert len(dispatch.sent) == 1  # the worker is busy: wait to fill the staged batch
        fourth = request(cfg)
        s.submit(fourth)
        assert dispatch.sent[1] == [*backlog, fourth]  # full: staged at once

    run(body)


def _callers(s: Scheduler, dispatch: FakeDispatch, cfg: ModelConfig, n: int) -> None:
    """`n` requests present at once (queued behind a busy worker), then answered:
    the scheduler has seen `n` callers and the worker is idle again."""
    dispatch.idle, dispatch.credits = 0, 0
    for _ in range(n):
        s.submit(request(cfg))
    dispatch.idle, dispatch.credits = 1, 1
    s.pump()
    assert len(dispatch.sent[-1]) == n
    dispatch.sent.clear()
    dispatch.idle, dispatch.credits = 1, 1


def test_scheduler_holds_batches_for_an_idle_worker_while_the_loop_is_saturated() -> None:
    async def body() -> None:
        clock, dispatch, saturated = Clock(), FakeDispatch(idle=1, credits=1), [True]
        s = Scheduler(dispatch, clock, patient=lambda: saturated[0])
        cfg = model(max_batch_size=4, delay_us=10_000)
        s.add_model(cfg)
        _callers(s, dispatch, cfg, 3)
        first, second = request(cfg), request(cfg)
        s.submit(first)
        s.submit(second)
        assert dispatch.sent == []  # an idle worker, but each batch costs the busy loop
        clock.now += 0.010
        s.pump()
        assert dispatch.sent == [[first, second]]  # the delay ran out: one batch of two
        dispatch.idle, dispatch.credits, saturated[0] = 1, 1, False
        third = request(cfg)
        s.submit(third)
        assert dispatch.sent[1] == [third]  # the loop has time again: eager

    run(body)


def test_a_ragged_batch_a_long_arrival_cannot_join_leaves_at_once() -> None:
    """A ragged model's batch is bounded by tokens too, even without max_batch_tokens
    (plan.py: no row padded far past its length): an arrival too long to join makes it
    full, so it leaves now. Its queue counted as one bounded by rows alone, and the
    arrival skipped the planner: the batch waited out its delay."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        s = Scheduler(dispatch, clock, patient=lambda: True)
        cfg = ragged_model(max_queue_delay_us=10_000)
        s.add_model(cfg)
        loop = asyncio.get_running_loop()
        dispatch.idle, dispatch.credits = 0, 0  # 8 callers seen (_callers, ragged)
        for _ in range(8):
            s.submit(text(cfg, loop, 1))
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        dispatch.sent.clear()
        dispatch.idle, dispatch.credits = 1, 1
        short = [text(cfg, loop, 1), text(cfg, loop, 1)]
        for r in short:
            s.submit(r)
        assert dispatch.sent == []  # patient: filling
        long = text(cfg, loop, 1)
        long.length = 8 * PAD_FREE  # (its tokens are never read here)
        s.submit(long)
        assert dispatch.sent == [short]

    run(body)


def test_a_patient_batch_leaves_once_every_caller_lately_present_is_here() -> None:
    """A closed loop of 3 callers: once the third is queued no other request is
    coming, so the idle worker takes the batch at once, without waiting out the
    delay. Requests still on another worker count as present: their callers cannot
    send again before they are answered."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        s = Scheduler(dispatch, clock, patient=lambda: True)
        cfg = model(max_batch_size=8, delay_us=10_000)
        s.add_model(cfg)
        _callers(s, dispatch, cfg, 3)
        trio = [request(cfg) for _ in range(3)]
        s.submit(trio[0])
        s.submit(trio[1])
        assert dispatch.sent == []
        s.submit(trio[2])
        assert dispatch.sent == [trio]
        dispatch.idle, dispatch.credits, dispatch.out = 1, 1, 2  # two on another worker
        last = request(cfg)
        s.submit(last)
        assert dispatch.sent[-1] == [last]

    run(body)


def test_the_callers_a_queue_counts_are_the_most_present_over_the_last_window_or_two() -> None:
    q = ModelQueue(model())
    assert q.callers > 1_000_000  # none counted yet: no batch is taken for all of them
    q.present(0.0, 20)
    q.present(0.3, 5)
    assert q.callers == 20
    q.present(0.6, 3)  # a new window: the last one's 20 still count
    assert q.callers == 20
    q.present(1.2, 4)  # and now they do not
    assert q.callers == 4
    q.present(5.0, 1)  # after a silence nothing before it counts
    assert q.callers == 1


def test_models_sharing_workers_take_turns_whatever_one_has_queued() -> None:
    """One model's request of many chunks must not keep the shared worker from
    another model's callers: each freed credit goes to the next model with work."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=0, credits=0)
        s = Scheduler(dispatch, clock)
        big, small = model(max_batch_size=4, queue=64), replace(model(), name="small")
        s.add_model(big)
        s.add_model(small)
        s.submit(request(big, rows=40))  # 10 chunks of 4 rows
        order = []
        for _ in range(6):
            s.submit(request(small))  # a caller of the other model, while the worker is busy
            dispatch.idle, dispatch.credits = 1, 1  # a batch finished
            s.pump()
            order.append(dispatch.sent[-1][0].model.name)
        assert order == ["m", "small"] * 3

    run(body)


def _play(
    events: list[tuple[str, float]], shortcut: bool
) -> tuple[list[tuple[int, list[str]]], int]:
    """Run `events` through a patient scheduler of two models; return (event index,
    request ids) per batch, and how many arrivals skipped the planner."""
    skipped = [0]

    async def body() -> list[tuple[int, list[str]]]:
        clock, dispatch, saturated = Clock(), FakeDispatch(idle=1, credits=1), [True]
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, patient=lambda: saturated[0], timer=timers)
        decides = s._arrival_changes_nothing

        def counted(*args: object) -> bool:
            skip = shortcut and decides(*args)  # type: ignore[arg-type]
            skipped[0] += skip
            return skip

        s._arrival_changes_nothing = counted  # type: ignore[method-assign]
        cfg = model(max_batch_size=8, queue=64, delay_us=20_000)
        other = replace(model(max_batch_size=8, queue=64, delay_us=200_000), name="other")
        other = replace(other, batching=replace(other.batching, preferred_batch_sizes=(3,)))
        s.add_model(cfg)
        # Its timer may be the one armed when cfg's first request comes; its preferred
        # size means an arrival may send a batch before it is full: never skipped.
        s.add_model(other)
        sent: list[tuple[int, list[str]]] = []  # and rejections, as (i, ["full"])
        futures, batches = [], []
        for i, (kind, x) in enumerate(events):
            if kind == "arrive":
                r = request(other if int(x * 1000) % 4 == 0 else cfg, rows=1 if x < 0.8 else 2)
                r.id = str(i)
                if x < 0.2:
                    r.deadline = clock.now + x * 0.05
                try:
                    futures.append(s.submit(r))
                except QueueFull:
                    sent.append((i, ["full"]))
            elif kind == "tick":
                clock.now += x * 0.002
                if x < 0.7:  # else a busy loop runs what is due late
                    timers.run_due()
            elif kind == "cancel" and s._queues[cfg.key].levels[0]:
                s._queues[cfg.key].levels[0][0].future.cancel()
            elif kind == "free":
                dispatch.idle, dispatch.credits = 1, 1
                s.pump()
            elif kind == "flip":
                saturated[0] = not saturated[0]
            sent += [(i, [r.id for r in batch]) for batch in dispatch.sent[len(batches) :]]
            batches = list(dispatch.sent)
        expired = [f for f in futures if f.done() and not f.cancelled() and f.exception()]
        assert all(isinstance(f.exception(), DeadlineExceeded) for f in expired)
        return sent

    return asyncio.run(body()), skipped[0]


@pytest.mark.parametrize("seed", range(30))
def test_skipping_the_planner_on_arrival_sends_what_planning_would(seed: int) -> None:
    """An arrival that cannot change the decision skips the planner
    (Scheduler._arrival_changes_nothing): the same batches must leave at the same
    events as when every arrival plans, through idle and busy workers, deadlines,
    cancellations, two-row requests and the loop's saturation coming and going."""
    rng = random.Random(seed)
    kinds = ["arrive"] * 6 + ["tick"] * 2 + ["cancel"] + ["free"] * 3 + ["flip"]
    events = [(rng.choice(kinds), rng.random()) for _ in range(300)]
    with_shortcut, skipped = _play(events, shortcut=True)
    assert len(with_shortcut) > 10 and skipped > 2  # batches left; arrivals skipped planning
    assert with_shortcut == _play(events, shortcut=False)[0]


def test_scheduler_stages_a_partial_batch_when_the_delay_runs_out() -> None:
    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=0, credits=1)
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, timer=timers)
        cfg = model(delay_us=10_000)
        s.add_model(cfg)
        r = request(cfg)
        s.submit(r)
        assert dispatch.sent == [] and timers.pending() == [clock.now + 0.010]
        timers.advance(0.009)
        assert dispatch.sent == []
        timers.advance(0.001)  # the batch timer fires: nothing else happened
        assert dispatch.sent == [[r]]

    run(body)


def test_a_job_lane_its_model_s_quarantine_pauses_waits_then_goes() -> None:
    """A job of many lines that each end their worker: past quarantine.BREAK of them
    its model version's lane waits, its lines not failed, while online callers (of
    another model here) are served; it goes on when the pause ends, at its timer."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, timer=timers)
        cfg, other = model(), replace(model(), name="other")
        s.add_model(cfg)
        s.add_model(other)
        dispatch.paused[cfg.key] = clock.now + 30
        line = request(cfg)
        line.background = True
        s.submit(line)
        online = request(other)
        s.submit(online)
        assert dispatch.sent == [[online]] and not line.future.done()
        assert clock.now + 30 in timers.pending()
        dispatch.idle, dispatch.credits = 1, 1  # online's answered: the worker is idle
        timers.advance(29.9)
        assert dispatch.sent == [[online]]
        del dispatch.paused[cfg.key]
        dispatch.settled = False  # its idle worker loads a model: a first try goes anyway
        timers.advance(0.1)
        assert dispatch.sent == [[online], [line]]

    run(body)


def _retry(cfg: ModelConfig, background: bool = False) -> Request:
    """A retry after a failure (a suspect) of model `cfg`, its caller waiting."""
    r = request(cfg)
    r.future = asyncio.get_running_loop().create_future()
    r.suspect, r.background = True, background
    return r


def test_an_online_retry_waits_out_a_load_for_half_its_time_left_at_most() -> None:
    """A retry (a suspect) whose idle worker only loads a model waits for it past
    SETTLE_S: a death as it loads is not counted, and its restart loads everything
    again (a load of 3 s had a poison end a third worker, review 54e); but for half its
    time left at most. Beside sequences, SETTLE_S at most."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, timer=timers)
        s.add_model(cfg := model())
        r = _retry(cfg)
        r.deadline = clock.now + 20.0
        dispatch.settled, dispatch.loading = False, True
        s.requeue([r])
        s.pump()
        timers.advance(9.9)  # (past SETTLE_S)
        assert dispatch.sent == []
        timers.advance(0.1)  # half of its 20 s
        assert dispatch.sent == [[r]]
        beside = _retry(cfg)
        dispatch.loading, dispatch.idle, dispatch.credits = False, 1, 1
        s.requeue([beside])
        s.pump()
        timers.advance(SETTLE_S - 0.1)
        assert dispatch.sent == [[r]]
        timers.advance(0.1)
        assert dispatch.sent == [[r], [beside]]

    run(body)


def test_requests_behind_a_waiting_retry_go_on() -> None:
    """A retry waiting for its idle worker to finish loading another model heads its
    queue: the requests that came after it went nowhere meanwhile, and expired (review
    54h: 17 of 17 calls with a 5 s deadline while a model loaded for 20 s). They go to
    that worker; the retry waits on for a settled one, and goes once there is one."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, timer=timers)
        s.add_model(cfg := model())
        dispatch.settled, dispatch.loading = False, True
        s.requeue([retry := _retry(cfg)])
        s.pump()
        fresh = request(cfg)
        s.submit(fresh)
        assert dispatch.sent == [[fresh]]  # not behind the retry's wait
        dispatch.idle, dispatch.credits, dispatch.settled = 1, 1, True  # back, the load done
        s.pump()
        assert dispatch.sent == [[fresh], [retry]]
        s.requeue([again := _retry(cfg)])  # and a job's line, behind a retry that waits
        line = request(cfg)
        line.future, line.background = asyncio.get_running_loop().create_future(), True
        s.requeue([line])
        dispatch.idle, dispatch.credits, dispatch.settled = 1, 1, False
        s.pump()
        assert dispatch.sent[2:] == [[line]]  # (the job lanes waited for the whole load)
        dispatch.idle, dispatch.credits, dispatch.settled = 1, 1, True
        s.pump()
        assert dispatch.sent[3:] == [[again]]

    run(body)


def test_a_job_s_retried_line_waits_settle_s_at_most_for_a_settled_worker() -> None:
    """A retried job line (a suspect) sent beside a load or a sequence and ending the
    worker there is not the death's sole suspect: it waits for a settled worker, but
    for SETTLE_S at most (a worker whose sequences never pause held a job for good)."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, timer=timers)
        s.add_model(cfg := model())
        line = _retry(cfg, background=True)
        dispatch.settled = False  # (its batch's worker was lost: the pool pumps)
        s.requeue([line])
        s.pump()
        assert dispatch.sent == [] and timers.pending() == [clock.now + SETTLE_S]
        assert line.settle_from == clock.now
        dispatch.settled = True  # a sequence ended: its pump sends it
        s.pump()
        assert dispatch.sent == [[line]]
        again = request(cfg)
        again.future = asyncio.get_running_loop().create_future()
        again.background = again.suspect = True
        dispatch.settled, dispatch.idle, dispatch.credits = False, 1, 1
        s.requeue([again])
        s.pump()
        timers.advance(SETTLE_S)  # none settled in time: it goes where it can
        assert dispatch.sent == [[line], [again]]
        waits, fresh = request(cfg), request(cfg)  # a cancelled job's retried line first
        for r in (waits, fresh):
            r.future = asyncio.get_running_loop().create_future()
            r.background = True
        waits.suspect, dispatch.idle, dispatch.credits = True, 1, 1
        s.requeue([waits])
        s.requeue([fresh])  # (its first try, behind it)
        settle_from = waits.settle_from
        s._queues[cfg.key].jobs.remove(waits)  # taken, sent, and put back by a send that
        s.requeue([waits])  # found no such worker: its wait does not start over
        assert waits.settle_from == settle_from
        waits.future.cancel()
        s.pump()
        assert dispatch.sent[-1] == [fresh]  # not held up by the dead line's wait

    run(body)


@pytest.mark.parametrize("quick_first", [True, False])
def test_a_request_for_one_model_does_not_postpone_another_models_batch(quick_first: bool) -> None:
    """Each pump of one queue keeps an earlier timer of another; and a queue's first
    request is planned (it arms its own timer) even behind another's later timer."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=0, credits=1)
        timers = FakeTimer(clock)
        s = Scheduler(dispatch, clock, timer=timers)
        quick = replace(model(delay_us=2_000), name="quick")
        slow = replace(model(delay_us=5_000_000), name="slow")
        s.add_model(quick)
        s.add_model(slow)
        first = request(quick)
        for r in [first, request(slow)] if quick_first else [request(slow), first]:
            s.submit(r)
        timers.advance(0.002)
        assert dispatch.sent == [[first]]  # at quick's 2 ms, not slow's 5 s

    run(body)


def test_an_arrival_after_the_delay_sends_the_batch_without_waiting_for_a_late_timer() -> None:
    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        s = Scheduler(dispatch, clock, patient=lambda: True)  # patient: batches fill
        cfg = model(max_batch_size=8, delay_us=10_000)
        s.add_model(cfg)
        _callers(s, dispatch, cfg, 4)
        waiting = [request(cfg), request(cfg)]
        for r in waiting:
            s.submit(r)
        assert dispatch.sent == []
        clock.now += 0.011  # the delay ran out, but a busy loop has not run the timer yet
        late = request(cfg)
        s.submit(late)
        assert dispatch.sent == [[*waiting, late]]

    run(body)


def test_a_patient_batch_leaves_so_a_request_of_another_shape_is_not_let_expire() -> None:
    """The request of another shape cannot join the batch filling for the idle worker:
    it waits for that batch to leave. Its deadline, sooner than the delay, sends the
    batch at once, and then it goes next, before its deadline."""

    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=1, credits=1)
        s = Scheduler(dispatch, clock, patient=lambda: True)
        cfg = model(max_batch_size=16, queue=64, delay_us=20_000, shape=(-1,))
        s.add_model(cfg)
        _callers(s, dispatch, cfg, 10)
        filling = request(cfg)
        s.submit(filling)
        assert dispatch.sent == []  # it waits to fill
        hurried = request(cfg, width=3, deadline=clock.now + 0.005)
        hurried.queue_timeout = True
        answer = s.submit(hurried)
        assert dispatch.sent == [[filling]]
        dispatch.idle, dispatch.credits = 1, 1  # the batch was answered
        s.pump()
        assert dispatch.sent == [[filling], [hurried]] and not answer.done()

    run(body)


def test_full_queue_rejects_at_once_with_the_limit_and_a_pushback() -> None:
    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), clock := Clock())
        cfg = model(queue=2)
        s.add_model(cfg)
        s.submit(request(cfg))
        s.submit(request(cfg))

        def pushback() -> str:
            with pytest.raises(QueueFull) as info:
                s.submit(request(cfg))
            assert "queue of model 'm' is full" in info.value.message
            assert "max_queue_size 2" in info.value.message
            return dict(info.value.trailers())["grpc-retry-pushback-ms"]

        assert pushback() == "1"
        # A place frees as a batch leaves: the pushback is about how often batches end
        # while requests wait (the queue delay alone said 1 ms: review 56d). Two workers'
        # batches of 60 ms end 30 ms apart (a batch's time said 60 ms: twice too long)
        for _ in range(40):
            clock.now += 0.03
            s.observe(cfg.key, 2, 0.06)
        assert pushback() == "30"
        # a frontend too busy to keep its workers fed: batches of 5 ms end 40 ms apart
        for _ in range(60):
            clock.now += 0.04
            s.observe(cfg.key, 2, 0.005)
        assert pushback() == "40"

    run(body)


def test_a_full_step_wise_queue_s_pushback_is_how_often_its_sequences_end() -> None:
    """A step-wise model's place frees as a sequence ends: its full queue said 1 ms (no
    batch ever ended), and a client honouring it was refused 1,337 times in 17.6 s
    (review 57a)."""

    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), clock := Clock())
        cfg = model(queue=1)
        s.add_model(cfg)
        s.submit(request(cfg))
        for _ in range(30):  # sequences of 2 s, two slots: one ends every second
            clock.now += 1.0
            s.ended(cfg.key, 2.0)
        with pytest.raises(QueueFull) as info:
            s.submit(request(cfg))
        assert dict(info.value.trailers())["grpc-retry-pushback-ms"] == "1000"
        for _ in range(30):  # 32 slots whose sequences end together, a round each 0.8 s:
            clock.now += 0.8  # places free every 0.8 s (it said 1 ms: review 57e)
            for _ in range(32):
                s.ended(cfg.key, 0.8)
        with pytest.raises(QueueFull) as info:
            s.submit(request(cfg))
        assert dict(info.value.trailers())["grpc-retry-pushback-ms"] == "800"

    run(body)


def test_a_full_queue_s_first_pushback_is_a_batch_s_time_not_the_idle_gaps() -> None:
    """Batches that ended with nothing waiting say how often requests came, not how
    often a place frees: a batch's compute time is all that is known then."""

    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), clock := Clock())
        cfg = model(queue=1)
        s.add_model(cfg)
        for took in (0.05, 0.05, 0.1):  # (nothing queued: idle between them)
            clock.now += 0.5
            s.observe(cfg.key, 2, took)
        s.submit(request(cfg))
        with pytest.raises(QueueFull) as info:
            s.submit(request(cfg))
        assert dict(info.value.trailers())["grpc-retry-pushback-ms"] == "60"  # (averaged)

    run(body)


def test_cancelled_requests_free_their_place_in_a_full_queue() -> None:
    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
        cfg = model(queue=1)
        s.add_model(cfg)
        s.submit(request(cfg)).cancel()
        s.submit(request(cfg))  # admitted: the cancelled one is compacted away
        assert s.queued_version(cfg.key) == 1

    run(body)


def test_expired_and_cancelled_requests_never_reach_the_dispatcher() -> None:
    async def body() -> None:
        clock, dispatch = Clock(), FakeDispatch(idle=0, credits=0)
        s = Scheduler(dispatch, clock)
        cfg = model()
        s.add_model(cfg)
        expiring = s.submit(request(cfg, deadline=clock.now + 1.0))
        cancelled = request(cfg)
        s.submit(cancelled).cancel()
        live = request(cfg)
        s.submit(live)
        clock.now += 2.0
        dispatch.idle, dispatch.credits = 1, 2
        s.pump()
        assert dispatch.sent == [[live]]
        with pytest.raises(DeadlineExceeded, match="reached its deadline"):
            expiring.result()

    run(body)


def test_queue_timeout_fires_without_any_other_event() -> None:
    async def body() -> None:
        clock = Clock()
        timers = FakeTimer(clock)
        s = Scheduler(FakeDispatch(idle=0, credits=0), clock, timer=timers)
        cfg = model()
        s.add_model(cfg)
        r = request(cfg, deadline=clock.now + 0.001)
        r.queue_timeout = True
        future = s.submit(r)
        timers.advance(0.001)  # its own timer, and nothing else
        with pytest.raises(DeadlineExceeded):
            future.result()

    run(body)


def test_a_requeued_request_still_expires_at_its_queue_timeout() -> None:
    """Its timer went when its batch took it; the worker was lost and no other is
    free: back in the queue it must still expire, with no other event."""

    async def body() -> None:
        clock = Clock()
        timers = FakeTimer(clock)
        dispatch = FakeDispatch(idle=1, credits=1)
        s = Scheduler(dispatch, clock, timer=timers)
        cfg = model()
        s.add_model(cfg)
        r = request(cfg, deadline=clock.now + 0.002)
        r.queue_timeout = True
        future = s.submit(r)
        assert dispatch.sent == [[r]] and timers.pending() == []  # taken: its timer went
        dispatch.idle, dispatch.credits = 0, 0
        s.requeue([r])  # its worker was lost
        timers.advance(0.002)
        with pytest.raises(DeadlineExceeded):
            future.result()

    run(body)


def test_a_request_for_a_version_retired_while_it_was_decoded_is_unavailable() -> None:
    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
        cfg = model()
        s.add_model(cfg)
        s.check_room(cfg.key)  # then the request is decoded off the loop, and meanwhile ...
        s.remove_model(cfg.key)  # ... a reload retires the version it was admitted to
        with pytest.raises(Unavailable, match="was replaced or unloaded while this request"):
            s.submit(request(cfg))

    run(body)


def _suspect_then_another_model(dispatch: FakeDispatch) -> tuple[Scheduler, Request, Request]:
    """A suspect of model `m` put back in the queue, then a request of `other` (first in
    turn) past any delay, each pumped: (the scheduler, the suspect, the other request)."""
    clock = Clock()
    s = Scheduler(dispatch, clock)
    other, cfg = replace(model(), name="other"), model()
    s.add_model(other)
    s.add_model(cfg)
    suspect = request(cfg)
    suspect.future = asyncio.get_running_loop().create_future()
    suspect.suspect = True
    s.requeue([suspect])
    s.pump()
    waiting = request(other)
    s.submit(waiting)
    clock.now += 1.0
    s.pump()
    return s, suspect, waiting


def test_a_suspect_gets_the_next_idle_worker_though_another_model_keeps_it_busy() -> None:
    """A retry after a failure needs a worker with nothing in flight. While it waits,
    no batch is staged on a busy worker, so one drains; then it goes first."""

    async def body() -> None:
        dispatch = FakeDispatch(idle=0, credits=1)  # busy, one credit free
        s, suspect, waiting = _suspect_then_another_model(dispatch)
        assert dispatch.sent == []  # not staged on the busy worker: it drains
        dispatch.idle, dispatch.credits = 1, 2
        s.pump()
        assert dispatch.sent == [[suspect]]  # the idle worker goes to it first
        s.pump()  # the suspect left: staging on a busy worker is back
        assert dispatch.sent == [[suspect], [waiting]]

    run(body)


def test_a_suspect_whose_model_no_worker_holds_does_not_hold_back_other_models() -> None:
    """Its worker may never come (its model's only worker was lost): staging on a busy
    worker goes on for the models that are served."""

    async def body() -> None:
        dispatch = FakeDispatch(idle=0, credits=1)  # busy, one credit free
        dispatch.unheld.add(model().key)  # no live worker holds the suspect's model
        _, suspect, waiting = _suspect_then_another_model(dispatch)
        assert dispatch.sent == [[waiting]]  # staged on the busy worker
        assert not suspect.future.done()  # the suspect waits on, for its worker

    run(body)


def test_requeued_requests_go_first() -> None:
    async def body() -> None:
        dispatch = FakeDispatch(idle=0, credits=0)
        s = Scheduler(dispatch, Clock())
        cfg = model()
        s.add_model(cfg)
        waiting = request(cfg)
        s.submit(waiting)
        lost = request(cfg)
        lost.future = asyncio.get_running_loop().create_future()
        s.requeue([lost])
        dispatch.idle, dispatch.credits = 1, 1
        s.pump()
        assert dispatch.sent == [[lost, waiting]]

    run(body)


def test_each_priority_level_has_its_own_queue_limit() -> None:
    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
        cfg = model(queue=8)
        cfg = replace(
            cfg,
            batching=replace(
                cfg.batching,
                priority_levels=2,
                default_priority_level=2,
                priority_queue_sizes=(1, 0),
            ),
        )
        s.add_model(cfg)
        high = request(cfg)
        high.level = 0
        s.submit(high)
        again = request(cfg)
        again.level = 0
        with pytest.raises(QueueFull, match="1 requests waiting at priority 1, its limit 1"):
            s.submit(again)
        for _ in range(8):
            low = request(cfg)
            low.level = 1  # level 2 has no limit of its own: only max_queue_size 8
            if _ == 7:
                with pytest.raises(QueueFull, match="8 requests waiting, max_queue_size 8"):
                    s.submit(low)
            else:
                s.submit(low)

    run(body)


def test_a_request_needing_more_places_than_its_level_may_hold_is_invalid_not_busy() -> None:
    """A request split into more batches than its priority level's queue limit can
    never be admitted: INVALID_ARGUMENT, saying how many rows a request may have. It was
    QueueFull ("retry later") with a pushback, and a client retried it till its deadline
    (review 58b). A request that fits the level but not the queue's room now is busy,
    saying how many places it needs."""

    async def body() -> None:
        s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
        cfg = model(max_batch_size=2, queue=4)
        levels = replace(cfg.batching, priority_levels=2, default_priority_level=2,
                         priority_queue_sizes=(2, 3))  # fmt: skip
        cfg = replace(cfg, batching=levels)
        s.add_model(cfg)
        for level, rows, limit in ((0, 5, 2), (1, 7, 3)):
            big = request(cfg, rows=rows)
            big.level = level
            with pytest.raises(InvalidInput, match=(
                f"request of {rows} rows needs {-(-rows // 2)} batches of 2, more than model "
                f"'m' queues \\(priority {level + 1}: priority_queue_sizes {limit}\\); send at "
                f"most {2 * limit} rows a request")):  # fmt: skip
                s.submit(big)
        fits = request(cfg, rows=6)  # 3 places at level 2: it may
        fits.level = 1
        s.submit(fits)
        two = request(cfg, rows=3)
        two.level = 0
        with pytest.raises(QueueFull, match="max_queue_size 4; this request needs 2 places"):
            s.submit(two)  # (3 of 4 places taken)

    run(body)


def _wait_after_the_last_arrival_ms(
    delay_us: int | None, loop_idles: bool = True, busy: float = 0.9, apart_ms: float = 1.0
) -> float:
    """A patient scheduler (saturated loop): arrivals measured at about 1,000 rows/s,
    then three requests `apart_ms` apart and no more. How long after the third its batch
    left. `loop_idles` False: the event loop never waits in select() (its idle clock
    stands still), busy with other callbacks. `busy`: the loop's busy share."""

    class Timed(FakeDispatch):
        sent_at: list[float] = []

        def send(self, model: ModelConfig, requests: list[Request]) -> None:
            self.sent_at.append(clock.now)
            super().send(model, requests)

    clock, dispatch, saturated = Clock(), Timed(idle=0, credits=0), [False]
    timer = FakeTimer(clock)
    idle = clock if loop_idles else (lambda: 0.0)
    s = Scheduler(
        dispatch, clock, patient=lambda: saturated[0], timer=timer, idle=idle, busy=lambda: busy
    )
    cfg = model(max_batch_size=32, queue=300, delay_us=delay_us)
    s.add_model(cfg)
    for _ in range(250):  # the rate, measured while the worker has no credit
        s.submit(request(cfg))
        clock.now += 0.001
    dispatch.idle, dispatch.credits = 1, 9
    s.pump()  # the backlog leaves (its requests have waited past the delay)
    dispatch.idle, saturated[0] = 1, True
    trio = [request(cfg) for _ in range(3)]
    for r in trio:
        s.submit(r)
        timer.advance(apart_ms / 1e3)
    timer.advance(0.05)
    assert dispatch.sent[-1] == trio
    return (dispatch.sent_at[-1] - trio[-1].arrival) * 1000


def test_with_the_automatic_delay_a_batch_stops_waiting_once_arrivals_stop() -> None:
    """The callers of a closed loop smaller than a batch are all here: with no
    max_queue_delay_us the batch leaves once the loop has idled about 3 ms (3 rows'
    time at the measured rate) after the last arrival, not when the first has
    waited the 20 ms a full batch would take. A loop that never idled could not
    have seen an arrival, so it waits on; a configured delay is waited out in full.
    A loop with time to spare (under 75% busy) waits half a row's time: a small
    batch costs it little."""

    async def body() -> None:
        assert 2.5 < _wait_after_the_last_arrival_ms(None) < 3.5
        assert 0.4 < _wait_after_the_last_arrival_ms(None, busy=0.7, apart_ms=0.2) < 0.6
        assert _wait_after_the_last_arrival_ms(None, loop_idles=False) == pytest.approx(18)
        assert _wait_after_the_last_arrival_ms(20_000) == pytest.approx(18)

    run(body)


def test_taking_a_batch_and_expiring_a_request_do_not_walk_a_long_queue() -> None:
    """Work per batch taken and per queue timeout is the batch's, not the queue's: with
    5,000 requests queued, each runs a bounded number of lines (a walk would run
    thousands), so draining or expiring a queue is linear in its length."""

    async def body() -> None:
        clock = Clock()
        timers = FakeTimer(clock)
        dispatch = FakeDispatch(idle=0, credits=0)
        s = Scheduler(dispatch, clock, timer=timers)
        cfg = model(max_batch_size=4, queue=10_000)
        s.add_model(cfg)
        for k in range(5_000):
            r = request(cfg, deadline=clock.now + (0.001 if k == 2_500 else 1e6))
            r.queue_timeout = True
            s.submit(r)
        q = s._queues[cfg.key]
        expiring = q.levels[0][2_500]
        dispatch.idle, dispatch.credits = 1, 1
        plan = q.plan(clock.now)
        assert plan is not None
        work, _ = lines_run(lambda: q.take(plan))
        assert work < 200, work
        assert len(q) == 4_996
        clock.now += 0.001
        work, _ = lines_run(timers.run_due)
        assert work < 200, work
        with pytest.raises(DeadlineExceeded):
            expiring.future.result()

    run(body)


def test_a_step_wise_request_failed_in_the_queue_ends_its_stream() -> None:
    """Its caller reads the stream to its end before the future: a queue timeout (or a
    drain, or a broken version) that fails the future must end the stream too, or the
    caller waits for ever (and the drain with it)."""

    async def body() -> None:
        clock = Clock()
        timers = FakeTimer(clock)
        s = Scheduler(FakeDispatch(idle=0, credits=0), clock, timer=timers)
        cfg = stepwise_model()
        s.add_model(cfg)
        expiring, drained = request(cfg, deadline=clock.now + 0.001), request(cfg)
        expiring.queue_timeout = True
        for r in (expiring, drained):
            r.stream = StepStream()
            s.submit(r)
        timers.advance(0.001)
        s.fail_all(Unavailable("the server is shutting down"))
        for r in (expiring, drained):
            assert r.stream is not None
            assert await asyncio.wait_for(r.stream.next(), 5) is None
        with pytest.raises(DeadlineExceeded):
            expiring.future.result()
        with pytest.raises(Unavailable):
            drained.future.result()

    run(body)


def test_a_sparse_model_on_a_patient_frontend_waits_for_no_rows_not_coming() -> None:
    """20 requests a second, two callers once overlapping, on a frontend another model
    keeps patient (its loop 90% busy): each lone request waited out the automatic delay,
    20 ms, for 0.4 rows expected meanwhile, its worker idle (1.2 rows a batch; its
    callers' p50 twice the busy model's)."""

    async def body() -> list[float]:
        clock, d = Clock(), FakeDispatch(idle=1, credits=1)
        idle = [0.0]  # the loop's idle seconds: another model keeps it busy
        s = Scheduler(d, clock, patient=lambda: True, timer=FakeTimer(clock),
                      idle=lambda: idle[0], busy=lambda: 0.9)  # fmt: skip
        cfg = model(max_batch_size=32, delay_us=None)
        s.add_model(cfg)
        waits = []
        for i in range(12):
            clock.now += 0.05
            idle[0] += 0.005
            d.out = 1 if i == 2 else 0  # once, another caller's request was out
            s.submit(request(cfg))
            start = clock.now
            while not d.sent:
                clock.now += 0.0005
                idle[0] += 0.00005
                s.pump()
            waits.append(clock.now - start)
            d.sent.clear()
            d.idle = d.credits = 1
            d.out = 0
        assert s._queues[cfg.key].callers == 2 and s._queues[cfg.key].rate > 10
        return waits

    assert asyncio.run(body()) == [0.0] * 12


def test_room_is_checked_for_a_version_retired_meanwhile_as_unavailable() -> None:
    """An HTTP body parsed off the loop while its version was retired (its last worker
    lost as a reload went on): check_room raised KeyError, a 500 and a traceback."""
    s = Scheduler(FakeDispatch(idle=0, credits=0), Clock())
    with pytest.raises(Unavailable, match="m@1 was replaced or unloaded while this request"):
        s.check_room("m@1")
