"""`--frontends N`: frontend 0's /metrics gathers the other frontends'.

Each child frontend answers /metrics on a private Unix socket in frontend 0's
folder (frontends.py names them); on each scrape frontend 0 asks them all at
once and labels every sample `frontend` (its index, 0 for its own), so
`sum without (frontend)` counts the whole server. What another process answers
is data: one that does not answer whole and in time is left out of that scrape,
and its text is parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger("batchd.metrics")
ANSWER_S = 2.0  # each sibling's answer is waited for this long, at most
# Frontend 0's alone, unlabelled: the jobs store's counts, which every frontend reads, and
# the workers, which it owns (a child names them by id, a new series for each restart)
WHOLE = frozenset({"batchd_jobs", "batchd_worker_up", "batchd_worker_restarts"})
MAX_SCRAPE_BYTES = 64 * 2**20  # a sibling's /metrics larger than this is left out
_left_out: set[str] = set()  # siblings' sockets whose metrics the last scrape left out


async def gathered(registry: CollectorRegistry, siblings: Sequence[str]) -> bytes:
    """The exposition of `registry`; with `siblings`, also of each sibling's /metrics
    (frontends 1.., asked at once, each given ANSWER_S, parsed off the loop), every
    sample labelled with its frontend's index, but for the WHOLE families, frontend
    0's alone. A sibling that does not answer whole and in time (restarting, hung) is
    left out of the scrape: a WARNING when it first is (but for one not listening:
    starting, restarting), INFO when it is back."""
    if not siblings:
        return generate_latest(registry)
    asked = [asyncio.wait_for(_scrape(path), ANSWER_S) for path in siblings]
    answers = await asyncio.gather(*asked, return_exceptions=True)
    merged: dict[str, Metric] = {}

    def add(families: Iterable[Metric], index: int) -> None:
        for f in families:
            if index and f.name in WHOLE:
                continue
            label = {} if f.name in WHOLE else {"frontend": str(index)}
            into = merged.setdefault(f.name, Metric(f.name, f.documentation, f.type, f.unit))
            into.samples += [s._replace(labels={**s.labels, **label}) for s in f.samples]

    add(registry.collect(), 0)
    for index, (path, answer) in enumerate(zip(siblings, answers, strict=True), 1):
        try:
            if isinstance(answer, BaseException):
                raise answer
            add(await asyncio.to_thread(_parsed, answer), index)
        except Exception as e:  # (another process's answer: data, never this scrape's end)
            # (one not listening yet, or restarting, frontend 0 logs as it starts it)
            absent = isinstance(e, FileNotFoundError | ConnectionRefusedError)
            say = log.debug if path in _left_out or absent else log.warning
            say("frontend %d's metrics are left out of this scrape: %.200r", index, e)
            _left_out.add(path)
            continue
        if path in _left_out:
            _left_out.discard(path)
            log.info("frontend %d's metrics are gathered again", index)
    return generate_latest(_Fixed(list(merged.values())))


async def _scrape(path: str) -> str:
    """GET /metrics from a sibling's socket: the body, all of it (Content-Length)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: batchd\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"\r\nContent-Length: *(\d{1,12})\r\n", head)
        if not head.startswith(b"HTTP/1.1 200 ") or length is None:
            raise ConnectionError(f"answered {head[:40]!r}")
        if (size := int(length.group(1))) > MAX_SCRAPE_BYTES:
            raise ConnectionError(f"answered {size} bytes, over {MAX_SCRAPE_BYTES}")
        return (await reader.readexactly(size)).decode()
    finally:
        writer.close()


@dataclass(frozen=True)
class _Fixed(Collector):
    families: list[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


def _parsed(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))
