"""The one way per-op tracing is turned on and off, shared by the session and escalation.

A session traces from its start; escalation turns the same tracing on in the middle of a
monitored run, after an anomaly. Both make their modes from names and options, start them on
the run directory, and put the tracer's pieces in place in one order: the module tracker's
hooks, compiled regions run eagerly (or kept), the dispatch mode. Taking them off is the
reverse, through the ``ExitStack`` :func:`traced` fills.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from types import MappingProxyType
from typing import Any

from probe.errors import warn_once
from probe.exporters.tensorboard_events import TENSORBOARD_SINK
from probe.modes.base import SessionPlugin
from probe.modes.config import ModeConfig
from probe.modes.registry import MODES
from probe.modes.sinks import SinkKind
from probe.tracer import mode_stack
from probe.tracer.compat import compiled_regions_eager
from probe.tracer.dispatch_mode import ProbeDispatchMode, Tracer
from probe.tracer.frozen_heap import frozen_heap
from probe.tracer.hook_notices import ignore_compiled_module_notice


def build_modes(configs: Iterable[ModeConfig]) -> list[SessionPlugin]:
    """Each mode's plug-in, made from its config."""
    return [MODES[config.mode](config) for config in configs]


SERIES_SINKS: Mapping[str, SinkKind] = MappingProxyType({TENSORBOARD_SINK.name: TENSORBOARD_SINK})
"""The live-output sinks the session offers every mode (``probe.modes.sinks``): the exporters
implement them, so no mode imports one."""


def start_modes(modes: Iterable[SessionPlugin], model: Any, out: Path, rank: int) -> None:
    """Each mode is offered the :data:`SERIES_SINKS`, opens its files in the run directory and
    attaches to the model (its hooks)."""
    for mode in modes:
        mode.sinks = SERIES_SINKS
        mode.start(out, rank)
        mode.attach(model, out, rank)


def traced(stack: ExitStack, tracer: Tracer, compiled: str,
           on_eager: Callable[[], None] | None = None, under_others: bool = False,
           gc_freeze: bool = True) -> None:
    """Put ``tracer`` in place, registering its removal on ``stack``.

    ``under_others``: the dispatch mode goes beneath the modes already on the stack (escalation
    arms it while the user's own dispatch modes may be active), and is taken out from there;
    otherwise it is entered on top, as a ``with`` block would. ``gc_freeze``: the program's
    objects are left out of garbage collections while it traces (``probe.tracer.frozen_heap``)."""
    stack.enter_context(frozen_heap(gc_freeze))
    tracer.modules.install()
    stack.callback(tracer.modules.uninstall)
    stack.callback(ignore_compiled_module_notice())  # torch's warning about those hooks
    stack.enter_context(compiled_regions_eager(compiled, on_eager))
    dispatch = ProbeDispatchMode(tracer)
    if under_others:
        mode_stack.push_under(dispatch)
        stack.callback(_take_out, dispatch)
    else:
        stack.enter_context(dispatch)
    # Module hooks on other threads are told apart from this one's: ops there go unseen.
    thread = threading.get_ident()
    tracer.modules.traced_threads.add(thread)
    stack.callback(tracer.modules.traced_threads.discard, thread)


def _take_out(dispatch: ProbeDispatchMode) -> None:
    if not mode_stack.remove(dispatch):
        warn_once("escalation-popped", "probe: the tracer's dispatch mode was taken off the stack by someone "
                  "else (a dispatch mode exited out of order)")
