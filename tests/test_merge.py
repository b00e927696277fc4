"""worker/merge.py: which batches one forward may take, and cutting its outputs back."""

from __future__ import annotations

import numpy as np

from batchd.protos import wire
from batchd.protos.tensors import bytes_row_offsets, from_raw, serialize_bytes, to_raw
from batchd.worker import merge
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
