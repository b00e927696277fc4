"""The JSON parser process (server/parser.py), driven from this test process: what runs
where, what crosses back, and a child that dies."""

from __future__ import annotations

import asyncio
import gc
import gzip
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchd.server import parser
from batchd.server.codec import DEFAULT_LIMITS
from batchd.server.errors import BatchdError, InvalidInput, QueueFull, Unavailable
from batchd.server.http_site import InflateBudget, Inflating
from batchd.server.jobs import chunks
from batchd.server.rest import _aside, _infer_body
from batchd.server.rest_codec import parse_generate, parse_infer
from tests.conftest import model
from tests.servers import alive, wait_for

BIG = parser.ASIDE_BYTES + 1


@pytest.fixture(autouse=True)
def no_child() -> Iterator[None]:
    parser.close()
    yield
    parser.close()


def test_a_small_document_is_parsed_here_and_a_large_one_in_one_kept_child() -> None:
    assert parser.run(os.getpid, parser.ASIDE_BYTES) == os.getpid()
    assert parser.child_pid() == 0, "a small document started a child"
    first = parser.run(os.getpid, BIG)
    assert first != os.getpid() and first == parser.child_pid()
    assert parser.run(os.getpid, BIG) == first


def test_a_result_and_a_refusal_cross_back_whole() -> None:
    body = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}'
    msg, _ = parser.run(parse_infer, BIG, body, None, "m", "1", DEFAULT_LIMITS)
    assert msg.model_name == "m" and msg.inputs[0].shape == [1, 2]
    assert msg.raw_input_contents[0] == b"\x00\x00\x80?\x00\x00\x00@"
    with pytest.raises(InvalidInput, match="input 'X': FP32 data holds numbers only, got a string"):
        bad = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": ["a"]}]}'
        parser.run(parse_infer, BIG, bad, None, "m", "1", DEFAULT_LIMITS)


def test_an_error_that_would_not_unpickle_comes_back_as_its_text() -> None:
    assert isinstance(parser._portable(InvalidInput("bad")), InvalidInput)
    said = parser._portable(QueueFull("full", retry_after_ms=5))  # (__init__ takes two)
    assert type(said) is BatchdError and said.message == "QueueFull: full"


def test_a_call_the_child_cannot_unpickle_is_refused_and_the_child_lives_on() -> None:
    pid = parser.run(os.getpid, BIG)
    with pytest.raises(BatchdError, match="No module named 'tests'"):
        parser.run(alive, BIG, 1)  # (tests/ is not on the child's path)
    assert parser.run(os.getpid, BIG) == pid


def test_what_the_child_prints_does_not_corrupt_its_answers() -> None:
    assert parser.run(print, BIG, "a line on the child's stdout") is None
    assert parser.run(len, BIG, "four") == 4


def test_a_document_that_kills_the_child_fails_alone_and_the_next_gets_a_new_one() -> None:
    first = parser.run(os.getpid, BIG)
    with pytest.raises(parser.ParserLost, match=r"ended \(exit 3\) twice"):
        parser.run(os._exit, BIG, 3)
    assert not alive(first)
    assert parser.run(os.getpid, BIG) not in (0, first)


def test_a_child_killed_between_documents_is_replaced_without_an_error() -> None:
    first = parser.run(os.getpid, BIG)
    os.kill(first, 9)
    assert parser.run(os.getpid, BIG) not in (0, first)


def test_the_child_ends_with_its_pipe() -> None:
    pid = parser.run(os.getpid, BIG)
    parser.close()
    assert not alive(pid) and parser.child_pid() == 0


def test_with_no_child_to_be_had_the_document_is_parsed_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.executable", "/nonexistent/python")  # (Popen: OSError)
    assert parser.run(os.getpid, BIG) == os.getpid()
    assert parser.child_pid() == 0


