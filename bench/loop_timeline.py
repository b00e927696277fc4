"""Where a saturated frontend's event loop waits (issue 19, target 2).

Serves tiny without its `[batching]` table, records a timeline inside the
frontend (each arrival, each batch sent with its rows, each reply, each time the
loop blocked in select()), drives it with perf_analyzer at `--concurrency`
callers and says, for the middle of the run, what share of the time the loop
was idle and in which state: how many rows were then at the worker, whether
requests were queued. And the worker's round trip (a batch sent to its reply
read) by batch size. Recording costs the loop a little: batches come out
smaller than without it.

    .venv/bin/python bench/loop_timeline.py --pa PATH [--concurrency 32] [--json F]
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

WINDOW = (5.0, 10.0)  # seconds after the first arrival: past warm-up, inside the run


def record(out: Path, serve_args: list[str]) -> int:
    """Run `batchd serve serve_args` with the recorders installed; write the
    timeline to `out` when the server exits."""
    from batchd.server import cli, core, loopload

    events: list[tuple[str, float, float]] = []
    clock = time.perf_counter
    select, submit = loopload.TimedSelector.select, core.Core.submit
    send, on_reply = core.Core.send, core.Core._on_reply

    def timed_select(self: Any, timeout: float | None = None) -> Any:
        start = clock()
        try:
            return select(self, timeout)
        finally:
            if timeout != 0:
                events.append(("idle", start, clock()))

    def wrap(kind: str, fn: Any, rows: bool = False) -> Any:
        def recorded(self: Any, *args: Any) -> Any:  # once it returned: not a refused request
            at = clock()
            result = fn(self, *args)
            events.append((kind, at, len(args[1]) if rows else 0))
            return result

        return recorded

    loopload.TimedSelector.select = timed_select  # type: ignore[method-assign]
    core.Core.submit = wrap("arrival", submit)  # type: ignore[method-assign]
    core.Core.send = wrap("send", send, rows=True)  # type: ignore[method-assign]
    core.Core._on_reply = wrap("reply", on_reply)  # type: ignore[method-assign]
    atexit.register(lambda: out.write_text(json.dumps(events)))
    return cli.main(["serve", *serve_args])


def analyse(events: list[list[Any]]) -> dict[str, Any]:
    events.sort(key=lambda e: e[1])
    first = next(e[1] for e in events if e[0] == "arrival")
    start, end = first + WINDOW[0], first + WINDOW[1]
    span = end - start
    idle: Counter[str] = Counter()
    in_flight: deque[tuple[float, int]] = deque()  # one worker: replies come in order
    queued, arrivals, sent, batches = 0, 0, 0, 0
    trips: dict[str, list[float]] = {}
    for kind, at, value in events:
        if at >= end:
            break
        inside = at >= start
        if kind == "arrival":
            queued += 1
            arrivals += inside
        elif kind == "send":
            in_flight.append((at, int(value)))
            queued -= int(value)
            sent, batches = sent + inside * int(value), batches + inside
        elif kind == "reply" and in_flight:
            at_send, rows = in_flight.popleft()
            if inside:
                band = f"{rows // 8 * 8}-{rows // 8 * 8 + 7} rows"
                trips.setdefault(band, []).append((at - at_send) * 1e6)
        elif kind == "idle" and inside:
            at_worker = sum(rows for _, rows in in_flight)
            state = "nothing at the worker" if not at_worker else f"{at_worker} rows at the worker"
            idle[state + (", requests queued" if queued > 0 else "")] += value - at
    return {
        "req_s": round(arrivals / span),
        "rows_per_batch": round(sent / max(1, batches), 1),
        "loop_idle_share": round(sum(idle.values()) / span, 3),
        "idle_share_by_state": {k: round(v / span, 3) for k, v in idle.most_common(8)},
        "worker_round_trip_us_p50": {
            band: round(statistics.median(v)) for band, v in sorted(trips.items()) if len(v) >= 5
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from peers import PY, untuned
    from run import perf_analyzer, running

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pa", required=True, help="perf_analyzer")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchd-timeline-") as tmp:
        out = Path(tmp) / "timeline.json"
        serve = [PY, __file__, "--record", str(out), "--model-repository",
                 str(untuned(Path(tmp) / "models")), "--grpc-port", "18191", "--metrics-port",
                 "-1", "--log-level", "WARNING", "--jobs-dir", f"{tmp}/jobs"]  # fmt: skip
        with running(serve, 18191):
            measured = perf_analyzer(args.pa, 18191, "tiny", args.concurrency, 4000)
        r = {"concurrency": args.concurrency, "perf_analyzer_req_s": measured["req_s"]}
        r |= analyse(json.loads(out.read_text()))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        sys.exit(record(Path(sys.argv[2]), sys.argv[3:]))
    main()
