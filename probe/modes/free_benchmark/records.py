"""The free benchmark's records, as its reader returns them (``run.mode("free_benchmark")``,
``run.checks()``): one check of one op output."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CheckRecord:
    """One free-benchmark check of one op output (``run.checks()``)."""

    step: int
    rank: int
    op_index: int
    op_id: str
    name: str
    module: str
    phase: str
    perturb: str
    verdict: str
    """"pass", "fail" or "skip"."""
    output: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    ratio: float | None = None
    """Largest output deviation, relative to ``max(|original|, rms(original))``."""
    threshold: float | None = None
    input_change: float | None = None
    nonfinite_mismatch: int = 0
    sign_flips: int = 0
    reason: str | None = None
    """Why a check was skipped."""
