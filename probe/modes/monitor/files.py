"""The monitor's files of one step, read back: ``monitor.csv``, ``anomalies.jsonl`` and the series'
distributions (the reader half of the mode; ``mode.py`` is the writer), and over a whole run
(``run.mode("monitor")``)."""

from __future__ import annotations

import csv
import math
from typing import Any, cast

import probe.modes.monitor.distribution as monitor_distribution
from probe.modes.monitor.anomaly import (
    incidents,
    read_anomalies,
)
from probe.modes.monitor.file_names import ANOMALIES_FILE, FILE_NAMES, MONITOR_FILE
from probe.modes.monitor.records import (
    LOSS_SCALE,
    LOSS_SCALE_SKIPPED,
    SCALER_SERIES,
    AnomalyRecord,
    MonitorRecord,
)
from probe.modes.statistics.columns import MONITOR_COLUMNS, canonical
from probe.rundir.confined_files import open_in_run
from probe.rundir.loss_scaler import ScalerStep
from probe.rundir.mode_files import ModeFiles, ModeReader
from probe.rundir.step_section import FollowedSeries, SectionLine, StepSection
from probe.rundir.untrusted_reads import reading, record_from_row


def _metrics_read(row: dict[str, str]) -> dict[str, float | None]:
    """A ``monitor.csv`` row's metrics by today's names. Runs before format 4 wrote ``nans`` and
    ``infs`` and no ``posinf``/``neginf``: both 0 where the row holds no Inf, else None (unknown)."""
    metrics: dict[str, float | None] = {}
    for column, value in row.items():
        name = canonical(column) if column is not None else None
        if name in MONITOR_COLUMNS:
            metrics[name] = float(value)
    for signed in ("posinf", "neginf"):
        if signed not in metrics:
            metrics[signed] = 0.0 if metrics.get("inf") == 0 else None
    missing = [c for c in MONITOR_COLUMNS if c not in metrics]
    if missing:
        raise ValueError(f"monitor.csv has no column {missing[0]!r}")
    return metrics


class MonitorReader(ModeReader):
    """The monitor's series and alerts over a run: ``run.mode("monitor")``."""

    def series(self, step: int | None = None, rank: int | None = None) -> list[MonitorRecord]:
        """The series of one step in collection order (default: the first step of ``rank``, or of
        rank 0); of every step and rank, rank then step, when neither is given."""
        return self.gather(lambda files: cast(MonitorFiles, files).series(), step, rank)

    def anomalies(self, step: int | None = None, rank: int | None = None) -> list[AnomalyRecord]:
        """The alerts of one step in detection order; of every step and rank, in step order, then
        rank, then detection order, when neither is given."""
        return self.gather(lambda files: cast(MonitorFiles, files).anomalies(), step, rank, by_step=True)

    @staticmethod
    def alert(row: dict[str, Any]) -> AnomalyRecord:
        """An alert from its JSON object (a line of ``anomalies.jsonl``, an incident an escalation
        marker names); keys a reader does not know are ignored."""
        return record_from_row(AnomalyRecord, row)


class MonitorFiles(ModeFiles):
    """``monitor.csv`` and ``anomalies.jsonl`` of one step (written by :class:`MonitorStep`), read back."""

    file_names = FILE_NAMES
    run_reader = MonitorReader

    def series(self) -> list[MonitorRecord]:
        """The step's series in collection order (metrics in fp64)."""
        path = self.where.directory / MONITOR_FILE
        if not path.exists():
            return []
        step, rank = self.where.step, self.where.rank
        # Streamed row by row (a field is at most csv's field_size_limit): a hostile file costs
        # the memory of its records, never a copy of its text.
        with open_in_run(path, self.where.run) as f, reading(path):
            rows = csv.DictReader(f.text())
            records = [MonitorRecord(step, rank, row["kind"], row["name"], row["slot"], int(row["call"]),
                                     **_metrics_read(row))
                       for row in rows]
        monitor_distribution.attach_series(self.where.directory, records, self.where.run)
        return records

    def anomalies(self) -> list[AnomalyRecord]:
        """The step's alerts in detection order."""
        return read_anomalies(self.where.directory / ANOMALIES_FILE, self.where.run)

    def read_whole(self) -> None:
        self.series()
        self.anomalies()

    def loss_scaler(self) -> ScalerStep | None:
        """What the loss scaler did in the step, from the ``loss_scale`` and ``loss_scale_skipped``
        series the monitor records with ``scaler=`` (the scale in force; 1 in a step it skipped);
        None without them. Whether the step overflowed is the skip; the next scale is not known."""
        scale = skipped = None
        for record in self.series():
            if record.name != SCALER_SERIES or not math.isfinite(record.mean):
                continue
            if record.kind == LOSS_SCALE:
                scale = record.mean
            elif record.kind == LOSS_SCALE_SKIPPED:
                skipped = record.mean > 0
        if scale is None and skipped is None:
            return None
        return ScalerStep(self.where.step, self.where.rank, skipped, scale, None, frozenset())

    def section(self) -> StepSection | None:
        """The step in ``probe summary``: its series and alerts, one line per incident that began
        in it (a gradient explosion is dozens of alerts, all in ``run.anomalies()``; those of an
        incident going on are counted in the header), and each series' norm to follow over the
        run. None for a step the monitor did not collect."""
        records = self.series()
        if not records:
            return None
        alerts = self.anomalies()
        grouped = incidents(alerts)
        step = self.where.step
        header = f"monitor: {len(records)} series, anomalies: {len(alerts) if alerts else 'none'}"
        going_on = [i.first_step for i in grouped if i.first_step != step]
        if going_on:
            header += f" (the incident of step {going_on[0]} goes on)"
        lines = [SectionLine(header, "red" if alerts else None)]
        lines += [SectionLine(f"  {i.describe()}", "red") for i in grouped if i.first_step == step]
        return StepSection(tuple(lines), brief=f"{len(records)} series, {len(alerts)} anomalies",
                           followed=FollowedSeries("monitored series (norm per step)", series_norms(records),
                                                   read_all="run.monitor()"))


def series_label(record: MonitorRecord) -> str:
    """A monitored series' name: kind, module or parameter, and the activation's slot."""
    return " ".join(part for part in (record.kind, record.name, record.slot) if part)


def series_norms(records: list[MonitorRecord]) -> dict[str, float]:
    """Each series of one step -> its norm at its last call in the step."""
    return {series_label(r): r.norm for r in sorted(records, key=lambda r: r.call)}
