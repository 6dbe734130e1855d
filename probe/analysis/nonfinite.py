"""The first op whose output holds a NaN or Inf.

"First" is execution order within a step (forward ops run before the backward
ops of the same step), the earliest step first; across ranks, the lowest rank
at that step. Ops without statistics are not considered.
"""

from __future__ import annotations

from probe.rundir.reader import OpRecord, Run


def first_nonfinite_in(ops: list[OpRecord]) -> OpRecord | None:
    for op in ops:
        if any(t.finite is False for t in op.outputs):
            return op
    return None


def first_nonfinite(run: Run, step: int | None = None, rank: int | None = None) -> OpRecord | None:
    steps = run.steps if step is None else [step]
    ranks = run.ranks if rank is None else [rank]
    for s in steps:
        for r in ranks:
            if s not in run.steps_of(r):
                continue
            found = first_nonfinite_in(run.ops(s, r))
            if found is not None:
                return found
    return None
