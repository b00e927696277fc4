"""`--frontends N`: more gRPC frontend processes on the same port, in front of
the same workers, for when one event loop is the ceiling.

Every frontend binds the gRPC port (and the HTTP one) with SO_REUSEPORT, so the kernel spreads
client connections across them; each runs the whole frontend (validation,
queues, batching, dispatch) on its own ZeroMQ endpoint, and every worker
connects to all of them (`--connect ep0,ep1,...`) and answers each on its
own socket. A worker serves one batch at a time from any frontend, in the
order they came; each frontend batches the requests it received.

The first process (index 0) owns the workers and the children: it starts
frontends 1..N-1 with its own arguments, restarts one that dies, and on
shutdown tells them to drain first, then stops the workers. A child exits
if the first process goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import Any, TypeVar

import zmq

from batchd.protos.model_config import ConfigError, ModelConfig
from batchd.protos.repository import NO_MODELS, Files, files_of, load_repository, strays
from batchd.server import private, siblings
from batchd.server.config import Models as ModelControl
from batchd.server.errors import Unavailable

PARENT = "BATCHD_FRONTEND_0_PID"  # in a child frontend's environment: who started it
MODELS = "BATCHD_FRONTEND_0_MODELS"  # ... and the file of its models and tokens at start
BEAT = "BATCHD_FRONTEND_BEAT"  # ... and the socket it beats on (watch_parent)
SOCKET = "BATCHD_FRONTEND_SOCKET"  # ... and its socket for the others (siblings.py)
Models = tuple[dict[str, ModelConfig], dict[str, Files]]  # by name: config, files then
log = logging.getLogger("batchd.server")
BACKOFF_FIRST_S, BACKOFF_MAX_S, STABLE_AFTER_S = 0.5, 10.0, 30.0
# A child's first beat comes once it has imported and set up (~1 s, more on a loaded
# host): till then it has this long, however short --frontend-timeout (1 s killed each)
START_S = 10.0
T = TypeVar("T")


def endpoints(tmp: str, count: int) -> list[str]:
    """The private ipc:// endpoint of each frontend, index 0 first; ConfigError if one
    is longer than a socket's path may be (a long TMPDIR: each child failed to bind
    it, and was started again and again)."""
    every = [f"ipc://{tmp}/workers.sock"] + [
        f"ipc://{tmp}/workers-{i}.sock" for i in range(1, count)
    ]
    if len(every[-1]) - len("ipc://") > (most := zmq.IPC_PATH_MAX_LEN):
        raise ConfigError(f"the workers' socket {every[-1]} is longer than a socket path may "
                          f"be ({most} bytes): set TMPDIR to a shorter path")  # fmt: skip
    return every


def bind(router: zmq.Socket[Any], endpoint: str, given: bool) -> None:
    """The workers' socket on `endpoint` (`given`: by --worker-endpoint, else a private
    ipc:// path under TMPDIR); ConfigError saying which, if it cannot be."""
    try:
        router.bind(endpoint)
    except zmq.ZMQError as e:
        which = "--worker-endpoint" if given else "the workers' socket (under TMPDIR)"
        raise ConfigError(f"cannot bind {which} {endpoint}: {e}") from None


class Children:
    """Frontends 1..N-1, started and kept running by frontend 0."""

    def __init__(self, argv: Sequence[str], endpoints: Sequence[str], at: tuple[Models, Any],
                 tmp: str, hung_s: float) -> None:  # fmt: skip
        self._argv, self._hung_s = list(argv), hung_s  # (--frontend-timeout)
        self._endpoints = list(endpoints)
        self.sockets = siblings.sockets(tmp, len(endpoints))  # each one's, for the others
        self._models, self._saved = pickle.dumps(at), Path(tmp) / "at-start.pickle"  # (0700)
        self._made = private.known(tmp)  # (its folder as made: trusted, whoever owns it)
        self._env = {**os.environ, PARENT: str(os.getpid()), MODELS: str(self._saved),
                     private.FOLDER: private.said(self._made)}  # fmt: skip
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = False

    def _command(self, i: int, port: int, http_port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "batchd.server", *self._argv),
            *("--grpc-port", str(port), "--http-port", str(http_port)),
            *("--metrics-port", "-1", "--no-local-workers"),
            *("--worker-endpoint", self._endpoints[i], "--frontend-index", str(i)),
        ]

    async def run(self, port: int, http_port: int) -> None:
        """Keep frontends 1..N-1 running on the first's gRPC and HTTP ports (-1: off)."""
        async with asyncio.TaskGroup() as tg:
            for i in range(1, len(self._endpoints)):
                tg.create_task(self._keep_running(i, port, http_port), name=f"frontend-{i}")

    async def _keep_running(self, i: int, port: int, http_port: int) -> None:
        backoff = 0.0
        while not self._stopping:
            # Written before each start: a /tmp cleaner may have taken it since (each
            # restart then failed to read it, for good)
            with contextlib.suppress(OSError):
                private.save(self._saved, self._models, self._made)
            started, (ours, theirs) = time.monotonic(), socket.socketpair()
            beats, beating = ours.detach(), theirs.detach()  # (a pipe each way: see _watched)
            env = {**self._env, BEAT: str(beating), SOCKET: self.sockets[i]}
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._command(i, port, http_port), env=env, pass_fds=(beating,)
                )
                self._procs[i] = proc
                log.info("started frontend %d (pid %d)", i, proc.pid)
                os.close(beating)
                beating = -1
                code = await _watched(proc, beats, i, self._hung_s)
            finally:
                for fd in (beats, beating):
                    if fd >= 0:
                        os.close(fd)
            if self._stopping:
                return
            backoff = restart_after(backoff, time.monotonic() - started)
            log.warning("frontend %d exited with code %s; restarting in %.1f s", i, code, backoff)
            await asyncio.sleep(backoff)

    def send(self, sig: int) -> None:
        """Pass `sig` on to every child running (each drains as this process does)."""
        for p in self._procs.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    async def stop(self, timeout_s: float, sig: int = signal.SIGTERM) -> None:
        """Signal every child (each drains as this process does); wait, then kill."""
        self._stopping = True
        procs = [p for p in self._procs.values() if p.returncode is None]
        self.send(sig)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout_s)
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    log.error(
                        "frontend pid %d did not stop in %.0f s; killing it", p.pid, timeout_s
                    )
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()


