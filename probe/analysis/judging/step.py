"""A matched step judged op by op in execution order: the verdicts, where a divergence enters,
and the first divergence with its chain."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from probe.analysis import precision
from probe.analysis.comparison_records import Carry, Divergence, OpComparison, StepComparison
from probe.analysis.judging.arguments import called_otherwise, constants_differ
from probe.analysis.judging.boundaries import RunView, entered_through_unmatched
from probe.analysis.judging.carried_state import (
    CHANGED_BETWEEN_STEPS,
    differs_on_identical_inputs,
    external_inputs_differ,
    layouts_unknown,
    left_state,
    measured_alike,
    state_errors,
    written_error,
)
from probe.analysis.judging.propagation import (
    REPLAY_LIMIT,
    elements_apart,
    judge_by_propagation,
    judge_by_replay,
    replay_skipped,
    replayable,
    unmeasured_elements,
)
from probe.analysis.judging.routing_decisions import (
    follows_routing,
    judge_random_draw,
    judge_routing_decision,
)
from probe.analysis.layouts import LogicalRun, partial_sums
from probe.analysis.matching import MICRO_BATCHES
from probe.analysis.micro_batches import NOT_FOLDED
from probe.analysis.random_draws import records_constants
from probe.analysis.routing import Routed
from probe.analysis.run_identity import same_kernels
from probe.analysis.scaler_skips import not_compared_from, one_sided_skip
from probe.analysis.step_sides import MatchedStep, Side
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
    RULE_SHAPE,
    RULE_UNMATCHED_PRODUCER,
    UNMATCHED,
    WARNING,
)
from probe.rundir.run import OpRecord, Run


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

def _judge(side_a: Side, side_b: Side, comparisons: list[OpComparison],
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
                    and same_kernels(side_a.run, side_b.run, rank),
                    elements_apart=elements_apart(comparisons))
    identical, written, written_absolute = carry.identical, carry.bound, carry.absolute
    # Read by the exact regime's rule only, which a step begun outside that regime never enters.
    layout_unknown = (layouts_unknown(side_a.ops), layouts_unknown(side_b.ops)) \
        if carry.same_kernels and carry.identical else (set(), set())
    by_index = {c.a.index: c for c in comparisons if c.a is not None}
    views = (
        RunView(side_a, {op.index: op for op in side_a.ops}, by_index,
                 {c.a.index for c in comparisons if c.a is not None and c.b is None
                  and c.match != MICRO_BATCHES}),
        RunView(side_b, {op.index: op for op in side_b.ops},
                 {c.b.index: c for c in comparisons if c.b is not None},
                 {c.b.index for c in comparisons if c.b is not None and c.a is None
                  and c.match != MICRO_BATCHES}),
    )
    # Ops a divergence reached, by index in each run (through errors or warnings).
    reached_a: set[int] = set()
    reached_b: set[int] = set()
    routed = (Routed(side_a.ops), Routed(side_b.ops))
    recorded = (records_constants(side_a.ops), records_constants(side_b.ops))
    for c in comparisons:
        tainted = (c.a is not None and (_tainted(c, by_index) or _reads(c.a, reached_a))) \
            or (c.b is not None and _reads(c.b, reached_b))
        reads_unmatched = c.a is not None and c.b is not None \
            and (_reads(c.a, views[0].only) or _reads(c.b, views[1].only))
        if not tainted and follows_routing(c, routed, lowerings):
            # Values one run moved to other positions are no routing's: they enter even here.
            moved = entered_through_unmatched(c, views, carry, moves_only=True) if reads_unmatched else None
            if moved is not None:
                _blame_unmatched(*moved)
            continue
        if not tainted and reads_unmatched:
            entered = entered_through_unmatched(c, views, carry)
            if entered is not None:
                _blame_unmatched(*entered)
                tainted = True
        regime = replace(carry, identical=identical)  # with the state the step before left
        _judge_op(side_a, side_b, c, by_index, lowerings, tainted, replay_limit, regime, layout_unknown)
        if not tainted:
            judge_random_draw(c, routed, recorded) or judge_routing_decision(side_a, side_b, c, routed)
        if tainted or c.verdict == ERROR:
            reached_a.update([c.a.index] if c.a is not None else [])
            reached_b.update([c.b.index] if c.b is not None else [])
        identical = identical and c.a is not None and c.b is not None and all(
            measured_alike(t, c.a.outputs[t.position], c.b.outputs[t.position]) for t in c.outputs)
        error, absolute = written_error(c)
        written, written_absolute = max(written, error), max(written_absolute, absolute)
    explained = carry.explained and not any(c.enters for c in comparisons)
    return Carry(carry.before + 1, identical, explained, written, written_absolute,
                 state_errors(comparisons, side_a), frozenset(left_state(side_b.ops, kept=True)))

def _blame_unmatched(blamed: OpComparison, message: str) -> None:
    """Marks ``blamed``, an op of one run only, where a difference entered (rule unmatched producer)."""
    blamed.verdict, blamed.rule, blamed.enters = ERROR, RULE_UNMATCHED_PRODUCER, True
    blamed.message = f"{message}; {blamed.message}" if blamed.message else message

def _reads(op: OpRecord, indices: set[int]) -> bool:
    return any(t.source is not None and t.source[0] in indices for t in op.inputs)

def _judge_op(side_a: Side, side_b: Side, c: OpComparison, by_index: dict[int, OpComparison],
              lowerings: dict[int, precision.Lowering], tainted: bool, replay_limit: int,
              carry: Carry, layout_unknown: tuple[set[int], set[int]] = (set(), set())) -> None:
    """Sets ``c``'s verdict, rule and ``enters``; ``tainted``: an input comes from a divergence;
    ``carry``: the regime the runs are in at this op (:class:`Carry`); ``layout_unknown``: each
    run's ops whose results may be laid out as a tensor from outside the step (:func:`layouts_unknown`)."""
    if c.b is not None and c.b.index in lowerings:
        message = lowerings[c.b.index].message
        c.verdict, c.rule, c.enters = ERROR, RULE_LOWERED, True
        c.message = f"{message}; {c.message}" if c.message else message
        return
    if c.a is None or c.b is None or c.verdict in (NOT_COMPARED, UNMATCHED):
        return
    constants = None if tainted else constants_differ(c)
    if constants is not None:
        c.verdict, c.rule, c.enters = ERROR, RULE_ARGUMENTS, True
        c.message = f"{constants}; {c.message}" if c.message else constants
        return
    carried: dict[int, float] = {}
    outside = [] if tainted else external_inputs_differ(side_a, side_b, c, carry, carried)
    # A state changed between the steps is a fact about the value read, not a magnitude: an op
    # whose result stays within the thresholds (a bf16 model's transposed weight, one element of
    # it x1.125) still reads the corrupted weight first, and is where it enters.
    changed = any(CHANGED_BETWEEN_STEPS in m for m in outside)
    computed_otherwise = None if tainted or outside else differs_on_identical_inputs(c, carry, layout_unknown)
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
    otherwise = None if tainted else called_otherwise(side_a, side_b, c)
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
    skipped = None if tainted else replay_skipped(c, replay_limit)
    judged, rule = (None if tainted or skipped else judge_by_replay(side_a, side_b, c)), RULE_REPLAY
    if judged is None:
        judged, rule = judge_by_propagation(side_a, side_b, c, by_index, carried,
                                            unmeasured=carry.elements_apart), RULE_PROPAGATION
        if judged is not None and skipped and replayable(side_a, c.a) and replayable(side_b, c.b):
            judged = (judged[0], f"{judged[1]} ({skipped})")
    if judged is None:  # an input unknown: the thresholds alone decide
        c.enters = magnitude == ERROR and not tainted
        return
    enters, note = judged
    unmeasured = unmeasured_elements(side_a, side_b, c) if enters and rule == RULE_PROPAGATION else None
    if unmeasured is not None:  # a bound from statistics the cancellation makes no measure of
        c.verdict, c.rule = NOT_COMPARED, RULE_NOT_COMPARED
        c.message = f"{unmeasured} ({note}); {c.message}" if c.message else f"{unmeasured} ({note})"
        return
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

