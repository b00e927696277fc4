"""The PostgreSQL connection of the shared job store (postgres.py): one connection,
one call at a time, each call one transaction on a thread, so the event loop
never waits on the database. The tables are made by the first call that
connects (an advisory lock: replicas that start together make them once).

A database that is down, or refuses, makes a call raise Unavailable saying why
(never the URL's password); the next call connects again, so a database that
was down when a replica started is used as soon as it is up.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from batchd.server.errors import Unavailable

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")
SCHEMA_LOCK = 0x62617463  # the advisory lock held while the tables are made
SCHEMA = """
CREATE TABLE IF NOT EXISTS batchd_jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    status TEXT NOT NULL,
    total BIGINT NOT NULL DEFAULT 0,
    completed BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    finished_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    input_bytes BIGINT NOT NULL DEFAULT 0,
    results_bytes BIGINT NOT NULL DEFAULT 0,
    input_offset BIGINT NOT NULL DEFAULT 0,
    lines_read BIGINT NOT NULL DEFAULT 0,
    resumed_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    resumed_done BIGINT NOT NULL DEFAULT 0,
    runner TEXT NOT NULL DEFAULT '',          -- the replica running it (or taking it in)
    epoch BIGINT NOT NULL DEFAULT 0,          -- claims so far: a run's writes name its own
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0  -- the database's clock
);
CREATE INDEX IF NOT EXISTS batchd_jobs_by_status ON batchd_jobs (status, created_at);
CREATE TABLE IF NOT EXISTS batchd_job_input (
    job_id TEXT NOT NULL REFERENCES batchd_jobs (id) ON DELETE CASCADE,
    part INTEGER NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (job_id, part)
);
CREATE TABLE IF NOT EXISTS batchd_job_results (
    job_id TEXT NOT NULL REFERENCES batchd_jobs (id) ON DELETE CASCADE,
    start BIGINT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (job_id, start)
);
"""


def safe_url(url: str) -> str:
    """`url` with its password, if any, replaced by ***: fit for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


class Database:
    def __init__(self, url: str) -> None:
        try:
            import psycopg  # only --jobs-db needs it
        except ImportError:
            raise Unavailable(
                "--jobs-db needs psycopg, which is not installed: pip install 'batchd[postgres]'"
            ) from None
        self._psycopg = psycopg
        self.url = url
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._schema = False  # the tables are there

    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._psycopg.connect(
                self.url, autocommit=True, connect_timeout=5,
                options="-c statement_timeout=30000 -c lock_timeout=10000",
                application_name="batchd",
            )  # fmt: skip
        if not self._schema:
            with self._conn.transaction(), self._conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                cur.execute(SCHEMA)
            self._schema = True
        return self._conn

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(cursor, *args)` in one transaction (on the caller's thread)."""
        with self._lock:
            try:
                conn = self._connect()
                with conn.transaction(), conn.cursor() as cur:
                    return fn(cur, *args)
            except self._psycopg.Error as e:
                if isinstance(e, self._psycopg.OperationalError) and self._conn is not None:
                    self._conn.close()
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise Unavailable(
                    f"the jobs database {safe_url(self.url)} failed: {first[:200]}"
                ) from None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(cursor, *args)` in one transaction, on a thread."""
        return await asyncio.to_thread(self.call, fn, *args)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()


def one(cur: psycopg.Cursor[Any], sql: str, args: tuple[Any, ...] = ()) -> Any:
    cur.execute(sql, args)
    return cur.fetchone()


def every(cur: psycopg.Cursor[Any], sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
    cur.execute(sql, args)
    return cur.fetchall()
