"""Opening a run's files as untrusted input: only regular files inside the run directory.

A run directory may come from anyone (a colleague's tarball, a shared disk, a hand edit).
Every file the reader opens goes through :func:`open_in_run`, which

- resolves the path (symlinks followed) and refuses it when the real file lies outside the
  run directory's own real path: a link to a file elsewhere is never followed, so a run
  cannot make the reader read (and a compare pass on) data it does not hold;
- refuses anything but a regular file: a FIFO would block the reader forever, a device
  (``/dev/zero``, ``/dev/urandom``) never ends, a socket or a directory is no file. The kind
  is checked with ``stat`` before the open (opening some devices has effects) and again on
  the open descriptor (opened ``O_NONBLOCK``, so a FIFO swapped in between cannot block);
- bounds what is read: never past the size the file had when opened, and never more than
  the limit the caller gives (the format's: see :mod:`probe.rundir.untrusted_reads`).

Each refusal is a :class:`ProbeError` naming the file. The check between resolving and
opening is not atomic (a directory swapped for a link in that instant escapes it); it guards
against hostile contents, not against a concurrent attacker on the same machine.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np

from probe.errors import ProbeError

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a link"}
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | \
    getattr(os, "O_CLOEXEC", 0)


def _refuse(path: Path | str, why: str) -> ProbeError:
    return ProbeError(f"cannot read {str(path)!r}: {why}")


def _size_text(size: int) -> str:
    return f"{size} bytes" if size < 1 << 20 else f"{size / (1 << 20):.0f} MiB"


def resolve_in_run(path: Path | str, run: Path | str) -> str:
    """The real path of ``path``, which must lie inside the real path of ``run`` (else a
    ``ProbeError`` naming ``path`` and where it leads)."""
    root = os.path.realpath(run)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise _refuse(path, f"it leads to {real!r}, outside the run directory {root!r}; a run's "
                      "files are read only from inside it")
    return real


def check_directory(path: Path | str, run: Path | str) -> None:
    """Refuse a directory of the run (a rank's, a step's) that is a link leading outside it."""
    resolve_in_run(path, run)


def _check_regular(path: Path | str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise _refuse(path, f"it is {kind}, not a regular file")


class RunFile:
    """An open regular file of a run: ``file`` (binary, unbuffered reads bounded by ``size``)."""

    def __init__(self, path: Path | str, fd: int, size: int) -> None:
        self.path, self.size = path, size
        self.file: BinaryIO = os.fdopen(fd, "rb")

    def check_size(self, limit: int) -> None:
        """Refuse the file, unread, when it holds more than ``limit`` bytes."""
        if self.size > limit:
            raise _refuse(self.path, f"it holds {_size_text(self.size)}, more than the "
                          f"{_size_text(limit)} this file may hold")

    def read(self, limit: int | None = None) -> bytes:
        """The whole file (its size when opened), refused when larger than ``limit`` bytes."""
        if limit is not None:
            self.check_size(limit)
        return self.file.read(self.size)

    def lines(self, line_limit: int) -> Iterator[bytes]:
        """The file's lines (newline kept), each at most ``line_limit`` bytes, streamed: a
        longer one is refused before more than ``line_limit`` bytes of it are read."""
        left = self.size
        number = 0
        while left > 0:
            line = self.file.readline(min(line_limit + 1, left))
            if not line:
                return
            number += 1
            left -= len(line)
            if len(line) > line_limit:
                raise _refuse(self.path, f"line {number} is longer than the {_size_text(line_limit)} "
                              "a line of this file may hold")
            yield line

    def text(self) -> io.TextIOWrapper:
        """The file as UTF-8 text (universal newlines off), read as it is consumed."""
        return io.TextIOWrapper(self.file, encoding="utf-8", newline="")

    def map(self, offset: int, length: int) -> np.ndarray:
        """``length`` bytes from ``offset``, memory-mapped copy-on-write (nothing read until used)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"bytes {offset} to {offset + length} reach past the end of the file "
                             f"({self.size} bytes)")
        return np.memmap(self.file, dtype=np.uint8, mode="c", offset=offset, shape=(length,))

    def close(self) -> None:
        self.file.close()


@contextmanager
def open_in_run(path: Path | str, run: Path | str | None = None) -> Iterator[RunFile]:
    """Open ``path``, a regular file inside the run directory ``run`` (default: the file's own
    directory), for reading; anything else is a ``ProbeError`` naming ``path``."""
    real = resolve_in_run(path, Path(path).parent if run is None else run)
    try:
        _check_regular(path, os.stat(real).st_mode)
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as e:
        raise _refuse(path, e.strerror or str(e)) from None
    try:
        info = os.fstat(fd)
        _check_regular(path, info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    opened = RunFile(path, fd, info.st_size)
    try:
        yield opened
    finally:
        opened.close()


def read_in_run(path: Path | str, run: Path | str | None, limit: int) -> bytes:
    """The bytes of a regular file inside the run, at most ``limit`` of them (else refused)."""
    with open_in_run(path, run) as f:
        return f.read(limit)

