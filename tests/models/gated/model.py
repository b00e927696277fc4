"""A fake model for tests: Y = 2 * X, with a gate and a call log.

While $BATCHD_TEST_DIR/gate-closed exists, a batch waits before it runs, so a
test can hold the worker busy and build a backlog deterministically. Every
batch appends a JSON line to $BATCHD_TEST_DIR/calls.log so a test can see
exactly which rows reached the model, batched how; entered.log gets the same
line when a batch starts, before the gate. A negative value makes the batch
raise; one of 1e6 or more makes it refuse its inputs (InputRefused). While
$BATCHD_TEST_DIR/hold-<V> exists, a batch holding the value V waits (after the
gate). Other test models reuse `checkpoint` through runpy.
"""

import atexit
import json
import os
import time
from pathlib import Path

import torch

from batchd.worker import InputRefused

NAME = globals().get("MODEL_NAME") or Path(__file__).parent.name
# its worker's atexit handlers ran as it left (even past a hung batch: test_failures.py)
atexit.register(lambda: (Path(os.environ["BATCHD_TEST_DIR"]) / f"atexit-{os.getpid()}").touch())


def checkpoint(record: dict) -> None:
    """Log that a batch started, wait while the gate is closed, log that it ran."""
    state = Path(os.environ["BATCHD_TEST_DIR"])
    line = json.dumps({"model": NAME, **record}) + "\n"
    with open(state / "entered.log", "a") as log:
        log.write(line)
    while (state / "gate-closed").exists():
        time.sleep(0.002)
    with open(state / "calls.log", "a") as log:
        log.write(line)


def load(device: torch.device):
    def run(x: torch.Tensor) -> torch.Tensor:
        values = x[:, 0].tolist()
        checkpoint({"values": values})
        state = Path(os.environ["BATCHD_TEST_DIR"])
        while any((state / f"hold-{int(v)}").exists() for v in values):
            time.sleep(0.002)
        if any(v < 0 for v in values):
            raise ValueError(f"negative input {min(values)}")
        if max(values) >= 1e6:
            raise InputRefused(f"X must be below 1e6, got {max(values)}")
        return x * 2

    return run
