"""What analysis reads of the records a mode's reader returns. The records are the modes' own
(``probe.modes.free_benchmark.records.CheckRecord``, ``probe.modes.monitor.records.MonitorRecord``
and ``AnomalyRecord``); analysis may not import a mode, so it names the fields it reads here and
gets the records through the run (``run.mode(name)``, ``run.checks()``, ``run.anomalies()``)."""

from __future__ import annotations

from typing import Any, Protocol


class Check(Protocol):
    """One free-benchmark check of one op output."""

    step: int
    rank: int
    op_id: str
    perturb: str
    verdict: str
    dtype: str | None
    ratio: float | None
    threshold: float | None
    nonfinite_mismatch: int
    sign_flips: int


class Alert(Protocol):
    """One monitor alert."""

    step: int
    rank: int
    module: str
    metric: str
    value: float
    baseline: float | None
    rule: str
    kind: str
    call: int
    reason: str
    incident: int | None

    def describe(self) -> str: ...


class AlertReader(Protocol):
    """The part of the monitor's run reader (``run.mode("monitor")``) analysis calls."""

    def alert(self, row: dict[str, Any]) -> Alert: ...
