"""The config of the free_benchmark mode: ``probe.mode(probe.FreeBenchmark(...), ...)``."""

from __future__ import annotations

from dataclasses import dataclass

from probe.errors import ProbeError
from probe.modes.config import ModeConfig
from probe.modes.free_benchmark.perturbations import PERTURBATIONS
from probe.vocabulary.option_fields import boolean, choice, integer, option

HANDLERS = ("check", "fix")


@dataclass(frozen=True, kw_only=True, eq=False)
class FreeBenchmark(ModeConfig):
    """Each op re-run perturbed: fragile ops found without a reference run."""

    mode = "free_benchmark"

    perturb: str = option("improve_precision", check=choice(*PERTURBATIONS),
                          doc="how each op is re-run (a higher precision, the CPU, or its inputs perturbed)")
    handler: str = option("check", check=choice(*HANDLERS),
                          doc="compare and record, or replace the op's output by the reference's")
    preheat: bool = option(False, check=boolean(),
                           doc="with `handler='check'`: measure calls for `preheat_steps` steps, then "
                               "bound each op at least at twice what it showed")
    preheat_steps: int = option(15, check=integer(1), doc="steps the preheat learns over")
    max_sample: int = option(20, check=integer(1), doc="preheat: calls measured per op")
    max_checks_per_op: int | None = option(
        None, check=integer(1, none=True),
        doc="check at most this many calls of each op per step (`None`: all)")

    def validate(self) -> None:
        if self.handler == "fix" and self.perturb not in ("improve_precision", "to_cpu"):
            raise ProbeError(f"option 'handler': 'fix' needs perturb 'improve_precision' or 'to_cpu', "
                             f"not {self.perturb!r}")
        if self.handler == "fix" and self.preheat:
            raise ProbeError("option 'preheat' works with handler 'check' only")
