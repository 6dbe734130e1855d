"""The monitor's configuration: msprobe's monitor ``config.json`` form, validated.

msprobe users write::

    {"targets": {"language_model.encoder.layers.0": {
         "input": "tuple[2]:0", "output": "tensor", "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}},
     "module_ranks": "0", "xy_distribution": true, "wg_distribution": true, "mv_distribution": true,
     "ops": ["min", "max", "norm", "zeros", "nans"], "eps": 1e-8, "start_step": 0, "step_interval": 1,
     "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}

The same keys are ``probe.mode("monitor", ...)`` options (``ops``, which is the
session's op filter, is spelled ``metrics`` there), and a file of this form is
accepted as ``config=``. Target names may be globs over module names
(``"layers.*"``) or parameter names. A slot spec is ``"tensor"`` (the value itself)
or ``"tuple[N]:i"`` (element ``i`` of an N-tuple; ``"tuple[N]"`` is element 0); a
module's input is the tuple of its positional arguments, its output a tensor (a
1-tuple to a ``tuple`` spec) or a tuple (a Hugging Face ``ModelOutput`` is its ``to_tuple()``,
and ``"tensor"`` its first field), and ``input_grad`` / ``output_grad`` are the
tuples autograd passes, element for element those of the input and output. A module called
with keyword arguments only (an HF model) has no input series, and no warning about it.

In a file of msprobe's form, an empty or absent ``targets`` watches every module
(msprobe's "full monitoring"), ``all_xy`` adds every module's four slots to the
targets, ``xy_distribution`` defaults to msprobe's false when no target names a slot,
and a disabled block (``"cc_distribution": {"enable": false}``) is accepted.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from probe.errors import ProbeError, warn_once
from probe.modes.config import CONFIG_FILE_FORMS, CONFIGS, ConfigFileForm, configs_for
from probe.modes.statistics.columns import LEGACY_NAMES
from probe.vocabulary.option_values import IntSet, parse_bool, parse_choice, parse_int, parse_number, show

SLOTS = ("input", "output", "input_grad", "output_grad")
ALERT_METRICS = ("min", "max", "mean", "norm", "zeros", "nan")
METRICS = (*ALERT_METRICS, "id")
"""What ``metrics`` (msprobe's ``ops``) may name; ``id`` is the value of a one-element tensor
(msprobe's identity metric, a loss or a scale), written for those series only."""
_MSPROBE_OPS_NOT_RECORDED = {
    "shape": "monitor.csv has each series' element count (numel), not its shape",
    "dtype": "monitor.csv does not record dtypes",
}
_SPEC = re.compile(r"tuple\[(\d{1,9})\](?::(\d{1,9}))?")

# msprobe monitor keys that change nothing here: a one-time notice each.
_IGNORED_KEYS = {
    "format": "probe writes CSV and TensorBoard event files both",
    "print_struct": "module names are in the run directory (modules.json)",
    "squash_name": "names are module FQNs as in model.named_modules()",
    "ndigits": "values are written at full precision",
    "collect_times": "use steps= or stop the session",
    "step_count_per_record": "every collected step is written",
    "stack_info": "use stack=True with the stats mode",
    "dynamic_on": "the session starts and stops where its with block does",
    "append_output": "each session writes its own run directory",
    "sa_order": "attention L2 features are not implemented",
}
_MSPROBE_FORMATS = ("tensorboard", "csv", "api")
"""msprobe's ``format`` values: checked although ignored (another value is a mistake in the file)."""
_UNSUPPORTED_KEYS = {
    "cc_distribution": "collective communication monitoring is not implemented",
    "mg_direction": "momentum/gradient direction is not implemented",
    "mg_distribution": "momentum/gradient direction is not implemented",
    "l2_targets": "attention L2 features are not implemented",
    "recording_l2_features": "attention L2 features are not implemented",
    "monitor_mbs_grad": "micro-batch gradients are not implemented",
}
# Keys only msprobe's monitor form has: a config holding one of them (and no ``task`` or
# ``mode``) is read as that form even without ``targets``, which msprobe 26 makes optional.
_MSPROBE_MONITOR_MARKERS = frozenset({
    "targets", "module_ranks", "xy_distribution", "wg_distribution", "mv_distribution", "param_distribution",
    "ur_distribution", "all_xy", "print_struct", "alert", *_UNSUPPORTED_KEYS,
})
ALL_SLOTS_SPEC = {slot: "tuple[1]:0" for slot in SLOTS}
"""Every slot of every module: msprobe's full monitoring (element 0 of each tuple)."""



def is_monitor_config(config: Mapping[str, Any]) -> bool:
    """msprobe's monitor form: one of its keys (``targets``, ``*_distribution``, ...) without a
    ``task`` (msprobe's dump form) or a ``mode`` (ours)."""
    return (not _MSPROBE_MONITOR_MARKERS.isdisjoint(config) and "task" not in config
            and "mode" not in config)


def _disabled(value: Any) -> bool:
    """An msprobe feature block that asks for nothing: false, empty, or ``{"enable": false, ...}``."""
    if value is None or value is False or (isinstance(value, (dict, list, str)) and not value):
        return True
    return isinstance(value, Mapping) and value.get("enable") is False


def _msprobe_ops(value: Any) -> tuple[str, ...]:
    """msprobe's ``ops``, checked under that name: its metric names, ``shape`` and ``dtype`` refused."""
    names = [value] if isinstance(value, str) else value
    if isinstance(names, (list, tuple)):
        for name in names:
            if isinstance(name, str) and name in _MSPROBE_OPS_NOT_RECORDED:
                raise ProbeError(f"msprobe monitor key 'ops': {name!r} cannot be honoured: "
                                 f"{_MSPROBE_OPS_NOT_RECORDED[name]} (the stats mode records shapes and "
                                 "dtypes per op); remove it")
    return parse_metrics("ops", value)


def _msprobe_targets(config: Mapping[str, Any]) -> Any:
    """msprobe's targets: empty or absent is every module; ``all_xy`` adds every module's slots
    under the named targets (whose own specs win, slot by slot)."""
    targets = config.get("targets")
    if targets is None or (isinstance(targets, Mapping) and not targets):
        return {"*": dict(ALL_SLOTS_SPEC)}
    if config.get("all_xy") is True and isinstance(targets, Mapping):
        return {"*": dict(ALL_SLOTS_SPEC), **targets}
    return targets


def _names_slots(targets: Any) -> bool:
    """Whether a target names a slot (msprobe's ``{module: {}}`` names parameters only)."""
    if isinstance(targets, (list, tuple)):
        return True
    return isinstance(targets, Mapping) and any(isinstance(v, Mapping) and v for v in targets.values())


def from_msprobe_monitor(config: Mapping[str, Any]) -> dict[str, Any]:
    """Our ``probe.mode`` options for an msprobe monitor config: ``mode`` holds a ``probe.Monitor``
    config, the other keys are the session's common options."""
    options: dict[str, Any] = {"mode": ["monitor"]}
    if "all_xy" in config:
        parse_bool("all_xy", config["all_xy"])
    options["targets"] = _msprobe_targets(config)
    if "xy_distribution" not in config and not _names_slots(config.get("targets")):
        options["xy_distribution"] = False  # msprobe's default: {} and {module: {}} name parameters
    for key, value in config.items():
        if key in _UNSUPPORTED_KEYS:
            if not _disabled(value):
                raise ProbeError(f"msprobe monitor key {key!r} = {show(value)}: {_UNSUPPORTED_KEYS[key]}; "
                                 "disable it (false, or {\"enable\": false})")
            continue
        if key in ("targets", "all_xy"):
            continue
        if key in _IGNORED_KEYS:
            if key == "format":
                parse_choice("format", value, _MSPROBE_FORMATS)
            warn_once(f"monitor-key-{key}", f"msprobe monitor key {key!r} ignored: {_IGNORED_KEYS[key]}")
            continue
        if key == "ops":
            options["metrics"] = _msprobe_ops(value)
        elif key == "module_ranks":
            options["ranks"] = _ranks(value)
        elif key in (monitor_keys := CONFIGS["monitor"].option_names()):
            options[key] = value
        else:
            accepted = (monitor_keys - {"metrics"}) | {"ops", "all_xy"} | set(_IGNORED_KEYS)
            raise ProbeError(f"msprobe monitor key {key!r} is unknown; accepted: {sorted(accepted)}")
    configs, common = configs_for(options.pop("mode"), options)
    return {"mode": configs, **common}


def _ranks(value: Any) -> Any:
    """``module_ranks``: "0", "0,1", [0, 1] or [] (empty: all): the session's ``ranks``."""
    if value is None or (isinstance(value, (str, list)) and not value):
        return None
    IntSet.parse("module_ranks", value)  # refused here, under the name the user wrote
    return value


@dataclass(frozen=True)
class SlotSpec:
    """Which tensor of a module's input, output or gradient tuple is monitored."""

    length: int | None  # None: the value itself must be a tensor
    index: int = 0

    @classmethod
    def parse(cls, where: str, text: Any) -> SlotSpec:
        if isinstance(text, str) and text == "tensor":
            return cls(None)
        match = _SPEC.fullmatch(text) if isinstance(text, str) else None
        if match is None or int(match.group(2) or 0) >= int(match.group(1)):
            raise ProbeError(f"monitor target {where}: {show(text)} is not 'tensor', 'tuple[N]' or "
                             "'tuple[N]:i' with i < N")
        return cls(int(match.group(1)), int(match.group(2) or 0))

    def __str__(self) -> str:
        return "tensor" if self.length is None else f"tuple[{self.length}]:{self.index}"

    def select(self, value: Any) -> torch.Tensor | None:
        """The monitored tensor of ``value``, or None if ``value`` does not have that shape.

        A tensor is a 1-tuple to a ``tuple`` spec: autograd passes a module's one output
        gradient as ``(grad,)``, so ``"output_grad": "tuple[1]:0"`` is that output's gradient.
        A Hugging Face ``ModelOutput`` (what every HF model returns) is the tuple HF makes of it
        (``to_tuple()``: its fields that are set, in order), and ``"tensor"`` is its first field,
        HF's ``output[0]`` (the loss when labels were given, else the logits or hidden states):
        the model's own output is monitored, not refused with a warning.
        """
        value = _model_output_tuple(value)
        if self.length is None and isinstance(value, _ModelOutputTuple) and value:
            value = value[0]
        if self.length is None:
            if isinstance(value, torch.Tensor):
                return value
            if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], torch.Tensor):
                return value[0]  # a module's input is always a tuple, "tensor" means its only element
            return None
        if isinstance(value, torch.Tensor):
            value = (value,)
        if isinstance(value, (tuple, list)) and len(value) > self.index:
            chosen = value[self.index]
            return chosen if isinstance(chosen, torch.Tensor) else None
        return None


