"""What the probe's global ``optimizer.step`` hooks need to know about the call they see.

- **Which call is the outer one.** torch wraps each optimizer class's own ``step`` to run
  the global step hooks, so a subclass whose ``step`` calls ``super().step()`` (a common
  way to add clipping or logging) runs them once per level. Work that must happen once
  per optimizer step (the monitor's gradients and moments, the parameter checks) asks
  :class:`StepNesting` whether a hook belongs to the outermost call.
- **The closure.** ``optimizer.step(closure)`` (LBFGS; Lightning's automatic
  optimization) runs the model's forward and backward inside the step. A pre-hook finds
  it with :func:`step_closure` and has the step call a wrapper instead with
  :func:`with_closure`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

StepArgs = tuple[tuple[Any, ...], dict[str, Any]]
"""A step pre-hook's ``(args, kwargs)``; ``args[0]`` is the optimizer."""


def step_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The closure the step was given, or None."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def with_closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]) -> StepArgs:
    """The pre-hook's result that makes the step call ``closure`` instead of the one it was given."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


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
