"""How a tensor's values sit in its dtype's range: shares and a log2-magnitude histogram.

Extremes say how large a tensor got; they do not say whether a lower precision can
hold it. Per tensor, against the range of **its own dtype** (``torch.finfo``):

- ``zeros``: the share of elements equal to zero;
- ``underflow``: the share of nonzero elements below the dtype's smallest normal
  (``finfo.tiny``): subnormals, which have lost precision (and which a
  flush-to-zero device turns into zeros);
- ``near_overflow``: the share of finite elements within a factor 2 of the dtype's
  largest value (``|x| > finfo.max / 2``: the dtype's top binade), one doubling from Inf.

Integer and bool tensors have only ``zeros`` (the others are None: unknown, never 0).
An empty tensor has none.

With ``histogram=True``, the counts of elements per binary exponent: bin ``e`` holds
the elements with ``2**e <= |x| < 2**(e + 1)``, from the dtype's smallest subnormal to
its largest binade, plus a ``zero`` and a ``nonfinite`` bin. The shares follow from it,
so only the histogram is computed then.

Everything is computed on the tensor's device at the time the tensor is recorded
(its value then), a piece at a time where the counting would make something of the tensor's
size (``statistics.pieces``: a widened or contiguous copy, masks, the histogram's index per
element), with no host sync: a count row per tensor, stacked per device at the
step's end, moved to the host by the writer thread with the step's other rows
(:meth:`PendingDistribution.to_host`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from probe.compiled import CompiledKernel, StandaloneCpuKernel
from probe.devices import is_accelerator, record_event
from probe.modes.statistics import pieces
from probe.modes.statistics.reduce import accumulation_dtype, as_real, compact_view

SHARE_NAMES = ("zeros", "underflow", "near_overflow")
"""The columns of ``distribution.npy`` (shares in [0, 1]; NaN where unknown, read back as None)."""
HIST_ZERO = -(1 << 30)
"""The exponent column's code for the zero bin in ``histogram.npy``."""
HIST_NONFINITE = 1 << 30
"""The exponent column's code for the NaN/Inf bin in ``histogram.npy``."""
COMPILED_MIN_NUMEL = 1 << 15
"""On accelerators, from this many elements one compiled pass (a dynamo call) costs less than a few
eager reductions."""
COMPILED_MAX_NUMEL = 1 << 31
CPU_COMPILED_MIN_NUMEL = 2
"""On the CPU, the generated loop (no dynamo frame) runs from this many elements."""
"""The compiled pass counts in int32."""


@dataclass(frozen=True)
class DtypeRange:
    """The binary exponents a floating-point dtype spans."""

    tiny: float
    """The smallest normal value."""
    half_max: float
    """``finfo.max / 2``: values above it are within a factor 2 of overflowing."""
    low: int
    """``log2`` of the smallest subnormal (the smallest normal where there are no subnormals)."""
    normal: int
    """``log2`` of the smallest normal."""
    high: int
    """``floor(log2(finfo.max))``: the top binade."""

    @property
    def bins(self) -> int:
        return self.high - self.low + 1


_RANGES: dict[torch.dtype, DtypeRange] = {}


def dtype_range(dtype: torch.dtype) -> DtypeRange:
    """The exponent range of a floating-point dtype (cached)."""
    known = _RANGES.get(dtype)
    if known is None:
        info = torch.finfo(dtype)
        normal = math.frexp(float(info.smallest_normal))[1] - 1  # exact: log2 of a float rounds
        mantissa_bits = -(math.frexp(float(info.eps))[1] - 1)
        # float8_e8m0fnu has no mantissa bits and no subnormals: low == normal then.
        known = _RANGES[dtype] = DtypeRange(
            tiny=float(info.smallest_normal), half_max=float(info.max) / 2, low=normal - mantissa_bits,
            normal=normal, high=math.frexp(float(info.max))[1] - 1)
    return known


