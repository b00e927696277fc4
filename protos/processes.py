"""The processes below one: what a model's code started in its worker, ended with it.

What a model's code starts (a pool's processes, DataLoader workers, a helper program)
is ended by the worker as it leaves (worker/loader.leave), with SIGKILL, once the
model's own atexit handlers and multiprocessing's have run. Before, they lived on after
the worker (reviews 52e, 53e). A worker killed, by its frontend (hung) or from outside,
runs nothing: its frontend kills what is left of the process group it leads
(server/supervisor.end_group). Linux only (/proc); elsewhere there is nothing to find.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """The pids below `pid` (children first), from one read of /proc."""
    below: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    # (the name, in parentheses, may hold spaces: the state and ppid follow)
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    below.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
