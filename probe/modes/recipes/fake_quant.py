"""Mode "fake_quant": the matmuls a plan quantizes are computed from quantized-dequantized
operands (an active mode: it changes training), so that ``probe.compare`` of a high-precision run
and this one tells whether the plan holds.

Each chosen matmul first runs as it is (dtype, shape, strides and autograd semantics stay the
original op's), then again from its operands quantized and dequantized under the recipe (back in
their own dtype); that result is copied into the original output. Forward and backward matmuls
are separate ops with their own ids: a plan keeps or quantizes each. A plan that quantizes
nothing leaves training bit-identical.
"""

from __future__ import annotations

import torch

from probe.modes.base import Mode
from probe.modes.recipes.formats import Recipe
from probe.modes.recipes.operands import MATMUL_OPERANDS, matmul_operands
from probe.modes.recipes.options import FakeQuant
from probe.modes.recipes.plan_file import Plan
from probe.modes.recipes.quantize import AmaxHistory, fake_quantize
from probe.modes.registry import register_mode
from probe.tracer.op_call import OpCall
from probe.vocabulary.op_tensors import results_of


@register_mode
class FakeQuantMode(Mode):
    """Quantize-dequantize the operands of the matmuls a plan quantizes."""

    name = "fake_quant"
    config_class = FakeQuant

    def __init__(self, config: FakeQuant) -> None:
        super().__init__(config)
        plan = config.plan if isinstance(config.plan, Plan) else None  # None: "all" (the config checked it)
        recipe = config.recipe if config.recipe is not None else plan.recipe if plan is not None else None
        assert recipe is not None  # FakeQuant.validate: "all" comes with a recipe
        self.recipe: Recipe = recipe
        self._quantize: frozenset[str] | None = None if plan is None else frozenset(plan.quantize)
        self._history = AmaxHistory()

    def after(self, call: OpCall) -> None:
        short = call.info.short
        if short not in MATMUL_OPERANDS or (self._quantize is not None and call.op_id not in self._quantize):
            return
        outputs = call.output_tensors or ()
        if not outputs:
            return
        replaced: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for position, t, layout in matmul_operands(short, call.args):
                view = layout.to_reduction_last(t)
                amax = (self._history.amax((call.op_id, position), view, self.recipe.history)
                        if self.recipe.scaling == "delayed" else None)
                replaced[position] = layout.back(fake_quantize(view, self.recipe, amax))
            if not replaced:
                return
            args = [replaced.get(i, a) for i, a in enumerate(call.args)]
            kwargs = call.kwargs or {}
            results = results_of(call.info, args, kwargs, call.func(*args, **kwargs))
            for original, exact in zip(outputs, results, strict=False):
                if (isinstance(exact, torch.Tensor) and exact.shape == original.shape
                        and original.is_floating_point()):
                    original.copy_(exact)
