"""Autocast's state, recorded with each forward op as a small policy id.

Inside a ``TorchDispatchMode`` autocast's state cannot be read: the dispatcher excludes every
``Autocast*`` key before it calls the mode, so ``torch.is_autocast_enabled()`` is False there
for every op. It is read where it is visible instead: in the module tracker's forward pre- and
post-hooks (and at the start of a step), each time a module call begins or ends, and the forward
ops recorded until the next read carry the id it found. A module hook is a few C calls; an op
pays one attribute read. An autocast block opened and closed inside one module's ``forward``
between two of its submodule calls is not seen (the ops in it carry the state read before it).

A policy is the tuple of ``(device type, dtype)`` autocast is enabled for, ``()`` when it is off
everywhere; :class:`AutocastPolicies` numbers them in the order they are first seen (0: off).
The step's manifest holds the table (``autocast``), the ops their id (``amp``; see
``docs/format.md``).
"""

from __future__ import annotations

import torch

from probe.tracer.value_ids import DTYPE_NAMES

AutocastPolicy = tuple[tuple[str, str], ...]
"""The ``(device type, dtype name)`` pairs autocast is enabled for; ``()``: off."""

OFF = 0
"""The id of the policy with autocast off everywhere."""

_any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)


def _device_types() -> tuple[str, ...]:
    """The device types whose autocast state is read: the CPU, CUDA, and this process's other
    accelerator (a privateuse1 backend such as an NPU) when there is one."""
    types = ["cpu", "cuda"]
    accelerator = getattr(torch, "accelerator", None)
    available = accelerator is not None and accelerator.is_available()
    current = accelerator.current_accelerator() if available else None
    if current is not None and current.type not in types:
        types.append(current.type)
    return tuple(types)


class AutocastPolicies:
    """Numbers the autocast policies a session sees; :meth:`current` reads the state now."""

    def __init__(self) -> None:
        self.table: list[AutocastPolicy] = [()]
        """Policy by id."""
        self._ids: dict[AutocastPolicy, int] = {(): OFF}
        self._devices = _device_types()

    def current(self) -> int:
        """The id of autocast's state on the calling thread now (outside a dispatch mode)."""
        if _any_enabled is not None and not _any_enabled():
            return OFF
        policy = tuple((device, DTYPE_NAMES[torch.get_autocast_dtype(device)]) for device in self._devices
                       if torch.is_autocast_enabled(device))
        known = self._ids.get(policy)
        if known is None:
            known = self._ids[policy] = len(self.table)
            self.table.append(policy)
        return known

    def manifest(self, ids: set[int]) -> list[dict[str, str]]:
        """The table for a step's manifest, up to the largest id its ops use: each policy as
        ``{device type: dtype}`` (``{}``: off)."""
        return [dict(policy) for policy in self.table[:max(ids, default=OFF) + 1]]
