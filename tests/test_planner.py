"""Issue 3's batching rules, each on the pure parts with a fake clock: the
planner (priorities, starvation, shapes, token budget, bucketing, preferred
sizes), the latency target, and ragged padding / splitting in split_join."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from batchd.protos import wire
from batchd.protos.model_config import BatchingConfig, BatchInputSpec, ModelConfig, TensorSpec
from batchd.protos.tensors import from_raw
from batchd.server.batching.latency import LatencyTarget
from batchd.server.batching.plan import plan_batch
from batchd.server.batching.split_join import (
    join_inputs,
    join_results,
    split_outputs,
    split_request,
)
from batchd.server.request import Request, Tensor

NOW = 100.0


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def ragged_model(**batching: object) -> ModelConfig:
    return ModelConfig(
        name="text",
        directory=Path("."),
        artifact=Path("model.py"),
        platform="python",
        max_batch_size=8,
        inputs=(TensorSpec("IDS", "INT64", (-1,), ragged=True, pad_value=0),),
        outputs=(TensorSpec("OUT", "FP32", (-1,), ragged_like="IDS"),),
        batching=BatchingConfig(**batching),  # type: ignore[arg-type]
        batch_inputs=(
            BatchInputSpec("MASK", "mask", "IDS"),
            BatchInputSpec("LEN", "lengths", "IDS"),
        ),
    )


def text(
    cfg: ModelConfig,
    loop: asyncio.AbstractEventLoop,
    length: int,
    rows: int = 1,
    level: int = 0,
    arrival: float = NOW,
    start: int = 1,
) -> Request:
    ids = np.arange(start, start + rows * length, dtype=np.int64).reshape(rows, length)
    r = Request(
        cfg, "", [Tensor("IDS", "INT64", ids.shape, ids.tobytes())], ("OUT",), rows, math.inf
    )
    r.level, r.arrival, r.future = level, arrival, loop.create_future()
    return r


def levels_of(*requests: Request, count: int = 1) -> list[deque[Request]]:
    levels: list[deque[Request]] = [deque() for _ in range(count)]
    for r in requests:
        levels[r.level].append(r)
    return levels


def test_fifo_stops_at_the_first_request_that_does_not_fit(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    a, b, c = (text(cfg, loop, 4, rows) for rows in (5, 4, 1))
    p = plan_batch(levels_of(a, b, c), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [a] and p.full  # c would fit, but not ahead of b


def test_higher_priority_goes_first_fifo_within_a_level(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model(priority_levels=2, default_priority_level=2)
    low = [text(cfg, loop, 4, level=1, arrival=NOW - 0.5 + i / 100) for i in range(3)]
    high = [text(cfg, loop, 4, level=0, arrival=NOW - 0.2 + i / 100) for i in range(2)]
    p = plan_batch(levels_of(*low, *high, count=2), NOW, 3, cfg.batching, 64)
    assert p is not None and p.requests == [*high, low[0]]
    assert p.oldest_arrival == high[0].arrival


def test_a_starving_level_jumps_the_line(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model(priority_levels=2, default_priority_level=2, max_starvation_us=500_000)
    starved = text(cfg, loop, 4, level=1, arrival=NOW - 0.6)
    high = text(cfg, loop, 4, level=0, arrival=NOW - 0.1)
    p = plan_batch(levels_of(starved, high, count=2), NOW, 1, cfg.batching, 64)
    assert p is not None and p.requests == [starved]
    fresh = replace_arrival(starved, NOW - 0.4)
    p = plan_batch(levels_of(fresh, high, count=2), NOW, 1, cfg.batching, 64)
    assert p is not None and p.requests == [high]


def replace_arrival(r: Request, arrival: float) -> Request:
    r.arrival = arrival
    return r


def test_requests_of_other_shapes_never_join(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ModelConfig(
        name="m",
        directory=Path("."),
        artifact=Path("model.py"),
        platform="python",
        max_batch_size=8,
        inputs=(TensorSpec("X", "FP32", (-1,)),),
        outputs=(TensorSpec("Y", "FP32", (-1,)),),
    )

    def req(width: int) -> Request:
        r = Request(
            cfg, "", [Tensor("X", "FP32", (1, width), b"\0" * 4 * width)], ("Y",), 1, math.inf
        )
        r.arrival, r.future = NOW, loop.create_future()
        return r

    a, b, c = req(2), req(3), req(2)
    p = plan_batch(levels_of(a, b, c), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [a, c]


def test_token_budget_bounds_rows_times_longest(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model(max_batch_tokens=40)
    a, b, c = text(cfg, loop, 10), text(cfg, loop, 10), text(cfg, loop, 30)
    p = plan_batch(levels_of(a, b, c), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [a, b] and p.full  # a+b+c: 3 x 30 = 90 > 40
    alone = text(cfg, loop, 100)
    p = plan_batch(levels_of(alone), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [alone]  # too long for the budget: it goes alone


def test_bucketing_picks_the_nearest_lengths_to_the_oldest(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model(bucket_by_length=True, max_batch_tokens=4 * 50)
    lengths = [50, 3, 200, 48, 7, 52, 49]
    queue = [text(cfg, loop, n, arrival=NOW - 1 + i / 100) for i, n in enumerate(lengths)]
    p = plan_batch(levels_of(*queue), NOW, 8, cfg.batching, 64)
    assert p is not None
    # 52 would make 4 x 52 > 200 tokens; 7 fits the budget but is not within 2x of 50
    assert [r.length for r in p.requests] == [50, 49, 48]
    assert p.padded_length == 50
    fifo = plan_batch(levels_of(*queue), NOW, 8, replace(cfg.batching, bucket_by_length=False), 64)
    assert fifo is not None and [r.length for r in fifo.requests] == [50, 3]


def test_preferred_size_cuts_the_batch_and_may_leave_at_once(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cfg = ragged_model(preferred_batch_sizes=(2, 4))
    queue = [text(cfg, loop, 4) for _ in range(5)]
    p = plan_batch(levels_of(*queue), NOW, 8, cfg.batching, 64)
    assert p is not None and p.preferred and p.rows == 4 and p.requests == queue[:4]
    p = plan_batch(levels_of(queue[0]), NOW, 8, cfg.batching, 64)
    assert p is not None and not p.preferred and p.rows == 1


def test_latency_target_settles_where_queue_plus_compute_fits() -> None:
    """A fake model whose batch takes 2 ms + 1 ms per row, under saturating
    load (every batch fills the cap). With a 20 ms target a batch may run
    10 ms: the cap falls from 32 and settles at 8-9 rows, and the worst
    latency (wait for the running batch, ride one's own) stays near 20 ms."""
    target = LatencyTarget(0.020, max_cap=32)

    def compute(rows: int) -> float:
        return 0.002 + 0.001 * rows

    caps = []
    for _ in range(300):
        rows = target.cap
        target.observe(rows, compute(rows))
        caps.append(target.cap)
    assert caps[0] < 32 and set(caps[-50:]) <= {8, 9}
    worst = max(compute(a) + compute(b) for a, b in zip(caps[-50:], caps[-49:], strict=False))
    assert worst <= 0.022
    assert target.delay_s(0.010) == pytest.approx(max(0, 0.020 - 2 * target.expected_compute_s()))


def test_latency_target_grows_back_when_batches_get_cheap() -> None:
    target = LatencyTarget(0.020, max_cap=32)
    for _ in range(50):
        target.observe(target.cap, 0.015)  # too slow: shrink
    assert target.cap == 1
    for _ in range(40):
        target.observe(target.cap, 0.001 * target.cap)  # 1 ms a row: up to 10 rows fit
    assert 9 <= target.cap <= 11


def test_ragged_inputs_are_padded_with_mask_and_lengths(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    a, b = text(cfg, loop, 2, start=1), text(cfg, loop, 4, rows=2, start=10)
    headers, frames = join_inputs([a, b])
    got = {
        h.name: from_raw(h.datatype, h.shape, np.asarray(f).tobytes())
        for h, f in zip(headers, frames, strict=True)
    }
    assert got["IDS"].tolist() == [[1, 2, 0, 0], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert got["MASK"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert got["LEN"].tolist() == [2, 4, 4]
    left = replace(cfg, inputs=(replace(cfg.inputs[0], padding_side="left", pad_value=-1),))
    a2, b2 = text(left, loop, 2, start=1), text(left, loop, 3, start=5)
    headers, frames = join_inputs([a2, b2])
    ids = np.asarray(frames[0])
    assert ids.tolist() == [[-1, 1, 2], [5, 6, 7]]
    assert np.asarray(frames[1]).tolist() == [[0, 1, 1], [1, 1, 1]]


def test_ragged_outputs_are_cut_back_per_request(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    a, b = text(cfg, loop, 2), text(cfg, loop, 3)
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    results = split_outputs(
        [a, b], [wire.Tensor(name="OUT", datatype="FP32", shape=[2, 3])], [out.tobytes()]
    )
    assert [r[0].shape for r in results] == [(1, 2), (1, 3)]
    assert from_raw("FP32", (1, 2), bytes(results[0][0].data)).tolist() == [[0.0, 1.0]]


def test_big_requests_split_and_join_back(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    big = text(cfg, loop, 3, rows=20)
    chunks = split_request(big, 8)
    assert [c.rows for c in chunks] == [8, 8, 4]
    assert b"".join(bytes(c.inputs[0].data) for c in chunks) == big.inputs[0].data
    parts = [
        [Tensor("OUT", "FP32", (c.rows, 3), np.full((c.rows, 3), i, np.float32).tobytes())]
        for i, c in enumerate(chunks)
    ]
    joined = join_results(parts)[0]
    assert joined.shape == (20, 3)
    assert from_raw("FP32", joined.shape, joined.data)[:, 0].tolist() == [0] * 8 + [1] * 8 + [2] * 4
