"""A step's ``ops.jsonl`` held as an index of where each record's line is, not as its text.

Op #i is the i-th non-blank line. One streaming pass finds the lines (each within the op
record limit) and keeps their start and end offsets, 16 bytes an op; records are then read from
the file when they are decoded, a run of consecutive lines in one read. So a step of 10^6 ops
costs 16 MB to hold open instead of the ~250 MB of its lines, and decoding it a batch at a time
(``Run.iter_ops``) holds one batch.

The file is opened through :mod:`probe.rundir.confined_files` each time it is read, and must
have the size it had when it was indexed: a file changed under the reader is refused by name.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from probe.errors import ProbeError
from probe.rundir.confined_files import open_in_run
from probe.rundir.untrusted_reads import reading

READ_CHUNK = 8 << 20
"""The most bytes read at once when consecutive lines are read together."""
_ID_KEY = '"id":'
_STRING = json.JSONDecoder()


class OpLines:
    """The non-blank lines of one ``ops.jsonl``, by number, read from the file when asked."""

    def __init__(self, path: Path, run: Path, line_limit: int) -> None:
        self.path, self._run = path, run
        self._starts, self._ends = array("q"), array("q")
        offset = 0
        with open_in_run(path, run) as f, reading(path):
            self._size = f.size
            for line in f.lines(line_limit):
                if line.strip():
                    self._starts.append(offset)
                    self._ends.append(offset + len(line))
                offset += len(line)
        self._id_order: np.ndarray | None = None
        """The line numbers sorted by the hash of their op id, and the hashes in that order."""
        self._id_hashes: np.ndarray | None = None
        self._unknown_ids: list[int] = []

    def __len__(self) -> int:
        return len(self._starts)

    def texts(self, numbers: Iterable[int]) -> Iterator[tuple[int, str]]:
        """``(number, line)`` for each of ``numbers`` (valid line numbers, ascending), the line
        decoded from UTF-8. Consecutive lines are read together."""
        wanted = list(numbers)
        if not wanted:
            return
        starts, ends = self._starts, self._ends
        with open_in_run(self.path, self._run) as f, reading(self.path):
            if f.size != self._size:
                raise ProbeError(f"cannot read {str(self.path)!r}: it changed while it was read "
                                 f"({self._size} bytes, now {f.size})")
            i = 0
            while i < len(wanted):
                # The run of consecutive numbers from wanted[i], up to READ_CHUNK bytes.
                j = i + 1
                while (j < len(wanted) and wanted[j] == wanted[j - 1] + 1
                       and ends[wanted[j]] - starts[wanted[i]] <= READ_CHUNK):
                    j += 1
                first = starts[wanted[i]]
                f.file.seek(first)
                block = f.file.read(ends[wanted[j - 1]] - first)
                for number in wanted[i:j]:
                    yield number, block[starts[number] - first:ends[number] - first].decode("utf-8")
                i = j

    def numbers_holding(self, needle: str) -> list[int]:
        """The numbers of the lines that hold ``needle`` (read through once, nothing kept)."""
        found = []
        batch = 1 << 16
        for start in range(0, len(self), batch):
            numbers = range(start, min(len(self), start + batch))
            found += [number for number, text in self.texts(numbers) if needle in text]
        return found

    def numbers_of_id(self, op_id: str) -> list[int]:
        """The numbers of the lines whose op id may be ``op_id`` (ascending; the caller decodes
        them and checks): a lookup in an index of the ids' hashes, 16 bytes an op, made by one
        pass over the file the first time. A line whose id cannot be found without decoding it
        whole is always a candidate."""
        if self._id_order is None or self._id_hashes is None:
            self._index_ids()
        assert self._id_order is not None and self._id_hashes is not None
        hashes, key = self._id_hashes, hash(op_id)
        found = self._id_order[np.searchsorted(hashes, key, "left"):np.searchsorted(hashes, key, "right")]
        return sorted({*found.tolist(), *self._unknown_ids})

    def _index_ids(self) -> None:
        # Python's string hash: ids are looked up in the process that indexed them. A line whose
        # "id" is not a plain string at the first '"id":' (a damaged record) is a candidate for
        # every id: the decode that follows names what is wrong with it.
        hashes = np.empty(len(self), dtype=np.int64)
        unknown: list[int] = []
        batch = 1 << 16
        for start in range(0, len(self), batch):
            for number, text in self.texts(range(start, min(len(self), start + batch))):
                at = text.find(_ID_KEY)
                try:
                    op_id, _ = _STRING.raw_decode(text, at + len(_ID_KEY)) if at >= 0 else (None, 0)
                except ValueError:
                    op_id = None
                if isinstance(op_id, str):
                    hashes[number] = hash(op_id)
                else:
                    hashes[number] = 0
                    unknown.append(number)
        order = np.argsort(hashes, kind="stable")
        self._id_order, self._id_hashes = order, hashes[order]
        self._unknown_ids = unknown
