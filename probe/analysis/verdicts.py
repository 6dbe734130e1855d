"""pass / warning / error, from metrics and the pair's lower precision.

The thresholds (table and reasoning in docs/compare.md) sit above what rounding
alone does in each dtype, so a clean comparison of two runs of one program is
all ``pass`` and a real numerical difference is an ``error``:

- data, pass: the largest error is at most 4 ULP of the pair's lower dtype;
- data, warning: cosine, msprobe's five-thousandth ratio and the largest error
  relative to the reference's rms are all within :data:`THRESHOLDS` (so one
  element far off, a corrupted weight, is an error even at cosine 1);
- statistics: the largest relative difference of max, min and norm within the
  pass or warning bound; the mean is held to the same bound scaled by
  ``norm / sqrt(numel)`` (a mean near zero has no useful relative error);
- anything else is an error, and so is any difference in NaN or Inf, shape, or
  a float-vs-integer dtype;
- "not compared": both runs dumped the step but a tensor's data is missing or
  unreadable on one side (a lost or deleted shard, a skipped blob). It is never
  a pass: nothing is known about that tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.analysis.metrics import StatsMetrics, TensorMetrics, lower_precision

PASS, WARNING, ERROR, UNMATCHED, NOT_COMPARED = "pass", "warning", "error", "unmatched", "not compared"

# The rule that decided a verdict (the ``rule`` of a row; docs/compare.md has the table).
RULE_ULP = "ulp"                      # data within 4 ULP of the pair's lower dtype
RULE_STATS = "stats rounding"         # statistics within the pair's pass bound
RULE_SHAPE = "shape"                  # only shape and dtype known (or they differ)
RULE_NONFINITE = "nonfinite"          # NaN/Inf at different positions, or in different numbers
RULE_THRESHOLDS = "thresholds"        # the fixed magnitude thresholds (inputs unknown)
RULE_NOT_COMPARED = "not compared"    # data missing or unreadable
RULE_UNMATCHED = "unmatched"          # only in one run
RULE_OUTSIDE = "outside input"        # an input from outside the step differs: it enters here
RULE_REPLAY = "replay"                # fp64 replay on each run's inputs: own rounding vs carried
RULE_PROPAGATION = "propagation"      # inputs' difference x 32 + each run's rounding
RULE_ARGUMENTS = "arguments"          # identical inputs, other exact results: called with other arguments
RULE_LOWERED = "lowered precision"    # computed lower than run A, unexplained by B's policy
RULE_CARRIED = "carried"              # downstream of a divergence, beyond the thresholds
RULE_UNMATCHED_PRODUCER = "unmatched producer"  # entered through ops that exist in one run only
RULE_REDUCTION_ORDER = "reduction order"  # a sum the layouts split otherwise, within each order's rounding
RULE_ROUTING = "routing"              # discrete results (indices, masks) of real inputs within precision
VERDICTS = (PASS, WARNING, ERROR, UNMATCHED, NOT_COMPARED)
"""Every verdict, in the order reports count them."""
SEVERITY = {PASS: 0, UNMATCHED: 1, WARNING: 2, NOT_COMPARED: 3, ERROR: 4}


@dataclass(frozen=True)
class Thresholds:
    pass_ulp: float
    warn_cosine: float
    warn_ratio: float
    warn_scaled_err: float
    """Largest absolute error allowed in a warning, as a fraction of the reference's rms."""
    pass_stats: float
    warn_stats: float


THRESHOLDS = {
    torch.float64: Thresholds(4, 1 - 1e-12, 1.0, 1e-10, 1e-12, 1e-9),
    torch.float32: Thresholds(4, 0.999999, 0.999, 1e-4, 4 * 2.0**-24, 1e-4),
    torch.float16: Thresholds(4, 0.9999, 0.99, 5e-3, 4 * 2.0**-11, 1e-2),
    torch.bfloat16: Thresholds(4, 0.999, 0.95, 5e-2, 4 * 2.0**-8, 5e-2),
}


def thresholds_for(dtype: torch.dtype) -> Thresholds:
    if dtype in THRESHOLDS:
        return THRESHOLDS[dtype]
    return THRESHOLDS[torch.bfloat16 if dtype.is_floating_point else torch.float64]


def tensor_verdict(m: TensorMetrics, dtype: torch.dtype) -> tuple[str, str]:
    """The magnitude verdict of a dumped tensor pair; the message names the failed bound."""
    t = thresholds_for(dtype)
    name = str(dtype).removeprefix("torch.")
    if m.nonfinite_mismatch:
        return ERROR, f"{m.nonfinite_mismatch} NaN/Inf positions differ"
    if m.max_ulp <= t.pass_ulp:
        return PASS, ""
    scaled = m.max_abs_err / m.ref_rms if m.ref_rms > 0 else (0.0 if m.max_abs_err == 0 else math.inf)
    failed = [f"cosine {m.cosine:.9g} < {t.warn_cosine:.9g}" if m.cosine < t.warn_cosine else "",
              f"{m.five_thousandth_ratio:.4g} within 5e-3 < {t.warn_ratio:.4g}"
              if m.five_thousandth_ratio < t.warn_ratio else "",
              f"max error {scaled:.3g} x the reference rms > {t.warn_scaled_err:.3g}"
              if scaled > t.warn_scaled_err else ""]
    failed = [f for f in failed if f]
    if not failed:
        return WARNING, (f"max error {m.max_ulp:.3g} ULP of {name} (> {t.pass_ulp:g}; {name} warning "
                         "thresholds hold)")
    return ERROR, (f"cosine {m.cosine:.9g}, max error {m.max_ulp:.3g} ULP of {name} ({scaled:.3g} x the "
                   f"reference rms); {name} thresholds failed: {', '.join(failed)}")


def stats_verdict(m: StatsMetrics, dtype: torch.dtype, norm: float, numel: int) -> tuple[str, str]:
    """The magnitude verdict of a pair of statistics; the message names the bound."""
    t = thresholds_for(dtype)
    name = str(dtype).removeprefix("torch.")
    if m.nan_diff or m.inf_diff:
        return ERROR, f"NaN count differs by {m.nan_diff}, Inf count by {m.inf_diff}"
    rel = max(m.max_rel, m.min_rel, m.norm_rel)
    mean_scale = (norm / math.sqrt(numel)) if numel and norm and math.isfinite(norm) else 0.0

    def mean_ok(bound: float) -> bool:
        return m.mean_abs <= bound * mean_scale or m.mean_rel <= bound

    if rel <= t.pass_stats and mean_ok(t.pass_stats):
        return PASS, ""
    if rel <= t.warn_stats and mean_ok(t.warn_stats):
        return WARNING, (f"statistics differ by up to {rel:.3g} (relative; {name} warning bound "
                         f"{t.warn_stats:.3g})")
    return ERROR, (f"statistics differ by up to {max(rel, m.mean_rel):.3g} (relative; {name} "
                   f"warning bound {t.warn_stats:.3g})")


def lower_precision_of(dtype_a: str, dtype_b: str) -> torch.dtype:
    """The less precise of two dtype names, as in the op records (``"bfloat16"``)."""
    return lower_precision(getattr(torch, dtype_a), getattr(torch, dtype_b))


def worst(verdicts: list[str]) -> str:
    return max(verdicts, key=SEVERITY.__getitem__) if verdicts else PASS
