"""A step the monitor collected, resolved (reduced over ranks if asked, moved to the host, scanned
for anomalies) once and then written: ``monitor.csv``, ``anomalies.jsonl``, the tensors around
an anomaly, and the live sinks' scalars (:class:`WriteSide`, what persists from step to step)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

import probe.modes.monitor.distribution as monitor_distribution
from probe.modes.monitor.anomaly import Anomaly, AnomalyDetector, Series, anomaly_json, incidents
from probe.modes.monitor.file_names import ANOMALIES_FILE, ANOMALY_TENSORS_FILE, MONITOR_FILE
from probe.modes.monitor.reduction import Reduction
from probe.modes.monitor.series import COUNT_COLUMNS, SeriesRows, add_update_ratios, overflow_handled
from probe.modes.sinks import SeriesSink
from probe.modes.statistics.capture import PendingRows
from probe.modes.statistics.columns import MONITOR_COLUMNS
from probe.modes.statistics.finalize import finalize, whole
from probe.rundir.writer import StepWriter

log = logging.getLogger("probe.monitor")


class WriteSide:
    """What the monitor keeps across written steps: the anomaly detector's history and the open
    live-output sinks (``probe.modes.sinks``). Only the steps' writes touch it, one step at a
    time, in order."""

    def __init__(self, detector: AnomalyDetector, metrics: tuple[str, ...] | list[str]) -> None:
        self.detector, self.metrics = detector, metrics
        self.rank = 0
        self.sinks: list[SeriesSink] = []
        self._tag_cache: tuple[tuple[Series, ...], tuple[str, ...]] | None = None

    def write_scalars(self, step: int, series: list[Series], values: np.ndarray) -> None:
        """The step's scalars to each sink (``<kind>/<name>[/<slot>][#call]/<metric>``)."""
        if not self.sinks:
            return
        tags, columns = self._tags(series)
        grid = values[:, columns]
        if "id" in self.metrics:  # msprobe's identity metric: the value of a one-element tensor
            keep = np.ones(grid.shape, dtype=bool)
            keep[:, self.metrics.index("id")] = values[:, MONITOR_COLUMNS.index("numel")] == 1
            picked = np.flatnonzero(keep.ravel())
            tags, flat = [tags[i] for i in picked], grid.ravel()[picked]
        else:
            flat = grid.ravel()
        for sink in self.sinks:
            sink.add_scalars(step, tags, flat)
            sink.flush()

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def _tags(self, series: list[Series]) -> tuple[tuple[str, ...], list[int]]:
        """Every series' tags, metric after metric, and the value columns they take (cached: the
        same series come step after step, and the same tag objects let the writer reuse its bytes)."""
        key = tuple(series)
        if self._tag_cache is None or self._tag_cache[0] != key:
            tags = []
            for s in series:
                tags.extend(f"{s.tag}/{metric}" for metric in self.metrics)
            self._tag_cache = (key, tuple(tags))
        columns = [MONITOR_COLUMNS.index("mean" if m == "id" else m) for m in self.metrics]
        return self._tag_cache[1], columns


def csv_line(series: Series, values: list[float]) -> str:
    """A series' row of ``monitor.csv``."""
    return f"{series.kind},{series.name},{series.slot},{series.call}," + ",".join(map(repr, values))


class MonitorStep:
    """A collected step: resolved (moved to the host, scanned) once, then written.

    Holds plain data: the rows (on their device), the cross-rank reduction in flight if
    any, and the monitor's write side; nothing of the mode's per-step state."""

    distribution: monitor_distribution.PendingDistribution | None = None
    """With ``distribution=``/``histogram=``: the step's distribution rows (not reduced over ranks)."""

    def __init__(self, step: int, rows: SeriesRows, pending: PendingRows, reduction: Reduction | None,
                 sink: WriteSide) -> None:
        self.step, self._rows, self._pending = step, rows, pending
        self._reduction, self._sink = reduction, sink
        self.values: np.ndarray | None = None
        self.anomalies: list[Anomaly] = []
        self.dumped: dict[str, torch.Tensor] = {}

    def resolve(self) -> None:
        if self.values is not None:
            return
        rows = self._rows
        if self._reduction is not None:
            host = self._reduction.result().cpu().numpy()
            raw, numel = host[:, :-1], host[:, -1]
        else:
            raw, numel = whole(*self._pending.to_host())  # the step's one transfer
        self.values = finalize(raw, numel, MONITOR_COLUMNS)
        lost = self._pending.lost()
        if lost:  # changed in place before it was reduced: unknown, no NaN or Inf counted (no alert)
            self.values[np.ix_(lost, COUNT_COLUMNS)] = 0
        self.values = add_update_ratios(rows.series, self.values)
        self.anomalies = self._sink.detector.scan(self.step, self._sink.rank, rows.series, self.values,
                                                  handled=overflow_handled(rows.series, self.values))
        if rows.held is not None and self.anomalies:
            flagged = {(a.kind, a.module, a.call) for a in self.anomalies}
            for index, tensor in rows.held.items():
                s = rows.series[index]
                if (s.kind, s.name, s.call) in flagged:
                    self.dumped[f"{s.name}[{s.call}].{s.slot or s.kind}"] = tensor.detach().cpu().contiguous()
        rows.held = None  # the tensors go now, not with the step's files

    def write(self, writer: StepWriter) -> dict[str, Any]:
        self.resolve()
        assert self.values is not None
        series, values = self._rows.series, self.values
        lines = ["kind,name,slot,call," + ",".join(MONITOR_COLUMNS)]
        for s, row in zip(series, values.tolist(), strict=True):
            lines.append(csv_line(s, row))
        writer.write_text(MONITOR_FILE, "\n".join(lines) + "\n")
        writer.write_jsonl(ANOMALIES_FILE, (anomaly_json(a) for a in self.anomalies))
        if self.dumped:
            from safetensors.torch import save

            writer.write_bytes(ANOMALY_TENSORS_FILE, save(self.dumped))
        # One line per incident (a gradient explosion is dozens of alerts); the rest at INFO.
        for incident in incidents(self.anomalies):
            if incident.first_step == self.step:
                log.warning("probe monitor: %s", incident.describe())
            else:
                log.info("probe monitor: %d more alert(s) at step %d in the incident of step %d",
                         incident.alerts, self.step, incident.first_step)
        self._sink.write_scalars(self.step, series, values)
        summary = {"series": len(series), "anomalies": len(self.anomalies), "dumped": len(self.dumped),
                   "reduced": self._reduction is not None}
        if self.distribution is not None:
            summary.update(monitor_distribution.write_step(writer, self.distribution, series,
                                                           self._sink.sinks, self.step))
        return summary
