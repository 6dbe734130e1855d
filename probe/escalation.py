"""Escalation: the monitor arms the per-op modes for a few steps after an anomaly.

A loss spike may show up after days, and per-op tracing cannot stay on that long. With
``probe.mode("monitor", ..., on_anomaly="trace", trace_modes=["stats"], trace_steps=N)``
the session runs the monitor alone (hooks, no dispatch mode) until the monitor finds an
anomaly, then turns the trace modes on for the next ``N`` steps and off again, without a
restart. msprobe's monitor guide advises switching activation monitoring on by hand when
the loss spikes; this does it for the user.

When: the monitor learns of an incident where its rules run: on the writer thread, after
the step's numbers reach the host (``on_anomaly="log"`` does the same). The session asks at
the start of each step whether an incident became known since; tracing starts there. With
the writer thread that is one or two steps after the incident's step (the step after, when
its numbers were on the host in time), never later, and no sync is added to know sooner.
An incident that began at a traced step needs no window of its own (its op records are
there); one learned while a window is open joins it. A session opens at most
``trace_limit`` windows (default 5): later incidents are logged once and listed in the
manifest of the step that learned them (:data:`REFUSED_KEY`), so the summary says why.

Cost while nothing happened: no dispatch mode and no module-tracker hooks are installed,
and the trace modes are not attached (the stats mode's parameter checks are hooks too),
so a step costs what the monitor alone costs plus one look at a queue. Each window builds
its modes afresh, attaches them, and closes them once its last step is on disk.

Dispatch modes the user holds across steps (``FlopCounterMode``, ``DebugMode``) keep
working: the tracer goes under them on the stack and is taken off by identity
(``probe.tracer.mode_stack``).

Traced steps are ordinary steps of the run directory (``ops.jsonl``, the stats, the dump);
their manifest holds ``"escalated": {"window": [first, last], "trace_modes": [...],
"incidents": [...]}``, each incident the root alert that armed the window (as in
``anomalies.jsonl``) with the turbulence threshold in force. ``probe summary`` links each
incident to what the traced steps found (``probe.analysis.summary.EscalationLinks``).
"""

from __future__ import annotations

import logging
import queue
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probe.errors import ProbeError, warn_once
from probe.lifecycle import build_modes, start_modes, traced
from probe.modes.base import Incident, OpObserver, SessionPlugin, TraceRequest
from probe.modes.config import ModeConfig, configs_for
from probe.modes.registry import MODES
from probe.rundir import layout
from probe.tracer.dispatch_mode import Tracer
from probe.tracer.op_call import OpCall
from probe.vocabulary.session_options import Options

log = logging.getLogger("probe.monitor")

MANIFEST_KEY = layout.ESCALATED_KEY
REFUSED_KEY = layout.ESCALATION_REFUSED_KEY
"""Manifest entry of the step at whose start incidents were learned but not traced: the
session had traced ``trace_limit`` windows already."""


class _Armed(OpObserver):
    """The tracer's one observer for the trace modes: it forwards to the window's modes (fresh
    each window), so the tracer is built once, with the session."""

    def __init__(self) -> None:
        self.before_modes: list[OpObserver] = []
        self.after_modes: list[OpObserver] = []

    def set(self, observers: list[OpObserver]) -> None:
        self.before_modes = [o for o in observers if type(o).before is not OpObserver.before]
        self.after_modes = [o for o in observers if type(o).after is not OpObserver.after]

    def before(self, call: OpCall) -> None:
        for observer in self.before_modes:
            observer.before(call)

    def after(self, call: OpCall) -> None:
        for observer in self.after_modes:
            observer.after(call)


@dataclass
class Window:
    """Steps ``first``..``last`` traced for the incidents in ``incidents``."""

    first: int
    last: int
    incidents: list[dict[str, Any]] = field(default_factory=list)


