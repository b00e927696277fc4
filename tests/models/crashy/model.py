"""A fake model that misbehaves on purpose: Y = 2 * X after 20 ms, except
X == 666 kills its worker process (SIGKILL) and X == 777 hangs forever."""

import os
import signal
import time

import torch


def load(device: torch.device):
    def run(x: torch.Tensor) -> torch.Tensor:
        values = x[:, 0].tolist()
        if 666.0 in values:
            os.kill(os.getpid(), signal.SIGKILL)
        while 777.0 in values:
            time.sleep(1)
        time.sleep(0.02)
        return x * 2

    return run
