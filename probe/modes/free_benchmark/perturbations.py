"""Input perturbations of the free-benchmark mode, and the checks' error bounds.

Each perturbation turns an op's floating inputs into perturbed copies (or picks a
higher compute precision) and says how large its own input change is:

| name | what changes | input change ``delta`` |
| --- | --- | --- |
| improve_precision | computed in fp32 (fp64 for fp32 inputs); again with inputs moved one ULP | 0, 1 ULP |
| add_noise | every normal element moved one ULP, up or down by a bit of its own (no RNG) | 1 ULP |
| bit_noise | the lowest mantissa bit of every normal element flipped | 1 ULP |
| change_value | first and last element of each input swapped | measured |
| no_change | nothing (a re-run: catches nondeterministic kernels) | 0 |
| to_cpu | computed on the CPU (with a registered reference for custom ops) | 0 |

Two rules judge a check (docs/free_benchmark.md gives them in full):

- **bits**: an input change of one ULP is twice the bound of the inputs' own rounding
  (half an ULP), so half the output change it causes, relative to the output, says how
  many significant bits the output keeps given that rounding: ``-log2(ratio / 2)``.
  Fewer than ``MIN_BITS`` (a ratio above ``BITS_BOUND = 2 * 2**-MIN_BITS``) fails, in
  every dtype: a total cancellation keeps none, fp32 ``sin`` of arguments near 1e4 keeps ten.
- **rounding**: a result computed another way (higher precision, CPU, again) may
  differ by ``CONDITION * delta + max(ROUNDING_ULPS * eps(out) * sqrt(K), RELATIVE_FLOOR)``
  (4 sqrt(K) ULPs for a contraction over K terms; ``delta`` is 0 except for
  ``change_value``); more means the op computed badly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probe.compiled import CompiledKernel
from probe.modes.statistics.reduce import COMPILED_MAX_NUMEL, COMPILED_MIN_NUMEL
from probe.vocabulary.rounding import (  # noqa: F401  (the checks' bounds; imported from here too)
    CONDITION,
    RELATIVE_FLOOR,
    ROUNDING_ULPS,
    eps,
    reduction_length,
    threshold,
)

PERTURBATIONS = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
MIN_BITS = 4
# The bits rule's input change is one ULP; the inputs' own rounding is at most half of one:
# the output change that rounding can make is this fraction of the measured one.
ROUNDING_PER_ULP = 0.5
BITS_BOUND = 2.0 ** -MIN_BITS / ROUNDING_PER_ULP
# The perturbations whose input change is a rounding-sized one ULP: judged by the bits rule.
JUDGES_BITS = ("improve_precision", "add_noise", "bit_noise")

_HIGHER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def significant_bits(dtype: torch.dtype) -> int:
    """Significant bits of a floating dtype (the stored mantissa and the implicit one)."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def bits_kept(ratio: float, dtype: torch.dtype) -> float:
    """Significant bits an output keeps when a one-ULP input change moves it by ``ratio``."""
    if ratio <= 0:
        return float(significant_bits(dtype))
    return min(float(significant_bits(dtype)), max(0.0, -math.log2(ratio * ROUNDING_PER_ULP)))


def rounding_scale(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Half an ULP of the largest input element (fp64, 0-dim, on the device: no sync).

    An all-zero output whose perturbed run is not zero is judged against it: a change
    below the inputs' own rounding is no loss of bits (a change of an output that is
    0 everywhere has no other yardstick). One ``aminmax`` pass per input, no temporaries of
    the input's size (this runs for every checked op); an input holding a NaN or Inf
    contributes 0, so the output dtype's smallest normal is the yardstick then.
    """
    extremes, halves = [], []
    for t in tensors:
        if t.is_floating_point() and t.numel():
            extremes.append(torch.stack(torch.aminmax(t.detach())))
            halves.append(eps(t.dtype) / 2)
    if not extremes:
        return torch.zeros((), dtype=torch.float64)
    # The inputs' extremes side by side: a few launches per check, not a few per input.
    device = extremes[0].device
    largest = torch.stack([e.to(device=device, dtype=torch.float64) for e in extremes]).abs().amax(dim=1)
    largest = torch.where(largest.isfinite(), largest, 0.0)
    if len(set(halves)) == 1:
        return (largest * halves[0]).max()
    return (largest * torch.tensor(halves, dtype=torch.float64).to(device, non_blocking=True)).max()


def higher_precision(dtype: torch.dtype, target: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype ``improve_precision`` computes ``dtype`` in (None: leave it)."""
    if target is not None:
        return target if dtype.is_floating_point and dtype.itemsize < target.itemsize else None
    return _HIGHER.get(dtype)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _movable(t: torch.Tensor) -> torch.Tensor:
    """Finite elements of at least the smallest normal magnitude, below the largest:
    the ones noise may move (an Inf moved one ULP becomes finite, a flipped bit of an
    Inf is a NaN, and the largest value moved up overflows)."""
    magnitude = t.abs()
    info = torch.finfo(t.dtype)
    return (magnitude >= info.tiny) & (magnitude < info.max)


def _one_ulp_moved(t: torch.Tensor) -> torch.Tensor:
    # On the bit pattern (sign and magnitude), +1 is one ULP away from zero and -1 one ULP
    # towards it. Each element goes one way or the other by its own second-lowest bit: moved
    # all alike, values close together shift as one, and an op blind to a shift (a softmax
    # over fp16 logits near 1000, whose ULP is 0.5) would look robust to its inputs' rounding.
    bits = _BITS[t.element_size()]
    pattern = t.view(bits)
    step = (((pattern >> 1) & 1) * 2 - 1) * _movable(t).to(bits)
    return (pattern + step).view(t.dtype)


