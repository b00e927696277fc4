"""A fake model for tests: Y = 2 * X, with a gate and a call log.

While $BATCHD_TEST_DIR/gate-closed exists, a batch waits before it runs, so a
test can hold the worker busy and build a backlog deterministically. Every
batch appends {"model", "values"} to $BATCHD_TEST_DIR/calls.log so a test
can see exactly which rows reached the model, batched how; entered.log gets
the same line when a batch starts, before the gate. A negative value
makes the batch raise.
"""

import json
import os
import time
from pathlib import Path

import torch

NAME = globals().get("MODEL_NAME") or Path(__file__).parent.name


def load(device: torch.device):
    state = Path(os.environ["BATCHD_TEST_DIR"])

    def run(x: torch.Tensor) -> torch.Tensor:
        with open(state / "entered.log", "a") as log:
            log.write(json.dumps({"model": NAME, "values": x[:, 0].tolist()}) + "\n")
        while (state / "gate-closed").exists():
            time.sleep(0.002)
        values = x[:, 0].tolist()
        with open(state / "calls.log", "a") as log:
            log.write(json.dumps({"model": NAME, "values": values}) + "\n")
        if any(v < 0 for v in values):
            raise ValueError(f"negative input {min(values)}")
        return x * 2

    return run