def at_start(root: Path, child: bool, tokens: Callable[[], T],
             control: ModelControl | None = None) -> tuple[Models, T]:  # fmt: skip
    """The repository's models and their files, and the tokens (`tokens()` reads them):
    read now, or, in a child frontend (restarted ones too), as frontend 0 read them. A
    child that read the repository again served a model's files changed since as the
    version frontend 0 refused them for, and one that found a model added broken failed
    to start, again and again; one that read the token file again let in the tokens of
    an edit that the other frontends refused, until the next restart."""
    if not child:  # (a variable inherited from elsewhere is not this process's)
        for name in (PARENT, MODELS, BEAT, SOCKET, private.FOLDER):
            os.environ.pop(name, None)
    if saved := os.environ.get(MODELS):
        try:
            made = private.parsed(os.environ.get(private.FOLDER, ""))
            at: tuple[Models, T] = pickle.loads(private.read(Path(saved), made))  # (0's)
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            why = f"frontend 0's models and tokens at start ({saved}) cannot be read: {e}"
            raise ConfigError(why) from None
        if not (isinstance(at, tuple) and len(at) == 2 and isinstance(at[0], tuple)):
            why = f"frontend 0's models and tokens at start ({saved}) are another version's"
            raise ConfigError(why + " (batchd upgraded under it?): restart the server")
        return at
    if control is not None and control.explicit and "*" not in control.load:  # a folder
        named = frozenset(control.load)  # broken beside the models named was a server that
        repository = load_repository(root, functools.partial(_not_loaded, named))  # would
    else:  # not start again (review 57b): a load of it refuses it
        repository = load_repository(root)
    for stray in strays(root) + ([] if repository else [NO_MODELS]):  # (not again in a child)
        log.warning("%s", stray)
    files = {name: files_of(cfg.directory) for name, cfg in repository.items()}
    return (repository, files), tokens()


def _not_loaded(named: frozenset[str], folder: Path, e: ConfigError) -> None:
    if folder.name in named or getattr(e, "name", None) in named:  # (its own error, not
        raise e  # "--load-model NAME: not in the repository": late review 57d)
    log.warning("%s; not loaded (a load of it is refused till it is mended)", e)


def parent() -> int:
    """A child frontend's frontend 0, as it said when it started the child: read from its
    parent process once that is gone, the child would take init for frontend 0."""
    return int(os.environ.get(PARENT) or os.getppid())


def sibling(pid: int) -> bool:
    """Whether this is a child frontend and process `pid` is alive and was started by its
    frontend 0 (a local worker: its silence is the GIL held, its exit seen by frontend 0),
    itself or by the zygote it started (server/zygote.py). Never in frontend 0: a remote
    worker's pid, of another host, is not in its /proc."""
    if PARENT not in os.environ:
        return False
    up = _parent_of(pid)
    if up is not None and up != parent() and _parent_of(up) == parent():
        with contextlib.suppress(OSError):  # (a zygote: frontend 0's child)
            up = parent() if b"batchd.worker.zygote" in _cmdline(up) else up
    return up == parent()


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # (ppid: after the name)


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def gone(pid: int) -> bool:
    """Whether this is a child frontend and worker `pid` is gone: its workers are all
    frontend 0's local processes (no --worker-endpoint with --frontends). Frontend 0
    gone, its workers outlive it a while, finishing what they hold (runner.py): each is
    gone once its process is (every one was taken for gone at once, and the sequences
    they were stepping failed as "lost", review 54c)."""
    if PARENT not in os.environ or sibling(pid):
        return False
    if os.getppid() == parent():
        return True
    try:  # (an orphan's parent is init, or a subreaper: not frontend 0)
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