_FREXP_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _widened(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype the reductions take: float8 values are exact in fp32 (subnormals included)."""
    return x if x.dtype in _FREXP_DTYPES else x.to(torch.float32)


def _fused_shares(flat: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """One pass over a 1-D tensor once compiled: ``[zeros, below tiny (zeros included), finite
    above max/2]`` as int32 counts (callers keep tensors of 2^31 elements or more away)."""
    return _count_shares(flat.to(bounds.dtype).abs(), bounds[0], bounds[1])


def _count_shares(a: torch.Tensor, tiny: torch.Tensor | float, half_max: torch.Tensor | float
                  ) -> torch.Tensor:
    zeros = (a == 0).to(torch.int32).sum(dtype=torch.int32)
    below = (a < tiny).to(torch.int32).sum(dtype=torch.int32)
    near = ((a > half_max) & (a != math.inf)).to(torch.int32).sum(dtype=torch.int32)
    return torch.stack([zeros, below - zeros, near])


_COMPILED_SHARES = CompiledKernel(_fused_shares)
_COMPILED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _shares_for(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    r = dtype_range(dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32

    def shares(flat: torch.Tensor) -> torch.Tensor:
        return _count_shares(flat.to(wide).abs(), r.tiny, r.half_max)

    return shares


_CPU_SHARES = StandaloneCpuKernel(_shares_for, "distribution")


def _compiled_input(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as the flat tensor a compiled pass reads, or None where the eager form runs."""
    # On the CPU the generated loop costs about an eager kernel's call: it pays from 2 elements.
    smallest = CPU_COMPILED_MIN_NUMEL if x.device.type == "cpu" else COMPILED_MIN_NUMEL
    if x.dtype not in _COMPILED_DTYPES or not smallest <= x.numel() < COMPILED_MAX_NUMEL:
        return None
    return (x if x.is_contiguous() else x.contiguous()).view(-1)


def _compiled_shares(x: torch.Tensor, r: DtypeRange) -> torch.Tensor | None:
    """The one-pass counts of a large tensor, or None where no compiled pass runs."""
    flat = _compiled_input(x)
    if flat is None:
        return None
    if x.device.type == "cpu":
        return _CPU_SHARES(flat)
    if not _COMPILED_SHARES.usable(x.device):
        return None
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _COMPILED_SHARES(flat, torch.tensor([r.tiny, r.half_max], dtype=wide, device=x.device))


def share_counts(x: torch.Tensor) -> torch.Tensor:
    """``[zeros, underflow, near_overflow]`` counts of a non-empty real tensor, on its device
    (accumulation dtype). Large tensors: one compiled pass (eager comparisons and boolean sums
    cost ten times more on the CPU); small ones: a few eager reductions, read in place.
    Integer/bool: NaN for the last two."""
    acc = accumulation_dtype(x.device)
    if pieces.too_large(x):
        read_whole = x.is_floating_point() and x.is_contiguous()  # the compiled pass, in place
        whole = _compiled_shares(x, dtype_range(x.dtype)) if read_whole else None
        if whole is not None:
            return whole.to(acc)
        return pieces.sum_counts([share_counts(p) for p in pieces.split(x)])
    if not x.is_floating_point():
        zeros = torch.count_nonzero(x == 0).to(acc)
        nan = torch.full((), math.nan, dtype=acc, device=x.device)
        return torch.stack([zeros, nan, nan])
    r = dtype_range(x.dtype)
    counts = _compiled_shares(x, r)
    if counts is not None:
        return counts.to(acc)
    a = _widened(x).abs()
    zeros = torch.count_nonzero(a == 0)
    below = torch.count_nonzero(a < r.tiny)  # zeros included
    above = torch.count_nonzero(a > r.half_max)  # +-Inf included (NaN compares false)
    inf = torch.count_nonzero(torch.isinf(a))
    return torch.stack([zeros, below - zeros, above - inf]).to(acc)


def _fused_bins(flat: torch.Tensor, low: int, bins: int) -> torch.Tensor:
    """Each element's histogram bin (see :func:`exponent_counts`) in one pass once compiled:
    the exponent read from the bits of the fp32 (fp64) value, subnormals scaled up first."""
    if flat.dtype == torch.float64:
        int_dtype, mantissa, bias, tiny, scale, shift = torch.int64, 52, 1023, 2.0**-900, 2.0**128, 128
    else:
        int_dtype, mantissa, bias, tiny, scale, shift = torch.int32, 23, 127, 2.0**-100, 2.0**64, 64
    a = flat.to(torch.float64 if flat.dtype == torch.float64 else torch.float32).abs()
    small = a < tiny
    bits = torch.where(small, a * scale, a).view(int_dtype)
    exponent = (bits >> mantissa) - bias - torch.where(small, shift, 0)
    index = (exponent - (low - 2)).clamp(2, bins + 1)
    index = torch.where(a == 0, 0, index)
    return torch.where((a == a) & (a != math.inf), index, 1).to(torch.int64)


_COMPILED_BINS = CompiledKernel(_fused_bins)


def _bins_for(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    r = dtype_range(dtype)
    return lambda flat: _fused_bins(flat, r.low, r.bins)


_CPU_BINS = StandaloneCpuKernel(_bins_for, "histogram")


def _compiled_bins(x: torch.Tensor, r: DtypeRange) -> torch.Tensor | None:
    flat = _compiled_input(x)
    if flat is None:
        return None
    if x.device.type == "cpu":
        return _CPU_BINS(flat)
    return _COMPILED_BINS(flat, r.low, r.bins) if _COMPILED_BINS.usable(x.device) else None


def exponent_counts(x: torch.Tensor) -> torch.Tensor:
    """The log2-magnitude histogram of a non-empty floating-point tensor, on its device:
    int64 ``[2 + bins]``: zero, nonfinite, then exponents ``low .. high`` of its dtype."""
    if pieces.too_large(x):  # every path makes an int64 bin index per element
        return pieces.sum_counts([exponent_counts(p) for p in pieces.split(x)])
    r = dtype_range(x.dtype)
    index = _compiled_bins(x, r)
    if index is None:
        w = _widened(x)
        # frexp: x = m * 2**e with 0.5 <= |m| < 1, so floor(log2|x|) = e - 1 (subnormals included).
        e = torch.frexp(w).exponent
        index = e.to(torch.int64).sub_(r.low - 1).clamp_(2, r.bins + 1)
        index = torch.where(w == 0, 0, index)
        index = torch.where(torch.isfinite(w), index, 1).reshape(-1)
    if x.device.type == "cpu":
        return torch.bincount(index, minlength=r.bins + 2)
    # bincount sizes its result from the data's max: a host sync on accelerators.
    counts = torch.zeros(r.bins + 2, dtype=torch.int64, device=x.device)
    return counts.scatter_add_(0, index, torch.ones((), dtype=torch.int64, device=x.device).expand_as(index))


def shares_from_histogram(counts: np.ndarray, r: DtypeRange) -> np.ndarray:
    """``[zeros, underflow, near_overflow]`` counts from a dense histogram (see :func:`exponent_counts`)."""
    return np.array([counts[0], counts[2:2 + r.normal - r.low].sum(), counts[-1]], dtype=np.float64)


class DistributionRows:
    """One step's distribution rows, keyed by the stats row they go with."""

    def __init__(self, histogram: bool = False) -> None:
        self.histogram = histogram
        self._reset()

    def _reset(self) -> None:
        # Per device, the count rows (a [3] tensor each) and histograms (1-D, of their dtype's length).
        self._counts: dict[torch.device, list[torch.Tensor]] = {}
        self._hists: dict[torch.device, list[torch.Tensor]] = {}
        # Host side: (row, device, position, numel, multiplicity, dtype range or None, histogram position).
        self._entries: list[tuple[int, torch.device, int, int, int, DtypeRange | None, int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, t: torch.Tensor, row: int) -> None:
        """Count ``t``'s values now, for stats row ``row`` (no host sync)."""
        if t.is_quantized or t.is_meta:
            return
        x, multiplicity = compact_view(as_real(t.detach()))
        numel = x.numel()
        if numel == 0:
            return
        device = x.device
        with torch.no_grad():
            if self.histogram and x.is_floating_point():
                hists = self._hists.setdefault(device, [])
                hists.append(exponent_counts(x))
                self._entries.append((row, device, -1, numel, multiplicity, dtype_range(x.dtype),
                                      len(hists) - 1))
                return
            counts = self._counts.setdefault(device, [])
            counts.append(share_counts(x))
            self._entries.append((row, device, len(counts) - 1, numel, multiplicity, None, -1))

    def end_step(self) -> PendingDistribution:
        """Stack the step's rows per device (queued, no sync) and start afresh."""
        with torch.no_grad():
            counts = {d: torch.stack(rows) for d, rows in self._counts.items()}
            hists = {d: torch.cat(rows) for d, rows in self._hists.items()}
        offsets: dict[torch.device, list[int]] = {}
        for device, rows in self._hists.items():
            offsets[device] = np.cumsum([0] + [len(h) for h in rows]).tolist()
        events = [record_event(d) for d in set(counts) | set(hists) if is_accelerator(d)]
        pending = PendingDistribution(counts, hists, offsets, self._entries, events, self.histogram)
        self._reset()
        return pending


class PendingDistribution:
    """A step's distribution rows on their devices, handed to the writer thread."""

    def __init__(self, counts: dict[torch.device, torch.Tensor], hists: dict[torch.device, torch.Tensor],
                 offsets: dict[torch.device, list[int]], entries: list[Any], events: list[Any],
                 histogram: bool) -> None:
        self.counts, self.hists, self.offsets = counts, hists, offsets
        self.entries, self.events, self.histogram = entries, events, histogram

    def to_host(self, rows: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``(shares [rows, 3] with NaN where unknown, histogram entries [n, 3] of (row, exponent,
        count) or None when no histogram was recorded)``: one transfer per device."""
        for event in self.events:
            event.synchronize()
        counts = {d: t.to("cpu", torch.float64).numpy() for d, t in self.counts.items()}
        hists = {d: t.cpu().numpy() for d, t in self.hists.items()}
        shares = np.full((rows, len(SHARE_NAMES)), np.nan)
        entries: list[np.ndarray] = []
        for row, device, position, numel, multiplicity, r, hist in self.entries:
            if r is None:
                shares[row] = counts[device][position] / numel
                continue
            start, stop = self.offsets[device][hist], self.offsets[device][hist + 1]
            dense = hists[device][start:stop]
            shares[row] = shares_from_histogram(dense, r) / numel
            nonzero = np.flatnonzero(dense)
            exponents = np.where(nonzero == 0, HIST_ZERO,
                                 np.where(nonzero == 1, HIST_NONFINITE, nonzero - 2 + r.low))
            entries.append(np.stack([np.full(len(nonzero), row), exponents, dense[nonzero] * multiplicity],
                                    axis=1).astype(np.int64))
        if not self.histogram:
            return shares, None
        histogram = np.concatenate(entries) if entries else np.empty((0, 3), dtype=np.int64)
        return shares, histogram


def read_shares(row: np.ndarray) -> dict[str, float | None]:
    """One ``distribution.npy`` row as the record's dict (NaN, unknown, is None)."""
    return {name: None if math.isnan(v) else v for name, v in zip(SHARE_NAMES, row.tolist(), strict=True)}


def read_histograms(entries: np.ndarray) -> dict[int, dict[str, Any]]:
    """``histogram.npy`` as ``{row: {"zero": n, "nonfinite": n, "exponents": {e: n}}}``
    (bin ``e`` counts ``2**e <= |x| < 2**(e + 1)``; elements, broadcast ones included)."""
    out: dict[int, dict[str, Any]] = {}
    for row, exponent, count in entries.tolist():
        h = out.setdefault(row, {"zero": 0, "nonfinite": 0, "exponents": {}})
        if exponent == HIST_ZERO:
            h["zero"] = count
        elif exponent == HIST_NONFINITE:
            h["nonfinite"] = count
        else:
            h["exponents"][exponent] = count
    return out


def check_arrays(shares: np.ndarray, histogram: np.ndarray | None, rows: int) -> None:
    """Raise ValueError when the files do not fit the step's ``rows`` statistics rows."""
    if shares.ndim != 2 or shares.shape != (rows, len(SHARE_NAMES)) or shares.dtype.kind != "f":
        raise ValueError(f"distribution shares are an array of shape {shares.shape} and dtype "
                         f"{shares.dtype}, expected ({rows}, {len(SHARE_NAMES)}) floats")
    if histogram is None:
        return
    if (histogram.ndim != 2 or histogram.shape[1] != 3 or histogram.dtype.kind not in "iu"
            or (histogram.size and not 0 <= histogram[:, 0].min() <= histogram[:, 0].max() < rows)):
        raise ValueError(f"the histogram is an array of shape {histogram.shape} and dtype {histogram.dtype}, "
                         f"expected (entries, 3) integers naming rows below {rows}")
