"""The monitor's records, as its reader returns them (``run.mode("monitor")``, ``run.monitor()``,
``run.anomalies()``): one series at one step, and one alert. The writer's alerts are these records
too (``anomaly.Anomaly``): what the monitor writes is what ``probe.load`` reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCALER_SERIES = "scaler"
"""The name of the loss scaler's series (``scaler=``): of kinds :data:`LOSS_SCALE` and
:data:`LOSS_SCALE_SKIPPED`, written by the monitor and read back by its reader."""
LOSS_SCALE = "loss_scale"
"""The kind of the series holding the scale in force in a step."""
LOSS_SCALE_SKIPPED = "loss_scale_skipped"
"""The kind of the series that is 1 in a step the scaler skipped (its gradients overflowed), else 0."""


@dataclass(slots=True)
class MonitorRecord:
    """One monitored series at one step (``run.monitor()``): metrics in fp64."""

    step: int
    rank: int
    kind: str
    """activation, weight_grad, weight, exp_avg, exp_avg_sq, update or update_ratio."""
    name: str
    """Module FQN (activations) or parameter name."""
    slot: str
    """input, output, input_grad or output_grad for activations; "" otherwise."""
    call: int
    min: float
    max: float
    mean: float
    norm: float
    zeros: float
    nan: float
    """NaN count (``nans`` before run format 4; that name still reads)."""
    inf: float
    """+Inf and -Inf count (``infs`` before run format 4; that name still reads)."""
    numel: float
    posinf: float | None = None
    """+Inf count; None in runs before format 4 where ``inf`` is not 0 (the sign was not recorded)."""
    neginf: float | None = None
    """-Inf count; as ``posinf``."""
    distribution: dict[str, float | None] | None = None
    """With the monitor's ``distribution=True`` (or ``histogram=True``): shares of ``zeros``,
    ``underflow`` and ``near_overflow`` of the series' dtype (see ``TensorRecord.distribution``);
    None when not recorded."""
    histogram: dict[str, Any] | None = None
    """With ``histogram=True``: as ``TensorRecord.histogram``; None when not recorded."""

    @property
    def nans(self) -> float:
        """``nan`` by its name before run format 4."""
        return self.nan

    @property
    def infs(self) -> float:
        """``inf`` by its name before run format 4."""
        return self.inf


@dataclass(slots=True)
class AnomalyRecord:
    """One monitor alert (``run.anomalies()``)."""

    step: int
    rank: int
    module: str
    metric: str
    """``<slot or kind>.<metric>``, e.g. ``output_grad.norm``."""
    value: float
    baseline: float | None
    rule: str
    """nonfinite, turbulence or ``rule:<name>`` of a user rule."""
    kind: str
    call: int = 0
    reason: str = ""
    incident: int | None = None
    """The step its incident began at (the incident's id within the rank); None in runs
    written before incidents existed."""

    def describe(self) -> str:
        base = "" if self.baseline is None else f" (baseline {self.baseline:.4g})"
        why = f": {self.reason}" if self.reason else ""
        return (f"step {self.step} rank {self.rank} {self.rule}: {self.module} {self.metric} = "
                f"{self.value:.4g}{base}{why}")
