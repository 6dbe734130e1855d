"""Alignment by structure: which proposed op pairs the two runs' dataflow confirms.

Two runs correspond module call by module call (module path, call index within the step,
phase). Inside a module call, an op of run A and an op of run B correspond when they compute
the same thing on corresponding values: the same op, and each input read from the partner of
the other's producer (or both from outside the step). Where the two decompositions agree
(the same program, autocast adding casts) every op is paired that way; where they do not
(eager against SDPA attention, a fused kernel against its decomposition, a compiled region
against eager ops), the ops of the differing part stay unpaired on both sides and the module
call is a black box: its consumers outside it read a value of that module call in both runs,
and are paired on that (its boundary value), so compare judges the box by what crosses its
boundary (``unmatched producer``), never an op of one decomposition against an op of the
other because they sit at the same index.

A cast, copy or detach that one run makes and the other does not (autocast's casts, a
backward's extra detach) is seen through: it moves a value without computing on it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from probe.analysis.precision import short_name
from probe.rundir.run import OpRecord

GroupKey = tuple[str, str, int]
"""A module call: (phase, module path, call index within the step)."""

_MOVES_VALUES = frozenset({"_to_copy", "to", "_to_dtype", "type_as", "clone", "detach", "alias",
                           "contiguous", "lift_fresh"})
"""Ops that hand on their one input's value (in another dtype at most), shape unchanged."""
_REARRANGES = frozenset({
    "t", "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "permute", "expand", "expand_as",
    "view_as", "unsqueeze", "squeeze", "clone", "contiguous", "detach", "alias", "_to_copy", "to",
    "repeat", "repeat_interleave", "lift_fresh",
})
"""Ops that reshape, repeat or copy their one input's elements without computing on them: two
decompositions that reshape a value their own way (a repeat_kv's expand and reshape against a
repeat_interleave) still read the same value. Not ``roll`` or ``flip``: they move elements to
other indices, which an elementwise consumer reads against another operand."""
_WALKED = 64
"""How many ops of one run only are walked up from a value to the op it was made from."""
_OUTSIDE_HOPS = 8
"""How many one-input ops (views, casts) a value from outside the step is followed through."""


def _moves_value(op: OpRecord) -> bool:
    return (short_name(op.name) in _MOVES_VALUES and len(op.inputs) == 1 and len(op.outputs) >= 1
            and op.inputs[0].shape == op.outputs[0].shape)


