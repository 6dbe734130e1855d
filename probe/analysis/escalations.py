"""What the steps traced after an anomaly found: the link ``probe summary`` prints per incident.

With the monitor's ``on_anomaly="trace"`` (``probe.escalation``) the steps after an
incident are traced by per-op modes, and their manifests say which incidents armed them.
Per incident this module answers: which steps were traced for it, whether it recurred
there, and if so where: the first non-finite op, and the modules whose output jumped
most over their input (:func:`module_jumps`). Or that it did not recur, or was never
traced (the run ended first).

Recurred means: a traced step made a NaN or Inf (first non-finite op, or the incident's
series non-finite), or the incident's root series is still outside the band of the rule
that raised it (turbulence: beyond ``baseline * (1 + threshold)`` or below
``baseline / (1 + threshold)``), or a traced step raised alerts of its own.

:class:`EscalationLinks` follows the step summaries as ``probe summary`` streams them, so
the run is read once; :func:`escalation_links` reads a run by itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from probe.analysis.mode_records import Alert, AlertReader
from probe.analysis.summary import StepSummary, ranked
from probe.errors import ProbeError
from probe.rundir.layout import ESCALATED_KEY, ESCALATION_REFUSED_KEY
from probe.rundir.records import frame_module
from probe.rundir.run import OpRecord, Run

TOP_JUMPS = 3


@dataclass(frozen=True)
class Jump:
    """A module whose outputs left it with a much larger norm than its inputs entered with."""

    module: str
    phase: str
    ratio: float
    """Largest norm among the tensors its ops passed out over the largest among those passed in."""
    entering: float
    leaving: float
    step: int

    def describe(self) -> str:
        return (f"{self.module} {self.phase} x{self.ratio:.3g} (norm {self.entering:.3g} in, "
                f"{self.leaving:.3g} out, step {self.step})")


def _inside(fqn: str, module: str) -> bool:
    return not module or fqn == module or fqn.startswith(module + ".")


def module_jumps(ops: list[OpRecord], step: int, within: str = "", top: int = TOP_JUMPS) -> list[Jump]:
    """The ``top`` module calls (per phase) under ``within`` ("" for all) whose outputs' norm is
    the largest multiple of their inputs'.

    A tensor an op produced and an op of another module call consumed (same phase: forward
    to forward, gradients to gradients) enters every module call on the consumer's module
    stack that is not on the producer's, and leaves every one on the producer's that is not
    on the consumer's. Parameters enter no module this way (no op of the step made them),
    so a module's jump is its activations' growth: a weight scaled by 10^4 shows as its
    module's x10^4. Norms are the stats mode's (fp32); non-finite tensors and mask fills
    are left out (:func:`probe.analysis.summary.ranked`: the non-finite report covers them)."""
    by_index = {op.index: op for op in ops}
    entering: dict[tuple[str, str], float] = {}
    leaving: dict[tuple[str, str], float] = {}
    for op in ops:
        consumer = set(op.module_stack)
        for tensor in op.inputs:
            if tensor.source is None:
                continue
            producer = by_index.get(tensor.source[0])
            if producer is None or producer.phase != op.phase or tensor.source[1] >= len(producer.outputs):
                continue
            made = producer.outputs[tensor.source[1]]
            if made.stats is None or not ranked(made):
                continue
            norm = made.stats.get("norm")
            if not isinstance(norm, float) or not norm > 0:
                continue
            produced = set(producer.module_stack)
            for frame in consumer - produced:
                key = (frame, op.phase)
                entering[key] = max(entering.get(key, 0.0), norm)
            for frame in produced - consumer:
                key = (frame, op.phase)
                leaving[key] = max(leaving.get(key, 0.0), norm)
    jumps = []
    for (frame, phase), norm_in in entering.items():
        module = frame_module(frame)
        if module and _inside(module, within) and (frame, phase) in leaving:
            call = frame[len(module):]
            name = module if call in ("", "[0]") else f"{module}{call}"
            norm_out = leaving[(frame, phase)]
            jumps.append(Jump(name, phase, norm_out / norm_in, norm_in, norm_out, step))
    jumps.sort(key=lambda j: -j.ratio)
    return jumps[:top]


@dataclass
class _TracedStep:
    step: int
    first_nonfinite: OpRecord | None
    has_stats: bool
    alerts: list[Alert]
    root_values: dict[tuple[int, int], tuple[float, bool]]
    """(incident rank, step) -> the root series' metric in this step and whether it was non-finite."""
    jumps: dict[tuple[int, int], list[Jump]]
    """(incident rank, step) -> the largest jumps under the incident's module (or anywhere)."""
    parameters: list[str]
    """Parameters non-finite at the step's start, gradients before its update (stats mode)."""


@dataclass
class _Window:
    rank: int
    first: int
    last: int
    trace_modes: list[str]
    incidents: dict[int, tuple[Alert, float | None]] = field(default_factory=dict)
    """Incident step -> its root alert and the turbulence threshold in force."""
    steps: list[_TracedStep] = field(default_factory=list)


