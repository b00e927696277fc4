"""`batchd bench` (client/bench.py): every datatype, and the server's error messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd.client import bench
from batchd.client.bench import declared_datatypes, make_inputs
from batchd.client.codec import build_request
from batchd.protos.datatypes import DATATYPES
from tests.servers import ServerProcess


def run_bench(url: str, model: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    argv = ["--url", url, "--model", model, "--concurrency", "1", "--duration", "0.5"]
    argv += ["--warmup", "0", "--processes", "1", "--json", str(out), *extra]
    code = bench.main(argv)
    return code, json.loads(out.read_text())


def test_random_inputs_travel_as_each_declared_datatype() -> None:
    meta = {"inputs": [{"name": f"IN_{d}", "datatype": d, "shape": [-1, 3]} for d in DATATYPES]}
    msg = build_request("m", make_inputs(meta, 2, 4, {}), datatypes=declared_datatypes(meta))
    assert [(t.name, t.datatype, list(t.shape)) for t in msg.inputs] == [
        (f"IN_{d}", d, [2, 3]) for d in DATATYPES
    ]


def test_bench_drives_a_model_with_every_datatype(
    test_server: ServerProcess, tmp_path: Path
) -> None:
    """The echo model has one input of each datatype the README lists."""
    code, result = run_bench(test_server.url, "echo", tmp_path)
    (level,) = result["levels"]
    assert (code, level["errors"], level["error_messages"]) == (0, {}, {})
    assert level["ok"] > 0


def test_bench_shows_the_servers_first_message_per_error_code(
    test_server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An FP64 file for `limited`'s FP32 input: every request is refused, and the
    table and the JSON say why, not only how often."""
    wrong = tmp_path / "x.npy"
    np.save(wrong, np.zeros((1, 1), np.float64))
    code, result = run_bench(test_server.url, "limited", tmp_path, "--input", f"X={wrong}")
    (level,) = result["levels"]
    assert code == 1 and level["ok"] == 0 and level["errors"]["INVALID_ARGUMENT"] > 0
    message = level["error_messages"]["INVALID_ARGUMENT"]
    assert "FP32" in message and "FP64" in message
    assert f"INVALID_ARGUMENT: {message}" in capsys.readouterr().out
