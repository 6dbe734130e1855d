"""Mode ``"monitor"``: the always-on training-state monitor.

Unlike the per-op modes it needs no dispatch mode: it watches module
boundaries and the optimizer step through hooks, so a step costs a queued
reference per monitored tensor, reduced later in batches, and nothing per op
(when it is the only mode the session does not trace ops at all). Per collected
step it reduces, on the device and without a host sync (the statistics engine,
``probe.modes.statistics``, the stats mode's too):

- activations: the ``input`` / ``output`` of each target module (forward hooks)
  and their gradients ``input_grad`` / ``output_grad`` (tensor hooks on the
  same tensors), per module call; checkpoint recompute is skipped;
- with ``wg_distribution``: weight gradients, as the optimizer sees them (after
  any clipping and data-parallel reduction), at the optimizer's step pre-hook, or
  with ``optimizer.step(closure)`` when the closure (forward, backward) returns;
- with ``param_distribution``: weights after the update; ``mv_distribution``:
  Adam's moments ``exp_avg`` / ``exp_avg_sq``; ``ur_distribution``: the norm of
  Adam's update over the norm of the weight;
- with ``scaler=`` (the loop's ``torch.amp.GradScaler``): the loss scale in force during
  the step, series ``loss_scale/scaler``, and ``loss_scale_skipped/scaler``: 1 when the
  scaler skipped the step (its gradients overflowed: its update lowered the scale), else
  0. GradScaler has no hooks, and a step it skips never calls the optimizer's: the scale
  tensor is copied on the device when the step begins (no host sync) and compared with the
  scale when it ends; in the step that creates the scale (its first ``scaler.scale(loss)``)
  the scale in force was its ``init_scale``. In a skipped step the non-finite gradients
  (``*_grad`` slots, ``weight_grad``) are the overflow the scaler handled: no alert.

At ``session.step()`` the rows are stacked on the device and, with
``reduce_ranks=True``, their cross-rank reductions are started there, on the
training thread, in the same order on every rank as the model's own
collectives (asynchronous: only the series count is agreed before, one tiny
all-reduce; a step that ends by an exception, and the tail after the last
``step()``, are not reduced, as the other ranks may not join). The writer
thread waits for the reductions and moves the rows to the host once; then the
anomaly rules run (``probe.modes.monitor.anomaly``) and the step's ``monitor.csv``,
``anomalies.jsonl`` and TensorBoard scalars are written. With
``on_anomaly="dump"`` or ``"stop"`` that happens on the training thread at the
step's end instead (one synchronizing transfer per step), so the step's
tensors around an anomalous module can be saved, or training stopped by
:class:`probe.AnomalyStop` from ``session.step()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import probe.modes.monitor.distribution as monitor_distribution
from probe.errors import ProbeError, warn_once
from probe.local_part import local_part, replicas
from probe.modes.base import Incident, SessionPlugin, TraceRequest
from probe.modes.monitor.anomaly import (
    Anomaly,
    AnomalyDetector,
    Series,
    anomaly_json,
    incidents,
)
from probe.modes.monitor.config import Target, describe_value
from probe.modes.monitor.file_names import ANOMALIES_FILE, ANOMALY_TENSORS_FILE, MONITOR_FILE
from probe.modes.monitor.files import MonitorFiles
from probe.modes.monitor.options import Monitor
from probe.modes.registry import register_mode
from probe.modes.sinks import SeriesSink, SinkKind
from probe.modes.statistics.capture import PendingRows, StepRows
from probe.modes.statistics.columns import MONITOR_COLUMNS, RAW_COLUMNS, REPEATS, combine_ops
from probe.modes.statistics.finalize import finalize, whole
from probe.modes.statistics.reduce import TensorStats, adam_update_row
from probe.optimizer_steps import StepNesting, step_closure, with_closure
from probe.rundir import layout
from probe.rundir.writer import StepWriter
from probe.tracer.mode_stack import untraced
from probe.tracer.module_tracker import parallel_layout

log = logging.getLogger("probe.monitor")

TENSORBOARD_SINK = "tensorboard"
"""The live-output sink (``probe.modes.sinks``) the monitor writes its scalars and histograms to;
its files go in ``rank<R>/tensorboard/``."""


class AnomalyStop(RuntimeError):
    """Raised by ``session.step()`` when the monitor found anomalies and ``on_anomaly="stop"``."""

    def __init__(self, anomalies: list[Anomaly]) -> None:
        first = anomalies[0]
        super().__init__(f"monitor stopped training at step {first.step}: {len(anomalies)} anomal"
                         f"{'y' if len(anomalies) == 1 else 'ies'}, first {first.describe()}")
        self.anomalies = anomalies


def _named_modules(model: Any) -> Iterator[tuple[str, nn.Module]]:
    roots = model.items() if isinstance(model, dict) else [("", model)]
    for prefix, root in roots:
        for name, module in root.named_modules():
            yield (f"{prefix}.{name}" if prefix and name else prefix or name), module


def _named_parameters(model: Any) -> Iterator[tuple[str, nn.Parameter]]:
    roots = model.items() if isinstance(model, dict) else [("", model)]
    for prefix, root in roots:
        for name, param in root.named_parameters():
            yield (f"{prefix}.{name}" if prefix else name), param


def _in_backward() -> bool:
    """Forward hooks firing inside a graph task are checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


