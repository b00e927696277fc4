"""A step-wise fake model for tests (model.toml [generate]).

Sequence ID yields ID * 1000 + k at step k, and ends at step STEPS. Every step
goes through the gated model's `checkpoint`, so while the gate is closed a step
waits, and calls.log gets one line per step with the IDs it stepped, in order:
a test sees exactly which sequences stepped together. A negative ID fails:
-1 in start(), -2 in its second step; start() refuses -3 (InputRefused).
release() is logged too ("released").
While $BATCHD_TEST_DIR/hold-<ID> exists, sequence ID stops after two outputs:
its worker's step waits there (so does every sequence beside it).
"""

import os
import runpy
import time
from pathlib import Path

import torch

from batchd.worker import InputRefused

gated = runpy.run_path(
    str(Path(__file__).parent.parent / "gated" / "model.py"), {"MODEL_NAME": "stepper"}
)
checkpoint = gated["checkpoint"]


class Stepper:
    def start(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, int]]:
        states = []
        for r in requests:
            seq, steps = int(r["ID"][0]), int(r["STEPS"][0])
            if seq == -1:
                raise ValueError("sequence -1 refuses to start")
            if seq == -3:
                raise InputRefused("ID -3 is not a sequence this model runs")
            states.append({"id": seq, "steps": steps, "k": 0})
        checkpoint({"started": [s["id"] for s in states], "pid": os.getpid()})
        return states

    def step(self, states: list[dict[str, int]]) -> list[tuple[dict[str, torch.Tensor], bool]]:
        checkpoint({"stepped": [s["id"] for s in states], "pid": os.getpid()})
        state_dir = Path(os.environ["BATCHD_TEST_DIR"])
        while any(s["k"] >= 2 and (state_dir / f"hold-{s['id']}").exists() for s in states):
            time.sleep(0.002)
        out = []
        for s in states:
            s["k"] += 1
            if s["id"] == -2 and s["k"] == 2:
                raise ValueError("sequence -2 fails at its second step")
            value = torch.tensor([s["id"] * 1000 + s["k"]], dtype=torch.int64)
            out.append(({"VALUE": value}, s["k"] >= s["steps"]))
        return out

    def release(self, state: dict[str, int]) -> None:
        checkpoint({"released": [state["id"]], "pid": os.getpid()})


def load(device: torch.device) -> Stepper:
    return Stepper()
