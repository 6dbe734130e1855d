"""Gradient accumulation: one run's step takes k micro-batches per optimizer step, the other's
another number (one full batch, say).

Such a step is the same training step computed over other slices of the batch: the model is
called k times, each call's backward adds into ``.grad`` (``param.grad += ...`` after the
first), the loss is divided by k, and the optimizer steps once. The structure is recognised
from the records alone: every module both runs call in forward is called r times as often in
run B as in run A, for one ratio r other than 1 (:func:`micro_batches`).

Against one full batch, the step of micro-batches is **folded in time** into the step of one
batch (:func:`fold`), the way a data-parallel run is folded across ranks
(``probe.analysis.layouts``): the first micro-batch's ops stand for the step's, each value the
micro-batches' values concatenated (statistics combined exactly) where the other run's shape
says so, each gradient accumulated in ``.grad`` the sum that made it in k partial sums; what
each micro-batch has of its own (its loss, positions within it) is unknown, "not compared" with
the reason. Micro-batches on both sides in other numbers are not folded: their forward and
backward are "not compared", and the ops after the last backward op (gradient clipping, a
GradScaler's unscale, the optimizer step), which read the accumulated gradients, are compared
as usual.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

from probe.analysis.layouts import combine_stats
from probe.analysis.precision import summation_terms
from probe.analysis.random_draws import draws, records_constants
from probe.rundir.records import module_frame
from probe.rundir.run import OpRecord, TensorRecord
from probe.vocabulary.op_class import returns_view


@dataclass(frozen=True)
class MicroBatches:
    """How often each run called the model in one step (its micro-batches)."""

    calls_a: int
    calls_b: int

    @property
    def reason(self) -> str:
        """Why the step's forward and backward ops are not compared, in words."""
        return (f"micro-batches: {self.calls_b} call{'s' if self.calls_b > 1 else ''} of the model in run B "
                f"vs {self.calls_a} in run A (gradient accumulation); forward and backward are not "
                f"compared op for op, the optimizer step on the accumulated gradients is")


def _forward_calls(ops: list[OpRecord], rename: Callable[[str], str]) -> dict[str, int]:
    """Module -> how many times it was called in forward (its distinct call indices)."""
    calls: dict[str, set[int]] = defaultdict(set)
    for op in ops:
        if op.phase == "forward" and op.module:
            calls[rename(op.module)].add(op.module_call)
    return {module: len(indices) for module, indices in calls.items()}


def _root_calls(ops: list[OpRecord]) -> int:
    """How many times the step called the root module (``model=``) in forward (0: no root frame)."""
    calls = set()
    for op in ops:
        if op.phase == "forward" and op.module_stack:
            frame = module_frame(op.module_stack[0])
            if frame is not None and frame[0] == "":
                calls.add(frame[1])
    return len(calls)


def micro_batches(ops_a: list[OpRecord], ops_b: list[OpRecord],
                  rename: Callable[[str], str] = lambda module: module) -> MicroBatches | None:
    """The runs' micro-batches in one step when they differ (None: they call the model alike, or
    no module both call tells). ``rename`` maps run B's module names into run A's."""
    roots_a, roots_b = _root_calls(ops_a), _root_calls(ops_b)
    if roots_a and roots_b:
        # The model's own calls, from its root frames: a submodule may be called a number of times
        # its data decide (a mixture's expert, only where tokens are routed to it), the model not.
        return MicroBatches(roots_a, roots_b) if roots_a != roots_b else None
    calls_a = _forward_calls(ops_a, lambda module: module)
    calls_b = _forward_calls(ops_b, rename)
    common = sorted(set(calls_a) & set(calls_b))
    if not common:
        return None
    ratios = {Fraction(calls_b[m], calls_a[m]) for m in common}
    if len(ratios) != 1 or ratios == {Fraction(1)}:
        return None
    # The model's calls: those of the modules called least (a submodule may be called more than
    # once per call of the model, never less).
    return MicroBatches(min(calls_a[m] for m in common), min(calls_b[m] for m in common))


