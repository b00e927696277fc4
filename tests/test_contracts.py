"""The contracts in batchd.protos: stubs, field numbers, tensor codecs, the
model repository format; and the import boundaries between the packages."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPES, datatype_of
from batchd.protos.model_config import ConfigError, load_model_config
from batchd.protos.repository import load_repository
from batchd.protos.tensors import (
    bounded_count,
    bytes_element_offsets,
    bytes_row_offsets,
    contents_to_raw,
    deserialize_bytes,
    from_raw,
    serialize_bytes,
    to_raw,
)
from tests.conftest import SAMPLES
from tests.servers import EXAMPLES, ROOT, TEST_MODELS


def test_generated_stubs_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [
        (pb.ModelInferRequest, "raw_input_contents", 7),
        (pb.ModelInferResponse, "raw_output_contents", 6),
        (pb.ModelInferRequest, "parameters", 4),
        (pb.InferTensorContents, "bytes_contents", 8),
        (pb.ModelConfig, "dynamic_batching", 11),
        (pb.ModelConfig, "model_transaction_policy", 19),
        (pb.ModelConfig, "response_cache", 24),
        (pb.ModelInput, "allow_ragged_batch", 7),
        (pb.ModelStatistics, "batch_stats", 7),
        (pb.RepositoryModelLoadRequest, "parameters", 3),
    ],
)
def test_wire_field_numbers_match_the_protocol(message, field: str, number: int) -> None:  # type: ignore[no-untyped-def]
    assert message.DESCRIPTOR.fields_by_name[field].number == number


def test_service_and_package_names() -> None:
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert {m.name for m in service.methods} >= {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    }
    assert pb.TYPE_BF16 == 14 and pb.TYPE_STRING == 13


def test_batchd_and_tritonclient_import_side_by_side() -> None:
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import tritonclient.grpc\n"
        "from batchd.protos import inference_pb2\n"
        "from batchd.client import Client\n"
        "print(inference_pb2.ModelInferRequest(model_name='x').model_name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "x", out.stderr


def test_frontend_and_client_never_import_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        "import batchd.server.app, batchd.server.cli, batchd.client\n"
        "assert sys.modules['torch'] is None\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


# ---- tensor codecs ----


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_raw_round_trip(datatype: str) -> None:
    arr = SAMPLES[datatype]
    name, shape, raw = to_raw(arr, "BF16" if datatype == "BF16" else None)
    assert name == datatype and shape == [1, 2]
    back = from_raw(name, shape, raw)
    assert back.tolist() == arr.tolist()
    if not DATATYPES[datatype].is_bytes:
        assert len(raw) == 2 * DATATYPES[datatype].itemsize


@pytest.mark.parametrize("datatype", sorted(d for d in SAMPLES if not DATATYPES[d].is_bytes))
def test_a_big_endian_array_travels_as_its_values(datatype: str) -> None:
    """Raw tensors are little-endian; a `>u2` array for BF16 was refused as not uint16."""
    arr = SAMPLES[datatype]
    swapped = arr.astype(arr.dtype.newbyteorder(">"))
    assert to_raw(swapped, "BF16" if datatype == "BF16" else None) == to_raw(arr, datatype)


@pytest.mark.parametrize("datatype", sorted(d for d in SAMPLES if DATATYPES[d].contents_field))
def test_typed_contents_give_the_same_bytes_as_raw(datatype: str) -> None:
    arr = SAMPLES[datatype]
    assert contents_to_raw(datatype, arr.ravel().tolist()) == to_raw(arr)[2]


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@pytest.mark.parametrize("shape", [[2, 0], [0, 3], [5, 0, 7]])
def test_a_tensor_with_a_0_in_its_shape_decodes_from_0_bytes(
    datatype: str, shape: list[int]
) -> None:
    """[2, 0] counted as 1 element once its product passed the 0 bytes' limit (the 0
    came after): a legal empty output failed in the client, a BYTES input in the worker."""
    empty = np.empty(shape, SAMPLES[datatype].dtype)
    name, got_shape, raw = to_raw(empty, "BF16" if datatype == "BF16" else None)
    assert (got_shape, raw) == (shape, b"")
    assert from_raw(name, shape, b"").shape == tuple(shape)
    assert bounded_count([2**62, 2**62, 0], 10) == 0 and bounded_count([3, 4], 12) == 12


def test_bytes_layout_is_length_prefixed_little_endian() -> None:
    raw = serialize_bytes(["ab", b"c"])
    assert raw == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    assert bytes_element_offsets(raw, 2).tolist() == [0, 6, 11]
    assert deserialize_bytes(raw, [2]).tolist() == [b"ab", b"c"]


def test_decoding_many_bytes_elements_holds_a_slice_of_their_offsets_as_python_ints() -> None:
    """All the offsets became Python ints at once: 14x the reply's size for a reply of
    empty elements, beside the array the caller gets (a 57 MB reply took 800 MB)."""
    count = 400_000
    raw = serialize_bytes([b""] * (count - 2) + [b"x", b"yz"])
    tracemalloc.start()
    try:
        got = deserialize_bytes(raw, [count // 2, 2])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.shape == (count // 2, 2) and got[-1].tolist() == [b"x", b"yz"]
    # the answer (8 bytes an element), the offsets and their making (16), the reply's
    # copy (4): 29 measured; with every offset a Python int at once, 56
    assert peak < 40 * count, peak


def test_bytes_row_offsets_mark_where_each_row_starts() -> None:
    raw = serialize_bytes([b"ab", b"c", b"", b"xyz"])
    assert bytes_row_offsets(raw, 2, 2).tolist() == [0, 11, 22]
    assert bytes_row_offsets(raw, 1, 4).tolist() == [0, 22]
    same_length = serialize_bytes([b"ab"] * 6)  # the numpy path
    assert bytes_row_offsets(same_length, 3, 2).tolist() == [0, 12, 24, 36]
    assert bytes_row_offsets(b"", 5, 0).tolist() == [0] * 6


@pytest.mark.parametrize(
    ("raw", "count", "message"),
    [
        (b"\x05\x00\x00\x00abc", 1, "its prefix says 5 bytes, 3 remain"),
        (b"\x01\x00\x00\x00a\x01\x00", 2, "element 1 is truncated: a 4-byte length prefix"),
        (b"\x00\x00\x00\x00" * 3, 2, "2 BYTES elements declared, the buffer holds more"),
        (b"\x00\x00\x00\x00" * 3, 4, "4 BYTES elements declared, the buffer holds only 3"),
        (b"\x01\x00\x00\x00a\x00\x00\x00\x00\x09", 2, "holds more (1 bytes after them)"),
        # a prefix saying too much is found at the next element: the one it names was
        # that next one ("element 1 is truncated: ... -98 remain")
        (b"\x64\x00\x00\x00ab", 2, "element 0 is truncated: its prefix says 100 bytes, 2"),
    ],
)
def test_bad_bytes_framing_is_named(raw: bytes, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        bytes_element_offsets(raw, count)


def test_a_bytes_walk_stops_at_the_declared_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer packed with a million elements for a shape that declares two is
    refused after reading a few prefixes: the walk is bounded by the header's
    count, not by what the sender packed."""
    reads = []

    class CountingPrefix:
        def unpack_from(self, buf: bytes, pos: int) -> tuple[int]:
            reads.append(pos)
            return LEN.unpack_from(buf, pos)

    import batchd.protos.tensors as tensors

    raw = serialize_bytes([b"a", b"bc"]) + b"\x00\x00\x00\x00" * 1_000_000
    LEN = tensors._LEN
    monkeypatch.setattr(tensors, "_LEN", CountingPrefix())
    with pytest.raises(ValueError, match="2 BYTES elements declared, the buffer holds more"):
        bytes_row_offsets(raw, 2, 1)
    assert len(reads) <= 4


