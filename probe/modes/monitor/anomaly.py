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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from probe.modes.monitor.records import AnomalyRecord as Anomaly  # what load() reads back
from probe.modes.statistics.columns import LEGACY_NAMES, MONITOR_COLUMNS
from probe.rundir.untrusted_reads import read_jsonl, reading, record_from_row

if TYPE_CHECKING:
    from probe.modes.monitor.options import Monitor


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

    @property
    def tag(self) -> str:
        """Its TensorBoard tag prefix, ``kind/name[/slot][#call]``; the model itself (name "")
        is ``<model>`` there, so the tag has no empty part."""
        prefix = f"{self.kind}/{self.name or '<model>'}" + (f"/{self.slot}" if self.slot else "")
        return prefix + (f"#{self.call}" if self.call else "")


class Metrics(dict):  # type: ignore[type-arg]
    """A series' metrics by the statistics engine's names; a rule written for the names before
    run format 4 (``nans``, ``infs``) reads them too."""

    def __missing__(self, key: str) -> float:
        if key in LEGACY_NAMES:
            return self[LEGACY_NAMES[key]]
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self[key] if key in self or key in LEGACY_NAMES else default


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


def read_anomalies(path: Path, run: Path | None = None) -> list[Anomaly]:
    """The lines of an ``anomalies.jsonl`` (:func:`anomaly_json`'s), in detection order; none
    when the file is absent. ``run``: the run directory, which the file must lie in."""
    rows = read_jsonl(path, run=run)
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
        why = f": {root.reason}" if root.reason else ""  # a non-finite root's NaN and Inf counts
        alerts = f"{self.alerts} alert{'s' * (self.alerts != 1)}"
        return (f"incident at {steps} rank {self.rank}: {alerts} on {self.series} series, "
                f"root {root.rule}: {root.module} {root.metric} = {root.value:.4g}{base}{why}")


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


_NANS, _INFS = MONITOR_COLUMNS.index("nan"), MONITOR_COLUMNS.index("inf")


@dataclass(frozen=True)
class _Layout:
    """A step's series mapped to the detector's state rows (the same series come step after step)."""

    key: tuple[Series, ...]
    rows: np.ndarray
    """The state row of each position."""
    groups: list[np.ndarray]
    """Positions by occurrence: a series listed twice in a step is scanned twice, in order."""


