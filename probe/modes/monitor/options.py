"""The config of the monitor mode: ``probe.mode(probe.Monitor(targets=...), ...)``.

Its options are msprobe's monitor keys (``metrics`` for msprobe's ``ops``, which is the session's
op filter here); ``probe.modes.monitor.config`` reads msprobe's monitor ``config.json`` into one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError
from probe.modes.config import ModeConfig
from probe.modes.monitor.config import (
    METRICS,
    ON_ANOMALY,
    TRACE_KEYS,
    TRACE_MODES,
    Target,
    TurbulenceRule,
    parse_alert,
    parse_metrics,
    parse_scaler,
    parse_targets,
    parse_trace_modes,
)
from probe.vocabulary.option_fields import Check, boolean, choice, integer, number, option
from probe.vocabulary.option_values import show


def _module_ranks(option_name: str, value: Any) -> None:
    # Which ranks record is the session's choice, made before the mode exists.
    raise ProbeError(f"monitor option 'module_ranks' ({show(value)}) is the msprobe config-file key; "
                     "given directly, use the session option ranks= (e.g. ranks=[0])")


def _anomaly_rules(option_name: str, value: Any) -> tuple[Callable[..., Any], ...]:
    rules = [value] if callable(value) else value
    if not isinstance(rules, (list, tuple)) or not all(callable(r) for r in rules):
        raise ProbeError(f"monitor option 'anomaly_rules': expected callables, got {show(rules)}")
    return tuple(rules)


def _trace_options(option_name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ProbeError("monitor option 'trace_options': expected a dict of the trace modes' options "
                         f"(e.g. {{'inputs': True}}), got {show(value)}")
    return dict(value)


def _flag(doc: str, default: bool = False) -> Any:
    return option(default, check=boolean(), doc=doc)


@dataclass(frozen=True, kw_only=True, eq=False)
class Monitor(ModeConfig):
    """Training-state statistics of chosen modules, from hooks, with anomaly alerts."""

    mode = "monitor"

    targets: tuple[Target, ...] | None = option(
        None, check=Check(lambda option_name, value: parse_targets(value),
                          "`{module glob: {slot: spec}}` or a list of globs"),
        doc="modules watched and their slots (input, output, input_grad, output_grad); needed "
            "unless `modules=` is given")
    module_ranks: None = option(None, check=Check(_module_ranks, "only in an msprobe monitor config"),
                                doc="msprobe's key; given directly, use `ranks=`")
    xy_distribution: bool = _flag("activations and their gradients of the targets", default=True)
    wg_distribution: bool = _flag("weight gradients, as the optimizer sees them")
    mv_distribution: bool = _flag("Adam's moments `exp_avg`, `exp_avg_sq`")
    param_distribution: bool = _flag("weights after the update")
    ur_distribution: bool = _flag("Adam's update over the weight (norm ratio)")
    forward_only: bool = _flag("activations only (not with `backward_only`)")
    backward_only: bool = _flag("activation gradients only (not with `forward_only`)")
    metrics: tuple[str, ...] = option(
        METRICS, check=Check(parse_metrics, f"a non-empty list from {list(METRICS)}"),
        doc="statistics of each series (msprobe's `ops`)")
    eps: float = option(1e-8, check=number(0.0), doc="added to the update ratio's denominator")
    start_step: int = option(0, check=integer(0), doc="the first step collected")
    step_interval: int = option(1, check=integer(1), doc="collect every this many steps")
    alert: tuple[TurbulenceRule | None, bool] = option(
        (TurbulenceRule(), True),
        check=Check(lambda option_name, value: parse_alert(value),
                    "msprobe's `{'rules': [...], 'dump': bool}`"),
        doc="anomaly rules: AnomalyTurbulence's args (threshold, warmup, decay, metrics, kinds), AnomalyNan")
    on_anomaly: str = option("log", check=choice(*ON_ANOMALY),
                             doc="after an anomaly: log it, dump the step's tensors around it, stop "
                                 "training, or trace per-op modes")
    anomaly_rules: tuple[Callable[..., Any], ...] = option(
        (), check=Check(_anomaly_rules, "a callable or a list of them"), doc="your own anomaly rules")
    reduce_ranks: bool = _flag("reduce each series over the ranks (a collective each step)")
    tensorboard: bool | None = option(None, check=boolean(),
                                      doc="write TensorBoard scalars (`None`: when installed)")
    trace_modes: tuple[str, ...] = option(
        ("stats",), check=Check(lambda option_name, value: parse_trace_modes(value),
                                f"a non-empty list from {list(TRACE_MODES)}"),
        doc="with `on_anomaly='trace'`: the per-op modes armed")
    trace_options: Mapping[str, Any] = option(
        default_factory=dict, check=Check(_trace_options, "a dict of the trace modes' options"),
        doc="with `on_anomaly='trace'`: their options")
    trace_steps: int = option(2, check=integer(1), doc="with `on_anomaly='trace'`: steps each window traces")
    trace_limit: int | None = option(5, check=integer(1, none=True),
                                     doc="with `on_anomaly='trace'`: the most windows a session traces")
    distribution: bool = _flag("per series: shares of zeros, underflow and near-overflow of its dtype")
    histogram: bool = _flag("per series: a log2-magnitude histogram (and the shares), TensorBoard too")
    scaler: Any = option(None, check=Check(lambda option_name, value: parse_scaler(value),
                                           "a `torch.amp.GradScaler`, `None`"),
                         doc="the loop's GradScaler: its scale becomes the series `loss_scale/scaler`")

    def validate(self) -> None:
        traced = [key for key in TRACE_KEYS if key in self.options]
        if traced and self.on_anomaly != "trace":
            # Given with another policy they would silently do nothing.
            raise ProbeError(f"monitor option {traced[0]!r} arms per-op tracing after an anomaly, which "
                             f"needs on_anomaly='trace'; on_anomaly is {self.on_anomaly!r}")
        if self.forward_only and self.backward_only:
            raise ProbeError("monitor options 'forward_only' and 'backward_only' exclude each other")

    def completed(self, common: Any) -> Monitor:
        # API.md: modules= serves as the monitor's targets when targets is absent.
        if "targets" not in self.options and common.modules.globs is not None:
            return self.with_options(targets=list(common.modules.globs))  # type: ignore[return-value]
        return self

    @property
    def turbulence(self) -> TurbulenceRule | None:
        """The running-average rule in force (None: turned off by an ``alert`` without it)."""
        return self.alert[0]

    @property
    def nonfinite(self) -> bool:
        """Whether NaN/Inf values raise alerts."""
        return self.alert[1]

    def collects(self, step: int) -> bool:
        """Whether ``step`` is collected (``start_step``, ``step_interval``)."""
        return step >= self.start_step and (step - self.start_step) % self.step_interval == 0
