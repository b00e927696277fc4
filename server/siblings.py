"""`--frontends N`: what the frontends ask each other, each on a private Unix socket
in frontend 0's folder (`sockets`): /metrics and ModelStatistics.

Frontend 0's /metrics asks every other frontend for its own on each scrape and
labels every sample `frontend` (its index, 0 for its own), so `sum without
(frontend)` counts the whole server. A ModelStatistics (gRPC, or HTTP's /stats),
whichever frontend it reaches, adds up every frontend's counts. What another
process answers is data: one that does not answer whole and in time is left out
of a scrape, and counts in statistics with its last answer; text is parsed off
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence

from batchd.protos import inference_pb2 as pb
from batchd.server import exposition

Stats = pb.ModelStatisticsResponse

log = logging.getLogger("batchd.metrics")
ANSWER_S = 2.0  # each sibling's answer is waited for this long, at most
# Frontend 0's alone, unlabelled: the jobs store's counts, which every frontend reads, and
# the workers, which it owns (a child names them by id, a new series for each restart)
WHOLE = frozenset({"batchd_jobs", "batchd_worker_up", "batchd_worker_restarts_total"})
MAX_SCRAPE_BYTES = 64 * 2**20  # a sibling's answer larger than this is left out
_left_out: set[str] = set()  # siblings' sockets whose metrics the last scrape left out
# Each sibling's last statistics, and what its runs before a restart counted: by its
# socket, model and version (statistics())
_last: dict[tuple[str, str, str], tuple[int, pb.ModelStatistics]] = {}  # (its pid, counts)
_gone: dict[tuple[str, str, str], pb.ModelStatistics] = {}


async def gathered(own: bytes, siblings: Sequence[str]) -> bytes:
    """The exposition `own`, this frontend's, and each sibling's /metrics (frontends 1..,
    asked at once, each given ANSWER_S), every sample labelled with its frontend's index,
    but for the WHOLE families, frontend 0's alone; parsed and merged off the loop. A
    sibling that does not answer whole and in time (restarting, hung) is left out of the
    scrape: a WARNING when it first is (but for one not listening: starting,
    restarting), INFO when it is back."""
    asked = [asyncio.wait_for(_ask(path, b"/metrics"), ANSWER_S) for path in siblings]
    answers = await asyncio.gather(*asked, return_exceptions=True)
    text, errors = await asyncio.to_thread(_merged, own, answers)
    for index, (path, e) in enumerate(zip(siblings, errors, strict=True), 1):
        if e is not None:  # (another process's answer: data, never this scrape's end)
            # (one not listening yet, or restarting, frontend 0 logs as it starts it)
            absent = isinstance(e, FileNotFoundError | ConnectionRefusedError)
            say = log.debug if path in _left_out or absent else log.warning
            say("frontend %d's metrics are left out of this scrape: %.200r", index, e)
            _left_out.add(path)
        elif path in _left_out:
            _left_out.discard(path)
            log.info("frontend %d's metrics are gathered again", index)
    return text


def _merged(
    own: bytes, answers: Sequence[bytes | BaseException]
) -> tuple[bytes, list[Exception | None]]:
    """gathered's exposition (on a thread of its own: it reads only `own` and `answers`),
    and what left out each answer, None for one merged."""
    merged = exposition.parse(own.decode(), 'frontend="0"', WHOLE)
    errors: list[Exception | None] = []
    for index, answer in enumerate(answers, 1):
        try:
            if isinstance(answer, BaseException):
                raise answer
            theirs = exposition.parse(answer.decode(), f'frontend="{index}"', WHOLE)
            exposition.merge(merged, {n: f for n, f in theirs.items() if n not in WHOLE})
            errors.append(None)
        except Exception as e:
            errors.append(e)
    return exposition.text(merged), errors


async def statistics(request: pb.ModelStatisticsRequest, own: Stats, remaining: float | None,
                     paths: Sequence[str]) -> Stats:  # fmt: skip
    """`own` (this frontend's answer to `request`) plus each other frontend's, asked at
    once (each given ANSWER_S, or half the call's `remaining` time if less: a call with
    a short deadline was failed whole by a sibling that hung; one that does not answer
    counts with its last answer, at DEBUG), and what each counted before it restarted
    (`_remember`)."""
    wait = ANSWER_S if remaining is None else min(ANSWER_S, max(remaining / 2, 0.001))
    what = b"/statistics/" + request.SerializeToString().hex().encode()
    asked = [asyncio.wait_for(_ask(path, what), wait) for path in paths]
    by_key = {(m.name, m.version): m for m in own.model_stats}
    for path, answer in zip(paths, await asyncio.gather(*asked, return_exceptions=True),
                            strict=True):  # fmt: skip
        try:
            if isinstance(answer, BaseException):
                raise answer
            run, theirs = int.from_bytes(answer[:8], "little"), answer[8:]  # (`answering`)
            for m in pb.ModelStatisticsResponse.FromString(theirs).model_stats:
                _remember(path, run, m)
        except Exception as e:  # (another process's answer: data)
            log.debug("%s's statistics are its last ones: %.200r", path, e)
        for (name, version), mine in by_key.items():  # (ours says which versions)
            if (last := _last.get((path, name, version))) is not None:
                add_statistics(mine, last[1])
            if (gone := _gone.get((path, name, version))) is not None:
                add_statistics(mine, gone)
    if not request.name and not request.version:  # ours names every version served: what
        served = {name for name, _ in by_key}  # was kept of a retired one goes, as our own
        for kept in (_last, _gone):  # Stats forgets it (an unloaded model's are kept)
            for key in [k for k in kept if k[1] in served and (k[1], k[2]) not in by_key]:
                del kept[key]
    return own


def _remember(path: str, run: int, m: pb.ModelStatistics) -> None:
    """A sibling's answer for one version, from its process `run`: kept as its last
    (used while it does not answer), and what its earlier runs counted kept too once
    it is another process, or its counts fell: the totals this frontend gives never go
    back, as a snapshot-to-snapshot delta needs (another frontend keeps its own)."""
    key = (path, m.name, m.version)
    if (last := _last.get(key)) is not None and (last[0] != run or any(
            n < was for n, was in zip(_counts(m), _counts(last[1]), strict=True))):  # fmt: skip
        gone = _gone.setdefault(key, pb.ModelStatistics(name=m.name, version=m.version))
        add_statistics(gone, last[1])
    _last[key] = run, m


def _counts(m: pb.ModelStatistics) -> tuple[int, int, int]:
    """What only grows while a frontend runs: one that fell, it began again."""
    return m.inference_count, m.inference_stats.success.count, m.inference_stats.fail.count


def add_statistics(into: pb.ModelStatistics, other: pb.ModelStatistics) -> None:
    """Add `other`'s counts and times (another frontend's, of the same version) to `into`."""
    into.last_inference = max(into.last_inference, other.last_inference)
    into.inference_count += other.inference_count
    into.execution_count += other.execution_count
    for f in pb.InferStatistics.DESCRIPTOR.fields:
        _add(getattr(into.inference_stats, f.name), getattr(other.inference_stats, f.name))
    sizes = {b.batch_size: b for b in into.batch_stats}
    for b in other.batch_stats:
        if (mine := sizes.get(b.batch_size)) is None:
            mine = sizes[b.batch_size] = into.batch_stats.add(batch_size=b.batch_size)
        for name in ("compute_input", "compute_infer", "compute_output"):
            _add(getattr(mine, name), getattr(b, name))
    into.batch_stats.sort(key=lambda b: b.batch_size)


def _add(into: pb.StatisticDuration, other: pb.StatisticDuration) -> None:
    into.count += other.count
    into.ns += other.ns


def answering(
    statistics: Callable[[pb.ModelStatisticsRequest], Awaitable[Stats]],
) -> Callable[[bytes], Awaitable[bytes]]:
    """What answers the others' /statistics (metrics.start_metrics): this process's
    pid (8 bytes: which run of the frontend counted), then `statistics` of the request
    they send, serialized; none (nothing to add) for one it refuses."""
    run = os.getpid().to_bytes(8, "little")

    async def answer(raw: bytes) -> bytes:
        try:
            asked = pb.ModelStatisticsRequest.FromString(raw)
            answered: bytes = (await statistics(asked)).SerializeToString()
            return run + answered
        except Exception:  # (an unknown model: the asking frontend refused it already)
            return run

    return answer


def sockets(folder: str, count: int) -> list[str]:
    """Each frontend's socket, by index (frontend 0 makes the folder, 0700). Named
    shorter than the workers' sockets there, so that frontends.endpoints' check of
    their length holds for these too (a TMPDIR where frontend-0.sock did not fit
    failed every start with "AF_UNIX path too long")."""
    return [f"{folder}/fe-{i}.sock" for i in range(count)]


def others(own: str, count: int) -> list[str]:
    """The other frontends' sockets, of `count`, beside this one's (`own`)."""
    return [s for s in sockets(os.path.dirname(own), count) if s != own]


async def _ask(path: str, what: bytes) -> bytes:
    """GET `what` from a sibling's socket: the body, all of it (Content-Length)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(b"GET " + what + b" HTTP/1.1\r\nHost: batchd\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"\r\nContent-Length: *(\d{1,12})\r\n", head)
        if not head.startswith(b"HTTP/1.1 200 ") or length is None:
            raise ConnectionError(f"answered {head[:40]!r}")
        if (size := int(length.group(1))) > MAX_SCRAPE_BYTES:
            raise ConnectionError(f"answered {size} bytes, over {MAX_SCRAPE_BYTES}")
        return await reader.readexactly(size)
    finally:
        writer.close()
