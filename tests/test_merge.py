"""worker/merge.py: which batches one forward may take, and cutting its outputs back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from batchd.protos import wire
from batchd.protos.tensors import bytes_row_offsets, from_raw, serialize_bytes, to_raw
from batchd.worker import merge
from batchd.worker.runner import Runner, RunnerOptions
from tests.conftest import model, ragged_model


def batch_header(
    arr: np.ndarray, model_name: str = "m", **kw: object
) -> tuple[wire.Header, list[bytes]]:
    datatype, shape, raw = to_raw(arr)
    t = wire.Tensor(name="X", datatype=datatype, shape=shape)
    h = wire.Header(kind=wire.Header.BATCH, model=model_name, version="1", tensors=[t], **kw)
    return h, [raw]


def test_only_like_batches_within_the_row_limit_merge() -> None:
    cfg = model(max_batch_size=4, shape=(2,))
    a, _ = batch_header(np.zeros((2, 2), np.float32))
    assert merge.can_merge(cfg, a, batch_header(np.zeros((2, 2), np.float32))[0], 2)
    assert not merge.can_merge(cfg, a, batch_header(np.zeros((3, 2), np.float32))[0], 2)  # 5 rows
    assert not merge.can_merge(cfg, a, batch_header(np.zeros((1, 3), np.float32))[0], 2)  # shape
    assert not merge.can_merge(cfg, a, batch_header(np.zeros((1, 2), np.float64))[0], 2)  # dtype
    assert not merge.can_merge(cfg, a, batch_header(np.zeros((1, 2), np.float32), "n")[0], 2)
    assert not merge.can_merge(cfg, a, batch_header(np.zeros((1, 2), np.float32), alone=True)[0], 2)
    ragged = ragged_model()
    assert not merge.can_merge(ragged, a, a, 1)


def test_join_then_split_gives_each_batch_its_rows_back() -> None:
    first = batch_header(np.arange(4, dtype=np.float32).reshape(2, 2))
    second = batch_header(np.arange(4, 10, dtype=np.float32).reshape(3, 2))
    tensors, frames = merge.join([(0, *first), (1, *second)])
    assert list(tensors[0].shape) == [5, 2]
    parts = merge.split(tensors, frames, [2, 3])
    got = [from_raw("FP32", tuple(t[0].shape), bytes(f[0])) for t, f in parts]
    assert got[0].tolist() == [[0, 1], [2, 3]] and got[1].tolist() == [[4, 5], [6, 7], [8, 9]]


def test_bytes_outputs_are_cut_by_their_row_offsets() -> None:
    values = np.array([[b"a"], [b"bcd"], [b""], [b"efgh"]], dtype=object)
    raw = serialize_bytes(values)
    t = wire.Tensor(name="T", datatype="BYTES", shape=[4, 1])
    t.row_offsets.extend(bytes_row_offsets(raw, 4, 1).tolist())
    parts = merge.split([t], [raw], [1, 3])
    second_t, second_f = parts[1][0][0], parts[1][1][0]
    assert list(second_t.shape) == [3, 1] and second_t.row_offsets[0] == 0
    assert from_raw("BYTES", (3, 1), bytes(second_f)).ravel().tolist() == [b"bcd", b"", b"efgh"]


def test_every_batch_of_a_merged_forward_is_answered_when_cutting_its_outputs_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure past the forward (splitting or packing the outputs) fails every batch
    of it, to its own frontend: the compute thread answered only the first, and the
    others' frontends waited for their execution limit."""
    cfg = model(max_batch_size=4, shape=(1,))
    options = RunnerOptions("w", "ipc://a,ipc://b", torch.device("cpu"), tmp_path)
    runner = Runner(options)
    runner.held.models = {cfg.key: (cfg, lambda x: x * 2)}
    runner._threads_all = runner._threads_now = 1  # (the compute thread sets them)
    h1, f1 = batch_header(np.ones((1, 1), np.float32), batch_id=1)
    h2, f2 = batch_header(np.ones((2, 1), np.float32), batch_id=2)
    runner._work.put((1, h2, f2))  # waiting behind the first: merged into its forward

    def broken(*args: object) -> None:
        raise RuntimeError("cutting failed")

    monkeypatch.setattr(merge, "split", broken)
    replies: list[tuple[int, wire.Header]] = []
    held = runner._handle((0, h1, f1), lambda to, parts, ends=1: replies.append(
        (to, wire.unpack(parts)[0])))  # fmt: skip
    assert held is None
    assert [(to, h.kind, h.batch_id) for to, h in replies] == [
        (0, wire.Header.ERROR, 1), (1, wire.Header.ERROR, 2)]  # fmt: skip
    assert all("RuntimeError: cutting failed" in h.error for _, h in replies), replies
