"""Mode "whatif": for every matmul operand the step reads (forward and backward), the statistics
of quantizing it under each chosen recipe (:data:`~probe.modes.recipes.quantize.STAT_COLUMNS`).

Passive: the operands are read, never changed. Each operand's statistics are one small float64
tensor on its device: its own losses, computed when the op is about to run, with the error its
rounding alone puts into the product (paired with the other operand's values), and the output's
sum of squares once the op ran. The step's are stacked and moved to the host on the writer thread
(no host sync in the step), written as ``whatif.npy`` (operands x recipes x columns) beside
``whatif_index.npy`` (op index, argument position, role).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.modes.base import Mode
from probe.modes.recipes.files import INDEX_FILE, STATS_FILE, WhatIfFiles
from probe.modes.recipes.formats import Recipe
from probe.modes.recipes.operands import Roles, matmul_operands, paired_views, positions
from probe.modes.recipes.options import WhatIf
from probe.modes.recipes.quantize import (
    STAT_COLUMNS,
    AmaxHistory,
    product_error_energy,
    what_if,
    what_if_energies,
)
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
        self._pending: _PendingProduct | None = None

    def attach(self, model: Any, out: Path, rank: int) -> None:
        self._roles.attach(model)

    def begin_step(self, step: int) -> None:
        self._roles.begin_step()

    def before(self, call: OpCall) -> None:
        self._settle(None)  # an op that raised: its product's output was never seen
        operands = list(matmul_operands(call.info.short, call.args))
        if not operands:
            return
        views = [layout.to_reduction_last(t) for _, t, layout in operands]
        paired = paired_views(call.info.short, call.args, views)
        per_operand: list[list[torch.Tensor]] = [[] for _ in operands]
        energies: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in operands]
        with torch.no_grad():
            for recipe in self.recipes:
                for i, (position, _, _) in enumerate(operands):
                    view, batch_dims = paired[i] if paired is not None else (views[i], 0)
                    amax = (self._history.amax((call.op_id, position), view, recipe.history)
                            if recipe.scaling == "delayed" else None)
                    if paired is None:
                        per_operand[i].append(what_if(view, recipe, amax))
                        continue
                    stats, error, signal = what_if_energies(view, recipe, amax, batch_dims)
                    per_operand[i].append(stats)
                    energies[i].append((error.reshape(-1), signal.reshape(-1)))
        products = None
        if paired is not None and energies[0][0][0].numel() == energies[1][0][0].numel():
            products = [torch.stack([product_error_energy(mine[0], theirs[1])
                                     for mine, theirs in zip(energies[i], energies[1 - i], strict=True)])
                        for i in range(2)]
        for position, t, _ in operands:
            found = input_position(call, t)
            source = call.inputs[found][2] if found is not None else None
            self._index.append((call.index, position, self._roles.role(call.phase, call.index, t, source)))
        # A convolution reads each input value once per weight tap and output position over it.
        inputs = positions(operands[0][1].shape) if call.info.short == "convolution" else 0
        self._pending = _PendingProduct(call.index, [torch.stack(rows) for rows in per_operand], products,
                                        inputs)

    def after(self, call: OpCall) -> None:
        self._settle(call)

    def _settle(self, call: OpCall | None) -> None:
        """Finish the pending product's rows with its output (``call``'s), or with NaN where the
        op ended without one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        output = None
        if call is not None and call.index == pending.index:
            output = next((t for t in call.output_tensors or () if isinstance(t, torch.Tensor)
                           and t.is_floating_point() and t.layout == torch.strided), None)
        with torch.no_grad():
            for i, stats in enumerate(pending.stats):
                extra = torch.full((stats.shape[0], 2), torch.nan, dtype=torch.float64, device=stats.device)
                if output is not None:
                    extra[:, 1] = output.detach().double().square().sum()
                    if pending.products is not None:
                        ratio = positions(output.shape) / pending.inputs if pending.inputs else 1.0
                        extra[:, 0] = pending.products[i] * ratio
                self._rows.append(torch.cat([stats, extra], dim=1))

    def end_step(self, step: int) -> WhatIfStep:
        self._settle(None)
        result = WhatIfStep(self.recipes, self._rows, self._index)
        self._reset()
        return result


class _PendingProduct:
    """A matmul's operand statistics waiting for its output."""

    __slots__ = ("index", "inputs", "products", "stats")

    def __init__(self, index: int, stats: list[torch.Tensor], products: list[torch.Tensor] | None,
                 inputs: int) -> None:
        self.index, self.stats, self.products = index, stats, products
        self.inputs = inputs
        """A convolution's input positions (0 for a matmul)."""


class WhatIfStep:
    """One step's what-if statistics, still on their devices."""

    def __init__(self, recipes: tuple[Recipe, ...], rows: list[torch.Tensor],
                 index: list[tuple[int, int, int]]) -> None:
        self.recipes, self.rows, self.index = recipes, rows, index

    def write(self, writer: StepWriter) -> dict[str, Any]:
        stats = (torch.stack([row.cpu() for row in self.rows]).numpy() if self.rows
                 else np.zeros((0, len(self.recipes), len(STAT_COLUMNS))))
        writer.write_array(STATS_FILE, stats)
        writer.write_array(INDEX_FILE, np.array(self.index, dtype=np.int64).reshape(-1, 3))
        return {"recipes": [r.to_json() for r in self.recipes], "operands": len(self.index)}