def _flip_low_bit(t: torch.Tensor) -> torch.Tensor:
    bits = _BITS[t.element_size()]
    return (t.view(bits) ^ _movable(t).to(bits)).view(t.dtype)


def _one_ulp_moved_to_fp32(t: torch.Tensor) -> torch.Tensor:
    return _one_ulp_moved(t).to(torch.float32)


def _one_ulp_moved_to_fp64(t: torch.Tensor) -> torch.Tensor:
    return _one_ulp_moved(t).to(torch.float64)


# One fused pass instead of five over large inputs (4x faster on a 45M-element
# weight on CPU); small ones stay eager, where a compiled call costs more than it saves.
# improve_precision's nudged run moves and upcasts an input in the same pass.
# Each compiled once the process has moved this many elements eagerly (five passes instead of one:
# ~4 ns an element more on a CPU core), about the cost of its compile (see CompiledKernel).
EAGER_ELEMENTS = 1 << 31
_COMPILED = {key: CompiledKernel(fn, compile_after=EAGER_ELEMENTS) for key, fn in (
    ("add_noise", _one_ulp_moved), ("bit_noise", _flip_low_bit),
    (("add_noise", torch.float32), _one_ulp_moved_to_fp32),
    (("add_noise", torch.float64), _one_ulp_moved_to_fp64))}
_EAGER = {"add_noise": _one_ulp_moved, "bit_noise": _flip_low_bit}
# Below this many elements the eager passes cost less than a compiled call: dynamo's guard
# evaluation alone takes tens of microseconds, which a CPU spends on a few 10^4 elements
# and an accelerator on a few 10^6 (an estimate from bandwidth, not yet measured on one).
COMPILED_MIN_NUMEL_ACCELERATOR = 1 << 22


def one_ulp_moved(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` with every finite normal element moved one ULP (``add_noise``: away from zero or
    towards it, by the element's second-lowest bit, so values change relative to each other), in ``dtype``
    (a higher precision than ``t``'s, which holds the moved values exactly) if given."""
    if dtype is None or dtype == t.dtype:
        return _noise("add_noise", t)
    return _noise("add_noise", t, dtype)


def worth_compiling(t: torch.Tensor) -> bool:
    """Whether one pass over ``t`` is worth a compiled call of its own on ``t``'s device."""
    least = COMPILED_MIN_NUMEL if t.device.type == "cpu" else COMPILED_MIN_NUMEL_ACCELERATOR
    return least <= t.numel() < COMPILED_MAX_NUMEL


def _noise(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    kernel = _COMPILED.get(name if dtype is None else (name, dtype))
    if kernel is not None and worth_compiling(t):
        # Elementwise, so the kernel may run over the tensor in memory order: one
        # rank-1 graph serves every shape (a graph per rank would soon hit dynamo's
        # recompile limit and fall back to eager), and the result keeps the input's
        # layout (a transposed weight stays transposed for the op).
        order = sorted(range(t.dim()), key=t.stride, reverse=True)
        in_memory_order = t.permute(order)
        if in_memory_order.is_contiguous():
            out = kernel(in_memory_order.view(-1)).view(in_memory_order.shape)
            return out.permute(sorted(range(t.dim()), key=order.__getitem__))
    out = _EAGER[name](t)
    return out if dtype is None else out.to(dtype)


def _swap_ends(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1) if out.is_contiguous() else out.reshape(-1)
    if flat.numel() > 1:
        first, last = flat[0].clone(), flat[-1].clone()
        flat[0], flat[-1] = last, first
    return out if out.is_contiguous() else flat.view(t.shape)


@dataclass(frozen=True)
class Perturbation:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PERTURBATIONS:
            raise ValueError(self.name)

    @property
    def on_cpu(self) -> bool:
        """The re-run computes on the CPU (``to_cpu``), not where the op ran."""
        return self.name == "to_cpu"

    @property
    def in_higher_precision(self) -> bool:
        """The re-run computes in a higher precision (``improve_precision``); its check also
        measures the inputs' rounding, by a second re-run with every input moved one ULP."""
        return self.name == "improve_precision"

    def perturb(self, t: torch.Tensor) -> tuple[torch.Tensor, float | torch.Tensor]:
        """A perturbed copy of a floating tensor and the relative change it made (at most).

        The change of ``change_value`` is a 0-dim tensor on the device: reading it
        here would sync with the host; it is read with the step's results.
        """
        if self.name in ("add_noise", "bit_noise"):
            return _noise(self.name, t), eps(t.dtype)
        if self.name == "change_value":
            swapped = _swap_ends(t)
            if t.numel() < 2:
                return swapped, 0.0
            # The relative change of the two swapped elements themselves (a tensor-wide
            # yardstick would call the swap of two scores among masked -1e38s "tiny").
            flat = t.detach().reshape(-1)
            ends = torch.stack([flat[0], flat[-1]]).to(torch.float64)
            change = (ends.flip(0) - ends).abs() / ends.abs().clamp(min=torch.finfo(t.dtype).tiny)
            return swapped, change.nan_to_num(0.0, posinf=1e300).max()
        return t.clone(), 0.0
