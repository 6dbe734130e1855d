"""The low-precision recipe lab: recipes as data (``formats``), reference quantize-dequantize and
its statistics (``quantize``), the matmul operands they apply to (``operands``), the passive
``whatif`` mode that measures every matmul operand under each recipe (``whatif``, read back by
``files``), the plan file (``plan_file``; ``probe plan`` ranks and writes it, see
``probe.modes.recipes.ranking``) and the active ``fake_quant`` mode that checks a plan
(``fake_quant``). ``options`` holds their options objects."""

from __future__ import annotations

from probe.modes.recipes.fake_quant import FakeQuantMode
from probe.modes.recipes.files import OperandWhatIf, WhatIfFiles
from probe.modes.recipes.formats import RECIPES, Recipe
from probe.modes.recipes.options import FakeQuant, WhatIf
from probe.modes.recipes.plan_file import Plan
from probe.modes.recipes.ranking import write_plan  # registers ``probe plan``
from probe.modes.recipes.whatif import WhatIfMode

__all__ = ["RECIPES", "FakeQuant", "FakeQuantMode", "OperandWhatIf", "Plan", "Recipe", "WhatIf",
           "WhatIfFiles", "WhatIfMode", "write_plan"]
