"""Where a non-finite fault starts in one step: the ops whose NaN, +Inf or -Inf reaches a fault
(a result, a value handed to Python) that none of their inputs held. Read by ``Run.first_nonfinite``,
the ranks' origin and the summary."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from probe.rundir.records import NAN, NEGINF, POSINF, OpRecord, TensorRecord
from probe.rundir.written_parts import partial_write, written_parts
from probe.vocabulary.op_class import reads_shape_only, returns_view


def _short_name(op: OpRecord) -> str:
    parts = op.name.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


_SIGN_CHANGING = frozenset({
    "neg", "negative", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide",
    "floor_divide", "abs", "absolute", "pow", "float_power", "square", "addcmul", "addcdiv", "lerp",
    "copysign", "prod", "cumprod", "cosh", "hypot", "var", "std", "var_mean", "std_mean", "dist", "cdist",
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "matmul", "mv", "dot", "vdot", "outer",
    "einsum", "tensordot", "_scaled_mm", "_scaled_grouped_mm", "_grouped_mm", "sgn_backward",
})
"""Ops that may turn an Inf into one of the other sign (a product with a negative value, a
negation, an absolute value or a square). Any other op keeps the sign of the Infs it passes on
(``exp`` of -Inf is 0, never +Inf; ``add``, ``softmax``, ``max``, ``where``, copies), or makes
NaN of them."""
_SIGN_CHANGING_PARTS = ("backward", "loss", "norm", "conv", "attention", "linear")
"""...and ops whose name holds one of these: gradients (derivatives of either sign), losses
(negative log-likelihoods), norms (absolute values; normalisation layers scale by weights of
either sign), convolutions and attention (products with weights)."""
_KEEPS_SIGN_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "fsdp"})
"""Collectives sum, gather or copy: the sign of an Inf stays (or two signs make NaN)."""


@lru_cache(maxsize=4096)
def _may_change_sign(name: str) -> bool:
    """Whether op ``name`` (full overload name) may turn +Inf into -Inf or back. Ops outside
    aten and the collectives (custom ops, higher-order ops) may: nothing is known of them."""
    namespace = name.split(".", 1)[0]
    if namespace in _KEEPS_SIGN_NAMESPACES:
        return False
    if namespace not in ("aten", "prims"):
        return True
    parts = name.split(".")
    short = (parts[1] if len(parts) > 2 else parts[-1]).removesuffix("_").removeprefix("_foreach_")
    return short in _SIGN_CHANGING or any(part in short for part in _SIGN_CHANGING_PARTS)


_OTHER_SIGN = {POSINF: NEGINF, NEGINF: POSINF}


def _heirs(reader: OpRecord, kind: str) -> frozenset[str]:
    """The kinds a non-finite value of ``kind`` may become in ``reader``'s outputs: itself, NaN
    (``inf - inf``, ``0 * inf``, a softmax of a row of -Inf), the other sign of Inf where the op
    may change signs. Never a finite value's kind: an op whose output holds a kind none of these
    explains made it."""
    if kind == NAN:
        return frozenset({NAN})
    if _may_change_sign(reader.name):
        return frozenset({NAN, POSINF, NEGINF})
    return frozenset({kind, NAN})


def nonfinite_origins_in(ops: list[OpRecord]) -> list[OpRecord]:
    """The ops of one step (``ops``: its records in execution order) where a non-finite fault
    starts, in execution order.

    Non-finite values are told apart by kind: NaN, +Inf and -Inf. A kind in an op's output
    *reaches a fault* when that output

    - is read by no later op of the step, other than for its shape: it is the loss, a
      gradient, a parameter or optimizer state the optimizer wrote, or a result handed to
      the user (not an output of a forward op the program read another output of and
      dropped this one: the values of ``topk(...).indices``); or
    - is read by an op that has no tensor outputs (``.item()`` hands the value to Python),
      or whose outputs are unknown (no statistics), or one of whose outputs holds a kind this
      one may become there (itself; NaN; the other sign of Inf in an op that may change
      signs, see ``_SIGN_CHANGING``), that the reader's other inputs do not hold, and that
      reaches a fault in turn (an attention's backward whose incoming gradient is NaN passes
      on that NaN, not its mask's -inf).

    A kind that no reader passes on is *absorbed*: the ``-inf`` of an attention mask that
    softmax, or ``exp``, turns into zeros is no fault, even where the reader makes another
    kind of its own (an ``exp`` that overflows to +Inf on the unmasked scores). The origins
    are the ops with a kind reaching a fault that none of their inputs computed in the step
    held (an Inf of either sign, in an op that may change signs): a kind the op created (an
    overflow to +Inf; a NaN of ``inf - inf``), or one that entered the step there (a weight or
    a batch holding it). The earliest of them is where
    the fault started; an op that made NaN out of an Inf an earlier origin made is an origin
    too, later.
    """
    outputs = [[t.nonfinite_kinds for t in op.outputs] for op in ops]
    readers: dict[tuple[int, int], list[int]] = {}
    for op in ops:
        if reads_shape_only(op.name):
            continue
        for tensor in op.inputs:
            if tensor.source is not None:
                readers.setdefault(tensor.source, []).append(op.index)
    reaching: dict[tuple[int, int], frozenset[str]] = {}  # (op, output) -> its kinds that reach a fault
    constant = _constant_ops(ops)

    def held_by(op: OpRecord, tensors: Iterable[TensorRecord]) -> set[str]:
        """The kinds ``tensors`` (inputs of ``op`` computed in the step) held, as ``op`` may pass
        them on: an Inf of either sign where ``op`` may change signs."""
        held: set[str] = set()
        for tensor in tensors:
            if tensor.source is None:
                continue  # from outside the step: a kind it brings enters the step at ``op``
            kinds = tensor.nonfinite_kinds
            if kinds is None and tensor.source[0] < len(outputs):  # the producer's, when known
                produced = outputs[tensor.source[0]]
                kinds = produced[tensor.source[1]] if tensor.source[1] < len(produced) else None
                if kinds is not None and partial_write(ops, tensor):
                    kinds = _kinds_of_parts(ops, tensor, kinds)
            held.update(kinds or ())
        if (POSINF in held or NEGINF in held) and _may_change_sign(op.name):
            held.update((POSINF, NEGINF))  # -x of -Inf is +Inf: passed on, not made here
        return held

    def passes_on(reader: OpRecord, source: tuple[int, int], kind: str) -> bool:
        kinds = outputs[reader.index]
        if not kinds or any(k is None for k in kinds):
            return True
        # A kind this one would become only by changing, that the reader's other inputs hold
        # already, is theirs: the NaN of an attention's backward whose incoming gradient is NaN
        # is that gradient's, not its mask's -inf, which the forward absorbed. The same kind in
        # two inputs is passed on by both.
        others = held_by(reader, [t for t in reader.inputs
                                  if t.source is None or tuple(t.source[:2]) != source])
        heirs = _heirs(reader, kind) - (others - {kind})
        return any(heirs & reaching.get((reader.index, q), frozenset()) for q in range(len(kinds)))

    for op in reversed(ops):  # a reader comes after what it reads
        read_outputs = [bool(readers.get((op.index, q))) for q in range(len(outputs[op.index]))]
        for position, kinds in enumerate(outputs[op.index]):
            if not kinds:
                continue
            values = readers.get((op.index, position))
            if not values:
                # A result, unless nothing computed it (a mask built and never used) or the program
                # kept another of the op's new results in forward and dropped this one (``topk(...)
                # .indices`` of scores masked with -inf: the values are never used). An in-place
                # op's results are the state it wrote (a GradScaler's unscale of the gradients).
                dropped = op.phase == "forward" and any(read_outputs) and not _short_name(op).endswith("_")
                # Nor is a view of forward: its memory is its base's, and a later read of it may be
                # named by the base's producer (DeepSeek-V4's compressor slices a -inf-padded buffer
                # its scatter_ wrote; the cat reading the slice names the scatter_). Its kinds reach
                # a fault through the base's readers, if at all.
                dropped = dropped or (op.phase == "forward" and bool(returns_view(op.name)))
                reached = frozenset() if op.index in constant or dropped else kinds
            else:
                reached = frozenset(k for k in kinds
                                    if any(passes_on(ops[c], (op.index, position), k) for c in values))
            if reached:
                reaching[(op.index, position)] = reached
    origins = []
    for op in ops:
        reached = frozenset().union(*(reaching.get((op.index, q), ()) for q in range(len(op.outputs))))
        if not reached:
            continue
        # Kinds its inputs computed in the step held are passed on, not made here.
        held = held_by(op, op.inputs) if not reads_shape_only(op.name) else set()
        if reached - held:
            origins.append(op)
    return origins


def _kinds_of_parts(ops: list[OpRecord], tensor: TensorRecord, last: frozenset[str]) -> frozenset[str]:
    """The kinds a buffer read whole holds whose last write (holding ``last``) was to a part of it:
    its parts' (``copy_`` into a slice of a ``full(-inf)`` padding, DeepSeek-V4's compressor,
    leaves the padding's -inf in the rest). Where the parts are not all known (a bucket DDP
    fills with ``mul.out``), the last write's: an op reading it is named rather than no op."""
    parts = written_parts(ops, tensor)
    if parts is None or any(part.nonfinite_kinds is None for part in parts):
        return last
    return frozenset().union(*(part.nonfinite_kinds or () for part in parts))


