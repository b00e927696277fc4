"""Linear(512,2048)-ReLU-Linear(2048,2048)-ReLU-Linear(2048,512), weights from seed 0.

Built in code so the repository ships no 25 MB weight file; `build()` is what a
test compares the served numbers against.
"""

import torch


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 512),
    ).eval()


def load(device: torch.device) -> torch.nn.Module:
    return build().to(device)
