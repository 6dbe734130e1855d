"""What each run's precision explains: policies, lowered precision, and rounding bounds.

Two runs that differ only in precision policy (bf16 autocast, a model-wide fp16, another
device's kernels) never agree bit for bit; ``compare`` asks of each op whether its
difference is what its inputs' differences, carried through the op, plus each run's own
rounding of the op give. This module holds the parts of that judgement that do not need
the compare machinery:

- :func:`lowered_precision`: the ops of run B that compute at a lower precision than run
  A where B's own policy does not explain it. Explained are autocast (a matmul-like op
  computed lower, and the casts feeding one), a model-wide dtype (B's parameters are of
  that dtype), gradients (they take the dtype of their forward tensors) and inherited
  precision (an op whose inputs arrived lower). Anything else is a finding: a bf16
  RMSNorm inside an fp32 or autocast run is a real bug even though each of its ops
  rounds as bf16 should.
- :func:`rounding` and :func:`own_error`: how far one run's result of an op may sit from
  its exact (fp64) result on that run's own inputs (the free benchmark's bound, from
  ``probe.modes.free_benchmark.perturbations``), and how far it does.
- :func:`describe_policy`: the words for a report whose differences precision explains.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from probe.analysis.metrics import TensorMetrics
from probe.rundir.loss_scaler import is_scaler_op, scaler_step_in
from probe.rundir.run import OpRecord, TensorRecord
from probe.vocabulary.rounding import CONDITION, ROUNDING_ULPS, eps, reduction_length, threshold

__all__ = [
    "CONDITION",
    "Lowering",
    "data_error",
    "describe_policy",
    "differing_error",
    "lowered_precision",
    "own_error",
    "rounding",
    "stats_error",
]

# Ops autocast computes in the lower dtype (torch's CUDA/CPU "lower_precision_fp" lists,
# short names): a lower precision here, or a cast feeding one, is the policy at work.
AUTOCAST_LOWERED = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot",
    "chain_matmul", "multi_dot", "convolution", "_convolution", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_native_multi_head_attention", "_weight_norm",
})
# Ops whose precision decides their result's (softmax, log_softmax, losses, norms): autocast
# keeps them in float32 on the accelerators (torch's CUDA "fp32" list, short names).
PRECISION_SENSITIVE = frozenset({
    "_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "layer_norm",
    "native_group_norm", "group_norm", "nll_loss_forward", "nll_loss", "nll_loss2d_forward",
    "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div",
})
# What autocast keeps in float32 whatever its inputs' dtype, by device type: one computed lower
# inside an autocast region was lowered by something else. CPU autocast keeps losses only (its
# softmax and norms follow their inputs' dtype); other devices follow CUDA's list.
_CPU_KEPT_FP32 = frozenset({"nll_loss_forward", "nll_loss", "nll_loss2d_forward",
                            "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss",
                            "kl_div"})
AUTOCAST_KEPT_FP32 = {"cpu": _CPU_KEPT_FP32}
# Ops that move values without computing on them: a cast's consumers are looked for past them.
_PASS_THROUGH = frozenset({
    "t", "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "permute", "expand", "contiguous",
    "clone", "detach", "alias", "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "as_strided", "lift_fresh", "dropout", "native_dropout", "expand_as", "view_as",
})
_CASTS = frozenset({"_to_copy", "to", "copy_", "_to_dtype", "type_as"})


def short_name(name: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 else parts[-1]


def _floating(dtype: str) -> torch.dtype | None:
    value = getattr(torch, dtype, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


_RANKS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def _lowest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    return min(dtypes, key=lambda d: _RANKS.get(d, 0)) if dtypes else None


def output_precision(op: OpRecord) -> torch.dtype | None:
    """The lowest precision any floating result of ``op`` is held in (None: no floating result)."""
    return _lowest([d for t in op.outputs if (d := _floating(t.dtype)) is not None])


def input_precision(op: OpRecord) -> torch.dtype | None:
    return _lowest([d for t in op.inputs if (d := _floating(t.dtype)) is not None])


def model_dtype(ops: list[OpRecord]) -> torch.dtype | None:
    """The floating dtype most inputs from outside the step (parameters, data) have."""
    counts = Counter(d for op in ops for t in op.inputs
                     if t.source is None and (d := _floating(t.dtype)) is not None)
    return counts.most_common(1)[0][0] if counts else None


def lower_of(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes."""
    return a if _lower(a, b) else b


def _lower(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether ``a`` is less precise than ``b``."""
    return _RANKS.get(a, 0) < _RANKS.get(b, 0)


def _dtype_word(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autocast_lowers_to(op: OpRecord, dtype: torch.dtype) -> bool | None:
    """Whether autocast, as recorded for ``op``, explains a result in ``dtype``: ``dtype`` is no
    coarser than a dtype the policy computes in. False where autocast was off, or where its policy
    rounds only to finer dtypes (a bf16 result under fp16 autocast: an 8-bit mantissa where autocast
    rounds to 11 bits); None where the policy is not known (the dtypes decide)."""
    if op.autocast is None:
        return None
    lowered = [d for d in map(_floating, op.autocast.values()) if d is not None]
    return any(not _lower(dtype, d) for d in lowered)


def kept_fp32(op: OpRecord) -> bool:
    """Whether autocast, enabled for ``op`` by its recorded policy, computes it in float32 whatever
    its inputs' dtype (``AUTOCAST_KEPT_FP32`` of the policy's device types)."""
    short = short_name(op.name)
    return any(short in AUTOCAST_KEPT_FP32.get(device, PRECISION_SENSITIVE) for device in op.autocast or ())


@dataclass
class Lowering:
    """An op of run B that computes at a lower precision than run A, unexplained by B's policy."""

    op: OpRecord
    before: torch.dtype
    after: torch.dtype
    only_in_b: bool
    range_only: bool = False
    """Finer but of a narrower range (bf16 -> fp16: values past 65504 become inf)."""

    @property
    def message(self) -> str:
        how = "by an explicit cast" if short_name(self.op.name) in _CASTS else f"by {self.op.name}"
        where = self.op.module or "<outside modules>"
        extra = " (an op of run B only)" if self.only_in_b else ""
        if self.range_only:
            return (f"range narrowed in {where}: {_dtype_word(self.before)} -> {_dtype_word(self.after)} "
                    f"(largest value {torch.finfo(self.before).max:.3g} -> "
                    f"{torch.finfo(self.after).max:.3g}) "
                    f"{how}{extra}, which neither autocast nor run B's model dtype explains")
        if self.op.autocast is not None and not self.op.autocast:
            why = "outside any autocast region (recorded), and run B's model dtype does not explain it"
        elif self.op.autocast and kept_fp32(self.op):
            why = "inside an autocast region, which keeps this op in float32"
        elif self.op.autocast and not autocast_lowers_to(self.op, self.after):
            policy = ", ".join(sorted(set(self.op.autocast.values())))
            why = f"coarser than the autocast region's {policy}, and run B's model dtype does not explain it"
        else:
            why = "which neither autocast nor run B's model dtype explains"
        return (f"precision lowered in {where}: {_dtype_word(self.before)} -> {_dtype_word(self.after)} "
                f"{how}{extra}, {why}")


