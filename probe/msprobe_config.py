"""msprobe's ``config.json`` read as probe options.

Users arrive with a config written for msprobe (``task``, ``dump_path``,
``rank``, ``step``, ``level`` and a block per task). ``probe.mode(config=...)``
accepts it: each key maps to our options, a key whose meaning we cannot honour
is a :class:`ProbeError` naming it, and a key that changes nothing we do (or
that msprobe itself ignores) is a one-time warning. See docs/msprobe.md for the
table. Keys of blocks that belong to other tasks are ignored, as msprobe does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from probe.errors import ProbeError, warn_once
from probe.modes.config import CONFIGS, configs_for
from probe.vocabulary.option_fields import option_specs
from probe.vocabulary.option_values import IntSet, parse_bool, show

# msprobe task -> probe modes (and options the task implies)
_TASKS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "statistics": (["stats"], {"inputs": True}),
    "tensor": (["stats", "dump"], {"inputs": True}),
    "structure": (["structure"], {}),
    "free_benchmark": (["free_benchmark"], {}),
}
# The free_benchmark block of msprobe 8.3.3 -> our free-benchmark options.
_FREE_BENCHMARK_KEYS = {
    "pert_mode": "perturb", "handler_type": "handler", "if_preheat": "preheat",
    "preheat_step": "preheat_steps", "max_sample": "max_sample",
}


def _free_benchmark_value(key: str, value: Any) -> Any:
    """A free_benchmark block's value, checked by its option's own check (the mode's config field)
    under the key the user wrote (``free_benchmark.pert_mode``, not ``perturb``)."""
    (_, spec) = option_specs(CONFIGS["free_benchmark"])[_FREE_BENCHMARK_KEYS[key]]
    return spec.check.parse(f"free_benchmark.{key}", value)

_UNSUPPORTED_TASKS = {
    "overflow_check": "use task 'statistics' and run.first_nonfinite() instead",
    "run_ut": "single-op replay is a separate command (probe replay)",
    "acc_check": "single-op replay is a separate command (probe replay)",
    "grad_probe": "use the monitor mode for gradient statistics",
    "nan_check": "use task 'statistics' and run.first_nonfinite() instead",
    "diff_check": "use probe compare on two runs",
    "exception_dump": "it needs Ascend hardware",
}
_TASK_BLOCKS = frozenset(_TASKS) | frozenset(_UNSUPPORTED_TASKS)
_IGNORED_WITH_WARNING = {
    "precision": "statistics are always accumulated in fp32 or wider",
    "risk_level": "every op is recorded whatever its risk level",
    "enable_dataloader": "sessions are delimited by probe.mode and session.step()",
    "seed": "not a config key in msprobe either (seed_all() takes it)",
    "is_deterministic": "not a config key in msprobe either (seed_all() takes it)",
    "custom_op_namespaces": "ops of every namespace are seen",
    "file_format": "tensors are always written as safetensors (probe export msprobe writes .pt)",
    "framework": "only PyTorch is supported",
}
_UNSUPPORTED_KEYS = {
    "dump_enable": "hot reloading of the config file",
    "load": "feeding dumped inputs back into modules",
    "tensor_list": "dumping the tensors of some ops inside a statistics task (use modes ['stats', 'dump'] "
                   "with ops=...)",
    "slice": "slicing tensors before they are dumped",
    "request_id": "per-request slicing",
    "online_run_ut": "online single-op checks",
    "nfs_path": "online single-op checks",
}
_LEVELS = {"L0", "L1", "mix"}
_API_NAME = re.compile(
    r"^(?:Distributed|Functional|Torch|Tensor|Mint|MintFunctional|Primitive|Aten|VF|NPU|Jit)\.(.+)\.\d+\.(forward|backward)$"
)
_MODULE_NAME = re.compile(r"^(?:Module|Cell)\.(.+)\.[A-Za-z_]\w*\.(forward|backward)\.\d+$")


def _warn_ignored(key: str) -> None:
    warn_once(f"msprobe-{key}", f"msprobe config key {key!r} is ignored: {_IGNORED_WITH_WARNING[key]}")


def is_msprobe_config(config: dict[str, Any]) -> bool:
    return "task" in config or "dump_path" in config


def _int_list(key: str, value: Any) -> Any:
    """``rank``/``step``: a list like ``[0, "4-6"]``; empty (or absent) selects all."""
    if value is None or (isinstance(value, list) and not value):
        return None
    if not isinstance(value, list):
        raise ProbeError(f"msprobe config key {key!r}: expected a list like [0, '4-6'], got {show(value)}")
    IntSet.parse(key, value)  # refused here, under the msprobe key the user wrote
    return value


def _dump_path(value: Any) -> str:
    """``dump_path``: a usable directory path, refused under this name (not as ``out``)."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise ProbeError(f"msprobe config key 'dump_path': expected a directory path, got {show(value)}")
    try:
        Path(value).is_symlink()  # a name too long for the filesystem fails here
    except OSError as e:
        raise ProbeError(f"msprobe config key 'dump_path': {show(value)} is not a usable path: "
                         f"{e.strerror}") from None
    return value


def _entries(key: str, value: Any) -> list[Any]:
    """``scope``, ``list``, ``data_mode``: a string or a list of them."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise ProbeError(f"msprobe config key {key!r}: expected a string or a list of them, got {show(value)}")


def _selectors(key: str, entries: list[Any]) -> tuple[list[str], list[str]]:
    """``scope``/``list`` entries -> (op globs, module globs)."""
    ops: list[str] = []
    modules: list[str] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ProbeError(f"msprobe config key {key!r}: {show(entry)} is not an API or module name")
        if m := _MODULE_NAME.match(entry):
            modules += [m.group(1), f"{m.group(1)}.*"]
        elif m := _API_NAME.match(entry):
            api = m.group(1).split(".")[-1]
            ops.append(f"*{api}*")
            warn_once(f"msprobe-{key}-api", f"msprobe {key!r} entry {show(entry)} selects every call of "
                      f"'{api}' (aten ops are recorded; call indices and directions are not kept)")
        elif key == "scope":
            raise ProbeError(
                f"msprobe config key 'scope': {show(entry)} is neither an API name "
                "('Functional.relu.0.forward') nor a module name ('Module.fc1.Linear.forward.0')"
            )
        else:  # "list" is a substring match in msprobe
            ops.append(f"*{entry}*")
    if key == "scope" and (ops or modules):
        warn_once("msprobe-scope-range", "msprobe 'scope' is a range in execution order; probe selects "
                  "the named APIs and modules themselves")
    return ops, modules


def from_msprobe(config: dict[str, Any]) -> dict[str, Any]:
    """Our ``probe.mode`` options for an msprobe config: ``mode`` holds the modes' configs
    (:class:`~probe.modes.config.ModeConfig`), the other keys are the session's common options."""
    task = config.get("task", "statistics")
    if not isinstance(task, str):
        raise ProbeError(f"msprobe task {show(task)} is not a task name; accepted: {sorted(_TASKS)}")
    if task in _UNSUPPORTED_TASKS:
        raise ProbeError(f"msprobe task {task!r} is not supported: {_UNSUPPORTED_TASKS[task]}")
    if task not in _TASKS:
        raise ProbeError(f"msprobe task {task!r} is unknown; accepted: {sorted(_TASKS)}")
    modes, implied = _TASKS[task]
    options: dict[str, Any] = {"mode": list(modes), **implied}
    for key, value in config.items():
        if key == "task" or (key in _TASK_BLOCKS and key != task and isinstance(value, dict)):
            continue  # other tasks' blocks: msprobe ignores them too (a dict under any other key is no block)
        if key == "dump_path":
            options["out"] = _dump_path(value)
        elif key == "rank":
            options["ranks"] = _int_list(key, value)
        elif key == "step":
            options["steps"] = _int_list(key, value)
        elif key == "level":
            if not isinstance(value, str) or value not in _LEVELS:
                raise ProbeError(f"msprobe level {show(value)} is not supported; accepted: {sorted(_LEVELS)} "
                                 "(every level records every aten op, attributed to its modules)")
        elif key == "async_dump":
            options["async_flush"] = parse_bool(key, value)
        elif key == "extra_info":
            options["stack"] = parse_bool(key, value)
        elif key == task:
            if not isinstance(value, dict):
                raise ProbeError(f"msprobe config key {task!r}: expected a block {{key: value}}, "
                                 f"got {show(value)}")
            _task_block(task, value, options)
        elif key in _IGNORED_WITH_WARNING:
            _warn_ignored(key)
        elif key in _UNSUPPORTED_KEYS:
            raise ProbeError(f"msprobe config key {key!r} ({_UNSUPPORTED_KEYS[key]}) is not supported")
        else:
            raise ProbeError(f"msprobe config key {key!r} is unknown")
    modes = options.pop("mode")
    configs, common = configs_for(modes, {k: v for k, v in options.items() if v is not None})
    return {"mode": configs, **common}


def _task_block(task: str, block: dict[str, Any], options: dict[str, Any]) -> None:
    ops: list[str] = []
    modules: list[str] = []
    for key, value in block.items():
        if task == "free_benchmark" and key in _FREE_BENCHMARK_KEYS:
            if value is not None:  # null: the default, as in msprobe
                options[_FREE_BENCHMARK_KEYS[key]] = _free_benchmark_value(key, value)
        elif task == "free_benchmark" and key == "fuzz_stage":
            if value not in ("forward", "backward"):
                raise ProbeError(f"msprobe fuzz_stage {show(value)} is not 'forward' or 'backward'")
            options["phases"] = [value]
        elif task == "free_benchmark" and key == "fuzz_device":
            if value not in ("npu", "cpu"):
                raise ProbeError(f"msprobe fuzz_device {show(value)} is not 'npu' or 'cpu'")
            if value == "cpu":
                options["perturb"] = "to_cpu"
        elif task == "free_benchmark" and key == "fuzz_level":
            if value != "L1":
                raise ProbeError(f"msprobe fuzz_level {show(value)} is not supported; accepted: ['L1']")
        elif key in ("scope", "list"):
            entries = _entries(f"{task}.{key}", value)
            found_ops, found_modules = _selectors(key, entries)
            ops += found_ops
            modules += found_modules
        elif key == "data_mode":
            _data_mode(value, options)
        elif key == "summary_mode":
            if value != "statistics":
                raise ProbeError(f"msprobe summary_mode {show(value)} is not supported; use the dump mode "
                                 "with checksum=True for bitwise comparison")
        elif key in _IGNORED_WITH_WARNING:
            _warn_ignored(key)
        elif key in _UNSUPPORTED_KEYS:
            raise ProbeError(f"msprobe config key {task}.{key} ({_UNSUPPORTED_KEYS[key]}) is not supported")
        else:
            raise ProbeError(f"msprobe config key {task}.{key} is unknown")
    if ops:
        options["ops"] = ops
    if modules:
        options["modules"] = modules


def _data_mode(value: Any, options: dict[str, Any]) -> None:
    modes = _entries("data_mode", value) or ["all"]
    allowed = {"all", "forward", "backward", "input", "output"}
    bad = [m for m in modes if not isinstance(m, str) or m not in allowed]
    if bad:
        raise ProbeError(f"msprobe data_mode {show(bad)} is not one of {sorted(allowed)}")
    if "all" in modes:
        return
    directions = [m for m in modes if m in ("forward", "backward")]
    io = [m for m in modes if m in ("input", "output")]
    if directions:
        phases = set(directions)
        if "forward" in phases:
            phases |= {"recompute", "optimizer"}
        options["phases"] = sorted(phases)
    if len(io) == 1:
        if "dump" in options["mode"]:
            options["tensors"] = f"{io[0]}s"
        options["inputs"] = io == ["input"]
