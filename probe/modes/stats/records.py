"""The stats mode's records beyond the statistics it attaches to every op record
(``TensorRecord.stats``, ``distribution``, ``histogram``, ``sketch``), and the one walk that
attaches a row's values to the tensors using it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


def row_tensors(index: np.ndarray, records: dict[int, Any]) -> Iterator[tuple[int, Any]]:
    """``(stats row, TensorRecord)`` for each row of a step's ``stats_index.npy`` (op, input 0 /
    output 1, position, row) whose op is among ``records``."""
    for op_index, io, position, row in index.tolist():
        record = records.get(op_index)
        if record is not None:
            yield row, (record.inputs if io == 0 else record.outputs)[position]


@dataclass(slots=True)
class NonfiniteParameterRecord:
    """The parameters that held NaN or Inf when a step started, and the gradients that did
    before its optimizer step, by name (``run.mode("stats").nonfinite_parameters()``, or
    ``run.nonfinite_parameters()``)."""

    step: int
    rank: int
    parameters: tuple[list[str], int] | None
    """(names, how many): names kept up to 100, the count exact; None when not checked (no
    ``model=`` given to the session)."""
    gradients: tuple[list[str], int] | None
    """(names, how many) of the gradients about to be applied; None when no optimizer stepped."""

    def describe(self, names_shown: int = 5) -> list[str]:
        """One line per non-empty finding, naming the first ``names_shown``."""
        lines = []
        for (found, what) in ((self.parameters, "parameters non-finite at the step's start"),
                              (self.gradients, "gradients non-finite before the optimizer step")):
            if found is not None and found[1]:
                count, names = found[1], found[0][:names_shown]
                more = f" ... {count - len(names)} more" if count > len(names) else ""
                lines.append(f"{what}: {count} ({', '.join(names)}{more})")
        return lines