def test_a_child_that_exits_before_it_is_ready_leaves_documents_parsed_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child that cannot start (a broken install: it exits at once) is not a document's
    fault: documents are parsed here, not refused (each refused with INTERNAL, before)."""
    monkeypatch.setattr("sys.executable", "/bin/false")
    assert parser.run(os.getpid, BIG) == os.getpid()
    monkeypatch.undo()
    assert parser.run(os.getpid, BIG) == os.getpid(), "a new child tried at every document"


def test_on_an_event_loop_s_thread_a_document_is_parsed_here() -> None:
    """The loop's callers wait on no process: whatever its size (a body whose
    Inference-Header-Content-Length lied made the loop start the child and wait)."""

    async def on_the_loop() -> int:
        return parser.run(os.getpid, BIG)

    assert asyncio.run(on_the_loop()) == os.getpid() and parser.child_pid() == 0


def test_a_document_is_parsed_in_the_child_with_the_collector_off_and_then_on() -> None:
    """A document of millions of lists set off collection after collection, each walking
    them all: 2.7M empty lists took 2.25 s to parse, 0.39 s without (review 57c)."""
    assert parser.run(gc.isenabled, BIG) is False and gc.isenabled()


def test_a_small_body_whose_header_length_lies_is_refused_here() -> None:
    cfg = model(max_batch_size=4, shape=(1,))
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length is 300000, but"):
        _infer_body(b'{"inputs": []}', "300000", cfg, DEFAULT_LIMITS)
    with pytest.raises(InvalidInput, match="more than 8388608"):
        _infer_body(b" " * (9 << 20), None, cfg, DEFAULT_LIMITS)  # (over json_body's limit)
    assert parser.child_pid() == 0


def test_turns_at_the_child_go_in_the_order_they_were_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waiting threads took the child's next turn as the lock woke them, not in order: a
    request behind one client's hostile documents could wait out its 10 s, refused 503
    (late review 57d). A turn given up passes to the next."""
    done: list[str] = []
    release = threading.Event()

    def held(self: Any, fn: Any, args: tuple[Any, ...], background: bool) -> str:
        if args[0] == "first":  # (a document the child takes long over)
            release.wait(30)
        return str(args[0])

    monkeypatch.setattr(parser._Child, "_call", held)
    monkeypatch.setattr(parser, "TIMEOUT_S", 0.5)

    def call(name: str) -> None:
        try:
            done.append(parser.run(str, BIG, name))
        except Unavailable:
            done.append(f"{name} gave up")

    names = ["first", "quitter", *(f"t{k}" for k in range(5))]
    threads = [threading.Thread(target=call, args=(n,)) for n in names]
    base = parser._child._tickets
    for k, t in enumerate(threads):  # each asks once the one before has asked
        t.start()
        wait_for(lambda k=k: parser._child._tickets == base + k + 1, 30, f"thread {k} to ask")
        if k == 1:
            wait_for(lambda: "quitter gave up" in done, 30, "the quitter to give up")
    release.set()
    for t in threads:
        t.join(30)
    assert done == ["quitter gave up", "first", "t0", "t1", "t2", "t3", "t4"]


def test_a_child_that_does_not_answer_is_killed_and_the_call_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every wait is bounded: a stopped child (or one on a document far too long) gets
    its caller UNAVAILABLE after TIMEOUT_S, and is replaced; a caller waiting for its
    turn meanwhile is refused after TIMEOUT_S too (before, both waited for ever)."""
    monkeypatch.setattr(parser, "TIMEOUT_S", 0.5)
    stopped = parser.run(os.getpid, BIG)
    os.kill(stopped, signal.SIGSTOP)
    failed: dict[str, BaseException] = {}

    def call(name: str) -> None:
        try:
            parser.run(os.getpid, BIG)
        except BaseException as e:
            failed[name] = e

    first, second = (threading.Thread(target=call, args=(n,)) for n in ("first", "second"))
    first.start()
    wait_for(lambda: parser._child._busy, 30, "the first to be in the child")
    second.start()
    first.join(30)
    second.join(30)
    assert isinstance(failed["first"], Unavailable)
    assert "did not answer within 0.5 s" in failed["first"].message
    if "second" in failed:  # its turn did not come in time (else: a new child answered)
        assert "was busy for 0.5 s" in str(failed["second"])
    assert not alive(stopped)
    assert parser.run(os.getpid, BIG) not in (0, stopped)


def test_an_online_document_never_waits_for_a_job_s_line(tmp_path: Path) -> None:
    """A job's lines are parsed in a child of their own: an online caller waited for the
    line in the one child (a hostile job's lines took 1.5 s each, and every online call
    waited 1.1-1.6 s). Here a job's line held in its child does not hold online ones."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    held: dict[str, str] = {}
    line = threading.Thread(target=lambda: held.update(
        line=parser.run(Path.read_text, BIG, gate, background=True)))  # fmt: skip
    line.start()
    try:
        wait_for(lambda: parser._jobs_child._busy, 30, "the job's child to hold the line")
        assert parser.run(os.getpid, BIG) == parser.child_pid() != parser.child_pid(True)
    finally:
        gate.write_text("go")
        line.join(30)
    assert held == {"line": "go"}


