"""The toy mode's plug-in: an op observer that counts, and the step result that writes the count."""

from __future__ import annotations

from collections import Counter
from typing import Any

from probe.modes.base import Mode
from probe.modes.registry import register_mode
from probe.rundir.writer import StepWriter
from probe.tracer.op_call import OpCall
from toy_mode.config import Toy
from toy_mode.files import TOY_FILE, ToyFiles


class ToyStep:
    """One step's counts, written on the writer thread."""

    def __init__(self, by_phase: dict[str, int]) -> None:
        self.by_phase = by_phase

    def write(self, writer: StepWriter) -> dict[str, Any]:
        writer.write_json(TOY_FILE, {"by_phase": self.by_phase})
        return {"ops": sum(self.by_phase.values())}


@register_mode
class ToyMode(Mode):
    """Counts the ops of each phase (the config's ``phases``: all, or the forward's alone)."""

    name = "toy"
    config_class = Toy
    files = ToyFiles

    def __init__(self, config: Toy) -> None:
        super().__init__(config)
        self._counts: Counter[str] = Counter()

    def after(self, call: OpCall) -> None:
        if self.config.phases == "all" or call.phase == self.config.phases:
            self._counts[call.phase] += 1

    def end_step(self, step: int) -> ToyStep:
        counted, self._counts = dict(self._counts), Counter()
        return ToyStep(counted)
