"""A gated packed model for tests: Y = 2 X (packed like X), and per row what the
batch inputs say of it: [LENGTHS[i], OFFSETS[i+1] - OFFSETS[i], elements whose
SEGMENTS is i, 1 if X viewed as a jagged nested tensor shares X's storage]. Logs
each batch's lengths, offsets and segment ids (gated/model.py's checkpoint)."""

import runpy
from pathlib import Path

import torch

NAME = globals().get("MODEL_NAME") or Path(__file__).parent.name
checkpoint = runpy.run_path(
    str(Path(__file__).parent.parent / "gated" / "model.py"), init_globals={"MODEL_NAME": NAME}
)["checkpoint"]


def load(device: torch.device):
    def run(x, offsets, lengths, segments):  # type: ignore[no-untyped-def]
        checkpoint({"lengths": lengths.tolist(), "offsets": offsets.tolist(),
                    "segments": segments.tolist(), "shape": list(x.shape)})  # fmt: skip
        rows = len(lengths)
        nested = torch.nested.nested_tensor_from_jagged(x, offsets)
        shared = int(nested.values().data_ptr() == x.data_ptr())
        counted = torch.bincount(segments, minlength=rows)
        flag = torch.full((rows,), shared, dtype=torch.int64, device=x.device)
        seen = torch.stack([lengths, offsets.diff(), counted, flag], 1)
        return {"Y": x * 2, "SEEN": seen}

    return run