def test_datatype_of_numpy_arrays() -> None:
    assert datatype_of(np.zeros(1, np.float32)) == "FP32"
    assert datatype_of(np.array(["a"])) == "BYTES"
    with pytest.raises(ValueError, match="complex128"):
        datatype_of(np.zeros(1, np.complex128))


# ---- the model repository ----


def test_example_and_test_repositories_load() -> None:
    examples = load_repository(EXAMPLES)
    assert sorted(examples) == ["decoder", "embed", "mlp", "textpool", "textpool_packed", "tiny"]
    assert examples["textpool_packed"].packed and not examples["textpool"].packed
    assert examples["decoder"].generate is not None and examples["decoder"].generate.max_active == 8
    mlp = examples["mlp"]
    assert mlp.max_batch_size == 32 and mlp.platform == "python"
    assert mlp.inputs[0].shape == (512,) and examples["tiny"].platform == "torch_export"
    assert "echo" in load_repository(TEST_MODELS)


def write_model(tmp_path: Path, toml: str, artifact: str = "model.py") -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "model.toml").write_text(toml)
    if artifact:
        (d / artifact).write_text("")
    return d


GOOD = """max_batch_size = 4
[[input]]
name = "X"
datatype = "FP32"
shape = [2]
[[output]]
name = "Y"
datatype = "FP32"
shape = [2]
"""

