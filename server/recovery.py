"""Recovery: what becomes of the requests of a batch that failed or lost its worker.
The policy has one owner, this module:

  * A request rides on at most MAX_ATTEMPTS batches whose worker is lost (a crash,
    silence, a batch past its execution limit); the last such loss fails it with
    ModelFailed naming the cause. A worker lost while it loaded a model, or while
    a step-wise sequence had just begun there (its `start()` may be the cause), is
    not counted against its batches' requests, once (a reload killed for want of
    memory failed requests of other models); they are retried as suspects. So a
    request runs at least once and at most twice, counting only runs on a worker
    that was lost. The same inputs sent again are then refused unrun for a while
    (quarantine.py), where the last loss was theirs alone.
  * Every request of a lost worker's batches, and of a forward of several whose
    model raised (a batch of several, or batches the worker merged), becomes a
    *suspect*: it is retried alone, on an idle worker that takes nothing else
    meanwhile. An innocent request that shared a batch
    with a poison one is charged once and its lone retry succeeds; the poison
    request kills one more worker at most, then fails; a model error is pinned
    on the request that causes it.
  * A request whose answer is more than a response may carry, from a forward of
    several, is retried alone too (`answer`): another's rows may have widened it.
  * A suspect that fails alone is answered with the failure: INVALID_ARGUMENT
    where the model refused its inputs (batchd.worker.InputRefused),
    RESOURCE_EXHAUSTED where an output was past what a response may carry (the
    worker's check, wire.proto's max_response_bytes), else INTERNAL.

  * A step-wise model's sequence on a lost worker is retried on another worker if
    it has streamed nothing yet (attempts counted as above; never a suspect: it
    shares no batch, and a worker running sequences without end would keep one
    waiting for ever). Where something on the worker had just begun (a sequence
    with no output yet, or a batch was in flight), those that had stepped are not
    counted, once: the poison is likelier what began (in `start`), and counted, an
    innocent restarted beside it was lost twice and failed. One that has streamed
    fails with UNAVAILABLE naming how many outputs its caller got: a sequence
    cannot resume where it was. A unary call's
    outputs are held for one answer at the end (StepStream.held): its caller has
    seen none, so it starts over like one that streamed nothing, what its lost run
    gave dropped (StepStream.restart), and its answer holds the new run's only.

Where the suspect flag is read: plan.py sends a suspect alone, decision.py waits
for an idle worker for it, a settled one for a while (lanes.settle_by; pool.choose:
else one where no sequence runs, if one is),
pool.WorkerHandle.exclusive keeps a worker running one from taking a staged batch
or starting a sequence beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from batchd.server.errors import InvalidInput, ModelFailed, ResponseTooLarge, Unavailable
from batchd.server.request import Batch, Request, Tensor

MAX_ATTEMPTS = 2  # batches a request may ride on that lose their worker


def after_loss(
    batches: Iterable[Batch],
    worker: str,
    reason: str,
    charged: bool = True,
    poisoned: Callable[[Request, str], None] | None = None,
    loading: bool = False,
    sees: bool = True,
) -> list[Request]:
    """The lost worker's requests to retry, as suspects; those out of attempts fail,
    each told to `poisoned` with its error (given only where it ran alone: quarantine).
    Not `charged` (the worker was loading a model: a load() that hung or was killed, out
    of memory, may be the cause; or a sequence had just begun there), they go back
    uncounted, once each, as suspects (a poison request on workers that load at their
    start would otherwise go round for ever). `loading`: a load was the other suspect;
    `sees`: this frontend sees every load on that worker (not one shared by frontends:
    another's load looked like none, and an innocent failed: reviews 55e, 55f)."""
    back: list[Request] = []
    for batch in batches:
        for r in batch.requests:
            if r.future.done():
                continue
            r.settle_from = 0.0  # (a wait of its own for a settled worker: lanes.settle_by)
            if not charged and not r.spared:
                r.spared = r.suspect = True
                r.loaded_beside = loading and sees
                back.append(r)
                continue
            # Alone where it died (`poisoned` given), a loss that spared it beside a load
            # counts too, as one beside other requests would have: the death is its own.
            # Else a poison whose first try came as its worker loaded ended three workers,
            # not two (review 54j). (Not one that spared it as its link was cut: no suspect)
            r.attempts += 2 if poisoned is not None and r.loaded_beside and sees else 1
            if r.attempts >= MAX_ATTEMPTS:
                why = (
                    f"model {batch.model.name!r}: the worker running this request was "
                    f"lost {r.attempts} times (last: {worker}: {reason}); not retried again"
                )
                r.future.set_exception(ModelFailed(why))
                if poisoned is not None:
                    poisoned(r, why)
            else:
                r.suspect = True
                back.append(r)
    return back


def after_error(
    batch: Batch, worker: str, error: str, forward_rows: int = 0, invalid: bool = False,
    too_large: bool = False,
) -> list[Request]:  # fmt: skip
    """A batch whose model raised. A request that ran alone is answered with the error:
    InvalidInput where the model refused its inputs (`invalid`), ResponseTooLarge where an
    output was past what a response may carry (`too_large`), else ModelFailed; if
    the forward held others too (the batch's other requests, whether or not their
    callers are still waiting, or, `forward_rows` says, the batches the worker merged
    into it), each request still waiting is retried alone (returned, as suspects)."""
    pending = [r for r in batch.requests if not r.future.done()]
    merged = not batch.suspect and forward_rows > sum(r.rows for r in batch.requests)
    if len(batch.requests) > 1 or merged:  # (a suspect's batch is never merged: `alone`)
        for r in pending:
            r.suspect, r.settle_from = True, 0.0
        return pending
    failed = (
        InvalidInput(f"model {batch.model.name!r} refused the inputs: {error}")
        if invalid
        else ResponseTooLarge(f"model {batch.model.name!r}: {error}")
        if too_large
        else ModelFailed(f"model {batch.model.name!r} raised on worker {worker}: {error}")
    )
    for r in pending:
        r.future.set_exception(failed)
    return []


def answer(batch: Batch, results: Sequence[list[Tensor]], most: int,
           forward_rows: int = 0) -> list[Request]:  # fmt: skip
    """Answer a batch's requests still waiting with their `results`, but for those whose
    answer is more than `most` bytes (what a response may carry; 0: any) where the
    forward held others: a neighbour's rows may have widened a variable output dim
    (rows of 1 float beside one of 100,000 got 100,000 each, and RESOURCE_EXHAUSTED,
    review 57f). Those are returned, suspects, to run alone: their answer may fit then."""
    crowded = len(batch.requests) > 1 or forward_rows > sum(r.rows for r in batch.requests)
    back = []
    for r, result in zip(batch.requests, results, strict=True):
        if r.future.done():
            continue
        if crowded and most and not r.background and (
                sum(len(t.data) for t in result if t.name in r.outputs) > most):  # fmt: skip
            r.suspect, r.settle_from = True, 0.0
            back.append(r)
        else:
            r.future.set_result(result)
    return back


def after_sequence_loss(sequences: Iterable[Batch], worker: str, reason: str,
                        batches: Sequence[Batch] = (), charged: bool = True,
                        poisoned: Callable[[Request, str], None] | None = None,
                        ) -> list[Request]:  # fmt: skip
    """A lost worker's sequences: those to start again elsewhere; the others fail, one
    out of attempts told to `poisoned` with its error (given only where it ran alone).
    `batches`: those in flight on it too. Not `charged` (it was loading a model), each
    is not counted, once, as batches."""
    live = [seq.requests[0] for seq in sequences if not seq.requests[0].future.done()]
    began = batches or not all(_stepped(r) for r in live)
    back: list[Request] = []
    for r in live:
        stream = r.stream
        assert stream is not None, "a sequence always has its stream"
        if (not charged or (began and _stepped(r))) and not r.spared:
            r.spared = True  # (not the likelier cause: once)
        else:
            r.attempts += 1
        streamed = 0 if stream.held else stream.sent
        if streamed:
            r.future.set_exception(Unavailable(
                f"model {r.model.name!r}: the worker running this sequence was lost "
                f"({worker}: {reason}) after {streamed} output(s) were streamed; a "
                "sequence cannot resume on another worker, retry it"))  # fmt: skip
            stream.close()
        elif r.attempts >= MAX_ATTEMPTS:
            why = (f"model {r.model.name!r}: the worker running this sequence was lost "
                   f"{r.attempts} times (last: {worker}: {reason}); not retried again")  # fmt: skip
            r.future.set_exception(ModelFailed(why))
            stream.close()
            if poisoned is not None:
                poisoned(r, why)
        else:
            stream.worker, stream.seq_id = None, 0
            stream.restart()
            back.append(r)
    return back


def begun(sequences: Iterable[Batch]) -> bool:
    """Whether one of a lost worker's sequences had just begun (no output yet in this
    run): it may have ended the worker as well as a batch beside it."""
    return not all(_stepped(s.requests[0]) for s in sequences)


def _stepped(r: Request) -> bool:
    """Whether sequence `r` has given outputs in this run on its worker."""
    assert r.stream is not None, "a sequence always has its stream"
    return r.stream.gave