async def _watched(
    proc: asyncio.subprocess.Process, beats: int, i: int, hung_s: float
) -> int | None:
    """Wait for a child frontend's exit; kill it if it stops beating for `hung_s`
    (watch_parent writes a byte to `beats` each round): a child hung (its event loop
    blocked, stopped) kept its listening socket and took its share of new connections,
    which hung. Each beat is answered, from this loop: the child hears whether this
    process is hung."""
    heard = woke = time.monotonic()
    limit = max(hung_s, START_S)  # till its first beat: it imports and sets up first

    def beat() -> None:
        nonlocal heard, limit
        try:
            got = os.read(beats, 4096)
        except BlockingIOError:
            return
        except OSError:  # reset: the child left an answer unread, as it exits
            got = b""
        if not got:  # its exit comes next
            loop.remove_reader(beats)
            return
        heard, limit = time.monotonic(), hung_s
        with contextlib.suppress(OSError):  # (the child's side full: it is behind)
            os.write(beats, b".")

    os.set_blocking(beats, False)
    loop = asyncio.get_running_loop()
    loop.add_reader(beats, beat)
    try:
        while (code := await _exit_within(proc, min(1.0, hung_s / 8))) is None:
            if (now := time.monotonic()) - woke > hung_s / 2:  # this process was stopped
                heard = now  # itself (the whole group: Ctrl-Z, a freeze): nobody's silence
            woke = now
            if now - heard > limit and proc.returncode is None:
                log.error("frontend %d (pid %d) silent for %g s; killing it", i, proc.pid, limit)
                proc.kill()
        return code
    finally:
        loop.remove_reader(beats)


async def _exit_within(proc: asyncio.subprocess.Process, seconds: float) -> int | None:
    with contextlib.suppress(TimeoutError):
        return await asyncio.wait_for(asyncio.shield(proc.wait()), seconds)
    return None


def restart_after(last: float, ran_s: float) -> float:
    """How long to wait before starting a child again that ran `ran_s` and exited, the
    last wait having been `last` (0: none yet): doubling, from BACKOFF_FIRST_S to
    BACKOFF_MAX_S, and back to the first after a run of STABLE_AFTER_S (it never went
    back: after a few crashes over days, each cost 10 s of that frontend)."""
    return BACKOFF_FIRST_S if ran_s > STABLE_AFTER_S or not last else min(last * 2, BACKOFF_MAX_S)


async def watch_parent(
    stop: asyncio.Event, workers: Callable[[], Sized], fail_all: Callable[[Exception], None],
    live: Callable[[bool], None], hung_s: float,
) -> None:  # fmt: skip
    """A child frontend stops (draining) when frontend 0 is gone, or was before it looked
    (it watched init for ever: it held the ports, and every call hung). Once the workers,
    frontend 0's, are gone too, what is left is answered UNAVAILABLE at once: no worker
    comes back (it waited out --drain-timeout). While frontend 0 answers no beat for
    `hung_s` (its loop blocked, the process stopped) this one is not live either, so that a
    liveness probe the kernel hands here restarts the server: nothing else restarts 0,
    whose callers wait (a probe reaching this frontend passed, and 0 was found late)."""
    beat = int(os.environ.get(BEAT, -1))  # frontend 0 hears from this child each round
    with contextlib.suppress(OSError):  # (none such: a stale variable; see below)
        os.set_blocking(beat, False)
    heard = woke = time.monotonic()
    hung = False
    while True:  # (no event tells a process its parent exited)
        if os.getppid() != parent():
            break
        if (now := time.monotonic()) - woke > hung_s / 2:  # this process was stopped itself
            heard = now  # (the whole group: Ctrl-Z, a freeze): not frontend 0's silence
        woke = now
        try:
            if beat >= 0:
                with contextlib.suppress(OSError):  # (full: frontend 0 is behind; gone: above)
                    os.write(beat, b".")
                heard = now if os.read(beat, 4096) else heard
        except BlockingIOError:
            pass
        except OSError:  # no such socket (a stale variable), or frontend 0 leaving: not watched
            beat = -1
        if hung != (beat >= 0 and now - heard > hung_s):
            hung = not hung
            said = f"silent for {hung_s:g} s: not live" if hung else "answers again: live"
            log.log(logging.ERROR if hung else logging.INFO, "frontend 0 (pid %d) %s",
                    parent(), said)  # fmt: skip
            live(not hung)
        await asyncio.sleep(min(0.5, hung_s / 8))
    log.warning("frontend 0 (pid %d) is gone; stopping", parent())
    stop.set()
    while True:
        if not workers():
            break
        await asyncio.sleep(0.2)
    fail_all(Unavailable("this frontend's frontend 0 and its workers are gone; retry"))
