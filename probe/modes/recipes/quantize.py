"""Reference quantize-dequantize of a tensor under a :class:`~probe.modes.recipes.formats.Recipe`,
and the what-if statistics of doing so.

The arithmetic follows torchao (``torchao.prototype.mx_formats``, ``torchao.float8``), the
PyTorch-native implementation of these formats, step for step, so that the codes and scales agree
with it bit for bit (``tests/test_recipes.py`` checks it where torchao is installed):

- per-tensor fp32 scale: ``scale = max_elem / amax``; ``q = cast(clamp(x * scale))``; ``x' = q / scale``;
- e8m0 block scale (OCP MX v1.0, section 6.3, torchao's FLOOR mode): the shared exponent is
  ``floor(log2(block amax)) - emax_elem``, read from the fp32 exponent bits; ``q = cast(clamp(x / 2^e))``;
- NVFP4: a per-tensor fp32 scale ``amax / (448 * 6)``, e4m3 block scales
  ``cast_e4m3(clamp(block amax / 6 / per_tensor, 2^-6, 448))``,
  ``q = e2m1(clamp(x * (1/per_tensor) / block))``.

Casts round to nearest, ties to even (torch's float8 casts; e2m1 by table).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable

import torch

from probe.modes.recipes.formats import E2M1_VALUES, ELEMENT_FORMATS, Recipe

STAT_COLUMNS = ("nonzero", "underflow", "saturated", "error_sq", "signal_sq", "block_range_log2",
                "output_error_sq", "output_sq")
"""The what-if statistics of one operand under one recipe: nonzero values, those that quantize to
0, those beyond the element format's largest value after scaling (clamped), the sum of squared
quantize-dequantize errors and of squared values, the largest log2(max / min nonzero |x|) of a
block (of the tensor, for a per-tensor recipe); then the expected squared error this operand's
rounding alone puts into the op's output (:func:`product_error_energy`; NaN where the op's
operands do not pair up, as a transposed convolution's or a convolution's backward) and the
output's own sum of squares."""

