"""A frontend that falls behind its worker (its event loop stalled; here SIGSTOP)
loses no step-wise output and no worker: the worker keeps the replies ZeroMQ's
queues cannot take, in order, and steps nothing until the frontend has taken them
(worker/frontend_link.py). It dropped them: the sequence's final STEP was lost, its
caller waited for execution_timeout_s, and the healthy worker was killed."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from batchd.client import Client
from batchd.worker.frontend_link import RETRY_S
from tests.conftest import scrape, stepwise_toml, total
from tests.servers import ServerProcess, wait_for

COUNT_TOML = stepwise_toml(2, 10_000_000)
COUNT_PY = """
import torch
class Count:  # N quick steps with no output (a STEP message each), then the count
    def start(self, requests):
        return [{"n": int(r["N"][0]), "k": 0} for r in requests]
    def step(self, states):
        out = []
        for s in states:
            s["k"] += 1
            done = s["k"] >= s["n"]
            out.append(({"OUT": torch.tensor([s["k"]])} if done else None, done))
        return out
def load(device):
    return Count()
"""
STEPS = 60_000
FLOOD_PY = """
import torch
class Flood:  # N quick steps, an output each
    def start(self, requests):
        return [{"n": int(r["N"][0]), "k": 0} for r in requests]
    def step(self, states):
        for s in states:
            s["k"] += 1
        return [({"OUT": torch.tensor([s["k"]])}, s["k"] >= s["n"]) for s in states]
def load(device):
    return Flood()
"""


def test_a_caller_reading_on_gets_every_output_of_a_model_faster_than_it(tmp_path: Path) -> None:
    """The frontend takes the worker's outputs in bursts, faster than it writes them to
    the caller: one reading on was cut at 256 outputs behind (after 614 to 1,700 of
    them in the reviewer's runs); the count allows a burst now, the bytes bound memory."""
    (tmp_path / "repo" / "flood").mkdir(parents=True)
    (tmp_path / "repo" / "flood" / "model.toml").write_text(COUNT_TOML)
    (tmp_path / "repo" / "flood" / "model.py").write_text(FLOOD_PY)
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(server.url) as c:
            n = {"N": np.array([3000], np.int64)}
            got = [int(o["OUT"][0]) for o in c.stream("flood", n, 60)]
        assert got == list(range(1, 3001))
    finally:
        assert server.stop() == 0, server.log()


def test_a_stalled_frontend_loses_no_step_and_no_worker(tmp_path: Path) -> None:
    (tmp_path / "repo" / "count").mkdir(parents=True)
    (tmp_path / "repo" / "count" / "model.toml").write_text(COUNT_TOML)
    (tmp_path / "repo" / "count" / "model.py").write_text(COUNT_PY)
    server = ServerProcess(tmp_path / "repo", log_dir=tmp_path).start()
    try:
        with Client(server.url) as c, ThreadPoolExecutor(1) as pool:
            n = {"N": np.array([STEPS], np.int64)}
            outcome = pool.submit(lambda: [int(o["OUT"][0]) for o in c.stream("count", n, 40)])
            wait_for(lambda: total(scrape(server), "batchd_sequences_active") == 1, 30, "a step")
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)  # the frontend's loop stalls ...
            time.sleep(RETRY_S + 1)  # ... past the worker's patience (the fault, not a check)
            server.proc.send_signal(signal.SIGCONT)
            assert outcome.result(60) == [STEPS]
        log = server.log()
        assert "lost" not in log and "dropped" not in log, log
    finally:
        assert server.stop() == 0, server.log()
