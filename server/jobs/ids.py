"""A job file's custom_ids checked for duplicates, in a process of its own.

Reading every line of a file of millions, in Python, on a thread of the frontend
took the GIL from the event loop over and over (online calls waited 0.4 to 1 s
behind a few uploads' checks), parsed each line whole beside the loop's memory,
and held the process's exit until it ended. So each check is a child process
(`python -P -m batchd.server.jobs.ids FILE SCRATCH PID`, at a lower priority, in a
session of its own: a signal to the server's process group, Ctrl-C or systemd's,
is the frontend's to act on, and uploads under way end), one at a time per
frontend: a cancel or a shutdown kills it, as does its parent's death; its memory
goes with it. The ids go into a scratch SQLite table on disk, so memory does not
grow with the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

from batchd.server.errors import InvalidInput, clip
from batchd.server.jobs import lines

SHOWN_DUPLICATES = 5  # custom_ids named in a duplicates error ...
SHOWN_LINES = 4  # ... and line numbers for each
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)  # one check at a time per event loop: the others' uploads wait their turn


async def checked(path: Path, scratch: Path) -> int:
    """check_ids(path, scratch) in a child process; killed if this is cancelled."""
    lock = _locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "batchd.server.jobs.ids", str(path), str(scratch),
            str(os.getpid()),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # (a signal to the server's process group is not its)
        )  # fmt: skip
        try:
            out, err = await child.communicate()
        finally:
            if child.returncode is None:  # cancelled (a cancel, a stop): it goes too
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await asyncio.shield(child.wait())  # (its scratch goes with the job's folder)
    try:
        answer = json.loads(out.splitlines()[-1]) if child.returncode == 0 and out else {}
    except ValueError:
        answer = {}
    if not isinstance(answer, dict) or not ("error" in answer or "total" in answer):
        raise RuntimeError(f"the custom_id check exited {child.returncode}: {err[-500:]!r}")
    if "error" in answer:
        raise InvalidInput(answer["error"])
    return int(answer["total"])


def _first_lines(db: sqlite3.Connection, cid: str, count: int) -> str:
    """The first SHOWN_LINES line numbers of `cid` (of its `count`): a message stays short
    whatever the file repeats."""
    found = db.execute(
        f"SELECT line FROM ids WHERE cid = ? ORDER BY line LIMIT {SHOWN_LINES}", (cid,)
    )
    at = ", ".join(str(n) for (n,) in found)
    return at if count <= SHOWN_LINES else f"{at}, ... ({count} lines)"


def check_ids(path: Path, scratch: Path, alive: Callable[[], bool] = lambda: True) -> int:
    """The number of request lines in the job file at `path`; InvalidInput naming the
    lines of duplicate custom_ids; SystemExit once `alive()` says its asker is gone.
    Memory does not grow with the file."""
    total = 0
    db = sqlite3.connect(scratch)
    try:
        db.execute("CREATE TABLE ids (cid TEXT, line INTEGER)")
        batch: list[tuple[str, int]] = []
        with path.open("rb") as f:
            number = 0
            while True:
                raw, length, too_long = lines.read_line(f)
                if not length:
                    break
                number += 1
                if number % 10_000 == 0 and not alive():  # (whoever asked is gone)
                    raise SystemExit(1)
                if too_long:  # blank or not: it becomes an error line when the job runs
                    total += 1
                    continue
                if not raw.strip():
                    continue
                total += 1
                try:
                    batch.append((lines.custom_id_of(lines.load(raw)), number))
                except ValueError:
                    continue  # so does this one
                if len(batch) >= 10_000:
                    db.executemany("INSERT INTO ids VALUES (?, ?)", batch)
                    batch.clear()
        db.executemany("INSERT INTO ids VALUES (?, ?)", batch)
        twice = db.execute(
            "SELECT cid, count(*) FROM ids GROUP BY cid HAVING count(*) > 1 "
            f"ORDER BY min(line) LIMIT {SHOWN_DUPLICATES + 1}"
        ).fetchall()
        shown = "; ".join(
            f"{clip(cid)} on lines {_first_lines(db, cid, n)}"
            for cid, n in twice[:SHOWN_DUPLICATES]
        )
    finally:
        db.close()
        scratch.unlink(missing_ok=True)
    if twice:
        more = " (and more)" if len(twice) > SHOWN_DUPLICATES else ""
        raise InvalidInput(f"duplicate custom_id: {shown}{more}; each must be unique")
    return total


def main(argv: list[str]) -> int:
    """FILE SCRATCH PARENT_PID: prints {"total": request lines} or {"error": why}; leaves
    once PARENT_PID is no longer its parent (given, not read: it may be gone already)."""
    with contextlib.suppress(OSError):
        os.nice(10)  # the frontend and the workers come first
    try:
        parent = int(argv[2])
        alive = lambda: os.getppid() == parent  # noqa: E731
        answer: dict[str, object] = {"total": check_ids(Path(argv[0]), Path(argv[1]), alive)}
    except InvalidInput as e:
        answer = {"error": e.message}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
