"""Whether a difference enters at an op or is carried through it: an fp64 replay of the op on
each run's dumped inputs, else a bound on the propagation of its inputs' difference (their
condition and each run's rounding)."""

from __future__ import annotations

import math

import torch

from probe.analysis import precision
from probe.analysis.assembled import assembled_record
from probe.analysis.comparison_records import OpComparison, TensorComparison
from probe.analysis.judging.carried_state import stats_difference
from probe.analysis.overwrites import overwritten_inputs
from probe.analysis.replay import recompute
from probe.analysis.step_sides import (
    Side,
    compare_tensors,
    error_of,
    is_float_dtype,
    producer_output,
    record_dtype,
)
from probe.analysis.verdicts import ERROR, PASS, RULE_NONFINITE, RULE_SHAPE
from probe.errors import ProbeError
from probe.rundir.run import OpRecord, TensorRecord
from probe.rundir.tensor_layouts import STRIDED
from probe.rundir.written_parts import partial_write, written_parts
from probe.vocabulary.op_class import creates_uninitialized

REPLAY_LIMIT = 4_000_000
"""Default ``replay_limit``: inputs (elements) up to which an op is replayed in fp64 to judge it."""

def replayable(side: Side, op: OpRecord) -> bool:
    if side.dump is None or not op.outputs:
        return False
    for io, records in (("input", op.inputs), ("output", op.outputs)):
        for position in range(len(records)):
            entry = side.dump.entries.get((op.index, io, position))
            if entry is None or entry.status is not None or entry.layout != STRIDED:
                return False  # a sparse, nested or quantized tensor is compared by its values alone
    return True