METRIC_COLUMNS = MONITOR_COLUMNS
"""The columns of ``monitor.csv`` (the statistics engine's names)."""
_COUNT_COLUMNS = [MONITOR_COLUMNS.index(c) for c in ("zeros", "nan", "inf", "posinf", "neginf")]
_MIN_COLUMNS, _MAX_COLUMNS, _SUM_COLUMNS = combine_ops()


@dataclass
class _Reduction:
    """A step's cross-rank reduction in flight: the collectives' buffers and their works, the
    raw columns combined as the statistics table says (``columns.RawColumn.combine``)."""

    extremes: torch.Tensor  # -x of the min columns, x of the max columns; all-reduced with MAX
    sums: torch.Tensor  # the summed columns and the element count, all-reduced with SUM
    works: list[Any]

    def result(self) -> torch.Tensor:
        """Wait for the collectives (on the writer thread); the reduced whole raw rows and counts."""
        for work in self.works:
            work.wait()
        n = len(_MIN_COLUMNS)
        out = torch.empty((self.sums.shape[0], len(RAW_COLUMNS) + 1), dtype=self.sums.dtype,
                          device=self.sums.device)
        out[:, _MIN_COLUMNS] = -self.extremes[:, :n]
        out[:, _MAX_COLUMNS] = self.extremes[:, n:]
        out[:, [*_SUM_COLUMNS, len(RAW_COLUMNS)]] = self.sums
        return out


class SeriesRows:
    """One step's series over the statistics engine's queue (row ``i`` is series ``i``), with
    the ranks holding each (``MonitorMode._replicas``) and, for ``on_anomaly="dump"``, its tensor."""

    def __init__(self, engine: StepRows, hold: bool) -> None:
        self.engine = engine
        self.series: list[Series] = []
        self.replicas: list[int] = []
        self.held: dict[int, torch.Tensor] | None = {} if hold else None

    def __len__(self) -> int:
        return len(self.series)

    def capture(self, series: Series, tensor: torch.Tensor, replicas: int) -> int:
        """Record ``tensor``'s statistics as they are now (reduced now or in a later batch); its row.
        Run untraced and without autograd."""
        index = len(self.series)
        # Keyed by series: one changed in place after capture is reduced at capture from then on.
        row = self.engine.add(tensor.detach(), key=(series.kind, series.name, series.slot))
        assert row == index, "monitored tensors are floating-point: each has a row"
        self.series.append(series)
        self.replicas.append(replicas)
        if self.held is not None:
            self.held[index] = tensor
        self.engine.settle()  # a spent budget: the hook runs after the op returned
        return index

    def add_row(self, series: Series, row: torch.Tensor, numel: int, replicas: int) -> None:
        """A series whose raw row was computed already (Adam's update)."""
        self.engine.add_row(row, numel)
        self.series.append(series)
        self.replicas.append(replicas)


