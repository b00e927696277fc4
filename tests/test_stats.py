"""Per-model statistics: what ModelStatistics and later metrics read."""

from batchd.server.stats import Stats


def test_batches_rows_histogram_and_durations() -> None:
    s = Stats()
    s.batch_done("m", rows=8, requests=3, queue_ns=300, input_ns=10, infer_ns=1000, output_ns=5)
    s.batch_done("m", rows=8, requests=2, queue_ns=100, input_ns=10, infer_ns=900, output_ns=5)
    s.batch_done("m", rows=1, requests=1, queue_ns=50, input_ns=10, infer_ns=200, output_ns=5)
    m = s.model("m")
    assert (m.inference_count, m.execution_count) == (17, 3)
    assert m.average_batch_size() == 17 / 3
    assert (m.queue.count, m.queue.ns) == (6, 450)
    assert (m.compute_infer.count, m.compute_infer.ns) == (6, 3 * 1000 + 2 * 900 + 200)
    pb = s.to_pb("m", "1")
    assert [(b.batch_size, b.compute_infer.count) for b in pb.batch_stats] == [(1, 1), (8, 2)]
    assert pb.batch_stats[1].compute_infer.ns == 1900


def test_padding_efficiency_and_failures_by_reason() -> None:
    s = Stats()
    assert s.model("t").padding_efficiency() == 1.0
    s.padding("t", real_tokens=30, padded_tokens=40)
    s.padding("t", real_tokens=10, padded_tokens=10)
    assert s.model("t").padding_efficiency() == 0.8
    s.answered("t", 100)
    s.answered("t", 50, "queue_full")
    s.answered("t", 70, "queue_full")
    s.answered("t", 20, "invalid")
    m = s.model("t")
    assert (m.success.count, m.fail.count, m.fail.ns) == (1, 3, 140)
    assert dict(m.rejected) == {"queue_full": 2, "invalid": 1}
