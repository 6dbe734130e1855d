"""Run against run: matched ops, metrics, verdicts, and the first divergence.

``compare(a, b)`` treats run A as the reference. Per (step, rank) found in both,
ops are matched (``matching``), each matched pair's outputs are compared on
dumped data when both runs hold it, else on statistics, else on shape and
dtype alone (``metrics``, ``verdicts``). When both runs dumped the step but a
tensor's data is missing or unreadable on either side, the output is "not
compared" (with the reason, and the statistics' metrics beside it when known):
missing data is never taken for agreement. What is not a pass is then judged with the
precision each run computed it in (``_judge``, ``probe.analysis.precision``): a
difference that the inputs' differences and each run's rounding explain is a warning
(by an fp64 replay of the op on each run's dumped inputs, else by a bound on the
propagation), an op of B lowering precision unexplained by B's policy is an error, and so
is a difference that enters at an op. Each verdict records its ``rule``. The **first
divergence** is the earliest op where a divergence enters (an op of B only when it
enters through one); an input whose difference is unknown (a producer that could not
be compared) leaves the thresholds to decide, and the divergence says its inputs were
assumed. Inputs from outside the step (weights, data) are the op's own state: when one
differs, this op is where the difference enters, and the report says so. From it, the
**chain** follows A's graph through the consumers that diverge too.

The work splits into pieces of one step of one rank (``compare_pieces``), matched in
parallel processes or on a cluster and judged here in step order; tensors are read one op at a time
through memory maps, so memory is bounded by the largest op, not the run.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from probe.analysis import precision
from probe.analysis.assembled import assembled_record
from probe.analysis.compare_pieces import run_pieces
from probe.analysis.compiled_regions import compare_notes, opened_regions, replayed_ops
from probe.analysis.layouts import LogicalRun, LogicalStep, layout_notes, logical_pair, partial_sums
from probe.analysis.matching import MICRO_BATCHES, Match, mapped_id, match_ops, rename_module
from probe.analysis.metrics import stats_metrics, tensor_metrics
from probe.analysis.micro_batches import NOT_FOLDED, MicroBatches, Unfoldable, accumulation_end, micro_batches
from probe.analysis.micro_batches import Folded as FoldedMicroBatches
from probe.analysis.micro_batches import fold as fold_micro_batches
from probe.analysis.mode_records import StepDump
from probe.analysis.module_graph import common_module
from probe.analysis.overwrites import overwritten_inputs
from probe.analysis.regrouped_sums import is_regrouped_sum
from probe.analysis.replay import recompute
from probe.analysis.report_writers import write_report
from probe.analysis.routing import Routed, decides, discrete
from probe.analysis.run_identity import Identity, identity, same_kernels
from probe.analysis.scaler_skips import not_compared_from, one_sided_skip
from probe.analysis.verdicts import (
    ERROR,
    NOT_COMPARED,
    PASS,
    RULE_ARGUMENTS,
    RULE_CARRIED,
    RULE_LOWERED,
    RULE_NONFINITE,
    RULE_NOT_COMPARED,
    RULE_OUTSIDE,
    RULE_PROPAGATION,
    RULE_REDUCTION_ORDER,
    RULE_REPLAY,
    RULE_ROUTING,
    RULE_SHAPE,
    RULE_STATS,
    RULE_THRESHOLDS,
    RULE_ULP,
    RULE_UNMATCHED,
    RULE_UNMATCHED_PRODUCER,
    UNMATCHED,
    VERDICTS,
    WARNING,
    lower_precision_of,
    stats_verdict,
    tensor_verdict,
    worst,
)
from probe.errors import ProbeError
from probe.rundir.rank_origin import is_collective
from probe.rundir.run import OpRecord, Run, TensorRecord
from probe.rundir.tensor_layouts import STRIDED, dense_values
from probe.rundir.written_parts import partial_write, written_part_sources, written_parts
from probe.vocabulary.op_class import creates_uninitialized, draws_random, probability_argument, returns_view

METRIC_KEYS = ("cosine", "max_abs_err", "max_rel_err", "one_thousandth_ratio",
               "five_thousandth_ratio", "rmse", "max_ulp", "ref_rms", "max_ulp_at_scale")
STATS_KEYS = ("max_rel", "min_rel", "mean_rel", "norm_rel", "nan_diff", "inf_diff")
REPLAY_LIMIT = 4_000_000
"""Default ``replay_limit``: inputs (elements) up to which an op is replayed in fp64 to judge it."""
_WORSE_IS_LOWER = {"cosine", "one_thousandth_ratio", "five_thousandth_ratio"}


@dataclass(slots=True)  # a report holds one an op: no __dict__ each
class TensorComparison:
    io: str
    position: int
    verdict: str
    message: str = ""
    kind: str = "shape"
    """What was compared: "data", "stats", only "shape" (and dtype), or "none" (not compared)."""
    metrics: dict[str, float] = field(default_factory=dict)
    rule: str = RULE_SHAPE
    """The rule that decided the verdict (``probe.analysis.verdicts.RULE_*``)."""


@dataclass(slots=True)  # a report holds one an op: no __dict__ each
class OpComparison:
    step: int
    rank: int
    a: OpRecord | None
    b: OpRecord | None
    match: str
    verdict: str
    message: str = ""
    outputs: list[TensorComparison] = field(default_factory=list)
    rule: str = ""
    """The rule that decided the verdict (``probe.analysis.verdicts.RULE_*``)."""
    enters: bool = False
    """A divergence enters at this op: its difference is more than its inputs and each run's
    precision explain (or it lowers precision unexplained)."""
    input_error: float | None = None
    """The inputs' difference (relative) the propagation rule judged this op by, when it did:
    how far its outputs' elements may be apart, whatever their statistics show."""

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
            "verdict": self.verdict, "rule": self.rule, "message": self.message, "enters": self.enters,
        }
        for key in (*METRIC_KEYS, *STATS_KEYS):
            values = [t.metrics[key] for t in self.outputs if key in t.metrics]
            if values:
                row[key] = min(values) if key in _WORSE_IS_LOWER else max(values, key=abs)
        return row


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


_NOT_IN_DUMP = "not in the dump"
_NOT_DUMPABLE = "not dumpable"


class _Side:
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


