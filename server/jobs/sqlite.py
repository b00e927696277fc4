"""One server's jobs, the default store: SQLite and files in --jobs-dir.

    DIR/jobs.sqlite        the jobs table (WAL: readers never wait for the writer)
    DIR/lock               held (flock) by the server that runs the jobs; its pid inside
    DIR/<job id>/input.jsonl    as uploaded; fsynced (and its folders) before it is queued
    DIR/<job id>/results.jsonl  written in input order; fsynced before each checkpoint

Its calls are coroutines only to match Store (store.py): they are short local
writes, made on the loop as they come (synchronous=NORMAL: no fsync there). The two
commits a power loss must not take back, a job told `queued` and a checkpoint's counts
shown, are made durable by an fsync of the WAL on a thread before they are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import BinaryIO

from batchd.server.jobs.store import (
    COLUMNS,
    ENDED,
    EXPIRE_MOST,
    READ_PIECE,
    STATUSES,
    TRIM_MOST,
    JobRow,
    Progress,
    Results,
    Store,
    Submitted,
    discard,
    discarded,
    durable,
    lock_directory,
    new_job_id,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,           -- a digest of the submitting token ('' without tokens)
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    status TEXT NOT NULL,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL NOT NULL DEFAULT 0,
    finished_at REAL NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    input_bytes INTEGER NOT NULL DEFAULT 0,
    results_bytes INTEGER NOT NULL DEFAULT 0,  -- the checkpoint: results kept
    input_offset INTEGER NOT NULL DEFAULT 0,   -- the checkpoint: input answered
    lines_read INTEGER NOT NULL DEFAULT 0,     -- physical lines answered (blank ones too)
    resumed_at REAL NOT NULL DEFAULT 0,        -- when it last started running, for its rate
    resumed_done INTEGER NOT NULL DEFAULT 0,   -- lines answered by then
    submission TEXT NOT NULL DEFAULT '',       -- its idempotency key, once queued
    checkpointed_at REAL NOT NULL DEFAULT 0,   -- its last checkpoint, for its rate
    lease_until REAL NOT NULL DEFAULT 0        -- validating: its frontend renews it
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, created_at);
-- ListJobs, newest first, read on the event loop: without these it sorted every job kept
-- (--jobs-retention-hours), ~1 us each, whatever its limit
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created_at);
CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created_at);
CREATE INDEX IF NOT EXISTS jobs_by_owner_end ON jobs (owner, finished_at);  -- trim()
"""
UPLOAD_LEASE_S = 30.0  # an upload its frontend has not renewed this long is removed
_ADDED = (
    ("submission", "TEXT NOT NULL DEFAULT ''"),
    ("checkpointed_at", "REAL NOT NULL DEFAULT 0"),
    ("lease_until", "REAL NOT NULL DEFAULT 0"),
)
# Made once a database of an older batchd has the column (ALTER TABLE, below).
_KEYS = (
    "CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_key ON jobs (owner, submission) "
    "WHERE submission <> ''"
)
_COLUMNS = ", ".join(COLUMNS)
# An owner's ended jobs past its newest (--jobs-max-kept), from the index, newest first
_PAST_KEPT = (
    "SELECT id FROM jobs WHERE owner = ? AND finished_at > 0 ORDER BY finished_at DESC "
    "LIMIT ? OFFSET ?"
)