def judge_by_replay(side_a: Side, side_b: Side, c: OpComparison,
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
    if not (replayable(side_a, c.a) and replayable(side_b, c.b)):
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
            computed = record_dtype(op.outputs[p])
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

def replay_skipped(c: OpComparison, replay_limit: int) -> str | None:
    """Why the replay of ``c`` is skipped for its size (None: it is not)."""
    assert c.a is not None and c.b is not None
    elements = max(sum(t.numel for t in c.a.inputs), sum(t.numel for t in c.b.inputs))
    if elements <= replay_limit:
        return None
    return (f"replay skipped: inputs of {elements} elements exceed replay_limit={replay_limit}"
            if replay_limit else "replay disabled (replay_limit=0)")

def producer_error(by_index: dict[int, OpComparison], source: tuple[int, int]) -> float | None:
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
            return error_of(t, producer.a.outputs[source[1]], producer.b.outputs[source[1]])
    return None

def measured_error(by_index: dict[int, OpComparison], source: tuple[int, int]) -> float | None:
    """The difference of a producer's output as its records measure it (None when unknown)."""
    producer = by_index.get(source[0])
    if producer is None or producer.a is None or producer.b is None or source[1] >= len(producer.b.outputs) \
            or source[1] >= len(producer.a.outputs):
        return None
    for t in producer.outputs:
        if t.position == source[1]:
            return error_of(t, producer.a.outputs[source[1]], producer.b.outputs[source[1]])
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
            found = max(found, measured_error(by_index, t.source) or 0.0,
                        _passed_on(by_index, t.source, depth + 1))
    return found

_PASSED_ON_DEPTH = 4
"""The most producers that passed on statistics walked up to the differences they carry."""

def _multiplies_tensors(op: OpRecord) -> bool:
    """Whether ``op`` multiplies (or divides) two tensors of more than one element each: ``mul``,
    ``div``, and the backward of a pointwise function (``silu_backward``, ``gelu_backward``,
    ``tanh_backward``: the gradient times the function's derivative at another tensor, element by
    element, one result per element of the gradient)."""
    tensors = [t for t in op.inputs if t.floating and math.prod(t.shape) > 1]
    if len(tensors) < 2:
        return False
    name = precision.short_name(op.name)
    if name in ("mul", "div"):
        return True
    return name.endswith("_backward") and bool(op.outputs) \
        and all(tuple(t.shape) == tuple(op.outputs[0].shape) for t in tensors)

def measured_input_error(side_a: Side, side_b: Side, c: OpComparison, position: int,
                 t: TensorComparison) -> float | None:
    """Input ``position``'s difference for the propagation bound: on data, over the elements
    that differ (a mask's fill would otherwise dilute it); else as :func:`error_of` says."""
    assert c.a is not None and c.b is not None
    if t.kind == "data":
        data_a, _ = side_a.data(c.a, "input", position)
        data_b, _ = side_b.data(c.b, "input", position)
        if data_a is not None and data_b is not None:
            return precision.differing_error(data_a, data_b)
    return error_of(t, c.a.inputs[position], c.b.inputs[position])

def _concentration(side_a: Side, side_b: Side, c: OpComparison, position: int) -> float:
    """The factor by which input ``position``'s difference, measured on the whole tensor, may
    be larger in the part ``c`` selects of it (:func:`precision.selection_gain`); 1 when both
    runs dumped that input, whose difference is then measured element by element."""
    assert c.a is not None and c.b is not None
    if position != 0:
        return 1.0
    if side_a.data(c.a, "input", 0)[0] is not None and side_b.data(c.b, "input", 0)[0] is not None:
        return 1.0
    return max(precision.selection_gain(c.a), precision.selection_gain(c.b))

def sources_error(side_a: Side, side_b: Side, a: TensorRecord, b: TensorRecord) -> float | None:
    """An input's difference from the statistics each run recorded for it, or else for the
    producer output it is (None when either is unknown)."""
    parts = [written_parts(side.ops, record) if record.stats is None and partial_write(side.ops, record)
             else None for side, record in ((side_a, a), (side_b, b))]
    if parts[0] is not None and parts[1] is not None and len(parts[0]) == len(parts[1]) \
            and all(x.shape == y.shape for x, y in zip(*parts, strict=True)):
        # A buffer written in place in parts alike in both runs: each element is one part's.
        errors = [stats_difference(x, y) for x, y in zip(*parts, strict=True)]
        return None if any(e is None for e in errors) else max(errors)  # type: ignore[type-var]
    found = []
    for side, record, written in ((side_a, a, parts[0]), (side_b, b, parts[1])):
        if written is not None:
            record = assembled_record(written, record) or record  # a buffer filled piece by piece
        elif record.stats is None:
            record = producer_output(side, record) or record
        found.append(record)
    return stats_difference(*found)

def _condition(side: Side, op: OpRecord) -> float:
    """``precision.condition`` of ``op`` in its run, an input computed in the step that has no
    statistics of its own (the stats mode records it as its producer's output; a view the tracer
    did not see made, of the same elements count) described by its producer's output: a key
    bias's gradient sums a view of a buffer ``copy_`` filled, and its cancellation is all there
    is to its rounding."""
    inputs = [record if record.stats is not None or (produced := producer_output(side, record)) is None
              or math.prod(produced.shape) != math.prod(record.shape) else produced
              for record in op.inputs]
    return precision.condition(op, inputs)

def _sketched(side_a: Side, side_b: Side, a: TensorRecord, b: TensorRecord) -> float:
    """How far an input's elements are apart in the two runs by their sketches (0 where either
    run took none): statistics understate differences of random sign, which rounding in another
    order makes, and a sum with cancellation shows them. An input computed in the step is
    described by its producer's output."""
    error = precision.sketch_error(_with_sketch(side_a, a), _with_sketch(side_b, b))
    return error if error is not None else 0.0

def _with_sketch(side: Side, record: TensorRecord) -> TensorRecord:
    """``record``, or where it has no sketch its producer's output (which describes an input
    computed in the step)."""
    return record if record.sketch is not None else producer_output(side, record) or record

def _sketched_once(side_a: Side, side_b: Side, a: TensorRecord, b: TensorRecord) -> str | None:
    """The run ("A" or "B") whose sketch alone describes an input (the other joined the value
    from parts); None where both runs' do, or neither's."""
    in_a, in_b = (_with_sketch(side, t).sketch is not None for side, t in ((side_a, a), (side_b, b)))
    return None if in_a == in_b else "A" if in_a else "B"

def elements_apart(comparisons: list[OpComparison]) -> float:
    """How far apart, element by element, the state a step reads is: the largest distance the
    sketches of its inputs from outside the step measure, in forward and backward (0 where the
    runs took no sketches). Every value computed in the step from that state may be that far
    apart, whatever its statistics say."""
    apart = 0.0
    for c in comparisons:
        if c.a is None or c.b is None or c.a.phase == "optimizer":
            continue
        for a, b in zip(c.a.inputs, c.b.inputs, strict=False):
            if a.source is None and b.source is None and a.sketch is not None and b.sketch is not None:
                error = precision.sketch_error(a, b)
                if error is not None and math.isfinite(error):
                    apart = max(apart, error)
    return apart

def unmeasured_elements(side_a: Side, side_b: Side, c: OpComparison) -> str | None:
    """Why ``c``'s difference beyond the propagation bound is no verdict (None: it is one): the op
    cancels (its condition beyond ``CONDITION``: a difference of random signs, which statistics
    understate, shows in its result) and an input computed in the step has a sketch in one run
    only, so its element-wise difference is not measured: a value the other run joined from parts
    (micro-batches concatenated, ranks' shards) whose sketches do not join, the sign pattern being
    the position's in the whole tensor."""
    assert c.a is not None and c.b is not None
    cancellation = max(_condition(side_a, c.a), _condition(side_b, c.b))
    if cancellation <= precision.CONDITION:
        return None
    for position, (a, b) in enumerate(zip(c.a.inputs, c.b.inputs, strict=False)):
        if a.source is None or b.source is None:
            continue
        sketched_in = _sketched_once(side_a, side_b, a, b)
        if sketched_in is not None:
            return (f"input {position} has a sketch in run {sketched_in} only (a value joined from "
                    f"parts, whose sketches do not join): its element-wise difference, which this op's "
                    f"cancellation (x{cancellation:.3g}) shows and its statistics understate, is not "
                    "measured")
    return None

def _sketches_taken(c: OpComparison) -> bool:
    """Whether both runs took sketches of this op's values (then a 0 from them is a measure)."""
    assert c.a is not None and c.b is not None
    return any(t.sketch is not None for t in c.a.outputs) and any(t.sketch is not None for t in c.b.outputs)

def held_apart(side_a: Side, side_b: Side, a: TensorRecord, b: TensorRecord) -> float:
    """The rounding one run's value of an input passed through and the other's did not (0 when
    none): a value held in bf16 in run B on its way here differs from run A's element by element
    by up to bf16's rounding, which its statistics average away."""
    held = []
    for side, record in ((side_a, a), (side_b, b)):
        dtype = record_dtype(record) if is_float_dtype(record.dtype) else torch.float64
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

def judge_by_propagation(side_a: Side, side_b: Side, c: OpComparison,
                          by_index: dict[int, OpComparison],
                          carried: dict[int, float] | None = None,
                          terms: tuple[int, int] | None = None,
                          unmeasured: float = 0.0) -> tuple[bool, str] | None:
    """(enters, message) from the inputs' difference: beyond ``CONDITION`` x it plus each run's
    rounding, the difference enters here. None when an input computed in the step is unknown.
    ``carried``: the differences of inputs from outside the step that earlier steps explain
    (input position -> relative difference). ``terms``: each run's terms for its rounding, as
    :func:`judge_by_replay` takes them. ``unmeasured``: the element-wise difference of the state
    the step reads (:func:`elements_apart`), at least what an input computed in the step differs
    by where a sketch measured it in one run only (a value a fold joined from parts)."""
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
        error = measured_input_error(side_a, side_b, c, position, t)
        if error is not None and t.kind != "data":
            error *= _concentration(side_a, side_b, c, position)
            if summed:
                error = max(error, _passed_on(by_index, record.source))
        if error is None and record.source is not None and not partial_write(side_a.ops, record):
            error = producer_error(by_index, record.source)  # nothing in its record: its producer's
        if error is None:  # producers that were not matched: their outputs, as each run recorded them
            error = sources_error(side_a, side_b, record, c.b.inputs[position])
        if error is None:
            return None
        floor = held_apart(side_a, side_b, record, c.b.inputs[position])
        sketched = max(sketched, _sketched(side_a, side_b, record, c.b.inputs[position]))
        if unmeasured and _sketched_once(side_a, side_b, record, c.b.inputs[position]) is not None:
            # Statistics understate a difference of random signs; the state the value was computed
            # from is that far apart element by element.
            floor = max(floor, unmeasured)
        in_error = max(in_error, error, floor, sketched)
    out_error, out_dtypes, underflow = 0.0, (torch.float64, torch.float64), 0.0
    primary = precision.primary_outputs(c.a)
    for t in c.outputs:
        if t.position >= primary:
            continue  # statistics the op keeps for its backward: its result and gradients tell
        error = error_of(t, c.a.outputs[t.position], c.b.outputs[t.position])
        if t.kind == "data":  # measured as the inputs are (a sparse gradient's rms is no scale)
            data_a, _ = side_a.data(c.a, "output", t.position)
            data_b, _ = side_b.data(c.b, "output", t.position)
            if data_a is not None and data_b is not None:
                error = precision.differing_error(data_a, data_b)
        if error is None:
            return None
        if error >= out_error:
            out_error = error
            out_dtypes = (record_dtype(c.a.outputs[t.position]), record_dtype(c.b.outputs[t.position]))
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

WHOLLY = 1.0
"""An input difference (relative) at which the runs' values are no longer each other's
approximations (a gradient of a near-zero quantity in a bf16 model): from it no bound
follows, and an op downstream is not where a divergence enters."""