def _terminal_consumers(op: OpRecord, consumers: dict[int, list[OpRecord]],
                        through_casts: bool = False) -> list[OpRecord]:
    """Who computes on ``op``'s result in its own phase, looking past views, copies and dropout.

    A backward op reading the result (a tensor the forward op saved for its gradient) is
    the backward of a forward consumer, not a consumer of its own: autocast's cast feeding
    SDPA is read again by SDPA's backward, which is autocast's too."""
    seen, found, stack = {op.index}, [], list(consumers.get(op.index, []))
    while stack:
        other = stack.pop()
        if other.index in seen or other.phase != op.phase:
            continue
        seen.add(other.index)
        if short_name(other.name) in _PASS_THROUGH or (through_casts and short_name(other.name) in _CASTS):
            stack += consumers.get(other.index, [])
        else:
            found.append(other)
    return found


def _in_sdpa_math(op: OpRecord, consumers: dict[int, list[OpRecord]], depth: int = 8) -> bool:
    """Whether ``op`` is part of SDPA's math path, which autocast lowers as SDPA: an op within
    ``depth`` ops before its ``_safe_softmax`` (the query's scaling, transpose, expand, view, bmm,
    view and mask add of the decomposition) (an op SDPA's decomposition alone uses; the path
    it takes where no fused kernel applies, e.g. a float mask such as T5's position bias)."""
    frontier = [op]
    for _ in range(depth + 1):
        if any(short_name(o.name) == "_safe_softmax" for o in frontier):
            return True
        frontier = [c for o in frontier for c in consumers.get(o.index, []) if c.phase == op.phase]
    return False


def lowered_precision(ops_a: list[OpRecord], ops_b: list[OpRecord],
                      partner_of_b: dict[int, OpRecord]) -> dict[int, Lowering]:
    """B ops (by index) that lower precision where B's policy does not explain it.

    An op lowers precision when its result is less precise than its floating inputs in
    B and than the matched op's result in A (a B-only op: than its inputs). Explained:
    matmul-like ops autocast lowers and the casts that feed one, results in B's
    model-wide dtype when it is lower than A's, and backward ops (a gradient takes
    the dtype of its forward tensor; the forward lowering is what gets reported).
    """
    consumers: dict[int, list[OpRecord]] = defaultdict(list)
    for op in ops_b:
        for t in op.inputs:
            if t.source is not None:
                consumers[t.source[0]].append(op)
    dtype_a, dtype_b = model_dtype(ops_a), model_dtype(ops_b)
    model_lowered = dtype_a is not None and dtype_b is not None and _lower(dtype_b, dtype_a)
    ops_by_index = {op.index: op for op in ops_b}
    held = held_precision(ops_b)
    found: dict[int, Lowering] = {}
    for op in ops_b:
        out, inp = output_precision(op), input_precision(op)
        if out is None or inp is None or op.phase != "forward":
            continue
        partner = partner_of_b.get(op.index)
        if not _lower(out, inp):
            # Not a new lowering (created in its dtype, or inherited), unless autocast keeps the
            # op in float32 and run A computed it higher: then something else lowered it.
            reference = output_precision(partner) if partner is not None else None
            if op.autocast and kept_fp32(op) and reference is not None and _lower(out, reference):
                found[op.index] = Lowering(op, reference, out, False)
            elif _narrows_range(op, out, inp, reference, dtype_b) and _terminal_consumers(op, consumers):
                found[op.index] = Lowering(op, reference or inp, out, partner is None, range_only=True)
            continue
        reference = output_precision(partner) if partner is not None else inp
        if reference is None or not _lower(out, reference):
            continue  # run A lowers here too
        # Autocast explains a lowering to its own dtype only: a result rounded coarser than the
        # recorded policy's dtype (bf16 under fp16 autocast) is some other cast's.
        autocast = autocast_lowers_to(op, out) is not False  # to its dtype, or not recorded
        if autocast and short_name(op.name) in AUTOCAST_LOWERED:
            continue
        targets = _terminal_consumers(op, consumers)
        if not targets:
            continue  # nothing in the step computes on it
        restores = _restores_arrival_dtype(op, out, ops_by_index)
        decides = any(short_name(t.name) in PRECISION_SENSITIVE for t in targets)
        if model_lowered and out == dtype_b and not (restores and decides):
            # B's model-wide dtype, except where the program widened a value for a softmax, a norm or
            # a loss and a cast put it back: the model's `logits.float()` before the loss says the
            # loss is computed in float32 whatever the model's dtype, and the cast undoes that.
            continue
        if restores and not decides:
            # The model's own cast back to the dtype its value arrived in (a norm's output), judged
            # by its effect; not where it decides the precision of a softmax, norm or loss.
            continue
        # Each consumer either meets an operand that arrived in ``out`` (``x.to(y.dtype) + y``) or,
        # where autocast is on, is an op it lowers: then this is autocast's cast at its input
        # (autocast makes casts only), past a cast back up (SDPA's math path computes in float32).
        autocast_cast = autocast and short_name(op.name) in _CASTS
        if all(_meets_its_dtype(t, op, out, ops_by_index, held)
               or (autocast_cast and _lowered_by_autocast(t, consumers)) for t in targets):
            continue
        scaler = _terminal_consumers(op, consumers, through_casts=True)
        if scaler and all(is_scaler_op(t) for t in scaler):
            continue  # the loss scaler's own bookkeeping (its inverse scale in fp32)
        found[op.index] = Lowering(op, reference, out, partner is None)
    return found


