"""Values made by ops of one run only (an insertion, or two decompositions of a module call, a
black box): their difference judged where a paired op reads them, against the difference
upstream and the rounding of the one-run-only chain."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.analysis import precision
from probe.analysis.comparison_records import Carry, OpComparison
from probe.analysis.judging.carried_state import fingerprint, stats_difference
from probe.analysis.judging.propagation import (
    WHOLLY,
    measured_error,
    measured_input_error,
    producer_error,
    sources_error,
)
from probe.analysis.module_graph import common_module
from probe.analysis.regrouped_sums import is_regrouped_sum
from probe.analysis.step_sides import Side, compare_tensors, record_dtype
from probe.analysis.verdicts import ERROR, RULE_NONFINITE, RULE_SHAPE
from probe.rundir.run import OpRecord, TensorRecord
from probe.rundir.written_parts import partial_write, written_part_sources


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

def _edge_error(side_a: Side, side_b: Side, c: OpComparison, position: int,
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
    error = measured_input_error(side_a, side_b, c, position, t)
    ra, rb = records
    if error is None and ra is not None and rb is not None:
        error = stats_difference(ra, rb)
    if error is None:
        error = sources_error(side_a, side_b, c.a.inputs[position], c.b.inputs[position])
    return error

@dataclass
class RunView:
    """One run's side of a step as the unmatched-producer rule walks it."""

    side: Side
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

def _upstream_error(view: RunView, boundary: list[tuple[int, int]]) -> float | None:
    """The largest difference of the matched outputs at ``boundary`` (None: one is unknown).

    An output within the thresholds is measured too: its difference is the one the ops of one
    run carry on, and a bound needs its size, not only that it is small."""
    upstream = 0.0
    for source in boundary:
        error = producer_error(view.comparisons, source)
        if error is None:
            error = measured_error(view.comparisons, source)
        if error is None:
            return None
        upstream = max(upstream, error)
    return upstream

def entered_through_unmatched(c: OpComparison, views: tuple[RunView, RunView], carry: Carry,
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
                             views: tuple[RunView, RunView]) -> bool:
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
                       views: tuple[RunView, RunView]) -> float | None:
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
    fa = fingerprint(ops[0].inputs[position])
    if not carry.before or not carry.state_b or walk is None or fa is None or fa not in carry.state_a:
        return None
    for producer in walk[0]:
        for t in producer.inputs:
            key = fingerprint(t) if t.source is None else None
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
    held = [record_dtype(record)] + [d for op in producers
                               for d in (precision.input_precision(op), precision.output_precision(op))
                               if d is not None]
    return max(held, key=lambda d: torch.finfo(d).eps)
