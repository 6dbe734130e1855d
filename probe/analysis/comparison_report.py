"""The result of :func:`probe.analysis.compare.compare`: the conclusion, counts, rows and the
reports written from them."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from probe.analysis.comparison_records import (
    METRIC_KEYS,
    STATS_KEYS,
    Divergence,
    OpComparison,
    StepComparison,
    count_verdicts,
)
from probe.analysis.random_draws import draws, records_constants
from probe.analysis.report_writers import write_report
from probe.analysis.run_identity import Identity
from probe.analysis.verdicts import NOT_COMPARED, RULE_REDUCTION_ORDER, RULE_ROUTING, WARNING
from probe.rundir.run import OpRecord

_OVERLAY_KEYS = frozenset(("verdict", "message", "op_b", *METRIC_KEYS, *STATS_KEYS))
"""The fields of a row the graph viewer's overlay shows (:meth:`Report.overlay`)."""

def _overlay_cells(step: StepComparison) -> Iterator[tuple[str, dict[str, Any]]]:
    """(run A's op id, the row's fields the graph viewer shows) of each op of ``step`` run A has."""
    for c in step.comparisons:
        if c.a is not None:
            yield c.a.id, {k: v for k, v in c.row().items() if k in _OVERLAY_KEYS}

class _RowsMadeWhenRead(Sequence[dict[str, Any]]):
    """The rows of ``comparisons``, each made when it is read and not kept: a writer that reads
    the rows more than once (the HTML page: its layout, then its lines) holds one at a time,
    where the list of them was ~1.5 KB an op."""

    def __init__(self, comparisons: list[OpComparison]) -> None:
        self._comparisons = comparisons

    def __len__(self) -> int:
        return len(self._comparisons)

    def __getitem__(self, number: int) -> dict[str, Any]:  # type: ignore[override]
        return self._comparisons[number].row()