class _Side:
    """One run's ops, who is paired so far, the module call each op belongs to and the module
    calls (frames, ``fqn[call]``) it runs inside, outermost first, in run A's names."""

    def __init__(self, ops: list[OpRecord], group_of: Callable[[OpRecord], GroupKey],
                 rename: Callable[[str], str]) -> None:
        self.by_index = {op.index: op for op in ops}
        self.group = {op.index: group_of(op) for op in ops}
        self.frames = {op.index: tuple(_renamed_frame(frame, rename) for frame in op.module_stack)
                       for op in ops}
        self.partner: dict[int, int] = {}

    def origin(self, source: tuple[int, int] | None) -> tuple[int, int] | None:
        """``source`` followed back through unpaired ops that only move a value."""
        while source is not None:
            op = self.by_index.get(source[0])
            if op is None or op.index in self.partner or not _moves_value(op):
                return source
            source = op.inputs[0].source
        return None

    def made_from(self, source: tuple[int, int], index: int) -> bool:
        """Whether unpaired ops made ``source`` from an output of op ``index`` alone (walking at
        most :data:`_WALKED` of them): ops one run inserted on that value (a scaling, a
        re-implementation of one function of it). An op on the way that also reads a value of a
        paired op other than ``index`` combines two values: no insertion (a sum autograd
        accumulates in another order)."""
        stack, seen, reached = [source], set(), False
        while stack:
            current, position = stack.pop()
            if current == index:
                reached = True
                continue
            if current in seen:
                continue
            op = self.by_index.get(current)
            if op is None or current in self.partner or len(seen) == _WALKED:
                return False
            seen.add(current)
            # A foreach op (the loss scaler's unscale of every gradient) makes its output k
            # of its input k alone.
            read = [op.inputs[position]] if "foreach" in short_name(op.name) and position < len(op.inputs) \
                else op.inputs
            stack += [t.source for t in read if t.source is not None]
        return reached

    def rearranged_from(self, source: tuple[int, int]) -> tuple[int, int] | None:
        """The value ``source`` is a rearrangement of: followed back through ops that only
        reshape or copy one value made in the step (paired or not; at most
        :data:`_OUTSIDE_HOPS`), the first output of another op; None when that is a value from
        outside the step. A saved tensor is the view in one run and what it views in the other
        (a view of a cast is a value of its own to the tracer, a view of a value made in the
        step is that value)."""
        for _ in range(_OUTSIDE_HOPS):
            op = self.by_index.get(source[0])
            if op is None:
                return source
            made = [t.source for t in op.inputs if t.source is not None]
            if short_name(op.name) not in _REARRANGES or len(made) > 1:
                return source
            if not made:
                return None
            source = made[0]
        return source

    def from_outside(self, source: tuple[int, int] | None) -> bool:
        """Whether ``source`` is a value from outside the step, or made of one by ops of one
        input each (a view or cast of a weight: the tracer sees a view of a weight itself as
        the weight, a view of a cast of it as made in the step)."""
        for _ in range(_OUTSIDE_HOPS):
            if source is None:
                return True
            op = self.by_index.get(source[0])
            if op is None or len(op.inputs) != 1:
                return False
            source = op.inputs[0].source
        return False


def _renamed_frame(frame: str, rename: Callable[[str], str]) -> str:
    module, bracket, call = frame.rpartition("[")
    return rename(module) + bracket + call if bracket else rename(frame)


def _box(frames_a: tuple[str, ...], frames_b: tuple[str, ...]) -> str | None:
    """The module call two values of unpaired ops were made in, when one run's call holds the
    other's (a compiled region of the whole model against a layer's eager ops): the larger;
    None when neither holds the other."""
    n = min(len(frames_a), len(frames_b))
    if n == 0 or frames_a[:n] != frames_b[:n]:
        return None
    return frames_a[n - 1]


def _input_agrees(a: OpRecord, b: OpRecord, position: int, side_a: _Side, side_b: _Side) -> bool:
    src_a = side_a.origin(a.inputs[position].source)
    src_b = side_b.origin(b.inputs[position].source)
    if src_a is None or src_b is None:  # from outside the step: their values are judged
        return side_a.from_outside(src_a) and side_b.from_outside(src_b)
    if side_a.partner.get(src_a[0]) == src_b[0]:
        return src_a[1] == src_b[1]
    same_shape = a.inputs[position].shape == b.inputs[position].shape
    moved_a, moved_b = side_a.rearranged_from(src_a), side_b.rearranged_from(src_b)
    if same_shape and moved_a is None and moved_b is None:
        return True  # views and copies of values from outside the step, alike
    if same_shape and moved_a is not None and moved_b is not None and \
            side_a.partner.get(moved_a[0]) == moved_b[0] and moved_a[1] == moved_b[1]:
        return True  # one value, rearranged each run its own way
    if src_a[0] in side_a.partner:  # ops of run B only between the two (a re-implementation, a bug)
        return same_shape and side_b.made_from(src_b, side_a.partner[src_a[0]])
    if src_b[0] in side_b.partner:
        return same_shape and side_a.made_from(src_a, side_b.partner[src_b[0]])
    # Both made by unpaired ops: a boundary value of one module call read from outside it,
    # the same in both runs (where two decompositions of that call part). The call's backward
    # is inside it: what its forward saved for it is no boundary value.
    if side_a.group[src_a[0]][0] != side_b.group[src_b[0]][0]:
        return False
    box = _box(side_a.frames[src_a[0]], side_b.frames[src_b[0]])
    inside = side_a.frames[a.index][-1:]
    return box is not None and (box,) != inside and same_shape


