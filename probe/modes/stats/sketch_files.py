"""The stats mode's sketch file of a step (``sketch=True``): the random-sign projections the
statistics engine took (:mod:`probe.modes.statistics.sketch`), written beside ``stats.npy`` and
attached back to the op records by their rows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from probe.modes.statistics.sketch import SKETCHES, PendingSketches
from probe.modes.stats.file_names import SKETCH_FILE
from probe.modes.stats.records import row_tensors
from probe.rundir.untrusted_reads import read_npy, reading


def write_file(writer: Any, pending: PendingSketches, rows: int) -> dict[str, Any]:
    """Write ``sketch.npy`` beside ``rows`` statistics rows (writer thread); the manifest
    summary's entry."""
    writer.write_array(SKETCH_FILE, pending.to_host(rows))
    return {"sketch": True}


def attach_file(directory: Any, index: np.ndarray, records: dict[int, Any], rows: int,
                run: Any = None) -> None:
    """Give the tensors of ``records`` their ``sketch`` from a step's file, where it exists
    (steps written without ``sketch=True`` have none: the records keep None). ``index`` rows:
    (op, io, position, stats row). ``run``: the run directory, which the file must lie in."""
    path = directory / SKETCH_FILE
    if not path.exists():
        return
    table = read_npy(path, run=run)
    with reading(path):
        if table.ndim != 2 or table.shape != (rows, SKETCHES) or table.dtype.kind != "f":
            raise ValueError(f"the sketches are an array of shape {table.shape} and dtype {table.dtype}, "
                             f"expected ({rows}, {SKETCHES}) floats")
    decoded: dict[int, tuple[float, ...] | None] = {}
    for row, tensor in row_tensors(index, records):
        if row not in decoded:
            values = tuple(table[row].tolist())
            decoded[row] = None if any(math.isnan(v) for v in values) else values
        tensor.sketch = decoded[row]