_F32_MIN_NORMAL = torch.finfo(torch.float32).tiny
_E4M3 = ELEMENT_FORMATS["e4m3"]
_E2M1_CODES = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# Midpoints between neighbouring e2m1 values; a tie rounds to the even code. bucketize puts a value
# equal to a boundary in the lower bucket, so a boundary whose tie goes up is moved one ulp down.
_E2M1_TIE_UP = (False, True, False, True, False, True, False)
_E2M1_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(E2M1_VALUES)], dtype=torch.float32)
_E2M1_BOUNDARIES = torch.where(torch.tensor(_E2M1_TIE_UP),
                               torch.nextafter(_E2M1_MIDPOINTS, torch.tensor(0.0)), _E2M1_MIDPOINTS)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already within [-6, 6] -> e2m1 codes (sign bit 3, magnitude code 0-7), uint8."""
    magnitude = torch.bucketize(x.abs().contiguous(), _E2M1_BOUNDARIES.to(x.device))
    return (magnitude | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes -> fp32 values."""
    magnitude = _E2M1_CODES.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def _round_elements(scaled: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Values already scaled and clamped into the element format's range, rounded to it (fp32)."""
    dtype = recipe.format.dtype
    if dtype is not None:
        return scaled.to(dtype).to(torch.float32)
    return e2m1_values(e2m1_codes(scaled))


def blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (reduction dimension last) as fp32 rows of ``block`` values, the last dimension padded
    with zeros to a whole number of blocks; one row for ``block == 0``."""
    x = x.detach().to(torch.float32)
    if block == 0:
        return x.reshape(1, -1)
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    pad = -rows.shape[-1] % block
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(-1, block)


def e8m0_exponent(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """The shared exponent of blocks of amax ``amax`` (fp32): floor(log2(amax)) - emax_elem, read
    from the exponent bits as torchao does, clamped to e8m0's range [-127, 128]."""
    emax_elem = math.floor(math.log2(element_max))
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    return (exponent - emax_elem).clamp(-127, 128)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32, built from the exponent bits (torchao), at least the smallest normal."""
    return ((exponent + 127).to(torch.int32) << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)


def quantize_blocks(blocks: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize-dequantize ``blocks`` (fp32 rows from :func:`blocks_of`); returns the dequantized
    values and a mask of those that saturated. ``amax``: the per-tensor amax to scale by (delayed
    scaling; default the tensor's own)."""
    element = recipe.format
    if recipe.scale == "e8m0":
        scale = _power_of_two(e8m0_exponent(blocks.abs().amax(-1, keepdim=True), element.max))
        scaled = blocks / scale
        saturated = scaled.abs() > element.saturation_bound
        return _round_elements(scaled.clamp(-element.max, element.max), recipe) * scale, saturated
    tensor_amax = blocks.abs().amax() if amax is None else amax.to(torch.float32)
    if recipe.scale == "e4m3":
        per_tensor = tensor_amax / (_E4M3.max * element.max)
        block_scale = (blocks.abs().amax(-1, keepdim=True) / element.max) / per_tensor
        block_scale = block_scale.clamp(_E4M3.min_normal, _E4M3.max).to(torch.float8_e4m3fn).to(torch.float32)
        scaled = blocks * ((1.0 / per_tensor) / block_scale)
        saturated = scaled.abs() > element.saturation_bound
        values = _round_elements(scaled.clamp(-element.max, element.max), recipe) * block_scale * per_tensor
        return torch.where(tensor_amax > 0, values, blocks), saturated & (tensor_amax > 0)
    scale = element.max / tensor_amax.clamp(min=1e-12)  # torchao.float8's amax_to_scale
    scaled = blocks * scale
    saturated = scaled.abs() > element.saturation_bound
    return _round_elements(scaled.clamp(-element.max, element.max), recipe) / scale, saturated


def _unblocked(values: torch.Tensor, x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Rows of :func:`blocks_of` (padding dropped) back in ``x``'s shape."""
    if recipe.block and x.dim():
        width = x.shape[-1]
        values = values.reshape(x.numel() // width, -1)[:, :width]
    return values.reshape(x.shape)


def fake_quantize(x: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (reduction dimension last) quantized and dequantized under ``recipe``, in ``x``'s dtype."""
    values, _ = quantize_blocks(blocks_of(x, recipe.block), recipe, amax)
    return _unblocked(values, x, recipe).to(x.dtype)


def _statistics(blocks: torch.Tensor, values: torch.Tensor, saturated: torch.Tensor,
                error_sq: torch.Tensor, signal_sq: torch.Tensor) -> torch.Tensor:
    nonzero = blocks != 0
    magnitude = blocks.abs()
    smallest = torch.where(nonzero, magnitude, torch.inf).amin(-1)
    # Difference of logs: the ratio of a denormal to a large value overflows fp32.
    spread = magnitude.amax(-1).log2() - smallest.log2()
    block_range = torch.where(torch.isfinite(smallest), spread, 0.0).amax()
    return torch.stack([
        nonzero.sum().double(), (nonzero & (values == 0)).sum().double(), saturated.sum().double(),
        error_sq, signal_sq, block_range.double(),
    ])


def _squares(x: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """Squares of fp32 ``x`` summed in float64 (over ``dims``; all when None)."""
    squared = x.square()
    if dims is None:
        return squared.sum(dtype=torch.float64)
    return squared.sum(dims, dtype=torch.float64) if dims else squared.double()


def what_if(x: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The first six :data:`STAT_COLUMNS` of quantizing ``x`` (reduction dimension last) under
    ``recipe``: one float64 tensor on ``x``'s device (no host sync)."""
    blocks = blocks_of(x, recipe.block)
    values, saturated = quantize_blocks(blocks, recipe, amax)
    return _statistics(blocks, values, saturated, _squares(values - blocks), _squares(blocks))


def what_if_energies(x: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None = None, batch_dims: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`what_if`'s statistics, and the squared quantize-dequantize errors and squared values
    of ``x`` (reduction dimension last) summed over every dimension but the reduction dimension and
    the first ``batch_dims``: two float64 tensors of shape ``x.shape[:batch_dims] + x.shape[-1:]``,
    what a product's error is made of (:func:`product_error_energy`)."""
    blocks = blocks_of(x, recipe.block)
    values, saturated = quantize_blocks(blocks, recipe, amax)
    summed = tuple(range(batch_dims, x.dim() - 1))
    error = _squares(_unblocked(values - blocks, x, recipe), summed)
    signal = _squares(x.detach().to(torch.float32), summed)
    return _statistics(blocks, values, saturated, error.sum(), signal.sum()), error, signal


def product_error_energy(error: torch.Tensor, other_signal: torch.Tensor) -> torch.Tensor:
    """The expected squared error of a product whose one operand carries rounding errors of
    energy ``error`` per (batch, reduction index) and whose other operand is exact, of energy
    ``other_signal`` there: E||dA B||^2 = sum over b, k of ||dA[b, :, k]||^2 ||B[b, k, :]||^2
    for errors independent of each other (rounding errors nearly are). Unlike an operand's
    relative error alone, it weighs each error by what it is multiplied with: the neighbours of
    an outlier channel, or a column the other operand zeroes, count for what they change."""
    return (error * other_signal).sum()


class AmaxHistory:
    """Delayed scaling's state: the amax of each operand (by key) over its last ``length`` uses,
    on its device. A use scales by the largest amax of the uses before it (its own, the first time)."""

    def __init__(self) -> None:
        self._history: dict[Hashable, deque[torch.Tensor]] = {}

    def amax(self, key: Hashable, x: torch.Tensor, length: int) -> torch.Tensor:
        current = x.detach().abs().amax().to(torch.float32)
        history = self._history.get(key)
        if history is None:
            history = self._history[key] = deque(maxlen=length)
        scale_amax = torch.stack(tuple(history)).amax() if history else current
        history.append(current)
        return scale_amax
