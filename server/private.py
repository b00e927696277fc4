"""Frontend 0's private folder (TMPDIR/batchd-*, 0700) and the Unix sockets in it or
given by flag: the workers' (ipc://), each frontend's for the others (--frontends N),
and the models and tokens a child frontend starts with (at-start.pickle).

A /tmp cleaner may remove any of them while the server runs: each socket is listened
on again (`keep_bound`), the folder made again. A folder of its name that another user
made meanwhile is not trusted (`untrusted`): nothing of ours goes into it, and nothing
read from it is believed (a pickle there would be code run in a child frontend)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from batchd.protos.model_config import ConfigError

log = logging.getLogger("batchd.server")


Known = tuple[int, int, int]  # a folder as it was made: its device, inode and owner
FOLDER = "BATCHD_FRONTEND_0_FOLDER"  # in a child frontend's environment: the folder, Known


def known(path: str | Path) -> Known | None:
    """The folder (or socket) `path` as it is now (None: none there); os.stat follows a
    symlinked TMPDIR."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_uid


def said(made: Known | None) -> str:
    """`made` as FOLDER carries it to a child frontend ("": none); `parsed` reads it."""
    return ":".join(map(str, made or ()))


def parsed(text: str) -> Known | None:
    """A folder as FOLDER says it was made ("dev:ino:uid"); None if it says none."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    dev, ino, uid = map(int, parts)
    return dev, ino, uid


def untrusted(folder: str | Path, made: Known | None = None) -> str:
    """Why `folder` is not to be trusted ("": it is): it is still the one `made` (as it was
    at start: a socket's folder the operator chose, a TMPDIR root squashes), or one that
    only this user (or root) may put files in (a sticky one, /tmp, lets none replace
    ours). Another user who made a folder of its name once a cleaner removed ours could
    put a socket or a pickle of theirs there (late review 59b)."""
    try:
        return _judged(os.stat(folder), folder, made)
    except OSError as e:
        return f"{folder}: {e.strerror or e}"


def _judged(st: os.stat_result, folder: str | Path, made: Known | None) -> str:
    mode, owner = st.st_mode, st.st_uid
    if made is not None and (st.st_dev, st.st_ino, owner) == made:
        return ""
    if stat.S_ISDIR(mode) and owner in (os.geteuid(), 0) and (
            not mode & 0o022 or mode & stat.S_ISVTX):  # fmt: skip
        return ""
    return (f"{folder} is not a folder of this user's (uid {os.geteuid()}) that only it may "
            f"write in: uid {owner}, {stat.filemode(mode)}")  # fmt: skip


@contextlib.contextmanager
def _opened(folder: Path, made: Known | None) -> Iterator[int]:
    """`folder` opened (its last part no symlink), judged as opened: no swap of it between
    the look and the use (late review 59c)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if why := _judged(os.fstat(fd), folder, made):
            raise PermissionError(why)
        yield fd
    finally:
        os.close(fd)


def save(path: Path, data: bytes, made: Known | None = None) -> None:
    """Write `path` whole or not at all (a child may be reading it), 0600 (token digests),
    in a folder that is ours alone (`untrusted`; PermissionError if it is not)."""
    with _opened(path.parent, made) as folder:
        writing = f"{path.name}.new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(writing, dir_fd=folder)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with open(os.open(writing, flags, 0o600, dir_fd=folder), "wb") as f:
            f.write(data)
        os.replace(writing, path.name, src_dir_fd=folder, dst_dir_fd=folder)


def read(path: Path, made: Known | None = None) -> bytes:
    """What `save` wrote: PermissionError if its folder is not to be trusted, or it is
    not a file of the folder's owner (no link)."""
    with _opened(path.parent, made) as folder:
        owner = os.fstat(folder).st_uid
        with open(os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder), "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != owner or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise PermissionError(f"{path} is not a file of its folder's owner (uid {owner}"
                                      f"): uid {st.st_uid}, {st.st_nlink} link(s)")  # fmt: skip
            return f.read()


async def keep_bound(path: str, bind: Callable[[], Any], what: str, every_s: float = 1.0) -> None:
    """Listen on the Unix socket `path` again, `bind()` (awaited if a coroutine's), whenever
    its file is gone (its folders too): a /tmp cleaner that removed the workers' left
    every restarted worker unable to connect, for good, the server live and unready
    (review 58c); a frontend's for the others (--frontends N), every scrape and statistics
    without it. A second listener: closing the first (unbind) cut every worker's
    connection, their work run again (late review 58e). A file another process put there
    (a second server on the same path) is its: said once, not taken back (each took it
    from the other every second). Its folder, made again by another user, is not
    trusted: said, and looked at again each second."""
    folder = os.path.dirname(path) or "."  # (a relative ipc://w.sock's: here)
    bound, made, said = known(path), known(folder), False
    while bound is not None:
        await asyncio.sleep(every_s)
        if (now := known(path)) == bound:
            continue
        if now is not None:  # (another's: ours cannot be found there again)
            log.warning("%s %s was replaced by another process's; what connects there from "
                        "now reaches that one", what, path)  # fmt: skip
            return
        if not said:
            log.warning("%s %s was removed; listening there again", what, path)
        try:
            os.makedirs(folder, 0o700, exist_ok=True)
            if why := untrusted(folder, made):  # (the one it was bound in, or ours alone)
                raise PermissionError(why)
            if asyncio.iscoroutine(again := bind()):
                await again
        except (OSError, zmq.ZMQError, ConfigError) as e:
            if not said:
                log.error("cannot listen on %s again (%s); trying each second", path, e)
            said = True
            continue
        bound, said = known(path), False
