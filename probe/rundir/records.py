"""The records every run holds, as ``probe.load`` returns them: ops, their tensors, step
manifests, steps the writer gave up. A mode's own records (the monitor's series, the free
benchmark's checks, the stats mode's non-finite parameters, the dump's index entries) live in its
package, beside the reader that makes them.

Plain data with no reading logic, so the reader, the op graph and every analysis
share them without depending on one another.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

_FLOATING_PREFIXES = ("float", "bfloat", "complex")
"""Dtype names (``TensorRecord.dtype``) of tensors that can hold NaN or Inf."""

NAN, POSINF, NEGINF = "nan", "+inf", "-inf"
"""The kinds of non-finite values (:attr:`TensorRecord.nonfinite_kinds`)."""


def nonfinite_kinds(stats: dict[str, float | int | None]) -> frozenset[str]:
    """The kinds of non-finite values a tensor's statistics count. Statistics without the sign
    of their Infs (``posinf``/``neginf`` None: a run of format version 2 or before) give both."""
    kinds = []
    if stats["nan"]:
        kinds.append(NAN)
    if stats["inf"]:
        positive, negative = stats.get("posinf"), stats.get("neginf")
        if positive is None or negative is None:
            kinds += [POSINF, NEGINF]
        else:
            kinds += [kind for kind, count in ((POSINF, positive), (NEGINF, negative)) if count]
    return frozenset(kinds)


@dataclass(slots=True)
class TensorRecord:
    """A tensor argument or result of a recorded op."""

    dtype: str
    shape: tuple[int, ...]
    stats: dict[str, float | int | None] | None = None
    """min, max, mean, norm (floats; None for empty tensors), nan, inf, posinf, neginf (counts;
    ``inf`` = ``posinf`` + ``neginf``; the two are None in a run of format version 2 or before
    when ``inf`` is not 0: the sign was not recorded)."""
    source: tuple[int, int] | None = None
    """For inputs: (index of the producing op in this step, its output position)."""
    mutated: bool = False
    """For outputs: an argument the op wrote in place."""
    skipped: str | None = None
    """Why the probe kept nothing of this tensor (no source, statistics or dump): "inference",
    "sparse", "nested", "zero", "meta" or "no storage"; None for a tensor it could key."""
    distribution: dict[str, float | None] | None = None
    """With the stats mode's ``distribution=True``: shares (0 to 1) of ``zeros``, ``underflow``
    (nonzero, below the dtype's smallest normal) and ``near_overflow`` (finite, above half the
    dtype's max); a share is None where it does not apply (integer tensors); None when not recorded."""
    histogram: dict[str, Any] | None = None
    """With ``histogram=True``: ``{"zero": n, "nonfinite": n, "exponents": {e: n}}``, where ``e``
    counts elements with ``2**e <= |x| < 2**(e + 1)``; None when not recorded."""

    @property
    def floating(self) -> bool:
        """Whether the dtype holds real numbers that can be NaN or Inf (float and complex dtypes)."""
        return self.dtype.startswith(_FLOATING_PREFIXES)

    @property
    def finite(self) -> bool | None:
        """False if the tensor held a NaN or Inf; True for integer and bool tensors (they cannot);
        None without statistics."""
        if self.stats is None:
            return None if self.floating else True
        return self.stats["nan"] == 0 and self.stats["inf"] == 0

    @property
    def nonfinite_kinds(self) -> frozenset[str] | None:
        """Which of NaN, +Inf and -Inf (:data:`NAN`, :data:`POSINF`, :data:`NEGINF`) the tensor
        held: empty when finite (integer and bool tensors always), None without statistics."""
        if self.stats is None:
            return None if self.floating else frozenset()
        return nonfinite_kinds(self.stats)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def abs_max(self) -> float | None:
        """max(|min|, |max|); None without statistics or for an empty tensor."""
        if self.stats is None or self.stats["min"] is None or self.stats["max"] is None:
            return None
        return max(abs(self.stats["min"]), abs(self.stats["max"]))

    @property
    def nonfinite(self) -> int | None:
        """How many elements were NaN or Inf; None without statistics."""
        if self.stats is None:
            return None
        return int(self.stats["nan"]) + int(self.stats["inf"])


def _all_finite(tensors: list[TensorRecord]) -> bool | None:
    known = [t.finite for t in tensors]
    if False in known:
        return False
    return None if None in known else True


@dataclass(slots=True)
class OpRecord:
    """One traced op call, as loaded from a run."""

    index: int
    id: str
    name: str
    phase: str
    module: str
    module_call: int
    module_stack: list[str]
    step: int
    rank: int
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    stack: list[str] | None = None
    """Python call site, outermost frame first (when recorded with ``stack=True``)."""
    group: dict[str, Any] | None = None
    """Collectives: their process group, ``{"size", "name", "ranks"}`` (global ranks)."""
    layout: dict[str, Any] | None = None
    """A local op that ran for a DTensor op: ``{"of": the DTensor op's name, "role": "compute" or
    "redistribute", "mesh": {"shape", "names", "ranks"}, "in": [placements or None per tensor
    input], "out": [... per result]}``; placements are one string per mesh dim (``"S(0)"``,
    ``"R"``, ``"P(sum)"``). None for an op on plain tensors (and in runs written before it)."""
    autocast: dict[str, str] | None = None
    """The autocast policy a forward (or recompute) op ran under, as the tracer read it at module
    calls (``probe.tracer.autocast_policy``): ``{device type: dtype}`` for each device type autocast
    was enabled for (``{"cpu": "bfloat16"}``), ``{}`` when it was off. None where it is not known:
    ops of other phases, and runs written before it was recorded."""
    fp8_scales: dict[str, dict[str, Any]] | None = None
    """fp8 ops (stats mode): the scales they were given, ``{argument: {"shape", "values", "min",
    "max"}}`` (``scale_a``, ``scale_b``, ``scale_result``, a float8 subclass input's ``_scale``)."""

    @property
    def inputs_finite(self) -> bool | None:
        """False if an input held a NaN or Inf; otherwise None if any input's statistics are
        unknown (never a guess: a weight read from outside the traced step, without
        ``inputs=True``, is unknown); True when every input is known finite (or there are none)."""
        return _all_finite(self.inputs)

    @property
    def outputs_finite(self) -> bool | None:
        """As :attr:`inputs_finite`, for the outputs."""
        return _all_finite(self.outputs)

    def __repr__(self) -> str:
        return f"OpRecord({self.id!r}, step={self.step}, rank={self.rank})"


@dataclass(slots=True)
class WriteFailure:
    """A step (or tail) whose files could not be written: given up, training went on
    (``run.write_failures()``, from ``rankR/write_failures.jsonl``)."""

    rank: int
    step: int
    error: str
    """The OS error's message (``No space left on device``)."""
    tail: bool = False
    """The tail after the last ``session.step()``, not a step."""
    directory: str | None = None
    """The partial directory left behind, emptied (``.step2.partial``); None if never created."""
    file: str | None = None
    """The file that failed, relative to the rank directory."""
    errno: int | None = None
    ops: int = 0
    """How many op records the step had (all lost)."""
    modes: tuple[str, ...] = ()
    """The modes whose results the step held."""
    time: str = ""

    def describe(self) -> str:
        what = f"tail {self.step}" if self.tail else f"step {self.step}"
        where = f"{self.file}: " if self.file else ""
        return (f"{what} rank {self.rank}: lost, not written ({where}{self.error}); {self.ops} ops"
                + (f", modes {', '.join(self.modes)}" if self.modes else ""))


@dataclass
class StepInfo:
    """The manifest of one flushed step."""

    step: int
    rank: int
    complete: bool
    reason: str | None
    manifest: dict[str, Any] = field(repr=False)


_READS_SHAPE_ONLY = frozenset({
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
})
"""Ops that read only a tensor's shape and dtype (``loss.backward()`` seeds its gradient with
``ones_like(loss)``): reading a non-finite value this way passes nothing on."""


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
        if _short_name(op) in _READS_SHAPE_ONLY:
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
        held = held_by(op, op.inputs) if _short_name(op) not in _READS_SHAPE_ONLY else set()
        if reached - held:
            origins.append(op)
    return origins


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
        if short in _READS_SHAPE_ONLY or all(t.source is not None and t.source[0] in constant
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


# -- what the modes' readers return (their files are theirs; the records are shared) --