def accumulation_end(ops: list[OpRecord]) -> int:
    """How many of the step's ops belong to its micro-batches: up to its last backward op (the
    last gradient accumulated), or its last op in a module call when it has no backward."""
    last = max((i for i, op in enumerate(ops) if op.phase == "backward"), default=None)
    if last is None:
        last = max((i for i, op in enumerate(ops) if op.phase == "forward" and op.module), default=-1)
    return last + 1


# --------------------------------------------------------------------------- the fold in time

NOT_FOLDED = ("a value of each micro-batch that is no slice of the full batch's "
              "(a sum or a loss per micro-batch)")
"""Why a folded value has no statistics: compare says "not compared", with this reason."""


_SCALINGS = frozenset({"aten.div.Tensor", "aten.div.Scalar", "aten.mul.Tensor", "aten.mul.Scalar"})


def _loss_scalings(ops: list[OpRecord]) -> set[int]:
    """The ops that scale each loss by a number before its backward (``loss / k``, gradient
    accumulation's) and that scaling's backward: a 0-dim ``div`` or ``mul`` outside the model whose
    result autograd seeds (``ones_like``), and the backward op of its name reading the seed."""
    found: set[int] = set()
    for seed in ops:
        if seed.name != "aten.ones_like.default" or seed.module_call >= 0 or not seed.inputs \
                or seed.inputs[0].source is None:
            continue
        scaling = ops[seed.inputs[0].source[0]]
        if scaling.name not in _SCALINGS or scaling.module_call >= 0 or not scaling.outputs \
                or tuple(scaling.outputs[0].shape) != ():
            continue
        backward = next((op for op in ops[seed.index + 1:] if op.phase == "backward"
                         and any(t.source == (seed.index, 0) for t in op.inputs)), None)
        if backward is not None and backward.name == scaling.name:
            found |= {scaling.index, backward.index}
    return found


def _moves_values(name: str) -> bool:
    """Whether an op's result holds its input's elements as they are (a view, a copy)."""
    return bool(returns_view(name)) or name in ("aten.clone.default", "aten._unsafe_view.default")


