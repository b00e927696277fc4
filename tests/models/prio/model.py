"""The `gated` fake model again, with two priority levels (see prio/model.toml)."""

import runpy
from pathlib import Path

load = runpy.run_path(
    str(Path(__file__).parent.parent / "gated" / "model.py"), init_globals={"MODEL_NAME": "prio"}
)["load"]
