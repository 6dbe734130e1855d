"""The stats mode's records beyond the statistics it attaches to every op record
(``TensorRecord.stats``, ``distribution``, ``histogram``)."""

from __future__ import annotations

from dataclasses import dataclass


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
