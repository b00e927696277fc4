"""plan.py's rules on hand-built queues: priorities, starvation, shapes, the token
budget, bucketing, preferred sizes."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import replace
from pathlib import Path

from batchd.protos.model_config import ModelConfig, TensorSpec
from batchd.server.batching.plan import PAD_FREE, PAD_WASTE, PADDED_TOKENS, plan_batch
from batchd.server.config import Limits
from batchd.server.request import Request, Tensor
from tests.conftest import NOW, ragged_model, text


def levels_of(*requests: Request, count: int = 1) -> list[deque[Request]]:
    levels: list[deque[Request]] = [deque() for _ in range(count)]
    for r in requests:
        levels[r.level].append(r)
    return levels


def replace_arrival(r: Request, arrival: float) -> Request:
    r.arrival = arrival
    return r


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


def test_a_starved_first_level_goes_before_a_younger_starved_head(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Under overload every head has waited past max_starvation_us: the oldest goes
    first, priority 1's too. Priority 1 never counted as starved, so it went after every
    starved level: with max_starvation_us = 0 it was served only once priority 3 had no
    request left (review 58b: 21 answers against 226 in 12 s); now 0 is first come,
    first served across levels."""
    for starvation_us in (500_000, 0):
        cfg = ragged_model(priority_levels=3, default_priority_level=3,
                           max_starvation_us=starvation_us)  # fmt: skip
        high = text(cfg, loop, 4, level=0, arrival=NOW - 0.9)
        low = text(cfg, loop, 4, level=2, arrival=NOW - 0.7)
        p = plan_batch(levels_of(high, low, count=3), NOW, 1, cfg.batching, 64)
        assert p is not None and p.requests == [high]
        older = replace_arrival(low, NOW - 1.0)  # (older than priority 1's head: it goes)
        p = plan_batch(levels_of(high, older, count=3), NOW, 1, cfg.batching, 64)
        assert p is not None and p.requests == [older]
    fresh = text(cfg, loop, 4, level=0, arrival=NOW)  # (0: no head is younger than 0 s)
    p = plan_batch(levels_of(fresh, low, count=3), NOW, 1, cfg.batching, 64)
    assert p is not None and p.requests == [low]


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


def test_without_a_token_budget_a_padded_batch_stays_within_what_one_request_may_send(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """One row of 40M tokens (under --max-tensor-elements) batched with 7 short ones
    was padded to 8 x 40M: 2.5 GB of INT64 for 320 MB sent, and 16 GB for the
    longest row a request may have beside 31 others. It now rides alone; short rows
    still batch together. A packed model (no padding) batches them all, but its sum
    of tokens is bounded the same: two such rows were one batch of 80M."""
    cfg = ragged_model()  # no max_batch_tokens
    long, *short = [text(cfg, loop, 3, arrival=NOW - 1 + i / 100) for i in range(8)]
    long.length = 40_000_000  # (its tokens are never read here)
    p = plan_batch(levels_of(long, *short), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [long]
    p = plan_batch(levels_of(*short), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == short
    p = plan_batch(levels_of(long, *short), NOW, 8, cfg.batching, 64, packed=True)
    assert p is not None and len(p.requests) == 8
    other = text(cfg, loop, 3, arrival=NOW - 0.5)
    other.length = 40_000_000
    p = plan_batch(levels_of(long, other), NOW, 8, cfg.batching, 64, packed=True)
    assert p is not None and p.requests == [long] and p.full
    assert Limits().max_tensor_elements == PADDED_TOKENS


def test_without_a_token_budget_no_row_is_padded_far_past_its_own_length(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Seven 1-token rows beside one of 7.9M were one batch of 63M tokens (under the
    67M bound): 482 MB padded on the frontend's loop, 1.3 s, for 63 MB sent. Past
    PAD_FREE elements a row is padded to at most PAD_WASTE times its length; under
    it, rows pad freely."""
    cfg = ragged_model()  # no max_batch_tokens
    long, *short = [text(cfg, loop, 1, arrival=NOW - 1 + i / 100) for i in range(8)]
    long.length = 7_900_000
    p = plan_batch(levels_of(long, *short), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [long] and p.full
    p = plan_batch(levels_of(*short[:2], long, *short[2:]), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == short[:2] and p.full
    near = text(cfg, loop, 1, arrival=NOW)
    near.length = long.length // PAD_WASTE  # padded to 4x its length: it may
    p = plan_batch(levels_of(long, near), NOW, 8, cfg.batching, 64)
    assert p is not None and p.requests == [long, near]
    small = [text(cfg, loop, 1, arrival=NOW - 1 + i / 100) for i in range(8)]
    small[0].length = PAD_FREE // 8  # each 1-token row padded to PAD_FREE / 8: free
    p = plan_batch(levels_of(*small), NOW, 8, cfg.batching, 64)
    assert p is not None and p.rows == 8


def test_without_a_token_budget_a_batch_pads_at_most_a_few_times_what_it_was_sent(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Each row under PAD_FREE pads freely, but 63 1-token rows beside one of 1M were
    one batch of 64 x 1M: 64M elements and a mask as large, 2.1 GB and 11 s on the
    frontend's loop, for 8 MB sent (review 54f). Past PAD_FREE elements in all, a
    batch holds at most PAD_WASTE times what its rows sent: the long row takes three
    short ones; rows of similar lengths fill the batch, however long."""
    cfg = ragged_model()  # no max_batch_tokens
    long, *short = [text(cfg, loop, 1, arrival=NOW - 1 + i / 1000) for i in range(64)]
    long.length = PAD_FREE
    p = plan_batch(levels_of(long, *short), NOW, 64, cfg.batching, 64)
    assert p is not None and len(p.requests) == PAD_WASTE and p.full
    p = plan_batch(levels_of(*short), NOW, 64, cfg.batching, 64)
    assert p is not None and len(p.requests) == 63
    alike = [text(cfg, loop, 1, arrival=NOW - 1 + i / 1000) for i in range(64)]
    for k, r in enumerate(alike):
        r.length = PAD_FREE // 2 + k  # 32M elements in all, little of it padding
    p = plan_batch(levels_of(*alike), NOW, 64, cfg.batching, 64)
    assert p is not None and len(p.requests) == 64


def test_without_a_token_budget_the_bound_counts_the_elements_of_each_position(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A packed [-1, 256] input (only a packed one may have more dims): 32 requests of
    the most one may send (2^26 elements, 2^18 positions each) made one batch of 2^31
    elements, the bound counting positions."""
    cfg = ragged_model()
    wide = replace(cfg, inputs=(replace(cfg.inputs[0], shape=(-1, 256), packed=True),))
    big = [
        Request(wide, "", [Tensor("IDS", "INT64", (1, 1 << 18, 256), b"")], ("OUT",), 1, 1e9)
        for _ in range(4)
    ]
    for i, r in enumerate(big):
        r.arrival, r.future = NOW - 1 + i / 100, loop.create_future()
    p = plan_batch(levels_of(*big), NOW, 8, cfg.batching, 64, packed=True)
    assert p is not None and p.requests == big[:1] and p.full


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
