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

This module is the plug-in, the step's life cycle; its parts: ``hooks`` (capture), ``series``
(rows and derived series), ``reduction`` (across ranks), ``step`` (resolve and write).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import probe.modes.monitor.distribution as monitor_distribution
from probe.errors import ProbeError, warn_once
from probe.local_part import local_part, replicas
from probe.modes.base import Incident, SessionPlugin, TraceRequest
from probe.modes.monitor.anomaly import Anomaly, AnomalyDetector, Series, anomaly_json
from probe.modes.monitor.file_names import MONITOR_FILE
from probe.modes.monitor.files import MonitorFiles
from probe.modes.monitor.hooks import OptimizerHooks, install_module_hooks, named_modules, named_parameters
from probe.modes.monitor.options import Monitor
from probe.modes.monitor.records import LOSS_SCALE, LOSS_SCALE_SKIPPED, SCALER_SERIES
from probe.modes.monitor.reduction import start_reduction
from probe.modes.monitor.series import SeriesRows, copy_scale, loss_scale_series
from probe.modes.monitor.step import MonitorStep, WriteSide, csv_line
from probe.modes.registry import register_mode
from probe.modes.sinks import SinkKind
from probe.modes.statistics.capture import StepRows
from probe.modes.statistics.columns import MONITOR_COLUMNS
from probe.modes.statistics.reduce import TensorStats, adam_update_row
from probe.rundir import layout
from probe.tracer.mode_stack import untraced
from probe.tracer.module_tracker import parallel_layout

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


METRIC_COLUMNS = MONITOR_COLUMNS
"""The columns of ``monitor.csv`` (the statistics engine's names)."""


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
        self._sink = WriteSide(self.detector, self.config.metrics)
        self.rank = 0
        self.step = 0
        self.collecting = False
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
        self._optimizer = OptimizerHooks(self)
        self._pending_stop: list[Anomaly] = []
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
        matched, handles = install_module_hooks(self, model)
        self._handles += handles
        params = self._optimizer.params = {id(p): name for name, p in named_parameters(model)}
        # msprobe's targets may name a parameter ("embedding.word_embeddings.weight": {}): its
        # series are the parameter kinds, which cover every parameter the optimizer steps.
        named_params = any(t.matches(name) for t in self.config.targets for name in params.values())
        if not matched and not named_params:
            patterns = [t.pattern for t in self.config.targets]
            names = [n for n, _ in named_modules(model)][:12]
            raise ProbeError(f"monitor option 'targets': {patterns} match no module or parameter; "
                             f"modules are named like {names}")
        config = self.config
        if (config.wg_distribution or config.param_distribution or config.mv_distribution
                or config.ur_distribution):
            self._handles += self._optimizer.install()
        # Opened now, at the session's start, not within a step.
        self._sink.sinks = [kind.open(layout.rank_dir(out, rank) / kind.name) for kind in self._sink_kinds()]

    def begin_step(self, step: int) -> None:
        self.step = step
        self.collecting = self.config.collects(step)
        self._optimizer.begin_step()
        self._scale_at_start = copy_scale(self.config.scaler) if self.collecting else None

    def pause(self) -> None:
        # The hooks stay installed; they check collecting (evaluation forwards pass unseen).
        self._collecting_before_pause, self.collecting = self.collecting, False

    def resume(self) -> None:
        self.collecting = self._collecting_before_pause

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
            line = csv_line(series, row[0].tolist())
            text = path.read_text()
            partial = path.with_suffix(".partial")
            partial.write_text(text + ("" if text.endswith("\n") else "\n") + line + "\n")
            partial.replace(path)  # never half-written
        self._sink.write_scalars(step, [series], row)

    def end_step(self, step: int) -> MonitorStep | None:
        alone, self._alone = self._alone, False
        if self.collecting:
            self._record_loss_scale()
        with self._lock:
            rows = self._rows
            if not len(rows) and not self.collecting:
                return None
            with torch.no_grad(), untraced():
                pending = self._engine.end_step()  # what the hooks queued, reduced on the training thread
            self._rows = self._new_rows()
            distribution, self._distribution = self._distribution, self._new_distribution()
        # On the training thread, where the model's collectives are issued: the writer thread
        # issuing its own would interleave with them differently on each rank.
        reduction = start_reduction(pending, rows.replicas) if self.config.reduce_ranks and not alone \
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

    def record(self, kind: str, name: str, slot: str, call: int, tensor: torch.Tensor) -> None:
        """Queue ``tensor``'s statistics as the series (kind, name, slot, call) of the step."""
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

    def record_adam_update(self, name: str, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """Queue Adam's update of parameter ``name``; False when ``state`` is not Adam's."""
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

    def _record_loss_scale(self) -> None:
        """The series ``loss_scale/scaler`` and ``loss_scale_skipped/scaler`` of the step
        (``series.loss_scale_series``)."""
        in_force, self._scale_at_start = self._scale_at_start, None
        values = loss_scale_series(self.config.scaler, in_force)
        if values is not None:
            self.record(LOSS_SCALE, SCALER_SERIES, "", 0, values[0])
            self.record(LOSS_SCALE_SKIPPED, SCALER_SERIES, "", 0, values[1])

    def flush(self) -> None:
        """Reduce the queued tensors now (the optimizer changes its gradients, weights and moments
        in place)."""
        with self._lock, torch.no_grad(), untraced():
            self._engine.flush()

    # -- step end ----------------------------------------------------------------

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
