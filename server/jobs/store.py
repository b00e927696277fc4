"""Where jobs live. Two stores keep the same rows and answer the same calls (Store):

  SqliteStore, the default (nothing to set up): one server's jobs, in --jobs-dir:
      an SQLite database and a folder per job with its input and results (sqlite.py)
  PostgresStore (--jobs-db postgresql://...): the jobs of every replica that names the
      same database, inputs and results included, so any replica answers for any job
      and takes over the job of one that died (postgres.py). --jobs-dir then only
      spools uploads and caches the inputs of the jobs this replica runs.

Exactly once across a crash: results are appended in input order, and a row's
checkpoint says how far both are done (`input_offset` bytes of input,
`results_bytes` bytes of results). The results are made durable before the
checkpoint that covers them is committed (SQLite: the file is fsynced first;
PostgreSQL: they are inserted in the checkpoint's own transaction); a run that
resumes cuts the results back to `results_bytes` and reads the input on from
`input_offset`, so a line answered after the last checkpoint is answered again,
once, and none is lost.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import queue
import secrets
import shutil
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, fields
from pathlib import Path

STATUSES = ("validating", "queued", "running", "completed", "failed", "cancelling", "cancelled")
OPEN = ("validating", "queued", "running", "cancelling")
ENDED = ("completed", "failed", "cancelled")
TRIM_MOST = 100  # ended jobs one submission removes past its token's --jobs-max-kept
# Expired jobs removed a minute at most: SQLite's on the loop, ~0.1 ms each (a backlog of
# 300,000 after a long stop held it 27 s at once), PostgreSQL's on its thread (every job
# call of the frontend waits behind it); more than a day's worth at a job a second
EXPIRE_MOST = 500
READ_PIECE = 1024 * 1024  # bytes of results per piece read back
OVERDUE_S = 2.0  # an ETA past by this long is not known (pace)


DISCARDED = ".discarded-"  # a folder being removed, renamed aside (discard)


def discard(folder: Path) -> None:
    """Remove a job's folder without holding the event loop: it is renamed aside at once
    (nothing finds it half removed) and removed by a thread of its own (removing a 1 GiB
    input took 0.26 s: four jobs' expiry held every call 0.65 s), one at a time, never
    holding up the threads the jobs and the database run on, nor a stop: what a stop
    leaves aside goes at the next start (the stores' sweeps)."""
    global _remover
    if folder in _removing:  # (a sweep's: this process removes it already)
        return
    aside = folder.with_name(f"{DISCARDED}{folder.name}-{secrets.token_hex(4)}")
    try:
        folder.rename(aside)
    except FileNotFoundError:
        return
    except OSError:  # (cannot be renamed: removed where it is)
        aside = folder
    _removing.add(aside)
    _removals.put(aside)
    if _remover is None or not _remover.is_alive():
        _remover = threading.Thread(target=_remove, name="batchd-job-removal", daemon=True)
        _remover.start()


def _remove() -> None:
    while True:
        aside = _removals.get()
        try:
            shutil.rmtree(aside, ignore_errors=True)
        finally:
            _removing.discard(aside)


_removing: set[Path] = set()  # folders set aside, not yet removed (by _remover)
_removals: queue.SimpleQueue[Path] = queue.SimpleQueue()
_remover: threading.Thread | None = None


def durable(path: Path, parents: int = 2) -> None:
    """`path` on disk, and the `parents` folders that name it (an input's: its job's, DIR;
    a file system that cannot fsync a folder, EINVAL, keeps its names as it can)."""
    for each in (path, *path.parents[:parents]):
        fd = os.open(each, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno != errno.EINVAL or not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise
        finally:
            os.close(fd)


def sweep(directory: Path, keep: set[str]) -> None:
    """Remove the job folders in `directory` not named in `keep`, and those set aside."""
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            if entry.name.startswith(("job-", DISCARDED)) and entry.name not in keep:
                discard(entry)


def discarded(directory: Path) -> list[Path]:
    """The folders a stop left aside in `directory` before removing them."""
    with contextlib.suppress(OSError):
        return [p for p in directory.iterdir() if p.name.startswith(DISCARDED)]
    return []


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
    checkpointed_at: float = 0.0  # its last checkpoint (wall clock, as resumed_at)

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def ended(self) -> bool:
        return self.status in ENDED


COLUMNS = tuple(f.name for f in fields(JobRow))


@dataclass(frozen=True, slots=True)
class Progress:
    """A checkpoint: how far a running job's input is answered, and how."""

    input_offset: int
    lines_read: int
    completed: int
    failed: int


def pace(done: int, remaining: int, since: tuple[float, int], saved_at: float,
                 now: float) -> tuple[float, float]:  # fmt: skip
    """A running job's lines a second, and seconds to its end: `done` lines at its last
    checkpoint, at `saved_at`, against `since` (when it started running, and its lines
    done then). Timed to the checkpoint and counted down from it: timed to `now`, the
    rate fell between checkpoints and the ETA climbed while the job went on. An ETA of
    -1: not known (no checkpoint since it started, or one overdue by OVERDUE_S: a job
    that stalls does not read 0 for as long as it stalls)."""
    took, done_since = saved_at - since[0], done - since[1]
    rate = done_since / took if took > 0 and done_since > 0 else 0.0
    eta = remaining / rate - (now - saved_at) if rate else -math.inf
    return rate, max(eta, 0.0) if eta > -OVERDUE_S or not remaining else -1.0


class InUse(Exception):
    """Another server holds the jobs directory."""


def lock_directory(directory: Path) -> int:
    """Hold `directory` for this process (flock on DIR/lock, our pid written in it);
    InUse if another holds it. The lock goes with the process or the returned fd."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise InUse(
            f"{directory} is in use by another batchd (pid {holder}); give this "
            "server its own --jobs-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


class LeaseLost(Exception):
    """This server no longer runs the job: another replica took it over (its lease
    here ran out), or it was given back. Nothing of this run is kept past it. Its
    message says which job, and so."""


class Submitted(Exception):
    """The submission's idempotency key is already on a stored job, `job_id`: the
    one it made before (its answer lost), or one sent at the same time."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


MAX_KEY_CHARS = 256  # of an idempotency key


def new_job_id() -> str:
    return "job-" + secrets.token_hex(8)


class Results(ABC):
    """A running job's results, open for appending after its last checkpoint."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def tell(self) -> int:
        """Bytes of results, those of the last checkpoint and those written since."""

    @abstractmethod
    def unsaved(self) -> int:
        """Bytes written since the last checkpoint."""

    @abstractmethod
    def close(self) -> None: ...


class PendingResults(Results):
    """Results written since the last checkpoint, held until it inserts them (postgres.py):
    at most runner.CHECKPOINT_BYTES and one chunk's answers."""

    def __init__(self, at: int) -> None:
        self.saved, self.size = at, 0
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def tell(self) -> int:
        return self.saved + self.size

    def unsaved(self) -> int:
        return self.size

    def close(self) -> None:
        self.parts.clear()
        self.size = 0


class Store(ABC):
    """What jobs/service.py and jobs/runner.py need of a store. Every call that reads
    or writes the database is a coroutine: the PostgreSQL store runs them on a
    thread, so a slow database never holds the event loop."""

    directory: Path  # local: uploads are spooled here (SQLite: and everything kept)
    shared = False  # several replicas use it at once (a claim is a lease, postgres.py)
    renew_every_s = math.inf  # how often an upload says it goes on, and hears of a cancel

    def folder(self, job_id: str) -> Path:
        return self.directory / job_id

    def discard(self, job_id: str) -> None:
        discard(self.folder(job_id))

    def upload_path(self, job_id: str) -> Path:
        """Where the upload is written as it comes (create() made its folder)."""
        return self.folder(job_id) / "input.jsonl"

    @abstractmethod
    async def create(self, owner: str, model: str, version: str) -> JobRow:
        """A new job, `validating` while its file is uploaded and checked."""

    @abstractmethod
    async def uploading(self, job_id: str) -> str:
        """The upload of `job_id` is still coming (a shared store removes an upload
        whose replica stopped saying so); the job's status now, '' if it is gone.
        Anything but `validating` stops the upload: it was cancelled (anywhere)."""

    @abstractmethod
    async def queue(self, job_id: str, total: int, input_bytes: int, key: str = "") -> bool:
        """The upload is whole and checked: keep it, and let the job wait to run. False,
        and nothing kept, if the job is no longer `validating` (it was cancelled);
        Submitted, and nothing kept, if its owner's `key` is on another job already."""

    @abstractmethod
    async def keyed(self, owner: str, key: str) -> str | None:
        """The job that `owner`'s submission with idempotency `key` made, if any."""

    @abstractmethod
    async def get(self, job_id: str) -> JobRow | None: ...

    @abstractmethod
    async def select(self, owner: str | None, status: str = "", limit: int = 1000) -> list[JobRow]:
        """Newest first; `owner` None: everyone's."""

    @abstractmethod
    async def count(self, statuses: tuple[str, ...]) -> int: ...

    @abstractmethod
    async def by_status(self) -> dict[str, int]: ...

    @abstractmethod
    async def claim(self, exclude_models: frozenset[str] = frozenset(),
                    only: Collection[str] | None = None) -> JobRow | None:  # fmt: skip
        """The oldest job waiting to run, of a model not in `exclude_models` and, given
        `only` (the models this replica can run now), of one of those; now running here
        (PostgreSQL: also one whose replica stopped renewing its lease). A job naming a
        version other than the one loaded fails when it runs (chunks.job_model): version
        numbers are each server's own count of its loads."""

    @abstractmethod
    async def open_input(self, row: JobRow) -> Path:
        """A local file holding the claimed job's whole input."""

    @abstractmethod
    def open_results(self, row: JobRow) -> Results:
        """The claimed job's results, cut back to its checkpoint, open for appending."""

    @abstractmethod
    async def checkpoint(self, row: JobRow, results: Results, progress: Progress) -> str:
        """Make `results` durable, then record `progress` as the job's checkpoint; the
        job's status now (`cancelling`: another frontend or replica cancelled it).
        LeaseLost if this server no longer runs it."""

    @abstractmethod
    async def renew(self, row: JobRow) -> str:
        """Say the claimed job is still running here (a model slower than the lease
        writes nothing for a while); its status now. LeaseLost as for checkpoint."""

    @abstractmethod
    async def release(self, row: JobRow, results: Results, progress: Progress) -> None:
        """The server stops: checkpoint the claimed job and give it back, to run on from
        there at the next start here or, shared, on another replica at once."""

    @abstractmethod
    async def requeue(self, row: JobRow, why: str) -> None:
        """The claimed job, whose run this server's storage stopped (a full disk) or whose
        end it could not record: queued again, to run on from its last checkpoint (what
        was written after it is not kept), `why` its error till it is claimed again; or
        cancelled if a cancel came."""

    async def settle(self) -> None:  # noqa: B027 (a database commits durably)
        """The commits so far made durable (SQLite: its WAL fsynced, on a thread)."""

    @abstractmethod
    async def finish(self, row: JobRow, status: str, error: str = "") -> None:
        """The claimed job ended; LeaseLost as for checkpoint."""

    @abstractmethod
    async def cancel(self, job_id: str) -> None:
        """queued or validating -> cancelled at once (an upload's own server then stops
        it and removes the job); running -> cancelling (its runner ends it)."""

    @abstractmethod
    async def delete(self, job_id: str) -> None: ...

    @abstractmethod
    async def recover(self) -> list[str]:
        """At start-up: interrupted runs wait to run on, interrupted cancels end, and the
        uploads a crash cut short are removed; the ids of those removed."""

    @abstractmethod
    async def expire(self, retention_s: float) -> list[str]:
        """Remove the jobs that ended more than `retention_s` ago, at most EXPIRE_MOST of
        them (a backlog goes over several runs); their ids."""

    @abstractmethod
    async def trim(self, owner: str, keep: int) -> list[str]:
        """Remove `owner`'s ended jobs past its `keep` newest (--jobs-max-kept), at most
        TRIM_MOST of them (a lowered cap is reached over several submissions, none
        holding the event loop long); their ids."""

    @abstractmethod
    def read_results(self, job_id: str, start: int, end: int) -> AsyncIterator[bytes]:
        """Bytes `start` to `end` of the job's results (end: a checkpoint's), in pieces."""

    @abstractmethod
    def close(self) -> None: ...
