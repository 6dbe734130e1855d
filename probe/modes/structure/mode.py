"""Mode "structure": the op records alone (ids, modules, phases, dtypes, shapes, graph).

No per-op work beyond the tracer's own bookkeeping: the cheapest way to see what
a step runs, and the measure of the tracer's cost in the benchmarks (msprobe
calls the same task "structure").
"""

from __future__ import annotations

from probe.modes.base import Mode
from probe.modes.registry import register_mode
from probe.modes.structure.options import Structure


@register_mode
class StructureMode(Mode):
    """Records op calls without inspecting tensor values."""

    name = "structure"
    config_class = Structure