def _narrows_range(op: OpRecord, out: torch.dtype, inp: torch.dtype, reference: torch.dtype | None,
                   model: torch.dtype | None) -> bool:
    """A cast to a finer dtype of a narrower range (bf16 -> fp16) that run A does not make and
    nothing recorded explains: an autocast region casts only to its own dtype, and a model held in
    fp16 casts to fp16 by design. Not a rounding but an overflow waiting for a value past 65504."""
    if short_name(op.name) not in _CASTS or out == model:
        return False
    narrower = torch.finfo(out).max < torch.finfo(inp).max
    if not narrower or (reference is not None and torch.finfo(reference).max <= torch.finfo(out).max):
        return False  # run A holds it in that range too
    # Only a region casting to ``out`` itself explains it (autocast_lowers_to asks "no coarser than").
    return out not in {_floating(d) for d in (op.autocast or {}).values()}


def _lowered_by_autocast(op: OpRecord, consumers: dict[int, list[OpRecord]]) -> bool:
    """Whether ``op`` is one autocast computes lower, or (a cast back up) feeds only such ops or
    SDPA's math path."""
    if short_name(op.name) in _CASTS:
        after = _terminal_consumers(op, consumers)
        return bool(after) and all(_lowered_by_autocast(t, consumers) for t in after)
    return short_name(op.name) in AUTOCAST_LOWERED or _in_sdpa_math(op, consumers)


def _meets_its_dtype(consumer: OpRecord, cast: OpRecord, dtype: torch.dtype,
                     ops: dict[int, OpRecord], held: dict[tuple[int, int], torch.dtype]) -> bool:
    """Whether ``consumer`` computes ``cast``'s result together with another operand that holds
    ``dtype``'s rounding already and is not made from ``cast`` (a bias cast to a projection's
    dtype before it is added, ``scale.to(query.dtype)``, rotary's ``cos.to(x.dtype)`` multiplying
    a value widened from a bf16 projection): the cast matches the precision that operand brought;
    it lowers nothing the computation still held. ``held``: :func:`held_precision` of the run."""
    for t in consumer.inputs:
        producer = ops.get(t.source[0]) if t.source is not None else None
        if producer is None or _floating(t.dtype) is None:
            continue
        brought = held.get((t.source[0], t.source[1]), _floating(t.dtype))
        if (brought is not None and not _lower(dtype, brought) and not _made_from(producer, cast.index, ops)
                and not _lowered_by_cast(producer, ops)):
            return True
    return False


def _lowered_by_cast(op: OpRecord, ops: dict[int, OpRecord], limit: int = 16) -> bool:
    """Whether ``op``'s result is, through views, a cast's that lowered its value: an operand cast
    down beside another (``F.linear(x.to(bf16), w.to(bf16))``) brought no precision of its own.
    Not a cast back to the dtype the value arrived in (a QK-norm's ``.to(input_dtype)`` of a query
    an fp16 projection made): that operand brings its arrival dtype's precision."""
    for _ in range(limit):
        short = short_name(op.name)
        if short in _CASTS:
            out, inp = output_precision(op), input_precision(op)
            return out is not None and inp is not None and _lower(out, inp) \
                and not _restores_arrival_dtype(op, out, ops)
        if short not in _PASS_THROUGH or not op.inputs or op.inputs[0].source is None:
            return False
        producer = ops.get(op.inputs[0].source[0])
        if producer is None:
            return False
        op = producer
    return False


def _made_from(op: OpRecord, index: int, ops: dict[int, OpRecord], limit: int = 16) -> bool:
    """Whether ``op``'s result is ``index``'s, passed through views and casts (within ``limit`` ops)."""
    for _ in range(limit):
        if op.index == index:
            return True
        if short_name(op.name) not in _PASS_THROUGH | _CASTS or not op.inputs or op.inputs[0].source is None:
            return False
        op = ops.get(op.inputs[0].source[0])
        if op is None:
            return False
    return False


_RESTORE_WALK = 64
"""The most ops walked back from a cast to find where its value was widened."""


def _restores_arrival_dtype(cast: OpRecord, dtype: torch.dtype, ops: dict[int, OpRecord]) -> bool:
    """Whether ``cast`` puts its value back into ``dtype`` after the same module call widened it
    from ``dtype``: the ``x.to(float32) ... .to(input_dtype)`` a norm wraps its arithmetic in, or
    rotary embeddings' ``(q * cos + ...).to(q.dtype)`` after type promotion widened ``q``.

    Such a cast lowers nothing the module received: what entered it was already in ``dtype``
    (under autocast, a projection's output), and the rounding it adds is the propagation rules'
    to judge by its effect. A cast of a value that arrived in the higher precision (a residual
    stream cast to bf16 before a norm) finds no such widening and stays a lowering.
    """
    call = (cast.phase, cast.module, cast.module_call)
    stack = [t.source[0] for t in cast.inputs if t.source is not None]
    seen: set[int] = set()
    while stack and len(seen) < _RESTORE_WALK:
        index = stack.pop()
        op = ops.get(index)
        if op is None or index in seen or (op.phase, op.module, op.module_call) != call:
            continue
        seen.add(index)
        widened_to = output_precision(op)
        if widened_to is not None and input_precision(op) == dtype and _lower(dtype, widened_to):
            return True  # a cast up from ``dtype``, or arithmetic promoting a ``dtype`` operand
        stack += [t.source[0] for t in op.inputs if t.source is not None]
    return False