class _WriteSide:
    """What the monitor keeps across written steps: the anomaly detector's history and the open
    live-output sinks (``probe.modes.sinks``). Only the steps' writes touch it, one step at a
    time, in order."""

    def __init__(self, detector: AnomalyDetector, metrics: tuple[str, ...] | list[str]) -> None:
        self.detector, self.metrics = detector, metrics
        self.rank = 0
        self.sinks: list[SeriesSink] = []
        self._tag_cache: tuple[tuple[Series, ...], tuple[str, ...]] | None = None

    def write_scalars(self, step: int, series: list[Series], values: np.ndarray) -> None:
        """The step's scalars to each sink (``<kind>/<name>[/<slot>][#call]/<metric>``)."""
        if not self.sinks:
            return
        tags, columns = self._tags(series)
        grid = values[:, columns]
        if "id" in self.metrics:  # msprobe's identity metric: the value of a one-element tensor
            keep = np.ones(grid.shape, dtype=bool)
            keep[:, self.metrics.index("id")] = values[:, MONITOR_COLUMNS.index("numel")] == 1
            picked = np.flatnonzero(keep.ravel())
            tags, flat = [tags[i] for i in picked], grid.ravel()[picked]
        else:
            flat = grid.ravel()
        for sink in self.sinks:
            sink.add_scalars(step, tags, flat)
            sink.flush()

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def _tags(self, series: list[Series]) -> tuple[tuple[str, ...], list[int]]:
        """Every series' tags, metric after metric, and the value columns they take (cached: the
        same series come step after step, and the same tag objects let the writer reuse its bytes)."""
        key = tuple(series)
        if self._tag_cache is None or self._tag_cache[0] != key:
            tags = []
            for s in series:
                tags.extend(f"{s.tag}/{metric}" for metric in self.metrics)
            self._tag_cache = (key, tuple(tags))
        columns = [MONITOR_COLUMNS.index("mean" if m == "id" else m) for m in self.metrics]
        return self._tag_cache[1], columns


def _csv_line(series: Series, values: list[float]) -> str:
    """A series' row of ``monitor.csv``."""
    return f"{series.kind},{series.name},{series.slot},{series.call}," + ",".join(map(repr, values))


class MonitorStep:
    """A collected step: resolved (moved to the host, scanned) once, then written.

    Holds plain data: the rows (on their device), the cross-rank reduction in flight if
    any, and the monitor's write side; nothing of the mode's per-step state."""

    distribution: monitor_distribution.PendingDistribution | None = None
    """With ``distribution=``/``histogram=``: the step's distribution rows (not reduced over ranks)."""

    def __init__(self, step: int, rows: SeriesRows, pending: PendingRows, reduction: _Reduction | None,
                 sink: _WriteSide) -> None:
        self.step, self._rows, self._pending = step, rows, pending
        self._reduction, self._sink = reduction, sink
        self.values: np.ndarray | None = None
        self.anomalies: list[Anomaly] = []
        self.dumped: dict[str, torch.Tensor] = {}

    def resolve(self) -> None:
        if self.values is not None:
            return
        rows = self._rows
        if self._reduction is not None:
            host = self._reduction.result().cpu().numpy()
            raw, numel = host[:, :-1], host[:, -1]
        else:
            raw, numel = whole(*self._pending.to_host())  # the step's one transfer
        self.values = finalize(raw, numel, MONITOR_COLUMNS)
        lost = self._pending.lost()
        if lost:  # changed in place before it was reduced: unknown, no NaN or Inf counted (no alert)
            self.values[np.ix_(lost, _COUNT_COLUMNS)] = 0
        self._add_update_ratios()
        self.anomalies = self._sink.detector.scan(self.step, self._sink.rank, rows.series, self.values,
                                                  handled=_overflow_handled(rows.series, self.values))
        if rows.held is not None and self.anomalies:
            flagged = {(a.kind, a.module, a.call) for a in self.anomalies}
            for index, tensor in rows.held.items():
                s = rows.series[index]
                if (s.kind, s.name, s.call) in flagged:
                    self.dumped[f"{s.name}[{s.call}].{s.slot or s.kind}"] = tensor.detach().cpu().contiguous()
        rows.held = None  # the tensors go now, not with the step's files

    def _add_update_ratios(self) -> None:
        """``update_ratio`` series: the norm of Adam's update over the norm of the weight."""
        assert self.values is not None
        series = self._rows.series
        norm = MONITOR_COLUMNS.index("norm")
        weights = {s.name: self.values[i, norm] for i, s in enumerate(series) if s.kind == "weight"}
        extra = []
        for i, s in enumerate(series):
            if s.kind == "update" and s.name in weights:
                row = np.full(len(MONITOR_COLUMNS), np.nan)
                row[norm] = self.values[i, norm] / weights[s.name] if weights[s.name] else np.inf
                row[_COUNT_COLUMNS[1:]] = 0  # NaN, Inf, +Inf, -Inf: none (zeros: not a tensor's)
                row[MONITOR_COLUMNS.index("numel")] = 1
                extra.append((Series("update_ratio", s.name), row))
        if extra:
            series.extend(s for s, _ in extra)
            self.values = np.vstack([self.values, np.stack([row for _, row in extra])])

    def write(self, writer: StepWriter) -> dict[str, Any]:
        self.resolve()
        assert self.values is not None
        series, values = self._rows.series, self.values
        lines = ["kind,name,slot,call," + ",".join(MONITOR_COLUMNS)]
        for s, row in zip(series, values.tolist(), strict=True):
            lines.append(_csv_line(s, row))
        writer.write_text(MONITOR_FILE, "\n".join(lines) + "\n")
        writer.write_jsonl(ANOMALIES_FILE, (anomaly_json(a) for a in self.anomalies))
        if self.dumped:
            from safetensors.torch import save

            writer.write_bytes(ANOMALY_TENSORS_FILE, save(self.dumped))
        # One line per incident (a gradient explosion is dozens of alerts); the rest at INFO.
        for incident in incidents(self.anomalies):
            if incident.first_step == self.step:
                log.warning("probe monitor: %s", incident.describe())
            else:
                log.info("probe monitor: %d more alert(s) at step %d in the incident of step %d",
                         incident.alerts, self.step, incident.first_step)
        self._sink.write_scalars(self.step, series, values)
        summary = {"series": len(series), "anomalies": len(self.anomalies), "dumped": len(self.dumped),
                   "reduced": self._reduction is not None}
        if self.distribution is not None:
            summary.update(monitor_distribution.write_step(writer, self.distribution, series,
                                                           self._sink.sinks, self.step))
        return summary


