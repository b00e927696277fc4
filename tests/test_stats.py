"""Per-model statistics: what ModelStatistics and later metrics read."""

import asyncio
import dataclasses
import gc
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchd.protos import inference_pb2 as pb
from batchd.protos.model_config import ConfigError
from batchd.server import exposition, metrics, siblings
from batchd.server.batching.split_join import split_request
from batchd.server.metrics import Collector, WorkerView, worker_views
from batchd.server.stats import REPORT_SLICE, RETIRED_KEEP_S, Stats
from tests.conftest import Clock, model, request, stepwise_model


def test_batches_rows_histogram_and_durations() -> None:
    s = Stats()
    s.batch_done("m", "1", rows=8, input_ns=10, infer_ns=1000, output_ns=5)
    s.batch_done("m", "1", rows=8, input_ns=10, infer_ns=900, output_ns=5)
    s.batch_done("m", "1", rows=1, input_ns=10, infer_ns=200, output_ns=5)
    for queue_ns, infer_ns in ((100, 1000), (100, 1000), (100, 1000), (50, 900), (50, 900)):
        s.answered("m", "1", 2000, timing=[queue_ns, 10, infer_ns, 5])
    s.answered("m", "1", 2000, timing=[50, 10, 200, 5])
    m = s.model("m", "1")
    assert (m.inference_count, m.execution_count) == (17, 3)
    assert m.average_batch_size() == 17 / 3
    assert (m.queue.count, m.queue.ns) == (6, 450)
    assert (m.compute_infer.count, m.compute_infer.ns) == (6, 3 * 1000 + 2 * 900 + 200)
    pb = s.to_pb("m", "1")
    assert [(b.batch_size, b.compute_infer.count) for b in pb.batch_stats] == [(1, 1), (8, 2)]
    assert pb.batch_stats[1].compute_infer.ns == 1900


def test_per_request_counts_and_durations_are_answered_requests_as_triton_s() -> None:
    """success, queue and the compute counts move together, once per request answered
    successfully, with that request's own durations, however many batches carried it
    (a split request's chunks: it waited as long as its longest-waiting chunk, and took
    their compute times together) and whatever its batches also carried (a job's lines:
    batches only). A request that fails adds nothing to them, whatever its batches took
    (a response refused as too large left 522 ms of compute with no count: review 58a)."""
    s = Stats()
    cfg = model(max_batch_size=8)
    whole = request(cfg, rows=24)
    for chunk, queue_ns in zip(split_request(whole, 8), (0, 3000, 2000), strict=True):
        chunk.took(queue_ns, 10, 100, 1)  # three chunks, each in its batch
        s.batch_done("m", "1", rows=8, input_ns=10, infer_ns=100, output_ns=1)
    s.batch_done("m", "1", rows=5, input_ns=10, infer_ns=100, output_ns=1)  # a job's
    refused = request(cfg)
    refused.took(5000, 10, 522_000_000, 1)
    s.answered("m", "1", 9000, timing=whole.timing)
    s.answered("m", "1", 500, "invalid", timing=refused.timing)  # a failure counts as one
    m = s.model("m", "1")
    counts = [m.success.count, m.queue.count, m.compute_input.count,
              m.compute_infer.count, m.compute_output.count]  # fmt: skip
    assert counts == [1, 1, 1, 1, 1] and m.fail.count == 1
    assert (m.queue.ns, m.compute_infer.ns, m.compute_input.ns) == (3000, 300, 30)
    assert (m.inference_count, m.execution_count) == (29, 4)


def test_a_step_wise_sequence_counts_its_wait_and_its_steps_as_one_request() -> None:
    """Its wait for a slot and each step round it was stepped in (the round's time),
    counted once it is answered: one request, as perf_analyzer divides them (counted
    per sequence-step, its compute showed one step's time: review 58a)."""
    s = Stats()
    r = request(stepwise_model("g"))
    r.took(700, 0, 0, 0)
    for _ in range(2):
        s.step("g", "1", active=1)
        r.took(0, 0, 50, 0)
    s.answered("g", "1", 9000, timing=r.timing)
    m = s.model("g", "1")
    assert (m.success.count, m.queue.count, m.queue.ns) == (1, 1, 700)
    assert [m.compute_input.count, m.compute_infer.count, m.compute_output.count] == [1, 1, 1]
    assert (m.compute_infer.ns, m.execution_count, m.inference_count) == (100, 2, 2)
    assert m.forward_rows == 2  # (it stayed 0: forward_rows / executions said 0, 58a)


