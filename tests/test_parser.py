"""The JSON parser process (server/parser.py), driven from this test process: what runs
where, what crosses back, and a child that dies."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from batchd.server import parser
from batchd.server.errors import BatchdError, InvalidInput, QueueFull
from batchd.server.rest_codec import parse_infer
from tests.servers import alive

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
    msg, _ = parser.run(parse_infer, BIG, body, None, "m", "1")
    assert msg.model_name == "m" and msg.inputs[0].shape == [1, 2]
    assert msg.raw_input_contents[0] == b"\x00\x00\x80?\x00\x00\x00@"
    with pytest.raises(InvalidInput, match="input 'X': FP32 data holds numbers only, got a string"):
        bad = b'{"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": ["a"]}]}'
        parser.run(parse_infer, BIG, bad, None, "m", "1")


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