class _ResultsFile(Results):
    def __init__(self, path: Path, at: int) -> None:
        path.touch()
        self.file: BinaryIO = path.open("r+b")
        self.file.truncate(at)  # what came after the last checkpoint goes
        self.file.seek(at)
        self.saved, self.named = at, False

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def unsaved(self) -> int:
        return self.tell() - self.saved

    def sync(self) -> int:
        """Flush and fsync (on a thread: a disk may be slow); the bytes now durable. The
        first also fsyncs its folder, which names the file (made after the input's sync)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        if not self.named:
            durable(Path(self.file.name).parent, parents=0)
            self.named = True
        return self.file.tell()

    def close(self) -> None:  # (a flush that fails, a full disk: past the checkpoint, cut)
        with contextlib.suppress(OSError):
            self.file.close()


class SqliteStore(Store):
    renew_every_s = 1.0  # an upload hears within this of a cancel through another frontend
    # Uploads' leases: the host's monotonic clock, one for every frontend process (a wall
    # clock stepped forward 30 s ran every live upload's lease out at once)
    lease_clock = staticmethod(time.monotonic)

    def __init__(
        self, directory: Path, *, lock: bool = True, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory = directory
        self._clock = clock
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # (its jobs: this user's)
        self._lock_fd = lock_directory(directory) if lock else None
        self._db = sqlite3.connect(directory / "jobs.sqlite", isolation_level=None, timeout=10)
        self._wal = directory / "jobs.sqlite-wal"
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        have = {c[1] for c in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in _ADDED:  # (a database of an older batchd)
            if column not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        self._db.execute(_KEYS)

    def _commits_durable(self) -> None:
        """The WAL on disk: every commit so far outlives a power loss (NORMAL: not yet)."""
        with contextlib.suppress(FileNotFoundError):  # (none: nothing written since)
            durable(self._wal, parents=0)

    @staticmethod
    def holder(directory: Path) -> int | None:
        """The pid written in DIR/lock, if any."""
        with contextlib.suppress(OSError, ValueError):
            return int((directory / "lock").read_text().strip())
        return None

    def close(self) -> None:
        self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def results_path(self, job_id: str) -> Path:
        return self.folder(job_id) / "results.jsonl"

    # ---- rows ----

    def _get(self, job_id: str) -> JobRow | None:
        found = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if found is None else JobRow(*found)

    async def create(self, owner: str, model: str, version: str) -> JobRow:
        job_id = new_job_id()
        self.folder(job_id).mkdir(mode=0o700)  # its input and results: this user's alone
        self._db.execute(
            "INSERT INTO jobs (id, owner, model, version, status, created_at, lease_until) "
            "VALUES (?, ?, ?, ?, 'validating', ?, ?)",
            (job_id, owner, model, version, self._clock(), self.lease_clock() + UPLOAD_LEASE_S),
        )
        row = self._get(job_id)
        assert row is not None
        return row

    async def get(self, job_id: str) -> JobRow | None:
        return self._get(job_id)

    async def select(self, owner: str | None, status: str = "", limit: int = 1000) -> list[JobRow]:
        where, args = [], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if status:
            where.append("status = ?")
            args.append(status)
        sql = f"SELECT {_COLUMNS} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._db.execute(f"{sql} ORDER BY created_at DESC LIMIT ?", (*args, limit))
        return [JobRow(*r) for r in rows]

    async def count(self, statuses: tuple[str, ...]) -> int:
        marks = ", ".join("?" * len(statuses))
        sql = f"SELECT count(*) FROM jobs WHERE status IN ({marks})"
        return int(self._db.execute(sql, statuses).fetchone()[0])

    async def by_status(self) -> dict[str, int]:
        """Counted on a thread, over a connection of its own: it reads every retained
        job (31 ms at 600,000), and WAL lets it read beside the loop's writes."""
        return await asyncio.to_thread(self._by_status)

    def _by_status(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        db = sqlite3.connect(self.directory / "jobs.sqlite", timeout=10)
        try:
            counts.update(db.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
        finally:
            db.close()
        return counts

    async def uploading(self, job_id: str) -> str:
        # The upload's lease, renewed: frontend 0 removes one whose frontend died (a crash
        # of the whole server: the next start); read for a cancel through another frontend.
        with contextlib.suppress(sqlite3.OperationalError):  # (busy, full: the next time)
            self._db.execute(
                "UPDATE jobs SET lease_until = ? WHERE id = ? AND status = 'validating'",
                (self.lease_clock() + UPLOAD_LEASE_S, job_id),
            )
        current = self._get(job_id)
        return "" if current is None else current.status

    async def queue(self, job_id: str, total: int, input_bytes: int, key: str = "") -> bool:
        await asyncio.to_thread(durable, self.upload_path(job_id))
        try:
            return bool(
                self._db.execute(
                    "UPDATE jobs SET status = 'queued', total = ?, input_bytes = ?, "
                    "submission = ? WHERE id = ? AND status = 'validating'",
                    (total, input_bytes, key, job_id),
                ).rowcount
            )
        except sqlite3.IntegrityError:  # the key is on another job of its owner
            row = self._get(job_id)
            other = None if row is None else await self.keyed(row.owner, key)
            if other is None:
                raise
            raise Submitted(other) from None

    async def keyed(self, owner: str, key: str) -> str | None:
        found = self._db.execute(
            "SELECT id FROM jobs WHERE owner = ? AND submission = ? AND submission <> ''",
            (owner, key),
        ).fetchone()
        return None if found is None else str(found[0])

    async def claim(self, exclude_models: frozenset[str] = frozenset(),
                    only: Collection[str] | None = None) -> JobRow | None:  # fmt: skip
        marks = ", ".join("?" * len(exclude_models))
        among, args = "", tuple(exclude_models)
        if only is not None:
            among = f" AND model IN ({', '.join('?' * len(only))})"
            args += tuple(only)
        found = self._db.execute(
            f"SELECT id FROM jobs WHERE status = 'queued' AND model NOT IN ({marks}){among} "
            "ORDER BY created_at LIMIT 1",
            args,
        ).fetchone()
        if found is None:
            return None
        now = self._clock()
        changed = self._db.execute(
            "UPDATE jobs SET status = 'running', error = '', resumed_at = ?, resumed_done = "
            "completed + failed, started_at = CASE WHEN started_at = 0 THEN ? ELSE started_at END "
            "WHERE id = ? AND status = 'queued'",
            (now, now, found[0]),
        ).rowcount
        return self._get(found[0]) if changed else None

    async def open_input(self, row: JobRow) -> Path:
        return self.upload_path(row.id)

    def open_results(self, row: JobRow) -> Results:
        return _ResultsFile(self.results_path(row.id), row.results_bytes)

    async def checkpoint(self, row: JobRow, results: Results, progress: Progress) -> str:
        assert isinstance(results, _ResultsFile)
        results.saved = await asyncio.to_thread(results.sync)  # the results first
        self._save(row.id, results.saved, progress)
        await self.settle()  # (the WAL: this commit outlives a power loss)
        current = self._get(row.id)
        return "" if current is None else current.status

    def _save(self, job_id: str, results_bytes: int, p: Progress) -> None:
        self._db.execute(
            "UPDATE jobs SET input_offset = ?, lines_read = ?, results_bytes = ?, "
            "completed = ?, failed = ?, checkpointed_at = ? WHERE id = ?",
            (p.input_offset, p.lines_read, results_bytes, p.completed, p.failed, self._clock(),
             job_id),
        )  # fmt: skip

    async def renew(self, row: JobRow) -> str:
        current = self._get(row.id)
        return "" if current is None else current.status

    async def release(self, row: JobRow, results: Results, progress: Progress) -> None:
        # On the loop, not a thread: the server is stopping and this must finish first.
        # The job stays `running`: recover() at the next start sets it to run on.
        assert isinstance(results, _ResultsFile)
        results.saved = results.sync()
        self._save(row.id, results.saved, progress)

    async def finish(self, row: JobRow, status: str, error: str = "") -> None:
        assert status in ENDED
        self._db.execute(
            "UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
            (status, error, self._clock(), row.id),
        )

    async def cancel(self, job_id: str) -> None:
        now = self._clock()
        self._db.execute(
            "UPDATE jobs SET status = 'cancelled', finished_at = ?, error = '' "  # (a stalled
            "WHERE id = ? AND status IN ('queued', 'validating')",  # run's: no longer so, 57e)
            (now, job_id),
        )
        self._db.execute(
            "UPDATE jobs SET status = 'cancelling' WHERE id = ? AND status = 'running'", (job_id,)
        )

    async def delete(self, job_id: str) -> None:
        # The folder first: a process ended between the two leaves a row, deleted again
        # by the next recover() or expire(), not a folder that nothing names any more.
        self.discard(job_id)
        self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    async def requeue(self, row: JobRow, why: str) -> None:
        self._requeue("id = ? AND ", (row.id,), why)

    async def settle(self) -> None:
        await asyncio.to_thread(self._commits_durable)

    def _requeue(self, which: str, args: tuple[str, ...], why: str = "") -> None:
        self._db.execute(
            f"UPDATE jobs SET status = 'queued', error = ? WHERE {which}status = 'running'",
            (why, *args),
        )
        self._db.execute(
            f"UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE {which}status = "
            "'cancelling'", (self._clock(), *args),
        )  # fmt: skip

    async def recover(self) -> list[str]:
        self._requeue("", ())
        for left in discarded(self.directory):  # (a stop came as they were removed)
            discard(left)
        gone = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status = 'validating'")]
        for job_id in gone:
            await self.delete(job_id)
        return gone

    async def expire(self, retention_s: float) -> list[str]:
        """Ended jobs past their retention, and uploads whose frontend stopped renewing
        them (SIGKILLed: they stayed validating, holding a --jobs-max-open place)."""
        sql = (
            "SELECT id FROM jobs WHERE (finished_at > 0 AND finished_at < ?) OR (status = "
            "'validating' AND lease_until < ?) LIMIT ?"
        )
        args = (self._clock() - retention_s, self.lease_clock(), EXPIRE_MOST)
        old = [r[0] for r in self._db.execute(sql, args)]
        for job_id in old:
            await self.delete(job_id)
        return old

    async def trim(self, owner: str, keep: int) -> list[str]:
        past = [r[0] for r in self._db.execute(_PAST_KEPT, (owner, TRIM_MOST, keep))]
        for job_id in past:
            await self.delete(job_id)
        return past

    async def read_results(self, job_id: str, start: int, end: int) -> AsyncIterator[bytes]:
        if start >= end:
            return
        with self.results_path(job_id).open("rb") as f:
            f.seek(start)
            while start < end:
                data = f.read(min(READ_PIECE, end - start))
                if not data:
                    break
                start += len(data)
                yield data
