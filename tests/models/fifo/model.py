"""The `bucketed` test model again, batching FIFO (see fifo/model.toml)."""

import runpy
from pathlib import Path

load = runpy.run_path(
    str(Path(__file__).parent.parent / "bucketed" / "model.py"), init_globals={"MODEL_NAME": "fifo"}
)["load"]