class Escalation:
    """The trace modes the monitor arms after an anomaly; driven by the session."""

    def __init__(self, request: TraceRequest, options: Options) -> None:
        self.request = request
        self.options = options
        self.trace_modes = request.modes
        self.trace_options = dict(request.options)
        self.trace_steps = request.steps
        self.trace_limit = request.limit
        self._opened = 0
        """Windows this session opened (``trace_limit`` bounds it)."""
        self._refused: dict[int, list[dict[str, Any]]] = {}
        """Step -> incidents learned at its start and not traced (the limit), for its manifest."""
        self._limit_told = False
        accepted = set().union(*(MODES[name].option_names for name in self.trace_modes))
        unknown = sorted(key for key in self.trace_options if key not in accepted)
        if unknown:
            raise ProbeError(f"monitor option 'trace_options': {unknown} is not an option of the trace modes "
                             f"{list(self.trace_modes)}; accepted: {sorted(accepted)}")
        self._spare: list[SessionPlugin] | None = self._build()  # checks the values now, before any step
        self.observer = _Armed()
        self._heard: queue.SimpleQueue[Incident] = queue.SimpleQueue()
        self._tracer: Tracer | None = None
        self._out: Path | None = None
        self._rank = 0
        self.window: Window | None = None
        self._windows: list[Window] = []
        """The latest windows (their steps are the traced ones), latest last."""
        self._modes: list[SessionPlugin] = []
        self._armed: ExitStack | None = None
        self._armed_step: int | None = None
        self._retired: list[tuple[int, list[SessionPlugin]]] = []
        """Modes of ended windows and the step they ended before: closed once that is on disk."""

    @classmethod
    def of(cls, modes: list[SessionPlugin], options: Options,
           observers: list[OpObserver]) -> Escalation | None:
        """The session's escalation: None unless a plug-in asks for one (the monitor's
        ``on_anomaly="trace"``, :meth:`SessionPlugin.trace_request`)."""
        request = next((r for r in (m.trace_request() for m in modes) if r is not None), None)
        if request is None:
            return None
        if observers:
            tracing = [m.name for m in modes if m.observer() is not None]
            raise ProbeError(f"monitor option on_anomaly='trace' turns per-op modes on after an anomaly, but "
                             f"this session traces every op already with {tracing}; drop on_anomaly='trace' "
                             "or those modes")
        return cls(request, options)

    def _build(self) -> list[SessionPlugin]:
        configs, _ = configs_for(self.trace_modes, self.trace_options)  # every option is some mode's
        return build_modes(c for c in configs if isinstance(c, ModeConfig))

    # -- session ---------------------------------------------------------------------

    def start(self, tracer: Tracer, out: Path, rank: int) -> None:
        """The session started on a recorded rank: listen for the monitor's incidents."""
        self._tracer, self._out, self._rank = tracer, out, rank
        self.request.listeners.append(self._hear)

    def _hear(self, incident: Incident) -> None:
        """The monitor reported a new incident (on the writer thread)."""
        self._heard.put(incident)

    def begin_step(self, step: int) -> None:
        """A step starts: close what is on disk, learn new incidents, arm or disarm for ``step``."""
        if self._tracer is None:
            return
        self._close_retired(step)
        while not self._heard.empty():
            self._learn(self._heard.get_nowait(), step)
        window = self.window
        inside = window is not None and window.first <= step <= window.last
        if self._armed is not None and not inside:
            self._disarm(step)
        self._armed_step = None
        if inside and self._armed is None:
            self._arm(step)
        if inside and self._armed is not None:
            for mode in self._modes:
                mode.begin_step(step)
            self._armed_step = step

    def _announce(self, step: int) -> None:
        """Say that ``step`` was traced, as it is written: a window announced whole when it opened
        named steps the run never reached (it ended inside the window)."""
        window = self.window
        assert window is not None
        began = [i["step"] for i in window.incidents]
        causes = ", ".join(f"step {s}" for s in began)
        place = f"step {step} ({step - window.first + 1} of {window.last - window.first + 1})"
        late = ("; the incident reached the session at that step's start (the monitor's writer reports "
                "a step or two late)") if step == window.first and step > min(began) + 1 else ""
        log.warning("probe monitor: traced %s with %s after the incident at %s%s", place,
                    list(self.trace_modes), causes, late)

    def _learn(self, heard: Incident, step: int) -> None:
        incident = heard.record
        if any(w.first <= heard.step <= w.last for w in self._windows):
            return  # it began at a traced step: its ops are recorded there
        window = self.window
        if window is not None and window.last >= step:
            window.incidents.append(incident)
            return
        if self.trace_limit is not None and self._opened >= self.trace_limit:
            if not self._limit_told:
                self._limit_told = True
                log.warning("probe monitor: not tracing after the incident at step %d: this session traced "
                            "%d window(s), its trace_limit", heard.step, self._opened)
            self._refused.setdefault(step, []).append(incident)
            return
        self._opened += 1
        self.window = Window(step, step + self.trace_steps - 1, [incident])
        # An incident is learned a step or two after it began: the last few windows are enough.
        self._windows = [*self._windows[-3:], self.window]

    def _arm(self, step: int) -> None:
        window = self.window
        assert window is not None and self._tracer is not None and self._out is not None
        tracer = self._tracer
        modes = self._spare if self._spare is not None else self._build()
        self._spare = None
        armed = ExitStack()
        try:
            start_modes(modes, self.options.model, self._out, self._rank)
            traced(armed, tracer, self.options.compiled, under_others=True, gc_freeze=self.options.gc_freeze)
        except Exception as e:  # training goes on, monitored
            with suppress(Exception):
                armed.close()
            for mode in modes:
                with suppress(Exception):
                    mode.close()
            warn_once(f"escalation-failed:{self._out}",
                      f"probe monitor: could not turn {list(self.trace_modes)} on after the incident at step "
                      f"{window.incidents[0]['step']} ({type(e).__name__}: {e}); the monitor goes on alone")
            self.window = None
            return
        self._armed, self._modes = armed, modes
        self.observer.set([o for m in modes if (o := m.observer()) is not None])

    def _disarm(self, step: int) -> None:
        """Take the tracer off; the window's modes are closed once its last step is on disk."""
        armed, self._armed = self._armed, None
        modes, self._modes = self._modes, []
        self.observer.set([])
        self._armed_step = None
        try:
            if armed is not None:
                armed.close()
        finally:
            if modes:
                self._retired.append((step, modes))

    def _close_retired(self, step: int) -> None:
        """Close the modes of windows that ended before the previous step: with the writer thread,
        every step before the one just handed over is on disk when a step starts."""
        done = [modes for retired_at, modes in self._retired if retired_at < step]
        if done:
            self._retired = [(at, modes) for at, modes in self._retired if at >= step]
            _close_all([mode for modes in done for mode in modes])

    def modes_of(self, step: int) -> list[SessionPlugin]:
        """The trace modes recording ``step`` (none unless it is an armed step)."""
        return self._modes if self._armed_step == step else []

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest entries of ``step``: :data:`MANIFEST_KEY` when it was traced by
        escalation, :data:`REFUSED_KEY` when incidents learned at its start were not."""
        entries: dict[str, Any] = {}
        window = self.window
        if self._armed_step == step and window is not None:
            self._announce(step)
            entries[MANIFEST_KEY] = {"window": [window.first, window.last],
                                     "trace_modes": list(self.trace_modes),
                                     "incidents": [dict(i) for i in window.incidents]}
        refused = self._refused.pop(step, None)
        if refused:
            entries[REFUSED_KEY] = {"trace_limit": self.trace_limit, "incidents": refused}
        return entries

    def disarm(self) -> None:
        """The session's block ends (its last step is handed over): take the tracer off."""
        if self._armed is not None:
            self._disarm(self._armed_step if self._armed_step is not None else -1)

    def close(self) -> None:
        """The session ends, every step on disk: close every window's modes."""
        if self._tracer is not None:
            with suppress(ValueError):
                self.request.listeners.remove(self._hear)
        modes = [mode for _, retired in self._retired for mode in retired] + self._modes
        self._retired, self._modes = [], []
        _close_all(modes)


def _close_all(modes: list[SessionPlugin]) -> None:
    """Close each mode whichever of them fails; then raise the first failure."""
    failure: BaseException | None = None
    for mode in modes:
        try:
            mode.close()
        except BaseException as e:
            failure = failure or e
    if failure is not None:
        raise failure

