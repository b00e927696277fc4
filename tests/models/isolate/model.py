"""The `gated` fake model again, behind a queue of 4 that never stages (see isolate/model.toml)."""

import runpy
from pathlib import Path

load = runpy.run_path(
    str(Path(__file__).parent.parent / "gated" / "model.py"), init_globals={"MODEL_NAME": "isolate"}
)["load"]
