"""What the runs carry from step to step: the values a step leaves, inputs from outside the step
that differ beyond what the steps before explain, and the exact regime's rule for ops on
identical inputs."""

from __future__ import annotations

import math

from probe.analysis import precision
from probe.analysis.comparison_records import Carry, OpComparison, TensorComparison
from probe.analysis.overwrites import overwritten_inputs
from probe.analysis.step_sides import Side, compare_tensors, error_of, record_dtype
from probe.analysis.verdicts import ERROR, NOT_COMPARED, WARNING
from probe.rundir.rank_origin import is_collective
from probe.rundir.run import OpRecord, TensorRecord
from probe.vocabulary.op_class import creates_uninitialized, returns_view


def fingerprint(record: TensorRecord) -> tuple | None:
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

def left_state(ops: list[OpRecord], kept: bool = False) -> dict[tuple, tuple[int, str, int]]:
    """The values a step leaves for the next (fingerprint -> where: op index, io, position);
    ``kept``: with every value forward made (see :func:`_leaves_state`)."""
    found: dict[tuple, tuple[int, str, int]] = {}
    for op in ops:
        for position, t in enumerate(op.inputs):
            if t.source is None and (key := fingerprint(t)) is not None:
                found[key] = (op.index, "input", position)
        for position, t in enumerate(op.outputs):
            if _leaves_state(op, t, kept) and (key := fingerprint(t)) is not None:
                found[key] = (op.index, "output", position)
    return found

def layouts_unknown(ops: list[OpRecord]) -> set[int]:
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
    dimensions: it is one, or a result :func:`layouts_unknown` found in ``unknown``."""
    return (t.source is None and len(t.shape) >= 2) or (t.source is not None and t.source[0] in unknown)

def differs_on_identical_inputs(c: OpComparison, carry: Carry,
                        layout_unknown: tuple[set[int], set[int]]) -> str | None:
    """Why ``c`` computed something else than run A's op (None: it did not, or it cannot be told):
    the runs computed alike bit for bit up to here (``carry.identical``: its inputs are too) with
    the same kernels (``carry.same_kernels``), so the same call gives the same results; these
    differ, so the call was another (an eps, a scale) or its code was. Found from statistics, where
    :func:`called_otherwise` needs both runs' dumps; an op returning memory nothing wrote
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
                 and not measured_alike(t, c.a.outputs[t.position], c.b.outputs[t.position])]
    if not differing:
        return None
    return (f"the runs computed alike bit for bit up to here with the same kernels (versions, devices, "
            f"settings and threads), so its inputs are identical, and its output(s) "
            f"{', '.join(map(str, differing))} differ: it computed something else (other arguments "
            f"or code)")

CHANGED_BETWEEN_STEPS = "it changed between the steps"
"""How an input is described that run B's step before did not leave where run A's did."""

def external_inputs_differ(side_a: Side, side_b: Side, c: OpComparison, carry: Carry,
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
            if not measured_alike(t, record, other) and (record.dtype == other.dtype or beyond_thresholds):
                why = t.message or ("its statistics differ" if not _stats_alike(record, other, sketches=False)
                                    else "its elements differ (its sketches), its statistics do not")
                differ.append(f"input {position} (from outside the step) differs while the runs computed "
                              f"alike bit for bit up to here: {why}")
            continue
        error = error_of(t, record, other)
        fa, fb = fingerprint(record), fingerprint(other)
        if carry.before and fa is not None and fa in carry.state_a:  # state run A carries over
            if fb is not None and carry.state_b and fb not in carry.state_b:
                differ.append(f"input {position} (from outside the step) holds in run B a value its step "
                              f"before did not leave: {CHANGED_BETWEEN_STEPS}")
                continue
            known = carry.state_a[fa]
            if error is not None and known is not None and error <= known * (1 + 1e-6) + 1e-12:
                carried[position] = _selected_state(c, t, position, error, carry)
                continue
        lower = precision.lower_of(record_dtype(record), record_dtype(other))
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

SUM_ROUNDING = 1e-12
"""How far (relative) two statistics sums of the same values may differ: fp64 sums taken in
another order (another thread count) round differently."""

def measured_alike(t: TensorComparison, a: TensorRecord, b: TensorRecord) -> bool:
    """Whether a compared tensor pair is bit-identical as far as the runs recorded it: equal
    data, or equal statistics (their fp64 sums up to their own rounding)."""
    if t.kind == "data":
        return t.metrics.get("max_abs_err") == 0 and not t.metrics.get("nonfinite_mismatch")
    return _stats_alike(a, b)

def _stats_alike(a: TensorRecord, b: TensorRecord, sketches: bool = True) -> bool:
    """Whether two records are of one dtype and shape with equal statistics (their fp64 sums up
    to their own rounding) and, where both took them and ``sketches``, equal sketches."""
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
    return not sketches or _sketches_alike(a, b, rms * math.sqrt(a.numel))

def _sketches_alike(a: TensorRecord, b: TensorRecord, norm: float) -> bool:
    """Whether two records' sketches agree up to their fp64 sums' rounding (True where either has
    none): elements moved to other places leave every statistic as it was, never the sketch."""
    if a.sketch is None or b.sketch is None or len(a.sketch) != len(b.sketch):
        return True
    # Non-finite values make non-finite projections: alike where both runs made the same.
    return all(x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= SUM_ROUNDING * norm
               for x, y in zip(a.sketch, b.sketch, strict=True))

def written_error(c: OpComparison) -> tuple[float, float]:
    """The largest difference of a value ``c`` leaves for later steps to read, relative and times
    that value's norm (0 when none)."""
    if c.a is None or c.b is None:
        return 0.0, 0.0
    worst_error = worst_absolute = 0.0
    for t in c.outputs:
        record = c.a.outputs[t.position]
        if _leaves_state(c.a, record):
            error = error_of(t, record, c.b.outputs[t.position]) or 0.0  # unknown: explains nothing
            norm = record.stats.get("norm") if record.stats is not None else None
            worst_error = max(worst_error, error)
            if norm is not None and math.isfinite(float(norm)):
                worst_absolute = max(worst_absolute, error * float(norm))
    return worst_error, worst_absolute

def state_errors(comparisons: list[OpComparison], side_a: Side) -> dict[tuple, float | None]:
    """Run A's values left for the next step, each with its difference from run B's (None:
    not known, e.g. an op of run A only)."""
    by_index = {c.a.index: c for c in comparisons if c.a is not None}
    out: dict[tuple, float | None] = {}
    for key, (index, io, position) in left_state(side_a.ops).items():
        c = by_index.get(index)
        error = None
        if c is not None and c.b is not None:
            records = (c.a.inputs, c.b.inputs) if io == "input" else (c.a.outputs, c.b.outputs)
            if position < len(records[1]):
                error = stats_difference(records[0][position], records[1][position])
        out[key] = error
    return out

def stats_difference(a: TensorRecord, b: TensorRecord) -> float | None:
    """Two records' statistics apart (``precision.stats_error``); None when either is unknown."""
    if a.stats is None or b.stats is None or a.numel != b.numel:
        return None
    return precision.stats_error(a.stats, b.stats, a.numel)
