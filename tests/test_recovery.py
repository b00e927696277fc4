"""recovery.after_error: a model error is pinned on a request only when that request
ran alone in its forward."""

from __future__ import annotations

import asyncio

import pytest

from batchd.protos.model_config import ModelConfig
from batchd.server import recovery
from batchd.server.errors import InvalidInput, ModelFailed
from batchd.server.flow import StepStream
from batchd.server.request import Batch, Request
from tests.conftest import model, run, stepwise_model
from tests.conftest import request as _request


def request(cfg: ModelConfig) -> Request:
    """A request as the scheduler holds it: with its caller's future."""
    r = _request(cfg)
    r.future = asyncio.get_running_loop().create_future()
    return r


def test_a_request_alone_in_its_forward_gets_the_error() -> None:
    async def body() -> None:
        r = request(model())
        assert recovery.after_error(Batch(1, r.model, [r], 0.0), "w", "boom", 1) == []
        with pytest.raises(ModelFailed, match="raised on worker w: boom"):
            r.future.result()

    run(body)


def test_inputs_the_model_refused_are_the_caller_s_fault_once_it_ran_alone() -> None:
    """InvalidInput (INVALID_ARGUMENT) for a lone request whose model refused its
    inputs; in a forward of several, where any row may be at fault, a retry alone."""

    async def body() -> None:
        r = request(model())
        assert recovery.after_error(Batch(1, r.model, [r], 0.0), "w", "no", 1, True) == []
        with pytest.raises(InvalidInput, match=r"^model 'm' refused the inputs: no$"):
            r.future.result()
        shared = request(model())
        assert recovery.after_error(Batch(2, r.model, [shared], 0.0), "w", "no", 3, True) == [
            shared
        ]
        assert shared.suspect and not shared.future.done()

    run(body)


def test_a_request_whose_batch_the_worker_merged_with_another_is_retried_alone() -> None:
    async def body() -> None:
        r = request(model())
        assert recovery.after_error(Batch(1, r.model, [r], 0.0), "w", "boom", 2) == [r]
        assert r.suspect and not r.future.done()

    run(body)


def test_the_last_request_waiting_of_a_batch_of_two_is_retried_alone() -> None:
    """The other's caller left before the model raised: it may be the poison one."""

    async def body() -> None:
        cfg = model()
        left, waiting = request(cfg), request(cfg)
        left.future.cancel()
        assert recovery.after_error(Batch(1, cfg, [left, waiting], 0.0), "w", "boom", 2) == [
            waiting
        ]
        assert waiting.suspect and not waiting.future.done()

    run(body)


def test_a_suspect_that_fails_is_answered_whatever_its_forward_held() -> None:
    async def body() -> None:
        r = request(model())
        r.suspect = True
        assert recovery.after_error(Batch(1, r.model, [r], 0.0, suspect=True), "w", "boom", 3) == []
        with pytest.raises(ModelFailed):
            r.future.result()

    run(body)


def test_a_worker_lost_while_it_loaded_a_model_charges_none_of_its_requests() -> None:
    """A reload whose load() was killed (out of memory) took its worker and the batches
    on it: each of 4 such reloads failed a request of another model, charged twice. Once
    for each request: a second such loss is charged."""

    async def body() -> None:
        r = request(model())
        r.attempts = recovery.MAX_ATTEMPTS - 1  # (one more charged loss would fail it)
        batch = Batch(1, r.model, [r], 0.0)
        assert recovery.after_loss([batch], "w", "exited", charged=False) == [r]
        # (a suspect: it runs where no load is, so that its next loss is its own)
        assert (r.attempts, r.suspect, r.future.done()) == (recovery.MAX_ATTEMPTS - 1, True, False)
        # once: a poison request on workers loading at their start does not go round for ever
        assert recovery.after_loss([batch], "w", "exited", charged=False) == []
        assert r.future.done()

    run(body)


