"""Packed ragged inputs (`packed = true`): a batch's rows concatenated with no
padding, the offsets, lengths and segment ids that find them, packed outputs cut
back per request, and a token budget that counts real elements.

The real-server tests use the gated packed test model (tests/models/packed): the
worker is held on a first batch while the next requests queue one by one, so
which requests share a batch is decided by the policy alone, and read from the
model's own log of what it was given."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchd.client import AsyncClient, Client, InvalidInput
from batchd.protos import wire
from batchd.protos.model_config import ConfigError, ModelConfig, load_model_config
from batchd.server.batching.plan import plan_batch
from batchd.server.batching.split_join import join_inputs, split_outputs
from batchd.server.request import Request, Tensor
from batchd.worker.execute import BatchError, encode_output
from tests.conftest import Gate, scrape, value
from tests.servers import EXAMPLES, TEST_MODELS, ServerProcess, wait_for

PACKED = load_model_config(TEST_MODELS / "packed")  # X FP32 [-1, 2], packed, 12 tokens


def packed_request(cfg: ModelConfig, rows: int, length: int, start: float = 0.0) -> Request:
    x = (start + np.arange(rows * length * 2, dtype=np.float32)).reshape(rows, length, 2)
    return Request(cfg, "", [Tensor("X", "FP32", x.shape, x.tobytes())], ("Y", "SEEN"), rows, 1e9)


# ---- bad configurations, refused at load naming the key ----

RAGGED = """
max_batch_size = 8
[[input]]
name = "X"
datatype = "FP32"
shape = {shape}
ragged = true
{extra}
[[output]]
name = "Y"
datatype = "FP32"
shape = [1]
"""


@pytest.mark.parametrize(
    ("shape", "extra", "key", "says"),
    [
        ("[-1]", "packed = true\npad_value = 3", "pad_value", "not padded"),
        ("[-1]", "packed = true\npadding_side = 'left'", "padding_side", "not padded"),
        ("[-1, -1]", "packed = true", "ragged", "[-1] (packed: or [-1, d, ...])"),
        ("[-1, 4]", "", "ragged", "got [-1, 4] FP32"),
        (
            "[-1]",
            "packed = true\n[batching]\nbucket_by_length = true",
            "bucket_by_length",
            "bucketing saves nothing",
        ),
        (
            "[-1]",
            "packed = true\n[[batch_input]]\nname = 'M'\nkind = 'mask'\nsource = 'X'",
            "kind",
            "no padding to mask",
        ),
        (
            "[-1]",
            "[[batch_input]]\nname = 'O'\nkind = 'offsets'\nsource = 'X'",
            "kind",
            "'X' is padded",
        ),
        (
            "[-1]",
            "packed = true\n[[output]]\nname = 'T'\ndatatype = 'BYTES'\nshape = [-1]\n"
            "ragged_like = 'X'",
            "ragged_like",
            "numeric, got [-1] BYTES",
        ),
        (
            "[-1]",
            "packed = true\n[[input]]\nname = 'Z'\ndatatype = 'FP32'\nshape = [-1]\nragged = true",
            "packed",
            "all packed or all padded, and ['Z'] are padded",
        ),
    ],
)
def test_a_bad_packed_configuration_is_refused_naming_the_key(
    tmp_path: Path, shape: str, extra: str, key: str, says: str
) -> None:
    (tmp_path / "model.toml").write_text(RAGGED.format(shape=shape, extra=extra))
    (tmp_path / "model.py").write_text("def load(device): return None\n")
    with pytest.raises(ConfigError, match=rf"key '{key}'") as e:
        load_model_config(tmp_path)
    assert says in str(e.value)


@pytest.mark.parametrize(
    ("datatype", "pad", "says"),
    [
        ("UINT16", "-1", "UINT16 holds 0 to 65535, got -1"),
        ("INT32", "3e9", "INT32 holds -2147483648 to 2147483647, got 3000000000.0"),
        ("INT8", "1.5", "INT8 takes whole numbers, got 1.5"),
        ("FP16", "1e6", "FP16 cannot hold 1000000.0: past its largest number"),
        ("BF16", "-4e38", "BF16 cannot hold -4e+38"),
    ],
)
def test_a_pad_value_its_input_cannot_hold_is_refused_at_load(
    tmp_path: Path, datatype: str, pad: str, says: str
) -> None:
    """Before, it loaded (and `batchd worker --check` said ok); the first batch to pad
    raised OverflowError in the frontend."""
    text = RAGGED.format(shape="[-1]", extra=f"pad_value = {pad}")
    (tmp_path / "model.toml").write_text(text.replace('"FP32"', f'"{datatype}"', 1))
    (tmp_path / "model.py").write_text("def load(device): return None\n")
    with pytest.raises(ConfigError, match=r"key 'pad_value': the pad must be a") as e:
        load_model_config(tmp_path)
    assert says in str(e.value)


def test_packed_needs_a_ragged_input(tmp_path: Path) -> None:
    text = RAGGED.format(shape="[1]", extra="").replace("ragged = true", "packed = true")
    (tmp_path / "model.toml").write_text(text)
    (tmp_path / "model.py").write_text("def load(device): return None\n")
    with pytest.raises(ConfigError, match=r"key 'packed': needs ragged = true"):
        load_model_config(tmp_path)


# ---- the pure pieces ----


def test_a_packed_batch_is_the_rows_concatenated_with_offsets_lengths_and_segment_ids() -> None:
    requests = [packed_request(PACKED, 2, 3), packed_request(PACKED, 1, 1, 100.0)]
    headers, frames = join_inputs(requests)
    kinds = {"INT64": "<i8", "FP32": "<f4"}
    by_name = {
        h.name: (list(h.shape), np.frombuffer(bytes(f), kinds[h.datatype]))
        for h, f in zip(headers, frames, strict=True)
    }
    shape, x = by_name["X"]
    assert shape == [7, 2]  # 2 rows of 3 and 1 of 1 elements, each [2]: no padding
    expected = np.concatenate([np.frombuffer(r.inputs[0].data, "<f4") for r in requests])
    np.testing.assert_array_equal(x, expected)
    assert by_name["OFFSETS"][0] == [4] and list(by_name["OFFSETS"][1]) == [0, 3, 6, 7]
    assert list(by_name["LENGTHS"][1]) == [3, 3, 1]
    assert list(by_name["SEGMENTS"][1]) == [0, 0, 0, 1, 1, 1, 2]


def test_packed_outputs_are_cut_back_per_request_by_the_offsets() -> None:
    requests = [packed_request(PACKED, 2, 3), packed_request(PACKED, 1, 1, 100.0)]
    y = np.arange(7 * 2, dtype=np.float32)
    seen = np.zeros((3, 4), np.int64)
    headers = [wire.Tensor(name="Y", datatype="FP32", shape=[7, 2]),
               wire.Tensor(name="SEEN", datatype="INT64", shape=[3, 4])]  # fmt: skip
    first, second = split_outputs(requests, headers, [y.tobytes(), seen.tobytes()])
    assert first[0].shape == (2, 3, 2) and second[0].shape == (1, 1, 2)
    np.testing.assert_array_equal(np.frombuffer(first[0].data, "<f4"), y[:12])
    np.testing.assert_array_equal(np.frombuffer(second[0].data, "<f4"), y[12:])
    assert first[1].shape == (2, 4) and second[1].shape == (1, 4)  # per row, as ever
    short = [wire.Tensor(name="Y", datatype="FP32", shape=[6, 2]), headers[1]]
    with pytest.raises(ValueError, match=r"packed output 'Y' has shape \[6, 2\], expected 7"):
        split_outputs(requests, short, [y[:12].tobytes(), seen.tobytes()])


def test_the_token_budget_counts_real_elements_for_packed_inputs(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Lengths 5, 1, 1, 3, 2: 12 real elements fit a budget of 12; padded to the
    longest, 5 rows x 5 would be 25, and the batch stops at two rows."""
    lengths = [5, 1, 1, 3, 2]
    padded = load_model_config(TEST_MODELS / "bucketed")  # max_batch_tokens 4096
    for cfg, packed, expected in ((PACKED, True, 5), (padded, False, 2)):
        queue = [packed_request(cfg, 1, n) if packed else _padded(cfg, n) for n in lengths]
        for i, r in enumerate(queue):
            r.arrival, r.future = float(i), loop.create_future()
        plan = plan_batch([queue], 10.0, 8, PACKED.batching, 64, packed)
        assert plan is not None and len(plan.requests) == expected, (packed, plan.rows)


