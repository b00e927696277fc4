"""Local workers forked from a zygote, not each exec'd with torch imported anew.

The supervisor asks `Zygote.fork` for each worker: the first ask starts `python -m
batchd.worker.zygote` (worker/zygote.py, its own session), which imports torch and
the worker's modules once and forks each worker from there, so a worker runs its main
in milliseconds, not 1.3 s (2 CPU-s) after its start, and shares those pages. What a
fork returns is a `Forked`, a worker's process as the supervisor uses one (pid,
returncode, wait, kill, terminate): the zygote reaps its workers and reports each
exit, which this module's reader turns into the waits' ends. A zygote that dies is
replaced at the next start; the workers it had are killed with their process groups
(SIGKILL: they were reparented, and would finish on their own, unseen) and seen to
exit so. Where no zygote can start (BATCHD_WORKER_ZYGOTE=0, or its start failed,
said once), `fork` returns None and the supervisor execs the worker as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("batchd.supervisor")
SWITCH = "BATCHD_WORKER_ZYGOTE"  # "0": exec each worker, as before
READY_S = 120.0  # its imports (torch's: 1.3 s on an idle machine)
CLOSE_S = 3.0
ANSWER_S = 10.0  # a fork not answered, or a killed worker's exit not told, in this: it hangs


class WorkerProcess(Protocol):
    """What the supervisor uses of a worker's process (asyncio's Process, or Forked)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    async def wait(self) -> int: ...
    def kill(self) -> None: ...
    def terminate(self) -> None: ...


class Forked:
    """A worker the zygote forked. Signalled only before its exit is reported: the
    zygote reaps it first, so its pid is free only from just before the report."""

    def __init__(self, pid: int, hung: Callable[[], None] = lambda: None) -> None:
        self.pid, self._hung = pid, hung  # (its zygote tells no exit: it is ended)
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # (reaped, its report on the way)
                os.kill(self.pid, sig)
            if sig == signal.SIGKILL:  # its exit must be told soon (a stopped zygote's never
                asyncio.get_running_loop().call_later(ANSWER_S, self._told_by)  # was: 58f)

    def _told_by(self) -> None:
        if self.returncode is None:
            self._hung()

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()


class ZygoteGone(OSError):
    """The zygote exited before it answered."""