def describe_policy(ops_a: list[OpRecord], ops_b: list[OpRecord]) -> str:
    """How run B's precision differs from run A's, in words ("bf16 autocast", ...)."""
    dtype_a, dtype_b = model_dtype(ops_a), model_dtype(ops_b)
    if dtype_a is not None and dtype_b is not None and dtype_a != dtype_b:
        return f"the precision of run B ({_dtype_word(dtype_b)} throughout, run A {_dtype_word(dtype_a)})"
    lowered = Counter(out for op in ops_b if short_name(op.name) in AUTOCAST_LOWERED
                      and (out := output_precision(op)) is not None
                      and dtype_b is not None and _lower(out, dtype_b))
    if lowered:
        dtype = lowered.most_common(1)[0][0]
        word = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "low-precision")
        return f"{word} autocast"
    return "rounding (other kernels or another device)"


def rounding(dtype: torch.dtype, reduction: int = 1, floor: bool = True) -> float:
    """How far (relative) one run's result of an op may sit from the exact result on its inputs.

    The free benchmark's bound: ``ROUNDING_ULPS`` ULPs of the result's dtype, times
    ``sqrt(K)`` for a contraction over K terms; ``floor`` adds its relative floor (1e-5),
    below which no error matters for training. Statistics of bit-identical runs are
    judged without the floor (``floor=False``), so one changed weight element shows.
    """
    if floor:
        return threshold(0.0, dtype, reduction)
    return ROUNDING_ULPS * eps(dtype) * math.sqrt(max(reduction, 1))


def underflow_rounding(a: TensorRecord, b: TensorRecord,
                       held: tuple[torch.dtype, torch.dtype] | None = None) -> float:
    """The rounding of two runs' results held below their dtypes' normal range, relative to
    their statistics.

    Below ``finfo.smallest_normal`` a dtype's spacing stops shrinking with the value: every
    element is rounded to a multiple of the smallest subnormal (fp16: 6e-8), an absolute error,
    so the relative rounding grows as the value shrinks, up to a result flushed to zero. fp16
    reaches there in ordinary training (a product of two 1e-4 activations; Mamba2's chunked
    scan, 1e-7; a gradient of 1e-10), bf16 and fp32 never in practice (1e-40).
    ``ROUNDING_ULPS`` such spacings of each run's dtype over the larger rms of the two bound
    the statistics' relative error (:func:`stats_error` judges the norm against the larger
    norm, the extremes against at least that rms). 0 without statistics or float dtypes.
    ``held``: the dtypes the two values passed through, where lower than the records' own (a
    gradient an fp16 matmul made, recorded after its cast to float32).
    """
    rms = [r for r in (_rms(a), _rms(b)) if r is not None]
    scale = max(rms, default=0.0)
    if scale <= 0:
        return 0.0
    spacing = 0.0
    dtypes = held if held is not None else (_floating(a.dtype), _floating(b.dtype))
    for dtype in dtypes:
        if dtype is not None:
            spacing += torch.finfo(dtype).smallest_normal * eps(dtype)  # its smallest subnormal
    return ROUNDING_ULPS * spacing / scale


def own_error(result: torch.Tensor, exact: torch.Tensor) -> float:
    """``max |result - exact| / max(|exact|, rms(exact))`` over the finite elements (0 when none).

    The free benchmark's deviation measure: elements smaller than the tensor's rms are
    judged against the rms, so a cancellation to a small value in a large tensor is
    judged by what it does to that tensor.
    """
    r = result.detach().to("cpu", torch.float64).reshape(-1)
    x = exact.detach().to("cpu", torch.float64).reshape(-1)
    finite = torch.isfinite(r) & torch.isfinite(x)
    if not bool(finite.any()):
        return 0.0
    r, x = r[finite], x[finite]
    rms = float(x.square().mean().sqrt())
    scale = torch.clamp(x.abs(), min=rms)
    diff = (r - x).abs()
    inf_or_zero = torch.where(diff > 0, math.inf, 0.0)
    ratio = torch.where(scale > 0, diff / torch.where(scale > 0, scale, 1.0), inf_or_zero)
    return float(ratio.max())


def data_error(m: TensorMetrics | dict) -> float:
    """A tensor pair's difference as one relative number: largest error over the reference rms."""
    get = m.get if isinstance(m, dict) else m.__getattribute__
    max_abs, rms = get("max_abs_err"), get("ref_rms")
    if max_abs == 0:
        return 0.0
    return max_abs / rms if rms > 0 else math.inf


def differing_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |b - a| / max(|a|, rms(a))``, over the finite elements where the runs differ (0 when none).

    For an input's difference in the propagation bound: elements equal in both runs (a
    mask's fill of ``finfo.min``, padding) say nothing of how far the runs are apart and,
    in the rms, would make any difference look negligible.
    """
    x = a.detach().to("cpu", torch.float64).reshape(-1)
    y = b.detach().to("cpu", torch.float64).reshape(-1)
    differ = torch.isfinite(x) & torch.isfinite(y) & (x != y)
    if not bool(differ.any()):
        return 0.0
    x, y = x[differ], y[differ]
    rms = float(x.square().mean().sqrt())
    if rms == 0:
        return math.inf
    # Element by element, relative to the element or, below it, to the rms: a gradient of
    # logits holds a few large values among many tiny ones, and the rounding of a large one
    # is no larger a difference than theirs.
    return float(((y - x).abs() / torch.clamp(x.abs(), min=rms)).max())


_MASK_MAGNITUDE = 1e30
"""Values this large are mask fills (``finfo.min`` of float32 or bfloat16), written as constants,
never computed."""
_FP16_FILL = float(torch.finfo(torch.float16).max)
"""float16's ``finfo.min`` (-65504): the fill of a mask made in the dtype of fp16 autocast's
activations, held in float16 or in the float32 its softmax computes in. No computation lands
on it but by saturating, and an fp16 overflow gives Inf, not this."""


def _is_fill(value: float | None) -> bool:
    if value is None or not math.isfinite(value):
        return False
    magnitude = abs(value)
    return magnitude >= _MASK_MAGNITUDE or magnitude == _FP16_FILL


def masked(stats: dict | None) -> bool:
    """Whether a tensor's statistics show a mask fill among its values (its min or max)."""
    return stats is not None and (_is_fill(stats.get("min")) or _is_fill(stats.get("max")))