class AnomalyDetector:
    """Applies the configured rules step after step; keeps each series' running averages.

    The built-in rules run over all series of a step at once (numpy over state arrays, one row
    per series, one column per watched metric); only alerts, alerts in progress and user rules
    take Python per series. The arithmetic is the per-series rule's, operation for operation, so
    the averages and alerts are the same bit for bit."""

    def __init__(self, config: Monitor) -> None:
        self.config = config
        watched = config.turbulence.metrics if config.turbulence is not None else ()
        self._columns = [MONITOR_COLUMNS.index(metric) for metric in watched]
        self._index: dict[Series, int] = {}
        self._series: list[Series] = []
        """The series of each state row."""
        self._bad = np.zeros(0, dtype=bool)
        """Non-finite at its latest step: one alert until the series is finite again."""
        self._watched = np.zeros(0, dtype=bool)
        """Of a kind the turbulence rule watches."""
        self._ema = np.zeros((0, len(watched)))
        self._seen = np.zeros((0, len(watched)), dtype=np.int64)
        """Values that entered the average."""
        self._outliers: dict[tuple[int, int], list[float]] = {}
        """(row, metric column) -> the values of the alert in progress (consecutive out-of-band values)."""
        self._layout: _Layout | None = None
        self._incident: int | None = None
        """The first step of the incident still going on, if any."""
        self.listeners: list[Callable[[list[Anomaly]], None]] = []
        """Called with each scanned step's alerts, where the scan runs (the writer thread, or the
        training thread with ``on_anomaly="dump"``/``"stop"``): ``probe.escalation`` learns of
        incidents this way, without a sync of its own. A listener must be quick and thread-safe."""

    def scan(self, step: int, rank: int, series: list[Series], values: np.ndarray,
             handled: np.ndarray | None = None) -> list[Anomaly]:
        """The step's alerts, in series order (per series: non-finite, turbulence, user rules).
        ``handled``: per series, its NaN and Inf are an overflow the loss scaler handled (a
        gradient in a step it skipped): no non-finite alert, and no alert in progress."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape[0] != len(series):
            raise ValueError(f"anomaly scan: {len(series)} series but {values.shape[0]} rows of values")
        layout = self._layout_of(series)
        alerts: list[tuple[int, int, Anomaly]] = []  # (position, order within the series, alert)
        for positions in layout.groups:
            self._scan_rows(step, rank, positions, layout.rows[positions], values[positions], alerts,
                            None if handled is None else handled[positions])
        if self.config.anomaly_rules:
            self._user_rules(step, rank, series, values, alerts)
        alerts.sort(key=lambda entry: (entry[0], entry[1]))
        found = [alert for _, _, alert in alerts]
        self._group(step, found)
        if found:
            for listener in self.listeners:
                listener(found)
        return found

    def _layout_of(self, series: list[Series]) -> _Layout:
        key = tuple(series)
        if self._layout is not None and self._layout.key == key:
            return self._layout
        fresh = [s for s in dict.fromkeys(key) if s not in self._index]
        if fresh:
            rule = self.config.turbulence
            for s in fresh:
                self._index[s] = len(self._series)
                self._series.append(s)
            self._bad = np.concatenate([self._bad, np.zeros(len(fresh), dtype=bool)])
            watched = [rule is not None and s.kind in rule.kinds for s in fresh]
            self._watched = np.concatenate([self._watched, np.array(watched, dtype=bool)])
            width = len(self._columns)
            self._ema = np.concatenate([self._ema, np.zeros((len(fresh), width))])
            self._seen = np.concatenate([self._seen, np.zeros((len(fresh), width), dtype=np.int64)])
        rows = np.array([self._index[s] for s in key], dtype=np.intp)
        occurrence: dict[Series, int] = {}
        groups: list[list[int]] = []
        for position, s in enumerate(key):
            n = occurrence[s] = occurrence.get(s, -1) + 1
            if n == len(groups):
                groups.append([])
            groups[n].append(position)
        self._layout = _Layout(key, rows, [np.array(g, dtype=np.intp) for g in groups])
        return self._layout

    def _scan_rows(self, step: int, rank: int, positions: np.ndarray, rows: np.ndarray, values: np.ndarray,
                   alerts: list[tuple[int, int, Anomaly]], handled: np.ndarray | None = None) -> None:
        """The built-in rules over distinct series (their state rows ``rows``)."""
        nans, infs = values[:, _NANS], values[:, _INFS]
        nonfinite = nans + infs
        bad = nonfinite > 0  # a NaN count (a row of unknown values) is neither bad nor calm
        if handled is not None:  # the loss scaler's overflow: neither an alert nor calm
            bad &= ~handled
        if self.config.nonfinite:
            for i in np.flatnonzero(bad & ~self._bad[rows]).tolist():
                s = self._series[rows[i]]
                # The metric is the count that is not zero (NaN first); the reason gives both.
                count, value = ("nan", float(nans[i])) if nans[i] > 0 else ("inf", float(infs[i]))
                reason = f"{int(nans[i])} NaN, {int(infs[i])} Inf"
                alert = Anomaly(step, rank, s.name, f"{s.label}.{count}", value, 0.0, "nonfinite", s.kind,
                                s.call, reason)
                alerts.append((int(positions[i]), 0, alert))
        self._bad[rows] = bad
        rule = self.config.turbulence
        if rule is None:
            return
        calm = (nonfinite == 0) & self._watched[rows]
        factor = 1 + rule.threshold
        for j, column in enumerate(self._columns):
            value = np.abs(values[:, column])
            live = np.flatnonzero(calm & np.isfinite(value))
            r, x = rows[live], value[live]
            ema, seen = self._ema[r, j], self._seen[r, j]
            with np.errstate(over="ignore"):  # a huge value's band is Inf, as in Python float arithmetic
                out = (seen >= rule.warmup) & (ema > 0) & ((x > ema * factor) | (x < ema / factor))
            inside = ~out
            # In band, or still warming up: the value enters the average and ends an alert in progress.
            entering = r[inside]
            with np.errstate(over="ignore"):
                self._ema[entering, j] = np.where(seen[inside] == 0, x[inside],
                                                  rule.decay * ema[inside] + (1 - rule.decay) * x[inside])
            self._seen[entering, j] += 1
            if self._outliers:
                for row in entering[np.isin(entering, [k[0] for k in self._outliers if k[1] == j])].tolist():
                    del self._outliers[(row, j)]
            for k in np.flatnonzero(out).tolist():
                alert = self._outlier(step, rank, int(r[k]), j, float(x[k]))
                if alert is not None:
                    alerts.append((int(positions[live[k]]), 1 + j, alert))

    def _outlier(self, step: int, rank: int, row: int, j: int, value: float) -> Anomaly | None:
        """A value out of band: an alert when it starts one; after ``warmup`` such values in a row
        their mean becomes the new average (a new level, not a spike: one alert, not one per step)."""
        rule = self.config.turbulence
        assert rule is not None
        outliers = self._outliers.setdefault((row, j), [])
        outliers.append(value)
        first = len(outliers) == 1
        baseline = float(self._ema[row, j])
        if len(outliers) >= rule.warmup:
            self._ema[row, j] = sum(outliers) / len(outliers)
            del self._outliers[(row, j)]
        if not first:
            return None
        s = self._series[row]
        return Anomaly(step, rank, s.name, f"{s.label}.{rule.metrics[j]}", value, baseline, "turbulence",
                       s.kind, s.call)

    def _user_rules(self, step: int, rank: int, series: list[Series], values: np.ndarray,
                    alerts: list[tuple[int, int, Anomaly]]) -> None:
        order = 1 + len(self._columns)
        for position, (s, row) in enumerate(zip(series, values.tolist(), strict=True)):
            metrics = Metrics(zip(MONITOR_COLUMNS, row, strict=True))
            for user_rule in self.config.anomaly_rules:
                verdict = user_rule(Observation(step, rank, s, metrics))
                if verdict:
                    reason = verdict if isinstance(verdict, str) else ""
                    name = getattr(user_rule, "__name__", type(user_rule).__name__)
                    alert = Anomaly(step, rank, s.name, f"{s.label}.norm", metrics["norm"], None,
                                    f"rule:{name}", s.kind, s.call, reason)
                    alerts.append((position, order, alert))

    def _group(self, step: int, found: list[Anomaly]) -> None:
        """Give the step's alerts their incident; keep it open while anything is still anomalous."""
        if found and self._incident is None:
            self._incident = step
        for anomaly in found:
            anomaly.incident = self._incident
        ongoing = bool(found) or bool(self._bad.any()) or bool(self._outliers)
        if not ongoing:
            self._incident = None
