"""Jobs shared by replicas: a PostgreSQL store (`--jobs-db postgresql://...`).

Every replica that names the same database sees every job, its input and its
results; any of them answers for any job, and a job whose replica died runs on
elsewhere from its last checkpoint, without losing or repeating a result.

    batchd_jobs          the rows SqliteStore keeps, plus who runs a job: runner (a
                         replica's id), epoch (claims so far), lease_until (the
                         database's clock) and submission (an idempotency key)
    batchd_job_input     the uploaded file, in parts of PART_BYTES
    batchd_job_results   the results, in parts, each written by one checkpoint

A claim is a lease. The replica running a job renews it with every checkpoint
(each second) or, while a slow batch writes nothing, on its own. A job whose
lease ran out (its replica was killed, or cut off from the database) is claimed
like a queued one by whichever replica asks first (`FOR UPDATE SKIP LOCKED`),
which bumps its epoch. Every write of a run names the epoch it claimed, so a
replica that lost its lease, and comes back, writes nothing: its checkpoint
finds no row of its epoch, rolls back and stops the run (LeaseLost). A
checkpoint inserts the results written since the last one in the same
transaction as the offsets that cover them, so results and offsets never
disagree; a run that takes over starts where the last committed checkpoint left
off. A stop (SIGTERM) checkpoints and gives the job back at once. A replica
claims only jobs of models it can run now (`claim(only=...)`); one whose model
went away, or whose run its own disk stopped, is given back (jobs/run.py), never failed.

Leases use the database's clock, so replicas' clocks need not agree. Calls run
on a thread, one at a time on each of two connections: the running jobs'
(claims, checkpoints, renewals, their ends) and every other call's (inputs read
back, questions); an upload's file is stored on a connection of its own, so a
large one holds up no lease, question or other upload. A database that does not
answer (database.py bounds every call) makes the job calls fail UNAVAILABLE and
running jobs stop where they were checkpointed; inference goes on.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import astuple
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchd.server.errors import ModelNotFound
from batchd.server.jobs.database import CALL_TIMEOUT_S, PART_BYTES, Database, every, one, parts
from batchd.server.jobs.store import (
    COLUMNS,
    ENDED,
    EXPIRE_MOST,
    READ_PIECE,
    STATUSES,
    TRIM_MOST,
    JobRow,
    LeaseLost,
    PendingResults,
    Progress,
    Results,
    Store,
    Submitted,
    lock_directory,
    new_job_id,
    sweep,
)

if TYPE_CHECKING:
    import psycopg

STORE_RATE = 8 * 1024 * 1024  # bytes/s an upload is given to be stored, at the least
_NOW = "extract(epoch from clock_timestamp())"  # the database's clock, in seconds
_ROW = ", ".join(COLUMNS)
_KEYED = "SELECT id FROM batchd_jobs WHERE submission = %s AND submission <> ''"
_GIVE_BACK = (  # a claimed job: queued (cancelled, if a cancel came), held by none
    "status = CASE WHEN status = 'cancelling' THEN 'cancelled' ELSE 'queued' END, finished_at "
    "= CASE WHEN status = 'cancelling' THEN %s ELSE 0 END, runner = '', lease_until = 0"
)


def _removal(where: str, then: str = "LIMIT %s FOR UPDATE SKIP LOCKED") -> str:
    """DELETE of rows matching `where` that `then` keeps (by default %s, none held), chosen
    once (as `id IN`'s subquery it ran again for each row), `where` checked again on them."""
    return (
        f"WITH chosen AS MATERIALIZED (SELECT id FROM batchd_jobs WHERE {where} {then}) DELETE "
        f"FROM batchd_jobs USING chosen WHERE batchd_jobs.id = chosen.id AND {where} "
        "RETURNING batchd_jobs.id"
    )


class PostgresStore(Store):
    shared = True

    def __init__(
        self, url: str, directory: Path, *, lease_s: float, keep_inputs: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self._db = Database(url)  # uploads, inputs read back, questions
        self._runs = Database(url)  # the running jobs': claims, checkpoints, leases
        self.directory, self.lease_s, self._clock = directory, lease_s, clock
        self._keep_inputs = keep_inputs  # an upload stays as the input cache (a runner's)
        self.renew_every_s = lease_s / 3
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._claims: dict[str, int] = {}  # the jobs this replica runs: their epochs
        self._uploads: set[str] = set()  # the uploads this replica is taking in
        self._lock_fd = lock_directory(directory)  # its spool is this process's alone

    def close(self) -> None:
        self._db.close()
        self._runs.close()
        os.close(self._lock_fd)

    # ---- rows ----

    async def create(self, owner: str, model: str, version: str) -> JobRow:
        job_id = new_job_id()
        self.folder(job_id).mkdir(mode=0o700)  # its input and results: this user's alone
        self._uploads.add(job_id)
        sql = (
            "INSERT INTO batchd_jobs (id, owner, model, version, status, created_at, runner, "
            f"lease_until) VALUES (%s, %s, %s, %s, 'validating', %s, %s, {_NOW} + %s) "
            f"RETURNING {_ROW}"
        )
        args = (job_id, owner, model, version, self._clock(), self.replica, self.lease_s)
        try:
            return JobRow(*await self._db.run(one, sql, args))
        except BaseException:
            self._forget_upload(job_id)
            raise

    async def keyed(self, owner: str, key: str) -> str | None:
        found = await self._db.run(one, f"{_KEYED} AND owner = %s", (key, owner))
        return None if found is None else str(found[0])

    async def uploading(self, job_id: str) -> str:
        sql = (
            f"UPDATE batchd_jobs SET lease_until = CASE status WHEN 'validating' THEN {_NOW} + %s "
            "ELSE lease_until END WHERE id = %s RETURNING status"
        )
        found = await self._db.run(one, sql, (self.lease_s, job_id))
        return "" if found is None else str(found[0])

    async def queue(self, job_id: str, total: int, input_bytes: int, key: str = "") -> bool:
        path = self.upload_path(job_id)

        def store(cur: psycopg.Cursor[Any]) -> bool:
            from psycopg.errors import UniqueViolation

            try:  # first: the row stays locked, so a cancel waits for the commit
                with cur.connection.transaction():  # a savepoint: the key's index may refuse
                    cur.execute(
                        "UPDATE batchd_jobs SET status = 'queued', total = %s, input_bytes = %s, "
                        "runner = '', lease_until = 0, submission = %s WHERE id = %s AND status "
                        "= 'validating' RETURNING id",
                        (total, input_bytes, key, job_id),
                    )
                    queued = cur.fetchone()
            except UniqueViolation:  # the key is on a job queued already (or just now)
                mine = f"{_KEYED} AND owner = (SELECT owner FROM batchd_jobs WHERE id = %s)"
                raise Submitted(one(cur, mine, (key, job_id))[0]) from None
            if queued is None:
                return False  # cancelled meanwhile, through any replica
            with path.open("rb") as f:
                for part, data in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
                    sql = "INSERT INTO batchd_job_input (job_id, part, data) VALUES (%s, %s, %s)"
                    cur.execute(sql, (job_id, part, data))
            return True

        # On a connection of its own: no other call waits on a large file
        if not await Database.alone(self._db.url, store, CALL_TIMEOUT_S + input_bytes / STORE_RATE):
            return False
        self._uploads.discard(job_id)
        if not self._keep_inputs:  # this frontend runs no jobs: nothing would read it
            self.discard(job_id)
        return True

    async def get(self, job_id: str) -> JobRow | None:
        found = await self._db.run(one, f"SELECT {_ROW} FROM batchd_jobs WHERE id = %s", (job_id,))
        return None if found is None else JobRow(*found)

    async def select(self, owner: str | None, status: str = "", limit: int = 1000) -> list[JobRow]:
        sql = (
            f"SELECT {_ROW} FROM batchd_jobs WHERE (%s::text IS NULL OR owner = %s) "
            "AND (%s = '' OR status = %s) ORDER BY created_at DESC LIMIT %s"
        )
        rows = await self._db.run(every, sql, (owner, owner, status, status, limit))
        return [JobRow(*r) for r in rows]

    async def count(self, statuses: tuple[str, ...]) -> int:
        sql = "SELECT count(*) FROM batchd_jobs WHERE status = ANY(%s)"
        return int((await self._db.run(one, sql, (list(statuses),)))[0])

    async def by_status(self) -> dict[str, int]:
        sql = "SELECT status, count(*) FROM batchd_jobs GROUP BY status"
        return {
            **dict.fromkeys(STATUSES, 0),
            **{s: int(n) for s, n in await self._db.run(every, sql)},
        }

    # ---- running: claims and leases ----

    async def claim(self, exclude_models: frozenset[str] = frozenset(),
                    only: Collection[str] | None = None) -> JobRow | None:  # fmt: skip
        now = self._clock()
        names = None if only is None else sorted(only)

        def claim(cur: psycopg.Cursor[Any]) -> Any:
            # A cancel whose replica died before it ended the job: it ends here.
            cur.execute(
                "UPDATE batchd_jobs SET status = 'cancelled', finished_at = %s, runner = '', "
                f"lease_until = 0 WHERE status = 'cancelling' AND lease_until < {_NOW}",
                (now,),
            )
            cur.execute(
                "SELECT id FROM batchd_jobs WHERE (status = 'queued' OR (status = 'running' "
                f"AND lease_until < {_NOW})) AND NOT (model = ANY(%s)) AND (%s::text[] IS NULL "
                "OR model = ANY(%s)) ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED",
                (sorted(exclude_models), names, names),
            )
            found = cur.fetchone()
            if found is None:
                return None
            cur.execute(
                "UPDATE batchd_jobs SET status = 'running', error = '', runner = %s, epoch = "
                f"epoch + 1, lease_until = {_NOW} + %s, resumed_at = %s, resumed_done = completed "
                "+ failed, started_at = CASE WHEN started_at = 0 THEN %s ELSE started_at END "
                f"WHERE id = %s RETURNING epoch, {_ROW}",
                (self.replica, self.lease_s, now, now, found[0]),
            )
            return cur.fetchone()

        got = await self._runs.run(claim)
        if got is None:
            return None
        row = JobRow(*got[1:])
        self._claims[row.id] = int(got[0])
        return row

    def _fenced(self, cur: psycopg.Cursor[Any], row: JobRow, assignments: str,
                args: tuple[Any, ...]) -> str:  # fmt: skip
        """UPDATE the claimed job's row, only while this replica holds the claim it made;
        its status, or LeaseLost (the transaction rolls back)."""
        cur.execute(
            f"UPDATE batchd_jobs SET {assignments} WHERE id = %s AND runner = %s AND epoch = %s "
            "RETURNING status",
            (*args, row.id, self.replica, self._claims.get(row.id, -1)),
        )
        found = cur.fetchone()
        if found is None:
            epoch = self._claims.pop(row.id, None)
            raise LeaseLost(
                f"job {row.id}: this replica no longer holds its claim (epoch {epoch}): "
                "its lease ran out and another replica took it over, or it was given back; "
                "nothing more of this run is written"
            )
        return str(found[0])

    async def open_input(self, row: JobRow) -> Path:
        path = self.upload_path(row.id)
        if path.exists() and path.stat().st_size == row.input_bytes:
            return path  # taken in here
        count = "SELECT count(*) FROM batchd_job_input WHERE job_id = %s"
        part = "SELECT data FROM batchd_job_input WHERE job_id = %s AND part = %s"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        try:
            with partial.open("wb") as f:  # a part at a time: memory stays PART_BYTES
                for n in range((await self._db.run(one, count, (row.id,)))[0]):
                    f.write((await self._db.run(one, part, (row.id, n)))[0])
            partial.rename(path)
        finally:  # (a full disk: what it took goes)
            partial.unlink(missing_ok=True)
        return path

    def open_results(self, row: JobRow) -> Results:
        return PendingResults(row.results_bytes)

    def _save(self, cur: psycopg.Cursor[Any], row: JobRow, pending: PendingResults, p: Progress,
              give_back_at: float | None = None) -> str:  # fmt: skip
        """The checkpoint's offsets (fenced), then the results they cover. The lease is
        renewed, or with `give_back_at` (a stop) the job given back: queued, or cancelled."""
        progress = (*astuple(p), pending.tell(), self._clock())  # (Progress's fields first)
        sets = ("input_offset = %s, lines_read = %s, completed = %s, failed = %s, "
                "results_bytes = %s, checkpointed_at = %s")  # fmt: skip
        if give_back_at is None:
            sets, args = f"{sets}, lease_until = {_NOW} + %s", (*progress, self.lease_s)
        else:
            sets, args = f"{sets}, {_GIVE_BACK}", (*progress, give_back_at)
        status = self._fenced(cur, row, sets, args)
        at = pending.saved
        for data in parts(pending.parts, pending.size):
            cur.execute(
                "INSERT INTO batchd_job_results (job_id, start, data) VALUES (%s, %s, %s)",
                (row.id, at, data),
            )
            at += len(data)
        return status

    async def checkpoint(self, row: JobRow, results: Results, progress: Progress) -> str:
        assert isinstance(results, PendingResults)

        def saved(_: str) -> None:  # once committed, even if this run is cancelled meanwhile:
            results.saved, results.parts, results.size = results.tell(), [], 0  # (a stop's
            # release, next on the connection, then inserts none of them again)

        return await self._runs.run(self._save, row, results, progress, then=saved)

    async def renew(self, row: JobRow) -> str:
        sets = f"lease_until = {_NOW} + %s"
        return await self._runs.run(self._fenced, row, sets, (self.lease_s,))

    async def release(self, row: JobRow, results: Results, progress: Progress) -> None:
        assert isinstance(results, PendingResults)
        try:
            await self._runs.run(self._save, row, results, progress, self._clock())
        finally:
            self._claims.pop(row.id, None)

    async def requeue(self, row: JobRow, why: str) -> None:  # its checkpoint as it was
        with contextlib.suppress(LeaseLost):  # (LeaseLost: another replica took it, nothing
            sets = f"{_GIVE_BACK}, error = CASE WHEN status = 'cancelling' THEN error ELSE %s END"
            await self._runs.run(self._fenced, row, sets, (self._clock(), why))  # to give back)
        self._claims.pop(row.id, None)  # (Unavailable: kept, for Jobs to try again)

    async def finish(self, row: JobRow, status: str, error: str = "") -> None:
        assert status in ENDED
        sets = "status = %s, error = %s, finished_at = %s, runner = '', lease_until = 0"
        try:
            await self._runs.run(self._fenced, row, sets, (status, error, self._clock()))
        finally:
            self._claims.pop(row.id, None)
            self.discard(row.id)  # the input cache

    async def cancel(self, job_id: str) -> None:
        """queued or validating -> cancelled at once (the upload's replica hears it when
        it next renews, and removes the job); running -> cancelling (its runner ends it)."""
        sql = (
            "UPDATE batchd_jobs SET status = CASE status WHEN 'running' THEN 'cancelling' "
            "ELSE 'cancelled' END, finished_at = CASE status WHEN 'running' THEN finished_at "
            "ELSE %s END, error = CASE status WHEN 'running' THEN error ELSE '' END WHERE id = "
            "%s AND status IN ('queued', 'validating', 'running') RETURNING id"
        )
        await self._db.run(one, sql, (self._clock(), job_id))

    async def delete(self, job_id: str) -> None:
        try:
            await self._db.run(one, "DELETE FROM batchd_jobs WHERE id = %s RETURNING id", (job_id,))
        finally:
            self._forget_upload(job_id)

    def _forget_upload(self, job_id: str) -> None:
        self._uploads.discard(job_id)
        self.discard(job_id)

    # ---- housekeeping ----

    async def recover(self) -> list[str]:
        """Nothing of another replica's is touched: its running jobs are its own until
        their leases run out. Uploads whose replica went (their lease ran out) go."""
        return await self._remove(-math.inf)

    async def expire(self, retention_s: float) -> list[str]:
        return await self._remove(self._clock() - retention_s)

    async def _remove(self, before: float) -> list[str]:
        """Uploads whose replica went (a few: --jobs-max-open), then at most EXPIRE_MOST jobs
        that ended before `before`; local leftovers. Rows held are skipped (a replica expiring
        too; a queue() past the upload's lease), and terms checked again: they deleted them."""
        stale = f"status = 'validating' AND lease_until < {_NOW}"
        ended = "finished_at > 0 AND finished_at < %s"
        gone = [r[0] for r in await self._db.run(every, _removal(stale), (1 << 31,))]
        if before > 0:
            removal, args = _removal(ended), (before, EXPIRE_MOST, before)
            gone += [r[0] for r in await self._db.run(every, removal, args)]
        # The local folders of jobs not running or taken in here: input caches of jobs that
        sweep(self.directory, set(self._claims) | self._uploads)  # ended or went elsewhere
        return gone

    async def trim(self, owner: str, keep: int) -> list[str]:
        sql = _removal(
            "owner = %s AND finished_at > 0", "ORDER BY finished_at DESC LIMIT %s OFFSET %s"
        )
        return [r[0] for r in await self._db.run(every, sql, (owner, TRIM_MOST, keep, owner))]

    async def read_results(self, job_id: str, start: int, end: int) -> AsyncIterator[bytes]:
        sql = (
            "SELECT start, data FROM batchd_job_results WHERE job_id = %s AND start <= %s "
            "ORDER BY start DESC LIMIT 1"
        )
        while start < end:  # a part (at most PART_BYTES) at a time
            found = await self._db.run(one, sql, (job_id, start))
            data = b"" if found is None else bytes(found[1])[start - found[0] : end - found[0]]
            if not data:  # removed meanwhile (its retention, a trim): a short file is no answer
                raise ModelNotFound(f"job {job_id} was removed while its results were read")
            for at in range(0, len(data), READ_PIECE):
                yield data[at : at + READ_PIECE]
            start += len(data)
