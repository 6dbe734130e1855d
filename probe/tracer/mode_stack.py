"""Putting a dispatch mode on the stack between steps, under the modes the user holds, and
taking exactly that one off again.

A ``with`` block pushes its mode on top and its exit pops whatever is on top. The monitor's
escalation (``probe.escalation``) turns the tracer on and off between steps, while the user
may hold a dispatch mode of their own across those steps (``FlopCounterMode``,
``DebugMode``), entered before or after ours. So the tracer goes *under* every mode on the
stack when it is put there (the user's exits keep popping their own modes, and a mode the
user holds sees the model's ops first, never the probe's own statistics work, which runs
with the tracer popped), and it is taken off by identity: the modes above it are popped,
it is removed, and they are pushed back in their order.

``TorchDispatchMode.__enter__``/``__exit__`` also keep module-level flags
(``is_in_torch_dispatch_mode`` and the one dynamo reads); they are recomputed from the
stack after each change rather than saved and restored, as the user's modes may have been
entered or left in between.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.utils._python_dispatch as python_dispatch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)


def untraced() -> contextlib.AbstractContextManager[Any]:
    """The probe's own torch work (reductions from hooks, a step's hand-over and write), out of
    sight of every dispatch mode: the tracer would record it as the model's ops, and a mode the
    user holds (DebugMode, FlopCounterMode) would count it."""
    return _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()


_INFRA_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)


def _sync_flags() -> None:
    """Set torch's "in a dispatch mode" flags to what the stack now holds."""
    modes = list(_get_current_dispatch_mode_stack())
    modes += [m for key in _INFRA_KEYS if (m := torch._C._get_dispatch_mode(key)) is not None]
    python_dispatch._is_in_torch_dispatch_mode = bool(modes)
    python_dispatch._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in modes)
    without_ignore = any(not m.ignore_compile_internals() for m in modes)
    python_dispatch._is_in_any_mode_without_ignore_compile_internals = without_ignore
    setter = getattr(python_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)
    if setter is not None:
        setter(without_ignore)


def push_under(mode: TorchDispatchMode) -> None:
    """Put ``mode`` at the bottom of the dispatch mode stack, under every mode on it now."""
    above = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]
    _push_mode(mode)
    for held in reversed(above):
        _push_mode(held)
    _sync_flags()


def remove(mode: TorchDispatchMode) -> bool:
    """Take ``mode`` off the stack wherever it is, leaving the others in their order; False if it
    is not there (someone popped it)."""
    stack = _get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return False
    above = []
    while True:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for held in reversed(above):
        _push_mode(held)
    _sync_flags()
    return True
