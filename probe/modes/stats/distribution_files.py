"""The stats mode's distribution files of a step (``distribution=``, ``histogram=``): the shares and
the histogram the statistics engine counted (:mod:`probe.modes.statistics.distribution`), written
beside ``stats.npy`` and attached back to the op records by its rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from probe.modes.statistics.distribution import (
    PendingDistribution,
    check_arrays,
    read_histograms,
    read_shares,
)
from probe.modes.stats.file_names import DISTRIBUTION_FILE, HISTOGRAM_FILE
from probe.modes.stats.records import row_tensors
from probe.rundir.untrusted_reads import read_npy, reading


def write_files(writer: Any, pending: PendingDistribution, rows: int) -> dict[str, Any]:
    """Write ``distribution.npy`` (and ``histogram.npy``) beside ``rows`` statistics rows (writer
    thread); the manifest summary's entry."""
    shares, histogram = pending.to_host(rows)
    writer.write_array(DISTRIBUTION_FILE, shares)
    if histogram is not None:
        writer.write_array(HISTOGRAM_FILE, histogram)
    return {"distribution": True, "histogram": histogram is not None}


def attach_files(directory: Any, index: np.ndarray, records: dict[int, Any], rows: int,
                 run: Any = None) -> None:
    """Give the tensors of ``records`` their ``distribution`` and ``histogram`` from a step's files,
    where they exist (steps written without ``distribution=``/``histogram=``, and runs of format
    version 1, have none: the records keep None). ``index`` rows: (op, io, position, stats row).
    ``run``: the run directory, which the files must lie in."""
    shares_path = directory / DISTRIBUTION_FILE
    if not shares_path.exists():
        return
    histogram_path = directory / HISTOGRAM_FILE
    shares = read_npy(shares_path, run=run)
    histogram = read_npy(histogram_path, run=run) if histogram_path.exists() else None
    with reading(shares_path):
        check_arrays(shares, histogram, rows)
    histograms = read_histograms(histogram) if histogram is not None else {}
    decoded: dict[int, dict[str, float | None]] = {}
    for row, tensor in row_tensors(index, records):
        if row not in decoded:
            decoded[row] = read_shares(shares[row])
        if all(v is None for v in decoded[row].values()):
            continue  # not measured (an empty tensor): None, never zeros
        tensor.distribution = decoded[row]
        tensor.histogram = histograms.get(row)