def masked_error(a: dict, b: dict) -> float:
    """Two masked tensors apart, on the extremes that are no fill in either (0 when none is:
    fills are the program's constants, ``finfo.min`` of one dtype or another, or the infinity
    that fill became in a dtype whose range it is beyond: :func:`fills_overflowed`)."""
    worst = 0.0
    for key in ("min", "max"):
        x, y = a.get(key), b.get(key)
        if x is None or y is None or _is_fill(x) or _is_fill(y) or x == y:
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(x), abs(y)))
    return worst


def fills_overflowed(a: dict | None, b: dict | None) -> bool:
    """Whether every Inf one run's statistics hold beyond the other's is a mask fill of the other
    (``finfo(float32).min``) become an infinity of its sign: bf16's largest value is 3.39e38,
    so float32's fill rounds to -inf there (and stays -inf in what is computed from it in any
    dtype). That is one constant in two dtypes, not a value that became non-finite. A computed
    value beyond a dtype's range (an fp16 activation past 65504) is no fill: not excused."""
    if a is None or b is None or a.get("nan") != b.get("nan"):
        return False
    extra = False
    for first, second in ((a, b), (b, a)):
        for count, key, sign in (("neginf", "min", -1.0), ("posinf", "max", 1.0)):
            x, y = first.get(count), second.get(count)
            if x is None or y is None:
                return False
            if y <= x:
                continue
            fill = first.get(key)
            if not (_is_fill(fill) and sign * fill > 0 and second.get(key) == sign * math.inf):
                return False
            extra = True
    return extra


def stats_error(a: dict, b: dict, numel: int) -> float:
    """Two tensors' statistics apart, as one relative number.

    The norm relatively; max, min and mean against ``max(|a|, |b|, rms)`` (rms =
    ``norm / sqrt(numel)``): like :func:`own_error`, a statistic near zero (the min of a
    square, a mean) is judged by what its difference does to the tensor, not relatively.
    Where a mask fill (``finfo.min``) is among the values, it dominates the sums and the
    norm: only the extremes that are no fill are compared (:func:`masked_error`).
    """
    if masked(a) or masked(b):
        return masked_error(a, b)
    def known(key: str) -> tuple[float, float] | None:
        x, y = a.get(key), b.get(key)
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            return None
        return float(x), float(y)

    norms = known("norm")
    if norms is None:
        return 0.0 if a.get("norm") == b.get("norm") else math.inf
    rms = max(norms) / math.sqrt(numel) if numel else 0.0
    worst = abs(norms[0] - norms[1]) / max(norms) if max(norms) > 0 else 0.0
    for key in ("max", "min", "mean"):
        pair = known(key)
        if pair is None:
            if a.get(key) != b.get(key):
                return math.inf
            continue
        scale = max(abs(pair[0]), abs(pair[1]), rms)
        if pair[0] != pair[1]:
            worst = max(worst, abs(pair[0] - pair[1]) / scale if scale > 0 else math.inf)
    return worst


def sketch_error(a: TensorRecord, b: TensorRecord) -> float | None:
    """How far two runs' values of a tensor are apart element by element, relative to its norm,
    estimated from their sketches (``sketch=True``: ``||a - b|| / ||a||``, the root mean square of
    the projections' differences over the larger norm); None without both sketches or norms.

    Statistics understate it where the elements differ at random signs (rounding in another
    order leaves the norm and the extremes as they were); a sketch's projection is linear, so
    it sees the difference itself (``modes.statistics.sketch``)."""
    if a.sketch is None or b.sketch is None or len(a.sketch) != len(b.sketch) or a.numel != b.numel \
            or a.stats is None or b.stats is None:
        return None
    norms = [t.stats.get("norm") for t in (a, b)]
    if any(n is None or not math.isfinite(n) for n in norms):
        return None
    diffs = [x - y for x, y in zip(a.sketch, b.sketch, strict=True)]
    if not all(math.isfinite(d) for d in diffs):
        return None
    distance = math.sqrt(sum(d * d for d in diffs) / len(diffs))
    scale = max(norms)  # type: ignore[type-var]
    return distance / scale if scale > 0 else (0.0 if distance == 0 else math.inf)


UNSCALE_OP = "aten._amp_foreach_non_finite_check_and_unscale_.default"
"""The op ``GradScaler.unscale_`` runs: its results no longer carry the scale."""


def _value(ops: list[OpRecord], record: TensorRecord) -> float | None:
    """The value of a one-element tensor, from its own statistics or its producer's."""
    stats = record.stats
    if stats is None and record.source is not None and record.source[0] < len(ops):
        producer = ops[record.source[0]]
        if record.source[1] < len(producer.outputs):
            stats = producer.outputs[record.source[1]].stats
    if stats is None or record.numel != 1 or stats.get("max") is None:
        return None
    return float(stats["max"])


def loss_scale(ops: list[OpRecord]) -> float | None:
    """The scale a loss scaler (``torch.amp.GradScaler``) multiplied this step's loss by
    (``probe.rundir.loss_scaler``); None when the step ran no scaler."""
    scaler = scaler_step_in(ops)
    return None if scaler is None or scaler.scale is None or not math.isfinite(scaler.scale) else scaler.scale


def _divided(stats: dict | None, scale: float) -> dict | None:
    if stats is None:
        return None
    out = dict(stats)
    for key in ("min", "max", "mean", "norm"):
        if out.get(key) is not None:
            out[key] = out[key] / scale
    return out


