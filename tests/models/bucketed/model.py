"""A gated ragged model: echoes TOKENS (cut back per request by the server) and
returns each row's real length from MASK. Logs every batch's rows, padded
width and real tokens, so a test can measure padding efficiency."""

import runpy
from pathlib import Path

import torch

NAME = globals().get("MODEL_NAME") or Path(__file__).parent.name
checkpoint = runpy.run_path(
    str(Path(__file__).parent.parent / "gated" / "model.py"), init_globals={"MODEL_NAME": NAME}
)["checkpoint"]


def load(device: torch.device):
    def run(tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        checkpoint({"rows": tokens.shape[0], "width": tokens.shape[1], "real": int(mask.sum())})
        return {"ECHO": tokens, "LENGTH": mask.sum(dim=1, keepdim=True)}

    return run