def _padded(cfg: ModelConfig, length: int) -> Request:
    data = np.zeros(length, np.int64).tobytes()
    return Request(cfg, "", [Tensor("TOKENS", "INT64", (1, length), data)], ("ECHO",), 1, 1e9)


def test_the_worker_checks_a_packed_output_against_its_elements() -> None:
    spec = PACKED.output("Y")
    assert spec is not None
    import torch

    header, _ = encode_output(spec, torch.zeros(7, 2), True, rows=3, packed=7)
    assert list(header.shape) == [7, 2]
    with pytest.raises(BatchError, match=r"expected shape \[7, 2\] \(packed like 'X'\)"):
        encode_output(spec, torch.zeros(3, 2), True, rows=3, packed=7)


# ---- real servers ----


def _queued(server: ServerProcess) -> float:
    return value(scrape(server), "batchd_inference_pending_request_count", model="packed",
                 version="1")  # fmt: skip


def test_packed_batches_through_a_real_worker(unstaged_server: ServerProcess, gate: Gate) -> None:
    """The worker holds a first batch; then, one by one: B (3 rows of 4: 12 elements,
    a batch's whole budget), C (5 rows of 3: split into 4 rows and 1), D (1 row of 5),
    E (2 rows of 1). FIFO under a budget of 12 real elements: [B], [C's first 4 rows],
    then C's last row, D and E together (3 + 5 + 2 = 10; padded, 4 rows x 5 = 20)."""
    shapes = {"A": (1, 2), "B": (3, 4), "C": (5, 3), "D": (1, 5), "E": (2, 1)}
    inputs = {k: (np.arange(r * n * 2, dtype=np.float32) + 1000 * i).reshape(r, n, 2)
              for i, (k, (r, n)) in enumerate(shapes.items())}  # fmt: skip

    async def scenario() -> dict[str, dict[str, np.ndarray]]:
        async with AsyncClient(unstaged_server.url) as ac:
            gate.close()
            calls = {"A": asyncio.ensure_future(ac.infer("packed", {"X": inputs["A"]}, timeout=60))}
            await asyncio.to_thread(
                wait_for, lambda: len(gate.records("packed", log="entered")) == 1, 30, "batch A"
            )
            waiting = 0
            for k in "BCDE":
                calls[k] = asyncio.ensure_future(ac.infer("packed", {"X": inputs[k]}, timeout=60))
                waiting += 2 if k == "C" else 1  # C is queued as two chunks
                await asyncio.to_thread(
                    wait_for, lambda w=waiting: _queued(unstaged_server) == w, 30, f"{k} queued"
                )
            gate.open()
            return {k: await f for k, f in calls.items()}

    got = asyncio.run(scenario())
    for k, (rows, n) in shapes.items():
        np.testing.assert_array_equal(got[k]["Y"], 2 * inputs[k])  # cut back to its own span
        # every row's length as LENGTHS, OFFSETS and SEGMENTS told it; a jagged view, no copy
        assert got[k]["SEEN"].tolist() == [[n, n, n, 1]] * rows, k
    batches = gate.records("packed")
    assert [b["lengths"] for b in batches] == [
        [2], [4, 4, 4], [3, 3, 3, 3], [3, 5, 1, 1],
    ]  # fmt: skip
    for b in batches:
        assert b["offsets"] == [0, *np.cumsum(b["lengths"]).tolist()]
        assert b["segments"] == np.repeat(np.arange(len(b["lengths"])), b["lengths"]).tolist()
        assert b["shape"] == [sum(b["lengths"]), 2]
    samples = scrape(unstaged_server)
    assert value(samples, "batchd_padding_efficiency", model="packed", version="1") == 1.0