class Report:
    """The result of :func:`compare`."""

    def __init__(self, path_a: Path, path_b: Path, steps: list[StepComparison], missing: list[str],
                 identity: Identity | None = None, notes: list[str] | None = None) -> None:
        self.path_a, self.path_b = path_a, path_b
        self.notes = notes or []
        """What the runs did not observe, said after the conclusion (``probe.analysis.compiled_regions``:
        compiled code that ran eagerly under the probe)."""
        self.steps = steps
        self.missing = missing
        """What could not be compared (a step or rank present on one side only), in words."""
        self.identity = identity
        """Whether the runs started alike (weights, inputs, RNG) and how their environments differ
        (``probe.analysis.run_identity``); the report's first section."""

    @property
    def comparisons(self) -> list[OpComparison]:
        return [c for s in self.steps for c in s.comparisons]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.comparisons]

    @property
    def divergence(self) -> Divergence | None:
        found = [s.divergence for s in self.steps if s.divergence is not None]
        return min(found, key=lambda d: (d.step, d.rank)) if found else None

    @property
    def first_divergence(self) -> tuple[OpRecord, OpRecord | None] | None:
        d = self.divergence
        return None if d is None else (d.op_a, d.op_b)

    @property
    def counts(self) -> dict[str, int]:
        """Ops per verdict: pass, warning, error, unmatched, not compared."""
        return count_verdicts(self.comparisons)

    @property
    def unreadable(self) -> list[StepComparison]:
        """The steps that could not be read in run A, run B or both (``StepComparison.unreadable``
        says why): not compared, whether or not either run could still list their ops."""
        return [s for s in self.steps if s.unreadable is not None]

    @property
    def ok(self) -> bool:
        """No divergence found, no op left uncompared and no step unreadable: what
        ``--fail-on-divergence`` checks. Missing data is never agreement: a step unreadable in both
        runs (a shared disk fault, a run compared with itself) has no op rows, and still fails."""
        return self.divergence is None and not self.counts[NOT_COMPARED] and not self.unreadable

    @property
    def conclusion(self) -> str:
        """What the comparison concludes, in one sentence.

        "no divergence: differences consistent with bf16 autocast" when every difference
        is explained by the precision each run computed in. When the runs did not start
        alike (other initial weights, inputs or RNG state, found at or before the first
        divergence), that leads as the explanation (``Identity.explain``).
        """
        text = self._ops_conclusion()
        if self.identity is not None:
            d = self.divergence
            step = None if d is None else d.step
            text = self.identity.explain(text, step, self._random_ops(step))
        return "; ".join([text, *self.notes])

    def _random_ops(self, last_step: int | None) -> bool | None:
        """Whether a compared op (up to ``last_step``) drew random numbers: False only when
        every op is known not to (an op this process cannot resolve is not known; one given
        probability 0 draws none, :mod:`probe.analysis.random_draws`)."""
        unknown = False
        recorded = [records_constants([op for c in self.comparisons if (op := getattr(c, side)) is not None])
                    for side in ("a", "b")]
        for c in self.comparisons:
            for op, constants in zip((c.a, c.b), recorded, strict=True):
                if op is None or (last_step is not None and op.step > last_step):
                    continue
                random = draws(op, constants)
                if random:
                    return True
                unknown = unknown or random is None
        return None if unknown else False

    def _ops_conclusion(self) -> str:
        d = self.divergence
        if d is not None:
            where = d.op.module or "<outside modules>"
            if d.op.parameter is not None:  # an optimizer op: which parameter's update
                where += f": the optimizer's update of {d.op.parameter}"
            return f"first divergence at {d.op.id} in {where} (rule: {d.rule})"
        uncompared = self.counts[NOT_COMPARED]
        explained = [c for c in self.comparisons if c.verdict == WARNING]
        if not explained:
            text = "no divergence: every matched op compared clean"
        else:
            policies = sorted({s.policy for s in self.steps if s.policy})
            text = f"no divergence: differences consistent with {' / '.join(policies) or 'rounding'}"
        if uncompared:
            text += f" among the ops compared ({uncompared} not compared)"
        if self.unreadable:
            steps = ", ".join(f"step {s.step} rank {s.rank}" for s in self.unreadable[:5])
            more = f" and {len(self.unreadable) - 5} more" if len(self.unreadable) > 5 else ""
            text += f"; {len(self.unreadable)} step(s) not compared, unreadable: {steps}{more}"
        parted = next((s for s in self.steps if s.apart is not None), None)
        if parted is not None:
            text += f"; not compared from there: {parted.apart}"
        routed = sum(c.rule == RULE_ROUTING for c in self.comparisons)
        if routed:
            text += (f"; routing differs (discrete choices of values within precision): {routed} op(s) "
                     f"judged by no numeric bound (rule: {RULE_ROUTING})")
        reordered = self.reduction_orders
        if reordered:
            text += (f"; {len(reordered)} sum(s) in a different reduction order across the layouts, each "
                     f"consistent with its own (rule: {RULE_REDUCTION_ORDER})")
        return text

    @property
    def reduction_orders(self) -> list[OpComparison]:
        """The ops judged "consistent with a different reduction order" (folded runs whose
        layouts split a sum otherwise: ``_judge_reduction_order``)."""
        return [c for c in self.comparisons if c.rule == RULE_REDUCTION_ORDER]

    def by_rank(self) -> list[dict[str, Any]]:
        """Across ranks: per rank, the steps compared, verdict counts and its first divergence."""
        out = []
        for rank in sorted({s.rank for s in self.steps}):
            steps = [s for s in self.steps if s.rank == rank]
            counts = count_verdicts([c for s in steps for c in s.comparisons])
            found = [s.divergence for s in steps if s.divergence is not None]
            first = min(found, key=lambda d: d.step) if found else None
            out.append({
                "rank": rank, "steps": [s.step for s in steps], "counts": counts,
                "first_divergence": None if first is None else {
                    "step": first.step, "op_a": first.op_a.id if first.op_a else None,
                    "op_b": first.op_b.id if first.op_b else None, "name": first.op.name,
                    "module": first.op.module, "rule": first.rule, "message": first.comparison.message,
                },
            })
        return out

    def overlay(self) -> dict[str, dict[str, Any]]:
        """Per step/rank, op id (run A) -> verdict and metrics, for the graph viewer."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.steps:
            out.setdefault(f"step{s.step}/rank{s.rank}", {}).update(_overlay_cells(s))
        return out

    def write_overlay(self, path: str | Path) -> None:
        """:meth:`overlay` as JSON, written a row at a time (not held whole: a row an op)."""
        with open(path, "w") as out:
            out.write("{")
            for number, s in enumerate(self.steps):
                out.write(("," if number else "") + json.dumps(f"step{s.step}/rank{s.rank}") + ":{")
                for written, (op_id, cell) in enumerate(_overlay_cells(s)):
                    out.write(("," if written else "") + json.dumps(op_id) + ":"
                              + json.dumps(cell, default=str))
                out.write("}")
            out.write("}")

    @property
    def summary(self) -> dict[str, Any]:
        """What the report found, without the rows: counts, per rank, the first divergence."""
        d = self.divergence
        return {
            "run_a": str(self.path_a), "run_b": str(self.path_b),
            "steps": sorted({s.step for s in self.steps}), "ranks": sorted({s.rank for s in self.steps}),
            "counts": self.counts, "ok": self.ok, "missing": self.missing, "per_rank": self.by_rank(),
            "unreadable": [{"step": s.step, "rank": s.rank, "reason": s.unreadable} for s in self.unreadable],
            "apart": [{"step": s.step, "rank": s.rank, "reason": s.apart} for s in self.steps
                      if s.apart is not None],
            "conclusion": self.conclusion,
            "identity": None if self.identity is None else self.identity.to_dict(),
            "first_divergence": None if d is None else {
                "step": d.step, "rank": d.rank, "op_a": d.op_a.id if d.op_a else None,
                "op_b": d.op_b.id if d.op_b else None, "name": d.op.name, "module": d.op.module,
                "phase": d.op.phase, "stack": d.op.stack, "rule": d.rule, "message": d.comparison.message,
                "inputs_assumed": d.inputs_assumed, "chain": d.chain,
                "metrics": d.comparison.row(),
            },
        }

    def to_csv(self, path: str | Path) -> None:
        """The rows as CSV, msprobe-like columns (cells escaped against spreadsheet formulas)."""
        write_report("compare_csv", self.summary, (c.row() for c in self.comparisons), Path(path))

    def to_json(self, path: str | Path) -> None:
        """The summary and the rows as JSON, a row a line: written as the rows are made, so that
        neither the rows nor the text are held whole (they were twice what the compare held)."""
        summary = json.dumps(self.summary, indent=1, default=_json_default)
        with open(path, "w") as out:
            out.write(summary[:-2] + ',\n "rows": [')  # the summary's text without its "\n}"
            for number, c in enumerate(self.comparisons):
                out.write(("," if number else "") + "\n  " + json.dumps(c.row(), default=_json_default))
            out.write("\n ]\n}\n")

    def to_html(self, path: str | Path) -> None:
        """A self-contained HTML page: the summary, the first divergence and a sortable table.
        Its rows are made as the page reads them (:class:`_RowsMadeWhenRead`), never all at once."""
        write_report("compare_html", self.summary, _RowsMadeWhenRead(self.comparisons), Path(path))

def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    raise TypeError(f"not JSON serialisable: {value!r}")