@dataclass
class IncidentLink:
    """One incident and what the steps traced after it found."""

    root: Alert
    traced: list[int]
    """The steps traced for it (empty: never traced)."""
    recurred: bool | None
    """None when not traced."""
    first_nonfinite: OpRecord | None = None
    nonfinite_step: int | None = None
    jumps: list[Jump] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    """The root series' metric in each traced step that collected it."""
    alerts: int = 0
    """Alerts the traced steps raised."""
    has_stats: bool = True
    in_traced_step: bool = False
    """The incident began at a traced step itself (its ops are there)."""
    parameters: list[str] = field(default_factory=list)
    """The first traced step's non-finite parameters or gradients, one line each."""
    untraced: str = "the run ended before the step after it was known"
    """Why it was not traced (when ``traced`` is empty)."""

    def describe(self) -> str:
        root = self.root
        if root.rule == "nonfinite":  # its value is a NaN count: the reason says both counts
            label = root.metric.rpartition(".")[0]
            what = f"{root.module} {label}: {root.reason or 'NaN or Inf'}"
        else:
            base = "" if root.baseline is None else f", baseline {root.baseline:.4g}"
            why = f", {root.reason}" if root.reason else ""
            what = f"{root.module} {root.metric} = {root.value:.4g}{base}{why}"
        head = f"anomaly at step {root.step} rank {root.rank} ({root.rule}: {what})"
        if not self.traced:
            return f"{head} -> not traced: {self.untraced}"
        steps = _span(self.traced)
        if self.in_traced_step:
            head += " in a traced step"
        values = "" if root.rule == "nonfinite" else ", ".join(f"{v:.4g}" for v in self.values)
        if not self.recurred:
            within = f" ({root.metric} {values} within the band)" if values else ""
            return f"{head} -> did not recur in traced {steps}{within}"
        parts = [f"{head} -> traced {steps}: recurred"]
        if values:
            parts[0] += f" ({root.metric} {values})"
        if not self.has_stats:
            parts.append("no statistics (trace_modes without 'stats')")
        elif self.first_nonfinite is not None:
            op = self.first_nonfinite
            parts.append(f"first non-finite {op.name} at {op.module or '<outside modules>'} ({op.phase}, "
                         f"step {self.nonfinite_step}, id {op.id})")
        else:
            parts.append("no non-finite op")
        parts += self.parameters
        if self.jumps:
            parts.append("largest jump " + "; ".join(j.describe() for j in self.jumps))
        if self.alerts:
            parts.append(f"{self.alerts} alert(s) in the traced steps")
        return "; ".join(parts)


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _module_of(root: Alert) -> str:
    """The module an alert is about: its series' module, or the module holding its parameter."""
    return root.module if root.kind == "activation" else root.module.rpartition(".")[0]


def _root_series_value(run: Run, step: int, rank: int, root: Alert) -> tuple[float, bool] | None:
    label, _, metric = root.metric.rpartition(".")
    for series in run.monitor(step, rank):
        if (series.kind == root.kind and series.name == root.module and series.call == root.call
                and (series.slot or series.kind) == label):
            value = getattr(series, metric, None)
            if not isinstance(value, float):
                return None
            return abs(value), series.nan + series.inf > 0
    return None


