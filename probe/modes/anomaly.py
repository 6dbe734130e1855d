"""The monitor's anomaly rules, applied to each collected step's metrics.

- **non-finite** (immediate): a series holding NaN or Inf, from its first step on
  (one alert until the series is finite again);
- **turbulence**: a metric (the norm by default) of an activation, weight
  gradient or weight (by default) far from its running average, in either
  direction: above ``ema * (1 + threshold)`` or below ``ema / (1 + threshold)``.
  The first ``warmup`` values of a series only build the average (a run's first
  steps have no history and are never alarms: msprobe's rule fires at step 1),
  and a value that raised an alarm does not enter the average (one spike gives
  one alert, not a second one when the metric falls back); an alert lasts while
  the values stay out of band (one alert per episode, not per step), and after
  ``warmup`` such values in a row their mean becomes the new average (a level
  shift is one alert);
- **user rules**: callables ``rule(observation) -> None | False | True | str``
  (a string is the reason), given a :class:`Observation`.

A rule's verdict is an :class:`Anomaly`: step, rank, module (or parameter) name,
metric (``"output_grad.norm"``), value, baseline (the running average, or 0).

Alerts are grouped into **incidents**: the alerts of one step form one incident, and an
incident goes on into the next collected step while one of its series is still anomalous
(alerting again, out of its band or still non-finite), so the alerts of consecutive steps
join it. One fault (a gradient explosion: dozens of series in a step, their effects the
step after) is one incident, logged once; its **root** is the alert of the series recorded
earliest in its first step (collection order: forward, then backward, then the optimizer).
Each alert carries its incident's id, the step it began at.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from probe.modes.monitor_metrics import METRIC_COLUMNS
from probe.rundir.reading import read_jsonl, reading, record_from_row
from probe.rundir.records import AnomalyRecord as Anomaly  # what the monitor writes is what load() reads

if TYPE_CHECKING:
    from probe.modes.monitor_config import MonitorConfig


@dataclass(frozen=True)
class Series:
    """One monitored quantity: ``kind`` (activation, weight_grad, weight, exp_avg,
    exp_avg_sq, update, update_ratio), module or parameter ``name``, ``slot`` (input,
    output, input_grad, output_grad for activations) and module ``call`` index."""

    kind: str
    name: str
    slot: str = ""
    call: int = 0

    @property
    def label(self) -> str:
        return self.slot or self.kind


@dataclass(frozen=True)
class Observation:
    """What a user rule sees: one series' metrics at one step."""

    step: int
    rank: int
    series: Series
    metrics: Mapping[str, float]


def anomaly_json(anomaly: Anomaly) -> dict[str, Any]:
    """One line of ``anomalies.jsonl`` (strict JSON: a non-finite number is written as a string)."""
    out = asdict(anomaly)
    for key in ("value", "baseline"):
        if isinstance(out[key], float) and not math.isfinite(out[key]):
            out[key] = repr(out[key])
    return out


def read_anomalies(path: Path) -> list[Anomaly]:
    """The lines of an ``anomalies.jsonl`` (:func:`anomaly_json`'s), in detection order; none
    when the file is absent."""
    rows = read_jsonl(path)
    with reading(path):
        return [record_from_row(Anomaly, row) for row in rows]


@dataclass(frozen=True)
class Incident:
    """Alerts of one fault: consecutive steps of one rank (see the module's docstring)."""

    rank: int
    first_step: int
    last_step: int
    root: Anomaly
    """The alert of the series recorded earliest in the incident's first step (among the
    alerts given: of a later step when only those were)."""
    alerts: int
    series: int
    """Distinct series (module or parameter, call, metric) among its alerts."""

    def describe(self) -> str:
        steps = (f"step {self.first_step}" if self.first_step == self.last_step
                 else f"steps {self.first_step}-{self.last_step}")
        root = self.root
        base = "" if root.baseline is None else f" (baseline {root.baseline:.4g})"
        alerts = f"{self.alerts} alert{'s' * (self.alerts != 1)}"
        return (f"incident at {steps} rank {self.rank}: {alerts} on {self.series} series, "
                f"root {root.rule}: {root.module} {root.metric} = {root.value:.4g}{base}")


