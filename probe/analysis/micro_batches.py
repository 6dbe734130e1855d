"""Gradient accumulation: one run's step takes k micro-batches per optimizer step, the other's
another number (one full batch, say).

Such a step is the same training step computed over other slices of the batch: the model is
called k times, each call's backward adds into ``.grad`` (``param.grad += ...`` after the
first), the loss is divided by k, and the optimizer steps once. Its forward and backward ops
have no partner op for op (a micro-batch's op sees half the rows of the full batch's), so they
are "not compared" with the reason, never paired by position and never taken as agreement.
What both runs compute on whole values is compared as usual: the ops after the last backward
op (gradient clipping, a GradScaler's unscale, the optimizer step), which read the accumulated
gradients and write the parameters the next step reads.

The structure is recognised from the records alone: every module both runs call in forward is
called r times as often in run B as in run A, for one ratio r other than 1.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from probe.rundir.run import OpRecord


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


def micro_batches(ops_a: list[OpRecord], ops_b: list[OpRecord],
                  rename: Callable[[str], str] = lambda module: module) -> MicroBatches | None:
    """The runs' micro-batches in one step when they differ (None: they call the model alike, or
    no module both call tells). ``rename`` maps run B's module names into run A's."""
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
