"""Writing a run directory: every file lands complete or not at all.

A step is written into a hidden ``.stepN.partial`` directory, each file fsynced,
then renamed to ``stepN``: a reader sees a whole step or none of it, and a crash
mid-flush leaves only the partial directory, which the reader reports as
unfinished. Every step flushed before a crash stays readable.

Failures: the run directory is checked at the start by writing ``rank.json``
and ``run.json`` (an ``OSError`` there is a :class:`ProbeError` naming the path
and the reason). A step whose files cannot be written later is given up, not
raised: its partial directory is emptied (to free the space for later steps)
and left as the marker of an unfinished step, and a line in
``rankR/write_failures.jsonl`` names the step, the file and the error.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.errors import ProbeError
from probe.rundir import layout
from probe.rundir.lock import RankLock

# One encoder for every row: json.dumps with options builds a new encoder per call.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_JSONL_BATCH = 1024
"""Rows of a JSON-lines file encoded into one write."""


def jsonl_chunks(rows: Iterable[Any]) -> Iterator[bytes]:
    """A JSON-lines file's bytes, one chunk per :data:`_JSONL_BATCH` rows, encoded as they are
    asked for."""
    encode = _COMPACT_JSON.encode
    batch: list[str] = []
    for row in rows:
        batch.append(encode(row))
        if len(batch) == _JSONL_BATCH:
            yield ("\n".join(batch) + "\n").encode()
            batch = []
    if batch:
        yield ("\n".join(batch) + "\n").encode()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, obj: Any) -> None:
    # Per process: every rank of a job writes run.json into the same directory.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_file(tmp, json.dumps(obj, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _unwritable(path: Path, error: OSError) -> ProbeError:
    where = error.filename if error.filename is not None else path
    reason = error.strerror or str(error)
    if path.is_symlink() and not path.exists():
        reason = f"it is a symbolic link to {os.readlink(path)!r}, which does not exist"
    return ProbeError(f"cannot write the run directory {str(path)!r}: {str(where)!r}: {reason}")


class StepWriter:
    """Collects the files of one (rank, step) and commits them with one rename.

    ``tail``: what was recorded after the last ``session.step()``, committed to
    :func:`layout.tail_dir` instead of a step directory.
    """

    def __init__(self, out: Path, rank: int, step: int, tail: bool = False) -> None:
        self.out, self.rank, self.step, self.tail = out, rank, step, tail
        self.directory = (layout.partial_tail_dir if tail else layout.partial_step_dir)(out, rank, step)
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True)

    def write_json(self, name: str, obj: Any) -> None:
        _write_file(self.directory / name, _COMPACT_JSON.encode(obj).encode())

    def write_jsonl(self, name: str, rows: Iterable[Any]) -> None:
        """One JSON line per row, encoded and written a batch of rows at a time: a step of 10^6
        op records is never held whole as text (before: its lines, their join and its bytes)."""
        self.write_chunks(name, jsonl_chunks(rows))

    def write_chunks(self, name: str, chunks: Iterable[bytes]) -> None:
        """A file of these bytes, written one chunk at a time (:func:`jsonl_chunks`'s)."""
        with open(self.directory / name, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    def write_text(self, name: str, text: str) -> None:
        _write_file(self.directory / name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        _write_file(self.directory / name, data)

    def write_array(self, name: str, array: np.ndarray) -> None:
        path = self.directory / name
        with open(path, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, manifest: dict[str, Any]) -> Path:
        """Write the manifest last, then make the step visible."""
        manifest = {"format_version": layout.FORMAT_VERSION, "step": self.step, "rank": self.rank,
                    **manifest}
        self.write_json(layout.MANIFEST_FILE, manifest)
        _fsync_dir(self.directory)
        final = (layout.tail_dir if self.tail else layout.step_dir)(self.out, self.rank, self.step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(self.directory, final)
        _fsync_dir(final.parent)
        return final


class RunWriter:
    """Creates the run directory, holds the rank's lock, and hands out one :class:`StepWriter`
    per step; :meth:`close` frees the lock."""

    def __init__(
        self, out: Path, process: dict[str, Any], overwrite: bool, run_info: dict[str, Any]
    ) -> None:
        """``process``: this rank's :func:`probe.tracer.rank.process_info`.

        Raises :class:`ProbeError` when the directory cannot be written (full disk, no
        permission, a file in the way) or another writer holds this rank.
        """
        self.out = out
        self.rank = rank = process["rank"]
        self.rank_path = rank_path = layout.rank_dir(out, rank)
        self._failures_lock = threading.Lock()
        self._failures: list[dict[str, Any]] = []
        self._failures_unwritten: list[dict[str, Any]] = []
        self._failures_reported = 0
        try:
            out.mkdir(parents=True, exist_ok=True)
            if overwrite and (rank_path.is_symlink() or rank_path.is_file()):
                rank_path.unlink()  # a file in the way: no writer can be holding it
            rank_path.mkdir(exist_ok=True)
            self._lock = RankLock.acquire(rank_path)
        except OSError as e:
            raise _unwritable(out, e) from None
        try:
            if overwrite:
                self._remove_old_run(process["world_size"])
            # The first writes are the pre-flight check: a full disk or a read-only
            # directory shows here, before anything is traced.
            write_json_atomic(rank_path / layout.RANK_FILE, process)
            info = {
                "format": layout.FORMAT_NAME,
                "format_version": layout.FORMAT_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "torch_version": torch.__version__,
                "world_size": process["world_size"],
                **run_info,
            }
            write_json_atomic(out / layout.RUN_FILE, info)
        except OSError as e:
            self.close()
            raise _unwritable(out, e) from None
        except BaseException:
            self.close()
            raise

    def _remove_old_run(self, world_size: int) -> None:
        """overwrite=True, with this rank's lock held: a single process replaces the whole run
        (taking each other rank's lock before removing it); a rank of a job only its own
        directory, as the other ranks are writing theirs."""
        for entry in self.rank_path.iterdir():
            if entry.name != layout.LOCK_FILE:
                _remove(entry)
        if world_size != 1:
            return
        for old in layout.list_ranks(self.out):
            if old == self.rank:
                continue
            other = layout.rank_dir(self.out, old)
            lock = RankLock.acquire(other)
            try:
                shutil.rmtree(other)
            finally:
                lock.release()

    def step(self, step: int, tail: bool = False) -> StepWriter:
        return StepWriter(self.out, self.rank, step, tail)

    # -- failures ------------------------------------------------------------------

    def record_failure(
        self, step: int, tail: bool, error: OSError, ops: int, modes: list[str]
    ) -> dict[str, Any]:
        """Give up a step whose files could not be written (any thread): empty its partial
        directory, keep that as the unfinished marker, and note the failure in
        ``write_failures.jsonl``. Never raises ``OSError``."""
        partial = (layout.partial_tail_dir if tail else layout.partial_step_dir)(self.out, self.rank, step)
        try:
            for entry in partial.iterdir():
                _remove(entry)
            left = partial.name
        except OSError:
            left = partial.name if partial.is_dir() else None
        failed = error.filename
        if failed is not None:
            failed = os.path.relpath(failed, self.rank_path) if os.path.isabs(failed) else str(failed)
        failure = {
            "step": step, "tail": tail, "directory": left, "file": failed,
            "errno": error.errno, "error": error.strerror or str(error),
            "ops": ops, "modes": modes, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with self._failures_lock:
            self._failures.append(failure)
            self._failures_unwritten.append(failure)
            self._write_failures()
        return failure

    def _write_failures(self) -> None:
        """Append the failures not yet on disk; on a full disk they wait for the next try."""
        lines = "".join(json.dumps(f, sort_keys=True) + "\n" for f in self._failures_unwritten)
        try:
            with open(self.rank_path / layout.WRITE_FAILURES_FILE, "a") as f:
                f.write(lines)
        except OSError:
            return
        self._failures_unwritten.clear()

    def new_failures(self) -> list[dict[str, Any]]:
        """The failures recorded since the last call (for the session to warn about)."""
        with self._failures_lock:
            new = self._failures[self._failures_reported:]
            self._failures_reported = len(self._failures)
            return new

    def abandon_in_forked_child(self) -> None:
        """In a process forked from the one writing: write nothing, and close this process's copy
        of the lock's descriptor. A ``flock`` belongs to the open file, which fork shares: the
        parent's lock stays held, and is freed when the parent lets it go, not when the child
        ends too. Takes no lock (another thread of the parent may have held one at the fork)."""
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.release()

    def close(self) -> None:
        """Write the failures a full disk held back, if it can now, and free the rank's lock."""
        lock = getattr(self, "_lock", None)
        try:
            with self._failures_lock:
                if self._failures_unwritten:
                    self._write_failures()
        finally:
            if lock is not None:
                lock.release()
