"""Proposed op pairs whose inputs cross two decompositions of one module call.

Ids and sequence alignment propose pairs by position: the n-th ``view`` of a module call in
run A with the n-th in run B. Where the two runs decompose the module call the same way
(the same program, autocast adding casts) that is the op's twin. Where they do not (eager
against SDPA attention, a fused kernel against its decomposition, a re-implemented module),
the n-th ``view`` of one is some other value of the other: pairing them compares values of
different shapes or meanings and calls a healthy pair divergent.

A pair is refused when, inside the module call it runs in, it reads a value that the two runs
made with ops that do not correspond: both producers are ops of one run only (each run's own
decomposition), or both are paired, but not with each other. Refusals cascade in execution
order within the module call, so the part where the
decompositions differ stays unpaired on both sides: a black box, whose boundary values the
unmatched-producer rule judges where a paired op outside it reads them. Only producers in the
same module call count, but for two paired with other ops: a value from another module call is
that call's boundary, judged there, unless the two runs read other values of it; and an
insertion by one run only (a cast, a re-implemented activation, a planted roll of a mask)
leaves the other run's producer paired, so it is never a reason to refuse: it is what the
judging rules look at. Nor is a reshape one run records between a value and its reader where
the other reads the value itself (Mamba's mixer under autocast: ``mul`` reads ``view(add)`` in
one run and the ``add`` in the other): producers are compared through the reshapes that keep
every element in its order. Two producers each of its own run only that pass on, through such
reshapes, copies and casts of their dtype, the value of two ops paired with each other are one
value copied alike (``F.linear`` of a strided slice: ``clone`` and ``_unsafe_view`` in float32,
autocast's cast and a ``view`` under autocast).

In a compiled region's graph (its ops recorded by a re-run: ``regraphed``) the decomposition is
the compiler's own (a softmax as ``amax``, ``sub``, ``exp``, ``sum``, ``div``; ``_unsafe_view``
as ``view``), so a value one run made with ops of its own is an insertion only where it is one:
those ops each read one value computed in the step, back to the twin of the other run's
producer; and a value from outside the module call that each run made with ops of its own
is no evidence the two readers are twins. Otherwise (the eager softmax's chain read where the
graph reads its ``q``: the n-th ``view`` of each) the pair is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable

from probe.analysis.precision import SAME_ORDER_VIEWS, VALUE_CASTS, faithful_rounding, short_name
from probe.rundir.run import OpRecord


def refuse_crossed(ops_a: list[OpRecord], ops_b: list[OpRecord], partner: dict[int, OpRecord],
                   call_a: Callable[[OpRecord], Hashable], call_b: Callable[[OpRecord], Hashable],
                   regraphed: Collection[int] = ()) -> list[int]:
    """Removes from ``partner`` (A index -> B op) the pairs that read values the two runs made by
    non-corresponding ops of the pair's own module call; returns the A indices removed.

    ``call_a``/``call_b``: the module call an op runs in (module path and call index, B's in
    A's names), whatever its phase: a backward op reading what its module call's forward saved
    reads from inside the box. ``regraphed``: indices of B's ops a compiled region's graph re-run
    recorded (see the module docstring)."""
    by_index_a = {op.index: op for op in ops_a}
    by_index_b = {op.index: op for op in ops_b}
    a_of_b = {b.index: a for a, b in partner.items()}
    # The module calls where each run scales a value by a number with an op the other run lacks.
    scaled = ({call_a(op) for op in ops_a if op.index not in partner and _scales(op)},
              {call_b(op) for op in ops_b if op.index not in a_of_b and _scales(op)})
    refused: list[int] = []
    # One pass, in execution order. Repeating it until nothing changes (a B op paired by id with a
    # later A op, refused after its reader was judged) unpaired the diagnosis matrix's rolled mask
    # under bf16 autocast into the box, where autocast's rounding hides it (3 of 75 faults lost).
    for op in ops_a:
        other = partner.get(op.index)
        if other is None or not _crossed(op, other, by_index_a, by_index_b, partner, a_of_b,
                                         call_a, call_b, scaled, other.index in regraphed):
            continue
        del partner[op.index]
        del a_of_b[other.index]
        refused.append(op.index)
    return refused


def _crossed(a: OpRecord, b: OpRecord, by_index_a: dict[int, OpRecord], by_index_b: dict[int, OpRecord],
             partner: dict[int, OpRecord], a_of_b: dict[int, int],
             call_a: Callable[[OpRecord], Hashable], call_b: Callable[[OpRecord], Hashable],
             scaled: tuple[set[Hashable], set[Hashable]], regraphed: bool = False) -> bool:
    call = call_a(a)
    for ta, tb in zip(a.inputs, b.inputs, strict=False):
        if ta.source is None and tb.source is None:
            continue
        if ta.source is None or tb.source is None:
            # A value from outside the step (a weight) in one run, one the module call computed with
            # ops of its own in the other: the weight's ``t`` of one linear's backward paired with
            # the ``t`` of the other's weight gradient (``mm`` against ``addmm`` decompositions);
            # or one computed by an op paired with another (the weight's ``t`` with a ``t`` of the
            # output gradient, aligned by name where one run has more ``t``s: a micro-batch's).
            # A cast or view of the outside value (autocast's weight cast) is that value.
            computing = ((tb.source, by_index_b, a_of_b, call_b) if ta.source is None
                         else (ta.source, by_index_a, partner, call_a))
            if _computed_otherwise(*computing, call):
                return True
            continue
        if ta.floating != tb.floating:
            # Another kind of value wherever it was made: a mask of booleans that SDPA reads in one
            # run, the additive float mask eager attention reads in the other (`where` of it).
            return True
        pa, pb = by_index_a.get(ta.source[0]), by_index_b.get(tb.source[0])
        if pa is None or pb is None:
            continue
        paired_a, paired_b = pa.index in partner, pb.index in a_of_b
        if call_a(pa) != call and call_b(pb) != call:
            # A value from outside the module call is its boundary, judged where it is read, but
            # one read from two producers paired with other ops is another value wherever it was
            # made: an op one run alone has (eager attention's scaling `mul` in backward) shifts
            # the ids of its kind, and the rotary `mul` by sin is paired with the one by cos.
            if paired_a and paired_b and _paired_otherwise(pa, pb, ta.source, tb.source, by_index_a,
                                                           by_index_b, partner):
                return True
            if regraphed and not paired_a and not paired_b:
                return True  # each run's own ops made it: which of the graph's values is it?
            continue
        if ta.shape != tb.shape:
            return True  # another value: what one run inserts on a value (a cast) keeps its shape
        if not paired_a and not paired_b:
            if _copied_alike(pa, pb, by_index_a, by_index_b, partner):
                continue  # one value, each run copying, casting or reshaping it its own way
            return True  # each run's own ops made it: the decompositions differ here
        inserted = (pb, by_index_b, a_of_b) if paired_a else (pa, by_index_a, partner)
        if paired_a != paired_b and call in scaled[0 if paired_a else 1] and _scaled_on_the_way(*inserted):
            # One run scales by a number where the other scales elsewhere in the call: a constant
            # placed otherwise (SDPA's math path scales q and k by sqrt(scale), eager attention its
            # scores), not an insertion on a shared value; the two agree again past the box.
            return True
        if regraphed and paired_a != paired_b:
            # One producer is its run's own (``own``): an insertion on the value the other run's
            # producer makes, or the compiler's decomposition of something else.
            own, other_side = (pb, by_index_b) if paired_a else (pa, by_index_a)
            twin = partner[pa.index].index if paired_a else a_of_b[pb.index]
            if not _inserted(own, twin, other_side, a_of_b if paired_a else partner):
                return True
        if paired_a and paired_b and _paired_otherwise(pa, pb, ta.source, tb.source, by_index_a, by_index_b,
                                                       partner):
            return True
    return False


def _computed_otherwise(source: tuple[int, int], by_index: dict[int, OpRecord],
                        paired: Collection[int], call_of: Callable[[OpRecord], Hashable],
                        call: Hashable) -> bool:
    """Whether the value at ``source`` (in one run, where the other run reads a value from outside
    the step) is computed otherwise in the module call ``call``, not a cast or reshape of a value
    from outside the step: by ops of that run only, or by an op paired with another op of the
    other run (whose value the other run's op does not read: it reads the outside value)."""
    producer = by_index.get(source[0])
    if producer is None or call_of(producer) != call:
        return False
    if producer.index in paired:
        # Outside every module, the step's own making of its batch (a ``randint``, an ``index`` of
        # a dataset) is read as from outside where the micro-batch fold dropped its slicing.
        return producer.module_call >= 0 and not _of_outside_value(producer, by_index)
    origin = _through_reshapes(producer, by_index, casts=True)
    reads_outside = _keeps_its_input(origin, casts=True) and origin.inputs[0].source is None
    return not reads_outside and origin.index not in paired


def _of_outside_value(op: OpRecord, by_index: dict[int, OpRecord]) -> bool:
    """Whether ``op`` computes from one value from outside the step alone, through ops of one
    input each (a weight's autocast cast and its transpose, which one run records where the other
    reads the weight as it is)."""
    for _ in range(_WALK_INSERTED):
        if len(op.inputs) != 1:
            return False
        source = op.inputs[0].source
        if source is None:
            return True
        producer = by_index.get(source[0])
        if producer is None:
            return False
        op = producer
    return False


def _paired_otherwise(pa: OpRecord, pb: OpRecord, source_a: tuple[int, int], source_b: tuple[int, int],
                      by_index_a: dict[int, OpRecord], by_index_b: dict[int, OpRecord],
                      partner: dict[int, OpRecord]) -> bool:
    """Whether two paired producers of one input pair are paired, not with each other (through
    the reshapes that keep every element in its order), or give other outputs: another value."""
    if partner[pa.index].index == pb.index and source_a[1] == source_b[1]:
        return False
    ra, rb = _through_reshapes(pa, by_index_a), _through_reshapes(pb, by_index_b)
    same = partner.get(ra.index)
    return (ra is pa and rb is pb) or same is None or same.index != rb.index


def _inserted(op: OpRecord, twin: int, by_index: dict[int, OpRecord], paired: Collection[int]) -> bool:
    """Whether ``op``, of one run only, passes on the value of the op at index ``twin`` (of the same
    run) through ops of that run only that each read one value computed in the step."""
    for _ in range(_WALK_INSERTED):
        sourced = [t.source for t in op.inputs if t.source is not None]
        if len(sourced) != 1:
            return False
        producer = by_index.get(sourced[0][0])
        if producer is None:
            return False
        if producer.index == twin:
            return True
        if producer.index in paired:
            return False
        op = producer
    return False


_WALK_INSERTED = 8
"""The most one-run-only ops an insertion walks back through (casts, views, a scaling)."""


def _scales(op: OpRecord) -> bool:
    """Whether ``op`` multiplies (or divides) its one tensor by a number, keeping every element."""
    return faithful_rounding(op) is not None and short_name(op.name) in _SCALING_OPS


_SCALING_OPS = frozenset({"mul", "div"})


def _scaled_on_the_way(op: OpRecord, by_index: dict[int, OpRecord], paired: Collection[int]) -> bool:
    """Whether ``op``, of one run only, passes on a value its run scaled by a number through ops
    of that run only that keep every element (views, casts, an expand for the batched product)."""
    for _ in range(_WALK_SCALED):
        if op.index in paired or faithful_rounding(op) is None:
            return False
        if _scales(op):
            return True
        source = op.inputs[0].source
        producer = by_index.get(source[0]) if source is not None else None
        if producer is None:
            return False
        op = producer
    return False


_WALK_SCALED = 8
"""The most element-keeping ops walked back from a one-run-only value to its scaling."""


def _through_reshapes(op: OpRecord, by_index: dict[int, OpRecord], casts: bool = False) -> OpRecord:
    """The op whose value ``op`` passes on unchanged in its order (``op`` itself if it computes);
    ``casts``: through casts of its dtype too (each element kept, rounded at most once)."""
    while op.inputs and op.inputs[0].source is not None and _keeps_its_input(op, casts):
        source = by_index.get(op.inputs[0].source[0])
        if source is None:
            break
        op = source
    return op


def _keeps_its_input(op: OpRecord, casts: bool = False) -> bool:
    short = short_name(op.name)
    if short == "expand":  # to the shape it has already: an alias
        return bool(op.outputs) and op.outputs[0].shape == op.inputs[0].shape
    if casts and short in VALUE_CASTS:
        return len(op.inputs) == 1 and len(op.outputs) == 1 and op.outputs[0].shape == op.inputs[0].shape
    return short in SAME_ORDER_VIEWS


def _copied_alike(pa: OpRecord, pb: OpRecord, by_index_a: dict[int, OpRecord],
                  by_index_b: dict[int, OpRecord], partner: dict[int, OpRecord]) -> bool:
    """Whether two one-run-only producers pass on, in its order, the value of two ops paired with
    each other: each run copying, casting or reshaping it its own way (``F.linear`` of a strided
    input in float32 ``clone``s it and ``_unsafe_view``s it for an ``mm``; under autocast its cast
    makes it contiguous and a ``view`` feeds an ``addmm``). Casts are what the precision rules judge,
    not another value."""
    ra, rb = _through_reshapes(pa, by_index_a, casts=True), _through_reshapes(pb, by_index_b, casts=True)
    same = partner.get(ra.index)
    return ra is not pa and rb is not pb and same is not None and same.index == rb.index
