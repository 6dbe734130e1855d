"""The free benchmark's files of one step, read back: ``checks.jsonl`` (the reader half of the mode;
``mode.py`` is the writer)."""

from __future__ import annotations

from probe.rundir import layout
from probe.rundir.mode_files import ModeFiles
from probe.rundir.records import CheckRecord
from probe.rundir.untrusted_reads import read_jsonl, reading, record_from_row


class ChecksFiles(ModeFiles):
    """``checks.jsonl`` of one step (written by :class:`ChecksStep`), read back."""

    def checks(self) -> list[CheckRecord]:
        """The step's checks in execution order; keys a reader does not know are ignored."""
        path = self.where.directory / layout.CHECKS_FILE
        rows = read_jsonl(path, run=self.where.run)
        with reading(path):
            return [record_from_row(CheckRecord, row, {"op": "op_index"}, step=self.where.step,
                                    rank=self.where.rank) for row in rows]
