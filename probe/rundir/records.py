"""The records every run holds, as ``probe.load`` returns them: ops, their tensors, step
manifests, steps the writer gave up. A mode's own records (the monitor's series, the free
benchmark's checks, the stats mode's non-finite parameters, the dump's index entries) live in its
package, beside the reader that makes them.

Plain data with no reading logic, so the reader, the op graph and every analysis
share them without depending on one another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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
    sketch: tuple[float, ...] | None = None
    """With the stats mode's ``sketch=True``: projections of the values on fixed random signs,
    whose difference between two runs estimates how far their elements are apart
    (``analysis.precision.sketch_error``); None when not recorded (integer tensors, broadcast views)."""

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


def module_frame(entry: str) -> tuple[str, int] | None:
    """An entry of an op's ``module_stack``, ``fqn[call]`` (``model.layers.1[0]``), as (fqn, call);
    None when it is not of that form."""
    name, bracket, call = entry.rpartition("[")
    if not bracket or not call.endswith("]") or not call[:-1].isdigit():
        return None
    return name, int(call[:-1])


def frame_module(entry: str) -> str:
    """The module of a ``module_stack`` entry (``model.layers.1[0]`` -> ``model.layers.1``); the
    entry itself when it is not ``fqn[call]``."""
    frame = module_frame(entry)
    return entry if frame is None else frame[0]


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
    constants: dict[str, float | str] = field(default_factory=dict)
    """The floats and strings the call was given beside its tensors (an eps, a scale, a fill
    value, an approximation's name), by argument position (``"4"``) or keyword name; empty in
    runs written before they were recorded."""
    parameter: str | None = None
    """An optimizer op: the parameter it works for (``layers.0.mlp.up.weight``), the one whose
    value, gradient or optimizer state it read (``probe.tracer.updated_parameters``); None for other
    phases, an op of several parameters (a ``foreach`` op) or none, and runs written before it."""
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


# -- what the modes' readers return (their files are theirs; the records are shared) --