class Zygote:
    def __init__(self) -> None:
        self._off = os.environ.get(SWITCH, "1").strip() == "0"
        self._proc: asyncio.subprocess.Process | None = None
        self._starting = asyncio.Lock()
        self._asked: deque[asyncio.Future[Forked]] = deque()  # answered in order
        self._children: dict[int, Forked] = {}
        self._reader: asyncio.Task[None] | None = None
        self._starting_proc: asyncio.subprocess.Process | None = None
        self.closed = False

    async def fork(self, argv: Callable[[int], list[str]]) -> Forked | None:
        """A worker forked with the arguments `argv(its parent's pid)`; None where no
        zygote runs or one died as it asked (the supervisor execs it instead). OSError:
        the zygote could not fork (no memory, no pid)."""
        proc = await self._running()
        if proc is None or proc.stdin is None:
            return None
        asked: asyncio.Future[Forked] = asyncio.get_running_loop().create_future()
        self._asked.append(asked)
        proc.stdin.write(json.dumps(argv(proc.pid)).encode() + b"\n")
        try:  # (shielded: a fork answered after it is given up is killed, _told)
            return await asyncio.wait_for(asyncio.shield(asked), ANSWER_S)
        except TimeoutError:  # a stopped or hung zygote: replaced (late review 58f)
            self._end(proc, f"it answered no fork in {ANSWER_S:g} s")
            asked.cancel()
            return None
        except ZygoteGone:
            return None

    def _end(self, proc: asyncio.subprocess.Process, why: str) -> None:
        """A zygote that hangs (SIGSTOPped, stuck): killed; its reader ends its workers."""
        if proc.returncode is None:
            log.error("the worker zygote (pid %d) hangs (%s): killing it", proc.pid, why)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def _running(self) -> asyncio.subprocess.Process | None:
        async with self._starting:
            if self._proc is None and not self._off:
                self._proc = await self._start()
                self._off = self._off or self._proc is None  # (for good: said once; closed)
        return None if self._off else self._proc  # (closed: none)

    async def _start(self) -> asyncio.subprocess.Process | None:
        try:  # the frontend's stdout, its workers' (above 2: never one of the zygote's own)
            out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
        except OSError:  # (none: theirs is /dev/null)
            out = -1
        try:
            proc = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "batchd.worker.zygote"),
                *(("--stdout-fd", str(out)) if out >= 0 else ()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(out,) if out >= 0 else (),
                start_new_session=True,  # (no signal to the server's group reaches it)
            )
        except OSError as e:
            log.error("could not start the worker zygote (%s); workers are exec'd", e)
            return None
        finally:
            if out >= 0:
                os.close(out)
        self._starting_proc = proc  # (close() ends it: a stop waits for no start)
        if self.closed:  # (a close came as it was made)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            assert proc.stdout is not None
            await asyncio.wait_for(self._ready(proc, proc.stdout), READY_S)
        except (TimeoutError, ValueError) as e:
            if not self.closed:  # (a stop's close ended it: nothing to say)
                log.error("the worker zygote did not start (%s); workers are exec'd", e)
            await _ended(proc)
            return None
        except BaseException:
            await asyncio.shield(_ended(proc))
            raise
        log.info("started the worker zygote (pid %d)", proc.pid)
        self._reader = asyncio.create_task(self._read(proc), name="worker-zygote")
        return proc

    async def _ready(self, proc: asyncio.subprocess.Process, out: asyncio.StreamReader) -> None:
        """Wait for its "ready". What its imports printed before (a sitecustomize, with
        PYTHONUNBUFFERED=1: the zygote was given up for good, late review 58f) goes to
        the frontend's stdout, as an exec'd worker's did; ValueError if it exits first."""
        while line := await out.readline():
            if _said(line, "ready") == proc.pid:
                return
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
        raise ValueError("it exited")

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        try:
            while line := await proc.stdout.readline():
                self._told(json.loads(line), proc)
        except Exception:  # (a zygote that says what it must not: it goes, as if it died)
            log.exception("the worker zygote (pid %d) answered wrongly", proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        code = await proc.wait()
        if self._proc is proc:
            self._proc = None
        for asked in self._asked:
            if not asked.done():
                asked.set_exception(ZygoteGone(f"the worker zygote exited ({code})"))
        self._asked.clear()
        children, self._children = self._children, {}
        if children and not self.closed:
            log.error("the worker zygote (pid %d) exited with code %s; killing its %d "
                      "worker(s)", proc.pid, code, len(children))  # fmt: skip
        for child in children.values():
            with contextlib.suppress(OSError):  # (each leads its own group: setsid)
                os.killpg(child.pid, signal.SIGKILL)
            child.exited(-signal.SIGKILL)

    def _told(self, message: dict[str, Any], proc: asyncio.subprocess.Process) -> None:
        if "exit" in message:
            if (child := self._children.pop(message["exit"], None)) is not None:
                child.exited(message["code"])
            return
        asked = self._asked.popleft()
        if "error" in message:
            if not asked.done():
                asked.set_exception(OSError(f"the worker zygote: {message['error']}"))
            return
        hung = functools.partial(self._end, proc, "it told no exit of a worker killed")
        child = self._children[message["pid"]] = Forked(message["pid"], hung)
        if asked.done():  # (its start was cancelled: nobody waits for this worker)
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
        else:
            asked.set_result(child)

    async def close(self, timeout_s: float = CLOSE_S) -> None:
        """End the zygote (its workers have exited): EOF, then SIGKILL if it lingers. (One
        starting as this is called, a stop in a server's first second, is ended at once: the
        stop waited for its start, up to READY_S: late review 58f.)"""
        self._off = self.closed = True  # (it forks no more)
        if (starting := self._starting_proc) is not None and self._proc is None:
            with contextlib.suppress(ProcessLookupError):
                starting.kill()
        async with self._starting:
            proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
        await _ended(proc)
        if self._reader is not None:
            await self._reader


def _said(line: bytes, key: str) -> Any:
    """What a line of the zygote's says under `key` (None: not that)."""
    try:
        return json.loads(line).get(key)
    except (ValueError, AttributeError):
        return None


async def _ended(proc: asyncio.subprocess.Process) -> None:
    """Kill `proc` if it runs, and reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