def _reads_unfolded(side_a: Side, side_b: Side, c: OpComparison) -> str | None:
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

def _judge_reduction_order(side_a: Side, side_b: Side, c: OpComparison, by_index: dict[int, OpComparison],
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
    skipped = replay_skipped(c, replay_limit)
    judged = None if skipped else judge_by_replay(side_a, side_b, c, terms)  # type: ignore[arg-type]
    how = "fp64 replay on each run's inputs" if judged is not None else "statistics"
    if judged is None:
        judged = judge_by_propagation(side_a, side_b, c, by_index, carried, terms)  # type: ignore[arg-type]
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

def step_divergence(run_a: Run, step: int, rank: int, comparisons: list[OpComparison]) -> Divergence | None:
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

def judge_step(run_a: Run, matched: MatchedStep, replay_limit: int = REPLAY_LIMIT,
               carry: Carry | None = None) -> StepComparison:
    """Judges a matched step (:func:`match_step`) given what the steps before hand on (``carry``):
    the verdicts, the first divergence, and what this step hands to the next."""
    side_a, side_b = matched.sides
    step, rank, comparisons = matched.step, matched.rank, matched.comparisons
    handed_on = _judge(side_a, side_b, comparisons, matched.lowerings, replay_limit, carry)
    # Where one run's loss scaler skipped the step, the runs part at its overflow: not compared on.
    skip = one_sided_skip((side_a.run, side_b.run), (side_a.ops, side_b.ops), step, rank)
    if skip is not None:
        not_compared_from(comparisons, *skip)
    divergence = step_divergence(run_a, step, rank, comparisons)
    return StepComparison(step, rank, comparisons, divergence, matched.policy, handed_on,
                          apart=None if skip is None else skip[2])
