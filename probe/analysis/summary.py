"""What ``probe summary`` reports for each (step, rank) of a run, one step at a time.

:func:`summarize` yields step by step and decodes only the ops a step summary names, so
summarizing a run of any length holds a few steps in memory (the run's cache).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from probe.rundir import layout
from probe.rundir.reader import AnomalyRecord, CheckRecord, OpRecord, Run


@dataclass
class Extreme:
    op: OpRecord
    value: float


@dataclass
class StepSummary:
    step: int
    rank: int
    complete: bool
    reason: str | None
    phase_counts: dict[str, int]
    has_stats: bool
    first_nonfinite: OpRecord | None
    largest_abs_max: list[Extreme]
    largest_norm: list[Extreme]
    check_counts: dict[str, int]
    """Free-benchmark verdicts (empty without that mode)."""
    failed_checks: list[CheckRecord]
    """The failed checks, worst (largest deviation over its bound) first."""
    monitored: int = 0
    """Series the monitor collected (0 without that mode)."""
    anomalies: list[AnomalyRecord] = field(default_factory=list)


def _largest(op_of_row: np.ndarray, values: np.ndarray, top: int) -> list[tuple[int, float]]:
    """(op index, value) of the ``top`` ops with the largest output value, NaN ignored."""
    known = ~np.isnan(values)
    ops, values = op_of_row[known], values[known]
    found: dict[int, float] = {}
    for row in np.argsort(-values, kind="stable"):
        op = int(ops[row])
        if op not in found:
            found[op] = float(values[row])
            if len(found) == top:
                break
    return list(found.items())


def _phase_counts(run: Run, step: int, rank: int, manifest: dict) -> dict[str, int]:
    phases = manifest.get("phases")
    if isinstance(phases, dict) and all(type(n) is int for n in phases.values()):
        return {phase: n for phase, n in phases.items() if n}
    return dict(Counter(op.phase for op in run.ops(step, rank)))


def summarize_step(run: Run, step: int, rank: int, top: int = 5) -> StepSummary:
    """One step's summary, from its manifest and statistics table; only the ops it names are decoded."""
    info = run.step_info(step, rank)
    checks = run.checks(step, rank)
    failed = [c for c in checks if c.verdict == "fail"]
    failed.sort(key=lambda c: -(c.ratio or 0.0) / (c.threshold or 1.0))
    stats = run.output_stats(step, rank)
    first, by_abs_max, by_norm = None, [], []
    if stats is not None:
        op_of_row, rows = stats
        lo, hi = np.abs(rows[:, 0]), np.abs(rows[:, 1])
        # max(|min|, |max|) as TensorRecord.abs_max computes it (NaN when |min| is NaN)
        abs_max = np.where(hi > lo, hi, lo)
        nonfinite = op_of_row[rows[:, 4] + rows[:, 5] > 0]
        first = int(nonfinite.min()) if nonfinite.size else None
        by_abs_max, by_norm = _largest(op_of_row, abs_max, top), _largest(op_of_row, rows[:, 3], top)
    named = sorted({i for i, _ in by_abs_max + by_norm} | ({first} if first is not None else set()))
    records = dict(zip(named, run.ops_at(named, step, rank), strict=True))
    return StepSummary(
        step=step,
        rank=rank,
        complete=info.complete,
        reason=info.reason,
        phase_counts=_phase_counts(run, step, rank, info.manifest),
        has_stats=stats is not None and len(stats[0]) > 0,
        first_nonfinite=None if first is None else records[first],
        largest_abs_max=[Extreme(records[i], value) for i, value in by_abs_max],
        largest_norm=[Extreme(records[i], value) for i, value in by_norm],
        check_counts=dict(Counter(c.verdict for c in checks)),
        failed_checks=failed[:top],
        monitored=len(run.monitor(step, rank)),
        anomalies=run.anomalies_of(step, rank),
    )


def summarize(run: Run, top: int = 5) -> Iterator[StepSummary]:
    """The summary of every (step, rank), rank by rank, each step as it is read."""
    for rank in run.ranks:
        for step in run.steps_of(rank):
            yield summarize_step(run, step, rank, top)



def lost_steps(run: Run) -> list[str]:
    """One line per step the run lost: each one the writer gave up (``write_failures.jsonl``:
    the file and the error), then each whose flush never finished for another reason (the
    process died while writing it)."""
    failures = run.write_failures()
    given_up = {(f.step, f.rank) for f in failures if not f.tail}
    return [failure.describe() for failure in failures] + [
        f"step {step} rank {rank}: flush never finished (the process died)"
        for step, rank in run.unfinished_steps if (step, rank) not in given_up
    ]


def tails(run: Run) -> list[str]:
    """One line per rank with a tail (ops recorded after the last ``session.step()``)."""
    lines = []
    for rank in run.ranks:
        tail = run.tail(rank)
        if tail:
            directory = layout.tail_dir(run.path, rank, tail[0].step).relative_to(run.path)
            lines.append(f"rank {rank}: a tail of {len(tail)} ops recorded after the last session.step() "
                         f"({directory}; run.tail({rank}))")
    return lines
