"""Issue 3's batching policies against real processes: priorities reorder a
backlog, ragged requests are padded and cut back, length bucketing keeps
padding small (FIFO measured beside it), and a ragged example model returns
the same for a request whatever it is batched with.

The `unstaged_server` gives each worker one credit, so while the gated model
holds the worker, the backlog builds whole; queue limits sized to the backlog
turn the first rejection into proof that every request is queued.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np

from batchd.client import AsyncClient, Client, ServerBusy
from tests.conftest import Gate, fill, outcome
from tests.servers import ServerProcess, wait_for


def occupy(
    client: AsyncClient, gate: Gate, model: str, inputs: dict[str, np.ndarray]
) -> asyncio.Future:  # type: ignore[type-arg]
    """Close the gate and start one batch on the worker; it holds until the gate opens."""
    gate.close()
    return asyncio.ensure_future(client.infer(model, inputs, timeout=60))


def test_priorities_reorder_a_backlog(unstaged_server: ServerProcess, gate: Gate) -> None:
    def x(v: float) -> dict[str, np.ndarray]:
        return {"X": np.array([[v]], np.float32)}

    async def scenario() -> None:
        async with AsyncClient(unstaged_server.url) as c:
            first = occupy(c, gate, "prio", x(1000))
            await asyncio.to_thread(wait_for, lambda: gate.calls("prio", "entered"), 30)
            # Level 2 (the default) first, then level 1: each holds 3, the 4th is refused.
            await fill(
                lambda i: asyncio.ensure_future(outcome(c.infer("prio", x(1 + i), timeout=60)))
            )
            await fill(
                lambda i: asyncio.ensure_future(
                    outcome(c.infer("prio", x(11 + i), timeout=60, parameters={"priority": 1}))
                )
            )
            gate.open()
            await first
            await asyncio.to_thread(wait_for, lambda: len(gate.calls("prio")) == 3, 30)

    asyncio.run(scenario())
    batches = gate.calls("prio")
    assert batches[0] == [1000.0]
    high, low = batches[1][:3], batches[1][3:] + batches[2]
    assert all(v > 10 for v in high) and high == sorted(high)  # level 1 first, FIFO within
    assert all(v < 10 for v in low) and low == sorted(low) and len(low) == 3


def tokens(rng: random.Random, n: int) -> np.ndarray:
    return np.array([[rng.randrange(1, 30000) for _ in range(n)]], dtype=np.int64)


def backlog_efficiency(server: ServerProcess, gate: Gate, model: str) -> tuple[float, list[dict]]:  # type: ignore[type-arg]
    """Queue 96 requests of lengths 1..256 behind a busy worker, let them run,
    and return real tokens / padded tokens over the batches they formed."""
    rng = random.Random(7)
    sent: dict[int, np.ndarray] = {}

    async def scenario() -> list[object]:
        async with AsyncClient(server.url) as c:
            first = occupy(c, gate, model, {"TOKENS": tokens(rng, 5)})
            await asyncio.to_thread(wait_for, lambda: gate.records(model, "entered"), 30)

            def call(i: int) -> asyncio.Future[object]:
                sent[i] = tokens(rng, rng.randint(1, 256))
                return asyncio.ensure_future(
                    outcome(c.infer(model, {"TOKENS": sent[i]}, timeout=60))
                )

            calls = await fill(call)
            gate.open()
            await first
            return list(await asyncio.gather(*calls))

    results = asyncio.run(scenario())
    served = 0
    for i, out in enumerate(results):
        if isinstance(out, ServerBusy):
            continue
        served += 1
        assert np.array_equal(out["ECHO"], sent[i])  # type: ignore[index]  # padding cut back
        assert out["LENGTH"].tolist() == [[sent[i].shape[1]]]  # type: ignore[index]
    assert served == 96
    batches = gate.records(model)[1:]  # the first is the busy one
    assert all(b["rows"] * b["width"] <= 4096 for b in batches)  # max_batch_tokens
    assert sum(b["rows"] for b in batches) == 96
    return sum(b["real"] for b in batches) / sum(b["rows"] * b["width"] for b in batches), batches


def test_bucketing_keeps_padding_small_where_fifo_does_not(
    unstaged_server: ServerProcess, gate: Gate
) -> None:
    bucketed, batches = backlog_efficiency(unstaged_server, gate, "bucketed")
    gate.reset()
    fifo, _ = backlog_efficiency(unstaged_server, gate, "fifo")
    print(
        f"padding efficiency: bucketed {bucketed:.3f} over {len(batches)} batches, FIFO {fifo:.3f}"
    )
    assert bucketed >= 0.8
    assert fifo < bucketed


def test_ragged_example_gives_every_request_what_it_gets_alone(
    example_server: ServerProcess,
) -> None:
    rng = random.Random(3)
    inputs = [tokens(rng, n) for n in [1, 256, *(rng.randint(1, 256) for _ in range(30))]]

    async def together() -> list[dict[str, np.ndarray]]:
        async with AsyncClient(example_server.url) as c:
            return list(await asyncio.gather(*(c.infer("textpool", t, timeout=60) for t in inputs)))

    batched = asyncio.run(together())
    with Client(example_server.url) as c:
        alone = [c.infer("textpool", t, timeout=60) for t in inputs]
    for b, a in zip(batched, alone, strict=True):
        assert b["EMBEDDING"].shape == (1, 64)
        assert np.allclose(b["EMBEDDING"], a["EMBEDDING"], atol=1e-5)
