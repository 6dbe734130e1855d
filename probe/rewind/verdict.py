"""A rewind's verdict: what re-running a step found, as written to the run directory and read back.

The file is ``rank<r>/step<k>/rewind.json`` (``rank<r>/rewind<k>/verdict.json`` when the step wrote no
directory of its own, a step the session recorded nothing of); the reruns' own runs are in
``rank<r>/rewind<k>/<rerun>``. docs/format.md describes the fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from probe.rundir import layout

VERDICT_FILE = "rewind.json"
KINDS = ("transient", "precision", "data", "code", "reproducible", "not classified")
"""transient: the rerun differs bitwise from the original (a hardware fault or non-determinism);
precision: the anomaly recurs, and vanishes in float64; data: it recurs in float64 and vanishes with
the batch before; code: it recurs with that batch too; reproducible: the rerun equals the original
bit for bit and the original had no non-finite value, nothing to classify; not classified: a rerun
could not be made (it raised, or no batch before it was kept)."""


def rewind_dir(out: Path, rank: int, step: int) -> Path:
    """Where the reruns of step ``step`` write their runs (a name ``list_steps`` does not count)."""
    return layout.rank_dir(out, rank) / f"rewind{step}"


@dataclass
class Rerun:
    """One rerun of the step: how it ran and what it ended with."""

    kind: str
    """"same" (the original's precision and batch), "same again" and "deterministic" (twice) for a
    transient's cause, "float64", "previous_batch", or "sample <i>"."""
    loss: float | None
    nonfinite: str | None
    """Why the rerun counts as anomalous (a non-finite loss or parameter), or None."""
    bitwise_equal: bool | None = None
    """Whether it ended with the loss, parameters and optimizer state of the run it is compared with,
    bit for bit: "same" with the original, "same again" with "same", the second "deterministic"
    with the first (None for the others)."""
    run: str | None = None
    """Its traced run, relative to the run directory (None when untraced)."""
    error: str | None = None


@dataclass
class Verdict:
    step: int
    rank: int
    trigger: str
    verdict: str
    why: str
    located: dict[str, Any] | None = None
    """The op that located it: ``{"op", "name", "module", "how"}``; None when nothing was located."""
    samples: list[int] = field(default_factory=list)
    """Data verdicts: the batch positions of the samples responsible."""
    sample_losses: list[float | None] = field(default_factory=list)
    reruns: list[Rerun] = field(default_factory=list)
    seconds: float = 0.0
    cause: str | None = None
    """Transient verdicts: "hardware" (a one-off), "non-determinism (kernel)" or "non-determinism
    (program)" (``probe.rewind.determinism``); None where not told."""
    evidence: str | None = None
    """Transient verdicts: what the reruns showed that tells the cause."""
    ranks: list[int] = field(default_factory=list)
    """Where the cause was found: a transient's ranks whose rerun differed from their original, a
    data verdict's ranks holding the samples, every rank otherwise (one rank: ``[rank]``)."""
    world: int = 1
    """The job's ranks, which rewound together."""

    def line(self) -> str:
        """One line a person reads first."""
        where = ""
        if self.located is not None:
            located = self.located
            where = f": {located['name']} in {located['module'] or '<top>'} (op {located['op']})"
        if self.samples:
            where = f": sample(s) {', '.join(map(str, self.samples))} of the batch"
        head = f"step {self.step} rank {self.rank}: rewound ({self.trigger})"
        kind = f"{self.verdict} ({self.cause})" if self.cause else self.verdict
        if self.world > 1 and self.ranks:
            kind += f" on rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}"
        return f"{head}: {kind}{where}; {self.why}"

    def write(self, out: Path) -> Path:
        step_directory = layout.step_dir(out, self.rank, self.step)
        target = (step_directory / VERDICT_FILE if step_directory.is_dir()
                  else rewind_dir(out, self.rank, self.step) / "verdict.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self), indent=1, allow_nan=True))
        partial.replace(target)  # never half-written
        return target

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        reruns = [Rerun(**r) for r in data.get("reruns", [])]
        return cls(**{**data, "reruns": reruns})


def read_verdicts(out: Path) -> list[Verdict]:
    """Every rewind verdict of a run directory, by rank then step; unreadable files are skipped."""
    found = []
    for rank in layout.list_ranks(out):
        directory = layout.rank_dir(out, rank)
        paths = [*directory.glob(f"step*/{VERDICT_FILE}"), *directory.glob("rewind*/verdict.json")]
        for path in paths:
            try:
                found.append(Verdict.from_json(json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
    return sorted(found, key=lambda v: (v.rank, v.step))
