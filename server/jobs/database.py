"""The PostgreSQL connection of the shared job store (postgres.py): one connection,
one call at a time, each call one transaction on a thread, so the event loop
never waits on the database. The tables are made by the first call that
connects (an advisory lock: replicas that start together make them once).

A database that is down, or refuses, makes a call raise Unavailable saying why
(never the URL's password); the next call connects again, so a database that
was down when a replica started is used as soon as it is up. A database that
stops answering (a host gone, a frozen server) is as down: every call is bounded
(TCP keepalives and tcp_user_timeout in the kernel, and `timeout_s` here, after
which its socket is shut, so the thread's call fails and the connection is made
again), and a call that waited its whole time for another to finish is not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from batchd.server.errors import Unavailable

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")
SCHEMA_LOCK = 0x62617463  # the advisory lock held while the tables are made
PART_BYTES = 4 * 1024 * 1024  # of input or results per row
CALL_TIMEOUT_S = 10.0  # a call (waiting for the connection included) that takes longer fails
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
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,  -- the database's clock
    checkpointed_at DOUBLE PRECISION NOT NULL DEFAULT 0  -- its runner's clock, as resumed_at
);
-- a submission's idempotency key, set once its job is queued, and its last checkpoint's
-- time (a database of an older batchd gets them). Looked up first: ALTER TABLE and CREATE
-- INDEX lock the table even when there is nothing to do, and a replica starts while others
-- use it.
DO $$ BEGIN
    IF to_regclass('batchd_jobs_by_status') IS NULL THEN
        CREATE INDEX batchd_jobs_by_status ON batchd_jobs (status, created_at);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema =
                   current_schema() AND table_name = 'batchd_jobs' AND column_name = 'submission')
    THEN
        ALTER TABLE batchd_jobs ADD COLUMN submission TEXT NOT NULL DEFAULT '';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()
                   AND table_name = 'batchd_jobs' AND column_name = 'checkpointed_at') THEN
        ALTER TABLE batchd_jobs ADD COLUMN checkpointed_at DOUBLE PRECISION NOT NULL DEFAULT 0;
    END IF;
    IF to_regclass('batchd_jobs_by_owner_end') IS NULL THEN  -- a submission's trim
        CREATE INDEX batchd_jobs_by_owner_end ON batchd_jobs (owner, finished_at);
    END IF;
    IF to_regclass('batchd_jobs_by_key') IS NULL THEN
        CREATE UNIQUE INDEX batchd_jobs_by_key ON batchd_jobs (owner, submission)
            WHERE submission <> '';
    END IF;
END $$;
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
        self._busy: object | None = None  # the call on the connection now (its token)
        self._busy_lock = threading.Lock()  # a late call's shut never hits the next call

    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._psycopg.connect(
                self.url, autocommit=True, connect_timeout=5,
                options="-c statement_timeout=30000 -c lock_timeout=10000",
                application_name="batchd",  # and a peer that stops answering is dropped:
                keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                tcp_user_timeout=10_000,  # ms
            )  # fmt: skip
        if not self._schema:
            with self._conn.transaction(), self._conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                cur.execute(SCHEMA)
            self._schema = True
        return self._conn

    def call(self, fn: Callable[..., T], *args: Any, token: object = None,
             until: float = math.inf, then: Callable[[T], None] | None = None) -> T:  # fmt: skip
        """`fn(cursor, *args)` in one transaction (on the caller's thread), then, once it
        is committed and before another call runs, `then(its result)`; not run at all
        if the connection is not free before `until` (time.monotonic)."""
        if not self._lock.acquire(timeout=max(0.0, min(until - time.monotonic(), 3600.0))):
            raise self._gone("did not answer in time (another call held the connection)")
        try:
            with self._busy_lock:
                self._busy = token
            conn = self._connect()
            with conn.transaction(), conn.cursor() as cur:
                got = fn(cur, *args)
            if then is not None:
                then(got)
            return got
        except self._psycopg.Error as e:
            if isinstance(e, self._psycopg.OperationalError) and self._conn is not None:
                self._conn.close()
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise self._gone(f"failed: {first[:200]}") from None
        finally:
            with self._busy_lock:
                self._busy = None
            self._lock.release()

    def _gone(self, why: str) -> Unavailable:
        return Unavailable(f"the jobs database {safe_url(self.url)} {why}")

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None,
                  then: Callable[[T], None] | None = None) -> T:  # fmt: skip
        """`fn(cursor, *args)` in one transaction, on a thread; Unavailable if it has not
        answered within `timeout_s` (its connection is then shut: the call fails, and
        the next connects again). A caller cancelled does not stop the call: it runs
        to its end on its thread (bounded the same way), `then` included."""
        timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        token = object()
        until = time.monotonic() + timeout_s
        call = asyncio.ensure_future(
            asyncio.to_thread(self.call, fn, *args, token=token, until=until, then=then)
        )
        call.add_done_callback(lambda c: c.cancelled() or c.exception())  # always retrieved
        done, _ = await asyncio.wait([call], timeout=timeout_s)
        if done:
            return call.result()
        with self._busy_lock:
            if self._busy is token:
                self._shut()
        raise self._gone(f"did not answer within {timeout_s:g} s")

    @staticmethod
    async def alone(url: str, fn: Callable[..., T], timeout_s: float) -> T:
        """`fn(cursor)` as run(), on a connection of its own, closed after (on a thread)."""
        db = Database(url)
        try:
            return await db.run(fn, timeout_s=timeout_s)
        finally:
            await asyncio.to_thread(db.close)

    def _shut(self) -> None:
        """Shut the connection's socket under the thread that waits on it: its call
        fails at once, and the connection is made again by the next call."""
        conn = self._conn
        with contextlib.suppress(Exception):
            if conn is not None and not conn.closed:
                sock = socket.socket(fileno=os.dup(conn.fileno()))
                with sock:
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection; a call still hanging on it is cut off first."""
        if not self._lock.acquire(timeout=CALL_TIMEOUT_S):
            self._shut()
            if not self._lock.acquire(timeout=CALL_TIMEOUT_S):
                return  # the thread is stuck outside the socket: the process exit ends it
        try:
            if self._conn is not None:
                self._conn.close()
        finally:
            self._lock.release()


def parts(pieces: list[bytes], size: int) -> Iterator[bytes]:
    """`pieces` joined again and cut into parts of PART_BYTES: one a row."""
    data = b"".join(pieces)
    for at in range(0, size, PART_BYTES):
        yield data[at : at + PART_BYTES]


def one(cur: psycopg.Cursor[Any], sql: str, args: tuple[Any, ...] = ()) -> Any:
    cur.execute(sql, args)
    return cur.fetchone()


def every(cur: psycopg.Cursor[Any], sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
    cur.execute(sql, args)
    return cur.fetchall()