def unscaled(ops: list[OpRecord]) -> tuple[list[OpRecord], float | None, set[tuple[int, str, int]]]:
    """The step's ops with the loss scale divided out of every value that carries it, the scale,
    and which tensors carried it (``(op index, "input" | "output", position)``).

    A loss scaler multiplies the loss by S (a power of two) so that small fp16 gradients do not
    underflow, and divides the gradients by S before the optimizer reads them. Between the two,
    every gradient of a run with a scaler is S times the one of a run without: compared as
    they are, a healthy fp32 run and its fp16 + ``GradScaler`` twin differ everywhere in
    backward. Carrying S are the outputs of the ops that read the scale (the scaled loss, the
    backward of that product) and, from there, of every backward op that reads a tensor
    carrying it; the unscale op's results no longer do. The records are copies: the run's own
    are left as they are."""
    scale = loss_scale(ops)
    if scale is None or scale == 1.0:
        return ops, scale, set()
    carrying: set[tuple[int, int]] = set()
    marked: set[tuple[int, str, int]] = set()
    out: list[OpRecord] = []
    for op in ops:
        reads = [t.source is not None and (t.source[0], t.source[1]) in carrying for t in op.inputs]
        seed = op.module == "" and op.name == "aten.mul.Tensor" and any(
            t.numel == 1 and t.dtype.startswith("float") and _value(ops, t) == scale for t in op.inputs)
        spreads = op.name != UNSCALE_OP and (seed or (op.phase == "backward" and any(reads)))
        if not any(reads) and not spreads:
            out.append(op)
            continue
        inputs = [replace(t, stats=_divided(t.stats, scale)) if r else t
                  for t, r in zip(op.inputs, reads, strict=True)]
        marked.update((op.index, "input", i) for i, r in enumerate(reads) if r)
        outputs = op.outputs
        if spreads:
            outputs = [replace(t, stats=_divided(t.stats, scale)) for t in op.outputs]
            carrying.update((op.index, i) for i in range(len(op.outputs)))
            marked.update((op.index, "output", i) for i in range(len(op.outputs)))
        out.append(replace(op, inputs=inputs, outputs=outputs))
    return out, scale, marked


def _rms(record: TensorRecord) -> float | None:
    stats = record.stats
    if stats is None or stats.get("norm") is None or not record.numel:
        return None
    return float(stats["norm"]) / math.sqrt(record.numel)




def _magnitude(record: TensorRecord) -> float | None:
    """The largest finite magnitude below mask fills (None without statistics)."""
    stats = record.stats
    if stats is None or stats.get("min") is None or stats.get("max") is None:
        return None
    values = [abs(float(stats[k])) for k in ("min", "max")]
    kept = [v for v in values if math.isfinite(v) and not _is_fill(v)]
    return max(kept) if kept else 0.0


_SUMS = frozenset({"sum", "mean", "nansum", "cumsum"})
_DIVS = frozenset({"div", "div_"})
_ADDS = frozenset({"add", "sub", "add_", "sub_", "rsub"})
_SOFTMAX = frozenset({"_softmax", "softmax", "_log_softmax", "log_softmax", "logsumexp"})
_NORMS = frozenset({"native_layer_norm"})
_PER_CHANNEL_GRADIENTS = frozenset({"convolution_backward", "native_batch_norm_backward",
                                    "cudnn_batch_norm_backward", "miopen_batch_norm_backward",
                                    "native_group_norm_backward"})
"""Backward ops whose weight and bias gradients (one value per channel, dim 1 of the output
gradient, their first input) sum the output gradient over the batch and the positions."""


def _quotient_condition(denominator: TensorRecord) -> float:
    """A quotient by ``denominator``: a relative difference of the denominator known as one of the
    whole (its statistics') is absolute at its scale, so an element ``|b|`` below its rms carries
    ``rms / |b|`` of it into the quotient (phimoe's router divides by clamped scores down to 1% of
    their rms). Of one sign: ``rms / min |b|``; 1 where it changes sign or has no statistics."""
    stats, rms = denominator.stats, _rms(denominator)
    if stats is None or rms is None or stats.get("min") is None or stats.get("max") is None:
        return 1.0
    low, high = float(stats["min"]), float(stats["max"])
    if not (math.isfinite(low) and math.isfinite(high)) or (low <= 0.0 <= high):
        return 1.0
    smallest = low if low > 0.0 else -high
    return max(rms / smallest, 1.0) if math.isfinite(rms) else 1.0