def _is_float(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point or getattr(torch, dtype).is_complex


def compare_tensors(
    side_a: _Side, side_b: _Side, op_a: OpRecord, op_b: OpRecord, io: str, position: int,
) -> TensorComparison:
    records = op_a.inputs if io == "input" else op_a.outputs
    others = op_b.inputs if io == "input" else op_b.outputs
    ta: TensorRecord = records[position]
    tb: TensorRecord = others[position]
    unfolded = next((name for name, t in (("A", ta), ("B", tb)) if t.skipped == NOT_FOLDED), None)
    if unfolded is not None and ta.shape != tb.shape:  # a micro-batch's value the fold did not make whole
        return TensorComparison(io, position, NOT_COMPARED, f"no statistics in run {unfolded} ({NOT_FOLDED})",
                                "none", {}, RULE_NOT_COMPARED)
    if ta.shape != tb.shape:
        return TensorComparison(io, position, ERROR, f"shape {list(ta.shape)} vs {list(tb.shape)}",
                                rule=RULE_SHAPE)
    if _is_float(ta.dtype) != _is_float(tb.dtype):
        return TensorComparison(io, position, ERROR, f"dtype {ta.dtype} vs {tb.dtype}", rule=RULE_SHAPE)
    dtype = lower_precision_of(ta.dtype, tb.dtype)
    data_a, why_a = side_a.data(op_a, io, position)
    data_b, why_b = side_b.data(op_b, io, position)
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


def _compare_pair(side_a: _Side, side_b: _Side, match: Match, step: int, rank: int) -> OpComparison:
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


@dataclass
class Divergence:
    step: int
    rank: int
    op_a: OpRecord | None
    """Run A's op where the divergence enters; None when it enters through ops of run B only."""
    op_b: OpRecord | None
    comparison: OpComparison
    inputs_assumed: bool
    """True when the producer of some input could not be matched or compared and was assumed to agree."""
    chain: list[str]
    """Op ids the divergence propagates through, in execution order (run A's, after a B-only start)."""

    @property
    def op(self) -> OpRecord:
        """The op where the divergence enters (run A's, or run B's when it exists in B only)."""
        op = self.op_a or self.op_b
        assert op is not None
        return op

    @property
    def rule(self) -> str:
        return self.comparison.rule


@dataclass(frozen=True)
class Carry:
    """What the steps compared before this one say about the state the runs carry into it
    (weights, optimizer state, buffers: the inputs from outside the step).

    A difference explained once stays explained: the weights two runs of different precision
    hold at step k differ by what their earlier steps computed differently, and that is no
    new divergence. Two runs that computed alike bit for bit so far are in the exact regime:
    any difference in what they carry, however small, entered between the steps."""

    before: int = 0
    """How many steps were compared before this one."""
    identical: bool = True
    """Every op compared so far had bit-identical results (statistics or data) in both runs."""
    explained: bool = True
    """No divergence entered in the steps before."""
    bound: float = 0.0
    """The largest difference (relative, as ``_error_of`` measures it) of a value the steps
    before wrote and that may be read again: optimizer outputs and in-place writes."""
    absolute: float = 0.0
    """The largest such difference times its value's norm: what a part of one may differ by,
    absolutely (a split of a parameter read whole by no op is no value the steps wrote)."""
    state_a: dict[tuple, float | None] = field(default_factory=dict, repr=False)
    """Run A's values the step before left (what it wrote in place or in its optimizer, and
    what it read from outside), by :func:`_fingerprint`, with their difference from run B's."""
    state_b: frozenset[tuple] = field(default=frozenset(), repr=False)
    """Run B's values the step before may have left (what forward made included: a value run B
    holds that is none of these changed between the steps), by :func:`_fingerprint`."""
    same_kernels: bool = False
    """The runs computed with the same kernels (:func:`run_identity.same_kernels`): in the exact
    regime, an op whose inputs are bit-identical and whose results are not computed otherwise."""


def _fingerprint(record: TensorRecord) -> tuple | None:
    """A value as its statistics identify it within one run (None without statistics). Sums are
    rounded: the same tensor reduced by another path (queued, eager) sums in another order."""
    stats = record.stats
    if stats is None:
        return None
    def sig(x: object) -> object:
        return float(f"{x:.9g}") if isinstance(x, float) and math.isfinite(x) else x
    return (record.dtype, tuple(record.shape), *(sig(stats.get(k)) for k in ("min", "max", "mean", "norm")),
            stats.get("nan"), stats.get("inf"))


def _leaves_state(op: OpRecord, output: TensorRecord, kept: bool = False) -> bool:
    """Whether an output of ``op`` may be read again in a later step: written in place, or by
    the optimizer (its moments, momentum buffers, the weights); with ``kept``, any output of
    forward too, where a model may keep what it computed (a positional table it extends and
    casts to its input's dtype, a cache) and a program what it drew (the next batches)."""
    return op.phase == "optimizer" or output.mutated or (kept and op.phase == "forward")


def _left_state(ops: list[OpRecord], kept: bool = False) -> dict[tuple, tuple[int, str, int]]:
    """The values a step leaves for the next (fingerprint -> where: op index, io, position);
    ``kept``: with every value forward made (see :func:`_leaves_state`)."""
    found: dict[tuple, tuple[int, str, int]] = {}
    for op in ops:
        for position, t in enumerate(op.inputs):
            if t.source is None and (key := _fingerprint(t)) is not None:
                found[key] = (op.index, "input", position)
        for position, t in enumerate(op.outputs):
            if _leaves_state(op, t, kept) and (key := _fingerprint(t)) is not None:
                found[key] = (op.index, "output", position)
    return found


@dataclass
class StepComparison:
    step: int
    rank: int
    comparisons: list[OpComparison]
    divergence: Divergence | None
    policy: str = ""
    """How run B's precision differs from run A's, in words ("bf16 autocast")."""
    carry: Carry = field(default_factory=Carry)
    """What this step hands to the next (:class:`Carry`)."""
    unreadable: str | None = None
    """Why the step could not be read in one run or both (its ops are "not compared"); None when read."""
    apart: str | None = None
    """Why the runs' training parted in this step or before it (one run's loss scaler skipped an update
    the other made: ``probe.analysis.scaler_skips``): its ops from there, and every later step's, are
    "not compared"; None while they train alike."""


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


def _chain(start: OpRecord, by_index: dict[int, OpComparison], limit: int = 100) -> list[str]:
    """The ids of the ops of run A a divergence at ``start`` reaches through consumers that
    diverge too (breadth first, consumers in execution order), in execution order. The consumers
    are found from the compared records' input sources: the step's graph is not built (at a
    kilobyte an op, it was the largest thing a compare of a long step held)."""
    consumers: dict[int, list[int]] = {}
    for index, c in by_index.items():
        assert c.a is not None
        for tensor in c.a.inputs:
            if tensor.source is not None:
                readers = consumers.setdefault(tensor.source[0], [])
                if not readers or readers[-1] != index:
                    readers.append(index)
    seen, queue, chain = {start.index}, deque([start.index]), []
    while queue and len(chain) < limit:
        index = queue.popleft()
        chain.append(index)
        for successor in consumers.get(index, []):
            comparison = by_index[successor]
            if successor not in seen and comparison.verdict in (ERROR, WARNING):
                seen.add(successor)
                queue.append(successor)
    return [start.id if i == start.index else by_index[i].a.id for i in sorted(chain)]  # type: ignore[union-attr]


def _tainted(op: OpComparison, by_index: dict[int, OpComparison]) -> bool:
    """Whether an input computed in the step comes from an op where the runs diverged."""
    agree, _ = _inputs_agree(op, by_index)
    return not agree


def _error_of(t: TensorComparison, a: TensorRecord, b: TensorRecord) -> float | None:
    """One relative number for a compared tensor pair (None: nothing known of its values)."""
    if t.kind == "stats" and a.stats is not None and b.stats is not None:
        return precision.stats_error(a.stats, b.stats, a.numel)
    if t.kind == "data":
        return precision.data_error(t.metrics)
    return None


def _dtype(record: TensorRecord) -> torch.dtype:
    dtype = getattr(torch, record.dtype)
    return dtype if dtype.is_floating_point else torch.float64


def _replayable(side: _Side, op: OpRecord) -> bool:
    if side.dump is None or not op.outputs:
        return False
    for io, records in (("input", op.inputs), ("output", op.outputs)):
        for position in range(len(records)):
            entry = side.dump.entries.get((op.index, io, position))
            if entry is None or entry.status is not None or entry.layout != STRIDED:
                return False  # a sparse, nested or quantized tensor is compared by its values alone
    return True


def _judge_by_replay(side_a: _Side, side_b: _Side, c: OpComparison,
                     terms: tuple[int, int] | None = None) -> tuple[bool, str] | None:
    """(enters, message) from an fp64 replay of the op on each run's own dumped inputs.

    A run's result far from the exact result on its own inputs (beyond the rounding
    bound of its dtype) was computed badly: the divergence enters here. Otherwise the
    difference is the inputs' difference carried through the op plus rounding.
    None when the op cannot be replayed (not fully dumped, random, unknown). ``terms``:
    the terms each run's rounding is bounded by, when its order of summation is not the
    op's own (:func:`_judge_reduction_order`); else the recorded shapes say.
    """
    assert c.a is not None and c.b is not None
    if not (_replayable(side_a, c.a) and _replayable(side_b, c.b)):
        return None
    cpu = torch.device("cpu")
    try:
        exact_a = side_a.unscale(c.a, recompute(side_a.run, c.a, cpu, torch.float64))
        exact_b = side_b.unscale(c.b, recompute(side_b.run, c.b, cpu, torch.float64))
    except (ProbeError, RuntimeError, TypeError, ValueError, NotImplementedError):
        return None
    worst_note, carried = "", 0.0
    for t in c.outputs:
        p = t.position
        if p >= len(exact_a) or p >= len(exact_b) or not c.a.outputs[p].dtype.startswith(("float", "bfloat")):
            continue
        for k, (name, side, op, exact) in enumerate((("A", side_a, c.a, exact_a[p]),
                                                     ("B", side_b, c.b, exact_b[p]))):
            result, _ = side.data(op, "output", p)
            if result is None or tuple(result.shape) != tuple(exact.shape):
                return None
            error = precision.own_error(result, exact)
            # Rounding relative to a result smaller than its terms grows as they cancel.
            # An op on operands of a lower dtype (layer norm's backward on fp16 gradients, with
            # fp32 weights) may compute in it.
            computed = _dtype(op.outputs[p])
            operands = precision.input_precision(op)
            if operands is not None:
                computed = precision.lower_of(computed, operands)
            reduction = terms[k] if terms is not None else precision.contraction_terms(op, p)
            bound = precision.rounding(computed, reduction) * max(_condition(side, op), 1.0)
            if error > bound:
                return True, (f"output {p}: run {name}'s result is {error:.3g} (relative) from the "
                              f"exact result on its own inputs (fp64 replay), beyond the rounding bound "
                              f"{bound:.3g} of {str(computed).removeprefix('torch.')}")
        if tuple(exact_a[p].shape) == tuple(exact_b[p].shape):
            carried = max(carried, precision.own_error(exact_b[p], exact_a[p]))
            worst_note = (f"consistent with precision (fp64 replay): each run's result is within its "
                          f"own rounding bound; the inputs' difference carried through the op gives "
                          f"{carried:.3g}")
    return False, worst_note or "consistent with precision (fp64 replay)"


def _scalar_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """The numbers and flags of a recorded call, by where they sit ("1", "alpha", "2.0"): what
    the call says beside its tensors. Dtypes, devices and layouts are left out, since
    precision policies change them and their rules judge them."""
    found: dict[str, Any] = {}

    def walk(where: str, value: Any) -> None:
        if isinstance(value, (bool, int, float)) or (isinstance(value, dict) and set(value) == {"float"}):
            found[where] = value
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{where}.{i}", v)

    for i, value in enumerate(call.get("args", [])):
        walk(str(i), value)
    for name, value in call.get("kwargs", {}).items():
        walk(name, value)
    return found


_DTYPE_LIMITS = tuple((name, d, float(getattr(torch.finfo(d), name)))
                      for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                      for name in ("max", "smallest_normal", "eps"))
"""``(limit, dtype, value)``: the numbers a program takes from a floating dtype's limits."""


def _limits_near(value: float | str) -> frozenset[tuple[str, torch.dtype]]:
    """The dtype limits ``value`` is within 2% of in magnitude (a floating dtype's largest value,
    smallest normal or eps): ``finfo(dtype).min`` as a mask's fill, T5's ``finfo(float16).max -
    1000`` as a clamp, ``nn.RMSNorm``'s default eps (its input dtype's)."""
    if type(value) is not float or not math.isfinite(value) or value == 0:
        return frozenset()
    return frozenset((name, d) for name, d, limit in _DTYPE_LIMITS if abs(abs(value) / limit - 1) <= 0.02)


def _of_dtype_limits(va: float | str, vb: float | str) -> bool:
    """Whether two runs' numbers are one limit each run took from its own dtype: the same limit
    (largest value, smallest normal or eps) of two dtypes."""
    near_a, near_b = _limits_near(va), _limits_near(vb)
    return any(name == other and da != db for name, da in near_a for other, db in near_b)


def _argument_difference(where: str, va: Any, vb: Any) -> str:
    """One argument two calls were given otherwise, in words (both rules of *arguments*)."""
    return f"argument {where}: {va!r} in run A, {vb!r} in run B"


def _constants_differ(c: OpComparison) -> str | None:
    """Why ``c`` was called with other constants in the two runs (None: it was not, or a run
    recorded none): an eps, a scale, a fill value or a mode word given to both runs' call of one
    op, different in each, is another computation at that op, whatever the precision of either
    run and however small its effect. A number each run derives from its own dtype's limits is
    not one (:func:`_of_dtype_limits`); nor is a slot only one run filled with a number (the
    other passed a tensor there)."""
    assert c.a is not None and c.b is not None
    ka, kb = c.a.constants, c.b.constants
    if not ka or not kb or c.a.name != c.b.name:
        return None
    differing = []
    for where in sorted(set(ka) & set(kb)):
        va, vb = ka[where], kb[where]
        if va == vb or (va != va and vb != vb) or _of_dtype_limits(va, vb):
            continue  # (NaN is a constant equal to itself)
        differing.append(_argument_difference(where, va, vb))
    if not differing:
        return None
    return f"called with other constants ({'; '.join(differing)})"


def _called_otherwise(side_a: _Side, side_b: _Side, c: OpComparison) -> str | None:
    """Why ``c`` was called with other arguments on identical tensors (None: it was not).

    With every tensor input equal bit for bit (values, dtype, shape) in both runs, a result
    that differs can only come from what the call says beside its tensors: an eps, a scale,
    a dim. That is a change of the computation itself, at this op, however small its effect.
    """
    assert c.a is not None and c.b is not None
    if side_a.dump is None or side_b.dump is None or not c.a.inputs or len(c.a.inputs) != len(c.b.inputs):
        return None
    if [t.dtype for t in c.a.outputs] != [t.dtype for t in c.b.outputs]:
        return None  # a result in another dtype is called with that dtype's numbers (its finfo.min)
    for position in range(len(c.a.inputs)):
        data_a, _ = side_a.data(c.a, "input", position)
        data_b, _ = side_b.data(c.b, "input", position)
        if data_a is None or data_b is None or data_a.dtype != data_b.dtype \
                or data_a.shape != data_b.shape or not torch.equal(data_a, data_b):
            return None
    try:
        call_a, call_b = side_a.dump.call(c.a.index), side_b.dump.call(c.b.index)
    except ProbeError:
        return None
    scalars_a, scalars_b = _scalar_arguments(call_a), _scalar_arguments(call_b)
    differing = [_argument_difference(where, scalars_a.get(where), scalars_b.get(where))
                 for where in sorted(set(scalars_a) | set(scalars_b))
                 if scalars_a.get(where) != scalars_b.get(where)]
    if not differing:
        return None
    return (f"its tensor inputs are identical in both runs, but it was called with other arguments "
            f"({'; '.join(differing)})")


def _layout_unknown(ops: list[OpRecord]) -> set[int]:
    """The ops of one step whose results may be laid out (strided) as a tensor from outside the step
    of two or more dimensions: its views, and ops whose result has its shape (elementwise ops
    follow their input's strides), transitively. Records keep no strides, and two runs may hold
    one value in other layouts (a weight stored transposed), which a reduction sums in another
    order: another kernel's rounding, not another computation."""
    unknown: set[int] = set()
    for op in ops:
        # A contraction writes a fresh result in its own layout; a view or an op of the same shape
        # (elementwise) may keep its input's.
        fresh = precision.short_name(op.name) in precision.AUTOCAST_LOWERED
        for t in op.inputs:
            if _laid_out_elsewhere(t, unknown) and (returns_view(op.name) or (not fresh and any(
                    tuple(o.shape) == tuple(t.shape) for o in op.outputs))):
                unknown.add(op.index)
                break
    return unknown


def _laid_out_elsewhere(t: TensorRecord, unknown: set[int]) -> bool:
    """Whether input ``t`` may be laid out as a tensor from outside the step of two or more
    dimensions: it is one, or a result :func:`_layout_unknown` found in ``unknown``."""
    return (t.source is None and len(t.shape) >= 2) or (t.source is not None and t.source[0] in unknown)


def _computed_otherwise(c: OpComparison, carry: Carry,
                        layout_unknown: tuple[set[int], set[int]]) -> str | None:
    """Why ``c`` computed something else than run A's op (None: it did not, or it cannot be told):
    the runs computed alike bit for bit up to here (``carry.identical``: its inputs are too) with
    the same kernels (``carry.same_kernels``), so the same call gives the same results; these
    differ, so the call was another (an eps, a scale) or its code was. Found from statistics, where
    :func:`_called_otherwise` needs both runs' dumps; an op returning memory nothing wrote
    (``empty``) holds no value to compare, and a collective reads other ranks' values too."""
    assert c.a is not None and c.b is not None
    if not (carry.identical and carry.same_kernels) or creates_uninitialized(c.a.name) or is_collective(c.a) \
            or c.a.name != c.b.name or not len(c.outputs) == len(c.a.outputs) == len(c.b.outputs):
        return None
    # Inputs from outside the step held in another dtype by design (a bf16 model's weights) keep
    # the regime: they are not identical, so neither need the results be. Nor need they where an
    # input's layout is not known to be the same (strides are not recorded).
    for op, unknown in zip((c.a, c.b), layout_unknown, strict=True):
        if any(_laid_out_elsewhere(t, unknown) for t in op.inputs):
            return None
    if len(c.a.inputs) != len(c.b.inputs) or not all(
            _stats_alike(ta, tb) if ta.source is None else (ta.dtype, ta.shape) == (tb.dtype, tb.shape)
            for ta, tb in zip(c.a.inputs, c.b.inputs, strict=True)):
        return None
    # (A result one run has no statistics of is unknown, not different.)
    differing = [t.position for t in c.outputs if t.verdict != NOT_COMPARED
                 and not _alike(t, c.a.outputs[t.position], c.b.outputs[t.position])]
    if not differing:
        return None
    return (f"the runs computed alike bit for bit up to here with the same kernels (versions, devices, "
            f"settings and threads), so its inputs are identical, and its output(s) "
            f"{', '.join(map(str, differing))} differ: it computed something else (other arguments "
            f"or code)")


def _replay_skipped(c: OpComparison, replay_limit: int) -> str | None:
    """Why the replay of ``c`` is skipped for its size (None: it is not)."""
    assert c.a is not None and c.b is not None
    elements = max(sum(t.numel for t in c.a.inputs), sum(t.numel for t in c.b.inputs))
    if elements <= replay_limit:
        return None
    return (f"replay skipped: inputs of {elements} elements exceed replay_limit={replay_limit}"
            if replay_limit else "replay disabled (replay_limit=0)")


def _producer_error(by_index: dict[int, OpComparison], source: tuple[int, int]) -> float | None:
    producer = by_index.get(source[0])
    if producer is None or producer.a is None or producer.b is None:
        return None
    for t in producer.outputs:
        if t.position != source[1]:
            continue
        if t.verdict == PASS and t.kind == "data":
            return 0.0
        # A pass on statistics is a difference within rounding, not none: its size is the
        # statistics' (their "max_rel" is the max statistic's alone, 0 while min and norm differ).
        if source[1] < len(producer.b.outputs):
            return _error_of(t, producer.a.outputs[source[1]], producer.b.outputs[source[1]])
    return None


def _measured_error(by_index: dict[int, OpComparison], source: tuple[int, int]) -> float | None:
    """The difference of a producer's output as its records measure it (None when unknown)."""
    producer = by_index.get(source[0])
    if producer is None or producer.a is None or producer.b is None or source[1] >= len(producer.b.outputs) \
            or source[1] >= len(producer.a.outputs):
        return None
    for t in producer.outputs:
        if t.position == source[1]:
            return _error_of(t, producer.a.outputs[source[1]], producer.b.outputs[source[1]])
    return None


def _passed_on(by_index: dict[int, OpComparison], source: tuple[int, int] | None, depth: int = 0) -> float:
    """How far the elements of a producer's output may be apart by what its inputs differ (0
    when its inputs were not judged).

    Statistics measure a difference of the whole tensor: differences of random sign, which
    rounding makes, leave the norm and the extremes nearly as they were. A sum makes them
    visible (the weight gradient of a norm sums a product over the rows), so a sum's input
    known by statistics differs, element by element, by as much as its producer's inputs. So
    does a product by another tensor, whose extremes are other elements than its inputs'.
    A producer that passed on its statistics was not judged from its inputs: their measured
    differences stand for it (a `cat` of a part that differs by 1e-6 and one that does not,
    whose statistics are 7e-8 apart: rotary's rotated half), up to ``_PASSED_ON_DEPTH`` such
    producers up."""
    producer = by_index.get(source[0]) if source is not None else None
    if producer is None:
        return 0.0
    if producer.input_error is not None:
        return producer.input_error
    if producer.verdict != PASS or producer.a is None or depth >= _PASSED_ON_DEPTH:
        return 0.0
    found = 0.0
    for t in producer.a.inputs:
        if t.source is not None:
            found = max(found, _measured_error(by_index, t.source) or 0.0,
                        _passed_on(by_index, t.source, depth + 1))
    return found


_PASSED_ON_DEPTH = 4
"""The most producers that passed on statistics walked up to the differences they carry."""


def _multiplies_tensors(op: OpRecord) -> bool:
    """Whether ``op`` multiplies (or divides) two tensors of more than one element each."""
    tensors = [t for t in op.inputs if t.floating and math.prod(t.shape) > 1]
    return precision.short_name(op.name) in ("mul", "div") and len(tensors) >= 2


def _input_error(side_a: _Side, side_b: _Side, c: OpComparison, position: int,
                 t: TensorComparison) -> float | None:
    """Input ``position``'s difference for the propagation bound: on data, over the elements
    that differ (a mask's fill would otherwise dilute it); else as :func:`_error_of` says."""
    assert c.a is not None and c.b is not None
    if t.kind == "data":
        data_a, _ = side_a.data(c.a, "input", position)
        data_b, _ = side_b.data(c.b, "input", position)
        if data_a is not None and data_b is not None:
            return precision.differing_error(data_a, data_b)
    return _error_of(t, c.a.inputs[position], c.b.inputs[position])


def _concentration(side_a: _Side, side_b: _Side, c: OpComparison, position: int) -> float:
    """The factor by which input ``position``'s difference, measured on the whole tensor, may
    be larger in the part ``c`` selects of it (:func:`precision.selection_gain`); 1 when both
    runs dumped that input, whose difference is then measured element by element."""
    assert c.a is not None and c.b is not None
    if position != 0:
        return 1.0
    if side_a.data(c.a, "input", 0)[0] is not None and side_b.data(c.b, "input", 0)[0] is not None:
        return 1.0
    return max(precision.selection_gain(c.a), precision.selection_gain(c.b))


def _sources_error(side_a: _Side, side_b: _Side, a: TensorRecord, b: TensorRecord) -> float | None:
    """An input's difference from the statistics each run recorded for it, or else for the
    producer output it is (None when either is unknown)."""
    parts = [written_parts(side.ops, record) if record.stats is None and partial_write(side.ops, record)
             else None for side, record in ((side_a, a), (side_b, b))]
    if parts[0] is not None and parts[1] is not None and len(parts[0]) == len(parts[1]) \
            and all(x.shape == y.shape for x, y in zip(*parts, strict=True)):
        # A buffer written in place in parts alike in both runs: each element is one part's.
        errors = [_stats_difference(x, y) for x, y in zip(*parts, strict=True)]
        return None if any(e is None for e in errors) else max(errors)  # type: ignore[type-var]
    found = []
    for side, record, written in ((side_a, a, parts[0]), (side_b, b, parts[1])):
        if written is not None:
            record = assembled_record(written, record) or record  # a buffer filled piece by piece
        elif record.stats is None:
            record = _producer_output(side, record) or record
        found.append(record)
    return _stats_difference(*found)


def _producer_output(side: _Side, record: TensorRecord) -> TensorRecord | None:
    """The output record of the op that produced input ``record`` in its run (None: from
    outside the step, or a source beyond what the run recorded)."""
    source = record.source
    if source is None or source[0] >= len(side.ops) or source[1] >= len(side.ops[source[0]].outputs):
        return None
    return side.ops[source[0]].outputs[source[1]]


def _condition(side: _Side, op: OpRecord) -> float:
    """``precision.condition`` of ``op`` in its run, an input computed in the step that has no
    statistics of its own (the stats mode records it as its producer's output; a view the tracer
    did not see made, of the same elements count) described by its producer's output: a key
    bias's gradient sums a view of a buffer ``copy_`` filled, and its cancellation is all there
    is to its rounding."""
    inputs = [record if record.stats is not None or (produced := _producer_output(side, record)) is None
              or math.prod(produced.shape) != math.prod(record.shape) else produced
              for record in op.inputs]
    return precision.condition(op, inputs)


def _sketched(side_a: _Side, side_b: _Side, a: TensorRecord, b: TensorRecord) -> float:
    """How far an input's elements are apart in the two runs by their sketches (0 where either
    run took none): statistics understate differences of random sign, which rounding in another
    order makes, and a sum with cancellation shows them. An input computed in the step is
    described by its producer's output."""
    found = [record if record.sketch is not None else _producer_output(side, record) or record
             for side, record in ((side_a, a), (side_b, b))]
    error = precision.sketch_error(*found)
    return error if error is not None else 0.0


def _sketches_taken(c: OpComparison) -> bool:
    """Whether both runs took sketches of this op's values (then a 0 from them is a measure)."""
    assert c.a is not None and c.b is not None
    return any(t.sketch is not None for t in c.a.outputs) and any(t.sketch is not None for t in c.b.outputs)


def _held_apart(side_a: _Side, side_b: _Side, a: TensorRecord, b: TensorRecord) -> float:
    """The rounding one run's value of an input passed through and the other's did not (0 when
    none): a value held in bf16 in run B on its way here differs from run A's element by element
    by up to bf16's rounding, which its statistics average away."""
    held = []
    for side, record in ((side_a, a), (side_b, b)):
        dtype = _dtype(record) if _is_float(record.dtype) else torch.float64
        if record.source is not None:
            dtype = precision.lower_of(dtype, side.held.get(record.source, dtype))
        held.append(dtype)
    if held[0] == held[1]:
        return 0.0
    return float(torch.finfo(precision.lower_of(held[0], held[1])).eps)


def _uninitialized(a: TensorRecord, b: TensorRecord, by_index: dict[int, OpComparison]) -> bool:
    """Whether the input is memory nothing had written yet (``empty_like``'s, filled by this op,
    e.g. ``copy_``'s destination): it holds no value of the program, so no difference."""
    producer = by_index.get(a.source[0]) if a.source is not None else None
    return (a.stats is None and b.stats is None and producer is not None and producer.a is not None
            and creates_uninitialized(producer.a.name))


def _judge_by_propagation(side_a: _Side, side_b: _Side, c: OpComparison,
                          by_index: dict[int, OpComparison],
                          carried: dict[int, float] | None = None,
                          terms: tuple[int, int] | None = None) -> tuple[bool, str] | None:
    """(enters, message) from the inputs' difference: beyond ``CONDITION`` x it plus each run's
    rounding, the difference enters here. None when an input computed in the step is unknown.
    ``carried``: the differences of inputs from outside the step that earlier steps explain
    (input position -> relative difference). ``terms``: each run's terms for its rounding, as
    :func:`_judge_by_replay` takes them."""
    assert c.a is not None and c.b is not None
    in_error = sketched = 0.0
    overwritten = overwritten_inputs(c.a)
    summed = precision.contraction_terms(c.a) > 1 or precision.summed_terms(c.a) > 1 \
        or _multiplies_tensors(c.a)
    for position, record in enumerate(c.a.inputs):
        if position >= len(c.b.inputs) or position in overwritten \
                or _uninitialized(record, c.b.inputs[position], by_index):
            continue
        if record.source is None and c.b.inputs[position].source is None:
            if carried is not None and position in carried:  # state the steps before explain
                gain = _concentration(side_a, side_b, c, position)
                # Its statistics understate an update that differs in a few elements (Adam's first
                # step moves each by +-lr: a gradient's sign flipped by rounding moves one by 2 lr,
                # which leaves the norm as it was); the sketches measure the elements.
                sketched = max(sketched, _sketched(side_a, side_b, record, c.b.inputs[position]))
                in_error = max(in_error, carried[position] * gain, sketched)
            continue
        t = compare_tensors(side_a, side_b, c.a, c.b, "input", position)
        if t.verdict == ERROR and t.rule in (RULE_SHAPE, RULE_NONFINITE):
            return None
        error = _input_error(side_a, side_b, c, position, t)
        if error is not None and t.kind != "data":
            error *= _concentration(side_a, side_b, c, position)
            if summed:
                error = max(error, _passed_on(by_index, record.source))
        if error is None and record.source is not None and not partial_write(side_a.ops, record):
            error = _producer_error(by_index, record.source)  # nothing in its record: its producer's
        if error is None:  # producers that were not matched: their outputs, as each run recorded them
            error = _sources_error(side_a, side_b, record, c.b.inputs[position])
        if error is None:
            return None
        floor = _held_apart(side_a, side_b, record, c.b.inputs[position])
        sketched = max(sketched, _sketched(side_a, side_b, record, c.b.inputs[position]))
        in_error = max(in_error, error, floor, sketched)
    out_error, out_dtypes, underflow = 0.0, (torch.float64, torch.float64), 0.0
    primary = precision.primary_outputs(c.a)
    for t in c.outputs:
        if t.position >= primary:
            continue  # statistics the op keeps for its backward: its result and gradients tell
        error = _error_of(t, c.a.outputs[t.position], c.b.outputs[t.position])
        if t.kind == "data":  # measured as the inputs are (a sparse gradient's rms is no scale)
            data_a, _ = side_a.data(c.a, "output", t.position)
            data_b, _ = side_b.data(c.b, "output", t.position)
            if data_a is not None and data_b is not None:
                error = precision.differing_error(data_a, data_b)
        if error is None:
            return None
        if error >= out_error:
            out_error = error
            out_dtypes = (_dtype(c.a.outputs[t.position]), _dtype(c.b.outputs[t.position]))
            underflow = precision.underflow_rounding(c.a.outputs[t.position], c.b.outputs[t.position])
    cancellation = max(_condition(side_a, c.a), _condition(side_b, c.b))
    # An op's own rounding is relative to its terms; where they cancel, relative to its result
    # it grows as its inputs' differences do (a gradient that is zero in exact arithmetic, such
    # as a key bias's, is rounding alone).
    reductions = terms if terms is not None else \
        (precision.contraction_terms(c.a), precision.contraction_terms(c.b))
    rounding = max(cancellation, 1.0) * (precision.rounding(out_dtypes[0], reductions[0], floor=False)
                                         + precision.rounding(out_dtypes[1], reductions[1], floor=False))
    # A result below its dtype's normal range rounds absolutely, already relative to itself.
    rounding += underflow
    factor = max(precision.CONDITION, cancellation)
    terms = precision.summed_terms(c.a)
    if sketched > 0 and terms > 1:
        # Element by element (the sketches), a sum of K terms per result moves by at most
        # sqrt(K) times its terms' L2 difference, whatever their signs (Cauchy-Schwarz): its
        # cancellation, which assumes the signs random, times sqrt(K).
        factor = max(factor, math.sqrt(terms) * cancellation * sketched / in_error)
    bound = factor * in_error + rounding
    c.input_error = in_error
    if in_error >= WHOLLY:
        bound = math.inf  # inputs that differ as much as their values bound nothing
    detail = (f"output differs by {out_error:.3g} (relative), {factor:.3g} x the inputs' "
              f"{in_error:.3g} + rounding {rounding:.3g} = {bound:.3g}")
    if c.a.phase == "optimizer" and in_error > 0:
        # Adam's m / (sqrt(v) + eps) is sign(g) where gradients are near zero: no condition
        # bounds what it makes of a difference of its inputs. A difference enters an
        # optimizer op only where its inputs agree.
        return False, (f"consistent with precision: the optimizer's update of inputs that differ by "
                       f"{in_error:.3g} (relative; its normalisation is unbounded near zero gradients)")
    if out_error > bound:
        unsketched = "" if sketched > 0 or _sketches_taken(c) else (
            " (the inputs' difference is their statistics': record both runs with sketch=True to "
            "measure their elements')")
        return True, f"{detail}: beyond what the inputs and each run's precision explain{unsketched}"
    return False, f"consistent with precision: {detail}"


CHANGED_BETWEEN_STEPS = "it changed between the steps"
"""How an input is described that run B's step before did not leave where run A's did."""


def _external_inputs_differ(side_a: _Side, side_b: _Side, c: OpComparison, carry: Carry,
                            carried: dict[int, float]) -> list[str]:
    """Inputs from outside the step (in run A) whose difference enters here, in words.

    In the exact regime (``carry.identical``) any difference does: the runs computed alike
    bit for bit, so what they carry cannot differ. When the steps before explained their
    differences, one up to ``carry.bound`` is carried state (recorded in ``carried``, input
    position -> difference); beyond it, or with nothing before to explain it, one beyond
    the thresholds enters here."""
    assert c.a is not None and c.b is not None
    differ = []
    overwritten = overwritten_inputs(c.a)
    for position, record in enumerate(c.a.inputs):
        if record.source is not None or position >= len(c.b.inputs) \
                or c.b.inputs[position].source is not None or position in overwritten:
            continue  # computed in the step (in run B: by ops of B only, which the rules judge)
        other = c.b.inputs[position]
        t = compare_tensors(side_a, side_b, c.a, c.b, "input", position)
        beyond_thresholds = t.verdict in (ERROR, WARNING)
        if carry.identical:
            # Another dtype by design (a bf16 model) is judged by the thresholds of the lower one.
            if not _alike(t, record, other) and (record.dtype == other.dtype or beyond_thresholds):
                differ.append(f"input {position} (from outside the step) differs while the runs computed "
                              f"alike bit for bit up to here: {t.message or 'its statistics differ'}")
            continue
        error = _error_of(t, record, other)
        fa, fb = _fingerprint(record), _fingerprint(other)
        if carry.before and fa is not None and fa in carry.state_a:  # state run A carries over
            if fb is not None and carry.state_b and fb not in carry.state_b:
                differ.append(f"input {position} (from outside the step) holds in run B a value its step "
                              f"before did not leave: {CHANGED_BETWEEN_STEPS}")
                continue
            known = carry.state_a[fa]
            if error is not None and known is not None and error <= known * (1 + 1e-6) + 1e-12:
                carried[position] = _selected_state(c, t, position, error, carry)
                continue
        lower = precision.lower_of(_dtype(record), _dtype(other))
        if record.dtype != other.dtype and error is not None and error <= precision.rounding(lower):
            carried[position] = error  # held in another dtype by design (a bf16 model): its rounding
            continue
        if carry.before and carry.explained and error is not None:
            # Both are measures (fp64 sums) of what the steps before wrote: one value read
            # back may be measured through another kernel, so they agree up to the sums' rounding.
            explained = _state_part_bound(record, carry)
            if error <= explained * (1 + SUM_ROUNDING):
                carried[position] = _selected_state(c, t, position, error, carry)
                continue
            differ.append(f"input {position} (from outside the step) differs by {error:.3g} (relative), "
                          f"beyond the {explained:.3g} the steps before explain"
                          + (f": {t.message}" if t.message else ""))
        elif beyond_thresholds:
            differ.append(f"input {position} (from outside the step) differs: {t.message}")
    return differ


def _state_part_bound(record: TensorRecord, carry: Carry) -> float:
    """The difference the steps before explain in ``record``, a value read from outside the step
    that is not one they wrote whole (then its own difference is known): a part of one (a split
    of a parameter: its views are read, never the whole) may hold all of a difference, larger
    relative to the part by the ratio of their norms."""
    norm = record.stats.get("norm") if record.stats is not None else None
    if not norm or not math.isfinite(float(norm)):
        return carry.bound
    return max(carry.bound, carry.absolute / float(norm))


def _selected_state(c: OpComparison, t: TensorComparison, position: int, error: float,
                    carry: Carry) -> float:
    """The difference to carry for state input ``position`` that the steps before explain.

    An op that selects part of the state (an embedding's rows) is not judged by the state's
    statistics: their extremes and norm belong to the part not selected (an SGD step changes
    only the rows of the tokens seen, and they are the rows selected next). The largest
    difference the steps before explain in what they wrote stands for it. Dumped data is
    measured element by element and needs no stand-in."""
    assert c.a is not None
    if position == 0 and t.kind != "data" and precision.is_selection(c.a):
        return max(error, carry.bound)
    return error


WHOLLY = 1.0
"""An input difference (relative) at which the runs' values are no longer each other's
approximations (a gradient of a near-zero quantity in a bf16 model): from it no bound
follows, and an op downstream is not where a divergence enters."""

SUM_ROUNDING = 1e-12
"""How far (relative) two statistics sums of the same values may differ: fp64 sums taken in
another order (another thread count) round differently."""


def _alike(t: TensorComparison, a: TensorRecord, b: TensorRecord) -> bool:
    """Whether a compared tensor pair is bit-identical as far as the runs recorded it: equal
    data, or equal statistics (their fp64 sums up to their own rounding)."""
    if t.kind == "data":
        return t.metrics.get("max_abs_err") == 0 and not t.metrics.get("nonfinite_mismatch")
    return _stats_alike(a, b)


def _stats_alike(a: TensorRecord, b: TensorRecord) -> bool:
    """Whether two records are of one dtype and shape with equal statistics (their fp64 sums up
    to their own rounding)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.stats is None or b.stats is None:
        return a.stats is b.stats
    norm = a.stats.get("norm")
    rms = norm / math.sqrt(a.numel) if isinstance(norm, float) and math.isfinite(norm) and a.numel else 0.0
    for key, x in a.stats.items():
        y = b.stats.get(key)
        if key in ("mean", "norm") and isinstance(x, float) and isinstance(y, float):
            # A mean near zero is the cancellation of its terms: its rounding is the rms's.
            if abs(x - y) > SUM_ROUNDING * max(abs(x), abs(y), rms):
                return False
        elif x != y:
            return False
    return True


def _written_error(c: OpComparison) -> tuple[float, float]:
    """The largest difference of a value ``c`` leaves for later steps to read, relative and times
    that value's norm (0 when none)."""
    if c.a is None or c.b is None:
        return 0.0, 0.0
    worst_error = worst_absolute = 0.0
    for t in c.outputs:
        record = c.a.outputs[t.position]
        if _leaves_state(c.a, record):
            error = _error_of(t, record, c.b.outputs[t.position]) or 0.0  # unknown: explains nothing
            norm = record.stats.get("norm") if record.stats is not None else None
            worst_error = max(worst_error, error)
            if norm is not None and math.isfinite(float(norm)):
                worst_absolute = max(worst_absolute, error * float(norm))
    return worst_error, worst_absolute


def _one_run_producers(op: OpRecord, position: int, ops: dict[int, OpRecord], only: set[int],
                       limit: int = 512) -> tuple[list[OpRecord], list[tuple[int, int]]] | None:
    """The ops of one run only that produced input ``position`` of ``op`` (walking up through such
    ops, earliest first), and the sources at their boundary: outputs of matched ops, whose
    differences are known. None when more than ``limit`` such ops would have to be walked."""
    source = op.inputs[position].source
    if source is None or source[0] not in only:
        return [], [] if source is None else [source]
    found: dict[int, OpRecord] = {}
    boundary: list[tuple[int, int]] = []
    stack = [source[0]]
    while stack:
        index = stack.pop()
        if index in found:
            continue
        if len(found) == limit:
            return None
        producer = found[index] = ops[index]
        for record in producer.inputs:
            if record.source is None:
                continue
            # A buffer written in part reads as its last write: its other parts hold values too.
            sources = (written_part_sources(ops, record) or [record.source]) \
                if partial_write(ops, record) else [record.source]  # type: ignore[arg-type]
            for source in sources:
                if source[0] in only:
                    stack.append(source[0])
                else:
                    boundary.append(source)
    return sorted(found.values(), key=lambda o: o.index), boundary


def _edge_error(side_a: _Side, side_b: _Side, c: OpComparison, position: int,
                records: tuple[TensorRecord | None, TensorRecord | None]) -> float | None:
    """The difference of input ``position`` of ``c`` between the runs, as one relative number.

    From the input's own data or statistics; when they were not recorded, from the
    statistics of the producers' outputs that the input is (``records``, one per run).
    """
    assert c.a is not None and c.b is not None
    t = compare_tensors(side_a, side_b, c.a, c.b, "input", position)
    if t.rule == RULE_SHAPE and t.verdict == ERROR:
        return None
    if t.rule == RULE_NONFINITE:
        return math.inf
    error = _input_error(side_a, side_b, c, position, t)
    ra, rb = records
    if error is None and ra is not None and rb is not None:
        error = _stats_difference(ra, rb)
    if error is None:
        error = _sources_error(side_a, side_b, c.a.inputs[position], c.b.inputs[position])
    return error


@dataclass
class _RunView:
    """One run's side of a step as the unmatched-producer rule walks it."""

    side: _Side
    ops: dict[int, OpRecord]
    """The step's ops by index."""
    comparisons: dict[int, OpComparison]
    """Comparison rows by this run's op index."""
    only: set[int]
    """Indices of the ops that exist in this run only."""

    def partner_in_a(self, index: int) -> int | None:
        """Run A's index of this run's op ``index`` where it is matched (run B's view)."""
        row = self.comparisons.get(index)
        return row.a.index if row is not None and row.a is not None else None

    def output_record(self, source: tuple[int, int] | None) -> TensorRecord | None:
        producer = self.ops.get(source[0]) if source is not None else None
        if producer is None or source is None or source[1] >= len(producer.outputs):
            return None
        return producer.outputs[source[1]]


def _upstream_error(view: _RunView, boundary: list[tuple[int, int]]) -> float | None:
    """The largest difference of the matched outputs at ``boundary`` (None: one is unknown).

    An output within the thresholds is measured too: its difference is the one the ops of one
    run carry on, and a bound needs its size, not only that it is small."""
    upstream = 0.0
    for source in boundary:
        error = _producer_error(view.comparisons, source)
        if error is None:
            error = _measured_error(view.comparisons, source)
        if error is None:
            return None
        upstream = max(upstream, error)
    return upstream


def _entered_through_unmatched(c: OpComparison, views: tuple[_RunView, _RunView], carry: Carry,
                               moves_only: bool = False) -> tuple[OpComparison, str] | None:
    """(the one-run-only op to blame, why) when an input of ``c`` produced by ops of one run
    only differs by more than the matched ops upstream of them and rounding explain.
    ``moves_only``: only where such ops moved its values to other positions (a routed op, which
    no numeric bound judges, still reads a mask one run rolled).

    Each input whose producer exists in one run only is traced up to the matched ops
    feeding those producers. Its difference at ``c`` is bounded by ``CONDITION`` x their
    difference plus each run's rounding of the input's dtype over that chain; beyond it,
    the difference entered in the one-run-only ops (a re-implemented module). The earliest
    of them in the module that holds them all is blamed (run B's when both runs have some).
    None when no such input differs beyond its bound or a difference is unknown.
    """
    assert c.a is not None and c.b is not None
    ops = (c.a, c.b)
    if c.a.phase == "backward" and is_regrouped_sum(
            c.a, c.b, views[0].ops, views[1].ops, views[0].only, views[1].only,
            views[1].partner_in_a):
        return None  # autograd added the same gradients in another grouping: judged by its result
    for position in range(min(len(c.a.inputs), len(c.b.inputs))):
        walks = [_one_run_producers(op, position, view.ops, view.only)
                 for op, view in zip(ops, views, strict=True)]
        if not any(w is None or w[0] for w in walks):
            continue  # both runs' producers are matched: the ordinary rules judge this input
        upstream = [_upstream_error(view, w[1]) if w is not None else None
                    for view, w in zip(views, walks, strict=True)]
        moved = _moved_positions(walks)
        if moved is not None:
            k, mover = moved
            return views[k].comparisons[mover.index], (
                f"input {position} of {c.a.id} is rearranged in run {'AB'[k]} only ({mover.name}: its "
                f"values moved to other positions, which statistics cannot see; no precision policy "
                f"moves a value)")
        if moves_only:
            continue
        if any(w is None for w in walks) or any(u is None for u in upstream):
            continue  # a chain too long to bound, or an input of it unknown: judged as before
        if c.a.phase == "backward" and not _made_from_shared_values(walks, views):
            # Not one quantity in the two runs: autograd grouped a gradient's sum otherwise (the
            # engine's order, not the program's); the op's outputs are judged. In forward, the
            # program computes the input: ops of one run only there are the program's own.
            continue
        sources = [op.inputs[position].source for op in ops]
        difference = _edge_error(views[0].side, views[1].side, c, position,
                                 (views[0].output_record(sources[0]), views[1].output_record(sources[1])))
        if difference is None:
            continue
        on_data = views[0].side.dump is not None and views[1].side.dump is not None
        rounding = sum(precision.rounding(_chain_precision(op.inputs[position], w[0]), _chain_terms(w[0]),
                                          floor=on_data)
                       for op, w in zip(ops, walks, strict=True) if w is not None)
        # Held below its dtype's normal range on the way (an fp16 matmul's gradient of 1e-9), a
        # value is rounded to subnormal spacings, up to flushed to zero: an absolute error.
        held = (_chain_precision(c.a.inputs[position], walks[0][0]),  # type: ignore[index]
                _chain_precision(c.b.inputs[position], walks[1][0]))  # type: ignore[index]
        underflow = precision.underflow_rounding(c.a.inputs[position], c.b.inputs[position], held)
        rounding += underflow
        changed = _changed_between_steps(ops, position, walks, carry)
        if changed is not None:
            return views[1].comparisons[changed.index], (
                f"input {position} of {c.a.id} is computed in run B from a value from outside the step "
                f"that run B's step before did not leave (run A's is what its step before left): it "
                f"changed between the steps")
        worst_upstream = max(u for u in upstream if u is not None)
        if carry.before and carry.explained and _reads_outside(ops, position, walks):
            worst_upstream = max(worst_upstream, carry.bound)  # state earlier steps explain
        if worst_upstream >= WHOLLY:
            continue  # the values upstream differ as much as they are large: nothing to bound
        # On statistics only: dumped values are measured element by element (differing_error),
        # which a whole tensor's difference upstream does not bound.
        faithful = None if on_data else _faithful_rounding(ops, position, walks, views)
        if faithful is not None:
            # Views, casts and scalings by a number carry a difference unamplified: what they
            # add is one rounding each, so the bound is that model's, with margin. Its floor is
            # one unit roundoff of the value's dtype: a difference below one rounding of what the
            # runs hold is no entry (a parameter all-gathered from shards another reduction order
            # updated differs from the single process's by less, and its matched start by 0).
            floor = max(precision.eps(_chain_precision(op.inputs[position], w[0])) / 2
                        for op, w in zip(ops, walks, strict=True) if w is not None)
            # A cast into fp16 of values below its normal range (a layer scale of 1e-6 times a
            # gradient) rounds each to subnormal spacings: an absolute error the relative model lacks.
            factor, rounding = FAITHFUL_MARGIN, FAITHFUL_MARGIN * (faithful + floor) + underflow
        else:
            factor = precision.CONDITION
        bound = factor * worst_upstream + rounding
        if difference <= bound:
            continue
        k = 1 if walks[1] and walks[1][0] else 0  # run B's re-implementation when both runs have some
        producers = walks[k][0]  # type: ignore[index]
        # An exact op (a view, a cast that widens) moves no value: the difference entered at one of
        # the others (a module's output scaled, then cast up to float32 for the loss outside it).
        suspects = [p for p in producers if precision.faithful_rounding(p) != 0.0] or producers
        module = common_module([p.module for p in suspects])
        blamed = next((p for p in suspects if p.module == module), suspects[0])
        names = ", ".join(sorted({p.name for p in producers}))
        message = (f"input {position} of {c.a.id} differs by {difference:.3g} (relative), beyond "
                   f"{factor:g} x the {worst_upstream:.3g} of the matched ops upstream + "
                   f"rounding {rounding:.3g} = {bound:.3g}: it was produced by ops that exist in run "
                   f"{'AB'[k]} only ({len(producers)} op(s): {names}, in {module or '<outside modules>'})")
        return views[k].comparisons[blamed.index], message
    return None


_MOVES_POSITIONS = frozenset({"roll", "flip", "fliplr", "flipud", "rot90"})
"""Ops whose result is their input's values at other positions (a mask shifted by one key): a
permutation, invisible to statistics, that no cast or layout change makes."""


def _moved_positions(walks: list[tuple[list[OpRecord], list[tuple[int, int]]] | None]
                     ) -> tuple[int, OpRecord] | None:
    """(run index, op) of the first op of one run only, in ``walks``, that moves a non-constant
    value's elements to other positions (None when none does). A forward op: backward moves a
    gradient back where its forward took it."""
    for k, walk in enumerate(walks):
        for op in walk[0] if walk is not None else ():
            if op.phase != "forward" or not op.inputs \
                    or precision.short_name(op.name) not in _MOVES_POSITIONS:
                continue
            stats = op.inputs[0].stats
            if stats is not None and stats.get("min") != stats.get("max"):
                return k, op
    return None


def _made_from_shared_values(walks: list[tuple[list[OpRecord], list[tuple[int, int]]] | None],
                             views: tuple[_RunView, _RunView]) -> bool:
    """Whether the two runs' values of one input are computed from a matched value in common: some
    matched output run B's value is read from, or made from by ops of its own (a walk's boundary),
    is the partner of one run A's is. Where they share none, the input position holds other
    quantities in the two runs, and nothing entered there: a sum grouped otherwise (a bf16 model's
    norm casts its input to fp32, so autograd sums the norm's gradients of that input before the
    cast back, and adds the residual's after, where the fp32 run adds the three in turn). True when
    either value comes from outside the step only, or its walk was too long (nothing to say)."""
    reached_a, reached_b = ({tuple(s[:2]) for s in walk[1]} if walk is not None else set() for walk in walks)
    if not reached_a or not reached_b:
        return True
    for index, position in reached_b:
        row = views[1].comparisons.get(index)
        if row is not None and row.a is not None and (row.a.index, position) in reached_a:
            return True
    return False


FAITHFUL_MARGIN = 2.0
"""How far beyond its error model a difference carried through views, casts and scalings may go
before it entered there: the model (the difference upstream plus one unit roundoff per rounding)
is a worst case, so healthy pairs sit at or below half the bound."""


def _faithful_rounding(ops: tuple[OpRecord, OpRecord], position: int,
                       walks: list[tuple[list[OpRecord], list[tuple[int, int]]] | None],
                       views: tuple[_RunView, _RunView]) -> float | None:
    """The rounding the one-run-only ops before input ``position`` add, when one run's are a
    path of :func:`precision.faithful_rounding` ops (views, casts, scalings by a number) from the
    very value the other run reads there: the matched op's output both runs start from, whose
    difference is measured. None otherwise (the general bound judges).

    Such a path changes nothing a correct program relies on but rounding (autocast's cast of an
    activation): a difference beyond it was made there, by a cast that lowers more than the
    other run's precision explains, or by a scaling the other run does not have."""
    sides = [k for k, walk in enumerate(walks) if walk is not None and walk[0]]
    if len(sides) != 1:
        return None  # both runs re-implement here: their ops are not one path of the other's value
    k = sides[0]
    producers = walks[k][0]  # type: ignore[index]
    other = ops[1 - k].inputs[position].source
    total, expected = 0.0, ops[k].inputs[position].source
    for op in reversed(producers):  # from the input back to the path's start
        if expected is None or op.index != expected[0]:
            return None  # a branch: not one path
        rounding = precision.faithful_rounding(op)
        if rounding is None:
            return None
        total += rounding
        expected = op.inputs[0].source
    if expected is None:
        # A tensor from outside the step: its two runs' values may be held in other dtypes by
        # design (a bf16 model's buffers, a weight autocast casts), a difference no matched op
        # measured here.
        return None
    matched = views[k].comparisons.get(expected[0])
    partner = (matched.a if k == 1 else matched.b) if matched is not None else None
    if partner is None or other is None or (partner.index, expected[1]) != tuple(other[:2]):
        return None
    return total


def _changed_between_steps(ops: tuple[OpRecord, OpRecord], position: int,
                           walks: list[tuple[list[OpRecord], list[tuple[int, int]]] | None],
                           carry: Carry) -> OpRecord | None:
    """Run B's op of its own (autocast's cast of a weight) that reads, for input ``position``, a
    value from outside the step that B's step before did not leave, where run A reads there a
    value its step before left: state changed between the steps in run B. None when none."""
    walk = walks[1]
    fa = _fingerprint(ops[0].inputs[position])
    if not carry.before or not carry.state_b or walk is None or fa is None or fa not in carry.state_a:
        return None
    for producer in walk[0]:
        for t in producer.inputs:
            key = _fingerprint(t) if t.source is None else None
            if key is not None and key not in carry.state_b:
                return producer
    return None


def _reads_outside(ops: tuple[OpRecord, OpRecord], position: int,
                   walks: list[tuple[list[OpRecord], list[tuple[int, int]]] | None]) -> bool:
    """Whether input ``position`` of either op is, or is computed by one-run-only ops from, a
    tensor from outside the step."""
    for op, walk in zip(ops, walks, strict=True):
        if op.inputs[position].source is None:
            return True
        if walk is not None and any(t.source is None for p in walk[0] for t in p.inputs):
            return True
    return False


def _chain_terms(producers: list[OpRecord]) -> int:
    """The roundings a chain of one run's ops makes in the value it ends in, as terms of one sum
    (``precision.rounding`` takes sqrt of them: roundings of random sign add as a random walk).

    Each op rounds once per term it sums (a contraction's, a sum's), amplified by its condition
    where it cancels (``precision.condition``: a bias gradient before a normalisation, zero in
    exact arithmetic); the value read rounds once more. A chain of plain ops counts one each.
    A compiled region's opaque op counts as one: the other run's chain of the ops it replaced is
    the model of what it computes."""
    terms = 1.0
    for op in producers:
        amplified = max(precision.condition(op), 1.0)
        terms += max(precision.contraction_terms(op), precision.summed_terms(op), 1) * amplified * amplified
    return int(min(terms, 2.0 ** 62))


def _chain_precision(record: TensorRecord, producers: list[OpRecord]) -> torch.dtype:
    """The lowest precision a value was held in on its way through ``producers`` to ``record``:
    a cast to bf16 and back rounds as bf16 even though both ends are fp32."""
    held = [_dtype(record)] + [d for op in producers
                               for d in (precision.input_precision(op), precision.output_precision(op))
                               if d is not None]
    return max(held, key=lambda d: torch.finfo(d).eps)


def _judge(side_a: _Side, side_b: _Side, comparisons: list[OpComparison],
           lowerings: dict[int, precision.Lowering], replay_limit: int = 0,
           carry: Carry | None = None) -> Carry:
    """Re-judges each op, in execution order, with the precision each run computed it in.

    Sets ``verdict``, ``rule`` and ``enters``: an op lowering precision unexplained is an
    error that enters there; a difference that the inputs' differences and each run's
    rounding explain is a warning; one they do not explain enters there (error); beyond
    the thresholds and downstream of a divergence, it is an error carried from it.
    ``carry`` is what the steps before hand to this one; returns what this step hands on.
    """
    # Runs folded from other layouts sum their sharded products in other orders: other kernels.
    rank = comparisons[0].rank if comparisons else 0
    runs = (side_a.run, side_b.run)
    carry = replace(carry or Carry(), same_kernels=all(run is not None and not isinstance(run, LogicalRun)
                                                       for run in runs)
                    and same_kernels(side_a.run, side_b.run, rank))
    identical, written, written_absolute = carry.identical, carry.bound, carry.absolute
    # Read by the exact regime's rule only, which a step begun outside that regime never enters.
    layout_unknown = (_layout_unknown(side_a.ops), _layout_unknown(side_b.ops)) \
        if carry.same_kernels and carry.identical else (set(), set())
    by_index = {c.a.index: c for c in comparisons if c.a is not None}
    views = (
        _RunView(side_a, {op.index: op for op in side_a.ops}, by_index,
                 {c.a.index for c in comparisons if c.a is not None and c.b is None
                  and c.match != MICRO_BATCHES}),
        _RunView(side_b, {op.index: op for op in side_b.ops},
                 {c.b.index: c for c in comparisons if c.b is not None},
                 {c.b.index for c in comparisons if c.b is not None and c.a is None
                  and c.match != MICRO_BATCHES}),
    )
    # Ops a divergence reached, by index in each run (through errors or warnings).
    reached_a: set[int] = set()
    reached_b: set[int] = set()
    routed = (Routed(side_a.ops), Routed(side_b.ops))
    recorded = (any(op.constants for op in side_a.ops), any(op.constants for op in side_b.ops))
    for c in comparisons:
        tainted = (c.a is not None and (_tainted(c, by_index) or _reads(c.a, reached_a))) \
            or (c.b is not None and _reads(c.b, reached_b))
        reads_unmatched = c.a is not None and c.b is not None \
            and (_reads(c.a, views[0].only) or _reads(c.b, views[1].only))
        if not tainted and _follows_routing(c, routed, lowerings):
            # Values one run moved to other positions are no routing's: they enter even here.
            moved = _entered_through_unmatched(c, views, carry, moves_only=True) if reads_unmatched else None
            if moved is not None:
                _blame_unmatched(*moved)
            continue
        if not tainted and reads_unmatched:
            entered = _entered_through_unmatched(c, views, carry)
            if entered is not None:
                _blame_unmatched(*entered)
                tainted = True
        regime = replace(carry, identical=identical)  # with the state the step before left
        _judge_op(side_a, side_b, c, by_index, lowerings, tainted, replay_limit, regime, layout_unknown)
        if not tainted:
            _judge_random_draw(c, routed, recorded) or _judge_routing_decision(side_a, side_b, c, routed)
        if tainted or c.verdict == ERROR:
            reached_a.update([c.a.index] if c.a is not None else [])
            reached_b.update([c.b.index] if c.b is not None else [])
        identical = identical and c.a is not None and c.b is not None and all(
            _alike(t, c.a.outputs[t.position], c.b.outputs[t.position]) for t in c.outputs)
        error, absolute = _written_error(c)
        written, written_absolute = max(written, error), max(written_absolute, absolute)
    explained = carry.explained and not any(c.enters for c in comparisons)
    return Carry(carry.before + 1, identical, explained, written, written_absolute,
                 _state_errors(comparisons, side_a), frozenset(_left_state(side_b.ops, kept=True)))


def _blame_unmatched(blamed: OpComparison, message: str) -> None:
    """Marks ``blamed``, an op of one run only, where a difference entered (rule unmatched producer)."""
    blamed.verdict, blamed.rule, blamed.enters = ERROR, RULE_UNMATCHED_PRODUCER, True
    blamed.message = f"{message}; {blamed.message}" if blamed.message else message


def _follows_routing(c: OpComparison, routed: tuple[Routed, Routed],
                     lowerings: dict[int, precision.Lowering]) -> bool:
    """Whether ``c`` is computed from a routing decision that differs between the runs, inside
    its scope (:mod:`probe.analysis.routing`): then no numeric bound judges it, its verdict is a
    warning (never a pass: its statistics may agree by permutation alone), the rule saying why,
    and what reads it is routed too. An op of one run only is marked routed and left as it is."""
    found = [r.reads(op) if op is not None else None for r, op in zip(routed, (c.a, c.b), strict=True)]
    decision = found[0] or found[1]
    if decision is None or (c.b is not None and c.b.index in lowerings):
        return False
    for r, op in zip(routed, (c.a, c.b), strict=True):
        if op is not None:
            r.follows(op, decision)
    if c.a is None or c.b is None or c.verdict == UNMATCHED:
        return True
    note = (f"computed from a routing that differs between the runs, consistent with precision: "
            f"no numeric bound (decided at {decision[1]}; within {decision[0] or '<outside modules>'})")
    c.verdict, c.rule, c.enters = WARNING, RULE_ROUTING, False
    c.message = f"{note}; {c.message}" if c.message else note
    for t in c.outputs:
        if t.verdict != NOT_COMPARED:  # data missing stays missing
            t.verdict, t.rule = WARNING, RULE_ROUTING
    c.verdict = worst([t.verdict for t in c.outputs] + [WARNING])
    return True


def _probability(op: OpRecord, recorded: bool) -> float | None:
    """The probability ``op`` was given (dropout's ``p``, attention's ``dropout_p``), from its
    recorded constants; its schema's default where the call left it out and its run recorded
    constants (``recorded``); None where unknown or it takes none."""
    found = probability_argument(op.name)
    if found is None:
        return None
    position, name, default = found
    value = op.constants.get(str(position), op.constants.get(name))
    if value is None:
        return default if recorded else None
    return value if isinstance(value, float) else None


def _judge_random_draw(c: OpComparison, routed: tuple[Routed, Routed], recorded: tuple[bool, bool]) -> bool:
    """Judges again an op drawing random numbers into another dtype in each run (``rand_like`` of
    scores that autocast made fp16: PhiMoE's jitter): the generator draws other numbers for each
    dtype, so no numeric bound relates them. A warning, its rule routing's, and what reads it
    inside its module is routed (:func:`_follows_routing`), never a pass. True when it was one."""
    if c.a is None or c.b is None or c.verdict == PASS \
            or c.rule in (RULE_LOWERED, RULE_OUTSIDE, RULE_ARGUMENTS) \
            or not (draws_random(c.a.name) and draws_random(c.b.name)) \
            or (_probability(c.a, recorded[0]) == 0.0 and _probability(c.b, recorded[1]) == 0.0):
        return False
    dtypes = [(ta.dtype, tb.dtype) for ta, tb in zip(c.a.outputs, c.b.outputs, strict=False)
              if ta.dtype != tb.dtype]
    if not dtypes:
        return False
    _decided(c, routed, f"random numbers drawn as {dtypes[0][0]} in run A and {dtypes[0][1]} in run B: "
                        f"the generator draws other numbers for each dtype, no numeric bound")
    return True


def _judge_routing_decision(side_a: _Side, side_b: _Side, c: OpComparison,
                            routed: tuple[Routed, Routed]) -> None:
    """Judges again an op making discrete results from real values (``topk``'s indices, a
    comparison) whose discrete results differ while nothing diverged upstream: when its real
    inputs differ at all, the routing differs, consistent with precision (a warning), and the
    ops computed from it are routed (:func:`_follows_routing`). An op that lowered precision,
    read an outside input or was called with other arguments keeps its verdict."""
    if c.a is None or c.b is None or c.rule in (RULE_LOWERED, RULE_OUTSIDE, RULE_ARGUMENTS) \
            or not (decides(c.a) and decides(c.b)):
        return
    # (A discrete result one run has no statistics of, a micro-batch's positions, is no evidence.)
    differing = [t for t in c.outputs if t.verdict not in (PASS, NOT_COMPARED)
                 and t.position < len(c.b.outputs)
                 and discrete(c.a.outputs[t.position]) and discrete(c.b.outputs[t.position])]
    if not differing:
        return
    inputs = _real_inputs_difference(side_a, side_b, c)
    if not inputs:  # unknown, or the same: a discrete result that differs is no rounding's
        return
    _decided(c, routed, f"routing differs, consistent with precision: real inputs differ by {inputs:.3g} "
                        f"(relative) and output(s) {', '.join(str(t.position) for t in differing)} "
                        f"(discrete) with them")


def _decided(c: OpComparison, routed: tuple[Routed, Routed], note: str) -> None:
    """Marks ``c`` a routing decision, a warning saying ``note``: what reads it inside its scope
    is routed (:func:`_follows_routing`)."""
    assert c.a is not None and c.b is not None
    c.verdict, c.rule, c.enters = WARNING, RULE_ROUTING, False
    c.message = f"{note}; {c.message}" if c.message else note
    for t in c.outputs:
        if t.verdict in (ERROR, WARNING):
            t.verdict, t.rule = WARNING, RULE_ROUTING
    routed[0].decided(c.a)
    routed[1].decided(c.b)


def _real_inputs_difference(side_a: _Side, side_b: _Side, c: OpComparison) -> float | None:
    """The largest difference of ``c``'s real (floating) inputs, with the rounding one run held
    them in and the other did not (None when one is unknown)."""
    assert c.a is not None and c.b is not None
    worst_error = 0.0
    for position, record in enumerate(c.a.inputs):
        if position >= len(c.b.inputs) or not record.floating:
            continue
        other = c.b.inputs[position]
        error = _sources_error(side_a, side_b, record, other)
        if error is None:
            return None
        worst_error = max(worst_error, error, _held_apart(side_a, side_b, record, other))
    return worst_error


def _state_errors(comparisons: list[OpComparison], side_a: _Side) -> dict[tuple, float | None]:
    """Run A's values left for the next step, each with its difference from run B's (None:
    not known, e.g. an op of run A only)."""
    by_index = {c.a.index: c for c in comparisons if c.a is not None}
    out: dict[tuple, float | None] = {}
    for key, (index, io, position) in _left_state(side_a.ops).items():
        c = by_index.get(index)
        error = None
        if c is not None and c.b is not None:
            records = (c.a.inputs, c.b.inputs) if io == "input" else (c.a.outputs, c.b.outputs)
            if position < len(records[1]):
                error = _stats_difference(records[0][position], records[1][position])
        out[key] = error
    return out


def _stats_difference(a: TensorRecord, b: TensorRecord) -> float | None:
    """Two records' statistics apart (``precision.stats_error``); None when either is unknown."""
    if a.stats is None or b.stats is None or a.numel != b.numel:
        return None
    return precision.stats_error(a.stats, b.stats, a.numel)


def _reads(op: OpRecord, indices: set[int]) -> bool:
    return any(t.source is not None and t.source[0] in indices for t in op.inputs)


def _judge_op(side_a: _Side, side_b: _Side, c: OpComparison, by_index: dict[int, OpComparison],
              lowerings: dict[int, precision.Lowering], tainted: bool, replay_limit: int,
              carry: Carry, layout_unknown: tuple[set[int], set[int]] = (set(), set())) -> None:
    """Sets ``c``'s verdict, rule and ``enters``; ``tainted``: an input comes from a divergence;
    ``carry``: the regime the runs are in at this op (:class:`Carry`); ``layout_unknown``: each
    run's ops whose results may be laid out as a tensor from outside the step (:func:`_layout_unknown`)."""
    if c.b is not None and c.b.index in lowerings:
        message = lowerings[c.b.index].message
        c.verdict, c.rule, c.enters = ERROR, RULE_LOWERED, True
        c.message = f"{message}; {c.message}" if c.message else message
        return
    if c.a is None or c.b is None or c.verdict in (NOT_COMPARED, UNMATCHED):
        return
    constants = None if tainted else _constants_differ(c)
    if constants is not None:
        c.verdict, c.rule, c.enters = ERROR, RULE_ARGUMENTS, True
        c.message = f"{constants}; {c.message}" if c.message else constants
        return
    carried: dict[int, float] = {}
    outside = [] if tainted else _external_inputs_differ(side_a, side_b, c, carry, carried)
    # A state changed between the steps is a fact about the value read, not a magnitude: an op
    # whose result stays within the thresholds (a bf16 model's transposed weight, one element of
    # it x1.125) still reads the corrupted weight first, and is where it enters.
    changed = any(CHANGED_BETWEEN_STEPS in m for m in outside)
    computed_otherwise = None if tainted or outside else _computed_otherwise(c, carry, layout_unknown)
    if computed_otherwise is not None:
        c.verdict, c.rule, c.enters = ERROR, RULE_ARGUMENTS, True
        c.message = f"{computed_otherwise}; {c.message}" if c.message else computed_otherwise
        return
    if c.verdict == PASS and not (outside and (carry.identical or changed)):
        if not tainted and not outside:  # a pass, and where the layouts summed in other orders, why
            _judge_reduction_order(side_a, side_b, c, by_index, replay_limit, carried)
        return
    magnitude = c.verdict
    if c.rule in (RULE_SHAPE, RULE_NONFINITE):
        c.enters = magnitude == ERROR and not tainted
        return
    if outside:
        c.verdict, c.rule, c.enters = ERROR, RULE_OUTSIDE, not tainted
        c.message = "; ".join([c.message, *outside] if c.message else outside)
        return
    otherwise = None if tainted else _called_otherwise(side_a, side_b, c)
    if otherwise is not None:
        c.verdict, c.rule, c.enters = ERROR, RULE_ARGUMENTS, True
        c.message = f"{otherwise}; {c.message}" if c.message else otherwise
        return
    if not tainted and _judge_reduction_order(side_a, side_b, c, by_index, replay_limit, carried):
        return
    unknown = None if tainted else _reads_unfolded(side_a, side_b, c)
    if unknown is not None:  # no bound follows from a value the fold does not know: never a verdict
        c.verdict, c.rule = NOT_COMPARED, RULE_NOT_COMPARED
        c.message = f"{unknown}; {c.message}" if c.message else unknown
        return
    # Downstream of a divergence a replay would only say where it grows: the cheap bound does.
    skipped = None if tainted else _replay_skipped(c, replay_limit)
    judged, rule = (None if tainted or skipped else _judge_by_replay(side_a, side_b, c)), RULE_REPLAY
    if judged is None:
        judged, rule = _judge_by_propagation(side_a, side_b, c, by_index, carried), RULE_PROPAGATION
        if judged is not None and skipped and _replayable(side_a, c.a) and _replayable(side_b, c.b):
            judged = (judged[0], f"{judged[1]} ({skipped})")
    if judged is None:  # an input unknown: the thresholds alone decide
        c.enters = magnitude == ERROR and not tainted
        return
    enters, note = judged
    if enters:
        c.verdict, c.rule, c.enters = ERROR, rule, True
    elif tainted and magnitude == ERROR:
        c.verdict, c.rule = ERROR, RULE_CARRIED
        note = f"carried from a divergence upstream ({note})"
    else:
        c.verdict, c.rule = WARNING, rule
    c.message = f"{note}; {c.message}" if c.message else note
    for t in c.outputs:  # consumers read their inputs' verdicts from here
        if t.verdict in (ERROR, WARNING):
            t.verdict, t.rule = c.verdict, c.rule


def _reads_unfolded(side_a: _Side, side_b: _Side, c: OpComparison) -> str | None:
    """Why ``c`` cannot be judged (None: it can): it reads a value a side folded from its
    micro-batches does not know (a gradient assembled from per-micro-batch parts)."""
    for side, op in ((side_a, c.a), (side_b, c.b)):
        if not side.folded or op is None:
            continue
        for position, t in enumerate(op.inputs):
            if t.source is not None and side.ops[t.source[0]].outputs[t.source[1]].skipped == NOT_FOLDED:
                return (f"input {position} is a value of the micro-batches the fold does not know "
                        f"({NOT_FOLDED})")
    return None


def _judge_reduction_order(side_a: _Side, side_b: _Side, c: OpComparison, by_index: dict[int, OpComparison],
                           replay_limit: int, carried: dict[int, float]) -> bool:
    """Judges an op whose sum the two layouts computed in other orders (a folded run's partial
    sums, ``probe.analysis.layouts.partial_sums``: TP's row-parallel product reduced by an
    all-reduce, where a single process ran one matmul): with both runs' dumps, by an fp64 replay
    on each run's (folded) inputs, each run's result held to the rounding bound of its own order
    (K terms in one sum; K / P in each of P partial sums, then P more); without them, by the
    propagation bound with those terms. When consistent, records it (rule "reduction order": a
    pass stays a pass, a difference beyond the thresholds is a warning) and returns True; else
    leaves the op to the other rules. Runs of one layout never get here."""
    assert c.a is not None and c.b is not None
    positions = range(min(len(c.a.outputs), len(c.b.outputs)))
    sides = (side_a, side_b)
    sums = tuple(side.partial_sums if side.folded else partial_sums(side.run, c.step) for side in sides)
    parts = [(sums[0].get((c.a.index, p), 1), sums[1].get((c.b.index, p), 1)) for p in positions]
    changed = [p for p, (pa, pb) in zip(positions, parts, strict=True) if pa != pb]
    if not changed:
        return False
    p = changed[0]
    total = max(precision.summation_terms(c.a, p), precision.summation_terms(c.b, p))
    split = [parts[p][k] for k in (0, 1)]
    terms = tuple(-(-total // n) + n - 1 for n in split)
    skipped = _replay_skipped(c, replay_limit)
    judged = None if skipped else _judge_by_replay(side_a, side_b, c, terms)  # type: ignore[arg-type]
    how = "fp64 replay on each run's inputs" if judged is not None else "statistics"
    if judged is None:
        judged = _judge_by_propagation(side_a, side_b, c, by_index, carried, terms)  # type: ignore[arg-type]
    if judged is None or judged[0]:
        return False
    orders = ", ".join(f"run {name} sums {total} terms in one" if n == 1 else
                       f"run {name} in {n} partial sums of {-(-total // n)}, then across "
                       f"{'micro-batches' if side.folded else 'ranks'} (rounding of {k} terms)"
                       for name, side, n, k in zip("AB", sides, split, terms, strict=True))
    note = f"consistent with a different reduction order ({how}): {orders}; {judged[1]}"
    c.rule = RULE_REDUCTION_ORDER
    if c.verdict != PASS:
        c.verdict = WARNING
        for t in c.outputs:
            if t.verdict in (ERROR, WARNING):
                t.verdict, t.rule = WARNING, RULE_REDUCTION_ORDER
    c.message = f"{note}; {c.message}" if c.message else note
    return True


def _divergence(run_a: Run, step: int, rank: int, comparisons: list[OpComparison]) -> Divergence | None:
    by_index = {c.a.index: c for c in comparisons if c.a is not None}
    for position, c in enumerate(comparisons):
        if not c.enters:
            continue
        assumed = _inputs_agree(c, by_index)[1] if c.a is not None else False
        start = c.a
        if start is None:  # entered through ops of run B only: follow run A from the next error
            start = next((later.a for later in comparisons[position + 1:]
                          if later.a is not None and later.verdict == ERROR), None)
        chain = _chain(start, by_index) if start is not None else []
        if c.a is None and c.b is not None:
            chain = [c.b.id, *chain]
        return Divergence(step, rank, c.a, c.b, c, assumed, chain)
    return None


def _micro_batch_rows(ops_a: list[OpRecord], ops_b: list[OpRecord], structure: MicroBatches, step: int,
                      rank: int, module_map: dict[str, str] | None) -> list[OpComparison]:
    """The rows of the micro-batches' ops: "not compared", with the reason. An op of run A is
    shown beside run B's op of its id (the first micro-batch's) for reading, not measured."""
    by_id = {mapped_id(op, module_map or {}): op for op in ops_b}
    rows = []
    for a in ops_a:
        b = by_id.pop(a.id, None)
        rows.append(OpComparison(step, rank, a, b, MICRO_BATCHES, NOT_COMPARED, structure.reason,
                                 rule=RULE_NOT_COMPARED))
    unpaired = {id(b) for b in by_id.values()}  # the later micro-batches', in run B's order
    rows += [OpComparison(step, rank, None, b, MICRO_BATCHES, NOT_COMPARED, structure.reason,
                          rule=RULE_NOT_COMPARED) for b in ops_b if id(b) in unpaired]
    return rows


def _fold_micro_batches(side_a: _Side, side_b: _Side, structure: MicroBatches,
                        module_map: dict[str, str]) -> bool:
    """Folds the side that took several micro-batches into one batch against the other's one
    (False: neither took one batch, or the micro-batches are laid out otherwise, and the
    micro-batches stay "not compared")."""
    def b_id(op: OpRecord) -> str:
        return mapped_id(op, module_map)
    try:
        if structure.calls_a == 1:
            side_b.fold(fold_micro_batches(side_b.ops, structure.calls_b, side_a.ops, b_id, lambda op: op.id))
        elif structure.calls_b == 1:
            side_a.fold(fold_micro_batches(side_a.ops, structure.calls_a, side_b.ops, lambda op: op.id, b_id))
        else:
            return False
    except Unfoldable:
        return False
    return True


@dataclass
class MatchedStep:
    """One step of one rank read, matched and measured but not judged yet: what a piece of work
    (``probe.analysis.compare_pieces``) hands back, in any process. The sides' runs are
    reattached where it is judged; ``folded`` are the logical steps a folded run's piece made,
    so that the judging process need not fold them again."""

    step: int
    rank: int
    sides: tuple[_Side, _Side]
    comparisons: list[OpComparison]
    lowerings: dict[int, precision.Lowering]
    policy: str
    folded: tuple[LogicalStep | None, LogicalStep | None] = (None, None)


def match_step(run_a: Run, run_b: Run, step: int, rank: int, module_map: dict[str, str] | None = None,
               on_op: Callable[[], None] | None = None) -> MatchedStep:
    """The part of :func:`compare_step` that reads this step alone: the ops matched and each
    pair measured, and the precision each run computed in."""
    side_a, side_b = _Side(run_a, step, rank), _Side(run_b, step, rank)
    structure = micro_batches(side_a.ops, side_b.ops, lambda module: rename_module(module, module_map or {}))
    comparisons: list[OpComparison] = []
    if structure is not None and _fold_micro_batches(side_a, side_b, structure, module_map or {}):
        structure = None  # folded: compared as two steps of one batch
    ops_a, ops_b = side_a.ops, side_b.ops
    if structure is not None:  # the micro-batches' forward and backward: not compared op for op
        end_a, end_b = accumulation_end(ops_a), accumulation_end(ops_b)
        comparisons = _micro_batch_rows(ops_a[:end_a], ops_b[:end_b], structure, step, rank, module_map)
        ops_a, ops_b = ops_a[end_a:], ops_b[end_b:]
        if on_op is not None:
            for _ in range(end_a):
                on_op()
    replayed = ((set(), set()) if side_a.folded or side_b.folded else replayed_ops(run_b, step, rank))
    matches = match_ops(ops_a, ops_b, module_map, *replayed)
    for m in matches:
        comparisons.append(_compare_pair(side_a, side_b, m, step, rank))
        if on_op is not None and m.a is not None:
            on_op()
    partner_of_b = {m.b.index: m.a for m in matches if m.a is not None and m.b is not None}
    lowerings = precision.lowered_precision(ops_a, ops_b, partner_of_b)
    # A compiled region whose graph was re-run node by node is judged at its nodes' ops.
    opened = opened_regions(run_b, step, rank)
    lowerings = {i: low for i, low in lowerings.items() if low.op.id not in opened}
    policy = precision.describe_policy(side_a.ops, side_b.ops)
    folded = tuple(run.logical_step(step) if isinstance(run, LogicalRun) else None for run in (run_a, run_b))
    return MatchedStep(step, rank, (side_a, side_b), comparisons, lowerings, policy, folded)


def judge_step(run_a: Run, matched: MatchedStep, replay_limit: int = REPLAY_LIMIT,
               carry: Carry | None = None) -> StepComparison:
    """Judges a matched step (:func:`match_step`) given what the steps before hand on (``carry``):
    the verdicts, the first divergence, and what this step hands to the next."""
    side_a, side_b = matched.sides
    step, rank, comparisons = matched.step, matched.rank, matched.comparisons
    handed_on = _judge(side_a, side_b, comparisons, matched.lowerings, replay_limit, carry)
    divergence = _divergence(run_a, step, rank, comparisons)
    return StepComparison(step, rank, comparisons, divergence, matched.policy, handed_on)


def compare_step(run_a: Run, run_b: Run, step: int, rank: int,
                 module_map: dict[str, str] | None = None,
                 on_op: Callable[[], None] | None = None,
                 replay_limit: int = REPLAY_LIMIT, carry: Carry | None = None) -> StepComparison:
    """Compares one step of one rank; ``carry``: what the steps compared before it hand on."""
    return judge_step(run_a, match_step(run_a, run_b, step, rank, module_map, on_op), replay_limit, carry)


def _unreadable_step(run_a: Run, run_b: Run, step: int, rank: int, reason: str) -> StepComparison:
    """A step one run (or both) cannot read: each op of a run that can is "not compared", with
    the reason (paired by id when both runs read their ops)."""
    why = {side: damage for side, run in (("A", run_a), ("B", run_b))
           if (damage := run.step_damage(step, rank)) is not None}
    message = "; ".join(f"run {side}: unreadable: {damage}" for side, damage in why.items()) or \
        f"unreadable: {reason}"
    rows = _rows_not_compared(run_a, run_b, step, rank, "not read", message)
    return StepComparison(step, rank, rows, None, unreadable=message)


def _apart_step(run_a: Run, run_b: Run, step: int, rank: int, apart: str) -> StepComparison:
    """A step after the runs' training parted (``StepComparison.apart``): each op "not compared"."""
    message = f"not compared: {apart}"
    return StepComparison(step, rank, _rows_not_compared(run_a, run_b, step, rank, "apart", message), None,
                          apart=apart)


def _rows_not_compared(run_a: Run, run_b: Run, step: int, rank: int, match: str,
                       message: str) -> list[OpComparison]:
    """A "not compared" row per op of each run that can read the step (paired by id where both can)."""
    ops: dict[str, list[OpRecord]] = {}
    for side, run in (("A", run_a), ("B", run_b)):
        try:
            ops[side] = run.ops(step, rank)
        except ProbeError:
            ops[side] = []
    by_id = {op.id: op for op in ops["B"]}
    pairs = [(a, by_id.pop(a.id, None)) for a in ops["A"]] + [(None, b) for b in by_id.values()]
    return [OpComparison(step, rank, a, b, match, NOT_COMPARED, message, rule=RULE_NOT_COMPARED)
            for a, b in pairs]


def _match_piece(spec_a: tuple[str, bool], spec_b: tuple[str, bool], partitions: dict[str, str | int] | None,
                 step: int, rank: int, module_map: dict[str, str] | None) -> MatchedStep | str:
    """A piece of a compare, run wherever the executor puts it: reopens both runs by path
    (``(path, folded)``) and matches one step, or says why the step cannot be read."""
    run_a, run_b = (LogicalRun(Run(path), partitions) if folded else Run(path)
                    for path, folded in (spec_a, spec_b))
    try:
        return match_step(run_a, run_b, step, rank, module_map)
    except ProbeError as e:
        return str(e)


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
        return _count(self.comparisons)

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
        """Whether a compared op (up to ``last_step``) draws random numbers: False only when
        every op is known not to (an op this process cannot resolve is not known)."""
        unknown = False
        for c in self.comparisons:
            for op in (c.a, c.b):
                if op is None or (last_step is not None and op.step > last_step):
                    continue
                random = draws_random(op.name)
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
            counts = _count([c for s in steps for c in s.comparisons])
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
    replay_limit: int = REPLAY_LIMIT, partitions: dict[str, str | int] | None = None,
    executor: Executor | None = None,
) -> Report:
    """Compare run ``b`` against the reference run ``a``; see the module docstring.

    ``progress(done, total)`` is called as ops of run A are compared. ``replay_limit``:
    ops whose inputs hold more elements (in either run) are judged by the propagation
    bound instead of an fp64 replay; 0 disables the replay. ``partitions``: for tensor
    parallelism written by hand (no DTensor), module (or glob) -> ``"colwise"``,
    ``"rowwise"`` or the weight's sharded dim, so that its shards fold into whole tensors
    (``probe.analysis.layouts.normalize_partitions``).

    The work splits into pieces of one step of one rank (one step of a folded run), see
    ``probe.analysis.compare_pieces``: ``processes=N`` runs them in N spawned processes
    (default: one per rank when ranks are compared one by one, else this process);
    ``executor``, any :class:`concurrent.futures.Executor` (a Dask cluster's:
    ``compare_pieces.cluster_executor``), runs them there, on workers that read the runs under
    the same paths. The report is the same wherever the pieces ran.
    """
    if type(replay_limit) is not int or replay_limit < 0:
        raise ProbeError(f"replay_limit must be a non-negative int, got {replay_limit!r}")
    run_a = a if isinstance(a, Run) else Run(a)
    run_b = b if isinstance(b, Run) else Run(b)
    # Runs over several ranks or with DTensor placements compare as logical ops (layouts.py).
    run_a, run_b = logical_pair(run_a, run_b, partitions)
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

    results = _compare_pieces(run_a, run_b, plan, module_map, replay_limit, partitions,
                              _workers(plan, processes), executor, sizes, advance)
    return Report(run_a.path, run_b.path, sorted(results, key=lambda s: (s.step, s.rank)), missing,
                  identity(run_a, run_b, _readable_plan(plan, results)),
                  compare_notes(run_a, run_b) + layout_notes(run_a, run_b))


def _workers(plan: dict[int, list[int]], processes: int | None) -> int:
    """How many processes compare the pieces: ``processes``, else one per rank when ranks are
    compared one by one (a folded run, one logical rank, stays in this process unless asked)."""
    if not processes:  # None (and 0, as before)
        return len(plan)
    if type(processes) is not int or processes < 0:
        raise ProbeError(f"processes must be a positive int, got {processes!r}")
    return processes


def _compare_pieces(run_a: Run, run_b: Run, plan: dict[int, list[int]], module_map: dict[str, str] | None,
                    replay_limit: int, partitions: dict[str, str | int] | None, workers: int,
                    executor: Executor | None, sizes: dict[tuple[int, int], int],
                    advance: Callable[[int], None]) -> list[StepComparison]:
    """Compares the plan (rank -> steps) as pieces of one step of one rank
    (``probe.analysis.compare_pieces``), matched wherever they run and judged here, per rank in
    step order as the pieces complete: each step is handed what the one before found
    (:class:`Carry`); a gap in the steps (a step one run lacks, or not asked for) or an
    unreadable step breaks the chain, and what the runs carry across it is judged as at a
    first step."""
    specs = tuple((str(run.path), isinstance(run, LogicalRun)) for run in (run_a, run_b))
    matched: dict[tuple[int, int], MatchedStep | str] = {}
    judged: dict[tuple[int, int], StepComparison] = {}
    next_of = dict.fromkeys(plan, 0)  # per rank, the position in its steps to judge next
    ran_here: set[tuple[int, int]] = set()  # pieces that advanced the progress op by op

    def here(piece: tuple[int, int]) -> MatchedStep | str:
        step, rank = piece
        ran_here.add(piece)
        try:
            return match_step(run_a, run_b, step, rank, module_map, advance)
        except ProbeError as e:
            return str(e)

    def judge_ready(rank: int) -> None:
        steps = plan[rank]
        while next_of[rank] < len(steps) and (steps[next_of[rank]], rank) in matched:
            i = next_of[rank]
            step = steps[i]
            earlier = judged.get((steps[i - 1], rank)) if i else None
            before = earlier if earlier is not None and steps[i - 1] == step - 1 else None
            carry = before.carry if before is not None and before.unreadable is None else None
            result = matched.pop((step, rank))
            if earlier is not None and earlier.apart is not None:  # the runs trained apart since
                judged[step, rank] = _apart_step(run_a, run_b, step, rank, earlier.apart)
            else:
                judged[step, rank] = _judged(run_a, run_b, result, step, rank, replay_limit, carry)
            next_of[rank] += 1

    def done(piece: tuple[int, int], result: MatchedStep | str) -> None:
        step, rank = piece
        if isinstance(result, MatchedStep):
            for run, folded in zip((run_a, run_b), result.folded, strict=True):
                if folded is not None:  # first: a folded run's dump is read through its fold
                    _adopt_folded(run, folded)
            for side, run in zip(result.sides, (run_a, run_b), strict=True):
                side.attach(run, step, rank)
        if piece not in ran_here:
            advance(sizes.get(piece, 0))
        matched[piece] = result
        judge_ready(rank)

    pieces = [(step, rank) for rank, steps in plan.items() for step in steps]
    run_pieces(pieces, here, _match_piece,
               lambda piece: (specs[0], specs[1], partitions, piece[0], piece[1], module_map),
               done, workers, executor)
    return list(judged.values())


def _judged(run_a: Run, run_b: Run, matched: MatchedStep | str, step: int, rank: int, replay_limit: int,
            carry: Carry | None) -> StepComparison:
    """A matched step judged, or one that could not be read (``matched`` is then the reason)."""
    if isinstance(matched, str):
        return _unreadable_step(run_a, run_b, step, rank, matched)
    try:
        judged = judge_step(run_a, matched, replay_limit, carry)
    except ProbeError as e:  # a damaged step: its ops are not compared, the other steps are
        return _unreadable_step(run_a, run_b, step, rank, str(e))
    skip = one_sided_skip((run_a, run_b), (matched.sides[0].ops, matched.sides[1].ops), step, rank)
    if skip is not None:
        side, origin, reason = skip
        not_compared_from(judged.comparisons, side, origin, reason)
        judged.divergence = _divergence(run_a, step, rank, judged.comparisons)
        judged.apart = f"{reason}, at step {step}"
    return judged


def _adopt_folded(run: Run, folded: LogicalStep) -> None:
    """Keeps a logical step folded in another process in this process's folded run, so that
    what reads it here (the replica findings of :func:`layout_notes`) does not fold it again.
    ``LogicalRun`` memoises its steps in ``_steps``; seeded from here rather than by a new
    method there while ``layouts.py`` is being changed by another line of work."""
    if isinstance(run, LogicalRun):
        run._steps.setdefault(folded.step, folded)


def _readable_plan(plan: dict[int, list[int]], results: list[StepComparison]) -> dict[int, list[int]]:
    """``plan`` without the steps that could not be read."""
    unread = {(s.step, s.rank) for s in results if s.unreadable is not None}
    return {rank: [s for s in steps if (s, rank) not in unread] for rank, steps in plan.items()}


def _op_count(run: Run, step: int, rank: int) -> int:
    """How many ops a step holds, from its manifest (no need to load them to size a progress bar)."""
    try:
        count = run.step_info(step, rank).manifest.get("ops")
        return count if type(count) is int and count >= 0 else len(run.ops(step, rank))
    except ProbeError:  # a damaged step: compared as "not compared" when its turn comes
        return 0