def test_a_request_spared_beside_a_load_fails_at_its_next_loss_alone() -> None:
    """A loss as its worker loaded a model spares a request (the load may be the cause);
    its next, alone on a worker that loads nothing, is its own, and the spared one counts
    too, as a loss beside other requests would have: a poison whose first try came as
    its worker loaded ended three workers (review 54j), it ends two now. A loss that
    spared it for another reason (its worker's link cut) leaves it a second try alone."""

    async def body() -> None:
        told: list[Request] = []
        for loading, fails in ((True, True), (False, False)):
            r = request(model())
            batch = Batch(1, r.model, [r], 0.0)
            assert recovery.after_loss([batch], "w", "x", charged=False, loading=loading) == [r]
            back = recovery.after_loss([batch], "w", "x", True, lambda r, why: told.append(r))
            assert (back == [], r.future.done(), told == [r]) == (fails, fails, fails)
            if fails:
                assert "lost 2 times" in str(r.future.exception())
                told.clear()
        r = request(model())  # beside others (no `poisoned`): counted once, as before
        batch = Batch(1, r.model, [r], 0.0)
        recovery.after_loss([batch], "w", "x", charged=False, loading=True)
        assert recovery.after_loss([batch], "w", "x") == [r] and r.attempts == 1

    run(body)


def test_a_sequence_of_a_worker_lost_while_it_loaded_a_model_is_not_counted_once() -> None:
    """As a batch's requests: a reload's load() killed for want of memory took the
    worker; the sequences on it that had not streamed were each counted a loss."""

    async def body() -> None:
        cfg = stepwise_model()
        r = _request(cfg)
        r.future, r.stream = asyncio.get_running_loop().create_future(), StepStream(held=True)
        lost = Batch(1, cfg, [r], 0.0)
        assert recovery.after_sequence_loss([lost], "w", "x", charged=False) == [r]
        assert (r.attempts, r.spared) == (0, True)
        assert recovery.after_sequence_loss([lost], "w", "x", charged=False) == [r]
        assert r.attempts == 1  # (once)
        # Out of attempts, it is told to `poisoned` (core.lose gives one where it ran alone)
        told: list[tuple[Request, str]] = []

        def tell(r: Request, why: str) -> None:
            told.append((r, why))

        s = _request(cfg)
        s.future, s.stream = asyncio.get_running_loop().create_future(), StepStream()
        s.attempts = recovery.MAX_ATTEMPTS - 1
        lost = Batch(1, cfg, [s], 0.0)
        assert recovery.after_sequence_loss([lost], "w", "x", poisoned=tell) == []
        assert told == [(s, str(s.future.exception()))] and "lost 2 times" in told[0][1]

    run(body)


def test_sequences_that_stepped_are_not_counted_once_when_something_had_just_begun() -> None:
    """A sequence whose start() ends its worker's process beside sequences already
    stepping: they were each counted a loss, restarted beside it, lost again and
    failed. Those that had stepped when something began (a sequence with no output
    yet, or a batch in flight) are not counted the first time; the new one is."""

    async def body() -> None:
        cfg = stepwise_model()
        loop = asyncio.get_running_loop()

        def sequence(outputs: int) -> Batch:
            r = _request(cfg)
            r.future, r.stream = loop.create_future(), StepStream(held=True)
            r.stream.sent = outputs  # (what push() counts)
            return Batch(0, cfg, [r], 0.0)

        old, new = sequence(3), sequence(0)
        back = recovery.after_sequence_loss([old, new], "w", "killed")
        assert [r.attempts for r in back] == [0, 1] and old.requests[0].spared
        back = recovery.after_sequence_loss([old, sequence(0)], "w", "killed")  # (restarted,
        assert old.requests[0].attempts == 1  # it has not stepped since: counted now)
        steady = sequence(5)
        assert recovery.after_sequence_loss([steady], "w", "killed")[0].attempts == 1
        lone = sequence(5)  # ... unless a batch was in flight on it
        batch = Batch(9, model(), [request(model())], 0.0)
        assert recovery.after_sequence_loss([lone], "w", "killed", [batch])[0].attempts == 0

    run(body)
