"""Discrete choices (a router's top-k, a random draw): ops that decide by comparing values within
precision, and the ops that follow what they chose."""

from __future__ import annotations

from probe.analysis import precision
from probe.analysis.comparison_records import OpComparison
from probe.analysis.judging.propagation import held_apart, sources_error
from probe.analysis.random_draws import draws
from probe.analysis.routing import Routed, decides, discrete
from probe.analysis.step_sides import Side
from probe.analysis.verdicts import (
    ERROR,
    NOT_COMPARED,
    PASS,
    RULE_ARGUMENTS,
    RULE_LOWERED,
    RULE_OUTSIDE,
    RULE_ROUTING,
    UNMATCHED,
    WARNING,
    worst,
)
from probe.vocabulary.op_class import draws_random


def follows_routing(c: OpComparison, routed: tuple[Routed, Routed],
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

def judge_random_draw(c: OpComparison, routed: tuple[Routed, Routed], recorded: tuple[bool, bool]) -> bool:
    """Judges again an op drawing random numbers into another dtype in each run (``rand_like`` of
    scores that autocast made fp16: PhiMoE's jitter): the generator draws other numbers for each
    dtype, so no numeric bound relates them. A warning, its rule routing's, and what reads it
    inside its module is routed (:func:`follows_routing`), never a pass. True when it was one."""
    if c.a is None or c.b is None or c.verdict == PASS \
            or c.rule in (RULE_LOWERED, RULE_OUTSIDE, RULE_ARGUMENTS) \
            or not (draws_random(c.a.name) and draws_random(c.b.name)) \
            or not (draws(c.a, recorded[0]) or draws(c.b, recorded[1])):  # both given 0: no draw
        return False
    dtypes = [(ta.dtype, tb.dtype) for ta, tb in zip(c.a.outputs, c.b.outputs, strict=False)
              if ta.dtype != tb.dtype]
    if not dtypes:
        return False
    _decided(c, routed, f"random numbers drawn as {dtypes[0][0]} in run A and {dtypes[0][1]} in run B: "
                        f"the generator draws other numbers for each dtype, no numeric bound")
    return True

def judge_routing_decision(side_a: Side, side_b: Side, c: OpComparison,
                            routed: tuple[Routed, Routed]) -> None:
    """Judges again an op making discrete results from real values (``topk``'s indices, a
    comparison) whose discrete results differ while nothing diverged upstream: when its real
    inputs differ at all, the routing differs, consistent with precision (a warning), and the
    ops computed from it are routed (:func:`follows_routing`). An op that lowered precision,
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
    is routed (:func:`follows_routing`)."""
    assert c.a is not None and c.b is not None
    c.verdict, c.rule, c.enters = WARNING, RULE_ROUTING, False
    c.message = f"{note}; {c.message}" if c.message else note
    for t in c.outputs:
        if t.verdict in (ERROR, WARNING):
            t.verdict, t.rule = WARNING, RULE_ROUTING
    routed[0].decided(c.a)
    routed[1].decided(c.b)

def _real_inputs_difference(side_a: Side, side_b: Side, c: OpComparison) -> float | None:
    """The largest difference of ``c``'s real (floating) inputs, with the rounding one run held
    them in and the other did not (None when one is unknown)."""
    assert c.a is not None and c.b is not None
    worst_error = 0.0
    for position, record in enumerate(c.a.inputs):
        if position >= len(c.b.inputs) or not record.floating:
            continue
        other = c.b.inputs[position]
        error = sources_error(side_a, side_b, record, other)
        if error is None:
            return None
        worst_error = max(worst_error, error, held_apart(side_a, side_b, record, other))
    return worst_error
