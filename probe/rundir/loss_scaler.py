"""What ``torch.amp.GradScaler`` did in a step, read from the ops it ran.

fp16 training multiplies the loss by a scale (65536 by default) so that small gradients
do not flush to zero. After each backward the scaler checks the gradients: when one
holds an Inf or NaN (the scale was too large: the gradients overflowed) it skips
``optimizer.step`` and halves the scale. The first steps of a run usually overflow this
way. That is the scaler doing its job, not a fault of the model, and this module exists so
the analyses can say so instead of reporting the overflow's first op as the step's fault.

The tracer sees the scaler's work as aten ops, outside every module:

- ``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: multiplies
  the gradients by ``inv_scale`` (1 / scale) and sets ``found_inf`` to 1 when one held an
  Inf or NaN. It runs once per optimizer and per device and dtype of the gradients, and
  writes its arguments in place: the stats mode records the written ``found_inf`` as its
  last output. ``inv_scale`` is its last input, computed from the scale by
  ``scale.double().reciprocal().float()`` (an ``aten.reciprocal`` whose input is the
  scale);
- ``_amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval)``:
  updates the scale in place (halved on overflow, doubled after ``interval`` clean steps);
  its first output is the next step's scale.

:func:`scaler_step` turns these records into a :class:`ScalerStep`: whether the step
overflowed (a ``found_inf`` output above 0: then the scaler skipped the optimizer step)
and the scale in force. The scale is read, in this order, from the update's scale input
(known in the step that created it, or with ``inputs=True``), from the input of the
``reciprocal`` that made ``inv_scale`` (exact: the scale widened to fp64), or as
``1 / inv_scale`` rounded to fp32 (exact for the powers of two GradScaler's defaults keep).

A mode may record the same two facts itself (the monitor's ``scaler=`` series): where no op was
traced, the run asks each mode of the step through its reader's declared capability
(:meth:`probe.rundir.mode_files.ModeFiles.loss_scaler`), naming none.

Limits: with several optimizers under one scaler, each skips its own step when its own
gradients overflowed; a step is called skipped here when any of them did (the scaler backs
off the scale then). Without the stats mode, or with ``ops=`` filters that leave out the
scaler's ops, nothing is known: :func:`scaler_step` returns None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from probe.rundir.records import OpRecord, TensorRecord

SCALER_OP_PREFIX = "aten._amp_"
"""Names of the loss scaler's own aten ops start with this."""
_UNSCALE = "aten._amp_foreach_non_finite_check_and_unscale_."
_UPDATE = "aten._amp_update_scale_."
_SCALE_CASTS = frozenset({"_to_copy", "clone"})
"""Ops between the scale and ``inv_scale`` other than the reciprocal: dtype and device copies."""
_CHAIN_HOPS = 8
"""The most producers followed back from ``inv_scale`` (GradScaler's chain has four)."""


def is_scaler_op(op: OpRecord) -> bool:
    """Whether ``op`` is one of the loss scaler's own aten ops (``_amp_*``)."""
    return op.name.startswith(SCALER_OP_PREFIX)


def format_scale(value: float) -> str:
    """A scale as people write it: ``65536``, ``0.5``, ``1.5e+20``."""
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.6g}"


@dataclass(frozen=True, slots=True)
class ScalerStep:
    """What the loss scaler did in one step (``run.loss_scaler(step)``, ``run.skipped_steps()``)."""

    step: int
    rank: int
    overflowed: bool | None
    """A gradient held an Inf or NaN (``found_inf`` set): the scaler skipped the optimizer step
    and backed off the scale. None when ``found_inf`` was not recorded."""
    scale: float | None
    """The scale in force during the step (the loss was multiplied by it); None when not recorded."""
    next_scale: float | None
    """The scale after the step's update (the next step's); None when the update was not recorded."""
    ops: frozenset[int]
    """Indices of the scaler's own ops in the step: its ``_amp_*`` ops, the copies and the
    reciprocal that made ``inv_scale`` from the scale, and the op that created the scale."""

    @property
    def skipped(self) -> bool:
        """The scaler skipped this step's optimizer step (its gradients overflowed)."""
        return self.overflowed is True

    def owns(self, op: OpRecord) -> bool:
        """Whether ``op`` is the scaler's work, not the model's: one of :attr:`ops`, an ``_amp_*``
        op, or a multiplication by the scale outside every module (``scaler.scale(loss)`` and
        its backward, which seeds the gradients with the scale)."""
        return op.index in self.ops or is_scaler_op(op) or self._scales(op)

    def _scales(self, op: OpRecord) -> bool:
        """``op`` multiplies a one-element tensor by the scale: its output is its first input
        times :attr:`scale` (up to fp32 rounding)."""
        if self.scale is None or op.module or not op.name.startswith("aten.mul.") or len(op.outputs) != 1:
            return False
        factor, product = _value(op.inputs[0]) if op.inputs else None, _value(op.outputs[0])
        if factor is None or product is None:
            return False
        return abs(product - factor * self.scale) <= 1e-6 * abs(product)

    def describe(self) -> str:
        """``step N skipped by the loss scaler: gradients overflowed at scale S``, or the scale
        of a step that was not skipped."""
        scale = "an unrecorded scale" if self.scale is None else f"scale {format_scale(self.scale)}"
        if self.skipped:
            return f"step {self.step} skipped by the loss scaler: gradients overflowed at {scale}"
        if self.overflowed is None:
            return f"step {self.step}: loss scaler at {scale}, whether it overflowed is not recorded"
        return f"step {self.step}: loss scaler at {scale}, no overflow"