class _Segments:
    """A step's micro-batches: which ops each holds, and where each module's calls start in each.

    An op in a module call belongs to the micro-batch of its outermost call (the model's: called
    once per micro-batch); an op outside modules to the micro-batch around it, or, in forward after
    a micro-batch's backward, to the next (its slicing of the batch). Inner modules may be called
    a different number of times in each (a mixture of experts' experts, called for the tokens
    routed to them): their calls are counted from each micro-batch's first."""

    def __init__(self, ops: list[OpRecord], calls: int) -> None:
        outer: dict[str, set[int]] = defaultdict(set)
        for op in ops:
            if op.module_stack and (frame := module_frame(op.module_stack[0])) is not None:
                outer[frame[0]].add(frame[1])
        if any(len(indices) % calls for indices in outer.values()):
            raise Unfoldable("the model is called a number of times the micro-batches do not divide")
        per_call = {module: len(indices) // calls for module, indices in outer.items()}
        self.of: list[int] = []
        """Op position -> its micro-batch."""
        current, backward_seen = 0, False
        for op in ops:
            frame = module_frame(op.module_stack[0]) if op.module_stack else None
            if frame is not None:
                segment = sorted(outer[frame[0]]).index(frame[1]) // per_call[frame[0]]
            else:
                segment = current + 1 if op.phase == "forward" and backward_seen else current
            if segment < current or segment >= calls:
                raise Unfoldable("the micro-batches' ops interleave")
            if segment != current:
                current, backward_seen = segment, False
            backward_seen = backward_seen or op.phase == "backward"
            self.of.append(segment)
        self.first: list[dict[str, int]] = [{} for _ in range(calls)]
        """Micro-batch -> module -> its first call there."""
        for op, segment in zip(ops, self.of, strict=True):
            for entry in op.module_stack:
                if (frame := module_frame(entry)) is not None:
                    first = self.first[segment]
                    first[frame[0]] = min(first.get(frame[0], frame[1]), frame[1])

    def renumber(self, op: OpRecord, segment: int, counts: Counter[tuple[str, str, str]]) -> OpRecord:
        """``op`` as the first micro-batch's call would have recorded it: its module calls and its
        id counted within the micro-batch."""
        def call(module: str, c: int) -> int:
            return c - self.first[segment].get(module, 0)
        stack = []
        for entry in op.module_stack:
            frame = module_frame(entry)
            stack.append(entry if frame is None else f"{frame[0]}[{call(*frame)}]")
        module_call = call(op.module, op.module_call) if op.module_call >= 0 else op.module_call
        frame_name = f"{op.module}[{module_call}]" if op.module_call >= 0 else ""
        key = (op.phase, frame_name, op.name)
        n = counts[key]
        counts[key] += 1
        return replace(op, id=f"{op.phase}:{frame_name}:{op.name}:{n}", module_call=module_call,
                       module_stack=stack)


@dataclass
class Folded:
    """A step of micro-batches folded into one batch (:func:`fold`)."""

    ops: list[OpRecord]
    """The step's ops as one batch's, indexed from 0."""
    partial_sums: dict[tuple[int, int], int]
    """(op index, output position) -> how many partial sums the micro-batches computed it in: a
    gradient summed over each micro-batch's slice of the batch and accumulated in ``.grad``
    (compare's "reduction order" rule, as for the partial sums of a folded multi-rank run)."""


class _References:
    """The reference's ops, found for a folded op by its id, or near it where ids shifted."""

    def __init__(self, ops: list[OpRecord], key: Callable[[OpRecord], str]) -> None:
        self.by_id = {key(op): op for op in ops}
        self.by_kind: dict[str, list[OpRecord]] = defaultdict(list)
        for op in ops:
            self.by_kind[key(op).rsplit(":", 1)[0]].append(op)

    def partner(self, op_id: str, ops: list[OpRecord]) -> OpRecord | None:
        """The reference's op of id ``op_id`` when its results' shapes are the micro-batches' ops'
        (``ops``) or their concatenation; else the nearest op of its kind (module call, name) whose
        are: the full batch may run one op of a name more or less than a micro-batch (a view a
        batch of one needs), which shifts the ids after it."""
        kind, _, n = op_id.rpartition(":")
        candidates = self.by_kind.get(kind, [])
        if not n.isdigit() or not candidates:
            return self.by_id.get(op_id)
        count = int(n)
        for k in sorted(range(len(candidates)), key=lambda k: (abs(k - count), k)):
            if abs(k - count) > 2:
                break
            if _fits(candidates[k], ops):
                return candidates[k]
        return self.by_id.get(op_id)


def _fits(reference: OpRecord, ops: list[OpRecord]) -> bool:
    """Whether the reference's results are shaped as the micro-batches' ops' or their concatenation."""
    if any(len(op.outputs) != len(reference.outputs) for op in ops):
        return False
    for position, t in enumerate(reference.outputs):
        shapes = [tuple(op.outputs[position].shape) for op in ops]
        if tuple(t.shape) != shapes[0] and _concatenated(shapes, t) is None:
            return False
    return True


class Unfoldable(Exception):
    """The step's micro-batches are not laid out as one fold can read (said in the reason)."""


def _fold_record(records: list[TensorRecord], reference: TensorRecord | None, varies: bool,
                 result: bool) -> TensorRecord:
    """One tensor of the micro-batches' op as the full batch's: where the reference's shape is the
    micro-batches' sizes added along one dim, the concatenation (statistics combined exactly); a
    value made from no micro-batch's data (``varies`` False: a weight, a constant) and alike in
    each is itself; else unknown, with the reason (a per-micro-batch loss or count, a partial sum
    of a gradient: alike in shape, not in value). An integer or bool ``result`` of the batch's size
    is unknown too, in its full shape: it may be positions within its micro-batch (a sort's
    indices, an ``arange`` over its tokens), no slice of the full batch's positions."""
    lead = records[0]
    full = _concatenated([tuple(r.shape) for r in records], reference)
    if full is not None:
        if result and not lead.floating:
            return _unknown(replace(lead, shape=full))
        stats = combine_stats([(r.stats, tuple(r.shape)) for r in records])
        return replace(lead, shape=full, stats=stats, distribution=None, histogram=None, sketch=None,
                       skipped=None if stats is not None else lead.skipped)
    if not varies and all(r.shape == lead.shape and r.stats == lead.stats for r in records):
        return lead
    return _unknown(lead)


def _concatenated(shapes: list[tuple[int, ...]], reference: TensorRecord | None) -> tuple[int, ...] | None:
    """The reference's shape where it is ``shapes`` concatenated along one dim (None: it is not)."""
    if reference is None or tuple(reference.shape) == shapes[0]:
        return None
    full = tuple(reference.shape)
    if any(len(shape) != len(full) for shape in shapes):
        return None
    dims = [d for d in range(len(full)) if full[d] != shapes[0][d]]
    if len(dims) != 1:
        return None
    d = dims[0]
    rest = full[:d] + full[d + 1:]
    if sum(shape[d] for shape in shapes) != full[d] \
            or any(shape[:d] + shape[d + 1:] != rest for shape in shapes):
        return None
    return full


def _unknown(record: TensorRecord) -> TensorRecord:
    return replace(record, stats=None, distribution=None, histogram=None, sketch=None, skipped=NOT_FOLDED)


def _accumulations(micro: list[OpRecord], of: list[int]
                   ) -> tuple[dict[tuple[int, int], TensorRecord], dict[int, tuple[int, int]]]:
    """The later micro-batches' in-place additions into a gradient (``.grad += g``): the first
    micro-batch's value each adds into -> the value it holds when done, and each addition's op
    index -> that first value (``of``: each op's micro-batch)."""
    accumulated: dict[tuple[int, int], TensorRecord] = {}
    root_of: dict[int, tuple[int, int]] = {}
    for k, op in enumerate(micro):
        if of[k] == 0 or op.phase != "backward" or not op.outputs or not op.outputs[0].mutated \
                or not op.inputs or op.inputs[0].source is None:
            continue
        source = op.inputs[0].source
        root = root_of.get(source[0], source if of[source[0]] == 0 else None)
        if root is not None:
            root_of[op.index] = root
            accumulated[root] = op.outputs[0]
    return accumulated, root_of


def _gradient_sums(micro: list[OpRecord], of: list[int], accumulated: dict[tuple[int, int], TensorRecord],
                   calls: int) -> dict[tuple[int, int], int]:
    """The sums that made the accumulated gradients, each in ``calls`` partial sums; the values
    between such a sum and its gradient (its views: ``t``, ``view``, AccumulateGrad's ``detach``,
    copies) hold the accumulated value too, added to ``accumulated``. A gradient made of parts
    (a stack of sums) is unknown there: no sum's rounding in parts bounds it."""
    partial_sums: dict[tuple[int, int], int] = {}
    for root, record in list(accumulated.items()):
        chain = [root]
        while True:
            producer = micro[chain[-1][0]]
            source = producer.inputs[0].source if producer.inputs else None
            if not (_moves_values(producer.name) and source is not None and of[source[0]] == 0
                    and micro[source[0]].outputs[source[1]].numel == record.numel):
                break
            chain.append(source)
        summed = summation_terms(micro[chain[-1][0]], chain[-1][1]) > 1
        if summed:
            partial_sums[chain[-1]] = calls
        for at in chain:
            value = replace(record, shape=micro[at[0]].outputs[at[1]].shape)
            accumulated[at] = value if summed else _unknown(value)
    return partial_sums


def fold(ops: list[OpRecord], calls: int, reference: list[OpRecord],
         key: Callable[[OpRecord], str] = lambda op: op.id,
         reference_key: Callable[[OpRecord], str] = lambda op: op.id) -> Folded:
    """A step of ``calls`` micro-batches as the step of one full batch: ``reference``, the other
    run's step of one batch, says what each value's full shape is. The micro-batches' ops are the
    first's, their values folded (:func:`_fold_record`); gradients accumulated into ``.grad`` in
    place by the later micro-batches are the first's gradient op's values; ops of the first
    micro-batch's slicing the reference lacks are dropped (what reads them reads the batch); the
    ops after the accumulation follow, their sources remapped. ``key`` and ``reference_key`` give
    the ops of both runs in one naming (a module map). Raises :class:`Unfoldable`."""
    end = accumulation_end(ops)
    micro, rest = ops[:end], ops[end:]
    segments = _Segments(micro, calls)
    # Each micro-batch's loss divided by their number, where the reference's is not: part of the
    # accumulation, like the slicing of the batch (and not counted, so that the ids of the ops of
    # that name after it are the reference's).
    reference = reference[:accumulation_end(reference)]
    scalings = _loss_scalings(micro) if not _loss_scalings(reference) else set()
    counts: list[Counter[tuple[str, str, str]]] = [Counter() for _ in range(calls)]
    renumbered = [replace(op, id=f"{op.id} (loss scaling)") if k in scalings
                  else segments.renumber(op, segments.of[k], counts[segments.of[k]])
                  for k, op in enumerate(micro)]
    by_id: list[dict[str, OpRecord]] = [{} for _ in range(calls)]
    for op, segment in zip(renumbered, segments.of, strict=True):
        by_id[segment][op.id] = op
    references = _References(reference, reference_key)
    first_forward = next((k for k, op in enumerate(micro) if op.module_call >= 0), len(micro))
    recorded = records_constants(ops)

    accumulated, root_of = _accumulations(micro, segments.of)
    partial_sums = _gradient_sums(micro, segments.of, accumulated, calls)

    readers: dict[int, set[int]] = defaultdict(set)  # op index -> the micro-batches reading its results
    for k, op in enumerate(micro):
        for t in op.inputs:
            if t.source is not None:
                readers[t.source[0]].add(segments.of[k])
    new_index: dict[int, int] = {}
    varying: set[int] = set()  # ops whose results the micro-batches' data make (no value alike in each)
    folded: list[OpRecord] = []
    def own_op(index: int) -> bool:
        """Whether op ``index`` is one a later micro-batch alone ran in the model."""
        op = renumbered[index]
        return segments.of[index] != 0 and op.id not in by_id[0] and op.module_call >= 0 \
            and index not in root_of

    def add_own(index: int) -> None:
        """Adds a later micro-batch's own op (and its own producers first), its results unknown."""
        if index in new_index:
            return
        op = renumbered[index]
        inputs = []
        for t in op.inputs:
            source = t.source
            if source is not None and own_op(source[0]):
                add_own(source[0])
            elif source is not None and segments.of[source[0]] != 0:
                twin = by_id[0].get(renumbered[source[0]].id)  # the first micro-batch's value of it
                source = (twin.index, source[1]) if twin is not None else None
            inputs.append(replace(t, source=source))
        new_index[index] = len(folded)
        varying.add(index)
        folded.append(replace(op, inputs=inputs, outputs=[_unknown(t) for t in op.outputs]))

    for k, (op, lead) in enumerate(zip(micro, renumbered, strict=True)):
        if segments.of[k] != 0:
            continue
        peers = [peer for t in range(1, calls) if (peer := by_id[t].get(lead.id)) is not None]
        partner = references.partner(key(lead), [lead, *peers])
        if k in scalings or (k < first_forward and (partner is None or len(readers[op.index]) > 1)):
            continue  # the loss scaled for the accumulation, the batch sliced into micro-batches
        # A later micro-batch reading a value of its own here (an op the first lacks: a fault in
        # that micro-batch alone) reads it in the fold too, so that the value enters there.
        redirected: dict[int, tuple[int, int]] = {}
        for peer in peers:
            for position, t in enumerate(peer.inputs[:len(op.inputs)]):
                if t.source is not None and own_op(t.source[0]):
                    add_own(t.source[0])
                    redirected[position] = t.source
        if redirected:
            op, lead = (replace(o, inputs=[replace(t, source=redirected.get(p, t.source))
                                           for p, t in enumerate(o.inputs)]) for o in (op, lead))
        new_index[op.index] = len(folded)
        inputs_vary = [t.source[0] in varying or t.source[0] not in new_index if t.source is not None else
                       any(position >= len(p.inputs) or p.inputs[position].stats != t.stats for p in peers)
                       for position, t in enumerate(op.inputs)]
        if any(inputs_vary):
            varying.add(op.index)
        folded.append(_folded_op(lead, peers, len(peers) in (0, calls - 1), partner, accumulated,
                                 op.index, inputs_vary, recorded))
        if any(f.shape != t.shape for f, t in zip(folded[-1].inputs, lead.inputs, strict=True)):
            varying.add(op.index)
    for op in rest:
        new_index[op.index] = len(folded)
        folded.append(op)

    def source_of(source: tuple[int, int] | None) -> tuple[int, int] | None:
        if source is None:
            return None
        source = root_of.get(source[0], source)
        return (new_index[source[0]], source[1]) if source[0] in new_index else None

    return Folded([replace(op, index=i, inputs=[replace(t, source=source_of(t.source)) for t in op.inputs])
                   for i, op in enumerate(folded)],
                  {(new_index[i], p): n for (i, p), n in partial_sums.items() if i in new_index})


def _folded_op(lead: OpRecord, peers: list[OpRecord], complete: bool, partner: OpRecord | None,
               accumulated: dict[tuple[int, int], TensorRecord], index: int,
               inputs_vary: list[bool], recorded: bool) -> OpRecord:
    """The first micro-batch's op with its values folded over its ``peers`` (the same op in the
    later micro-batches: none, an op done once for all of them; ``complete`` False: some lack it,
    so nothing folds). ``partner``: the reference's op; ``inputs_vary``: whether the micro-batches'
    data make each input (and so its results, where one does); ``accumulated``: the values later
    micro-batches add into in place, when done; ``recorded``: whether the run records constants
    (an op's probability among them, :func:`probe.analysis.random_draws.draws`)."""
    def folded(io: str, position: int, record: TensorRecord, varies: bool) -> TensorRecord:
        # A value later micro-batches add into in place (``.grad``) is their sum, unless the
        # reference's op makes a value of another size there: a micro-batch of one's gradient
        # that AccumulateGrad kept as ``.grad`` (no sum over the batch, which the reference does
        # after this op), so that this op's value is the batch's slice, folded as any other.
        if io == "output" and (index, position) in accumulated and not (
                partner is not None and position < len(partner.outputs)
                and partner.outputs[position].numel != accumulated[(index, position)].numel):
            return replace(accumulated[(index, position)], source=None, mutated=record.mutated)
        if io == "output" and peers and draws(lead, recorded):  # each micro-batch's own draw
            return _unknown(record)
        if not peers and complete:  # done once: itself, unless made from the first micro-batch alone
            return _unknown(record) if varies else record
        if not complete:
            return _unknown(record)
        tensors = [(p.outputs if io == "output" else p.inputs) for p in peers]
        if any(position >= len(t) for t in tensors):
            return _unknown(record)
        mine = partner.outputs if partner is not None and io == "output" else \
            partner.inputs if partner is not None else []
        return _fold_record([record, *(t[position] for t in tensors)],
                            mine[position] if position < len(mine) else None, varies, io == "output")
    inputs = [replace(folded("input", p, t, inputs_vary[p]), source=t.source)
              for p, t in enumerate(lead.inputs)]
    # An input the full batch's size where each micro-batch's is smaller: what the op makes of it is
    # the batch's (a sum of a value expanded over the batch), even alike in every micro-batch.
    varies = any(inputs_vary) or any(f.shape != t.shape for f, t in zip(inputs, lead.inputs, strict=True))
    # An argument each micro-batch gives otherwise (a count of its tokens) is its data's, no
    # constant of the computation to hold against the reference's.
    constants = {k: v for k, v in lead.constants.items() if all(p.constants.get(k) == v for p in peers)}
    outputs = [folded("output", p, t, varies) for p, t in enumerate(lead.outputs)]
    return replace(lead, inputs=inputs, outputs=outputs, constants=constants)
