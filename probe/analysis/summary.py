"""What ``probe summary`` reports for each (step, rank) of a run."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from probe.analysis.nonfinite import first_nonfinite_in
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


def _largest(ops: list[OpRecord], key: str, top: int) -> list[Extreme]:
    found = []
    for op in ops:
        values = [t.abs_max if key == "abs_max" else t.stats["norm"] for t in op.outputs if t.stats]
        values = [v for v in values if v is not None and not math.isnan(v)]
        if values:
            found.append(Extreme(op, max(values)))
    found.sort(key=lambda e: e.value, reverse=True)
    return found[:top]


def summarize_step(run: Run, step: int, rank: int, top: int = 5) -> StepSummary:
    ops = run.ops(step, rank)
    info = run.step_info(step, rank)
    checks = run.checks(step, rank)
    failed = [c for c in checks if c.verdict == "fail"]
    failed.sort(key=lambda c: -(c.ratio or 0.0) / (c.threshold or 1.0))
    return StepSummary(
        step=step,
        rank=rank,
        complete=info.complete,
        reason=info.reason,
        phase_counts=dict(Counter(op.phase for op in ops)),
        has_stats=any(t.stats is not None for op in ops for t in op.outputs),
        first_nonfinite=first_nonfinite_in(ops),
        largest_abs_max=_largest(ops, "abs_max", top),
        largest_norm=_largest(ops, "norm", top),
        check_counts=dict(Counter(c.verdict for c in checks)),
        failed_checks=failed[:top],
        monitored=len(run.monitor(step, rank)),
        anomalies=run.anomalies_of(step, rank),
    )


def summarize(run: Run, top: int = 5) -> list[StepSummary]:
    return [
        summarize_step(run, step, rank, top)
        for rank in run.ranks
        for step in run.steps_of(rank)
    ]
