"""`batchd jobs`: submit a JSONL file of requests to a server, watch it, fetch its results.

    batchd jobs submit --url HOST:PORT --model NAME FILE.jsonl   # prints the job id only
    batchd jobs status ID [--json]
    batchd jobs list [--status S] [--json]
    batchd jobs wait ID          # a progress bar on a terminal; exit 0 iff completed
    batchd jobs results ID -o OUT.jsonl
    batchd jobs cancel ID

Exit status: 0 done (for `wait`: the job completed), 1 the job failed or was
cancelled (`wait`), 2 a usage error or an error from the server (on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from batchd.client.client import Client
from batchd.client.errors import BatchdClientError, ServerUnavailable
from batchd.client.jobs import Job, ResultsFile
from batchd.client.options import add_security, connection
from batchd.client.retry import RetryPolicy

POLL_S = 0.5
RETRY_MAX_S = 5.0  # the longest pause between polls that failed UNAVAILABLE
PLAIN_EVERY_S = 30.0  # a progress line this often when stderr is not a terminal
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _shown(text: object) -> str:
    """A server's text for a terminal: control characters (an escape sequence that
    would retitle, clear or hide it) written as escapes, `\\x1b`."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], str(text))


def _json(job: Job) -> str:
    """A job as one line of JSON: a server's NaN or inf as null, not as the `NaN` that
    Python writes and JSON readers refuse."""
    fields = dataclasses.asdict(job)
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in fields.items()})  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchd jobs", description=__doc__.splitlines()[0])
    verbs = p.add_subparsers(dest="verb", required=True)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=help)
        v.add_argument("--url", default="127.0.0.1:8001", help="the server (HOST:PORT)")
        v.add_argument("--timeout", type=float, default=60.0,
                       help="seconds per call (an upload or a download has no limit)")  # fmt: skip
        add_security(v)
        return v

    s = verb("submit", "upload a JSONL file of requests; prints the job id")
    s.add_argument("--model", required=True)
    s.add_argument("--model-version", default="", help="a version ('': the loaded one)")
    s.add_argument("file", metavar="FILE.jsonl")
    s.add_argument(
        "--idempotency-key", metavar="KEY",
        help="the same KEY again answers the job it made, never a second (default: a new one)",
    )  # fmt: skip
    s.set_defaults(timeout=None)  # an upload takes as long as the file
    for name, what in (
        ("status", "a job's status, counts, rate and ETA"),
        ("cancel", "stop a job, keeping its results"),
    ):
        v = verb(name, what)
        v.add_argument("id")
        v.add_argument("--json", action="store_true", help="print the job as JSON")
    ls = verb("list", "your jobs, newest first")
    ls.add_argument("--status", default="", help="only jobs in this status")
    ls.add_argument("--json", action="store_true", help="print JSON lines")
    w = verb("wait", "follow a job until it ends; exit 0 iff it completed (--timeout: how "
             "long polls may fail UNAVAILABLE, as while a server restarts)")  # fmt: skip
    w.add_argument("id")
    r = verb("results", "download a job's results (so far, while it runs; --timeout: how "
             "long it may be cut off, as while a server restarts)")  # fmt: skip
    r.add_argument("id")
    r.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="'-': stdout")
    return p


def _when(t: float) -> str:
    try:  # (a server's number: a time no calendar holds is shown as it came)
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"
    except (OverflowError, ValueError, OSError):
        return f"{t!r}"


def _duration(s: float | None) -> str:
    if s is None or not math.isfinite(s):  # (a server's number: inf and nan are unknown)
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def describe(job: Job) -> str:
    lines = [
        f"id        {job.id}",
        f"model     {job.model}{' version ' + job.version if job.version else ''}",
        f"status    {job.status}{': ' + job.error if job.error else ''}",
        f"progress  {job.done:,} of {job.total:,} ({job.completed:,} answered, "
        f"{job.failed:,} failed)",
        f"created   {_when(job.created_at)}",
        f"started   {_when(job.started_at)}",
        f"finished  {_when(job.finished_at)}",
    ]
    if job.status == "running":
        lines.append(
            f"rate      {job.rows_per_second:,.0f} lines/s, ETA {_duration(job.eta_seconds)}"
        )
    return "\n".join(_shown(line) for line in lines)


def bar(job: Job, width: int = 30) -> str:
    share = job.done / job.total if job.total else 1.0
    filled = int(share * width)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {share:6.1%} {job.done:,}/{job.total:,} "
        f"{job.rows_per_second:,.0f}/s ETA {_duration(job.eta_seconds)} {_shown(job.status)}"
    )


