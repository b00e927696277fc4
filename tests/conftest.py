from __future__ import annotations

import asyncio
import heapq
import json
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from batchd.protos.model_config import (
    BatchingConfig,
    BatchInputSpec,
    GenerateConfig,
    ModelConfig,
    TensorSpec,
)
from batchd.server.batching.decision import Capacity
from batchd.server.request import Request, Tensor
from tests.certs import make_certs, write_tokens
from tests.servers import EXAMPLES, TEST_MODELS, ServerProcess

T = TypeVar("T")

# ---- helpers for unit tests of the frontend's pieces ----


def model(
    max_batch_size: int = 4,
    queue: int = 8,
    delay_us: int | None = 1000,
    shape: tuple[int, ...] = (2,),
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


def stepwise_model(
    name: str = "fake", max_active: int = 2, max_steps: int = 10, admission: str = "continuous"
) -> ModelConfig:
    """A step-wise model config: input N INT64 [1] -> output OUT INT64 [1] per step."""
    return ModelConfig(
        name=name,
        directory=Path("."),
        artifact=Path("model.py"),
        platform="python",
        max_batch_size=0,
        inputs=(TensorSpec("N", "INT64", (1,)),),
        outputs=(TensorSpec("OUT", "INT64", (1,)),),
        generate=GenerateConfig(max_active, max_steps, admission),
    )


def stepwise_toml(max_active: int, max_steps: int) -> str:
    """stepwise_model's model.toml: input N INT64 [1] -> output OUT INT64 [1] per step."""
    return (
        '[[input]]\nname = "N"\ndatatype = "INT64"\nshape = [1]\n'
        '[[output]]\nname = "OUT"\ndatatype = "INT64"\nshape = [1]\n'
        f"[generate]\nmax_active = {max_active}\nmax_steps = {max_steps}\n"
    )


def request(cfg: ModelConfig, rows: int = 1, width: int = 2, deadline: float = math.inf) -> Request:
    data = b"\0" * (rows * width * 4)
    return Request(cfg, "", [Tensor("X", "FP32", (rows, width), data)], ("Y",), rows, deadline)


class FakeDispatch:
    """The scheduler's view of the core: capacity the test sets, the batches it sent."""

    def __init__(self, idle: int = 1, credits: int = 2) -> None:
        self.idle, self.credits = idle, credits
        self.settled = True  # False: the idle workers load a model, or run sequences
        self.loading = False  # ... and one of them only loads (Capacity.loading)
        self.out = 0  # online requests on workers, as the test says
        self.unheld: set[str] = set()  # model versions no live worker holds
        self.paused: dict[str, float] = {}  # model version -> till when its job lane waits
        self.sent: list[list[Request]] = []

    def capacity(self, model: ModelConfig) -> Capacity:
        return Capacity(self.idle > 0, self.credits > 0, self.settled, self.loading)

    def requests_out(self, key: str) -> int:
        return self.out

    def held(self, key: str) -> bool:
        return key not in self.unheld

    def jobs_paused(self, key: str) -> float:
        return self.paused.get(key, 0.0)

    def send(self, model: ModelConfig, requests: list[Request]) -> None:
        self.sent.append(requests)
        self.credits -= 1
        self.idle = max(0, self.idle - 1)


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


@pytest.fixture(scope="session", autouse=True)
def processes_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The processes tests start keep their temporary files under pytest's own folder
    (pruned to the last 3 runs): a server a test kills with SIGKILL leaves its private
    folder behind, and every run left dozens in /tmp."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path := tmp_path_factory.mktemp("tmp", numbered=False))
    yield path
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before


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


# ==== shared helpers of several test files ====
# Test files import these from here, never from each other.

import urllib.request  # noqa: E402
from collections.abc import Coroutine  # noqa: E402

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from batchd.client import ServerBusy  # noqa: E402

# ---- a full queue (test_policies, test_failures) ----


async def fill(make_call: Callable[[int], asyncio.Future[object]]) -> list[asyncio.Future[object]]:
    """Start calls until one is turned away: then the queue is exactly full."""
    calls: list[asyncio.Future[object]] = []
    while not any(c.done() and isinstance(c.result(), ServerBusy) for c in calls):
        calls.append(make_call(len(calls)))
        await asyncio.wait(calls, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
    return calls


async def outcome(call: Coroutine[Any, Any, T]) -> T | ServerBusy:
    """The call's result, or the ServerBusy it was turned away with."""
    try:
        return await call
    except ServerBusy as e:
        return e


# ---- one sample array of every datatype (test_contracts, test_processes) ----

SAMPLES = {
    "BOOL": np.array([[True, False]]),
    "UINT8": np.array([[0, 255]], np.uint8),
    "UINT16": np.array([[1, 65535]], np.uint16),
    "UINT32": np.array([[1, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[1, 2**64 - 1]], np.uint64),
    "INT8": np.array([[-128, 127]], np.int8),
    "INT16": np.array([[-1, 2]], np.int16),
    "INT32": np.array([[-(2**31), 7]], np.int32),
    "INT64": np.array([[-(2**63), 7]], np.int64),
    "FP16": np.array([[0.5, -2.0]], np.float16),
    "FP32": np.array([[0.25, 1e30]], np.float32),
    "FP64": np.array([[1e-300, -3.5]], np.float64),
    "BF16": np.array([[0x3F80, 0xC000]], np.uint16),  # 1.0, -2.0
    "BYTES": np.array([[b"", b"\x00\xffok"]], dtype=object),
}

# ---- a `scaled` model written into a test's own repository (test_control,
# test_failures, test_processes) ----

MODEL_TOML = """
max_batch_size = 8

[[input]]
name = "X"
datatype = "FP32"
shape = [1]

[[output]]
name = "Y"
datatype = "FP32"
shape = [1]

[batching]
max_queue_delay_us = 2000
"""

# Y = X * the number in scale.txt, read when the module loads, so each version
# answers differently; a negative scale refuses to load. Gates are files in the
# model's folder: while `.hold-load` exists load() waits, and while `hold-<scale>`
# exists (see batch_gate) a batch of that version waits. The logs beside it:
# loads.log (each load() call), entered.log (a batch started, before its gate),
# calls.log (a batch ran); each line names the scale and the worker's pid.
MODEL_PY = r"""
import json
import os
import time
from pathlib import Path

HERE = Path(__file__).parent
SCALE = float((HERE / "scale.txt").read_text())


def note(log, **record):
    with open(HERE / log, "a") as f:
        f.write(json.dumps({"scale": SCALE, "pid": os.getpid(), **record}) + "\n")


def hold(gate):
    while (HERE / gate).exists():
        time.sleep(0.002)


def load(device):
    note("loads.log")
    hold(".hold-load")
    if SCALE < 0:
        raise RuntimeError(f"scale {SCALE} refuses to load")

    def run(x):
        values = x[:, 0].tolist()
        note("entered.log", values=values)
        hold(f".hold-{SCALE}")
        note("calls.log", values=values)
        return x * SCALE

    return run
"""


def make_model(repo: Path, name: str, scale: float, toml: str = MODEL_TOML) -> Path:
    d = repo / name
    d.mkdir(parents=True)
    (d / "model.toml").write_text(toml)
    (d / "model.py").write_text(MODEL_PY)
    (d / "scale.txt").write_text(str(scale))
    return d


def batch_gate(model_dir: Path, scale: float) -> Path:
    """The file that holds the batches of the version with this scale while it exists
    (hidden, as load_gate's: a file written there meanwhile fails a load)."""
    return model_dir / f".hold-{float(scale)}"


def load_gate(model_dir: Path) -> Path:
    """The file that holds every load() of the model while it exists (hidden: not one
    of the files a version is loaded from, repository.files_of)."""
    return model_dir / ".hold-load"


def model_log(model_dir: Path, log: str) -> list[dict[str, Any]]:
    """The lines of loads.log, entered.log or calls.log, oldest first."""
    path = model_dir / log
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def reset_model_logs(model_dir: Path) -> None:
    for log in ("loads.log", "entered.log", "calls.log"):
        (model_dir / log).unlink(missing_ok=True)


# ---- asking a server's /metrics (test_operations, test_failures, test_processes) ----

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: ServerProcess) -> Samples:
    with urllib.request.urlopen(server.metrics_url(), timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def workers_up(server: ServerProcess) -> int:
    """Workers registered with the server now (batchd_worker_up)."""
    return sum(v == 1.0 for (n, _), v in scrape(server).items() if n == "batchd_worker_up")


def worker_restarts(server: ServerProcess) -> float:
    """Local worker restarts so far, over all slots (batchd_worker_restarts_total)."""
    return total(scrape(server), "batchd_worker_restarts_total")
