"""``toy.json`` of one step read back, and over a run (``run.mode("toy")``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from probe.rundir.mode_files import ModeFiles, ModeReader
from probe.rundir.untrusted_reads import expect, read_json, reading

TOY_FILE = "toy.json"


@dataclass(frozen=True)
class StepCounts:
    """The ops the toy counted in one step of one rank, by phase."""

    step: int
    rank: int
    by_phase: dict[str, int]


class ToyReader(ModeReader):
    """The toy's counts over a run: ``run.mode("toy")``."""

    def counts(self, step: int | None = None, rank: int | None = None) -> list[StepCounts]:
        """Each step's counts (one step with ``step``/``rank``; every step of every rank without)."""
        return self.gather(lambda files: [cast(ToyFiles, files).counts()], step, rank)


class ToyFiles(ModeFiles):
    """``toy.json`` of one step."""

    file_names = (TOY_FILE,)
    run_reader = ToyReader

    def counts(self) -> StepCounts:
        path = self.where.directory / TOY_FILE
        data = read_json(path, run=self.where.run)
        with reading(path):
            by_phase = {expect(k, str, "a phase"): expect(v, int, f"the count of {k}")
                        for k, v in expect(data.get("by_phase"), dict, "by_phase").items()}
        return StepCounts(self.where.step, self.where.rank, by_phase)

    def read_whole(self) -> None:
        self.counts()
