"""split_join.py: ragged padding with its mask and lengths, outputs cut back per
request, big requests split by rows and joined again."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from batchd.protos import wire
from batchd.protos.model_config import TensorSpec
from batchd.protos.tensors import from_raw
from batchd.server.batching.split_join import (
    join_inputs,
    join_results,
    split_outputs,
    split_request,
)
from batchd.server.errors import ModelFailed
from batchd.server.request import Request, Tensor
from batchd.worker.execute import BatchError, run_batch
from tests.conftest import ragged_model, text


def test_ragged_inputs_are_padded_with_mask_and_lengths(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    a, b = text(cfg, loop, 2, start=1), text(cfg, loop, 4, rows=2, start=10)
    headers, frames = join_inputs([a, b])
    got = {
        h.name: from_raw(h.datatype, h.shape, np.asarray(f).tobytes())
        for h, f in zip(headers, frames, strict=True)
    }
    assert got["IDS"].tolist() == [[1, 2, 0, 0], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert got["MASK"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert got["LEN"].tolist() == [2, 4, 4]
    left = replace(cfg, inputs=(replace(cfg.inputs[0], padding_side="left", pad_value=-1),))
    a2, b2 = text(left, loop, 2, start=1), text(left, loop, 3, start=5)
    headers, frames = join_inputs([a2, b2])
    ids = np.asarray(frames[0])
    assert ids.tolist() == [[-1, 1, 2], [5, 6, 7]]
    assert np.asarray(frames[1]).tolist() == [[0, 1, 1], [1, 1, 1]]


def test_a_bf16_input_is_padded_with_the_bf16_of_its_pad_value(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """BF16 travels as uint16 bits: a pad of 1.0 was written as the bits 0x0001
    (9.2e-41), not 0x3F80."""
    spec = replace(ragged_model().inputs[0], datatype="BF16", pad_value=1.0)
    cfg = replace(ragged_model(), inputs=(spec,))
    a, b = text(cfg, loop, 1), text(cfg, loop, 3)
    for r, n in ((a, 1), (b, 3)):
        r.inputs = [Tensor("IDS", "BF16", (1, n), np.full(n, 0x4000, np.uint16).tobytes())]
    _, frames = join_inputs([a, b])
    assert np.asarray(frames[0]).view(np.uint16).tolist() == [
        [0x4000, 0x3F80, 0x3F80],
        [0x4000, 0x4000, 0x4000],
    ]


def test_ragged_outputs_are_cut_back_per_request(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    a, b = text(cfg, loop, 2), text(cfg, loop, 3)
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    results = split_outputs(
        [a, b], [wire.Tensor(name="OUT", datatype="FP32", shape=[2, 3])], [out.tobytes()]
    )
    assert [r[0].shape for r in results] == [(1, 2), (1, 3)]
    assert from_raw("FP32", (1, 2), bytes(results[0][0].data)).tolist() == [[0.0, 1.0]]


def test_big_requests_split_and_join_back(loop: asyncio.AbstractEventLoop) -> None:
    cfg = ragged_model()
    big = text(cfg, loop, 3, rows=20)
    chunks = split_request(big, 8)
    assert [c.rows for c in chunks] == [8, 8, 4]
    assert b"".join(bytes(c.inputs[0].data) for c in chunks) == big.inputs[0].data
    parts = [
        [Tensor("OUT", "FP32", (c.rows, 3), np.full((c.rows, 3), i, np.float32).tobytes())]
        for i, c in enumerate(chunks)
    ]
    joined = join_results(parts)[0]
    assert joined.shape == (20, 3)
    assert from_raw("FP32", joined.shape, joined.data)[:, 0].tolist() == [0] * 8 + [1] * 8 + [2] * 4


def test_chunks_whose_other_dims_differ_fail_naming_the_output_and_both_shapes() -> None:
    """A padded model's output of a variable dim that is not ragged_like comes back as
    wide as its batch: a request split into chunks got their bytes joined under the
    first chunk's shape, a response whose shape and bytes disagreed."""

    def piece(rows: int, width: int) -> list[Tensor]:
        return [Tensor("W", "FP32", (rows, width), bytes(4 * rows * width))]

    joined = join_results([piece(4, 3), piece(2, 3)])
    assert joined[0].shape == (6, 3) and len(joined[0].data) == 72
    with pytest.raises(ModelFailed) as e:
        join_results([piece(4, 3), piece(4, 7), piece(2, 3)])
    assert "output 'W' came back [-1, 3] for one part of this request and [-1, 7]" in str(e.value)


def _joined(requests: list[Request]) -> tuple[list[wire.Tensor], list[bytes]]:
    """A batch's inputs as the worker gets them: headers and raw frames."""
    headers, frames = join_inputs(requests)
    return headers, [np.asarray(f).tobytes() for f in frames]


@pytest.mark.parametrize("width", [5, 3])  # the padded width is 4
def test_a_ragged_like_output_wider_or_narrower_than_the_padding_is_refused_by_the_worker(
    loop: asyncio.AbstractEventLoop, width: int
) -> None:
    """Left-padded rows cut from a wider output took another position's values (the
    call succeeded with wrong data); a narrower one failed every request of the batch
    at the frontend, not the worker, so none was retried alone."""
    cfg = ragged_model()
    headers, frames = _joined([text(cfg, loop, 2), text(cfg, loop, 4)])
    model = lambda ids, mask, lengths: torch.zeros(len(ids), width)  # noqa: E731
    with pytest.raises(BatchError, match=re.escape(
        f"output 'OUT': expected shape [2, 4] (padded like 'IDS'), the model returned [2, {width}]"
    )):  # fmt: skip
        run_batch(model, cfg, torch.device("cpu"), headers, frames)
    out, _ = run_batch(lambda ids, mask, lengths: ids.float(), cfg, torch.device("cpu"),
                       headers, frames)  # fmt: skip
    assert list(out[0].shape) == [2, 4]
    # and the frontend, from a peer that does not check (another build, a remote worker)
    wrong = [wire.Tensor(name="OUT", datatype="FP32", shape=[2, width])]
    with pytest.raises(ValueError, match=f"has {width} positions, the batch was padded to 4"):
        split_outputs([text(cfg, loop, 2), text(cfg, loop, 4)], wrong, [bytes(8 * width)])


def test_an_output_with_a_zero_in_its_shape_is_returned_and_cut_per_request(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A legal empty output ([rows, 0]: nothing found in any row) failed its whole batch
    with memoryview's TypeError, in the worker and again as the frontend cut it."""
    cfg = replace(ragged_model(), outputs=(TensorSpec("OUT", "FP32", (-1,)),))
    headers, frames = _joined([text(cfg, loop, 2), text(cfg, loop, 4)])
    for empty in (torch.zeros(2, 0), np.zeros((2, 0), np.float32)):
        out, raw = run_batch(lambda *a, e=empty: e, cfg, torch.device("cpu"), headers, frames)
        assert (list(out[0].shape), len(raw[0])) == ([2, 0], 0)
    like = replace(ragged_model(), outputs=(TensorSpec("OUT", "FP32", (-1, 0), ragged_like="IDS"),))
    requests = [text(like, loop, 2), text(like, loop, 4)]
    results = split_outputs(requests, [wire.Tensor(name="OUT", datatype="FP32", shape=[2, 4, 0])],
                            [b""])  # fmt: skip
    assert [(r[0].shape, len(r[0].data)) for r in results] == [((1, 2, 0), 0), ((1, 4, 0), 0)]
