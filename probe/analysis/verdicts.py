"""pass / warning / error, from metrics and the pair's lower precision.

The thresholds (also in docs/compare.md) sit above what rounding alone does in
each dtype, so a clean comparison of two runs of one program is all ``pass``
and a real numerical difference is an ``error``:

| lower dtype | pass (data) | warning (data) | pass (stats) | warning (stats) |
| --- | --- | --- | --- | --- |
| fp64 | max ULP <= 4 | cosine >= 1 - 1e-12 | rel <= 1e-12 | rel <= 1e-9 |
| fp32 | max ULP <= 4 | cosine >= 0.999999 and 99.9% within 5e-3 | rel <= 2.4e-7 | rel <= 1e-4 |
| fp16 | max ULP <= 4 | cosine >= 0.9999 and 99% within 5e-3 | rel <= 2e-3 | rel <= 1e-2 |
| bf16, fp8 | max ULP <= 4 | cosine >= 0.999 and 95% within 5e-3 | rel <= 1.6e-2 | rel <= 5e-2 |

Data: "max ULP" is the largest error in units in the last place of the lower
dtype; "within 5e-3" is msprobe's five-thousandth ratio. Statistics: "rel" is
the largest relative difference of max, min and norm; the mean is held to the
same bound scaled by ``norm / sqrt(numel)`` (a mean near zero has no useful
relative error). Anything else is an error, and so is any difference in NaN or
Inf, shape, or a float-vs-integer dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.analysis.metrics import StatsMetrics, TensorMetrics, lower_precision

PASS, WARNING, ERROR, UNMATCHED = "pass", "warning", "error", "unmatched"
SEVERITY = {PASS: 0, UNMATCHED: 1, WARNING: 2, ERROR: 3}


@dataclass(frozen=True)
class Thresholds:
    pass_ulp: float
    warn_cosine: float
    warn_ratio: float
    pass_stats: float
    warn_stats: float


THRESHOLDS = {
    torch.float64: Thresholds(4, 1 - 1e-12, 1.0, 1e-12, 1e-9),
    torch.float32: Thresholds(4, 0.999999, 0.999, 4 * 2.0**-24, 1e-4),
    torch.float16: Thresholds(4, 0.9999, 0.99, 4 * 2.0**-11, 1e-2),
    torch.bfloat16: Thresholds(4, 0.999, 0.95, 4 * 2.0**-8, 5e-2),
}


def thresholds_for(dtype: torch.dtype) -> Thresholds:
    if dtype in THRESHOLDS:
        return THRESHOLDS[dtype]
    return THRESHOLDS[torch.bfloat16 if dtype.is_floating_point else torch.float64]


def tensor_verdict(m: TensorMetrics, dtype: torch.dtype) -> tuple[str, str]:
    t = thresholds_for(dtype)
    if m.nonfinite_mismatch:
        return ERROR, f"{m.nonfinite_mismatch} NaN/Inf positions differ"
    if m.max_ulp <= t.pass_ulp:
        return PASS, ""
    if m.cosine >= t.warn_cosine and m.five_thousandth_ratio >= t.warn_ratio:
        return WARNING, f"max error {m.max_ulp:.3g} ULP of {str(dtype).removeprefix('torch.')}"
    return ERROR, (f"cosine {m.cosine:.6g}, max error {m.max_ulp:.3g} ULP of "
                   f"{str(dtype).removeprefix('torch.')}")


def stats_verdict(m: StatsMetrics, dtype: torch.dtype, norm: float, numel: int) -> tuple[str, str]:
    t = thresholds_for(dtype)
    if m.nan_diff or m.inf_diff:
        return ERROR, f"NaN count differs by {m.nan_diff}, Inf count by {m.inf_diff}"
    rel = max(m.max_rel, m.min_rel, m.norm_rel)
    mean_scale = (norm / math.sqrt(numel)) if numel and norm and math.isfinite(norm) else 0.0

    def mean_ok(bound: float) -> bool:
        return m.mean_abs <= bound * mean_scale or m.mean_rel <= bound

    if rel <= t.pass_stats and mean_ok(t.pass_stats):
        return PASS, ""
    if rel <= t.warn_stats and mean_ok(t.warn_stats):
        return WARNING, f"statistics differ by up to {rel:.3g} (relative)"
    return ERROR, f"statistics differ by up to {max(rel, m.mean_rel):.3g} (relative)"


def lower_precision_of(dtype_a: str, dtype_b: str) -> torch.dtype:
    """The less precise of two dtype names, as in the op records (``"bfloat16"``)."""
    return lower_precision(getattr(torch, dtype_a), getattr(torch, dtype_b))


def worst(verdicts: list[str]) -> str:
    return max(verdicts, key=SEVERITY.__getitem__) if verdicts else PASS