class EscalationLinks:
    """Collects incidents and escalated steps while the steps stream by; then :meth:`links`."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self._roots: list[Alert] = []
        self._windows: dict[tuple[int, int], _Window] = {}
        self._escalated: set[tuple[int, int]] = set()
        self._refused: dict[tuple[int, int], int | None] = {}
        """(rank, incident step) -> the trace_limit that kept it from being traced."""
        options = run.info.get("options") if isinstance(run.info, dict) else None
        mode_options = options.get("mode_options", {}) if isinstance(options, dict) else {}
        policy = mode_options.get("on_anomaly") if isinstance(mode_options, dict) else None
        self.tracing = policy in ("trace", "'trace'")  # the manifest shows options as repr
        """The run was written with ``on_anomaly="trace"`` (else there is nothing to link)."""

    def follow(self, summaries: Iterable[StepSummary]) -> Iterator[StepSummary]:
        """Pass the summaries through, noting what each step adds."""
        for summary in summaries:
            parameters = summary.nonfinite_parameters
            self.add(summary.step, summary.rank, summary.anomalies, summary.fault,
                     summary.has_stats, [] if parameters is None else parameters.describe())
            yield summary

    def add(self, step: int, rank: int, alerts: list[Alert], first_nonfinite: OpRecord | None,
            has_stats: bool, parameters: list[str] | None = None) -> None:
        for alert in alerts:
            if alert.incident in (None, alert.step):
                self._roots.append(alert)
                break  # the first alert of an incident's first step is its root
        if not self.tracing:
            return
        manifest = self.run.step_info(step, rank).manifest
        refused = manifest.get(ESCALATION_REFUSED_KEY)
        if isinstance(refused, dict) and isinstance(refused.get("incidents"), list):
            limit = refused.get("trace_limit")
            for row in refused["incidents"]:
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    self._refused[(rank, row["step"])] = limit if isinstance(limit, int) else None
        marker = manifest.get(ESCALATED_KEY)
        if not isinstance(marker, dict):
            return
        window = self._window(rank, marker)
        if window is None:
            return
        self._escalated.add((rank, step))
        values, jumps = {}, {}
        ops = self.run.ops(step, rank) if has_stats else []
        for incident_step, (root, _) in window.incidents.items():
            found = _root_series_value(self.run, step, rank, root)
            if found is not None:
                values[(rank, incident_step)] = found
            if ops:
                jumps[(rank, incident_step)] = (module_jumps(ops, step, _module_of(root))
                                                or module_jumps(ops, step))
        window.steps.append(_TracedStep(step, first_nonfinite, has_stats, list(alerts), values, jumps,
                                        parameters or []))

    def _window(self, rank: int, marker: dict[str, Any]) -> _Window | None:
        try:
            first, last = (int(v) for v in marker["window"])
            window = self._windows.setdefault((rank, first), _Window(rank, first, last,
                                                                     list(marker.get("trace_modes", []))))
            for row in marker.get("incidents", []):
                root = cast(AlertReader, self.run.mode("monitor")).alert(row)
                threshold = row.get("threshold")
                known = float(threshold) if isinstance(threshold, (int, float)) else None
                window.incidents.setdefault(root.step, (root, known))
        except (KeyError, TypeError, ValueError, ProbeError):
            return None  # a marker this probe cannot read: the step is summarized without the link
        return window

    def links(self) -> list[IncidentLink]:
        """One link per incident of the run (with ``on_anomaly="trace"``), in step order."""
        if not self.tracing:
            return []
        by_incident = {(w.rank, step): w for w in self._windows.values() for step in w.incidents}
        links = []
        for root in self._roots:
            inside = (root.rank, root.step) in self._escalated
            window = by_incident.get((root.rank, root.step))
            if window is None and inside:
                window = next(w for w in self._windows.values()
                              if w.rank == root.rank and any(s.step == root.step for s in w.steps))
            if window is None:
                link = IncidentLink(root, [], None)
                if (root.rank, root.step) in self._refused:
                    limit = self._refused[(root.rank, root.step)]
                    link.untraced = (f"the session had traced {limit} window(s), its trace_limit"
                                     if limit is not None else "the session's trace_limit was reached")
                links.append(link)
                continue
            links.append(self._link(root, window, inside))
        return links

    def _link(self, root: Alert, window: _Window, inside: bool) -> IncidentLink:
        threshold = window.incidents.get(root.step, (root, None))[1]
        steps = [s for s in window.steps if s.step >= root.step]
        link = IncidentLink(root, [s.step for s in steps], False, in_traced_step=inside)
        link.has_stats = any(s.has_stats for s in steps)
        link.parameters = next((s.parameters for s in steps if s.parameters), [])
        for s in steps:
            if s.first_nonfinite is not None and link.first_nonfinite is None:
                link.first_nonfinite, link.nonfinite_step = s.first_nonfinite, s.step
            link.alerts += sum(1 for a in s.alerts if a.step != root.step)
            measured = s.root_values.get((root.rank, root.step))
            if measured is not None:
                link.values.append(measured[0])
                if measured[1] or _out_of_band(root, measured[0], threshold):
                    link.recurred = True
        if link.first_nonfinite is not None or link.alerts:
            link.recurred = True
        # Jumps say where a magnitude grew; a NaN's origin is the first non-finite op, not a jump.
        if link.recurred and (root.rule != "nonfinite" or link.first_nonfinite is None):
            best: dict[tuple[str, str], Jump] = {}
            for s in steps:
                for jump in s.jumps.get((root.rank, root.step), []):
                    key = (jump.module, jump.phase)
                    if key not in best or jump.ratio > best[key].ratio:
                        best[key] = jump
            link.jumps = sorted(best.values(), key=lambda j: -j.ratio)[:TOP_JUMPS]
        return link


def _out_of_band(root: Alert, value: float, threshold: float | None) -> bool:
    """Whether ``value`` is still anomalous by the turbulence rule that raised ``root``."""
    if root.rule != "turbulence" or threshold is None or root.baseline is None or not root.baseline > 0:
        return False
    if not math.isfinite(value):
        return True
    factor = 1 + threshold
    return value > root.baseline * factor or value < root.baseline / factor


def escalation_links(run: Run) -> list[IncidentLink]:
    """Every incident of ``run`` linked to the steps traced after it (``on_anomaly="trace"``)."""
    links = EscalationLinks(run)
    if not links.tracing:
        return []
    for rank in run.ranks:
        for step in run.steps_of(rank):
            marker = run.step_info(step, rank).manifest.get(ESCALATED_KEY)
            first, has_stats, parameters = None, False, []
            if marker is not None:
                stats = run.output_stats(step, rank)
                has_stats = stats is not None and len(stats[0]) > 0
                first = run.first_nonfinite(step, rank) if has_stats else None
                found = run.nonfinite_parameters(step, rank)
                parameters = [] if found is None else found.describe()
            links.add(step, rank, run.anomalies_of(step, rank), first, has_stats, parameters)
    return links.links()
