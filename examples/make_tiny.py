"""Write examples/models/tiny/model.pt: Linear(16,16), seed 0, as TorchScript.

    python examples/make_tiny.py
The committed model.pt is this script's output (it shows the TorchScript path).
"""

from pathlib import Path

import torch

torch.manual_seed(0)
model = torch.jit.script(torch.nn.Linear(16, 16).eval())
out = Path(__file__).parent / "models" / "tiny" / "model.pt"
model.save(str(out))
print(f"wrote {out}")