@register_mode
class MonitorMode(SessionPlugin):
    """Training-state statistics from module and optimizer hooks, with anomaly alerts (no per-op work)."""

    name = "monitor"
    config_class = Monitor
    files = MonitorFiles

    def trace_request(self) -> TraceRequest | None:
        """With ``on_anomaly="trace"``: the trace modes to turn on after each incident."""
        config = self.config
        if config.on_anomaly != "trace":
            return None
        threshold = None if config.turbulence is None else config.turbulence.threshold
        listeners: list[Callable[[Incident], None]] = []

        def report(found: list[Anomaly]) -> None:  # a scan's alerts, the first the incident's root
            root = found[0]
            if root.incident != root.step:
                return  # alerts joining an incident going on arm nothing new
            record = {**anomaly_json(root), "threshold": threshold if root.rule == "turbulence" else None}
            for listener in listeners:
                listener(Incident(root.step, record))

        self.detector.listeners.append(report)
        return TraceRequest(config.trace_modes, dict(config.trace_options), config.trace_steps,
                            config.trace_limit, listeners)

    @property
    def collective_each_step(self) -> bool:
        return self.config.reduce_ranks

    def __init__(self, config: Monitor) -> None:
        if config.targets is None:
            raise ProbeError("the monitor mode needs option 'targets': {module glob: {slot: spec}} "
                             "or a list of globs (or the session option modules=)")
        super().__init__(config)
        self.config: Monitor = config
        self.detector = AnomalyDetector(self.config)
        self._sink = _WriteSide(self.detector, self.config.metrics)
        self.rank = 0
        self.step = 0
        self._collecting = False
        self._collecting_before_pause = False
        self._alone = False
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        # Staged chunks are reduced on the host: rows reduced over ranks stay on the device.
        self._engine = StepRows(TensorStats(), stage=not self.config.reduce_ranks, saturation=False,
                                queue=True, eps=self.config.eps, on_changed=self._changed_in_place)
        self._engine.learning = True  # the first collected step: see statistics.capture
        self._rows = self._new_rows()
        self._distribution = self._new_distribution()
        self._params: dict[int, str] = {}
        self._pending_stop: list[Anomaly] = []
        self._closure_unread: set[int] = set()
        """Optimizers (ids) in a step whose closure has not run yet (weight grads not read)."""
        self._nesting = StepNesting()
        self._scale_at_start: torch.Tensor | None = None
        """A copy of the loss scaler's scale taken when the step began (``scaler=``)."""
        self._ddp_replicas = 1
        """Ranks holding each parameter, gradient and moment whole: the world under DDP, else 1."""

    # -- session ---------------------------------------------------------------

    def attach(self, model: Any, out: Path, rank: int) -> None:
        if model is None:
            raise ProbeError("the monitor mode needs model= (the module whose named_modules() the "
                             "targets name)")
        self.rank = self._sink.rank = rank
        roots = model.values() if isinstance(model, dict) else [model]
        if any(parallel_layout(root) == "replicated" for root in roots):
            import torch.distributed as dist

            self._ddp_replicas = dist.get_world_size() if dist.is_initialized() else 1
        matched = self._install_module_hooks(model)
        self._params = {id(p): name for name, p in _named_parameters(model)}
        # msprobe's targets may name a parameter ("embedding.word_embeddings.weight": {}): its
        # series are the parameter kinds, which cover every parameter the optimizer steps.
        named_params = any(t.matches(name) for t in self.config.targets for name in self._params.values())
        if not matched and not named_params:
            patterns = [t.pattern for t in self.config.targets]
            names = [n for n, _ in _named_modules(model)][:12]
            raise ProbeError(f"monitor option 'targets': {patterns} match no module or parameter; "
                             f"modules are named like {names}")
        config = self.config
        if (config.wg_distribution or config.param_distribution or config.mv_distribution
                or config.ur_distribution):
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer_step))
            self._handles.append(register_optimizer_step_post_hook(self._after_optimizer_step))
        # Opened now, at the session's start, not within a step.
        self._sink.sinks = [kind.open(layout.rank_dir(out, rank) / kind.name) for kind in self._sink_kinds()]

    def begin_step(self, step: int) -> None:
        self.step = step
        self._collecting = self.config.collects(step)
        # A step that raised inside optimizer.step never ran its post-hooks: start afresh.
        self._nesting.reset()
        self._closure_unread.clear()
        self._scale_at_start = self._copy_scale() if self._collecting else None

    def pause(self) -> None:
        # The hooks stay installed; they check _collecting (evaluation forwards pass unseen).
        self._collecting_before_pause, self._collecting = self._collecting, False

    def resume(self) -> None:
        self._collecting = self._collecting_before_pause

    def ending_alone(self) -> None:
        self._alone = True

    def rewound(self, out: Path, step: int, verdict: str) -> None:
        """A rewind's verdict on ``step``, known after the step was written (``probe.rewind``): the
        series ``rewind/<verdict>`` (value 1, a one-element series like ``loss_scale_skipped``) is
        added to that step's ``monitor.csv`` and written to the sinks at that step."""
        series = Series("rewind", verdict)
        one = {"min": 1.0, "max": 1.0, "mean": 1.0, "norm": 1.0, "numel": 1.0}  # the counts: 0
        row = np.array([[one.get(column, 0.0) for column in MONITOR_COLUMNS]])
        path = layout.step_dir(out, self.rank, step) / MONITOR_FILE
        if path.is_file():
            line = _csv_line(series, row[0].tolist())
            text = path.read_text()
            partial = path.with_suffix(".partial")
            partial.write_text(text + ("" if text.endswith("\n") else "\n") + line + "\n")
            partial.replace(path)  # never half-written
        self._sink.write_scalars(step, [series], row)

    def end_step(self, step: int) -> MonitorStep | None:
        alone, self._alone = self._alone, False
        if self._collecting:
            self._record_loss_scale()
        with self._lock:
            rows = self._rows
            if not len(rows) and not self._collecting:
                return None
            with torch.no_grad(), untraced():
                pending = self._engine.end_step()  # what the hooks queued, reduced on the training thread
            self._rows = self._new_rows()
            distribution, self._distribution = self._distribution, self._new_distribution()
        # On the training thread, where the model's collectives are issued: the writer thread
        # issuing its own would interleave with them differently on each rank.
        reduction = self._start_reduction(pending, rows.replicas) if self.config.reduce_ranks and not alone \
            else None
        result = MonitorStep(step, rows, pending, reduction, self._sink)
        if distribution is not None:
            with torch.no_grad(), untraced():
                result.distribution = distribution.end_step()
        if self.config.on_anomaly in ("dump", "stop"):
            result.resolve()  # now, on the training thread: the tensors are still here
            if self.config.on_anomaly == "stop" and result.anomalies:
                self._pending_stop = result.anomalies
        return result

    def has_pending(self) -> bool:
        return len(self._rows) > 0

    def after_step(self) -> None:
        if self._pending_stop:
            anomalies, self._pending_stop = self._pending_stop, []
            raise AnomalyStop(anomalies)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._sink.close()

    # -- collection ------------------------------------------------------------

    def _new_distribution(self) -> monitor_distribution.SeriesDistribution | None:
        config = self.config
        if not (config.distribution or config.histogram):
            return None
        return monitor_distribution.SeriesDistribution(config.histogram)

    def _new_rows(self) -> SeriesRows:
        return SeriesRows(self._engine, hold=self.config.on_anomaly == "dump")

    def _changed_in_place(self, rows: list[int]) -> None:
        for row in rows:
            s = self._rows.series[row]
            warn_once(f"monitor-inplace:{s.kind}:{s.name}:{s.slot}",
                      f"monitor: {s.kind} {s.name} {s.slot} was changed in place after its hook saw it, "
                      "before the monitor reduced it; its statistics at this step are unknown (NaN) and "
                      "it is reduced at capture from now on")

    def _record(self, kind: str, name: str, slot: str, call: int, tensor: torch.Tensor) -> None:
        held_by = self._replicas(kind, tensor)
        tensor = local_part(tensor)
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return
        with self._lock, torch.no_grad(), untraced():  # a queued reference, most steps: no op issued
            if self._distribution is not None:  # opt-in: counted now, on the device
                self._distribution.capture(len(self._rows), tensor)
            self._rows.capture(Series(kind, name, slot, call), tensor, held_by)

    def _replicas(self, kind: str, tensor: torch.Tensor) -> int:
        """How many ranks hold each element of ``tensor``: a DTensor's replicated mesh
        dimensions (HSDP's replicate dimension; 1 for FSDP2's shards), every rank for a
        parameter's gradient, value or optimizer state under DDP, else 1. Summed over ranks
        (``reduce_ranks``) such a tensor would count each element that many times (its norm
        sqrt(replicas) times too large): its sums are divided by it instead."""
        count = replicas(tensor)
        if count is not None:
            return count
        return 1 if kind == "activation" else self._ddp_replicas

    def _record_adam_update(self, name: str, group: dict[str, Any], state: dict[str, Any]) -> bool:
        m, v, step = state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")
        if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)) or step is None:
            return False
        held_by = self._replicas("update", m)
        m, v = local_part(m), local_part(v)
        if isinstance(step, torch.Tensor):
            step = local_part(step)
        beta1, beta2 = group["betas"]
        with torch.no_grad(), untraced():
            row, numel = adam_update_row(m, v, float(group["lr"]), beta1, beta2, group["eps"], step,
                                         self.config.eps)
        with self._lock, torch.no_grad(), untraced():
            self._rows.add_row(Series("update", name), row, numel, held_by)
        return True

    def _copy_scale(self) -> torch.Tensor | None:
        """A device copy of the loss scaler's scale (no host sync); None without an enabled
        scaler, or before its first ``scale()`` (the scale does not exist yet)."""
        scaler = self.config.scaler
        if scaler is None or not scaler.is_enabled():
            return None
        # The scale tensor itself: get_scale() would read it to the host, a sync every step.
        scale = scaler._get_scale_async()
        if scale is None:
            return None
        with torch.no_grad(), untraced():
            return scale.detach().clone()

    def _record_loss_scale(self) -> None:
        """The series ``loss_scale/scaler``, the scale in force during the step (the scaler's
        update at the step's end changed the tensor in place: the copy from its start is used),
        and ``loss_scale_skipped/scaler``: whether that update lowered it, which GradScaler does
        exactly when the step's gradients overflowed and it skipped the optimizer step."""
        in_force, self._scale_at_start = self._scale_at_start, None
        scaler = self.config.scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale = scaler._get_scale_async()
        if scale is None:  # no loss scaled yet
            return
        with torch.no_grad(), untraced():
            if in_force is None:  # created in this step, at its initial value
                in_force = torch.full((), float(scaler._init_scale), dtype=scale.dtype, device=scale.device)
            skipped = (scale < in_force).to(scale.dtype)
        self._record("loss_scale", "scaler", "", 0, in_force)
        self._record("loss_scale_skipped", "scaler", "", 0, skipped)

    def _flush(self) -> None:
        """Reduce the queued tensors now (the optimizer changes its gradients, weights and moments
        in place)."""
        with self._lock, torch.no_grad(), untraced():
            self._engine.flush()

    def _install_module_hooks(self, model: Any) -> int:
        matched = 0
        for fqn, module in _named_modules(model):
            slots: dict[str, Any] = {}
            for target in self.config.targets:
                if target.matches(fqn):
                    slots.update(target.slots)
            if not slots:
                continue
            matched += 1
            watcher = _ModuleWatcher(self, fqn, Target(fqn, slots))
            self._handles.append(module.register_forward_pre_hook(watcher.before))
            self._handles.append(module.register_forward_hook(watcher.after))
        return matched

    def _parameters(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self._params.get(id(param))
                if name is not None:
                    yield name, param

    def _record_weight_grads(self, optimizer: torch.optim.Optimizer, call: int) -> None:
        for name, param in self._parameters(optimizer):
            if param.grad is not None:
                self._record("weight_grad", name, "", call, param.grad)
        self._flush()

    def _before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        outermost = self._nesting.enter(optimizer)  # super().step() runs the hooks again
        if not outermost or not self._collecting or not self.config.wg_distribution:
            return None
        closure = step_closure(args, kwargs)
        if closure is None:
            self._record_weight_grads(optimizer, 0)
            return None
        # optimizer.step(closure) (LBFGS, Lightning's automatic optimization): the closure's
        # backward makes the gradients the update uses, so they are read when it returns (the
        # grads here are the previous step's, or none). Each evaluation is a call of the series.
        calls = 0
        self._closure_unread.add(id(optimizer))

        def closure_then_grads() -> Any:
            nonlocal calls
            result = closure()
            self._closure_unread.discard(id(optimizer))
            if self._collecting:
                self._record_weight_grads(optimizer, calls)
            calls += 1
            return result

        return with_closure(args, kwargs, closure_then_grads)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._nesting.exit(optimizer):
            return
        if id(optimizer) in self._closure_unread:
            # A step given a closure it never called: its gradients are those it was given.
            self._closure_unread.discard(id(optimizer))
            if self._collecting:
                self._record_weight_grads(optimizer, 0)
        if not self._collecting:
            return
        config = self.config
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self._params.get(id(param))
                if name is None:
                    continue
                if config.param_distribution:
                    self._record("weight", name, "", 0, param)
                state = optimizer.state.get(param, {})
                if config.mv_distribution:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if isinstance(state.get(key), torch.Tensor):
                            self._record(key, name, "", 0, state[key])
                if config.ur_distribution:
                    if not self._record_adam_update(name, group, state):
                        warn_once("monitor-ur", "monitor: ur_distribution needs Adam-family optimizer state "
                                  f"(exp_avg, exp_avg_sq, step); {type(optimizer).__name__} has none")
                        continue
                    if not config.param_distribution:  # the ratio's denominator
                        self._record("weight", name, "", 0, param)
        self._flush()

    # -- step end ----------------------------------------------------------------

    def _start_reduction(self, pending: PendingRows, replicas: list[int]) -> _Reduction | None:
        """Start the element-wise reduction over ranks, each raw column as the statistics table
        combines it (min of mins, max of maxes, sums of the rest, element counts included so the
        mean is over every rank's elements)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            warn_once("monitor-reduce", "monitor: reduce_ranks=True without an initialized process group; "
                      "each rank writes its own values")
            return None
        with torch.no_grad(), untraced():
            if len(pending):
                raw = pending.on_device()
                numel, multiplicity = pending.counts()
                m = torch.tensor(multiplicity, dtype=torch.float64, device=raw.device)
                repeats = torch.tensor(REPEATS, device=raw.device)
                raw = torch.where(repeats[None, :], raw * m[:, None], raw)  # whole tensors (columns.whole)
                counts = torch.tensor(numel, dtype=torch.float64, device=raw.device) * m
                stacked = torch.cat([raw, counts[:, None]], dim=1)
            else:
                stacked = torch.zeros((0, len(RAW_COLUMNS) + 1), dtype=torch.float64)
            # Collectives of different sizes would mismatch (a hang or garbage): agree on the
            # series count first. The one wait here, on a tiny tensor (on the CPU when the
            # process group can reduce there).
            n = stacked.shape[0]
            count_device = "cpu" if "gloo" in str(dist.get_backend()) else stacked.device
            agreed = torch.tensor([n, -n], dtype=torch.float64, device=count_device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            if agreed[0] != -agreed[1]:
                raise ProbeError("monitor reduce_ranks: ranks collected different numbers of series this "
                                 f"step ({int(-agreed[1])} to {int(agreed[0])}); monitor the same modules on "
                                 "every rank")
            extremes = torch.cat([-stacked[:, _MIN_COLUMNS], stacked[:, _MAX_COLUMNS]], dim=1)
            sums = stacked[:, [*_SUM_COLUMNS, len(RAW_COLUMNS)]]
            if any(r > 1 for r in replicas):  # held by several ranks: count each element once
                sums /= torch.tensor(replicas, dtype=sums.dtype, device=sums.device)[:, None]
            if n == 0:  # every rank has nothing: no buffers to reduce
                return _Reduction(extremes, sums, [])
            works = [dist.all_reduce(extremes, op=dist.ReduceOp.MAX, async_op=True),
                     dist.all_reduce(sums, op=dist.ReduceOp.SUM, async_op=True)]
        return _Reduction(extremes, sums, works)

    def _sink_kinds(self) -> list[SinkKind]:
        """The offered sinks this monitor writes to: TensorBoard where its package is installed
        (``tensorboard=None``), required (``True``) or not at all (``False``)."""
        if self.config.tensorboard is False:
            return []
        kind = self.sinks.get(TENSORBOARD_SINK)
        if kind is not None and kind.available():
            return [kind]
        if self.config.tensorboard:
            missing = "no TensorBoard sink is offered here" if kind is None else \
                f"the {kind.reader_package!r} package is not installed"
            raise ProbeError(f"monitor option 'tensorboard'=True: {missing}; pip install 'probe[monitor]', "
                             "or pass tensorboard=None to write TensorBoard files only where it is")
        return []


def _is_gradient(series: Series) -> bool:
    return series.kind == "weight_grad" or (series.kind == "activation" and series.slot.endswith("_grad"))


def _overflow_handled(series: list[Series], values: np.ndarray) -> np.ndarray | None:
    """Per series, whether its non-finite values are an overflow the loss scaler handled: a
    gradient in a step the scaler skipped (``loss_scale_skipped`` is 1). None when it did not
    skip the step, or is not monitored."""
    mean = MONITOR_COLUMNS.index("mean")
    if not any(s.kind == "loss_scale_skipped" and values[i, mean] > 0 for i, s in enumerate(series)):
        return None
    return np.array([_is_gradient(s) for s in series], dtype=bool)


class _ModuleWatcher:
    """The hooks of one monitored module: its slots, and its call count this step."""

    def __init__(self, mode: MonitorMode, fqn: str, target: Target) -> None:
        self.mode, self.fqn, self.slots = mode, fqn, target.slots
        self.calls = 0
        self.step = -1
        config = mode.config
        self.forward = not config.backward_only
        self.backward = not config.forward_only

    def _call_index(self) -> int:
        if self.step != self.mode.step:
            self.step, self.calls = self.mode.step, 0
        index = self.calls
        self.calls += 1
        return index

    def _grad_hook(self, slot: str, call: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad is not None:
                self.mode._record("activation", self.fqn, slot, call, grad)

        return hook

    def before(self, module: nn.Module, args: tuple) -> None:
        if not self.mode._collecting or not self.mode.config.xy_distribution or _in_backward():
            return
        self._current = self._call_index()
        self._capture(args, "input")

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.mode._collecting or not self.mode.config.xy_distribution or _in_backward():
            return
        self._capture(output, "output")

    def _capture(self, value: Any, slot: str) -> None:
        """Record the ``slot`` ("input"/"output") tensor now and hook its gradient for ``slot_grad``
        (the gradient tuple autograd passes matches the value element for element)."""
        if slot == "input" and isinstance(value, tuple) and not value:
            # Called with keyword arguments only (an HF model's input_ids=...): nothing passed
            # positionally, so nothing to monitor and no spec that misfits.
            return
        spec = self.slots.get(slot)
        if spec is not None and self.forward:
            t = spec.select(value)
            if t is not None:
                self.mode._record("activation", self.fqn, slot, self._current, t)
            else:
                self._unmatched(slot, spec, value)
        grad_slot = f"{slot}_grad"
        spec = self.slots.get(grad_slot)
        if spec is not None and self.backward:
            t = spec.select(value)
            if t is None:
                self._unmatched(grad_slot, spec, value)
            elif t.requires_grad:
                t.register_hook(self._grad_hook(grad_slot, self._current))

    def _unmatched(self, slot: str, spec: Any, value: Any) -> None:
        """A spec that does not fit what the module passes gives no series: said once, never silent
        (raising here would stop the user's training step)."""
        grad = " (its gradient tuple matches it element for element)" if slot.endswith("_grad") else ""
        forward = slot.removesuffix("_grad")
        warn_once(f"monitor-spec:{slot}:{spec}",  # once per slot and spec: "*" targets many modules
                  f"monitor target {self.fqn!r} {slot}: {str(spec)!r} does not fit its {forward}, "
                  f"{describe_value(value)}{grad}, so it has no {slot} series; give a spec that selects a "
                  "tensor ('tensor', 'tuple[N]:i')")

