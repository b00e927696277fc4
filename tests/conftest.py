from __future__ import annotations

import asyncio
import heapq
import json
import math
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from batchd.protos.model_config import BatchingConfig, BatchInputSpec, ModelConfig, TensorSpec
from batchd.server.request import Request, Tensor
from tests.certs import make_certs, write_tokens
from tests.servers import EXAMPLES, TEST_MODELS, ServerProcess

T = TypeVar("T")

# ---- helpers for unit tests of the frontend's pieces ----


def model(
    max_batch_size: int = 4, queue: int = 8, delay_us: int = 1000, shape: tuple[int, ...] = (2,)
) -> ModelConfig:
    """A model config with one FP32 input X and output Y, no files behind it."""
    return ModelConfig(
        name="m",
        directory=Path("."),
        artifact=Path("model.py"),
        platform="python",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec("X", "FP32", shape),),
        outputs=(TensorSpec("Y", "FP32", shape),),
        batching=BatchingConfig(max_queue_delay_us=delay_us, max_queue_size=queue),
    )


def request(cfg: ModelConfig, rows: int = 1, width: int = 2, deadline: float = math.inf) -> Request:
    data = b"\0" * (rows * width * 4)
    return Request(cfg, "", [Tensor("X", "FP32", (rows, width), data)], ("Y",), rows, deadline)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeTimer:
    """The scheduler's timers on a Clock the test moves: nothing fires by itself;
    `run_due` runs what is due now, `advance` moves the clock and runs each timer
    at its own time, in order."""

    class _Handle:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._due: list[tuple[float, int, Callable[[], None], FakeTimer._Handle]] = []
        self._seq = 0

    def at(self, when: float, callback: Callable[[], None]) -> FakeTimer._Handle:
        handle = FakeTimer._Handle()
        self._seq += 1
        heapq.heappush(self._due, (when, self._seq, callback, handle))
        return handle

    def pending(self) -> list[float]:
        return sorted(when for when, _, _, h in self._due if not h.cancelled)

    def run_due(self) -> int:
        fired = 0
        while self._due and self._due[0][0] <= self.clock.now:
            _, _, callback, handle = heapq.heappop(self._due)
            if not handle.cancelled:
                fired += 1
                callback()
        return fired

    def advance(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while (due := self.pending()) and due[0] <= end:
            self.clock.now = max(self.clock.now, due[0])
            self.run_due()
        self.clock.now = end


def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await coro_fn()

    return asyncio.run(main())


NOW = 100.0


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop that is not running: futures for requests built by hand."""
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


# ---- the gated test models and the servers ----


class Gate:
    """Holds the `gated` test models' batches while closed; reads their call log."""

    def __init__(self, state: Path) -> None:
        self.state = state

    def close(self) -> None:
        (self.state / "gate-closed").touch()

    def open(self) -> None:
        (self.state / "gate-closed").unlink(missing_ok=True)

    def records(self, model: str | None = None, log: str = "calls") -> list[dict[str, Any]]:
        """The lines the test models wrote for each batch they finished (or, log="entered",
        started), oldest first."""
        path = self.state / f"{log}.log"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [r for r in rows if model is None or r["model"] == model]

    def calls(self, model: str | None = None, log: str = "calls") -> list[list[float]]:
        """The X values of each batch of the `gated`-style models."""
        return [r["values"] for r in self.records(model, log) if "values" in r]

    def reset(self) -> None:
        self.open()
        (self.state / "calls.log").unlink(missing_ok=True)
        (self.state / "entered.log").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate")


@pytest.fixture
def gate(state_dir: Path) -> Iterator[Gate]:
    g = Gate(state_dir)
    g.reset()
    yield g
    g.open()


@pytest.fixture(scope="session")
def test_server(
    state_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server over tests/models (gated, limited, echo) with one worker, holding
    two batches at once as GPU workers do, so staging runs under every test."""
    server = ServerProcess(
        TEST_MODELS,
        "--credits-per-worker",
        "2",
        log_dir=tmp_path_factory.mktemp("logs"),
        env={"BATCHD_TEST_DIR": str(state_dir)},
    ).start()
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="session")
def unstaged_server(
    state_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """tests/models again, with one credit per worker: while the worker runs a
    batch nothing is staged, so a backlog builds whole and forms the next
    batches by the policy under test alone."""
    server = ServerProcess(
        TEST_MODELS,
        "--credits-per-worker",
        "1",
        log_dir=tmp_path_factory.mktemp("logs"),
        env={"BATCHD_TEST_DIR": str(state_dir)},
    ).start()
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="session")
def example_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server over examples/models (mlp, tiny, embed) with two workers."""
    server = ServerProcess(EXAMPLES, log_dir=tmp_path_factory.mktemp("logs"), workers=2).start()
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server and a client certificate it signed, and a stranger's (tests/certs.py)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokens(tmp_path_factory.mktemp("tokens") / "tokens")