def dataflow_agrees(a: OpRecord, b: OpRecord, side_a: _Side, side_b: _Side) -> bool:
    """Whether ``a`` and ``b`` read corresponding values: each input from partnered producers,
    from outside the step in both runs, or from the same module call's boundary."""
    return len(a.inputs) == len(b.inputs) and all(
        _input_agrees(a, b, i, side_a, side_b) for i in range(len(a.inputs)))


def _outermost_calls(ops: list[OpRecord]) -> set[str]:
    return {op.module_stack[0].rpartition("[")[0] for op in ops if op.module_stack and op.phase == "forward"}


def wrapper_roots(ops_a: list[OpRecord], ops_b: list[OpRecord]) -> dict[str, str]:
    """A module map (B's names -> A's) for a wrapper module one run called around the model
    and the other did not (``torch.compile``'s ``OptimizedModule``, named by its class since it
    is not part of ``model=``): the root's own ops run in the wrapper's call there."""
    calls_a, calls_b = _outermost_calls(ops_a), _outermost_calls(ops_b)
    only_a, only_b = calls_a - calls_b, calls_b - calls_a
    if only_a == {""} and len(only_b) == 1:
        return {only_b.pop(): ""}
    if only_b == {""} and len(only_a) == 1:
        return {"": only_a.pop()}
    return {}


def _token(op: OpRecord) -> tuple:
    return op.name, tuple(t.shape for t in op.inputs), tuple(t.shape for t in op.outputs)


_SEARCHED = 64
"""How many unpaired candidates of B an op of A tries when its proposal is refused: the
search stays linear in a module call of many like ops (an optimizer's), and a partner that
dataflow confirms is near where sequence alignment looked."""


def _search(a: OpRecord, queue: list[OpRecord], side_a: _Side, side_b: _Side) -> OpRecord | None:
    while queue and queue[0].index in side_b.partner:
        queue.pop(0)
    tried = 0
    for op in queue:
        if op.index in side_b.partner:
            continue
        if dataflow_agrees(a, op, side_a, side_b):
            return op
        tried += 1
        if tried == _SEARCHED:
            break
    return None


def align(ops_a: list[OpRecord], ops_b: list[OpRecord], proposed: dict[int, OpRecord],
          group_a: Callable[[OpRecord], GroupKey], group_b: Callable[[OpRecord], GroupKey],
          rename_b: Callable[[str], str], excluded_b: set[int] | frozenset[int] = frozenset()
          ) -> dict[int, OpRecord]:
    """The pairs (A index -> B op) that dataflow confirms, in run A's execution order.

    ``proposed`` pairs (by id or by sequence alignment) are kept where their dataflow agrees;
    an op of A left without a partner takes the first unpaired op of B in its module call with
    the same name, input and output shapes whose dataflow agrees and that reads at least one value
    made in the step (a factory op's only evidence is its position). ``rename_b``: B's module
    paths in A's names; ``excluded_b``: B ops never paired."""
    side_a, side_b = _Side(ops_a, group_a, str), _Side(ops_b, group_b, rename_b)
    candidates: dict[tuple, list[OpRecord]] = defaultdict(list)
    for op in ops_b:
        if op.index not in excluded_b:
            candidates[(side_b.group[op.index], *_token(op))].append(op)
    paired: dict[int, OpRecord] = {}
    for a in ops_a:
        b = proposed.get(a.index)
        if b is None or b.index in side_b.partner or not dataflow_agrees(a, b, side_a, side_b):
            b = None
            queue = candidates.get((side_a.group[a.index], *_token(a)))
            if queue and any(t.source is not None for t in a.inputs):
                b = _search(a, queue, side_a, side_b)
        if b is not None:
            paired[a.index] = b
            side_a.partner[a.index] = b.index
            side_b.partner[b.index] = a.index
    return paired
