"""The monitor's files of one step, read back: ``monitor.csv``, ``anomalies.jsonl`` and the series'
distributions (the reader half of the mode; ``mode.py`` is the writer)."""

from __future__ import annotations

import csv

import probe.modes.monitor.distribution as monitor_distribution
from probe.modes.monitor.anomaly import (
    Anomaly,
    read_anomalies,
)
from probe.modes.statistics.columns import MONITOR_COLUMNS, canonical
from probe.rundir import layout
from probe.rundir.confined_files import open_in_run
from probe.rundir.mode_files import ModeFiles
from probe.rundir.records import MonitorRecord
from probe.rundir.untrusted_reads import reading


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


class MonitorFiles(ModeFiles):
    """``monitor.csv`` and ``anomalies.jsonl`` of one step (written by :class:`MonitorStep`), read back."""

    def series(self) -> list[MonitorRecord]:
        """The step's series in collection order (metrics in fp64)."""
        path = self.where.directory / layout.MONITOR_FILE
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

    def anomalies(self) -> list[Anomaly]:
        """The step's alerts in detection order."""
        return read_anomalies(self.where.directory / layout.ANOMALIES_FILE, self.where.run)
