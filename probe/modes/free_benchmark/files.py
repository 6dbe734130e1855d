"""The free benchmark's files of one step, read back: ``checks.jsonl`` (the reader half of the mode;
``mode.py`` is the writer), and over a whole run (``run.mode("free_benchmark")``)."""

from __future__ import annotations

from typing import cast

from probe.modes.free_benchmark.records import CheckRecord
from probe.rundir.mode_files import ModeFiles, ModeReader
from probe.rundir.untrusted_reads import read_jsonl, reading, record_from_row

CHECKS_FILE = "checks.jsonl"
"""One check per line, in execution order (:class:`CheckRecord`'s fields; ``op`` is ``op_index``)."""


class ChecksReader(ModeReader):
    """The free benchmark's checks over a run: ``run.mode("free_benchmark")``."""

    def checks(self, step: int | None = None, rank: int | None = None) -> list[CheckRecord]:
        """The checks of one step in execution order (default: the first step of ``rank``, or of
        rank 0); of every step and rank, rank then step, when neither is given."""
        return self.gather(lambda files: cast(ChecksFiles, files).checks(), step, rank)


class ChecksFiles(ModeFiles):
    """``checks.jsonl`` of one step (written by :class:`ChecksStep`), read back."""

    file_names = (CHECKS_FILE,)
    run_reader = ChecksReader

    def checks(self) -> list[CheckRecord]:
        """The step's checks in execution order; keys a reader does not know are ignored."""
        path = self.where.directory / CHECKS_FILE
        rows = read_jsonl(path, run=self.where.run)
        with reading(path):
            return [record_from_row(CheckRecord, row, {"op": "op_index"}, step=self.where.step,
                                    rank=self.where.rank) for row in rows]

    def read_whole(self) -> None:
        self.checks()
