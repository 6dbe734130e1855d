"""One writer per rank directory: an advisory ``flock`` held for the session's lifetime.

The lock file (``rankR/.lock``) holds the holder's host and pid, so a second
writer of the same rank, in another process or another session of this one,
is told who has it. The kernel frees the lock when its holder's file is closed,
including when the process dies, so a killed job leaves no stale lock behind.
Readers take no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from probe.errors import ProbeError
from probe.rundir import layout


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says; a reading failure is only a vaguer message."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host = int(data["pid"]), str(data["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return "another writer"
    if pid == os.getpid() and host == socket.gethostname():
        return f"another session of this process (pid {pid} on host {host})"
    return f"pid {pid} on host {host}"


class RankLock:
    """The held lock of one rank directory; :meth:`release` (or the process's end) frees it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, rank_dir: Path) -> RankLock:
        """Lock ``rank_dir`` (which must exist) without waiting.

        Raises :class:`ProbeError` naming the holder when it is locked, and ``OSError`` when
        the lock file cannot be written (the caller's pre-flight check turns that into a
        ``ProbeError``).
        """
        path = rank_dir / layout.LOCK_FILE
        # Another writer with overwrite=True may remove the directory between our open and
        # our flock: a lock on a removed file excludes nobody, so take it again on the new one.
        for _ in range(3):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise ProbeError(
                    f"{str(rank_dir)!r} is being written by {holder} (lock {str(path)!r}); one writer "
                    "per rank: let it finish, or choose another out="
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                current = os.stat(path)
                opened = os.fstat(fd)
                if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, holder, 0)
                    return cls(fd, path)
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise ProbeError(f"{str(rank_dir)!r} keeps being removed by another writer; cannot lock it")

    def release(self) -> None:
        """Free the lock (the file stays: removing it would race with the next writer's open)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
