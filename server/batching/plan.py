"""Which queued requests form the next batch. Pure: queues in, a Plan out.

The anchor is the oldest request of the most urgent level: levels are served
highest first (level 0 = priority 1), FIFO within a level, except that a level
whose head has waited longer than `max_starvation_us` jumps the line. Only
requests whose non-ragged shapes equal the anchor's can join it. Then:

  * FIFO (the default): take requests in order while rows <= the cap and the
    batch's tokens <= `max_batch_tokens` (padded: rows x longest ragged length;
    packed: the sum of the lengths, what the model computes); stop at the first
    that does not fit, so nobody is overtaken.
  * `bucket_by_length`: among the first `window` candidates of each level,
    prefer the lengths nearest the anchor's (which always goes first), and
    keep the batch's longest row at most twice its shortest, so padding stays
    small; a request that does not fit is skipped, not a stop. A skipped
    request waits for a batch of its own lengths; at the latest it becomes the
    oldest and anchors one, so nobody starves.
  * `preferred_batch_sizes`: if a prefix of the chosen requests has exactly a
    preferred number of rows, the batch is cut there and may leave at once.

Without `max_batch_tokens`, a batch still holds at most PADDED_TOKENS elements
(padded: rows x longest x the elements of a position; packed: their sum x the
same), so thirty requests of the most one may send never make one batch thirty
times that (a worker's memory); no row is padded past PAD_FREE elements to
more than PAD_WASTE times its own length, so one row of millions of tokens
rides alone rather than have short rows padded to its length (the frontend
pads on its event loop: seven 1-token rows beside one of 7.9M were 482 MB, 1.3 s);
and a batch padded past PAD_FREE elements holds at most PAD_WASTE times the
elements its requests sent (63 1-token rows, each padded free to one of 1M,
were 64M elements and their mask, 2.1 GB and 11 s on the loop: review 54f).

A suspect (a request whose batch lost its worker or made the model raise)
rides alone, so a poison request or a bad input takes nobody else down.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

from batchd.protos.model_config import BatchingConfig
from batchd.server.request import Request

PADDED_TOKENS = 1 << 26  # (the default --max-tensor-elements: what one request may send)
PAD_FREE = 1 << 20  # elements a row may be padded to whatever its length (8 MB of INT64)
PAD_WASTE = 4  # past that, at most this many times its own length


@dataclass(frozen=True, slots=True)
class Plan:
    requests: list[Request]
    rows: int
    padded_length: int  # longest ragged length in the batch (0: no ragged input)
    full: bool  # nothing more fits: a compatible request was left out for want of room
    preferred: bool  # rows is one of the preferred batch sizes
    oldest_arrival: float  # the anchor's arrival: the batch window starts there
    suspect: bool = False  # a lone retry after a failure: it needs an idle worker
    # The soonest deadline of the live requests planned over, in the batch or not (one
    # of another shape waits for this batch to leave): it must not wait past that.
    deadline: float = math.inf
    settle_by: float = 0.0  # a suspect: till when it waits for a settled worker (lanes.py)


def _live(r: Request, now: float) -> bool:
    return not r.future.done() and r.deadline > now


def level_order(
    levels: Sequence[Iterable[Request]],
    heads: Sequence[Request | None],
    now: float,
    starvation_s: float,
) -> list[int]:
    """Level indices, most urgent first: starved levels by their head's age, then by
    level. The first level's head is starved too once it has waited as long: it goes
    before younger heads (counted as never starved, it went after every starved level,
    and under overload, where every head is, priority 1 was served last: review 58b)."""
    starved = sorted(
        (h.arrival, i)
        for i, h in enumerate(heads)
        if h is not None and now - h.arrival >= starvation_s
    )
    first = [i for _, i in starved]
    return first + [i for i in range(len(levels)) if i not in first]


def _fits(rows: int, tokens: int, sent: int, longest: int, shortest: int, cap: int,
          budget: int, per: int) -> bool:  # fmt: skip
    """Whether a batch of `rows` and `tokens` (padded: rows x `longest`, its shortest row
    `shortest`, `sent` the sum of its lengths; packed: the sum, nothing padded, `shortest`
    then `longest`) fits the cap and the model's token budget, or without one the default
    bounds, counted in elements (`per` a position)."""
    if rows > cap:
        return False
    if budget:
        return tokens <= budget
    return (
        tokens * per <= PADDED_TOKENS
        and (longest * per <= PAD_FREE or longest <= PAD_WASTE * shortest)
        and (tokens * per <= PAD_FREE or tokens <= PAD_WASTE * sent)
    )


def _elements_per_position(r: Request) -> int:
    """A ragged request's elements at one position of its ragged dim, over its ragged
    inputs ([rows, length, d, ...]: d x ...)."""
    ragged = (t for t, s in zip(r.inputs, r.model.inputs, strict=True) if s.ragged)
    return sum(math.prod(t.shape[2:]) for t in ragged) or 1


def plan_batch(
    levels: Sequence[Sequence[Request]],
    now: float,
    cap: int,
    cfg: BatchingConfig,
    window: int,
    packed: bool = False,
    past_suspects: bool = False,  # (they wait for a settled worker: lanes.settle_by)
) -> Plan | None:
    heads = [next((r for r in q if _live(r, now) and not (past_suspects and r.suspect)), None)
             for q in levels]  # fmt: skip
    order = level_order(levels, heads, now, cfg.max_starvation_us / 1e6)
    anchor = next((heads[i] for i in order if heads[i] is not None), None)
    if anchor is None:
        return None
    if anchor.suspect:  # its last batch failed: alone, it cannot take others down with it
        return Plan([anchor], anchor.rows, anchor.length, True, False, anchor.arrival, True,
                    anchor.deadline)  # fmt: skip
    bucket = cfg.bucket_by_length
    soonest = [anchor.deadline]
    candidates: Iterable[Request] = _joinable(levels, order, window, anchor, now, soonest)
    if bucket:  # nearest lengths first, level by level: priorities still come first
        rank = {i: n for n, i in enumerate(order)}
        candidates = sorted(
            candidates, key=lambda r: (rank[r.level], abs(r.length - anchor.length), r.arrival)
        )
    chosen, rows, length, blocked = [anchor], anchor.rows, anchor.length, False
    shortest, summed = anchor.length, anchor.rows * anchor.length
    per = _elements_per_position(anchor) if anchor.length else 1
    for r in candidates:
        new_rows, new_len = rows + r.rows, max(length, r.length)
        new_sum = summed + r.rows * r.length
        if bucket and new_len > 2 * min(shortest, r.length):
            continue  # not of this bucket: it anchors a batch of its own later
        tokens = new_sum if packed else new_rows * new_len
        least = new_len if packed else min(shortest, r.length)  # (packed: nothing padded)
        if not _fits(new_rows, tokens, new_sum, new_len, least, cap, cfg.max_batch_tokens, per):
            blocked = True
            if not bucket:
                break
            continue
        chosen.append(r)
        rows, length, shortest, summed = new_rows, new_len, min(shortest, r.length), new_sum
    chosen, rows, preferred = _cut_to_preferred(chosen, rows, cfg.preferred_batch_sizes)
    if preferred:
        length = max(r.length for r in chosen)
    full = blocked or rows >= cap
    return Plan(chosen, rows, length, full, preferred, anchor.arrival, False, soonest[0])


def _joinable(
    levels: Sequence[Sequence[Request]], order: list[int], window: int, anchor: Request,
    now: float, soonest: list[float],
) -> Iterator[Request]:  # fmt: skip
    """The live requests of each level's window that may join `anchor`, most urgent
    level first; `soonest[0]` is lowered to every live deadline seen on the way.
    FIFO stops at the first that does not fit, and then the batch is full and leaves:
    the deadline matters only when the whole window was seen."""
    key = anchor.shape_key
    for i in order:
        for r in islice(levels[i], window):
            if r is anchor or not _live(r, now):
                continue
            soonest[0] = min(soonest[0], r.deadline)
            if r.shape_key == key and not r.suspect:
                yield r


def _cut_to_preferred(
    chosen: list[Request], rows: int, preferred: tuple[int, ...]
) -> tuple[list[Request], int, bool]:
    if not preferred:
        return chosen, rows, False
    prefix_rows, best = 0, 0
    for n, r in enumerate(chosen, 1):
        prefix_rows += r.rows
        if prefix_rows in preferred:
            best = n
    if not best:
        return chosen, rows, False
    kept = chosen[:best]
    return kept, sum(r.rows for r in kept), True
