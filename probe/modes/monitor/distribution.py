"""The monitor's ``distribution=`` and ``histogram=`` options: per series, where its values sit in
its dtype's range (``probe.modes.statistics.distribution``), as files, scalars and TensorBoard histograms.

Counted when a series is captured (its value then), on its device without a host sync; the
step's rows move to the host on the writer thread with the monitor's own rows. Files beside
``monitor.csv``, rows in its order: ``monitor_distribution.npy`` (shares, NaN where unknown:
series with no tensor, such as ``update``/``update_ratio``) and ``monitor_histogram.npy``
((row, exponent, count) entries). TensorBoard: the scalars ``<series>/zeros_share``,
``<series>/underflow``, ``<series>/near_overflow`` and the histogram ``<series>/log2_magnitude``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.modes.monitor.file_names import MONITOR_DISTRIBUTION_FILE, MONITOR_HISTOGRAM_FILE
from probe.modes.sinks import Histogram, SeriesSink
from probe.modes.statistics.distribution import (
    HIST_NONFINITE,
    HIST_ZERO,
    SHARE_NAMES,
    DistributionRows,
    PendingDistribution,
    check_arrays,
    read_histograms,
    read_shares,
)
from probe.rundir.untrusted_reads import read_npy, reading

TENSORBOARD_SHARES = ("zeros_share", "underflow", "near_overflow")
"""The TensorBoard scalar names of :data:`SHARE_NAMES` (``zeros`` is the monitor's ``|x| < eps`` metric)."""



class SeriesDistribution:
    """The distribution rows of one step's series, by series index."""

    def __init__(self, histogram: bool) -> None:
        self.rows = DistributionRows(histogram)

    def capture(self, index: int, tensor: torch.Tensor) -> None:
        """Count ``tensor`` (series ``index``) now; the monitor's hooks run outside any dispatch mode."""
        self.rows.add(tensor, index)

    def end_step(self) -> PendingDistribution:
        return self.rows.end_step()


def write_step(writer: Any, pending: PendingDistribution, series: list[Any], sinks: Sequence[SeriesSink],
               step: int) -> dict[str, Any]:
    """Write a step's distribution files and its values to the live-output ``sinks`` (TensorBoard;
    on the writer thread); the manifest entry."""
    shares, histogram = pending.to_host(len(series))
    writer.write_array(MONITOR_DISTRIBUTION_FILE, shares)
    if histogram is not None:
        writer.write_array(MONITOR_HISTOGRAM_FILE, histogram)
    if sinks:
        prefixes = [s.tag for s in series]
        known = ~np.isnan(shares)
        rows, columns = np.nonzero(known)
        tags = [f"{prefixes[r]}/{TENSORBOARD_SHARES[c]}" for r, c in zip(rows, columns, strict=True)]
        values = shares[rows, columns]
        items: list[Histogram] = []
        if histogram is not None and len(histogram):
            finite = (histogram[:, 1] != HIST_ZERO) & (histogram[:, 1] != HIST_NONFINITE)
            groups: dict[int, tuple[list[int], list[int]]] = {}
            for row, exponent, count in histogram[finite].tolist():
                exponents, counts = groups.setdefault(row, ([], []))
                exponents.append(exponent)
                counts.append(count)
            items = [(f"{prefixes[row]}/log2_magnitude", np.array(e), np.array(c))
                     for row, (e, c) in groups.items()]
        for sink in sinks:
            sink.add_scalars(step, tags, values)
            if items:
                sink.add_histograms(step, items)
            sink.flush()
    return {"distribution": True, "histogram": histogram is not None}


def attach_series(directory: Path, records: list[Any], run: Path | None = None) -> None:
    """Give a step's monitor records (``monitor.csv`` order) their ``distribution``/``histogram``
    where the step has the files (None otherwise: not recorded); ``run``: the run directory,
    which the files must lie in."""
    path = directory / MONITOR_DISTRIBUTION_FILE
    if not records or not path.exists():
        return
    histogram_path = directory / MONITOR_HISTOGRAM_FILE
    shares = read_npy(path, run=run)
    histogram = read_npy(histogram_path, run=run) if histogram_path.exists() else None
    with reading(path):
        check_arrays(shares, histogram, len(records))
    histograms = read_histograms(histogram) if histogram is not None else {}
    for row, record in enumerate(records):
        decoded = read_shares(shares[row])
        if any(v is not None for v in decoded.values()):
            record.distribution = decoded
            record.histogram = histograms.get(row)


__all__ = ["SHARE_NAMES", "PendingDistribution", "SeriesDistribution", "attach_series",
           "write_step"]