def wait(client: Client, job_id: str, out: TextIO, give_up_s: float | None = None,
         sleep: Callable[[float], None] = time.sleep) -> Job:  # fmt: skip
    """Poll until the job ends, drawing a bar on a terminal (a line now and then elsewhere).
    A poll answered UNAVAILABLE (a replica or the jobs database restarting) is tried
    again with backoff, until polls have failed for `give_up_s` (None: for ever)."""
    tty = out.isatty()
    shown = -PLAIN_EVERY_S
    failing_since: float | None = None
    while True:
        try:
            job = client.job(job_id)
        except ServerUnavailable as e:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                out.write(f"{chr(10) if tty else ''}job {job_id}: {_shown(e)}; asking again\n")
            elif give_up_s is not None and now - failing_since >= give_up_s:
                raise
            pause = min(RETRY_MAX_S, POLL_S * 2 ** min(10, int(now - failing_since).bit_length()))
            left = math.inf if give_up_s is None else failing_since + give_up_s - now
            sleep(max(0.0, min(pause, left)))  # (then one more poll, at the time given)
            continue
        failing_since = None
        now = time.monotonic()
        if tty:
            out.write("\r\033[K" + bar(job))
            out.flush()
        elif job.ended or now - shown >= PLAIN_EVERY_S:
            shown = now
            out.write(bar(job) + "\n")
        if job.ended:
            if tty:
                out.write("\n")
            return job
        time.sleep(POLL_S)


def _print_job(job: Job, as_json: bool) -> None:
    print(_json(job) if as_json else describe(job))


def _list(jobs: list[Job], as_json: bool) -> None:
    for job in jobs:
        if as_json:
            print(_json(job))
            continue
        done = f"{job.done:>10,}/{job.total:<10,}"
        print(_shown(f"{job.id}  {job.status:10}  {job.model:16}  {done}  {_when(job.created_at)}"))


def run(args: argparse.Namespace) -> int:
    # retries: status, list, cancel and results are idempotent, a submission goes with
    # its idempotency key; their backoff spans ~10 s (3 retries at 50 ms spanned 0.35 s,
    # less than a server's restart or a balancer's reload)
    with Client(args.url, timeout=args.timeout, **connection(args)) as c:
        c.retry = RetryPolicy(retries=10, base_s=0.1)
        if args.verb == "submit":
            key = args.idempotency_key
            print(_shown(c.submit_job(args.model, args.file, args.model_version,
                                      idempotency_key=key).id))  # fmt: skip
        elif args.verb == "status":
            _print_job(c.job(args.id), args.json)
        elif args.verb == "cancel":
            _print_job(c.cancel_job(args.id), args.json)
        elif args.verb == "list":
            _list(c.jobs(status=args.status), args.json)
        elif args.verb == "wait":
            job = wait(c, args.id, sys.stderr, give_up_s=args.timeout)
            if job.status != "completed":
                why = f": {job.error}" if job.error else ""
                print(_shown(f"job {job.id} {job.status}{why}"), file=sys.stderr)
                return 1
        elif args.verb == "results":
            _results(c, args)
    return 0


def _results(c: Client, args: argparse.Namespace) -> None:
    out: Any = sys.stdout.buffer if args.output == "-" else args.output
    then = _job_now(c, args.id)
    count = c.job_results(args.id, out, give_up_s=args.timeout)
    if args.output != "-":
        print(f"{count:,} lines written to {args.output}", file=sys.stderr)
    if then is None:  # (not ended now: nor was it then)
        then = _job_now(c, args.id)
    if then is not None and not then.ended:  # (a script's `submit; results` got part, and 0)
        print(_shown(f"job {then.id} is {then.status} ({then.done:,} of {then.total:,} lines "
                     "then): these are its results so far; `batchd jobs wait` for all of them"),
              file=sys.stderr)  # fmt: skip


def _job_now(c: Client, job_id: str) -> Job | None:
    """The job, asked once (the download waits out a restart, not this); None if not."""
    policy, c.retry = c.retry, RetryPolicy()
    try:
        return c.job(job_id)
    except BatchdClientError:
        return None
    finally:
        c.retry = policy


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM: the results' .partial removed, and out at once. An exception raised
    here lands wherever the main thread is, inside gRPC's calls too, and left its
    channel's close() waiting forever (1 SIGTERM in 100 early in a download)."""
    for partial in list(ResultsFile.writing):
        partial.unlink(missing_ok=True)
    with contextlib.suppress(Exception):  # (a print the signal cut: its lock is held)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # (called from a thread: not)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return run(args)
    except BatchdClientError as e:
        print(f"batchd jobs {args.verb}: {_shown(e)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # (ValueError: a URL, a certificate without its key)
        print(f"batchd jobs {args.verb}: {_shown(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.verb == "wait":
            print(f"\nstopped watching; job {args.id} goes on", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
