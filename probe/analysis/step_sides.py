"""Each run's step as compare reads it (its ops, with the loss scale divided out, its dump), a
matched step, and the measure of a pair of tensors: on dumped data, else statistics, else shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from probe.analysis import precision
from probe.analysis.comparison_records import OpComparison, TensorComparison
from probe.analysis.layouts import LogicalStep
from probe.analysis.matching import Match
from probe.analysis.metrics import stats_metrics, tensor_metrics
from probe.analysis.micro_batches import NOT_FOLDED
from probe.analysis.micro_batches import Folded as FoldedMicroBatches
from probe.analysis.mode_records import StepDump
from probe.analysis.verdicts import (
    ERROR,
    NOT_COMPARED,
    PASS,
    RULE_NONFINITE,
    RULE_NOT_COMPARED,
    RULE_SHAPE,
    RULE_STATS,
    RULE_THRESHOLDS,
    RULE_ULP,
    RULE_UNMATCHED,
    UNMATCHED,
    WARNING,
    lower_precision_of,
    stats_verdict,
    tensor_verdict,
    worst,
)
from probe.errors import ProbeError
from probe.rundir.run import OpRecord, Run, TensorRecord
from probe.rundir.tensor_layouts import dense_values

_NOT_IN_DUMP = "not in the dump"

_NOT_DUMPABLE = "not dumpable"

class Side:
    """One run's step: its ops, and its dump when it has one."""

    def __init__(self, run: Run, step: int, rank: int) -> None:
        self.run = run
        # A loss scaler's gradients are compared with its scale divided out (precision.unscaled).
        self.ops, self.loss_scale, self._scaled = precision.unscaled(run.ops(step, rank))
        self.held = precision.held_precision(self.ops)
        self.dump: StepDump | None = run.dump(step, rank) if run.has_dump(step, rank) else None
        self.folded = False
        """Whether :meth:`fold` replaced the run's ops (and the dump is not read)."""
        self.partial_sums: dict[tuple[int, int], int] = {}
        """A folded side's values its micro-batches summed in parts (see :meth:`fold`)."""

    def fold(self, folded: FoldedMicroBatches) -> None:
        """Takes the step's micro-batches folded into one batch as its ops
        (:func:`probe.analysis.micro_batches.fold`). Their indices are no longer the dump's, so the
        side is judged on statistics."""
        self.ops, self.loss_scale, self._scaled = precision.unscaled(folded.ops)
        self.partial_sums = folded.partial_sums
        self.held = precision.held_precision(self.ops)
        self.dump = None
        self.folded = True

    def __getstate__(self) -> dict[str, Any]:
        # A piece of work (compare_pieces) hands its sides back without the run and its open
        # dump; the process that judges the step attaches its own (:meth:`attach`).
        return {**self.__dict__, "run": None, "dump": None}

    def attach(self, run: Run, step: int, rank: int) -> None:
        """Reattaches the run (and its dump) after the side was pickled."""
        self.run = run
        if not self.folded:
            self.dump = run.dump(step, rank) if run.has_dump(step, rank) else None

    def unscale(self, op: OpRecord, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """An op's outputs recomputed from its dumped inputs, with the loss scale divided out
        where its recorded outputs carry it (as :meth:`data` reads them)."""
        if not self.loss_scale:
            return outputs
        return [t.double() / self.loss_scale if (op.index, "output", i) in self._scaled else t
                for i, t in enumerate(outputs)]

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
            data = dense_values(self.dump.tensor(op.index, io, position))  # a sparse tensor's values, ...
        except ProbeError as e:
            return None, f"unreadable: {e}"
        if (op.index, io, position) in self._scaled and self.loss_scale:
            data = data.double() / self.loss_scale
        return data, None

def is_float_dtype(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point or getattr(torch, dtype).is_complex


def same_elements(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether tensors of shapes ``a`` and ``b`` hold their elements alike, in the same order:
    equal shapes, or shapes apart by dimensions of size 1 only (autograd reduces a bias's gradient
    to ``[1, 1, n]`` from a batch of 2 and to ``[1, n]`` from a micro-batch of 1)."""
    return tuple(a) == tuple(b) or [d for d in a if d != 1] == [d for d in b if d != 1]

def compare_tensors(
    side_a: Side, side_b: Side, op_a: OpRecord, op_b: OpRecord, io: str, position: int,
) -> TensorComparison:
    records = op_a.inputs if io == "input" else op_a.outputs
    others = op_b.inputs if io == "input" else op_b.outputs
    ta: TensorRecord = records[position]
    tb: TensorRecord = others[position]
    unfolded = next((name for name, t in (("A", ta), ("B", tb)) if t.skipped == NOT_FOLDED), None)
    if unfolded is not None and ta.shape != tb.shape:  # a micro-batch's value the fold did not make whole
        return TensorComparison(io, position, NOT_COMPARED, f"no statistics in run {unfolded} ({NOT_FOLDED})",
                                "none", {}, RULE_NOT_COMPARED)
    if not same_elements(ta.shape, tb.shape):
        return TensorComparison(io, position, ERROR, f"shape {list(ta.shape)} vs {list(tb.shape)}",
                                rule=RULE_SHAPE)
    if is_float_dtype(ta.dtype) != is_float_dtype(tb.dtype):
        return TensorComparison(io, position, ERROR, f"dtype {ta.dtype} vs {tb.dtype}", rule=RULE_SHAPE)
    dtype = lower_precision_of(ta.dtype, tb.dtype)
    data_a, why_a = side_a.data(op_a, io, position)
    data_b, why_b = side_b.data(op_b, io, position)
    if data_a is not None and data_b is not None and data_a.shape != data_b.shape \
            and same_elements(data_a.shape, data_b.shape):
        data_b = data_b.reshape(data_a.shape)
    if data_a is not None and data_b is not None and data_a.shape != data_b.shape:  # nested: each its own
        return TensorComparison(io, position, ERROR, f"dumped values {list(data_a.shape)} vs "
                                f"{list(data_b.shape)}", rule=RULE_SHAPE)
    if data_a is not None and data_b is not None:
        m = tensor_metrics(data_a, data_b)
        verdict, message = tensor_verdict(m, dtype)
        rule = RULE_NONFINITE if m.nonfinite_mismatch else RULE_ULP if verdict == PASS else RULE_THRESHOLDS
        return TensorComparison(io, position, verdict, message, "data", m.as_dict(), rule)
    stats = None
    if ta.stats is not None and tb.stats is not None:
        m = stats_metrics(ta.stats, tb.stats)
        stats = (*stats_verdict(m, dtype, ta.stats["norm"] or 0.0, ta.numel), m.as_dict())
        overflowed = bool(m.nan_diff or m.inf_diff) and precision.fills_overflowed(ta.stats, tb.stats)
        if (precision.masked(ta.stats) or precision.masked(tb.stats)) and (
                overflowed or not (m.nan_diff or m.inf_diff)):
            # Mask fills dominate the sums: the extremes that are no fill decide.
            error = precision.masked_error(ta.stats, tb.stats)
            verdict = PASS if error <= precision.rounding(dtype) else WARNING
            note = f" (the mask fill is {m.inf_diff:+g} infinite value(s) in run B)" if overflowed else ""
            stats = (verdict, f"masked: statistics differ by {error:.3g} on the extremes that are no fill"
                     f"{note}", {**m.as_dict(), "fills_overflowed": 1.0} if overflowed else m.as_dict())
    # Both runs dumped this step, and the data of this tensor is missing on a side that
    # should hold it: whatever the statistics say, the data was not compared.
    if side_a.dump is not None and side_b.dump is not None and (why_a or why_b) \
            and not why_a == why_b == _NOT_IN_DUMP:
        reasons = "; ".join(f"run {name}: {why}" for name, why in (("A", why_a), ("B", why_b)) if why)
        message = f"no data to compare ({reasons})"
        if stats is not None:
            message += f"; statistics alone say {stats[0]}" + (f" ({stats[1]})" if stats[1] else "")
        return TensorComparison(io, position, NOT_COMPARED, message, "none", stats[2] if stats else {},
                                RULE_NOT_COMPARED)
    if stats is not None:
        nonfinite = (stats[2]["nan_diff"] or stats[2]["inf_diff"]) and not stats[2].get("fills_overflowed")
        rule = RULE_NONFINITE if nonfinite else RULE_STATS if stats[0] == PASS else RULE_THRESHOLDS
        return TensorComparison(io, position, stats[0], stats[1], "stats", stats[2], rule)
    note = "; ".join(f"run {name}: {why}" for name, why in (("A", why_a), ("B", why_b)) if why)
    if (ta.stats is None) != (tb.stats is None):
        # One run measured it, the other did not (its memory freed before it was read, a
        # filter, a mode the other run lacked): nothing to compare it against, never a pass.
        missing, why = ("B", tb.skipped) if tb.stats is None else ("A", ta.skipped)
        note = "; ".join(n for n in (note, why if why == NOT_FOLDED else None) if n)
        message = f"no statistics in run {missing}" + (f" ({note})" if note else "")
        return TensorComparison(io, position, NOT_COMPARED, message, "none", {}, RULE_NOT_COMPARED)
    if ta.dtype != tb.dtype:
        return TensorComparison(io, position, PASS, note or f"dtype {ta.dtype} vs {tb.dtype}")
    return TensorComparison(io, position, PASS, note)

def compare_pair(side_a: Side, side_b: Side, match: Match, step: int, rank: int) -> OpComparison:
    if match.a is None or match.b is None:
        which = "only in run A" if match.b is None else "only in run B"
        return OpComparison(step, rank, match.a, match.b, match.how, UNMATCHED, which, rule=RULE_UNMATCHED)
    outputs = [
        compare_tensors(side_a, side_b, match.a, match.b, "output", i)
        for i in range(min(len(match.a.outputs), len(match.b.outputs)))
    ]
    verdict = worst([t.verdict for t in outputs])
    messages = [f"output {t.position}: {t.message}" for t in outputs if t.message and t.verdict != PASS]
    decisive = [t for t in outputs if t.verdict == verdict]
    rule = decisive[0].rule if decisive else RULE_SHAPE
    if len(match.a.outputs) != len(match.b.outputs):
        verdict, rule = ERROR, RULE_SHAPE
        messages.append(f"{len(match.a.outputs)} outputs vs {len(match.b.outputs)}")
    return OpComparison(step, rank, match.a, match.b, match.how, verdict, "; ".join(messages), outputs, rule)

def error_of(t: TensorComparison, a: TensorRecord, b: TensorRecord) -> float | None:
    """One relative number for a compared tensor pair (None: nothing known of its values)."""
    if t.kind == "stats" and a.stats is not None and b.stats is not None:
        return precision.stats_error(a.stats, b.stats, a.numel)
    if t.kind == "data":
        return precision.data_error(t.metrics)
    return None

def record_dtype(record: TensorRecord) -> torch.dtype:
    dtype = getattr(torch, record.dtype)
    return dtype if dtype.is_floating_point else torch.float64

def producer_output(side: Side, record: TensorRecord) -> TensorRecord | None:
    """The output record of the op that produced input ``record`` in its run (None: from
    outside the step, or a source beyond what the run recorded)."""
    source = record.source
    if source is None or source[0] >= len(side.ops) or source[1] >= len(side.ops[source[0]].outputs):
        return None
    return side.ops[source[0]].outputs[source[1]]

@dataclass
class MatchedStep:
    """One step of one rank read, matched and measured but not judged yet: what a piece of work
    (``probe.analysis.compare_pieces``) hands back, in any process. The sides' runs are
    reattached where it is judged; ``folded`` are the logical steps a folded run's piece made,
    so that the judging process need not fold them again."""

    step: int
    rank: int
    sides: tuple[Side, Side]
    comparisons: list[OpComparison]
    lowerings: dict[int, precision.Lowering]
    policy: str
    folded: tuple[LogicalStep | None, LogicalStep | None] = (None, None)
