"""Low-precision recipes as data: an element format, a block size, a scale format and a scaling.

A :class:`Recipe` says how a matmul operand would be stored in a low-precision run: each value in
``element`` (fp8 e4m3 or e5m2, fp4 e2m1), scaled by a factor shared by ``block`` consecutive values
along the matmul's reduction dimension (0: the whole tensor), the factor itself stored in ``scale``
(fp32, the power of two e8m0, or fp8 e4m3 under a per-tensor fp32 factor as NVFP4 does).
``scaling`` says where a per-tensor factor comes from: the tensor's own amax ("current"), or the
largest amax of the last ``history`` steps of the same operand ("delayed", TransformerEngine's
default). The built-ins are :data:`RECIPES`; any other combination is a ``Recipe(...)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from probe.errors import ProbeError
from probe.vocabulary.option_values import show


@dataclass(frozen=True)
class ElementFormat:
    """A low-precision element format: its largest finite value, smallest normal and smallest
    subnormal magnitudes, and the torch dtype that rounds to it (None: rounded by table)."""

    name: str
    max: float
    min_normal: float
    min_subnormal: float
    dtype: torch.dtype | None
    saturation_bound: float
    """Half a step beyond ``max``: a scaled value above it is clipped (saturates); one below it
    would round to ``max`` anyway."""


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative values of fp4 e2m1 (OCP MX spec, table 5), in code order."""

ELEMENT_FORMATS = {
    "e4m3": ElementFormat("e4m3", 448.0, 2.0 ** -6, 2.0 ** -9, torch.float8_e4m3fn, 464.0),
    "e5m2": ElementFormat("e5m2", 57344.0, 2.0 ** -14, 2.0 ** -16, torch.float8_e5m2, 61440.0),
    "e2m1": ElementFormat("e2m1", 6.0, 1.0, 0.5, None, 7.0),
}
SCALE_FORMATS = ("fp32", "e8m0", "e4m3")
SCALINGS = ("current", "delayed")


@dataclass(frozen=True)
class Recipe:
    """How an operand is quantized (see the module docstring); ``name`` labels it in reports."""

    name: str
    element: str
    block: int = 0
    """Values sharing one scale along the reduction dimension; 0: one scale per tensor."""
    scale: str = "fp32"
    scaling: str = "current"
    history: int = 16
    """Steps of amax history under ``scaling="delayed"``."""

    def __post_init__(self) -> None:
        if self.element not in ELEMENT_FORMATS:
            raise ProbeError(f"recipe {self.name!r}: element format {show(self.element)} is not one of "
                             f"{sorted(ELEMENT_FORMATS)}")
        if self.scale not in SCALE_FORMATS:
            raise ProbeError(f"recipe {self.name!r}: scale format {show(self.scale)} is not one of "
                             f"{list(SCALE_FORMATS)}")
        if self.scaling not in SCALINGS:
            raise ProbeError(f"recipe {self.name!r}: scaling {show(self.scaling)} is not one of "
                             f"{list(SCALINGS)}")
        if not isinstance(self.block, int) or self.block < 0:
            raise ProbeError(f"recipe {self.name!r}: block {show(self.block)} is not a size >= 0 "
                             "(0: per tensor)")
        if self.block and self.scaling == "delayed":
            raise ProbeError(f"recipe {self.name!r}: delayed scaling is per tensor; give block=0")
        if self.scale != "fp32" and not self.block:
            raise ProbeError(f"recipe {self.name!r}: scale format {self.scale!r} needs a block size")

    @property
    def format(self) -> ElementFormat:
        return ELEMENT_FORMATS[self.element]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


RECIPES = {r.name: r for r in [
    Recipe("fp8-e4m3", "e4m3"),
    Recipe("fp8-e5m2", "e5m2"),
    Recipe("fp8-e4m3-delayed", "e4m3", scaling="delayed"),
    Recipe("mxfp8", "e4m3", block=32, scale="e8m0"),
    Recipe("nvfp4", "e2m1", block=16, scale="e4m3"),
]}
"""The built-in recipes: FP8 with per-tensor current (or delayed) scaling, MXFP8 (OCP MX v1.0),
NVFP4 (16-value blocks, e4m3 block scales under a per-tensor fp32 scale)."""


def parse_recipe(value: Any, option: str = "recipe") -> Recipe:
    """A built-in recipe's name, a :class:`Recipe`, or a dict of its fields (a JSON config)."""
    if isinstance(value, Recipe):
        return value
    if isinstance(value, str) and value in RECIPES:
        return RECIPES[value]
    if isinstance(value, dict):
        try:
            return Recipe(**value)
        except TypeError as error:
            raise ProbeError(f"option {option!r}: {show(value)} is not a recipe ({error})") from None
    raise ProbeError(f"option {option!r}: {show(value)} is not one of {sorted(RECIPES)} "
                     "(or a probe.Recipe, or a dict of its fields)")


def parse_recipes(value: Any, option: str = "recipes") -> tuple[Recipe, ...]:
    """One recipe or several (see :func:`parse_recipe`); names must differ."""
    items: Iterable[Any] = [value] if isinstance(value, (str, Recipe, dict)) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ProbeError(f"option {option!r}: expected a recipe name or a list of them, got {show(value)}")
    recipes = tuple(parse_recipe(item, option) for item in items)
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise ProbeError(f"option {option!r}: recipe names repeat in {names}")
    return recipes
