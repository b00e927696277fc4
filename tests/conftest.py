from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.certs import make_certs, write_tokens
from tests.servers import EXAMPLES, TEST_MODELS, ServerProcess


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