def _sum_condition(x: TensorRecord, y: TensorRecord, mean: bool) -> float:
    """A sum (or mean) of ``x`` into ``y``: sqrt(K) rms(x) / rms(sum), K terms per result."""
    in_rms, out_rms = _rms(x), _rms(y)
    if in_rms is None or not out_rms or not y.numel:
        return 1.0
    terms = max(x.numel // y.numel, 1)
    return math.sqrt(terms) * in_rms / ((terms if mean else 1) * out_rms)


def contraction_terms(op: OpRecord, output: int = 0) -> int:
    """Terms per element of output ``output`` of a contraction (1 for other ops), from the
    recorded shapes."""
    args: list[Any] = [torch.empty(t.shape, device="meta") for t in op.inputs]
    if op.name == "aten.native_layer_norm_backward.default" and len(op.inputs) >= 3:
        # Its normalized shape is no tensor: each row's mean (input 2) stands for a row.
        rows = max(op.inputs[2].numel, 1)
        args = [*args[:2], [max(op.inputs[0].numel // rows, 1)], *args[2:]]
    return reduction_length(op.name, args, output)


def summation_terms(op: OpRecord, position: int) -> int:
    """Terms each element of output ``position`` sums: a contraction's, a sum's (or mean's, a
    loss's) input elements per output element."""
    ratio = op.inputs[0].numel // max(op.outputs[position].numel, 1) if op.inputs else 1
    return max(contraction_terms(op, position), summed_terms(op), ratio, 1)


def summed_terms(op: OpRecord) -> int:
    """Terms per element of a sum's (or mean's) first output, or of the per-channel weight and
    bias gradients of a convolution's or a batch norm's backward, from the recorded sizes (1 for
    other ops)."""
    short = short_name(op.name)
    if short in _PER_CHANNEL_GRADIENTS and op.inputs and len(op.inputs[0].shape) >= 2 \
            and op.inputs[0].shape[1]:
        return max(op.inputs[0].numel // op.inputs[0].shape[1], 1)
    if short not in _SUMS or not op.inputs or not op.outputs or not op.outputs[0].numel:
        return 1
    return max(op.inputs[0].numel // op.outputs[0].numel, 1)


def condition(op: OpRecord, inputs: Sequence[TensorRecord] | None = None) -> float:
    """How much ``op`` may amplify a relative difference of its inputs into one of its outputs,
    estimated from its recorded statistics (1 where nothing says more; the caller's floor,
    ``CONDITION``, covers the ordinary ops).

    Cancellation is what amplifies, and small divisors: a sum of K terms of rms r whose result has rms s
    (sqrt(K) r / s: bias gradients summed over a batch); an addition whose result is smaller
    than its terms ((r_x + r_y) / s); layer norm's ``x - mean(x)`` (max |x| x max rstd); a
    softmax, which turns a relative difference of its logits into an absolute one of their
    size (2 max |x|, masks aside); a softmax's backward, whose rows subtract their mean, and a
    log-softmax's, their sums; a quotient by a tensor of one sign (``rms(b) / min |b|``).

    ``inputs``: the records that describe ``op``'s inputs where they differ from its own (an
    input computed in the step that the stats mode recorded only as its producer's output)."""
    short = short_name(op.name)
    inputs = op.inputs if inputs is None else inputs
    if not op.outputs or not inputs:
        return 1.0
    out_rms = _rms(op.outputs[0])
    if short in _SUMS:
        return _sum_condition(inputs[0], op.outputs[0], mean=short == "mean")
    if short in _ADDS:
        # A mask's -inf terms make the norms infinite: they say nothing of cancellation (inf / inf).
        rms = [r for t in inputs if (r := _rms(t)) is not None and math.isfinite(r)]
        return sum(rms) / out_rms if rms and out_rms and math.isfinite(out_rms) else 1.0
    if short in _NORMS and len(op.outputs) >= 3:
        # The normalised output through x - mean(x); the row means themselves, a sum's.
        means = _sum_condition(inputs[0], op.outputs[1], mean=True)
        magnitude = _magnitude(inputs[0])
        rstd = op.outputs[2].stats
        if magnitude is None or rstd is None or rstd.get("max") is None:
            return means
        return max(means, magnitude * abs(float(rstd["max"])))
    if short == "native_layer_norm_backward" and len(op.outputs) >= 3:
        # The weight's and the bias's gradients sum the output gradient over the rows (the
        # normalised input, which the weight's multiplies it by, has rms 1).
        grad = inputs[0]
        return max(_sum_condition(grad, out, mean=False) for out in op.outputs[1:3])
    if short in _PER_CHANNEL_GRADIENTS:
        # As layer norm's, over the batch and the positions: a bias before a normalisation (a
        # convolution's before BatchNorm) has a gradient that is zero in exact arithmetic, so
        # each run's is its rounding alone.
        grad = inputs[0]
        channels = [out for out in op.outputs
                    if len(grad.shape) >= 2 and len(out.shape) == 1 and out.shape[0] == grad.shape[1]]
        return max((_sum_condition(grad, out, mean=False) for out in channels), default=1.0)
    if short in _DIVS and len(inputs) == 2:
        return _quotient_condition(inputs[1])
    if short in _SOFTMAX:
        magnitude = _magnitude(inputs[0])
        return 2.0 * magnitude if magnitude is not None else 1.0
    if short == "_softmax_backward_data" and len(inputs) >= 2:
        return _softmax_backward_condition(inputs[0], inputs[1], out_rms)
    if short == "_log_softmax_backward_data":
        return _log_softmax_backward_condition(inputs[0], out_rms)
    if short in _ATTENTION_BACKWARD and len(inputs) >= 4:
        return _attention_backward_condition(*inputs[:4], op.outputs)
    return 1.0


_ATTENTION_BACKWARD = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward"})
"""Fused attention backwards: their tensor inputs begin with the output's gradient, q, k and v."""


def _attention_backward_condition(grad: TensorRecord, q: TensorRecord, k: TensorRecord, v: TensorRecord,
                                  outputs: Sequence[TensorRecord]) -> float:
    """A fused attention's backward: the gradients of q and k pass through its softmax's backward,
    ``dS = P (dP - rowsum(P dP))`` with ``dP = dO V^T``, which cancels where the scores' gradients
    barely depend on the key (exactly, with one key: both gradients are zero in exact arithmetic,
    and each run's is its rounding alone). Their terms' rms, at most ``2 rms(dO) rms(V) rms(K)`` for
    q's (a row of P sums to 1, so its rms is at most ``1/sqrt(keys)``; the default scale
    ``1/sqrt(head dim)``) and ``sqrt(queries/keys)`` times that with ``rms(Q)`` for k's, over the
    results' rms."""
    rms = [_rms(t) for t in (grad, q, k, v)]
    if any(r is None or not math.isfinite(r) for r in rms) or len(q.shape) < 2 or len(k.shape) < 2:
        return 1.0
    r_grad, r_q, r_k, r_v = rms  # type: ignore[misc]
    queries, keys = q.shape[-2], k.shape[-2]
    if not queries or not keys:
        return 1.0
    terms = (2 * r_grad * r_v * r_k, 2 * r_grad * r_v * r_q * math.sqrt(queries / keys))
    conditions = [term / out for term, result in zip(terms, outputs[:2], strict=False)
                  if (out := _rms(result)) and math.isfinite(out)]
    return max(conditions, default=1.0)


def _softmax_backward_condition(grad: TensorRecord, probs: TensorRecord, out_rms: float | None) -> float:
    """Softmax's backward, ``y * (g - sum(y * g))`` by row, cancels where a row's gradient is
    near its mean under ``y`` (attention whose gradients barely depend on the key chosen): its
    terms, of rms at most ``max(y) rms(g) + rms(y) max|g|``, against its result's rms."""
    g_rms, y_rms, g_max, y_max = _rms(grad), _rms(probs), _magnitude(grad), _magnitude(probs)
    if None in (g_rms, y_rms, g_max, y_max) or not out_rms or not math.isfinite(out_rms):
        return 1.0
    terms = y_max * g_rms + y_rms * g_max
    return terms / out_rms if math.isfinite(terms) else 1.0


def _log_softmax_backward_condition(grad: TensorRecord, out_rms: float | None) -> float:
    """Log-softmax's backward, ``g - exp(y) sum(g)`` by row, cancels where the predictions are
    certain (a cross entropy's: exp(y) = 1 at the target, whose gradient is the row's sum, and the
    result is rounding alone). Its second term is the first less the result, so its terms have rms
    at most ``2 rms(g) + rms(result)``: against the result's rms, with nothing assumed of the rows."""
    g_rms = _rms(grad)
    if g_rms is None or not math.isfinite(g_rms) or not out_rms or not math.isfinite(out_rms):
        return 1.0
    return (2.0 * g_rms + out_rms) / out_rms


_SAVED_FOR_BACKWARD = {
    "native_layer_norm": 1, "native_group_norm": 1, "native_batch_norm": 1, "_native_batch_norm_legit": 1,
    "_native_batch_norm_legit_no_training": 1, "_fused_rms_norm": 1, "nll_loss_forward": 1,
    "nll_loss2d_forward": 1, "native_dropout": 1, "_scaled_dot_product_flash_attention_for_cpu": 1,
    "_scaled_dot_product_flash_attention": 1, "_scaled_dot_product_efficient_attention": 1,
    "_scaled_dot_product_cudnn_attention": 1, "_scaled_dot_product_fused_attention_overrideable": 1,
}
"""Ops whose results past the first few are what they keep for their backward (a layer norm's
row means and inverse deviations, a loss's total weight, attention's log-sum-exp, dropout's
mask): by op short name, how many results come before them."""


def primary_outputs(op: OpRecord) -> int:
    """How many of ``op``'s results are its result proper; the rest, statistics it keeps for its
    backward, follow from its inputs and that result (a row mean near zero differs between runs
    by a large relative amount where the normalised rows agree to rounding). A fault in them
    shows in the result or in the gradients, where it is judged."""
    return _SAVED_FOR_BACKWARD.get(short_name(op.name), len(op.outputs))


_SELECTIONS = frozenset({"embedding", "index_select", "gather", "index", "take", "_embedding_bag",
                         "embedding_bag", "slice", "select", "narrow", "split", "split_with_sizes",
                         "unsafe_split", "unsafe_split_with_sizes", "unbind", "chunk", "tensor_split"})
"""Ops whose results are each part of their first input's elements, unchanged. Slices and splits
too: backward slices a fused bias's gradient (WavLM's query, key and value biases concatenated),
and the key's part is rounding alone in both runs, whatever the whole's difference; a split of
hyper-connection weights (HunYuan's) gives parts a thousand times apart in size."""


def is_selection(op: OpRecord) -> bool:
    """Whether each of ``op``'s results is part of its first input's elements, unchanged."""
    return short_name(op.name) in _SELECTIONS and bool(op.inputs) and bool(op.outputs)


def selection_gain(op: OpRecord) -> float:
    """How much larger, relatively, a difference of ``op``'s first input may be in the part of
    it ``op`` selects (an embedding's rows, a gather) than its statistics say of the whole.

    A relative difference known from statistics is one of the whole tensor; its elements that
    differ may all sit in the rows selected (the rows of the tokens seen, where an optimizer
    changed a table it updates sparsely). Concentrated there, it is larger relative to the
    selected part by the ratio of the norms: ``norm(input) / norm(output)`` (at least 1; of a
    split, its smallest part's). 1 for other ops, and without statistics."""
    if not is_selection(op):
        return 1.0
    whole = op.inputs[0].stats
    norms = [t.stats.get("norm") for t in op.outputs if t.stats is not None]
    if whole is None or not whole.get("norm") or not norms or not all(norms):
        return 1.0
    ratio = float(whole["norm"]) / min(float(norm) for norm in norms)
    return max(ratio, 1.0) if math.isfinite(ratio) else 1.0


SAME_ORDER_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "contiguous", "clone", "detach", "alias",
    "unsqueeze", "squeeze", "lift_fresh", "view_as",
})
"""Ops whose result is their one input's elements in their order: the same value, read by shape."""
_WHOLE_VIEWS = SAME_ORDER_VIEWS | {"t", "transpose", "permute", "expand", "expand_as"}
"""Ops whose result holds every element of their one input, unchanged (repeated at most): the
statistics of a difference pass through them as they are."""
VALUE_CASTS = frozenset({"_to_copy", "to", "_to_dtype"})
"""Ops that change a value's dtype only: the same value, rounded once where the dtype is lower."""
_SCALINGS = frozenset({"mul", "div", "neg", "mul_", "div_", "neg_"})


def faithful_rounding(op: OpRecord) -> float | None:
    """The most ``op`` can move the statistics of its one tensor input, relative, when it keeps
    every element's value up to one rounding: 0 for a view of the whole tensor, the unit
    roundoff of its result's dtype (half its eps) for a cast down or a scaling by a number
    (``x * 1.05``, ``x.to(bfloat16)``). None for any other op (one that selects part of its
    input, combines tensors, or computes a function of them): the general condition bound is
    its error model.

    Each element rounded once is off by at most the unit roundoff relative to itself, so its
    extremes and norm are, and its mean relative to the tensor's rms: a difference of two runs
    measured before such an op is carried through it unamplified, plus that rounding."""
    tensors = [t for t in op.inputs if _floating(t.dtype) is not None]
    if len(op.inputs) != 1 or len(tensors) != 1 or len(op.outputs) != 1:
        return None
    out, inp = _floating(op.outputs[0].dtype), _floating(tensors[0].dtype)
    if out is None or inp is None:
        return None
    short = short_name(op.name)
    if short in _WHOLE_VIEWS:
        return 0.0 if out == inp else None
    if short in VALUE_CASTS:
        return eps(out) / 2 if _lower(out, inp) else 0.0  # a widening is exact
    if short in _SCALINGS:
        return eps(lower_of(out, inp)) / 2
    return None


def held_precision(ops: list[OpRecord]) -> dict[tuple[int, int], torch.dtype]:
    """For each floating output ``(op index, position)``, the lowest precision its value passed
    through on its way from the step's inputs: a value computed from a bf16 matmul's result
    carries bf16's rounding, whatever dtype it is held in now."""
    held: dict[tuple[int, int], torch.dtype] = {}
    for op in ops:
        upstream = [held[s] for t in op.inputs
                    if (s := t.source) is not None and (s[0], s[1]) in held]
        for position, t in enumerate(op.outputs):
            own = _floating(t.dtype)
            if own is not None:
                found = _lowest([own, *upstream])
                if found is not None:
                    held[(op.index, position)] = found
    return held
