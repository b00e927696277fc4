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
from tests.conftest import scrape, total
from tests.servers import ServerProcess, wait_for

COUNT_TOML = """
[[input]]
name = "N"
datatype = "INT64"
shape = [1]
[[output]]
name = "OUT"
datatype = "INT64"
shape = [1]
[generate]
max_active = 2
max_steps = 10000000
"""
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
