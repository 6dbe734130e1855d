"""Input perturbations of the free-benchmark mode, and the checks' error bound.

Each perturbation turns an op's floating inputs into perturbed copies (or picks a
higher compute precision) and says how large its own input change is, so the
check can tell an op that merely passes a small change on (well-conditioned)
from one that amplifies it (fragile):

| name | what changes | input change ``delta`` |
| --- | --- | --- |
| improve_precision | computed in fp32 (fp64 for fp32 inputs) | 0 |
| add_noise | every normal element moved one ULP up (deterministic, no RNG) | 1 ULP |
| bit_noise | the lowest mantissa bit of every normal element flipped | 1 ULP |
| change_value | first and last element of each input swapped | measured |
| no_change | nothing (a re-run: catches nondeterministic kernels) | 0 |
| to_cpu | computed on the CPU (with a registered reference for custom ops) | 0 |

The check fails when ``max_i |p_i - o_i| / max(|o_i|, rms(o))`` exceeds
``CONDITION * delta + max(ROUNDING_ULPS * eps(out), RELATIVE_FLOOR)``: an op may
amplify its input change 32-fold and round 4 ULPs of its output dtype (and
relative errors below 1e-5 never matter for training) before it is called
fragile. Errors are measured against the tensor's rms for elements smaller than
it, so a cancellation that leaves a small result in a large tensor is judged
by what it does to that tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PERTURBATIONS = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
CONDITION = 32.0
ROUNDING_ULPS = 4.0
RELATIVE_FLOOR = 1e-5

_HIGHER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def threshold(delta: float, out_dtype: torch.dtype) -> float:
    return CONDITION * delta + max(ROUNDING_ULPS * eps(out_dtype), RELATIVE_FLOOR)


def higher_precision(dtype: torch.dtype, target: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype ``improve_precision`` computes ``dtype`` in (None: leave it)."""
    if target is not None:
        return target if dtype.is_floating_point and dtype.itemsize < target.itemsize else None
    return _HIGHER.get(dtype)


def _normal(t: torch.Tensor) -> torch.Tensor:
    """Finite elements of at least the smallest normal magnitude: the ones noise may move
    (an Inf moved one ULP becomes finite; a flipped bit of an Inf is a NaN)."""
    magnitude = t.abs()
    return (magnitude >= torch.finfo(t.dtype).tiny) & (magnitude <= torch.finfo(t.dtype).max)


def _one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    return torch.where(_normal(t), torch.nextafter(t, torch.full_like(t, float("inf"))), t)


def _flip_low_bit(t: torch.Tensor) -> torch.Tensor:
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return torch.where(_normal(t), (t.view(bits) ^ 1).view(t.dtype), t)


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

    def perturb(self, t: torch.Tensor) -> tuple[torch.Tensor, float | torch.Tensor]:
        """A perturbed copy of a floating tensor and the relative change it made (at most).

        The change of ``change_value`` is a 0-dim tensor on the device: reading it
        here would sync with the host; it is read with the step's results.
        """
        if self.name == "add_noise":
            return _one_ulp_up(t), eps(t.dtype)
        if self.name == "bit_noise":
            return _flip_low_bit(t), eps(t.dtype)
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
