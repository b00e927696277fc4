"""Where jobs live: a SQLite database (one row per job) and a folder per job under
--jobs-dir holding its input and its results.

    DIR/jobs.sqlite        the jobs table (WAL: readers never wait for the writer)
    DIR/lock               held (flock) by the server that runs the jobs; its pid inside
    DIR/<job id>/input.jsonl    as uploaded
    DIR/<job id>/results.jsonl  written in input order

Exactly once across a crash: results are appended in input order, and a row's
checkpoint says how far both files are done (`input_offset` bytes of input,
`results_bytes` bytes of results). The results file is flushed to disk before
the checkpoint that covers it is committed; on restart it is cut back to
`results_bytes` and the input read on from `input_offset`, so a line answered
after the last checkpoint is answered again, once, and none is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

STATUSES = ("validating", "queued", "running", "completed", "failed", "cancelling", "cancelled")
OPEN = ("validating", "queued", "running", "cancelling")
ENDED = ("completed", "failed", "cancelled")

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
    resumed_done INTEGER NOT NULL DEFAULT 0    -- lines answered by then
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, created_at);
"""


@dataclass(frozen=True, slots=True)
class JobRow:
    id: str
    owner: str
    model: str
    version: str
    status: str
    total: int
    completed: int
    failed: int
    created_at: float
    started_at: float
    finished_at: float
    error: str
    input_bytes: int
    results_bytes: int
    input_offset: int
    lines_read: int
    resumed_at: float
    resumed_done: int

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def ended(self) -> bool:
        return self.status in ENDED


_COLUMNS = ", ".join(f.name for f in fields(JobRow))


class InUse(Exception):
    """Another server holds the jobs directory."""


class Store:
    def __init__(
        self, directory: Path, *, lock: bool = True, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory = directory
        self._clock = clock
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None
        if lock:
            self._take_lock()
        self._db = sqlite3.connect(directory / "jobs.sqlite", isolation_level=None, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def _take_lock(self) -> None:
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InUse(
                f"{self.directory} is in use by another batchd (pid {holder}); give this "
                "server its own --jobs-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

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

    # ---- files ----

    def folder(self, job_id: str) -> Path:
        return self.directory / job_id

    def input_path(self, job_id: str) -> Path:
        return self.folder(job_id) / "input.jsonl"

    def results_path(self, job_id: str) -> Path:
        return self.folder(job_id) / "results.jsonl"

    # ---- rows ----

    def create(self, owner: str, model: str, version: str) -> JobRow:
        job_id = "job-" + secrets.token_hex(8)
        self.folder(job_id).mkdir()
        self._db.execute(
            "INSERT INTO jobs (id, owner, model, version, status, created_at) "
            "VALUES (?, ?, ?, ?, 'validating', ?)",
            (job_id, owner, model, version, self._clock()),
        )
        row = self.get(job_id)
        assert row is not None
        return row

    def get(self, job_id: str) -> JobRow | None:
        found = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if found is None else JobRow(*found)

    def select(self, owner: str | None, status: str = "", limit: int = 1000) -> list[JobRow]:
        """Newest first; `owner` None: everyone's."""
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

    def count(self, statuses: tuple[str, ...]) -> int:
        marks = ", ".join("?" * len(statuses))
        sql = f"SELECT count(*) FROM jobs WHERE status IN ({marks})"
        return int(self._db.execute(sql, statuses).fetchone()[0])

    def by_status(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        counts.update(self._db.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
        return counts

    def queue(self, job_id: str, total: int, input_bytes: int) -> None:
        """The upload is stored and checked: the job waits to run."""
        self._db.execute(
            "UPDATE jobs SET status = 'queued', total = ?, input_bytes = ? WHERE id = ?",
            (total, input_bytes, job_id),
        )

    def claim(self, exclude_models: set[str] = frozenset()) -> JobRow | None:  # type: ignore[assignment]
        """The oldest queued job of a model not in `exclude_models`, now running."""
        marks = ", ".join("?" * len(exclude_models))
        found = self._db.execute(
            f"SELECT id FROM jobs WHERE status = 'queued' AND model NOT IN ({marks}) "
            "ORDER BY created_at LIMIT 1",
            tuple(exclude_models),
        ).fetchone()
        if found is None:
            return None
        now = self._clock()
        changed = self._db.execute(
            "UPDATE jobs SET status = 'running', resumed_at = ?, resumed_done = completed + "
            "failed, started_at = CASE WHEN started_at = 0 THEN ? ELSE started_at END "
            "WHERE id = ? AND status = 'queued'",
            (now, now, found[0]),
        ).rowcount
        return self.get(found[0]) if changed else None

    def checkpoint(self, job_id: str, input_offset: int, lines_read: int, results_bytes: int,
                   completed: int, failed: int) -> None:  # fmt: skip
        self._db.execute(
            "UPDATE jobs SET input_offset = ?, lines_read = ?, results_bytes = ?, "
            "completed = ?, failed = ? WHERE id = ?",
            (input_offset, lines_read, results_bytes, completed, failed, job_id),
        )

    def cancel(self, job_id: str) -> None:
        """queued -> cancelled at once; running -> cancelling (its runner ends it)."""
        now = self._clock()
        self._db.execute(
            "UPDATE jobs SET status = 'cancelled', finished_at = ? "
            "WHERE id = ? AND status = 'queued'",
            (now, job_id),
        )
        self._db.execute(
            "UPDATE jobs SET status = 'cancelling' WHERE id = ? AND status = 'running'", (job_id,)
        )

    def finish(self, job_id: str, status: str, error: str = "") -> None:
        assert status in ENDED
        self._db.execute(
            "UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
            (status, error, self._clock(), job_id),
        )

    def delete(self, job_id: str) -> None:
        self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

    def recover(self) -> list[str]:
        """At start-up, after a crash or a stop: running jobs wait to run on from their
        checkpoint, cancelling ones are cancelled, uploads cut short are removed."""
        self._db.execute("UPDATE jobs SET status = 'queued' WHERE status = 'running'")
        self._db.execute(
            "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE status = 'cancelling'",
            (self._clock(),),
        )
        gone = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status = 'validating'")]
        for job_id in gone:
            self.delete(job_id)
        return gone

    def expire(self, retention_s: float) -> list[str]:
        """Remove the jobs that ended more than `retention_s` ago; their ids."""
        before = self._clock() - retention_s
        old = [
            r[0]
            for r in self._db.execute(
                "SELECT id FROM jobs WHERE finished_at > 0 AND finished_at < ?", (before,)
            )
        ]
        for job_id in old:
            self.delete(job_id)
        return old
