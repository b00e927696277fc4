"""Write examples/models/tiny/model.pt2: Linear(16,16), seed 0, as a torch.export program.

    python examples/make_tiny.py
The committed model.pt2 is this script's output; it shows the torch.export
path (batch dim dynamic, 1..32). TorchScript model.pt files load too.
"""

from pathlib import Path

import torch

torch.manual_seed(0)
model = torch.nn.Linear(16, 16).eval()
batch = torch.export.Dim("batch", min=1, max=32)
program = torch.export.export(model, (torch.zeros(2, 16),), dynamic_shapes={"input": {0: batch}})
out = Path(__file__).parent / "models" / "tiny" / "model.pt2"
torch.export.save(program, str(out))
print(f"wrote {out}")