def test_a_short_bad_line_keeps_no_traceback_holding_its_document() -> None:
    """An error line is kept till written: its error held the parse's frames, the parsed
    line in them (16 error lines of 241 KB held 20.7 MB)."""
    cfg = model(max_batch_size=4, shape=(1,))
    line = chunks.decode(b'{"custom_id": "a", "inputs": 7}', 1, cfg, chunks.Limits())
    assert line.error is not None and line.custom_id == "a"
    assert line.error.__traceback__ is None and line.error.__context__ is None


def test_a_job_s_line_is_tried_again_on_a_new_child_when_one_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job's line has no deadline and cannot be sent again: a child that did not answer
    it is replaced and the line tried once more (an error line for a stalled child, in a
    job reported completed, before)."""
    monkeypatch.setattr(parser, "TIMEOUT_S", 0.5)
    stopped = parser.run(os.getpid, BIG, background=True)
    os.kill(stopped, signal.SIGSTOP)
    assert parser.run(os.getpid, BIG, background=True) not in (0, stopped)
    assert not alive(stopped)


def test_a_call_that_fails_halfway_through_a_frame_leaves_no_rest_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever stops a call mid-frame (here a MemoryError reading the answer), the child
    goes with it: the next caller read the rest of this one's answer as its own."""
    first = parser.run(os.getpid, BIG)
    real = parser._receive

    def failing(fd: int, deadline: float) -> bytearray:
        monkeypatch.setattr(parser, "_receive", real)
        raise MemoryError

    monkeypatch.setattr(parser, "_receive", failing)
    with pytest.raises(MemoryError):
        parser.run(len, BIG, "abc")
    assert not alive(first)
    assert parser.run(len, BIG, "four") == 4


def test_a_server_that_is_pid_1_gets_a_child() -> None:
    """In a container the server is often pid 1: the child took a parent of pid 1 for
    one gone, and every large document was parsed on the frontend's threads."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a pid namespace")
    code = ("import os; from batchd.server import parser; assert os.getpid() == 1; "
            f"print(parser.run(os.getpid, {BIG}))")  # fmt: skip
    pid_1 = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code]
    done = subprocess.run(pid_1, capture_output=True, text=True, timeout=60)
    if done.returncode and "unshare" in done.stderr:
        pytest.skip(f"no pid namespace here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 1, done.stderr


def test_a_generate_body_over_the_json_limit_is_refused_here() -> None:
    cfg = model(max_batch_size=4, shape=(1,))
    with pytest.raises(InvalidInput, match="more than 8388608"):
        _aside(parse_generate)(b" " * (9 << 20), cfg)
    assert parser.child_pid() == 0


def test_a_document_the_child_refuses_is_freed_with_the_refusal_not_by_a_collection() -> None:
    """The child's refusal was raised from a frame its traceback keeps, holding itself
    and the document: a cycle only the collector breaks. An inflated body counts against
    every request's budget until freed: four bad 1 MiB gzip bodies (1 KB each sent)
    made every compressed request 429 until a collection happened to run."""
    budget = InflateBudget(10**8)
    inflating = Inflating(gzip.compress(b"[" * 1_000_000), "gzip", 2**24, budget)
    inflating.finish()
    body, held = inflating.out, budget.held
    del inflating
    assert held == 1_000_000
    gc.disable()
    try:
        with pytest.raises(InvalidInput):
            parser.run(parse_infer, len(body), body, None, "m", "1", DEFAULT_LIMITS)
        del body
        assert budget.held == 0
    finally:
        gc.enable()
