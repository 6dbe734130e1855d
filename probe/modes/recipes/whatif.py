"""Mode "whatif": for every matmul operand the step reads (forward and backward), the statistics
of quantizing it under each chosen recipe (:data:`~probe.modes.recipes.quantize.STAT_COLUMNS`).

Passive: the operands are read, never changed. Each operand's statistics are one small float64
tensor on its device, computed when the op is about to run; the step's are stacked and moved to
the host on the writer thread (no host sync in the step), written as ``whatif.npy``
(operands x recipes x columns) beside ``whatif_index.npy`` (op index, argument position, role).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.modes.base import Mode
from probe.modes.recipes.files import INDEX_FILE, STATS_FILE, WhatIfFiles
from probe.modes.recipes.formats import Recipe
from probe.modes.recipes.operands import Roles, matmul_operands
from probe.modes.recipes.options import WhatIf
from probe.modes.recipes.quantize import AmaxHistory, what_if
from probe.modes.registry import register_mode
from probe.rundir.writer import StepWriter
from probe.tracer.op_call import OpCall


def input_position(call: OpCall, t: torch.Tensor) -> int | None:
    """The position of argument ``t`` among the op's tensor inputs (``call.inputs``)."""
    for position, candidate in enumerate(call.input_tensors or ()):
        if candidate is t:
            return position
    return None


@register_mode
class WhatIfMode(Mode):
    """What-if statistics of each matmul operand under low-precision recipes."""

    name = "whatif"
    config_class = WhatIf
    files = WhatIfFiles

    def __init__(self, config: WhatIf) -> None:
        super().__init__(config)
        self.recipes: tuple[Recipe, ...] = config.recipes
        self._roles = Roles()
        self._history = AmaxHistory()
        self._reset()

    def _reset(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._index: list[tuple[int, int, int]] = []

    def attach(self, model: Any, out: Path, rank: int) -> None:
        self._roles.attach(model)

    def begin_step(self, step: int) -> None:
        self._roles.begin_step()

    def before(self, call: OpCall) -> None:
        for position, t, layout in matmul_operands(call.info.short, call.args):
            found = input_position(call, t)
            source = call.inputs[found][2] if found is not None else None
            role = self._roles.role(call.phase, call.index, t, source)
            with torch.no_grad():
                view = layout.to_reduction_last(t)
                stats = []
                for recipe in self.recipes:
                    amax = (self._history.amax((call.op_id, position), view, recipe.history)
                            if recipe.scaling == "delayed" else None)
                    stats.append(what_if(view, recipe, amax))
                self._rows.append(torch.stack(stats))
            self._index.append((call.index, position, role))

    def end_step(self, step: int) -> WhatIfStep:
        result = WhatIfStep(self.recipes, self._rows, self._index)
        self._reset()
        return result


class WhatIfStep:
    """One step's what-if statistics, still on their devices."""

    def __init__(self, recipes: tuple[Recipe, ...], rows: list[torch.Tensor],
                 index: list[tuple[int, int, int]]) -> None:
        self.recipes, self.rows, self.index = recipes, rows, index

    def write(self, writer: StepWriter) -> dict[str, Any]:
        stats = (torch.stack([row.cpu() for row in self.rows]).numpy() if self.rows
                 else np.zeros((0, len(self.recipes), 6)))
        writer.write_array(STATS_FILE, stats)
        writer.write_array(INDEX_FILE, np.array(self.index, dtype=np.int64).reshape(-1, 3))
        return {"recipes": [r.to_json() for r in self.recipes], "operands": len(self.index)}