def test_padding_efficiency_and_failures_by_reason() -> None:
    s = Stats()
    assert s.model("t", "1").padding_efficiency() == 1.0
    s.padding("t", "1", real_tokens=30, padded_tokens=40)
    s.padding("t", "1", real_tokens=10, padded_tokens=10)
    assert s.model("t", "1").padding_efficiency() == 0.8
    s.answered("t", "1", 100)
    s.answered("t", "1", 50, "queue_full")
    s.answered("t", "1", 70, "queue_full")
    s.answered("t", "1", 20, "invalid")
    m = s.model("t", "1")
    assert (m.success.count, m.fail.count, m.fail.ns) == (1, 3, 140)
    assert dict(m.rejected) == {"queue_full": 2, "invalid": 1}
    assert s.answered_total() == 4


def test_each_version_counts_its_own_and_a_retired_one_is_forgotten() -> None:
    """A reload starts version 2 at zero; version 1, still answering a request, is
    reported beside it with its own counts; once that is answered version 1 is retired,
    reported RETIRED_KEEP_S more (its last answers were never seen: it went as they were
    counted, review 58a), then forgotten (Triton reports loaded versions only)."""
    clock = Clock()
    s = Stats(clock)
    for _ in range(3):
        s.opened("m", "1")
        s.batch_done("m", "1", rows=1, input_ns=1, infer_ns=1, output_ns=1)
        s.answered("m", "1", 100)
    s.opened("m", "1")  # admitted by version 1, answered after the reload
    assert s.versions("m", "2") == ["1", "2"]
    assert s.model("m", "2").success.count == s.model("m", "2").inference_count == 0
    s.answered("m", "2", 100)
    assert [(p.version, p.inference_stats.success.count) for p in report(s, [("m", "2")])] == [
        ("1", 3), ("2", 1),
    ]  # fmt: skip
    s.answered("m", "1", 100)  # version 1's last: it is retired
    clock.now += RETIRED_KEEP_S
    assert [(p.version, p.inference_stats.success.count) for p in report(s, [("m", "2")])] == [
        ("1", 4), ("2", 1),
    ]  # fmt: skip
    assert [p.version for p in report(s, [("m", "2")], "1")] == ["1"]  # asked for by number
    clock.now += 0.001
    assert s.versions("m", "2") == ["2"]
    assert s.versions("m", "3") == ["3"]  # after an unload and a load: version 3 from zero
    assert s.model("m", "3").success.count == 0
    assert [p.version for p in report(s, [("m", "3")], "3")] == ["3"]
    assert s.answered_total() == 5


def report(s: Stats, current: list[tuple[str, str]], only: str = "") -> list[pb.ModelStatistics]:
    return asyncio.run(s.report(current, only))


def test_statistics_of_every_model_let_the_loop_run() -> None:
    """ModelStatistics of every model was built at once on the loop: 1,500 models of 32
    batch sizes held it 188 ms (review 58a). REPORT_SLICE models a turn: the same
    answer."""
    s = Stats()
    current = [(f"m{i:04}", "1") for i in range(3 * REPORT_SLICE + 1)]
    for name, _ in current:
        s.answered(name, "1", 100)
    turns = [0]

    async def body() -> list[pb.ModelStatistics]:
        async def count() -> None:
            while True:
                turns[0] += 1
                await asyncio.sleep(0)

        counting = asyncio.ensure_future(count())
        await asyncio.sleep(0)
        turns[0] = 0
        try:
            return await s.report(current)
        finally:
            counting.cancel()

    got = asyncio.run(body())
    assert [p.name for p in got] == [n for n, _ in current] and turns[0] >= 3


