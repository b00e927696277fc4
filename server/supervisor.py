"""Local worker processes: plan them, start them, restart them, stop them.

The frontend holds handles only; each worker runs `python -m batchd.worker`'s
main in its own process, forked from a zygote that imported torch once
(server/zygote.py; BATCHD_WORKER_ZYGOTE=0: exec'd, each importing it). A worker
that exits is reported lost at once (its batches are requeued) and restarted with
exponential backoff: a crash loop (a model whose load ends the process, a broken
device) must not spin. Not after a death while it ran one online request alone
(core.worker_exited says): recovery.py bounds the deaths one request may cause (two,
then its inputs are refused a while: quarantine.py), and backed off, a client
resending a poison request kept the whole pool down for every model. Stop: the
dispatcher sends STOP, then we wait, then terminate, then kill, then the zygote
goes. Workers also watch their parent (the zygote, which exits once its frontend is
gone) and exit if it disappears, so none is ever orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from batchd.protos.model_config import ModelConfig
from batchd.protos.processes import descendants, kill_all
from batchd.server.zygote import WorkerProcess, Zygote

log = logging.getLogger("batchd.supervisor")
BACKOFF_FIRST_S, BACKOFF_MAX_S, STABLE_AFTER_S = 0.2, 10.0, 30.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    slot: str  # stable name of this place: "cpu0", "cuda0.1"
    device: str  # "cpu", "cuda:0"
    models: tuple[str, ...]
    threads: int


def plan_workers(
    models: Sequence[ModelConfig], devices: Sequence[str], threads: int | None = None
) -> list[WorkerSpec]:
    """One process per listed device (listed twice: two) and per model copy: the first
    copy of a device may load any model (models=()), copy i > 0 the models whose
    `instances.count` exceeds i. CPU worker threads split the cores."""
    copies = max((m.instances.count for m in models), default=1)
    specs = []
    seen: set[str] = set()
    for d, device in enumerate(devices):
        base = device.replace(":", "") if device != "cpu" else f"cpu{d}"
        base = f"{base}-{d}" if base in seen else base  # cuda:0,cuda:0: two workers on one GPU
        seen.add(base)
        for i in range(copies):
            names = tuple(m.name for m in models if m.instances.count > i) if i else ()
            if names or not i:
                specs.append(WorkerSpec(f"{base}.{i}" if copies > 1 else base, device, names, 0))
    per = threads or max(1, usable_cpus() // max(1, len(specs)))
    return [WorkerSpec(s.slot, s.device, s.models, per) for s in specs]


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup"),
                ) -> int:  # fmt: skip
    """The cores this process may use: those its affinity allows (taskset, a cpuset),
    at most the tightest CPU quota of its cgroup and those above it (a container's limit,
    systemd's CPUQuota=), not the machine's: os.cpu_count() gave each worker of a pod
    with 2 CPUs on a 64-core node 32 threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cores = os.cpu_count() or 1
    quotas = []
    with contextlib.suppress(OSError, ValueError):  # (a line of another form: no quota read)
        for line in own.read_text().splitlines():  # "0::/a/b" (v2), "4:cpu,cpuacct:/a" (v1)
            _, controllers, path = line.split(":", 2)
            if controllers and "cpu" not in controllers.split(","):
                continue
            mount = cgroup / controllers if (cgroup / controllers).is_dir() else cgroup / "cpu"
            top = cgroup if not controllers else mount
            here = top / path.strip("/")
            for folder in [here, *here.parents]:  # (the mount shows a container's own at top)
                if folder.is_relative_to(top):
                    quotas += _quota(folder, v2=not controllers)
    quota = min(quotas, default=None)
    return max(1, min(cores, math.ceil(quota))) if quota else max(1, cores)


def _quota(folder: Path, v2: bool) -> list[float]:
    """The CPUs a cgroup's quota allows, if it sets one."""
    with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
        if v2:  # "max 100000", "200000 100000"
            most, period = (folder / "cpu.max").read_text().split()[:2]
            return [] if most == "max" else [int(most) / int(period)]
        quota = int((folder / "cpu.cfs_quota_us").read_text())  # -1: none
        return [quota / int((folder / "cpu.cfs_period_us").read_text())] if quota > 0 else []
    return []


@dataclass(frozen=True)
class Launch:
    """How local workers are started."""

    repository: Path
    specs: tuple[WorkerSpec, ...] = ()  # none: no local workers
    endpoint: str = ""  # what they connect to (several frontends: comma-separated)
    log_level: str = "INFO"
    log_format: str = "text"
    worker_keys: Path | None = None  # CURVE key directory, passed on to them
    otlp_endpoint: str | None = None  # --otlp-endpoint, passed on (OTEL_* pass by the environment)


class Supervisor:
    def __init__(self, launch: Launch, on_exit: Callable[[str, int, str], bool]) -> None:
        self.specs = list(launch.specs)
        self._launch = launch
        keys = launch.worker_keys
        self._keys = [] if keys is None else ["--worker-keys", str(keys)]
        if launch.otlp_endpoint:
            self._keys += ["--otlp-endpoint", launch.otlp_endpoint]
        self.restarts = {s.slot: 0 for s in self.specs}  # by slot: 0 from the start, so an
        # increase() over the series sees the first restart
        self._on_exit = on_exit  # (worker id, pid, why) -> whether a request ended it
        self._procs: dict[str, tuple[str, WorkerProcess]] = {}
        self.zygote = Zygote()  # what workers are forked from (server/zygote.py)
        self._stopping = False
        self._groups: set[int] = set()  # the workers leading a process group (_end_group)

    def pids(self) -> dict[str, int]:
        return {wid: p.pid for wid, p in self._procs.values() if p.returncode is None}

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for spec in self.specs:
                tg.create_task(self._keep_running(spec), name=f"worker-{spec.slot}")

    async def _start(self, spec: WorkerSpec, worker_id: str) -> WorkerProcess:
        # Born with SIGINT and SIGTERM blocked (the mask passes through fork and exec), which
        # it unblocks once it ignores them: a signal to the whole group in its first seconds,
        # torch's import, killed it, and it was started again during the stop. Unblocked
        # again once this step yields, its fork done (asyncio forks before its first wait),
        # and only those this start blocked: restored to the mask it found after the await,
        # two starts interleaved and the second restored the first's blocked mask, for good;
        # a child frontend started later inherited it, ignored SIGTERM, and its streams
        # were cut at the stop's 40 s (review 54c; a frontend unblocks both as it starts).
        # A worker forked from the zygote is born with both blocked by the zygote; the
        # zygote, started here, with this mask (and one exec'd as a fallback, as before)
        both = {signal.SIGINT, signal.SIGTERM}
        blocked = both - signal.pthread_sigmask(signal.SIG_BLOCK, both)
        asyncio.get_running_loop().call_soon(signal.pthread_sigmask, signal.SIG_UNBLOCK, blocked)
        proc = await self._exec(spec, worker_id)
        with contextlib.suppress(OSError):  # (alive: it has not even registered yet)
            if os.getpgid(proc.pid) == proc.pid:  # (a session of its own: start_new_session)
                self._groups.add(proc.pid)
        return proc

    async def _exec(self, spec: WorkerSpec, worker_id: str) -> WorkerProcess:
        forked = await self.zygote.fork(lambda parent: self._argv(spec, worker_id, parent))
        if forked is not None:
            return forked
        if self._stopping:  # (a stop closed the zygote: no worker is started now)
            raise _Stopping
        return await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "batchd.worker"),
            *self._argv(spec, worker_id, os.getpid()),
            # its own process group: a signal to the server's whole group (Ctrl-C, kill
            # -TERM -PGID) reaches neither it nor what its model started (a pool, whose
            # processes a SIGTERM ends, mid-drain); it leaves when the frontend says STOP
            # (a forked one too: the zygote's child calls setsid)
            start_new_session=True,
        )

    def _argv(self, spec: WorkerSpec, worker_id: str, parent: int) -> list[str]:
        """A worker's arguments; `parent`: the process whose exit stops it (this one, or
        the zygote it is forked from)."""
        return [
            *("--connect", self._launch.endpoint, "--device", spec.device, "--id", worker_id),
            *("--model-repository", str(self._launch.repository)),
            *("--models", ",".join(spec.models), "--threads", str(spec.threads)),
            *("--parent-pid", str(parent), "--log-level", self._launch.log_level),
            *("--log-format", self._launch.log_format, *self._keys),
        ]

    async def _keep_running(self, spec: WorkerSpec) -> None:
        backoff = BACKOFF_FIRST_S
        generation = 0
        while not self._stopping:
            worker_id, ran = f"{spec.slot}#{generation}", False
            try:
                proc = await self._start(spec, worker_id)
            except OSError as e:  # no process (out of memory, of pids): try again later
                if self._stopping:  # (or a stop came as it started: nothing to say)
                    return
                log.error("could not start worker %s (%s); trying in %.1f s", worker_id, e, backoff)
            else:
                if self._stopping:  # (begun as it started: the stop waits for none it
                    proc.kill()  # has not seen, and it would be forked to be killed: 58f)
                    return
                if generation:
                    self.restarts[spec.slot] = self.restarts.get(spec.slot, 0) + 1
                self._procs[spec.slot] = (worker_id, proc)
                log.info(
                    "started worker %s (pid %d) on %s for %s",
                    worker_id,
                    proc.pid,
                    spec.device,
                    ", ".join(spec.models) or "any model",
                    extra={"worker": worker_id, "device": spec.device},
                )
                started = time.monotonic()
                code = await proc.wait()
                self._end_group(proc.pid, last=True)  # killed from outside: what it started
                if self._stopping:
                    return
                ran = self._on_exit(worker_id, proc.pid, f"process exited ({_exit_reason(code)})")
                if ran or time.monotonic() - started > STABLE_AFTER_S:
                    backoff = BACKOFF_FIRST_S
                log.warning(
                    "worker %s exited with code %s; restarting in %.1f s",
                    worker_id,
                    code,
                    backoff,
                    extra={"worker": worker_id},
                )
            await asyncio.sleep(backoff)
            backoff = backoff if ran else min(backoff * 2, BACKOFF_MAX_S)
            generation += 1

    def kill(self, worker_id: str, pid: int) -> None:
        """Kill a local worker that is alive but useless (hung past its execution limit):
        the process of that id and pid (a peer that registered under a local worker's id
        had the healthy local worker killed)."""
        for wid, proc in self._procs.values():
            if wid == worker_id and proc.pid == pid and proc.returncode is None:
                log.warning("killing worker %s (pid %d)", wid, proc.pid, extra={"worker": wid})
                below = self._below(proc.pid)  # (one in a session of its own too: setsid)
                proc.kill()
                self._end_group(proc.pid)  # what its model started, with it
                kill_all(below)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers (already told STOP) to exit; terminate, then kill, stragglers."""
        self._stopping = True
        procs = [p for _, p in self._procs.values()]
        for signal_step in (None, "terminate", "kill"):
            alive = [p for p in procs if p.returncode is None]
            if not alive:
                break
            below = [d for p in alive for d in self._below(p.pid)] if signal_step == "kill" else []
            for p in alive:
                if signal_step is not None:
                    with contextlib.suppress(ProcessLookupError):
                        getattr(p, signal_step)()
                if signal_step == "kill":
                    self._end_group(p.pid)  # (killed: what its model started goes with it)
            kill_all(below)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(p.wait() for p in alive)),
                    timeout_s if signal_step is None else 3.0,
                )
        for p in procs:  # what a worker killed, here or from outside, left behind
            self._end_group(p.pid, last=True)
        await self.zygote.close()  # (it forks no more: every worker has exited)

    def _below(self, pid: int) -> list[int]:
        """The processes below a local worker this supervisor started (not a pid alone)."""
        return descendants(pid) if pid in self._groups else []

    def _end_group(self, pid: int, last: bool = False) -> None:
        """SIGKILL what is left in the process group local worker `pid` leads (its own: it
        starts in a session of its own, checked as it started), that is, what its model
        started: with a worker killed from outside (the OOM killer, an operator), they
        lived on, re-parented, for good. (One that left the group, setsid, is found by its
        parent while the worker lives: kill, stop.) A group's id is given to no new process
        while the group has a member; once it has none, this finds nothing. `last`: the
        worker was reaped, and this is the last look."""
        if pid in self._groups:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        if last:
            self._groups.discard(pid)


class _Stopping(OSError):
    """No worker is started once a stop began."""


def _exit_reason(code: int) -> str:
    """`exit code 3`, `killed by SIGKILL`; a signal with no name (real-time) by number."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
