"""Cross-rank consistency: values that every rank of a group must hold identically.

In data-parallel training some tensors are the same on every rank by
construction: the result of an all-reduce, all-gather or broadcast (on the ranks
of its group), and under DDP the parameters after each optimizer update. When
one rank's copy differs (a flipped bit, a rank that skipped an update, a
non-deterministic kernel on one device) the replicas silently drift apart.

This check reads the statistics every rank recorded (mode "stats") and, per
step in execution order, compares them op by op (ops are matched by their op id)
across the ranks that must agree. The value most ranks hold is the reference
(on a tie, the lowest rank's); every rank that differs from it is reported, and
the first disagreement in execution order is the one to look at. An op that one
rank of the group never ran is reported too: its collectives no longer line up.
No collective is issued: the check runs on the run directory, after the fact.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from probe.errors import ProbeError
from probe.rundir.run import OpRecord, Run, load

COMPARED_STATS = ("min", "max", "mean", "norm", "nan", "inf")
# Collectives whose result is the same on every rank of their group.
REPLICATING_COLLECTIVES = frozenset({
    "c10d.allreduce_", "c10d.allreduce_coalesced_", "c10d.broadcast_", "c10d.allgather_",
    "c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_", "c10d.allgather_coalesced_",
    "_c10d_functional.all_reduce", "_c10d_functional.all_reduce_", "_c10d_functional.all_reduce_coalesced",
    "_c10d_functional.all_reduce_coalesced_", "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.all_gather_into_tensor_out", "_c10d_functional.all_gather_into_tensor_coalesced",
    "_c10d_functional.broadcast", "_c10d_functional.broadcast_",
})
REPLICATED = "replicated"


def _packet(name: str) -> str:
    """``c10d.allreduce_.default`` -> ``c10d.allreduce_``."""
    return name.rpartition(".")[0]


@dataclass(frozen=True)
class Disagreement:
    """One rank's copy of a replicated value that differs from the other ranks'."""

    step: int
    rank: int
    op_id: str
    name: str
    module: str
    phase: str
    why: str
    """What makes the value replicated: "all-reduce result", "parameter update (DDP)", ..."""
    output: int | None
    """Output position; None when the rank did not run the op at all."""
    shape: tuple[int, ...] | None
    """The output's shape (helps tell which parameter an optimizer op updated)."""
    stat: str | None
    """The first statistic that differs (``min``, ``max``, ``mean``, ``norm``, ``nan``, ``inf``)."""
    value: float | None
    reference: float | None
    reference_ranks: tuple[int, ...]
    """The ranks that hold the reference value."""

    def describe(self) -> str:
        where = f"step {self.step} rank {self.rank}: {self.op_id} ({self.why}"
        where += f", module {self.module!r})" if self.module else ")"
        agree = ",".join(map(str, self.reference_ranks))
        if self.output is None:
            return f"{where} was not run on this rank; ranks {agree} ran it"
        shape = "x".join(map(str, self.shape or ())) or "scalar"
        return (f"{where} output {self.output} ({shape}) {self.stat} = {self.value!r}; "
                f"ranks {agree} hold {self.reference!r}")


