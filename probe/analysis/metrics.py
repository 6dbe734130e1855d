"""How far apart two tensors (or two tensors' statistics) are.

Tensor metrics follow msprobe's definitions where it has one, so users can read
them side by side: cosine similarity; max absolute error; max relative error
``|a - b| / |a|`` (``a`` the reference; a tiny epsilon where ``a == 0``); the
one- and five-thousandth ratios (fraction of elements whose relative error is
below 0.001 / 0.005). Added: RMSE, and the error in ULPs of the lower-precision
dtype of the pair (``|a - b|`` over the spacing of that dtype at
``max(|a|, |b|)``), which makes thresholds dtype-aware.

Everything is computed in fp64, vectorised, over chunks of the flattened
tensors so memory stays bounded whatever the tensor's size. NaN and Inf must
sit at the same positions in both tensors; they are counted, and left out of
the numeric metrics.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

CHUNK = 1 << 22
_REL_EPS = 1e-12
# Mantissa bits including the implicit one, and the smallest positive subnormal.
_PRECISION = {
    torch.float64: (53, 2.0**-1074),
    torch.float32: (24, 2.0**-149),
    torch.float16: (11, 2.0**-24),
    torch.bfloat16: (8, 2.0**-133),
}
_RANK = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def lower_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes (fp8 counts as bf16, integers as fp64)."""
    ra = _RANK.get(a, 0 if a.is_floating_point else 3)
    rb = _RANK.get(b, 0 if b.is_floating_point else 3)
    return a if ra <= rb else b


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each (non-negative, fp64) magnitude."""
    bits, tiny = _PRECISION.get(dtype, _PRECISION[torch.bfloat16])
    _, exponent = torch.frexp(magnitude)
    return torch.clamp(torch.ldexp(torch.ones_like(magnitude), exponent - bits), min=tiny)


@dataclass
class TensorMetrics:
    cosine: float
    max_abs_err: float
    max_rel_err: float
    one_thousandth_ratio: float
    five_thousandth_ratio: float
    rmse: float
    max_ulp: float
    nonfinite_mismatch: int
    """Positions where one tensor holds NaN/Inf and the other does not (or another one)."""
    numel: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1)


def tensor_metrics(a: torch.Tensor, b: torch.Tensor) -> TensorMetrics:
    """Metrics of ``b`` against the reference ``a`` (same number of elements)."""
    fa, fb = _flat(a), _flat(b)
    if fa.numel() != fb.numel():
        raise ValueError(f"cannot compare {fa.numel()} elements with {fb.numel()}")
    dtype = lower_precision(a.dtype, b.dtype)
    n = fa.numel()
    dot = norm_a = norm_b = sq_err = 0.0
    max_abs = max_rel = max_ulps = 0.0
    within_1e3 = within_5e3 = 0
    mismatch = 0
    finite_count = 0
    for start in range(0, n, CHUNK):
        x = fa[start : start + CHUNK].to(torch.float64)
        y = fb[start : start + CHUNK].to(torch.float64)
        fx, fy = torch.isfinite(x), torch.isfinite(y)
        same_nonfinite = (~fx & ~fy) & ((x == y) | (torch.isnan(x) & torch.isnan(y)))
        mismatch += int(((fx != fy) | (~fx & ~fy & ~same_nonfinite)).sum())
        both = fx & fy
        x, y = x[both], y[both]
        finite_count += x.numel()
        if x.numel() == 0:
            continue
        diff = (x - y).abs()
        rel = diff / x.abs().clamp(min=_REL_EPS)
        dot += float((x * y).sum())
        norm_a += float((x * x).sum())
        norm_b += float((y * y).sum())
        sq_err += float((diff * diff).sum())
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float(rel.max()))
        max_ulps = max(max_ulps, float((diff / ulp(torch.maximum(x.abs(), y.abs()), dtype)).max()))
        within_1e3 += int((rel < 1e-3).sum())
        within_5e3 += int((rel < 5e-3).sum())
    if norm_a == 0.0 and norm_b == 0.0:
        cosine = 1.0
    elif norm_a == 0.0 or norm_b == 0.0:
        cosine = 0.0
    else:
        cosine = dot / math.sqrt(norm_a * norm_b)
    counted = max(finite_count, 1)
    return TensorMetrics(
        cosine=cosine,
        max_abs_err=max_abs,
        max_rel_err=max_rel,
        one_thousandth_ratio=within_1e3 / counted if finite_count else 1.0,
        five_thousandth_ratio=within_5e3 / counted if finite_count else 1.0,
        rmse=math.sqrt(sq_err / counted) if finite_count else 0.0,
        max_ulp=max_ulps,
        nonfinite_mismatch=mismatch,
        numel=n,
    )


@dataclass
class StatsMetrics:
    """Relative differences of statistics (``|b - a| / max(|a|, |b|)``), and count differences."""

    max_rel: float
    min_rel: float
    mean_rel: float
    norm_rel: float
    mean_abs: float
    nan_diff: int
    inf_diff: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return math.inf if math.isinf(scale) else abs(a - b) / scale


def stats_metrics(a: dict, b: dict) -> StatsMetrics:
    mean_a, mean_b = a.get("mean"), b.get("mean")
    mean_abs = abs(mean_a - mean_b) if mean_a is not None and mean_b is not None else 0.0
    return StatsMetrics(
        max_rel=_rel(a["max"], b["max"]),
        min_rel=_rel(a["min"], b["min"]),
        mean_rel=_rel(mean_a, mean_b),
        norm_rel=_rel(a["norm"], b["norm"]),
        mean_abs=mean_abs if not math.isnan(mean_abs) else 0.0,
        nan_diff=int(b["nan"]) - int(a["nan"]),
        inf_diff=int(b["inf"]) - int(a["inf"]),
    )