def test_a_row_of_length_zero_is_refused(unstaged_server: ServerProcess) -> None:
    with (
        Client(unstaged_server.url) as c,
        pytest.raises(
            InvalidInput,
            match="input 'X': a ragged input needs at least one element per row, got 0",
        ),
    ):
        c.infer("packed", {"X": np.zeros((1, 0, 2), np.float32)})


def test_textpool_packed_equals_textpool_batched_and_alone(example_server: ServerProcess) -> None:
    """Skewed lengths, sent together (batched, packed) and one at a time: every
    embedding equals the padded textpool's for the same tokens, and itself alone."""
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.choice([1, 2, 5, 9, 16], 30)] + [120, 300]
    tokens = [rng.integers(1, 8000, (1 + i % 2, n)) for i, n in enumerate(lengths)]
    tokens.append(rng.integers(1, 8000, (40, 3)))  # split: more rows than a batch holds

    async def together(model: str) -> list[Any]:
        async with AsyncClient(example_server.url) as ac:
            return await asyncio.gather(
                *(ac.infer(model, {"TOKENS": t}, timeout=60) for t in tokens)
            )

    packed, padded = asyncio.run(together("textpool_packed")), asyncio.run(together("textpool"))
    with Client(example_server.url) as c:
        alone = [c.infer("textpool_packed", {"TOKENS": t})["EMBEDDING"] for t in tokens]
    for t, p, q, a in zip(tokens, packed, padded, alone, strict=True):
        assert p["EMBEDDING"].shape == (t.shape[0], 64)
        np.testing.assert_allclose(p["EMBEDDING"], a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(p["EMBEDDING"], q["EMBEDDING"], rtol=1e-5, atol=1e-6)


def test_the_packed_examples_jagged_attention_equals_its_loop_over_rows() -> None:
    """The GPU's way (SDPA over torch.nested jagged tensors), run on the CPU here, gives
    what the CPU's loop over the rows' views gives."""
    import runpy
    import warnings

    import torch

    module = runpy.run_path(str(EXAMPLES / "textpool_packed" / "model.py"))
    loop, jagged = module["TextPoolPacked"](), module["TextPoolPacked"](jagged=True)
    lengths = [3, 1, 17, 6]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
        tokens = torch.arange(sum(lengths)) * 37 % 8000
        offsets = torch.tensor([0, *np.cumsum(lengths).tolist()])
        torch.testing.assert_close(jagged(tokens, offsets), loop(tokens, offsets))


def test_the_packed_example_passes_the_check_tool() -> None:
    """`batchd models DIR --check` builds a packed batch of zeros with its offsets."""
    from batchd.worker.check import check_model

    row = check_model(EXAMPLES / "textpool_packed")
    assert row.problem is None and row.run_ms > 0, row.problem


def test_the_readme_packed_example_runs_as_written(tmp_path: Path) -> None:
    """The README's packed model.toml and model.py, as written there, through the
    check tool and a real server: each row's output is the mean of its own token
    embeddings, batched with others or alone."""
    import re

    import torch

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("\n### Packed ragged inputs (no padding)\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    (tmp_path / "pooled").mkdir()
    (tmp_path / "pooled" / "model.toml").write_text(next(c for k, c in blocks if k == "toml"))
    (tmp_path / "pooled" / "model.py").write_text(next(c for k, c in blocks if k == "python"))
    from batchd.worker.check import check_model

    assert check_model(tmp_path / "pooled").problem is None
    torch.manual_seed(0)
    table = torch.nn.Embedding(1000, 16).weight.detach().numpy()
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 5000, (1, n)) for n in (1, 7, 3, 30, 2)]
    server = ServerProcess(tmp_path, log_dir=tmp_path).start()
    try:

        async def together() -> list[Any]:
            async with AsyncClient(server.url) as ac:
                return await asyncio.gather(*(ac.infer("pooled", {"TOKENS": t}) for t in rows))

        for t, got in zip(rows, asyncio.run(together()), strict=True):
            expected = table[t[0] % 1000].mean(axis=0)
            np.testing.assert_allclose(got["POOLED"][0], expected, rtol=1e-5, atol=1e-6)
    finally:
        assert server.stop() == 0, server.log()
