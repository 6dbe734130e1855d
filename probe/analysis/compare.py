"""Run against run: matched ops, metrics, verdicts, and the first divergence.

``compare(a, b)`` treats run A as the reference. Per (step, rank) found in both,
ops are matched (``matching``), each matched pair's outputs are compared on
dumped data when both runs hold it, else on statistics, else on shape and
dtype alone (``metrics``, ``verdicts``). When both runs dumped the step but a
tensor's data is missing or unreadable on either side, the output is "not
compared" (with the reason, and the statistics' metrics beside it when known):
missing data is never taken for agreement. The **first divergence** is the earliest
op of A, in execution order, whose outputs are an error while the inputs the
step computed agree (their producers compared clean; a producer that could not
be compared counts as unknown, and the divergence says its inputs were assumed). Inputs from outside the
step (weights, data) are the op's own state: when one differs, this op is where
the difference enters, and the report says so. From it, the **chain** follows
A's graph through the consumers that diverge too.

Ranks are compared in parallel processes; tensors are read one op at a time
through memory maps, so memory is bounded by the largest op, not the run.
"""

from __future__ import annotations

import json
import math
import multiprocessing
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from probe.analysis.matching import Match, match_ops
from probe.analysis.metrics import stats_metrics, tensor_metrics
from probe.analysis.verdicts import (
    ERROR,
    NOT_COMPARED,
    PASS,
    UNMATCHED,
    VERDICTS,
    WARNING,
    lower_precision_of,
    stats_verdict,
    tensor_verdict,
    worst,
)
from probe.errors import ProbeError
from probe.exporters.compare_report import write_csv, write_html
from probe.modes.dump import DumpIndex
from probe.rundir.reader import OpRecord, Run, TensorRecord

METRIC_KEYS = ("cosine", "max_abs_err", "max_rel_err", "one_thousandth_ratio",
               "five_thousandth_ratio", "rmse", "max_ulp", "ref_rms")
STATS_KEYS = ("max_rel", "min_rel", "mean_rel", "norm_rel", "nan_diff", "inf_diff")
_WORSE_IS_LOWER = {"cosine", "one_thousandth_ratio", "five_thousandth_ratio"}


@dataclass
class TensorComparison:
    io: str
    position: int
    verdict: str
    message: str = ""
    kind: str = "shape"
    """What was compared: "data", "stats", only "shape" (and dtype), or "none" (not compared)."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class OpComparison:
    step: int
    rank: int
    a: OpRecord | None
    b: OpRecord | None
    match: str
    verdict: str
    message: str = ""
    outputs: list[TensorComparison] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        op = self.a or self.b
        assert op is not None
        ref = self.a.outputs[0] if self.a and self.a.outputs else None
        test = self.b.outputs[0] if self.b and self.b.outputs else None
        row: dict[str, Any] = {
            "step": self.step, "rank": self.rank,
            "op_a": self.a.id if self.a else None, "op_b": self.b.id if self.b else None,
            "name": op.name, "module": op.module, "phase": op.phase, "match": self.match,
            "dtype_a": ref.dtype if ref else None, "dtype_b": test.dtype if test else None,
            "shape_a": list(ref.shape) if ref else None, "shape_b": list(test.shape) if test else None,
            "compared": ",".join(sorted({t.kind for t in self.outputs})) or None,
            "verdict": self.verdict, "message": self.message,
        }
        for key in (*METRIC_KEYS, *STATS_KEYS):
            values = [t.metrics[key] for t in self.outputs if key in t.metrics]
            if values:
                row[key] = min(values) if key in _WORSE_IS_LOWER else max(values, key=abs)
        return row


_NOT_IN_DUMP = "not in the dump"
_NOT_DUMPABLE = "not dumpable"


class _Side:
    """One run's step: its ops, and its dump when it has one."""

    def __init__(self, run: Run, step: int, rank: int) -> None:
        self.ops = run.ops(step, rank)
        self.dump: DumpIndex | None = run.dump(step, rank) if run.has_dump(step, rank) else None

    def data(self, op: OpRecord, io: str, position: int) -> tuple[torch.Tensor | None, str | None]:
        """The dumped tensor, or None and why its data is not there (None: never dumped by design)."""
        if self.dump is None:
            return None, None
        entry = self.dump.entries.get((op.index, io, position))
        if entry is None:
            return None, _NOT_IN_DUMP
        if entry.status is not None and entry.status.startswith(_NOT_DUMPABLE):  # by design: no bytes
            return None, None
        if entry.status is not None:
            return None, entry.status
        try:
            return self.dump.tensor(op.index, io, position), None
        except ProbeError as e:
            return None, f"unreadable: {e}"