class _ModelOutputTuple(tuple):
    """A ``ModelOutput``'s fields as a tuple (told apart from a tuple the module returned)."""


def _model_output_tuple(value: Any) -> Any:
    """A Hugging Face ``ModelOutput`` (a mapping with ``to_tuple``; transformers is not imported
    for this) as its tuple; anything else as it is."""
    to_tuple = getattr(value, "to_tuple", None)
    if isinstance(value, Mapping) and callable(to_tuple):
        return _ModelOutputTuple(to_tuple())
    return value


def describe_value(value: Any) -> str:
    """What a module passed, for a spec that does not fit it: "a tensor", "a tuple of 2 (tensor, int)"."""
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join("tensor" if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:6])
        return f"a {type(value).__name__} of {len(value)} ({kinds}{', ...' if len(value) > 6 else ''})"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class Target:
    """A module glob and the slots monitored on the modules it matches."""

    pattern: str
    slots: dict[str, SlotSpec]

    def matches(self, fqn: str) -> bool:
        return fnmatch.fnmatchcase(fqn, self.pattern)


@dataclass(frozen=True)
class TurbulenceRule:
    """A metric far from its running average, in either direction."""

    threshold: float = 1.0
    """Fires when ``value > ema * (1 + threshold)`` or ``value < ema / (1 + threshold)``."""
    warmup: int = 5
    """Steps that only build the average (the first values of a run are never alarms)."""
    decay: float = 0.9
    """``ema = decay * ema + (1 - decay) * value``, on values that raised no alarm."""
    metrics: tuple[str, ...] = ("norm",)
    kinds: tuple[str, ...] = ("activation", "weight_grad", "weight")
    """Series it watches. Adam's moments and update trend by construction (its second
    moment grows for ~1/(1 - beta2) steps), so a running average would flag a healthy
    start; a fault in the gradients shows in ``weight_grad`` first."""