def incidents(anomalies: Iterable[Anomaly]) -> list[Incident]:
    """The incidents of these alerts (given in step, then detection order, as ``run.anomalies()``
    returns them), in order of their first alert. Alerts written without an incident id (older
    runs) are grouped by step."""
    groups: dict[tuple[int, int], list[Anomaly]] = {}
    for a in anomalies:
        groups.setdefault((a.rank, a.step if a.incident is None else a.incident), []).append(a)
    found = []
    for (rank, began), alerts in groups.items():
        first = min(a.step for a in alerts)
        root = next(a for a in alerts if a.step == first)
        series = {(a.kind, a.module, a.call, a.metric) for a in alerts}
        found.append(Incident(rank, began, max(a.step for a in alerts), root, len(alerts), len(series)))
    return found


@dataclass
class _Average:
    ema: float = 0.0
    seen: int = 0
    outliers: list[float] = field(default_factory=list)
    """The values of the alert in progress (consecutive out-of-band values)."""


class AnomalyDetector:
    """Applies the configured rules step after step; keeps each series' running averages."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self._averages: dict[tuple[Series, str], _Average] = {}
        self._nonfinite: set[Series] = set()
        self._incident: int | None = None
        """The first step of the incident still going on, if any."""

    def scan(self, step: int, rank: int, series: list[Series], values: np.ndarray) -> list[Anomaly]:
        found: list[Anomaly] = []
        rule = self.config.turbulence
        for s, row in zip(series, values, strict=True):
            metrics = {name: float(v) for name, v in zip(METRIC_COLUMNS, row, strict=True)}
            nonfinite = metrics["nans"] + metrics["infs"]
            if self.config.nonfinite and nonfinite > 0 and s not in self._nonfinite:
                reason = f"{int(metrics['nans'])} NaN, {int(metrics['infs'])} Inf"
                found.append(Anomaly(step, rank, s.name, f"{s.label}.nans", metrics["nans"], 0.0, "nonfinite",
                                     s.kind, s.call, reason))
            if nonfinite > 0:
                self._nonfinite.add(s)  # one alert until the series is finite again
            else:
                self._nonfinite.discard(s)
            if rule is not None and nonfinite == 0 and s.kind in rule.kinds:
                for metric in rule.metrics:
                    anomaly = self._turbulence(step, rank, s, metric, abs(metrics[metric]))
                    if anomaly is not None:
                        found.append(anomaly)
            for user_rule in self.config.user_rules:
                verdict = user_rule(Observation(step, rank, s, metrics))
                if verdict:
                    reason = verdict if isinstance(verdict, str) else ""
                    name = getattr(user_rule, "__name__", type(user_rule).__name__)
                    found.append(Anomaly(step, rank, s.name, f"{s.label}.norm", metrics["norm"], None,
                                         f"rule:{name}", s.kind, s.call, reason))
        self._group(step, found)
        return found

    def _group(self, step: int, found: list[Anomaly]) -> None:
        """Give the step's alerts their incident; keep it open while anything is still anomalous."""
        if found and self._incident is None:
            self._incident = step
        for anomaly in found:
            anomaly.incident = self._incident
        ongoing = bool(found) or bool(self._nonfinite) or any(a.outliers for a in self._averages.values())
        if not ongoing:
            self._incident = None

    def _turbulence(self, step: int, rank: int, s: Series, metric: str, value: float) -> Anomaly | None:
        rule = self.config.turbulence
        assert rule is not None
        if not math.isfinite(value):
            return None
        average = self._averages.setdefault((s, metric), _Average())
        if average.seen >= rule.warmup and average.ema > 0:
            factor = 1 + rule.threshold
            if value > average.ema * factor or value < average.ema / factor:
                average.outliers.append(value)
                first = len(average.outliers) == 1
                baseline = average.ema
                if len(average.outliers) >= rule.warmup:
                    # A new level, not a spike: adopt it, so that it is one alert, not one per step.
                    average.ema = sum(average.outliers) / len(average.outliers)
                    average.outliers.clear()
                if first:
                    return Anomaly(step, rank, s.name, f"{s.label}.{metric}", value, baseline, "turbulence",
                                   s.kind, s.call)
                return None
        average.outliers.clear()
        average.ema = value if average.seen == 0 else rule.decay * average.ema + (1 - rule.decay) * value
        average.seen += 1
        return None