def _value(tensor: TensorRecord | None) -> float | None:
    """The value of a one-element tensor from its statistics; None when unknown."""
    if tensor is None or tensor.numel != 1 or tensor.stats is None:
        return None
    value = tensor.stats["max"]
    return float(value) if value is not None and math.isfinite(value) else None


def _scale_from_inv(unscale: OpRecord, op_at: Callable[[int], OpRecord], ops: set[int]) -> float | None:
    """The scale that ``unscale``'s ``inv_scale`` was computed from, adding the ops of that
    computation to ``ops``: the input of the ``reciprocal`` when it is recorded, else
    ``1 / inv_scale`` rounded to fp32 (the scale's dtype)."""
    inv = unscale.inputs[-1] if unscale.inputs else None
    found: float | None = None
    tensor = inv
    for _ in range(_CHAIN_HOPS):
        if tensor is None or tensor.source is None:
            break
        producer = op_at(tensor.source[0])
        short = producer.name.split(".")[1] if producer.name.count(".") >= 2 else producer.name
        if short == "reciprocal" and producer.inputs:
            ops.add(producer.index)
            found = _value(producer.inputs[0]) if found is None else found
        elif short not in _SCALE_CASTS or len(producer.inputs) != 1:
            break
        ops.add(producer.index)
        tensor = producer.inputs[0] if producer.inputs else None
    if found is not None:
        return found
    inverse = _value(inv)
    return None if inverse is None or inverse == 0 else float(np.float32(1.0 / inverse))


def scaler_step(step: int, rank: int, scaler_ops: Iterable[OpRecord],
                op_at: Callable[[int], OpRecord]) -> ScalerStep | None:
    """What the loss scaler did in one step, from its ``_amp_*`` op records (``scaler_ops``, in
    execution order; others are ignored) and ``op_at`` (the step's op #i, to follow where
    ``inv_scale`` and the scale came from). None when the step ran no scaler op."""
    unscales, updates = [], []
    for op in scaler_ops:
        if op.name.startswith(_UNSCALE):
            unscales.append(op)
        elif op.name.startswith(_UPDATE):
            updates.append(op)
    if not unscales and not updates:
        return None
    ops = {op.index for op in (*unscales, *updates)}
    # found_inf is the last tensor the unscale writes: recorded after the op, so it holds its verdict.
    flags = [_value(op.outputs[-1]) for op in unscales if op.outputs]
    known = [flag for flag in flags if flag is not None]
    overflowed: bool | None = any(flag > 0 for flag in known) if known else None
    scale = next_scale = None
    if updates:
        update = updates[-1]
        next_scale = _value(update.outputs[0]) if update.outputs else None
        if update.inputs:
            scale = _value(update.inputs[0])
            source = update.inputs[0].source
            if source is not None and not op_at(source[0]).inputs:  # the scale's creation (a full)
                ops.add(source[0])
        if overflowed is None and len(update.inputs) > 2:
            # No unscale recorded (filtered out): the found_inf the update read.
            flag = _value(update.inputs[2])
            overflowed = None if flag is None else flag > 0
    for unscale in unscales:
        from_inv = _scale_from_inv(unscale, op_at, ops)
        scale = from_inv if scale is None else scale
    return ScalerStep(step, rank, overflowed, scale, next_scale, frozenset(ops))


def scaler_step_in(ops: list[OpRecord]) -> ScalerStep | None:
    """:func:`scaler_step` over every op record of one step (``ops``, in execution order)."""
    if not ops:
        return None
    return scaler_step(ops[0].step, ops[0].rank, (op for op in ops if is_scaler_op(op)), ops.__getitem__)


def handled_by_scaler(origins: list[OpRecord], scaler: ScalerStep | None) -> bool:
    """Whether a step's non-finite faults (``origins``: :func:`probe.rundir.nonfinite_origins.
    nonfinite_origins_in`) are all a gradient overflow the loss scaler handled: it skipped the
    step, and each fault started in the backward (where the scaled loss's gradient flows) or
    in one of the scaler's own ops. A fault that started in the forward is the model's: the
    scaler skipping that step does not make it one of its overflows."""
    if scaler is None or not scaler.skipped or not origins:
        return False
    return all(op.phase == "backward" or scaler.owns(op) for op in origins)