ON_ANOMALY = ("log", "dump", "stop", "trace")
TRACE_MODES = ("stats", "dump")
"""Per-op modes ``on_anomaly="trace"`` may arm: those that observe ops without replacing them."""
TRACE_KEYS = ("trace_modes", "trace_options", "trace_steps", "trace_limit")
"""The options that arm per-op tracing after an anomaly: only with ``on_anomaly="trace"``."""


def parse_trace_modes(value: Any) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
        unknown = [n for n in names if n not in TRACE_MODES]
        if not unknown:
            return tuple(dict.fromkeys(names))
        raise ProbeError(f"monitor option 'trace_modes': unknown trace mode(s) {unknown}; accepted: "
                         f"{list(TRACE_MODES)} (the monitor arms no mode that replaces op execution)")
    raise ProbeError(f"monitor option 'trace_modes': expected a non-empty list from {list(TRACE_MODES)}, "
                     f"got {show(value)}")


def parse_targets(value: Any) -> tuple[Target, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = {pattern: {slot: "tensor" for slot in ("output", "output_grad")} for pattern in value}
    if not isinstance(value, Mapping) or not value:
        raise ProbeError("monitor option 'targets': expected a non-empty {module glob: {slot: spec}} mapping "
                         f"or a list of module globs, got {show(value)}")
    targets = []
    for pattern, slots in value.items():
        if not isinstance(pattern, str) or not isinstance(slots, Mapping):  # "": the model itself
            raise ProbeError(f"monitor target {show(pattern)}: expected a module glob -> {{slot: spec}} with "
                             f"slots from {list(SLOTS)}, got {show(slots)}")
        bad = sorted((slot for slot in slots if slot not in SLOTS), key=str)
        if bad:
            raise ProbeError(f"monitor target {pattern!r}: unknown slot(s) {show(bad)}; "
                             f"accepted: {list(SLOTS)}")
        specs = {slot: SlotSpec.parse(f"{pattern!r} {slot}", spec) for slot, spec in slots.items()}
        if not specs:
            specs = {"output": SlotSpec(None), "output_grad": SlotSpec(None)}
        targets.append(Target(pattern, specs))
    return tuple(targets)


_TURBULENCE_ARGS = ("threshold", "warmup", "decay", "metrics", "kinds")


def _turbulence(args: Any) -> TurbulenceRule:
    where = "monitor alert rule AnomalyTurbulence"
    if not isinstance(args, Mapping) or not all(isinstance(k, str) and k in _TURBULENCE_ARGS for k in args):
        raise ProbeError(f"{where}: args {show(args)}; accepted: {list(_TURBULENCE_ARGS)}")
    kwargs: dict[str, Any] = {}
    if "threshold" in args:
        kwargs["threshold"] = parse_number("alert threshold", args["threshold"], 0.0)
        if not kwargs["threshold"] > 0:
            raise ProbeError(f"{where}: threshold must be > 0, got {show(args['threshold'])}")
    if "warmup" in args:
        kwargs["warmup"] = parse_int("alert warmup", args["warmup"], 0)
    if "decay" in args:
        kwargs["decay"] = parse_number("alert decay", args["decay"], 0.0)
        if not kwargs["decay"] < 1:
            raise ProbeError(f"{where}: decay must be in [0, 1), got {show(args['decay'])}")
    if "metrics" in args:
        kwargs["metrics"] = parse_metrics("alert metrics", args["metrics"], ALERT_METRICS)
    if "kinds" in args:
        kwargs["kinds"] = _kinds(args["kinds"])
    return TurbulenceRule(**kwargs)


def parse_alert(value: Any) -> tuple[TurbulenceRule | None, bool]:
    """msprobe's ``alert`` block: ``{"rules": [{"rule_name": ..., "args": {...}}], "dump": bool}``.

    ``dump`` (msprobe writes its alerts to a file) changes nothing: the run holds every anomaly.
    """
    if (not isinstance(value, Mapping) or not isinstance(value.get("rules", []), list)
            or not set(value) <= {"rules", "dump"}):
        raise ProbeError("monitor option 'alert': expected {'rules': [...], 'dump': bool}, "
                         f"got {show(value)}")
    if "dump" in value:
        parse_bool("alert dump", value["dump"])
    turbulence, nonfinite = None, True
    for rule in value.get("rules", []):
        name = rule.get("rule_name") if isinstance(rule, Mapping) else None
        if name == "AnomalyTurbulence":
            turbulence = _turbulence(rule.get("args", {}))
        elif name == "AnomalyNan":
            nonfinite = True
        else:
            raise ProbeError(f"monitor alert rule {show(name)} is unknown; accepted: "
                             "['AnomalyTurbulence', 'AnomalyNan']")
    return turbulence, nonfinite


KINDS = ("activation", "weight_grad", "weight", "exp_avg", "exp_avg_sq", "update", "update_ratio")


def _kinds(value: Any) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if (not isinstance(names, (list, tuple)) or not names
            or not all(isinstance(n, str) and n in KINDS for n in names)):
        raise ProbeError(f"monitor alert rule AnomalyTurbulence: kinds {show(value)} is not a non-empty list "
                         f"from {list(KINDS)}")
    return tuple(dict.fromkeys(names))


def parse_metrics(key: str, value: Any, accepted: tuple[str, ...] = METRICS) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if isinstance(names, (list, tuple)):  # msprobe's and earlier runs' "nans" is today's "nan"
        names = [LEGACY_NAMES.get(n, n) if isinstance(n, str) else n for n in names]
    if (not isinstance(names, (list, tuple)) or not names
            or not all(isinstance(n, str) and n in accepted for n in names)):
        raise ProbeError(f"monitor option {key!r}: {show(value)} is not a non-empty list "
                         f"from {list(accepted)}")
    return tuple(dict.fromkeys(names))


def parse_scaler(value: Any) -> Any:
    """The ``scaler`` option: a ``torch.amp.GradScaler`` (``torch.cuda.amp``'s and FSDP's
    ``ShardedGradScaler`` are ones) or None."""
    if value is None or isinstance(value, torch.amp.GradScaler):
        return value
    raise ProbeError("monitor option 'scaler': expected the torch.amp.GradScaler the training loop uses "
                     f"(its scale becomes the series loss_scale/scaler), got {show(value)}")


CONFIG_FILE_FORMS.append(ConfigFileForm(is_monitor_config, from_msprobe_monitor))
