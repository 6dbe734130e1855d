"""The configs of the recipe lab's modes: ``probe.mode(probe.WhatIf(recipes=["mxfp8"]), ...)`` and
``probe.mode(probe.FakeQuant(plan="plan.json"), ...)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError
from probe.modes.config import ModeConfig
from probe.modes.recipes.formats import RECIPES, Recipe, parse_recipe, parse_recipes
from probe.modes.recipes.plan_file import Plan, parse_plan
from probe.vocabulary.option_fields import Check, option

_RECIPE_NAMES = ", ".join(f"`{name!r}`" for name in RECIPES)


def _recipes(option_name: str, value: Any) -> tuple[Recipe, ...]:
    return parse_recipes(value, option_name)


def _recipe(option_name: str, value: Any) -> Recipe | None:
    return None if value is None else parse_recipe(value, option_name)


def _plan(option_name: str, value: Any) -> Plan | str | None:
    if value is None:
        return None
    parsed = parse_plan(value)
    return "all" if parsed is None else parsed


@dataclass(frozen=True, kw_only=True, eq=False)
class WhatIf(ModeConfig):
    """What-if statistics of each matmul operand under low-precision recipes."""

    mode = "whatif"

    recipes: tuple[Recipe, ...] = option(
        (RECIPES["fp8-e4m3"], RECIPES["mxfp8"], RECIPES["nvfp4"]),
        check=Check(_recipes, f"recipe names ({_RECIPE_NAMES}), `probe.modes.recipes.Recipe` objects"),
        doc="the recipes each matmul operand is measured under (default: fp8-e4m3, mxfp8, nvfp4)")


@dataclass(frozen=True, kw_only=True, eq=False)
class FakeQuant(ModeConfig):
    """The matmuls a plan quantizes computed from quantized-dequantized operands."""

    mode = "fake_quant"

    plan: Plan | str | None = option(
        None, check=Check(_plan, "a plan.json path, a `Plan`, its dict, `'all'`"),
        doc="the matmuls to quantize: the plan `probe plan` wrote, or all")
    recipe: Recipe | None = option(
        None, check=Check(_recipe, f"{_RECIPE_NAMES}, a `Recipe`"),
        doc="the recipe to quantize with (default: the plan's)")

    def validate(self) -> None:
        if self.plan is None:
            raise ProbeError("option 'plan' is required by mode 'fake_quant': give the plan.json that "
                             "'probe plan RUN' wrote, or 'all'")
        if self.plan == "all" and self.recipe is None:
            raise ProbeError("option 'recipe' is required with plan='all' (e.g. recipe='mxfp8')")
