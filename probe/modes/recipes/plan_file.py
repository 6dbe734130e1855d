"""A low-precision plan as a file: the recipe, the matmuls (op ids) that keep high precision and
those that are quantized, and the ranking that decided it (``probe plan`` writes it, the
fake_quant mode reads it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.modes.recipes.formats import Recipe, parse_recipe
from probe.rundir.untrusted_reads import read_json
from probe.vocabulary.option_values import show

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Plan:
    """Which matmuls (op ids) are quantized under ``recipe``, which keep high precision."""

    recipe: Recipe
    quantize: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    ranking: tuple[dict[str, Any], ...] = field(default=(), compare=False)
    """Each matmul's risk, highest first: ``op``, ``module``, ``phase``, ``name``, ``risk``, ``reason``."""

    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "recipe": self.recipe.to_json(), "keep": list(self.keep),
                "quantize": list(self.quantize), "ranking": list(self.ranking)}

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any], what: str = "the plan") -> Plan:
        try:
            return cls(parse_recipe(data["recipe"]), tuple(str(op) for op in data.get("quantize", ())),
                       tuple(str(op) for op in data.get("keep", ())), tuple(data.get("ranking", ())))
        except (KeyError, TypeError, ProbeError) as error:
            raise ProbeError(f"{what} is not a plan written by 'probe plan' ({error})") from None

    @classmethod
    def load(cls, path: Path | str) -> Plan:
        return cls.from_json(read_json(Path(path)), str(path))


def parse_plan(value: Any) -> Plan | None:
    """The fake_quant mode's ``plan`` option: a :class:`Plan`, a path to a plan file, a plan's
    JSON dict, or ``"all"`` (every matmul quantized: returns None)."""
    if value == "all":
        return None
    if isinstance(value, Plan):
        return value
    if isinstance(value, dict):
        return Plan.from_json(value, "option 'plan'")
    if isinstance(value, (str, Path)):
        try:
            is_file = Path(value).is_file()
        except (OSError, ValueError):  # a name too long for the file system, a NUL byte
            is_file = False
        if not is_file:
            raise ProbeError(f"option 'plan': {show(str(value))} is no file; give the plan.json that "
                             "'probe plan RUN' wrote, a Plan, or 'all'")
        return Plan.load(value)
    raise ProbeError(f"option 'plan': expected a plan file, a Plan, a dict or 'all', got {show(value)}")
