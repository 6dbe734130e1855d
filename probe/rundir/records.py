"""The records a run holds, as ``probe.load`` returns them: ops, their tensors, checks,
monitor series and alerts, step manifests, steps the writer gave up.

Plain data with no reading logic, so the reader, the op graph and every analysis
share them without depending on one another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TensorRecord:
    """A tensor argument or result of a recorded op."""

    dtype: str
    shape: tuple[int, ...]
    stats: dict[str, float | int | None] | None = None
    """min, max, mean, norm (floats; None for empty tensors), nan, inf (counts)."""
    source: tuple[int, int] | None = None
    """For inputs: (index of the producing op in this step, its output position)."""
    mutated: bool = False
    """For outputs: an argument the op wrote in place."""
    skipped: str | None = None
    """Why the probe kept nothing of this tensor (no source, statistics or dump): "inference",
    "sparse", "nested", "zero", "meta" or "no storage"; None for a tensor it could key."""

    @property
    def finite(self) -> bool | None:
        """False if the tensor held a NaN or Inf; None without statistics."""
        if self.stats is None:
            return None
        return self.stats["nan"] == 0 and self.stats["inf"] == 0

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

    @property
    def inputs_finite(self) -> bool | None:
        """Whether every input with known statistics was finite; None if none are known."""
        known = [t.finite for t in self.inputs if t.finite is not None]
        if not known:
            return None
        return all(known)

    @property
    def outputs_finite(self) -> bool | None:
        known = [t.finite for t in self.outputs if t.finite is not None]
        if not known:
            return None
        return all(known)

    def __repr__(self) -> str:
        return f"OpRecord({self.id!r}, step={self.step}, rank={self.rank})"


@dataclass(slots=True)
class CheckRecord:
    """One free-benchmark check of one op output (``run.checks()``)."""

    step: int
    rank: int
    op_index: int
    op_id: str
    name: str
    module: str
    phase: str
    perturb: str
    verdict: str
    """"pass", "fail" or "skip"."""
    output: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    ratio: float | None = None
    """Largest output deviation, relative to ``max(|original|, rms(original))``."""
    threshold: float | None = None
    input_change: float | None = None
    nonfinite_mismatch: int = 0
    sign_flips: int = 0
    reason: str | None = None
    """Why a check was skipped."""


@dataclass(slots=True)
class MonitorRecord:
    """One monitored series at one step (``run.monitor()``): metrics in fp64."""

    step: int
    rank: int
    kind: str
    """activation, weight_grad, weight, exp_avg, exp_avg_sq, update or update_ratio."""
    name: str
    """Module FQN (activations) or parameter name."""
    slot: str
    """input, output, input_grad or output_grad for activations; "" otherwise."""
    call: int
    min: float
    max: float
    mean: float
    norm: float
    zeros: float
    nans: float
    infs: float
    numel: float


@dataclass(slots=True)
class AnomalyRecord:
    """One monitor alert (``run.anomalies()``)."""

    step: int
    rank: int
    module: str
    metric: str
    """``<slot or kind>.<metric>``, e.g. ``output_grad.norm``."""
    value: float
    baseline: float | None
    rule: str
    """nonfinite, turbulence or ``rule:<name>`` of a user rule."""
    kind: str
    call: int = 0
    reason: str = ""

    def describe(self) -> str:
        base = "" if self.baseline is None else f" (baseline {self.baseline:.4g})"
        why = f": {self.reason}" if self.reason else ""
        return (f"step {self.step} rank {self.rank} {self.rule}: {self.module} {self.metric} = "
                f"{self.value:.4g}{base}{why}")


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


def first_nonfinite_in(ops: list[OpRecord]) -> OpRecord | None:
    """The first op of ``ops`` with an output that held a NaN or Inf (ops without statistics never)."""
    for op in ops:
        if any(t.finite is False for t in op.outputs):
            return op
    return None
