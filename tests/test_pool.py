"""The worker pool as pure state: no socket, no clock."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from batchd.protos import wire
from batchd.server.batching.decision import (
    BUSY_WITH_CREDIT,
    IDLE,
    IDLE_LOADING,
    IDLE_UNSETTLED,
    NO_CAPACITY,
)
from batchd.server.pool import Joined, WorkerHandle, WorkerPool
from tests.conftest import model, request, stepwise_model


def info(name: str, device: str = "cpu", pid: int = 1, instance: str = "i1") -> wire.WorkerInfo:
    return wire.WorkerInfo(worker_id=name, device=device, pid=pid, instance=instance,
                           protocol=wire.PROTOCOL_VERSION)  # fmt: skip


def serving(pool: WorkerPool, *names: str, key: str) -> list[WorkerHandle]:
    workers = []
    for name in names:
        _, w = pool.join(name.encode(), info(name))
        w.models.add(key)
        workers.append(w)
    return workers


@pytest.mark.parametrize(("credits", "expected"), [(None, [1, 2]), (3, [3, 3])])
def test_cpu_workers_hold_one_batch_gpu_workers_two(
    credits: int | None, expected: list[int]
) -> None:
    pool = WorkerPool(credits)
    for name, device in (("a", "cpu"), ("b", "cuda:0")):
        pool.join(name.encode(), info(name, device))
    assert [w.credits for w in pool.workers()] == expected


def test_an_idle_worker_is_chosen_first_then_round_robin_among_those_with_credit() -> None:
    cfg = model()
    pool = WorkerPool(credits=2)
    a, b = serving(pool, "a", "b", key=cfg.key)
    assert pool.capacity(cfg) == IDLE
    assert pool.choose(cfg.key) is a
    pool.hand(a, cfg, [request(cfg)], 0.0)
    assert pool.choose(cfg.key) is b  # idle beats a's free credit
    pool.hand(b, cfg, [request(cfg)], 0.0)
    assert pool.capacity(cfg) == BUSY_WITH_CREDIT
    assert pool.choose(cfg.key, idle_only=True) is None
    assert pool.choose(cfg.key) in (a, b)
    for w in (a, b):
        pool.hand(w, cfg, [request(cfg)], 0.0)
    assert pool.capacity(cfg) == NO_CAPACITY and pool.choose(cfg.key) is None


def test_a_settled_worker_loads_no_model_and_runs_no_sequence() -> None:
    """A retried job line sent to a worker as it loaded another model (a restart loads
    them all), or beside a bystander's sequence, and ended it was never the death's
    sole suspect: not remembered, its deaths backed off, and a storm of such lines
    kept the pool down (quarantine.py). A retry (a suspect) waits for a settled worker
    a while (lanes.settle_by: till a load is done, SETTLE_S beside sequences), and
    goes to one first; the heartbeat that says another frontend's last sequence there
    ended asks for a pump (a job's line waited for some other event)."""
    cfg = model()
    pool = WorkerPool()
    a, b = serving(pool, "a", "b", key=cfg.key)
    a.load_sent["other@1"] = 0.0
    assert pool.capacity(cfg) == IDLE  # b: idle, loading nothing
    for _ in "ab":  # whatever the round-robin's turn
        assert pool.choose(cfg.key, idle_only=True, suspect=True) is b
    pool.hand(b, cfg, [request(cfg)], 0.0)
    assert pool.capacity(cfg) == IDLE_LOADING and not IDLE_LOADING.settled
    assert pool.choose(cfg.key, idle_only=True, suspect=True) is a  # (its wait over)
    a.load_sent.clear()
    a.others["steps@1"] = 1  # another frontend's sequence runs there
    assert pool.capacity(cfg) == IDLE_UNSETTLED and not IDLE_UNSETTLED.loading
    assert pool.beat(a, wire.Header(kind=wire.Header.HEARTBEAT), 1.0) is True
    assert pool.capacity(cfg) == IDLE and pool.choose(cfg.key, True, suspect=True) is a
    assert pool.beat(a, wire.Header(kind=wire.Header.HEARTBEAT), 2.0) is False


def test_a_sequence_starts_where_other_frontends_fill_fewest_slots_never_past_ours() -> None:
    """choose_slot ranks the workers with a slot free of our sequences by what their
    heartbeats say other frontends hold there (their count less ours)."""
    cfg = stepwise_model(max_active=2)
    pool = WorkerPool(credits=1)
    a, b = serving(pool, "a", "b", key=cfg.key)
    assert pool.choose_slot(cfg) is a  # nothing known: the first with most free
    pool.occupied(a, {cfg.key: 2})  # another frontend's two sequences fill a
    assert a.others == {cfg.key: 2} and pool.choose_slot(cfg) is b
    pool.start(b, cfg, request(cfg), 0.0)
    pool.occupied(b, {cfg.key: 2})  # ours and one other's
    assert b.others == {cfg.key: 1}
    assert pool.choose_slot(cfg) is a  # a tie, none free by the counts: the first
    pool.occupied(a, {cfg.key: 1})
    assert pool.choose_slot(cfg) is a  # a: 1 free, b: 0
    pool.occupied(a, {cfg.key: 2})
    pool.start(b, cfg, request(cfg), 0.0)
    assert pool.choose_slot(cfg) is a  # b's slots are all ours: never sent past them
    pool.start(a, cfg, request(cfg), 0.0)
    pool.start(a, cfg, request(cfg), 0.0)
    assert pool.choose_slot(cfg) is None
    pool.occupied(a, {})  # its model unloaded, or nothing of others' left
    assert a.others == {}


def test_requests_out_counts_online_requests_of_one_version_until_their_reply() -> None:
    cfg = model()
    other = replace(cfg, name="other")
    pool = WorkerPool(credits=2)
    a, b = serving(pool, "a", "b", key=cfg.key)
    b.models.add(other.key)
    job = request(cfg)
    job.background = True
    first = pool.hand(a, cfg, [request(cfg), request(cfg)], 0.0)
    pool.hand(b, cfg, [request(cfg)], 0.0)
    pool.hand(a, cfg, [job], 0.0)  # a job's batch: its callers are not online
    pool.hand(b, other, [request(other)], 0.0)
    assert pool.requests_out(cfg.key) == 3
    pool.finish(a, first.id)
    assert pool.requests_out(cfg.key) == 1


def test_a_worker_running_a_suspect_takes_nothing_beside_it() -> None:
    cfg = model()
    pool = WorkerPool(credits=2)
    (a,) = serving(pool, "a", key=cfg.key)
    suspect = request(cfg)
    suspect.suspect = True
    batch = pool.hand(a, cfg, [suspect], 0.0)
    assert batch.suspect and a.exclusive
    assert pool.capacity(cfg) == NO_CAPACITY
    assert pool.finish(a, batch.id) is batch and pool.finish(a, batch.id) is None
    assert pool.capacity(cfg) == IDLE


def test_a_suspect_goes_where_no_sequence_runs_and_no_sequence_starts_beside_it() -> None:
    """A poison ends what runs beside it: a suspect goes to an idle worker with no
    sequence, ours or another frontend's, if there is one, else to an idle one with
    sequences; while it runs there, no sequence starts there."""
    cfg, gen = model(), stepwise_model(max_active=2)
    pool = WorkerPool(credits=2)
    a, b, c = serving(pool, "a", "b", "c", key=cfg.key)
    for w in (a, b, c):
        w.models.add(gen.key)
    pool.start(a, gen, request(gen), 0.0)
    b.others = {gen.key: 1}
    assert pool.choose(cfg.key, suspect=True) is c
    assert pool.choose(cfg.key, idle_only=True) is a  # (a job's batch: any idle worker)
    pool.hand(c, cfg, [request(cfg)], 0.0)
    assert pool.choose(cfg.key, suspect=True) in (a, b)  # (none free of sequences)
    c.inflight.clear()
    suspect = request(cfg)
    suspect.suspect = True
    pool.hand(c, cfg, [suspect], 0.0)
    assert pool.choose_slot(gen) is a  # (a and b have one slot free, c two: it runs the suspect)
    for w in (a, b, b):
        pool.start(w, gen, request(gen), 0.0)
    assert pool.choose_slot(gen) is None and pool.capacity(gen) == NO_CAPACITY
    c.inflight.clear()
    assert pool.choose_slot(gen) is c and pool.capacity(gen) == IDLE


def test_joining_again_from_the_same_process_keeps_the_worker_and_its_batches() -> None:
    cfg = model()
    pool = WorkerPool()
    (a,) = serving(pool, "a", key=cfg.key)
    batch = pool.hand(a, cfg, [request(cfg)], 0.0)
    assert pool.join(b"a", info("a")) == (Joined.AGAIN, a)
    assert a.inflight == {batch.id: batch}
    assert pool.join(b"a", info("a", pid=2)) == (Joined.REPLACED, a)
    # A container restarted: the same host name and pid 1, another process.
    assert pool.join(b"a", info("a", instance="i2")) == (Joined.REPLACED, a)
    assert pool.leave(a) == ([batch], []) and pool.workers() == []
    assert pool.leave(a) == ([], [])  # already gone
    joined, new = pool.join(b"a", info("a", pid=2))
    assert joined is Joined.NEW and new is not a


def test_batches_past_their_execution_limit_are_found() -> None:
    cfg = model()
    pool = WorkerPool(credits=2)
    a, b = serving(pool, "a", "b", key=cfg.key)
    late = pool.hand(a, cfg, [request(cfg)], 0.0)
    pool.hand(b, cfg, [request(cfg)], 59.0)
    limit = cfg.instances.execution_timeout_s  # 60 s by default
    # (with no heartbeat saying when it began, a heartbeat interval more than from its send)
    assert pool.overdue(limit + 0.5) == []
    assert pool.overdue(limit + 1.5) == [
        (a, f"batch {late.id} of model 'm' ran past execution_timeout_s {limit}")
    ]
    assert pool.inflight(cfg.key) == 2 and pool.model_ready(cfg.key)


def test_a_sequence_with_no_step_past_its_limit_is_found_as_a_sequence() -> None:
    """It was named 'batch <its id>', an id no log or caller knows for a sequence."""
    cfg = stepwise_model(max_active=2)
    pool = WorkerPool()
    (w,) = serving(pool, "w", key=cfg.key)
    seq = request(cfg)
    seq.id = "r-1"
    pool.start(w, cfg, seq, 0.0)
    limit = cfg.instances.execution_timeout_s
    assert pool.overdue(limit - 0.5) == []
    assert pool.overdue(limit + 0.5) == [
        (w, f"a sequence (request id 'r-1') of model '{cfg.name}' had no step in its "
            f"execution_timeout_s {limit}")
    ]  # fmt: skip


def test_a_worker_dropping_a_model_is_not_idle_while_another_is() -> None:
    """A worker in an unloaded model's finalizer (its beats: busy, none of our batches)
    was taken for idle: batches went to it and waited out the finalizer while another
    worker idled, and a lone request left at once for it. Dropping, it takes a batch only
    where no worker is idle (a suspect's retry: never), and it is idle again, a pump
    due, when a beat says the drop is over."""
    cfg = model()
    pool = WorkerPool(credits=2)
    a, b = serving(pool, "a", "b", key=cfg.key)
    dropping = wire.Header(kind=wire.Header.HEARTBEAT, busy_ns=int(2e9), dropping=True)
    assert pool.beat(a, dropping, 10.0) is False
    assert pool.capacity(cfg) == IDLE and pool.choose(cfg.key) is b
    assert pool.choose(cfg.key) is b  # (round-robin would give a its turn)
    pool.hand(b, cfg, [request(cfg)], 0.0)
    assert pool.capacity(cfg) == BUSY_WITH_CREDIT  # (a batch fills: none is idle)
    assert pool.choose(cfg.key, suspect=True) is None
    assert pool.choose(cfg.key) in (a, b)
    assert pool.beat(a, wire.Header(kind=wire.Header.HEARTBEAT, idle_ns=1), 11.0) is True
    assert pool.capacity(cfg) == IDLE and pool.choose(cfg.key, idle_only=True) is a


def test_a_sequence_goes_where_no_model_is_dropped_and_a_drop_is_no_load() -> None:
    """A START went to a worker in a finalizer of seconds (it had the most free slots)
    while another with free slots stepped, and one idle but dropping made the capacity
    IDLE (late review 59b): it goes to the other, and with no worker idle the slots are
    busy with room. A dropping worker that loads nothing made a one-shot model's capacity
    IDLE_LOADING, not IDLE_UNSETTLED (a suspect then waited half its time to settle)."""
    gen, cfg = stepwise_model(max_active=4), model()
    pool = WorkerPool(credits=1)
    a, b = serving(pool, "a", "b", key=gen.key)
    pool.start(b, gen, request(gen), 0.0)  # b steps one: 3 slots free; a has 4
    dropping = wire.Header(kind=wire.Header.HEARTBEAT, busy_ns=int(2e9), dropping=True)
    pool.beat(a, dropping, 10.0)
    assert pool.choose_slot(gen) is b and pool.capacity(gen) == BUSY_WITH_CREDIT
    for w in (a, b):
        w.models.add(cfg.key)
    assert not a.load_sent and pool.capacity(cfg) == IDLE_UNSETTLED  # b: idle, stepping
    pool.occupied(b, {gen.key: 4})  # another frontend's fill b's slots: a's drop ends soon
    assert pool.choose_slot(gen) is a  # (a START on b waits for a sequence's end: 59c)


def test_a_sequence_waiting_behind_other_work_within_its_limit_is_not_late() -> None:
    """A sequence of a model with a 3 s limit waited behind an 8 s forward of another
    model (limit 30 s) on its worker: the frontend killed the healthy worker as hung,
    failed the stream and ran the forward again. It is timed from the worker's last
    work as its heartbeats tell it; a worker silent or idle is still found."""
    cfg = replace(
        stepwise_model(max_active=2), instances=replace(model().instances, execution_timeout_s=3.0)
    )
    pool = WorkerPool()
    (w,) = serving(pool, "w", key=cfg.key)
    pool.start(w, cfg, request(cfg), 0.0)
    for at in (1.0, 2.0, 4.0, 6.0, 8.0):  # another model's forward, begun at 0.5
        busy = wire.Header(kind=wire.Header.HEARTBEAT, busy_ns=int((at - 0.5) * 1e9),
                           busy_limit_s=30.0)  # fmt: skip
        pool.beat(w, busy, at)
        assert pool.overdue(at + 0.5) == []
    pool.beat(w, wire.Header(kind=wire.Header.HEARTBEAT, idle_ns=int(0.2e9)), 8.7)  # ended 8.5
    assert pool.overdue(11.4) == []
    assert [why[:13] for _, why in pool.overdue(11.6)] == ["a sequence (r"]


def test_a_batch_is_timed_from_its_forward_s_start_as_the_worker_s_heartbeats_tell() -> None:
    """A shared worker runs other frontends' forwards before ours (or a GPU worker the
    one staged ahead): timed from its send, a batch waiting there was taken for stuck.
    A heartbeat that shows a forward running excuses our batches not in it; one in it is
    timed from when the forward began; a worker stuck outside its forwards (a hung
    unload) is timed from the end of its last."""
    cfg = model()  # execution_timeout_s 60
    pool = WorkerPool(credits=2)
    (w,) = serving(pool, "w", key=cfg.key)
    first, second = (pool.hand(w, cfg, [request(cfg)], 0.0) for _ in range(2))

    def beat(at: float, busy_s: float, *running: int, idle_s: float = 0.0) -> None:
        header = wire.Header(kind=wire.Header.HEARTBEAT, busy_ns=int(busy_s * 1e9),
                             idle_ns=int(idle_s * 1e9), running=running)  # fmt: skip
        pool.beat(w, header, at)

    beat(50.0, 45.0)  # another frontend's forward for 45 s: both of ours wait behind it
    assert pool.overdue(100.0) == []  # 100 s after their send
    beat(100.0, 0.0, idle_s=0.001)  # between two forwards
    beat(101.0, 1.0, first.id)  # ours began at 100
    beat(150.0, 50.0, first.id)
    assert pool.overdue(159.0) == []  # the second, staged, waits for the first
    assert pool.overdue(160.5) == [
        (w, f"batch {first.id} of model 'm' ran past execution_timeout_s 60.0")
    ]
    pool.finish(w, first.id)
    beat(170.0, 0.0, idle_s=10.0)  # stuck outside its forwards since the first's end, 160
    # (a batch not shown running may have begun since the last heartbeat: 1 s more)
    assert pool.overdue(220.5) == [] and pool.overdue(221.5) == [
        (w, f"batch {second.id} of model 'm' ran past execution_timeout_s 60.0")
    ]


def test_a_forward_of_a_frontend_gone_is_held_to_its_limit_by_every_frontend() -> None:
    """A forward hung (the GIL released) whose frontend died: only its own frontend timed
    it, so the worker was never stopped and every later batch waited behind it."""
    cfg = model()
    pool = WorkerPool()
    (w,) = serving(pool, "w", key=cfg.key)
    header = wire.Header(kind=wire.Header.HEARTBEAT, busy_ns=int(2e9), busy_limit_s=3.0)
    pool.beat(w, header, 10.0)  # another frontend's forward, begun at 8
    assert pool.overdue(11.9) == []
    late = "its forward (or a model's release, finalizer) ran past execution_timeout_s 3.0"
    assert pool.overdue(12.1) == [(w, late)]
    pool.beat(w, wire.Header(kind=wire.Header.HEARTBEAT, idle_ns=1), 12.0)  # it ended
    assert pool.overdue(20.0) == []


def test_a_load_past_the_load_timeout_is_found_and_only_while_it_is_pending() -> None:
    """A load() that never returns holds up a worker's later loads: pool.overdue names
    it once --load-timeout has passed since its LOAD went."""
    pool = WorkerPool(credits=1, load_timeout_s=10.0)
    (a,) = serving(pool, "a", key="other@1")
    loop = asyncio.new_event_loop()
    try:
        a.loads["m@2"], a.load_sent["m@2"] = loop.create_future(), 100.0
        assert pool.overdue(110.0) == []
        why = "its load of model 'm' version 2 ran past --load-timeout 10 s"
        assert pool.overdue(110.5) == [(a, why)]
        hung = "not sent: its load on a ran past --load-timeout 10 s"
        assert pool.hung == {("a", "m@2"): hung}  # a's replacement is not asked again
        a.loads["m@2"].set_result("")  # LOADED (control.on_loaded)
        a.load_sent.pop("m@2")
        assert pool.overdue(200.0) == []
    finally:
        loop.close()


def test_a_hung_load_unloaded_meanwhile_is_still_the_one_blamed() -> None:
    """A worker loads in turn: a load unloaded while it hangs still runs there until
    LOADED, and the loads behind it wait. Past --load-timeout the hung one is named,
    not the next (which was then marked hung, and unavailable till a reload by hand)."""
    pool = WorkerPool(credits=1, load_timeout_s=10.0)
    (a,) = serving(pool, "a", key="other@1")
    loop = asyncio.new_event_loop()
    try:
        a.load_sent["c@1"] = 100.0  # its future gone with the unload (control)
        a.loads["tiny@1"], a.load_sent["tiny@1"] = loop.create_future(), 100.0
        why = "its load of model 'c' version 1 ran past --load-timeout 10 s"
        assert pool.overdue(110.5) == [(a, why)]
        assert list(pool.hung) == [("a", "c@1")]
    finally:
        loop.close()


def test_a_hung_load_is_kept_from_its_slot_and_from_the_process_it_hung() -> None:
    """A remote worker's default id ends in its pid, so each restart was a new slot and
    hung on the version again; the process whose load hung, still alive after STOP,
    registered again and each load it was sent waited behind the hung one, to be
    judged hung in turn (a healthy model marked for good)."""
    pool = WorkerPool(credits=1, load_timeout_s=10.0)
    _, local = pool.join(b"l", info("cpu0#3", pid=5))
    _, hung = pool.join(b"r", info("vm-cpu-77", pid=77))
    assert (local.slot, hung.slot) == ("cpu0", "vm-cpu")
    loop = asyncio.new_event_loop()
    try:
        hung.loads["m@1"], hung.load_sent["m@1"] = loop.create_future(), 0.0
        assert [w for w, _ in pool.overdue(11.0)] == [hung]
    finally:
        loop.close()
    pool.leave(hung)
    _, again = pool.join(b"r", info("vm-cpu-77", pid=77))  # the same process, back
    assert pool.hung_for(again, "m@1") and pool.hung_for(again, "healthy@1")
    pool.leave(again)
    _, restarted = pool.join(b"r2", info("vm-cpu-78", pid=78))  # a new process in the slot
    assert pool.hung_for(restarted, "m@1") and not pool.hung_for(restarted, "healthy@1")
    assert not pool.hung_for(local, "m@1")


def test_a_version_its_workers_are_lost_loading_twice_in_a_row_is_not_sent_again() -> None:
    """A slot's workers lost as they load a version: once may be chance (the memory
    killer), twice in a row is the version (a model.py that ends its process), which
    would take every restart with it. A load of it that succeeds in between resets it."""
    pool = WorkerPool(credits=1)

    def lost_loading(pid: int) -> WorkerHandle:
        _, w = pool.join(b"cpu0", info(f"cpu0#{pid}", pid=pid))
        w.load_sent["bad@1"] = 0.0
        pool.leave(w)
        return w

    lost_loading(1)
    _, w = pool.join(b"cpu0", info("cpu0#2", pid=2))
    pool.loaded(w, "bad@1")  # (it loaded, this time)
    pool.leave(w)
    lost_loading(3)
    assert pool.hung_for(w, "bad@1") == ""
    lost_loading(4)
    why = "not sent: a worker of cpu0 was lost 2 times as it loaded it"
    assert pool.hung_for(w, "bad@1") == why


def test_a_worker_lost_loading_while_a_suspect_ran_does_not_count_against_the_load() -> None:
    """The suspect has ended a worker before: the likelier cause. In a poison storm a
    healthy model's load, under way each time the poison's retry ended its worker,
    was not sent again."""
    cfg = model()
    pool = WorkerPool(credits=1)
    for pid in (1, 2, 3):
        _, w = pool.join(b"cpu0", info(f"cpu0#{pid}", pid=pid))
        w.models.add(cfg.key)
        w.load_sent["healthy@1"] = 0.0
        poison = request(cfg)
        poison.suspect = True
        pool.hand(w, cfg, [poison], 0.0)
        pool.leave(w)
    assert pool.hung_for(w, "healthy@1") == ""
    _, w = pool.join(b"cpu0", info("cpu0#4", pid=4))
    w.load_sent["healthy@1"] = 0.0
    pool.hand(w, cfg, [request(cfg)], 0.0)  # (not a suspect: counted)
    pool.leave(w)
    assert pool.hung_for(w, "healthy@1") == ""  # (counted: once of 2)
    gen = stepwise_model()
    _, w = pool.join(b"cpu0", info("cpu0#5", pid=5))
    w.load_sent["healthy@1"] = 0.0
    again = request(gen)
    again.attempts = 1  # a sequence started again after a loss: as a suspect
    pool.start(w, gen, again, 0.0)
    pool.leave(w)
    assert pool.hung_for(w, "healthy@1") == ""