RAGGED = """max_batch_size = 4
[[input]]
name = "T"
datatype = "INT64"
shape = [-1]
ragged = true
max_length = 512
[[output]]
name = "Y"
datatype = "FP32"
shape = [2]
"""


def test_a_ragged_input_may_declare_its_longest_row(tmp_path: Path) -> None:
    cfg = load_model_config(write_model(tmp_path, RAGGED))
    assert cfg.inputs[0].max_length == 512
    assert cfg.length_limit(cfg.inputs[0]) == (512, "[[input]] 'T' max_length")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (GOOD.replace('"FP32"', '"FP33"', 1), "[[input]] 'X' key 'datatype': expected one of"),
        (GOOD.replace("[2]", "[0]", 1), "[[input]] 'X' key 'shape': expected a list of positive"),
        (GOOD.replace("max_batch_size = 4", "max_batch_size = -1"), "key 'max_batch_size'"),
        (GOOD.replace("max_batch_size = 4", 'max_batch_size = "4"'), "expected int, got '4'"),
        (GOOD + "[batching]\nmax_queue_size = 0\n", "[batching] key 'max_queue_size'"),
        (GOOD + "[batching]\nmax_delay = 1\n", "[batching] unknown key(s): max_delay"),
        (GOOD + "colour = 1\n", "unknown key(s): colour"),
        (GOOD + GOOD.split("shape = [2]\n", 1)[1], "[[output]] names must be unique"),
        (GOOD.split("[[output]]")[0], "key 'output': expected at least one [[output]]"),
        ("max_batch_size = [", "not valid TOML"),
        (
            GOOD.replace("shape = [2]\n", "shape = [2]\nmax_length = 9\n", 1),
            "unknown key(s): max_length",
        ),
        (
            RAGGED.replace("max_length = 512", "max_length = -1"),
            "key 'max_length': expected an integer",
        ),
    ],
)
def test_config_errors_name_the_file_and_the_key(tmp_path: Path, toml: str, message: str) -> None:
    d = write_model(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_model_config(d)
    assert str(d / "model.toml") in str(info.value) or str(d) in str(info.value)
    assert message in str(info.value)


def test_config_needs_exactly_one_artifact(tmp_path: Path) -> None:
    d = write_model(tmp_path, GOOD, artifact="")
    with pytest.raises(ConfigError, match=r"expected exactly one of model\.py, model\.pt"):
        load_model_config(d)


def test_config_defaults(tmp_path: Path) -> None:
    cfg = load_model_config(write_model(tmp_path, GOOD))
    assert cfg.name == "m" and cfg.batching.max_queue_size == 1024
    assert cfg.instances.count == 1 and math.isclose(cfg.instances.execution_timeout_s, 60.0)
