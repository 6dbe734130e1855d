"""Which ``optimizer.step()`` call is the outer one.

torch wraps each optimizer class's own ``step`` to run the global step hooks, so a
subclass whose ``step`` calls ``super().step()`` (a common way to add clipping or
logging) runs them once per level. Work that must happen once per optimizer step (the
monitor's gradients and moments, the parameter checks) asks :class:`StepNesting`
whether a hook belongs to the outermost call.
"""

from __future__ import annotations

import torch


class StepNesting:
    """Depth of the ``step`` calls in progress, per optimizer."""

    def __init__(self) -> None:
        self._depth: dict[int, int] = {}

    def enter(self, optimizer: torch.optim.Optimizer) -> bool:
        """From a step pre-hook: whether this call is the outermost one of ``optimizer``."""
        depth = self._depth.get(id(optimizer), 0)
        self._depth[id(optimizer)] = depth + 1
        return depth == 0

    def exit(self, optimizer: torch.optim.Optimizer) -> bool:
        """From a step post-hook: whether this call is the outermost one (it ends the step)."""
        depth = self._depth.get(id(optimizer), 1) - 1
        if depth > 0:
            self._depth[id(optimizer)] = depth
            return False
        self._depth.pop(id(optimizer), None)
        return True

    def reset(self) -> None:
        """A new probe step: forget calls whose post-hooks never ran (``step`` raised)."""
        self._depth.clear()