def _constant_ops(ops: list[OpRecord]) -> set[int]:
    """The ops whose results depend on no value of the program: made from scalars and shapes
    alone (``full(-inf)``, ``arange``, a ``triu`` or ``masked_fill`` of those), reading no tensor
    from outside the step nor one computed from one. Their infinities are masks, written on
    purpose: one that no op reads is nothing (a causal mask SDPA skips under ``is_causal=True``),
    one that a reader passes on to a fault is still where that fault started."""
    constant: set[int] = set()
    for op in ops:
        short = _short_name(op)
        if short.removesuffix("_") not in _MASK_BUILDERS:
            continue  # arithmetic, a random draw: a value of the program, whatever it is made from
        if reads_shape_only(op.name) or all(t.source is not None and t.source[0] in constant
                                             for t in op.inputs):
            constant.add(op.index)
    return constant


_MASK_BUILDERS = frozenset({
    "full", "full_like", "new_full", "fill", "scalar_tensor", "zeros", "zeros_like", "ones", "ones_like",
    "new_zeros", "new_ones", "arange", "triu", "tril", "masked_fill", "where", "lt", "le", "gt", "ge", "eq",
    "ne", "logical_not", "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or",
    "view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "slice", "select", "transpose",
    "permute", "t", "alias", "clone", "contiguous", "_to_copy", "to", "detach", "lift_fresh", "copy",
})
"""Ops masks are built with: fills of a scalar, positions, comparisons and selections of them, and
ops that move or cast them. A value any other op computed (``x * x``, ``exp``, a random draw) is a
value of the program even when made from constants alone."""


def first_nonfinite_in(ops: list[OpRecord]) -> OpRecord | None:
    """The first op of one step's ``ops`` where a non-finite fault starts (see
    :func:`nonfinite_origins_in`), or None; ops without statistics never are."""
    origins = nonfinite_origins_in(ops)
    return origins[0] if origins else None
