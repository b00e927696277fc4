"""server/private.py: frontend 0's private folder, made again by another user once a
/tmp cleaner removed it, is not trusted (late review 59b): no socket of ours is bound
in it, no pickle of ours written there, and none read from it."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from batchd.protos.model_config import ConfigError
from batchd.server import frontends, private

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="another user's folder needs root")


def _theirs(folder: Path) -> Path:
    """`folder`, made as another user's, that anyone may write in."""
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    folder.chmod(0o777)
    return folder


def test_a_folder_is_trusted_if_only_this_user_may_write_in_it_or_it_is_as_made(
    tmp_path: Path,
) -> None:
    (ours := tmp_path / "ours").mkdir(0o700)
    assert private.untrusted(ours) == ""
    made = private.known(ours)
    ours.chmod(0o2775)  # (its group may write in it: a umask of 002, a setgid folder)
    assert "only it may write in" in private.untrusted(ours)
    assert private.untrusted(ours, made) == ""  # (as it was made, or bound in, at start)
    (tmp_path / "link").symlink_to(ours)  # (a symlinked TMPDIR: macOS's /tmp)
    assert private.untrusted(tmp_path / "link", made) == ""
    (sticky := tmp_path / "sticky").mkdir()
    sticky.chmod(0o1777)  # (as /tmp: none may replace another's files there)
    assert private.untrusted(sticky) == ""
    assert "No such file" in private.untrusted(tmp_path / "none")
    assert private.parsed(private.said(made)) == made and private.said(None) == ""
    assert private.parsed("") is None and private.parsed("1:2") is None


@needs_root
def test_nothing_of_ours_is_written_into_another_user_s_folder_nor_read_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their at-start.pickle, unpickled by a child frontend, would run their code in it."""
    folder = _theirs(tmp_path / "batchd-x")
    with pytest.raises(PermissionError, match="uid 65534, drwxrwxrwx"):
        private.save(folder / "at-start.pickle", b"ours")
    assert not list(folder.iterdir())
    (planted := folder / "at-start.pickle").write_bytes(pickle.dumps(("theirs", "code")))
    monkeypatch.setenv(frontends.PARENT, "1")
    monkeypatch.setenv(frontends.MODELS, str(planted))
    with pytest.raises(ConfigError, match=r"cannot be read: .*only it may write in"):
        frontends.at_start(tmp_path, True, lambda: None)
    (ours := tmp_path / "ours").mkdir(0o700)
    (planted := ours / "at-start.pickle").write_bytes(b"x")
    os.chown(planted, NOBODY, NOBODY)  # (in our folder, but theirs)
    with pytest.raises(PermissionError, match="uid 65534, 1 link"):
        private.read(planted)
    planted.unlink()
    (ours / "elsewhere").write_bytes(b"x")
    planted.symlink_to(ours / "elsewhere")  # (no link followed)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        private.read(planted)
    planted.unlink()
    private.save(planted, b"ours")
    assert private.read(planted) == b"ours"
    made = private.known(ours)  # (a TMPDIR whose server squashes root: the folder made
    os.chown(ours, NOBODY, NOBODY)  # is nobody's; trusted as made, not as owned)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(PermissionError):
        private.read(planted)
    assert private.read(planted, private.known(ours)) == b"ours" and made != private.known(ours)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(3000):  # (30 s at most)
        if condition():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the condition never held")


@needs_root
def test_a_socket_is_not_listened_on_again_in_a_folder_another_user_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ours removed with its folder, theirs made: refused, said, and looked at again; ours
    made again (theirs removed too), listened on again there."""
    (folder := tmp_path / "batchd-x").mkdir(0o700)
    path = folder / "fe-1.sock"
    listeners: list[socket.socket] = []

    def bind() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        listeners.append(s)

    async def scenario() -> None:
        bind()
        kept = asyncio.ensure_future(private.keep_bound(str(path), bind, "its socket", 0.01))
        await asyncio.sleep(0)  # (it has found what it keeps)
        try:
            path.unlink()
            folder.rmdir()
            _theirs(folder)
            await _until(lambda: "cannot listen on" in caplog.text)
            assert len(listeners) == 1 and not path.exists()
            folder.rmdir()  # (a cleaner again): made again, ours
            await _until(lambda: len(listeners) == 2)
            assert path.exists() and private.untrusted(folder) == ""
        finally:
            kept.cancel()

    with caplog.at_level(logging.WARNING, "batchd.server"):
        try:
            asyncio.run(scenario())
        finally:
            for s in listeners:
                s.close()
    assert "is not a folder of this user's" in caplog.text


@pytest.mark.parametrize("where", ["group-writable", "through a symlink", "relative"])
def test_a_socket_is_listened_on_again_in_the_folder_it_was_first_bound_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A folder the operator chose, as it was at start, is trusted whoever may write in it:
    one of theirs that their group may write in (or reached through a symlink, or a
    relative --worker-endpoint's, the working directory) was refused after the cleaner
    removed the socket, and restarted workers could not connect (late review 59c)."""
    (folder := tmp_path / "run").mkdir(0o700)
    path = str(folder / "w.sock")
    if where == "group-writable":
        folder.chmod(0o2775)
    elif where == "through a symlink":
        (tmp_path / "link").symlink_to(folder)
        path = str(tmp_path / "link" / "w.sock")
    else:
        monkeypatch.chdir(folder)
        path = "w.sock"
    listeners: list[socket.socket] = []

    def bind() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        listeners.append(s)

    async def scenario() -> None:
        bind()
        kept = asyncio.ensure_future(private.keep_bound(path, bind, "its socket", 0.01))
        await asyncio.sleep(0)  # (it has found what it keeps)
        try:
            (folder / "w.sock").unlink()
            await _until(lambda: len(listeners) == 2)
        finally:
            kept.cancel()

    try:
        asyncio.run(scenario())
    finally:
        for s in listeners:
            s.close()
    assert (folder / "w.sock").exists()
