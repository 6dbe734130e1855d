"""The monitor's anomaly alerts: a non-finite alert names the count it found (the Inf count of
an all-Inf series), and the vectorized anomaly scan gives what the per-series rules give."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe.modes.monitor.anomaly import AnomalyDetector, Series, incidents
from probe.modes.monitor.options import Monitor
from probe.modes.statistics.columns import MONITOR_COLUMNS as METRIC_COLUMNS

# -- non-finite alerts ----------------------------------------------------------------


def _row(nans: float, infs: float, norm: float = 1.0) -> np.ndarray:
    row = np.zeros((1, len(METRIC_COLUMNS)))
    row[0, METRIC_COLUMNS.index("norm")] = norm
    row[0, METRIC_COLUMNS.index("nan")] = nans
    row[0, METRIC_COLUMNS.index("inf")] = infs
    row[0, METRIC_COLUMNS.index("numel")] = 1024
    return row


@pytest.mark.parametrize(("nans", "infs", "metric", "value"),
                         [(0, 1024, "output.inf", 1024), (3, 0, "output.nan", 3), (3, 5, "output.nan", 3)])
def test_a_nonfinite_alert_names_the_count_it_found(nans, infs, metric, value):
    detector = AnomalyDetector(Monitor(targets=["x"]))
    (alert,) = detector.scan(0, 0, [Series("activation", "x", "output")], _row(nans, infs, np.inf))
    assert (alert.rule, alert.metric, alert.value) == ("nonfinite", metric, value)
    assert alert.reason == f"{nans} NaN, {infs} Inf"
    for text in (alert.describe(), incidents([alert])[0].describe()):
        assert f"{infs} Inf" in text and f"{nans} NaN" in text
        assert "= 0 " not in text and not text.endswith("= 0")


def test_an_all_inf_output_is_reported_as_inf(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].register_forward_hook(lambda m, a, out: torch.full_like(out, torch.inf))
    with (caplog.at_level(logging.WARNING, logger="probe.monitor"),
          probe.mode("monitor", out=tmp_path / "run", model=model, targets=["0"], tensorboard=False,
                     async_flush=False) as session):
        model(torch.randn(3, 4))
        session.step()
    (alert,) = probe.load(tmp_path / "run").anomalies()
    assert (alert.metric, alert.value, alert.reason) == ("output.inf", 24, "0 NaN, 24 Inf")
    (line,) = [r.getMessage() for r in caplog.records if "incident" in r.getMessage()]
    assert "output.inf = 24" in line and "0 NaN, 24 Inf" in line


# -- the vectorized scan against the per-series rules -----------------------------------


class _PerSeries:
    """The rules one series at a time, as the detector applied them before it ran over arrays
    (the oracle: the same alerts, values, baselines and incidents)."""

    def __init__(self, config) -> None:
        self.config = config
        self.averages: dict = {}
        self.nonfinite: set = set()
        self.incident = None

    def scan(self, step, rank, series, values):
        from probe.modes.monitor.anomaly import Anomaly, Observation

        found = []
        rule = self.config.turbulence
        for s, row in zip(series, values, strict=True):
            metrics = {name: float(v) for name, v in zip(METRIC_COLUMNS, row, strict=True)}
            nonfinite = metrics["nan"] + metrics["inf"]
            if self.config.nonfinite and nonfinite > 0 and s not in self.nonfinite:
                count = "nan" if metrics["nan"] > 0 else "inf"
                reason = f"{int(metrics['nan'])} NaN, {int(metrics['inf'])} Inf"
                found.append(Anomaly(step, rank, s.name, f"{s.label}.{count}", metrics[count], 0.0,
                                     "nonfinite", s.kind, s.call, reason))
            if nonfinite > 0:
                self.nonfinite.add(s)
            else:
                self.nonfinite.discard(s)
            if rule is not None and nonfinite == 0 and s.kind in rule.kinds:
                for metric in rule.metrics:
                    value = abs(metrics[metric])
                    if not np.isfinite(value):
                        continue
                    average = self.averages.setdefault((s, metric), {"ema": 0.0, "seen": 0, "outliers": []})
                    if average["seen"] >= rule.warmup and average["ema"] > 0:
                        factor = 1 + rule.threshold
                        if value > average["ema"] * factor or value < average["ema"] / factor:
                            outliers = average["outliers"]
                            outliers.append(value)
                            baseline = average["ema"]
                            if len(outliers) >= rule.warmup:
                                average["ema"] = sum(outliers) / len(outliers)
                                average["outliers"] = []
                            if len(outliers) == 1:
                                found.append(Anomaly(step, rank, s.name, f"{s.label}.{metric}", value,
                                                     baseline, "turbulence", s.kind, s.call))
                            continue
                    average["outliers"] = []
                    average["ema"] = (value if average["seen"] == 0
                                      else rule.decay * average["ema"] + (1 - rule.decay) * value)
                    average["seen"] += 1
            for user_rule in self.config.anomaly_rules:
                verdict = user_rule(Observation(step, rank, s, metrics))
                if verdict:
                    found.append(Anomaly(step, rank, s.name, f"{s.label}.norm", metrics["norm"], None,
                                         f"rule:{user_rule.__name__}", s.kind, s.call,
                                         verdict if isinstance(verdict, str) else ""))
        if found and self.incident is None:
            self.incident = step
        for a in found:
            a.incident = self.incident
        if not (found or self.nonfinite or any(a["outliers"] for a in self.averages.values())):
            self.incident = None
        return found


def _big_norm(observation):
    return "norm over 30" if observation.metrics["norm"] > 30 else None


@pytest.mark.parametrize("options", [
    {},
    {"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {
        "warmup": 0, "threshold": 0.3, "metrics": ["norm", "max", "min", "zeros"]}}]}},
    {"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"warmup": 1, "decay": 0.5,
                                                                     "kinds": ["activation", "exp_avg"]}}]},
     "anomaly_rules": [_big_norm]},
    {"alert": {"rules": [{"rule_name": "AnomalyNan"}]}},
])
def test_the_vectorized_scan_gives_the_per_series_alerts(options):
    config = Monitor(targets=["x"], **options)
    rng = np.random.default_rng(7)
    pool = [Series(kind, f"m{i}", slot, call) for i in range(12)
            for kind, slot in (("activation", "output"), ("weight_grad", ""), ("exp_avg", ""))
            for call in (0, 1)][:60]
    fast, slow = AnomalyDetector(config), _PerSeries(config)
    total = 0
    for step in range(120):
        # Mostly the same series; some steps a changed set, or a series listed twice.
        series = pool[:48] if step % 7 else [pool[j] for j in rng.choice(len(pool), 40)]
        n = len(series)
        values = np.abs(rng.normal(1.0, 0.15, size=(n, len(METRIC_COLUMNS))))
        values[:, METRIC_COLUMNS.index("nan")] = 0
        values[:, METRIC_COLUMNS.index("inf")] = 0
        spikes = rng.random(n) < 0.04
        values[spikes] *= rng.choice([0.01, 40.0, 1e308], size=(int(spikes.sum()), 1))  # 1e308 * 40: Inf
        if step >= 60:
            with np.errstate(over="ignore"):
                values[:5] *= 8.0  # a level shift (a spike of 1e308 becomes Inf)
        for column, share in (("nan", 0.01), ("inf", 0.01)):
            hit = rng.random(n) < share
            values[hit, METRIC_COLUMNS.index(column)] = rng.integers(1, 50, size=int(hit.sum()))
        unknown = rng.random(n) < 0.01  # a row whose values are unknown (NaN counts too)
        values[unknown] = np.nan
        got = fast.scan(step, 0, series, values.copy())
        want = slow.scan(step, 0, series, values.copy())
        assert got == want, step
        total += len(got)
    assert total > 50  # the sequence exercised the rules