def _is_float(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point or getattr(torch, dtype).is_complex


def compare_tensors(
    side_a: _Side, side_b: _Side, op_a: OpRecord, op_b: OpRecord, io: str, position: int,
) -> TensorComparison:
    records = op_a.inputs if io == "input" else op_a.outputs
    others = op_b.inputs if io == "input" else op_b.outputs
    ta: TensorRecord = records[position]
    tb: TensorRecord = others[position]
    if ta.shape != tb.shape:
        return TensorComparison(io, position, ERROR, f"shape {list(ta.shape)} vs {list(tb.shape)}")
    if _is_float(ta.dtype) != _is_float(tb.dtype):
        return TensorComparison(io, position, ERROR, f"dtype {ta.dtype} vs {tb.dtype}")
    dtype = lower_precision_of(ta.dtype, tb.dtype)
    data_a, why_a = side_a.data(op_a, io, position)
    data_b, why_b = side_b.data(op_b, io, position)
    if data_a is not None and data_b is not None:
        m = tensor_metrics(data_a, data_b)
        verdict, message = tensor_verdict(m, dtype)
        return TensorComparison(io, position, verdict, message, "data", m.as_dict())
    stats = None
    if ta.stats is not None and tb.stats is not None:
        m = stats_metrics(ta.stats, tb.stats)
        stats = (*stats_verdict(m, dtype, ta.stats["norm"] or 0.0, ta.numel), m.as_dict())
    # Both runs dumped this step, and the data of this tensor is missing on a side that
    # should hold it: whatever the statistics say, the data was not compared.
    if side_a.dump is not None and side_b.dump is not None and (why_a or why_b) \
            and not why_a == why_b == _NOT_IN_DUMP:
        reasons = "; ".join(f"run {name}: {why}" for name, why in (("A", why_a), ("B", why_b)) if why)
        message = f"no data to compare ({reasons})"
        if stats is not None:
            message += f"; statistics alone say {stats[0]}" + (f" ({stats[1]})" if stats[1] else "")
        return TensorComparison(io, position, NOT_COMPARED, message, "none", stats[2] if stats else {})
    if stats is not None:
        return TensorComparison(io, position, stats[0], stats[1], "stats", stats[2])
    note = "; ".join(f"run {name}: {why}" for name, why in (("A", why_a), ("B", why_b)) if why)
    if ta.dtype != tb.dtype:
        return TensorComparison(io, position, PASS, note or f"dtype {ta.dtype} vs {tb.dtype}")
    return TensorComparison(io, position, PASS, note)


def _compare_pair(side_a: _Side, side_b: _Side, match: Match, step: int, rank: int) -> OpComparison:
    if match.a is None or match.b is None:
        which = "only in run A" if match.b is None else "only in run B"
        return OpComparison(step, rank, match.a, match.b, match.how, UNMATCHED, which)
    outputs = [
        compare_tensors(side_a, side_b, match.a, match.b, "output", i)
        for i in range(min(len(match.a.outputs), len(match.b.outputs)))
    ]
    verdict = worst([t.verdict for t in outputs])
    messages = [f"output {t.position}: {t.message}" for t in outputs if t.message and t.verdict != PASS]
    if len(match.a.outputs) != len(match.b.outputs):
        verdict = ERROR
        messages.append(f"{len(match.a.outputs)} outputs vs {len(match.b.outputs)}")
    return OpComparison(step, rank, match.a, match.b, match.how, verdict, "; ".join(messages), outputs)


@dataclass
class Divergence:
    step: int
    rank: int
    op_a: OpRecord
    op_b: OpRecord | None
    comparison: OpComparison
    inputs_assumed: bool
    """True when the producer of some input could not be matched or compared and was assumed to agree."""
    chain: list[str]
    """Op ids (run A) the divergence propagates through, in execution order."""


@dataclass
class StepComparison:
    step: int
    rank: int
    comparisons: list[OpComparison]
    divergence: Divergence | None


def _inputs_agree(op: OpComparison, by_index: dict[int, OpComparison]) -> tuple[bool, bool]:
    """(agree, assumed): whether every input computed in the step came from an op that compared clean.

    Inputs from outside the step (weights, data) are the op's own state: when they
    differ, this op is where the difference enters, so they do not count against it.
    ``assumed`` is True when a producer could not be matched.
    """
    assert op.a is not None
    assumed = False
    for tensor in op.a.inputs:
        if tensor.source is None:
            continue
        producer = by_index.get(tensor.source[0])
        if producer is None or producer.match == "unmatched":
            assumed = True
            continue
        outs = [t for t in producer.outputs if t.position == tensor.source[1]]
        if outs and outs[0].verdict == ERROR:
            return False, assumed
        if not outs or outs[0].verdict == NOT_COMPARED:  # unknown, not agreement
            assumed = True
    return True, assumed


def _external_inputs_that_differ(side_a: _Side, side_b: _Side, op: OpComparison) -> list[str]:
    assert op.a is not None and op.b is not None
    differ = []
    for position, tensor in enumerate(op.a.inputs):
        if tensor.source is None and position < len(op.b.inputs):
            result = compare_tensors(side_a, side_b, op.a, op.b, "input", position)
            if result.verdict == ERROR:
                differ.append(f"input {position} (from outside the step) differs: {result.message}")
    return differ


def _chain(run: Run, step: int, rank: int, start: OpRecord, by_index: dict[int, OpComparison],
           limit: int = 100) -> list[str]:
    graph = run.graph(step, rank)
    index_of = {node: data["index"] for node, data in graph.nodes(data=True)}
    seen, queue, chain = {start.id}, deque([start.id]), []
    while queue and len(chain) < limit:
        node = queue.popleft()
        chain.append(node)
        for successor in graph.successors(node):
            comparison = by_index.get(index_of[successor])
            if successor not in seen and comparison is not None and comparison.verdict in (ERROR, WARNING):
                seen.add(successor)
                queue.append(successor)
    return sorted(chain, key=index_of.__getitem__)


def compare_step(run_a: Run, run_b: Run, step: int, rank: int,
                 module_map: dict[str, str] | None = None,
                 on_op: Callable[[], None] | None = None) -> StepComparison:
    side_a, side_b = _Side(run_a, step, rank), _Side(run_b, step, rank)
    matches = match_ops(side_a.ops, side_b.ops, module_map)
    comparisons = []
    for m in matches:
        comparisons.append(_compare_pair(side_a, side_b, m, step, rank))
        if on_op is not None and m.a is not None:
            on_op()
    by_index = {c.a.index: c for c in comparisons if c.a is not None}
    divergence = None
    for c in comparisons:
        if c.a is None or c.b is None or c.verdict != ERROR:
            continue
        agree, assumed = _inputs_agree(c, by_index)
        if agree:
            notes = _external_inputs_that_differ(side_a, side_b, c)
            if notes:
                c.message = "; ".join([c.message, *notes]) if c.message else "; ".join(notes)
            chain = _chain(run_a, step, rank, c.a, by_index)
            divergence = Divergence(step, rank, c.a, c.b, c, assumed, chain)
            break
    return StepComparison(step, rank, comparisons, divergence)


def _compare_rank(path_a: str, path_b: str, steps: list[int], rank: int,
                  module_map: dict[str, str] | None) -> list[StepComparison]:
    run_a, run_b = Run(path_a), Run(path_b)
    return [compare_step(run_a, run_b, step, rank, module_map) for step in steps]


class Report:
    """The result of :func:`compare`."""

    def __init__(self, path_a: Path, path_b: Path, steps: list[StepComparison], missing: list[str]) -> None:
        self.path_a, self.path_b = path_a, path_b
        self.steps = steps
        self.missing = missing
        """What could not be compared (a step or rank present on one side only), in words."""

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
        return _count(self.comparisons)

    @property
    def ok(self) -> bool:
        """No divergence found and no op left uncompared: what ``--fail-on-divergence`` checks."""
        return self.divergence is None and not self.counts[NOT_COMPARED]

    def by_rank(self) -> list[dict[str, Any]]:
        """Across ranks: per rank, the steps compared, verdict counts and its first divergence."""
        out = []
        for rank in sorted({s.rank for s in self.steps}):
            steps = [s for s in self.steps if s.rank == rank]
            counts = _count([c for s in steps for c in s.comparisons])
            found = [s.divergence for s in steps if s.divergence is not None]
            first = min(found, key=lambda d: d.step) if found else None
            out.append({
                "rank": rank, "steps": [s.step for s in steps], "counts": counts,
                "first_divergence": None if first is None else {
                    "step": first.step, "op_a": first.op_a.id, "name": first.op_a.name,
                    "module": first.op_a.module, "message": first.comparison.message,
                },
            })
        return out

    def overlay(self) -> dict[str, dict[str, Any]]:
        """Per step/rank, op id (run A) -> verdict and metrics, for the graph viewer."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.steps:
            layer = out.setdefault(f"step{s.step}/rank{s.rank}", {})
            for c in s.comparisons:
                if c.a is not None:
                    row = c.row()
                    layer[c.a.id] = {k: v for k, v in row.items() if k in (
                        "verdict", "message", "op_b", *METRIC_KEYS, *STATS_KEYS)}
        return out

    @property
    def summary(self) -> dict[str, Any]:
        """What the report found, without the rows: counts, per rank, the first divergence."""
        d = self.divergence
        return {
            "run_a": str(self.path_a), "run_b": str(self.path_b),
            "steps": sorted({s.step for s in self.steps}), "ranks": sorted({s.rank for s in self.steps}),
            "counts": self.counts, "ok": self.ok, "missing": self.missing, "per_rank": self.by_rank(),
            "first_divergence": None if d is None else {
                "step": d.step, "rank": d.rank, "op_a": d.op_a.id, "op_b": d.op_b.id if d.op_b else None,
                "name": d.op_a.name, "module": d.op_a.module, "phase": d.op_a.phase,
                "stack": d.op_a.stack, "message": d.comparison.message,
                "inputs_assumed": d.inputs_assumed, "chain": d.chain,
                "metrics": d.comparison.row(),
            },
        }

    def to_csv(self, path: str | Path) -> None:
        """The rows as CSV, msprobe-like columns (cells escaped against spreadsheet formulas)."""
        write_csv(self.rows, Path(path))

    def to_json(self, path: str | Path) -> None:
        """The summary and the rows as JSON."""
        Path(path).write_text(json.dumps({**self.summary, "rows": self.rows}, indent=1,
                                         default=_json_default))

    def to_html(self, path: str | Path) -> None:
        """A self-contained HTML page: the summary, the first divergence and a sortable table."""
        write_html(self.summary, self.rows, Path(path))


def _count(comparisons: list[OpComparison]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    for c in comparisons:
        counts[c.verdict] += 1
    return counts


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def compare(
    a: str | Path | Run, b: str | Path | Run, steps: list[int] | None = None,
    ranks: list[int] | None = None, module_map: dict[str, str] | None = None,
    processes: int | None = None, progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Compare run ``b`` against the reference run ``a``; see the module docstring.

    ``progress(done, total)`` is called as ops of run A are compared.
    """
    run_a = a if isinstance(a, Run) else Run(a)
    run_b = b if isinstance(b, Run) else Run(b)
    missing: list[str] = []
    plan: dict[int, list[int]] = {}
    for rank in sorted(set(run_a.ranks) | set(run_b.ranks)):
        if ranks is not None and rank not in ranks:
            continue
        if rank not in run_a.ranks or rank not in run_b.ranks:
            missing.append(f"rank {rank} is only in run {'A' if rank in run_a.ranks else 'B'}")
            continue
        steps_a, steps_b = set(run_a.steps_of(rank)), set(run_b.steps_of(rank))
        for step in sorted(steps_a ^ steps_b):
            if steps is None or step in steps:
                missing.append(f"step {step} of rank {rank} is only in run {'A' if step in steps_a else 'B'}")
        common = sorted(steps_a & steps_b)
        plan[rank] = [s for s in common if steps is None or s in steps]
    if not any(plan.values()):
        raise ProbeError(f"{str(run_a.path)!r} and {str(run_b.path)!r} have no step and rank in common"
                         + (f" ({'; '.join(missing)})" if missing else ""))
    sizes = {(s, r): _op_count(run_a, s, r) for r, ss in plan.items() for s in ss}
    total, done = sum(sizes.values()), 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    workers = min(len(plan), processes or len(plan))
    if workers > 1:
        # Spawned, not forked: a fork of a process whose OpenMP pool has run (any torch CPU
        # kernel, the compiled metrics) deadlocks in the child's first parallel region.
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
            futures = {pool.submit(_compare_rank, str(run_a.path), str(run_b.path), s, r, module_map): r
                       for r, s in plan.items()}
            results = []
            for future in as_completed(futures):
                results += future.result()
                advance(sum(n for (_, r), n in sizes.items() if r == futures[future]))
    else:
        results = [compare_step(run_a, run_b, s, r, module_map, advance)
                   for r, ss in plan.items() for s in ss]
    return Report(run_a.path, run_b.path, sorted(results, key=lambda s: (s.step, s.rank)), missing)


def _op_count(run: Run, step: int, rank: int) -> int:
    """How many ops a step holds, from its manifest (no need to load them to size a progress bar)."""
    count = run.step_info(step, rank).manifest.get("ops")
    return count if type(count) is int and count >= 0 else len(run.ops(step, rank))