@dataclass
class ConsistencyReport:
    """What :func:`check_consistency` found."""

    ranks: list[int]
    steps: list[int]
    checked: int = 0
    """Outputs compared across ranks (one per replicated op output and step)."""
    findings: list[Disagreement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What could not be checked, in words."""

    @property
    def first(self) -> Disagreement | None:
        """The earliest disagreement: first step, then execution order, then lowest rank."""
        return self.findings[0] if self.findings else None

    @property
    def consistent(self) -> bool:
        return not self.findings

    @property
    def summary(self) -> dict[str, Any]:
        """The findings as plain data (what ``probe consistency -o`` writes)."""
        return {
            "ranks": self.ranks, "steps": self.steps, "checked": self.checked,
            "consistent": self.consistent, "notes": self.notes,
            "first": None if self.first is None else asdict(self.first),
            "findings": [asdict(f) for f in self.findings],
        }


def _why(op: OpRecord, replicated_params: bool) -> str | None:
    """Why ``op``'s outputs must agree across ranks, or None when they need not."""
    packet = _packet(op.name)
    if packet in REPLICATING_COLLECTIVES:
        return packet.rpartition(".")[2].strip("_").replace("_", " ") + " result"
    if replicated_params and op.phase == "optimizer" and any(t.mutated for t in op.outputs):
        return "parameter update (replicated parameters)"
    return None


def _group_ranks(op: OpRecord, ranks: list[int]) -> list[int]:
    group = op.group
    if group and group.get("ranks"):
        return [r for r in group["ranks"] if r in ranks]
    return ranks


def _stat_key(op: OpRecord, output: int) -> tuple[float, ...] | None:
    if output >= len(op.outputs) or op.outputs[output].stats is None:
        return None
    stats = op.outputs[output].stats
    return tuple(math.nan if stats[k] is None else float(stats[k]) for k in COMPARED_STATS)


def _same(a: tuple[float, ...], b: tuple[float, ...], tolerance: float) -> bool:
    for x, y in zip(a, b, strict=True):
        if math.isnan(x) and math.isnan(y):
            continue
        if x == y:
            continue
        if tolerance > 0 and math.isfinite(x) and math.isfinite(y) and abs(x - y) <= tolerance * max(
            abs(x), abs(y)
        ):
            continue
        return False
    return True


def _first_differing_stat(a: tuple[float, ...], b: tuple[float, ...], tolerance: float) -> int:
    return next(i for i in range(len(a)) if not _same(a[i : i + 1], b[i : i + 1], tolerance))


def _reference(values: dict[int, tuple[float, ...]], tolerance: float) -> list[int]:
    """The ranks holding the value most ranks hold (ties: the lowest rank's value)."""
    classes: list[list[int]] = []
    for rank in sorted(values):
        for members in classes:
            if _same(values[members[0]], values[rank], tolerance):
                members.append(rank)
                break
        else:
            classes.append([rank])
    return max(classes, key=lambda members: (len(members), -members[0]))


def _check_step(run: Run, step: int, ranks: list[int], replicated_params: bool, tolerance: float,
                report: ConsistencyReport) -> None:
    ops = {r: run.ops(step, r) for r in ranks}
    by_id = {r: {op.id: op for op in ops[r]} for r in ranks}
    # Execution order of the rank that ran the most ops (every op id seen anywhere, once).
    order: list[OpRecord] = []
    seen: set[str] = set()
    for r in sorted(ranks, key=lambda r: -len(ops[r])):
        for op in ops[r]:
            if op.id not in seen:
                seen.add(op.id)
                order.append(op)
    positions = {op.id: i for i, op in enumerate(max(ops.values(), key=len))}
    found: list[tuple[int, Disagreement]] = []
    for op in order:
        why = _why(op, replicated_params)
        if why is None:
            continue
        group = _group_ranks(op, ranks)
        if len(group) < 2:
            continue
        present = {r: by_id[r].get(op.id) for r in group}
        missing = [r for r, record in present.items() if record is None]
        ran = [r for r in group if present[r] is not None]
        position = positions.get(op.id, len(positions))
        if missing and ran:
            for r in missing:
                found.append((position, Disagreement(step, r, op.id, op.name, op.module, op.phase, why,
                                                     None, None, None, None, None, tuple(ran))))
        for output in range(len(op.outputs)):
            values = {r: key for r in ran if (key := _stat_key(present[r], output)) is not None}
            if len(values) < 2:
                continue
            report.checked += 1
            agree = _reference(values, tolerance)
            reference = values[agree[0]]
            for r, value in values.items():
                if r in agree:
                    continue
                i = _first_differing_stat(value, reference, tolerance)
                found.append((position, Disagreement(
                    step, r, op.id, op.name, op.module, op.phase, why, output, op.outputs[output].shape,
                    COMPARED_STATS[i], value[i], reference[i], tuple(agree))))
    found.sort(key=lambda item: (item[0], item[1].rank))
    report.findings.extend(d for _, d in found)


def check_consistency(run: Run | str, steps: list[int] | None = None, tolerance: float = 0.0,
                      replicated_params: bool | None = None) -> ConsistencyReport:
    """Compare, per step, what the ranks of a run hold for replicated values.

    ``tolerance``: relative difference still taken as equal (default 0: replicas are
    bit-identical, so are their statistics). ``replicated_params``: whether parameters
    are the same on every rank (DDP), so that optimizer updates are compared too;
    by default what the run recorded (a DDP-wrapped model).
    """
    run = load(run) if isinstance(run, str) else run
    if tolerance < 0 or not math.isfinite(tolerance):
        raise ProbeError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    ranks = run.ranks
    common = sorted(s for s, count in Counter(s for r in ranks for s in run.steps_of(r)).items() if count > 1)
    if steps is not None:
        unknown = sorted(set(steps) - set(common))
        if unknown:
            raise ProbeError(f"steps {unknown} were not recorded on two or more ranks of "
                             f"{str(run.path)!r}; steps on several ranks: {common}")
        common = [s for s in common if s in steps]
    report = ConsistencyReport(ranks, common)
    if len(ranks) < 2:
        report.notes.append(f"{str(run.path)!r} holds one rank: nothing to compare across ranks")
        return report
    for step in common:
        on_step = [r for r in ranks if step in run.steps_of(r)]
        if not any(op.outputs and op.outputs[0].stats is not None for op in run.ops(step, on_step[0])):
            report.notes.append(f"step {step}: no statistics recorded (record with mode 'stats')")
            continue
        replicated = replicated_params
        if replicated is None:
            layouts = {run.step_info(step, r).manifest.get("parallel") for r in on_step}
            replicated = layouts == {REPLICATED}
        _check_step(run, step, on_step, replicated, tolerance, report)
    return report