def scrape(collector: Collector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = asyncio.run(exposition.render([collector])).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scrapes_that_come_while_one_is_rendered_share_it() -> None:
    """Each /metrics request rendered its own exposition on the loop: 20 requests sent
    and closed at once held it 7 s on a server of 1,500 models."""
    renders, release = [], asyncio.Event()

    async def render() -> bytes:
        renders.append(1)
        await release.wait()
        return b"text %d" % len(renders)

    async def body() -> tuple[list[bytes], bytes]:
        shared = metrics.Shared(render)
        waiting = [asyncio.ensure_future(shared()) for _ in range(10)]
        await asyncio.sleep(0)  # each runs to its wait
        waiting[0].cancel()  # one caller gone takes the render from no other
        release.set()
        answers = await asyncio.gather(*waiting[1:])
        return answers, await shared()  # one asked after: rendered anew

    answers, later = asyncio.run(body())
    assert (answers, later, len(renders)) == ([b"text 1"] * 9, b"text 2", 2)


def test_a_render_that_fails_with_no_one_waiting_leaves_no_unretrieved_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def render() -> bytes:
        await asyncio.sleep(0)
        raise OSError("a sibling's socket")

    async def body() -> None:
        shared = metrics.Shared(render)
        waiting = asyncio.ensure_future(shared())
        await asyncio.sleep(0)
        waiting.cancel()  # its only caller gone before the render failed
        assert shared._running is not None
        await asyncio.wait([shared._running])

    asyncio.run(body())
    gc.collect()  # (a future's unretrieved error is logged as it is freed)
    assert "never retrieved" not in caplog.text


def test_a_scrape_lets_the_loop_run_and_says_what_one_read_of_every_model_says() -> None:
    """A scrape built prometheus_client's objects for every model's series and rendered
    them at once, on the loop: 1,500 models held it 0.4-0.8 s a scrape, and every call
    waited. It writes the lines itself, PART models a turn: the same text as one part,
    families whole and in order, that Prometheus' parser reads."""
    stats, models = Stats(), {f"m{i:03}": model() for i in range(2 * metrics.PART + 5)}
    models["m007"] = dataclasses.replace(model(), version="2")  # reloaded; version 1 answers
    for i, m in enumerate(models):
        stats.batch_done(m, "1", rows=i % 9 + 1, input_ns=1, infer_ns=1000, output_ns=1)
        stats.answered(m, "1", 1000 + i, failure="INTERNAL" if i % 5 == 0 else None)
    stats.opened("m007", "1")  # (still answering)
    views = [WorkerView("cpu0#1", "cpu0", "cpu", True)]

    def waiting() -> dict[str, int]:
        return {"m006": 3, "gone": 1}  # (an unloaded model's is not said)

    collector = Collector(models, stats, waiting, lambda: views, lambda: {"cpu0": 1}, lambda: 2.5)
    turns = 0

    async def body() -> tuple[bytes, int]:
        async def beside() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(beside())
        await asyncio.sleep(0)
        before = turns
        text = await exposition.render([collector])
        other.cancel()
        return text, turns - before

    text, turns_in = asyncio.run(body())
    assert turns_in >= 2  # three parts: the loop ran between them
    assert text == exposition.text(next(collector.parts(size=10**6)))
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert text.count(b"# TYPE batchd_batch_size histogram\n") == 1
    sizes = [s for s in families["batchd_batch_size"].samples if s.labels.get("model") == "m006"]
    assert [(s.labels.get("le"), s.value) for s in sizes[3:5]] == [("8.0", 1.0), ("16.0", 1.0)]
    assert sizes[2].value == 0.0 and sizes[-1].value == 7.0  # le 4.0; the sum
    count = {(s.labels["model"], s.labels["version"]): s.value
             for s in families["batchd_inference_count"].samples}  # fmt: skip
    assert len(count) == len(models) + 1 and count["m007", "1"] == 8.0 and count["m007", "2"] == 0
    assert families["batchd_frontend_loop_busy_seconds"].samples[0].value == 2.5
    pending = {s.labels["model"]: s.value
               for s in families["batchd_inference_pending_request_count"].samples}  # fmt: skip
    assert len(pending) == len(models) and pending["m006"] == 3 and pending["m005"] == 0


def test_the_text_is_prometheus_client_s_byte_for_byte() -> None:
    """batchd writes /metrics itself (exposition.py) since it is read a few models a turn
    of the loop: the text must stay what prometheus_client wrote before, which dashboards
    and scrapers read. The file is the parent revision's text of this state."""
    stats = Stats()
    models = {
        "plain": model(),
        "reloaded": dataclasses.replace(model(), version="2"),
        'odd"é\\name': model(),
        "steps": stepwise_model("steps", max_active=3),
    }
    for i, m in enumerate(["plain", "reloaded", 'odd"é\\name'] * 3):
        stats.batch_done(m, "1", rows=i % 5 + 1, input_ns=13, infer_ns=2_000_000 + i, output_ns=5)
        stats.answered(m, "1", 3_000_000 + i, timing=[1000 * i + 7, 26, 4_000_000 + 2 * i, 10])
        stats.answered(m, "1", 10, failure=("INTERNAL", "RESOURCE_EXHAUSTED")[i % 2])
    stats.opened("reloaded", "1")  # version 1 still answers
    stats.answered("reloaded", "2", 123_456_789_012)
    s = stats.model("steps", "1")
    s.first_output.counts[2] += 3
    s.first_output.sum_us += 2500.25
    s.between_outputs.counts[0] += 40
    s.between_outputs.sum_us += 11.5
    s.slots.update({1: 4, 3: 9})
    s.outputs = 49
    s.real_tokens, s.padded_tokens = float("nan"), 48  # (NaN as Go writes it)
    stats.model("plain", "1").forward_rows = 12_345_678_901  # (1.2345678901e+10)
    views = [WorkerView("cpu0#1", "cpu0", "cpu", True), WorkerView("", "cpu1", "cpu", False),
             WorkerView('gpu"\\\nbox', 'gpu"\\\nbox', "cuda:0", True)]  # fmt: skip
    collector = Collector(
        models, stats, lambda: {"plain": 2, "steps": 1}, lambda: views,
        lambda: {"cpu1": 3, "cpu0": 1}, lambda: 2.5, lambda m: (1, 2), lambda: {"plain": 4},
    )  # fmt: skip
    want = (Path(__file__).parent / "data" / "metrics-543b6a3.txt").read_bytes()
    assert asyncio.run(exposition.render([collector])) == want


def test_a_sibling_s_text_prometheus_would_refuse_is_refused_and_a_label_it_adds_replaced() -> None:
    """Frontend 0 merges every frontend's text (siblings.py): a line that would make
    Prometheus refuse the whole scrape (a value float() reads but Go does not, labels
    with no comma between them or a label twice, a type it does not know) passed; a
    `frontend` label of the text's own was kept beside the one added, twice in one
    series."""
    head = "# HELP batchd_x a\n# TYPE batchd_x gauge\n"
    for bad in ('batchd_x{model="m"} 1_0', 'batchd_x{model="m"model="n"} 1', "batchd_x \uff11",
                'batchd_x{model="m" 5', "batchd_y 1", "# a comment", 'batchd_x{a="1",a="2"} 1',
                "batchd_x 1e400"):  # fmt: skip
        with pytest.raises(ValueError):
            exposition.parse(head + bad + "\n", 'frontend="1"')
    for bad_head in ("# HELP batchd-x a\n", "# HELP batchd_x a\n# TYPE batchd_x bogus\n",
                     "# HELP batchd_x a\n# TYPE batchd_x\n"):  # fmt: skip
        with pytest.raises(ValueError):
            exposition.parse(bad_head + "batchd_x 1\n")
    text = head + 'batchd_x{frontend="9",model="m"} 1.5e+07\nbatchd_x +Inf\n'
    got = exposition.text(exposition.parse(text, 'frontend="1"'))
    assert got == (head + 'batchd_x{frontend="1",model="m"} 1.5e+07\n'
                   'batchd_x{frontend="1"} +Inf\n').encode()  # fmt: skip


def test_a_label_holding_a_line_break_other_than_newline_leaves_the_merged_scrape_whole() -> None:
    """Frontend 0 reads its own text back to merge the others' (--frontends N), and split
    it at every line break Python knows: a worker id holding U+2028 (a remote worker's
    --id) made each scrape fail, answered with nothing, and logged nowhere."""
    odd = [WorkerView("gpu\u2028box\rx", "gpu\u2028box\rx", "cuda:0", True)]
    collector = Collector({}, Stats(), dict, lambda: odd, dict)
    own = asyncio.run(exposition.render([collector]))
    assert asyncio.run(siblings.gathered(own, [])) == own  # (worker_up: frontend 0's alone)
    assert 'worker="gpu\u2028box\rx"'.encode() in own


def test_a_scrape_that_fails_is_answered_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A scrape that raised closed the connection with no answer and no log line."""

    class Broken:  # (its scrape takes many turns of the loop: the three callers share it)
        def parts(self) -> Iterator[exposition.Families]:
            yield from ({} for _ in range(1000))
            raise RuntimeError("a defect")

    async def ask(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer

    async def body() -> list[bytes]:
        server = await metrics.start_metrics([Broken()], "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        answers = await asyncio.gather(*[ask(port) for _ in range(3)])
        server.close()
        return answers

    with caplog.at_level(logging.ERROR, "batchd.metrics"):
        answers = asyncio.run(body())
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 500 ") and answer.endswith(b"see batchd's log\n")
    assert [r.getMessage() for r in caplog.records] == ["a /metrics scrape failed"]
    assert "a defect" in caplog.text


def test_metrics_are_labelled_by_the_version_that_counted_them() -> None:
    stats = Stats()
    for _ in range(3):
        stats.answered("m", "1", 100)
    models = {"m": dataclasses.replace(model(), version="2")}  # reloaded: version 1 retired
    collector = Collector(models, stats, dict, lambda: [], lambda: {})
    got = scrape(collector)
    success = {k[1]: v for k, v in got.items() if k[0] == "batchd_inference_request_success_total"}
    assert success == {(("model", "m"), ("version", "2")): 0.0}


def test_worker_up_has_one_series_per_slot_down_while_its_worker_restarts() -> None:
    slots = [("cpu0", "cpu"), ("cpu1", "cpu")]
    views = worker_views(slots, [("cpu0#3", "cpu"), ("gpuhost-cuda:0-81", "cuda:0")])
    assert views == [
        WorkerView("cpu0#3", "cpu0", "cpu", True),
        WorkerView("", "cpu1", "cpu", False),  # its process is restarting
        WorkerView("gpuhost-cuda:0-81", "gpuhost-cuda:0-81", "cuda:0", True),  # another host's
    ]
    collector = Collector({}, Stats(), dict, lambda: views, lambda: {"cpu1": 4})
    up = {
        dict(k[1])["worker"]: v for k, v in scrape(collector).items() if k[0] == "batchd_worker_up"
    }
    assert up == {"cpu0": 1.0, "cpu1": 0.0, "gpuhost-cuda:0-81": 1.0}


def test_frontend_0_gathers_each_frontends_metrics_labelled_and_leaves_out_the_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """--frontends N: frontend 0's /metrics said its own counts alone. It asks each
    sibling's socket; one that hangs (given ANSWER_S), is gone (restarting), answers
    cut short (Content-Length unmet: a number cut to 1234.0 parsed) or answers what
    does not parse (which ended the whole scrape unanswered) is left out of it. The
    jobs store's counts and the workers, frontend 0's, once and unlabelled."""
    monkeypatch.setattr(siblings, "ANSWER_S", 0.5)

    def registry(seen: int) -> CollectorRegistry:
        r = CollectorRegistry()
        Counter("batchd_seen", "a metric", ["model"], registry=r).labels("m").inc(seen)
        Histogram("batchd_took", "a histogram", buckets=(1.0,), registry=r).observe(seen)
        Gauge("batchd_jobs", "the store's", ["status"], registry=r).labels("queued").set(7)
        Gauge("batchd_worker_up", "the workers", ["worker"], registry=r).labels("cpu0").set(1)
        return r

    def answering(text: bytes, length: int | None = None) -> Any:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readuntil(b"\r\n\r\n")
                if length is None:
                    await asyncio.sleep(30)  # hangs
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (length, text))
                await writer.drain()
            except asyncio.CancelledError:
                pass
            finally:
                writer.close()

        return answer

    async def body() -> bytes:
        one = await metrics.start_metrics([registry(2)], "", -1, unix=str(tmp_path / "1.sock"))
        cut = b'# TYPE batchd_seen counter\nbatchd_seen_total{model="m"} 1234'  # (12345)
        garbage = b'batchd_seen_total{model="m" 5\n'
        others = [answering(b""), answering(cut, len(cut) + 1), answering(garbage, len(garbage))]
        servers = [await asyncio.start_unix_server(a, str(tmp_path / f"{i}.sock"))
                   for i, a in enumerate(others, 2)]  # fmt: skip
        paths = [str(tmp_path / f"{i}.sock") for i in (1, 2, 3, 4, 5)]  # (5: none there)
        try:
            return await siblings.gathered(generate_latest(registry(1)), paths)
        finally:
            for server in (one, *servers):
                server.close()

    with caplog.at_level(logging.WARNING, "batchd.metrics"):
        text = asyncio.run(body()).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("batchd_seen_total", (("frontend", "0"), ("model", "m")))] == 1
    assert samples[("batchd_seen_total", (("frontend", "1"), ("model", "m")))] == 2
    assert samples[("batchd_took_bucket", (("frontend", "1"), ("le", "1.0")))] == 0
    assert samples[("batchd_took_sum", (("frontend", "1"),))] == 2
    assert not [k for k in samples if {("frontend", f) for f in "2345"} & set(k[1])], samples
    whole = sorted(k for k in samples if k[0] in ("batchd_jobs", "batchd_worker_up"))
    assert whole == [("batchd_jobs", (("status", "queued"),)),
                     ("batchd_worker_up", (("worker", "cpu0"),))]  # fmt: skip
    left_out = [r.getMessage() for r in caplog.records]
    # (5, not listening, is starting or restarting: frontend 0 says so as it starts it)
    assert len(left_out) == 3 and all("left out of this scrape" in m for m in left_out), left_out
    assert not any(m.startswith("frontend 5") for m in left_out)


def test_statistics_of_a_version_no_model_serves_are_empty_and_keep_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelStatistics with no name and a made-up version answered zeros for every model
    under it, and kept an entry for each (every frontend, for ever): a caller grew a
    frontend by 400 MB in 6,000 calls. A version served is still reported alone."""
    s = Stats()
    s.answered("m", "1", 2000)
    assert report(s, [("m", "1"), ("n", "1")], "zzz") == []
    assert report(s, [("m", "1")], "1")[0].inference_stats.success.count == 1
    assert [list(v) for v in s._models.values()] == [["1"], []]  # no "zzz" kept
    # what was kept of another frontend's: a retired version of a model served goes (as
    # our own Stats forgets it); an unloaded model's stays (as ours does, for its reload)
    keys = [(str(tmp_path), m, v) for m, v in (("m", "1"), ("m", "9"), ("gone", "1"))]
    kept = {k: (1, pb.ModelStatistics(name=k[1], version=k[2])) for k in keys}
    monkeypatch.setattr(siblings, "_last", dict(kept))
    monkeypatch.setattr(siblings, "_gone", {k: m for k, (_, m) in kept.items()})
    own = pb.ModelStatisticsResponse(model_stats=report(s, [("m", "1")]))
    asyncio.run(siblings.statistics(pb.ModelStatisticsRequest(), own, None, []))
    assert list(siblings._last) == list(siblings._gone) == [keys[0], keys[2]]


def test_a_frontend_s_statistics_add_up_every_other_frontend_s(tmp_path: Path) -> None:
    """--frontends N: ModelStatistics said the counts of the frontend the connection
    reached. Each version's counts and times are added, batch sizes merged in order,
    the last inference the latest; a sibling's model it does not serve is not added,
    and one that answers nothing (not listening) is left out."""

    def stats(success: int, last: int, sizes: dict[int, int]) -> pb.ModelStatistics:
        m = pb.ModelStatistics(name="m", version="1", last_inference=last, inference_count=success)
        m.inference_stats.success.count, m.inference_stats.success.ns = success, 1000 * success
        for size, n in sizes.items():
            m.batch_stats.add(batch_size=size).compute_infer.count = n
        return m

    async def theirs(request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        assert request.name == "m"
        other = pb.ModelStatistics(name="other", version="1", inference_count=99)
        return pb.ModelStatisticsResponse(model_stats=[stats(5, 70, {4: 1, 1: 2}), other])

    async def body() -> pb.ModelStatisticsResponse:
        paths = siblings.sockets(str(tmp_path), 3)  # 0: this one; 2: not listening
        one = await metrics.start_metrics(
            [], "", -1, unix=paths[1], statistics=siblings.answering(theirs)
        )
        own = pb.ModelStatisticsResponse(model_stats=[stats(3, 90, {2: 3, 4: 1})])
        try:
            return await siblings.statistics(
                pb.ModelStatisticsRequest(name="m"), own, None, siblings.others(paths[0], 3)
            )
        finally:
            one.close()

    (m,) = asyncio.run(body()).model_stats
    assert (m.name, m.inference_count, m.last_inference) == ("m", 8, 90)
    assert (m.inference_stats.success.count, m.inference_stats.success.ns) == (8, 8000)
    assert [(b.batch_size, b.compute_infer.count) for b in m.batch_stats] == [
        (1, 2),
        (2, 3),
        (4, 2),
    ]


def test_a_sibling_s_statistics_never_go_back_when_it_restarts_or_goes_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted child's counts began again from 0, and a silent one's dropped out:
    the server's totals went back, and a delta between two snapshots (perf_analyzer's)
    wrapped around. Its last answer stands in while it is silent, and what it counted
    before a restart is kept."""
    monkeypatch.setattr(siblings, "ANSWER_S", 0.5)
    counts = [5]

    async def theirs(request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        m = pb.ModelStatistics(name="m", version="1", inference_count=counts[0])
        m.inference_stats.success.count = counts[0]
        return pb.ModelStatisticsResponse(model_stats=[m])

    async def total(paths: list[str]) -> int:
        own = pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(name="m", version="1")])
        got = await siblings.statistics(pb.ModelStatisticsRequest(name="m"), own, None, paths)
        return int(got.model_stats[0].inference_stats.success.count)

    async def body() -> list[int]:
        paths = siblings.others(str(tmp_path / "frontend-0.sock"), 2)
        seen = []
        one = await metrics.start_metrics(
            [], "", -1, unix=paths[0], statistics=siblings.answering(theirs)
        )
        seen.append(await total(paths))  # 5
        counts[0] = 2  # it restarted and answered 2 since
        seen.append(await total(paths))  # 5 before, 2 now
        one.close()
        await one.wait_closed()
        seen.append(await total(paths))  # gone: silent
        # started again (another process) and counted 6 before anyone asked: more than
        # its last answer, so no count fell, and its 7 before were lost
        monkeypatch.setattr(siblings.os, "getpid", lambda: 424242)
        counts[0] = 6
        again = await metrics.start_metrics(
            [], "", -1, unix=paths[0], statistics=siblings.answering(theirs)
        )
        seen.append(await total(paths))
        again.close()
        return seen

    assert asyncio.run(body()) == [5, 7, 7, 13]


def test_a_call_with_a_deadline_waits_for_a_hung_sibling_half_its_time_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ModelStatistics with a deadline under ANSWER_S failed whole (DEADLINE_EXCEEDED)
    while a sibling hung: it is answered with the others' counts within its time."""
    monkeypatch.setattr(siblings, "ANSWER_S", 60.0)

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()

    async def body() -> int:
        paths = siblings.others(str(tmp_path / "frontend-0.sock"), 2)
        hung = await asyncio.start_unix_server(hang, paths[0])
        own = pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(name="m", version="1")])
        own.model_stats[0].inference_count = 4
        try:
            got = await asyncio.wait_for(  # (60 s, were the deadline not heeded)
                siblings.statistics(pb.ModelStatisticsRequest(name="m"), own, 0.2, paths), 10
            )
        finally:
            hung.close()
        return int(got.model_stats[0].inference_count)

    assert asyncio.run(body()) == 4


def test_a_frontend_socket_that_cannot_be_served_is_named(tmp_path: Path) -> None:
    """It was reported as a --metrics-port refusal, even with --metrics-port -1."""
    where = str(tmp_path / "gone" / "frontend-1.sock")

    async def body() -> None:
        await metrics.start_metrics([], "", -1, unix=where)

    with pytest.raises(ConfigError) as e:
        asyncio.run(body())
    assert str(e.value) == (
        f"cannot serve this frontend's socket for the others, {where}: No such file or directory"
    )
