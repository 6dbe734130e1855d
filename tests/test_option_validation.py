"""Hostile option values: each is refused with a ProbeError naming the option, or accepted and honoured.

Every option of ``probe.mode`` (the common ones and each registered mode's config fields) is tried
with one value per path through its check, directly and from JSON config files (ours, msprobe's and
msprobe's monitor form). The paths come from the kind of check the option's field declares
(``probe.vocabulary.option_fields``: bool, integer, number, choice, globs, int sets, or the option's
own check, whose family (a path, a mapping, a list of names, an object) is declared in
:data:`OWN_CHECK`): a value it accepts, one refused by type, one refused by range or choice, and the
values that once broke a check of that kind (a recursive list, a failing ``__repr__``, ``10**30``,
NaN and infinities, a 100,000-character string, a generator). The tables below say, per option,
which value classes are accepted: each of those must reach the session (the resolved value is read
back from it), each other one must be refused naming the option. Never another exception type,
never a hang, never a huge allocation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import probe
from probe import ProbeError
from probe.modes.config import CONFIGS
from probe.modes.monitor.config import SLOTS
from probe.modes.registry import MODES
from probe.options import _COMMON_KEYS, DEFAULT_CHECKSUMS, PHASES, IntSet
from probe.vocabulary.option_fields import OptionSpec, boolean, default_of, option_specs
from probe.vocabulary.option_values import Patterns
from probe.vocabulary.session_options import Options


@pytest.fixture(autouse=True)
def _own_warn_once_state(monkeypatch):
    """The config keys tried here warn once per process: keep those notices from other tests' files."""
    monkeypatch.setattr(probe.errors, "_warned", set())


def _recursive_list() -> list[Any]:
    values: list[Any] = []
    values.append(values)
    return values


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr fails")


# name -> a factory (a fresh value per case: generators are consumed, lists may be mutated)
HOSTILE: dict[str, Callable[[], Any]] = {
    "int": lambda: 5, "negative": lambda: -1, "zero": lambda: 0, "huge": lambda: 10**30,
    "true": lambda: True, "false": lambda: False, "float": lambda: 1.5, "nan": lambda: math.nan,
    "inf": lambda: math.inf, "bytes": lambda: b"stats", "dict": lambda: {"a": 1}, "empty_dict": dict,
    "set": lambda: {1}, "none": lambda: None, "object": object, "bad_repr": _BadRepr,
    "empty_str": lambda: "", "truthy_str": lambda: "no", "negative_str": lambda: "-1",
    "long_str": lambda: "x" * 100_000, "big_range_str": lambda: "0-1000000000",
    "empty_list": list, "nested_list": lambda: [[1]], "nested_str_list": lambda: [["a"]],
    "recursive_list": _recursive_list, "generator": lambda: (i for i in range(3)),
    "big_range": lambda: range(10**12), "tensor": lambda: torch.ones(2), "dtype": lambda: torch.float16,
    "list_of_object": lambda: [object()], "list_of_float": lambda: [1.5], "list_of_bool": lambda: [True],
}
# The same classes, as JSON can write them ("none" is null).
JSON_HOSTILE = {
    "int": 5, "negative": -1, "huge": 10**30, "true": True, "false": False, "float": 1.5, "none": None,
    "empty_str": "", "truthy_str": "no", "false_str": "false", "long_str": "x" * 100_000,
    "big_range_str": "0-1000000000", "empty_list": [], "nested_list": [[1]], "list_of_null": [None],
    "dict": {"a": 1}, "empty_dict": {}, "list_of_dict": [{}],
}

# -- what each option accepts, and where the session shows it --------------------------------------

_BOOL = frozenset({"true", "false"})
_NONE = frozenset({"none"})
_SHORT_STRS = frozenset({"big_range_str", "truthy_str", "negative_str", "false_str"})
_INT_SET = frozenset({"none", "int", "zero", "huge", "set", "big_range", "big_range_str"})
_GLOBS = _NONE | _SHORT_STRS | {"long_str"}  # any non-empty string is a glob

ACCEPTED: dict[str, frozenset[str]] = {
    # common options
    "out": _NONE | _SHORT_STRS,  # a relative path; 100,000 characters is no usable path
    "model": _NONE, "config": _NONE | {"empty_dict"}, "hparams": _NONE | {"dict", "empty_dict"},
    "ops": _GLOBS, "modules": _GLOBS, "steps": _INT_SET, "ranks": _INT_SET,
    "overwrite": _BOOL, "stack": _BOOL, "async_flush": _BOOL, "compiled_inputs": _BOOL, "checksums": _BOOL,
    "gc_freeze": _BOOL,
    "phases": frozenset(), "compiled": frozenset(),
    # stats (and the monitor's distribution/histogram)
    "inputs": _BOOL, "distribution": _BOOL, "histogram": _BOOL, "saturation": _BOOL,
    "stats_backend": frozenset(),
    # dump
    "checksum": _BOOL, "memory_budget": frozenset({"int"}), "shard_size": frozenset({"int", "huge"}),
    "on_budget": frozenset(), "on_error": frozenset(), "tensors": frozenset(),
    # free_benchmark
    "preheat": _BOOL, "preheat_steps": frozenset({"int", "huge"}), "max_sample": frozenset({"int", "huge"}),
    "max_checks_per_op": _NONE | {"int", "huge"}, "perturb": frozenset(), "handler": frozenset(),
    # monitor
    **{flag: _BOOL for flag in ("xy_distribution", "wg_distribution", "mv_distribution", "param_distribution",
                                "ur_distribution", "forward_only", "backward_only", "reduce_ranks",
                                "tensorboard")},
    "eps": frozenset({"int", "zero", "huge", "float"}), "start_step": frozenset({"int", "zero", "huge"}),
    "step_interval": frozenset({"int", "huge"}), "alert": frozenset({"empty_dict"}),
    "anomaly_rules": frozenset({"empty_list"}), "scaler": _NONE,
    "targets": frozenset(), "metrics": frozenset(), "module_ranks": frozenset(), "on_anomaly": frozenset(),
    "trace_modes": frozenset(), "trace_options": frozenset(), "trace_steps": frozenset(),
    "trace_limit": frozenset(),  # the trace_* options need on_anomaly='trace'
    # upcast
    "upcast_dtype": frozenset(),
    # whatif, fake_quant (a recipe is named, a plan is a file or "all": no hostile value is either)
    "recipes": frozenset(), "plan": frozenset(), "recipe": frozenset(),
}

_MONITOR_FIELDS = {"alert": "turbulence"}  # the rule the alert block leaves in force


# -- which values reach which path of each option's check ---------------------------------------

# The family of each option whose field declares a check of its own (or, for ``config``, no field):
# it says which hostile values can take different paths through that check.
OWN_CHECK: dict[str, str] = {
    "out": "path", "config": "mapping", "hparams": "mapping", "alert": "mapping", "trace_options": "mapping",
    "phases": "names", "checksums": "names", "metrics": "names", "trace_modes": "names", "recipes": "names",
    "targets": "names", "anomaly_rules": "names",
    "model": "object", "scaler": "object", "plan": "object", "recipe": "object", "upcast_dtype": "object",
    "inputs": "object", "saturation": "object", "module_ranks": "object",
}

# check kind -> the value classes tried: one per path (accepted, refused by type, refused by range or
# choice) and the values that once broke a check reading that type. "default" is the field's own
# default given explicitly (a declared choice: the accepted path of a choice).
PATHS: dict[str, tuple[str, ...]] = {
    "bool": ("true", "false", "int", "truthy_str", "bad_repr"),
    "integer": ("int", "zero", "negative", "huge", "true", "float", "nan", "none", "negative_str",
                "bad_repr"),
    "number": ("int", "zero", "negative", "float", "huge", "nan", "inf", "true", "none", "negative_str",
               "bad_repr"),
    "choice": ("default", "truthy_str", "empty_str", "long_str", "int", "none", "bad_repr"),
    "globs": ("none", "truthy_str", "long_str", "empty_str", "empty_list", "nested_str_list",
              "list_of_object", "int", "generator", "recursive_list", "bad_repr"),
    "int_set": ("none", "int", "zero", "huge", "set", "big_range", "big_range_str", "negative",
                "negative_str", "true", "float", "nan", "empty_list", "nested_list", "list_of_bool",
                "recursive_list", "generator", "long_str", "bytes", "tensor", "bad_repr"),
    "path": ("none", "truthy_str", "long_str", "empty_str", "bytes", "int", "bad_repr"),
    "mapping": ("none", "dict", "empty_dict", "empty_list", "recursive_list", "truthy_str", "long_str", "int",
                "generator", "bad_repr"),
    "names": ("none", "truthy_str", "empty_str", "long_str", "empty_list", "nested_str_list",
              "list_of_object", "list_of_float", "recursive_list", "generator", "set", "dict", "int", "true",
              "big_range", "bad_repr"),
    "object": ("none", "true", "false", "int", "truthy_str", "long_str", "dtype", "tensor", "object", "dict",
               "empty_list", "recursive_list", "generator", "bad_repr"),
}
# The same paths as JSON can reach them.
JSON_PATHS: dict[str, tuple[str, ...]] = {
    "bool": ("true", "false", "int", "false_str", "none"),
    "integer": ("int", "huge", "negative", "true", "float", "none", "truthy_str"),
    "number": ("int", "float", "huge", "negative", "true", "none", "truthy_str"),
    "choice": ("default", "truthy_str", "empty_str", "long_str", "int", "none"),
    "globs": ("none", "truthy_str", "long_str", "empty_str", "empty_list", "nested_list", "list_of_null",
              "int"),
    "int_set": ("none", "int", "huge", "big_range_str", "negative", "true", "float", "empty_list",
                "nested_list", "list_of_null", "long_str", "dict"),
    "path": ("none", "truthy_str", "long_str", "empty_str", "int", "empty_list"),
    "mapping": ("none", "dict", "empty_dict", "list_of_dict", "empty_list", "int", "truthy_str"),
    "names": ("none", "empty_list", "nested_list", "list_of_null", "list_of_dict", "truthy_str", "empty_str",
              "long_str", "int", "true", "dict"),
    "object": ("none", "true", "false", "int", "truthy_str", "long_str", "empty_list", "dict"),
}


def _option_field(mode: str, key: str) -> tuple[dataclasses.Field[Any], OptionSpec] | None:
    """The option field behind ``key`` and its spec (``config`` has none: it is read before any field)."""
    return (option_specs(Options) if key in _COMMON_KEYS else option_specs(CONFIGS[mode])).get(key)


def _check_kind(mode: str, key: str) -> str:
    """The kind of check the option's field declares, by the factory that made it ("unknown": a check
    of its own whose family :data:`OWN_CHECK` does not say)."""
    found = _option_field(mode, key)
    if found is None or key in OWN_CHECK:
        return OWN_CHECK.get(key, "unknown")
    check = found[1].check
    if check.parse == Patterns.parse:  # bound classmethods: equal, not identical
        return "globs"
    if check.parse == IntSet.parse:
        return "int_set"
    if check.accepts == boolean().accepts:
        return "bool"
    for kind, made_by in (("integer", r"int >= -?\d+(, `None`)?"), ("number", r"number >= -?[\d.]+"),
                          ("choice", r"`'[^`]*'`( \\\| `'[^`]*'`)*")):
        if re.fullmatch(made_by, check.accepts):
            return kind
    return "unknown"


def _default(mode: str, key: str) -> Any:
    found = _option_field(mode, key)
    assert found is not None, key
    return default_of(found[0])


def _resolved(session: probe.Session, mode: str, key: str) -> Any:
    """The value of ``key`` as the session will use it."""
    if key in _COMMON_KEYS:
        value = getattr(session.options, key)
        return value.globs if key in ("ops", "modules") else value
    if key == "config":
        return session.options.modes
    (built,) = [m for m in session.modes if m.name == mode]  # with model=, checksums is one too
    return getattr(built.config, _MONITOR_FIELDS.get(key, key))


def _expected(key: str, given: Any) -> Any:
    """What ``_resolved`` must show for an accepted value ``given``."""
    if key == "out":
        return None if given is None else Path(given)
    if key in ("ops", "modules"):
        return None if given is None else (given,)
    if key == "checksums":
        return DEFAULT_CHECKSUMS if given else frozenset()
    if key == "config":
        return ("stats",)
    if key == "alert":
        return None  # an alert block with no rules turns the default turbulence rule off
    if key == "anomaly_rules":
        return ()
    if key == "eps":
        return float(given)
    return given


# value class -> (a step the set holds, one it does not)
_MEMBERS = {"int": (5, 4), "zero": (0, 1), "huge": (10**30, 0), "set": (1, 0),
            "big_range": (10**12 - 1, 10**12), "big_range_str": (10**9, 10**9 + 1)}


def _assert_honoured(session: probe.Session, mode: str, key: str, value: str, given: Any) -> None:
    resolved = _resolved(session, mode, key)
    if key in ("steps", "ranks"):
        assert isinstance(resolved, IntSet)
        if value == "none":
            assert resolved.ranges is None, f"{key}={value}: {resolved}"
        else:
            held, not_held = _MEMBERS[value]
            assert held in resolved and not_held not in resolved, f"{key}={value}: {resolved}"
        return
    expected = _expected(key, given)
    assert resolved == expected and type(resolved) is type(expected), f"{key}={value}: {resolved!r}"


def _mode_cases() -> list[tuple[str, str]]:
    cases = [("stats", key) for key in sorted(_COMMON_KEYS | {"config"})]
    cases += [(name, key) for name, cls in sorted(MODES.items()) for key in sorted(cls.option_names)]
    return cases


def _fuzz_cases(paths: dict[str, tuple[str, ...]],
                cases: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(mode, option, value class): the classes that reach each path of the option's check."""
    return [(mode, key, value) for mode, key in cases for value in paths.get(_check_kind(mode, key), ())]


def test_every_option_has_an_expectation():
    """A new option must say which hostile values it accepts, and a check of its own its family,
    before the fuzz can judge it."""
    assert {key for _, key in _mode_cases()} <= set(ACCEPTED)
    unknown = [f"{mode}.{key}" for mode, key in _mode_cases() if _check_kind(mode, key) not in PATHS]
    assert not unknown, f"a check of its own: say its family in OWN_CHECK: {unknown}"


def _base(mode: str) -> dict[str, Any]:
    """What a mode needs besides the option under test."""
    if mode == "monitor":
        return {"targets": ["*"], "model": torch.nn.Linear(2, 2)}
    if mode == "fake_quant":
        return {"plan": "all", "recipe": "mxfp8"}  # it needs both; the option under test replaces one
    return {}


def _names_option(message: str, key: str) -> bool:
    # The monitor's targets are named one by one ("monitor target 'x'"); a config dict's own keys
    # are options in their own right.
    return (key in message or (key == "targets" and "monitor target" in message)
            or (key == "config" and "option" in message))


def _use(session: probe.Session) -> None:
    """An accepted value must also trace: run two steps of a tiny model."""
    model = torch.nn.Linear(2, 2)
    with session:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            session.step()


def _outcome(make: Callable[[], probe.Session], key: str, accepted: bool, value: str) -> probe.Session | None:
    """``make()`` returns a session when ``accepted``, else raises a ProbeError naming ``key``."""
    if accepted:
        return make()
    with pytest.raises(ProbeError) as refused:
        make()
    assert _names_option(str(refused.value), key), f"{key}={value}: {refused.value}"
    return None


@pytest.mark.parametrize("value", PATHS["names"] + ("bytes", "dtype"))
def test_hostile_modes_argument(tmp_path, value):
    _outcome(lambda: probe.mode(HOSTILE[value](), out=tmp_path / "run"), "mode", False, value)
    assert not (tmp_path / "run").exists()  # none of these names a mode


@pytest.mark.parametrize(("mode", "key", "value"), _fuzz_cases(PATHS, _mode_cases()))
def test_hostile_option_value(tmp_path, monkeypatch, mode, key, value):
    monkeypatch.chdir(tmp_path)  # a relative out= lands here
    given = _default(mode, key) if value == "default" else HOSTILE[value]()
    kwargs = {"out": tmp_path / "run", **_base(mode), key: given}
    accepted = value == "default" or value in ACCEPTED[key]
    started = time.perf_counter()
    session = _outcome(lambda: probe.mode(mode, **kwargs), key, accepted, value)
    assert time.perf_counter() - started < 2, "validation must not expand or walk the value"
    if session is None:
        assert not (tmp_path / "run").exists(), "a refused option must leave nothing behind"
        return
    _assert_honoured(session, mode, key, value, given)
    if key != "model":  # a model that is not the one trained would attribute nothing
        _use(session)


@pytest.mark.parametrize(("mode", "key", "value"), _fuzz_cases(
    JSON_PATHS, [c for c in _mode_cases() if c[1] not in ("config", "model")]))
def test_hostile_value_in_a_config_file(tmp_path, monkeypatch, mode, key, value):
    monkeypatch.chdir(tmp_path)  # a relative out lands here
    config = tmp_path / "config.json"
    base = {"targets": ["*"]} if mode == "monitor" else {k: v for k, v in _base(mode).items() if k != key}
    given = _default(mode, key) if value == "default" else JSON_HOSTILE[value]
    config.write_text(json.dumps({"mode": mode, **base, key: given}))
    extra: dict[str, Any] = {"model": torch.nn.Linear(2, 2)} if mode == "monitor" else {}
    if key != "out":  # given directly it would win over the file's
        extra["out"] = tmp_path / "run"
    accepted = value == "default" or value in ACCEPTED[key]
    session = _outcome(lambda: probe.mode(config=config, **extra), key, accepted, value)
    if session is not None:
        _assert_honoured(session, mode, key, value, given)


@pytest.mark.parametrize(("mode", "options", "named"), [
    ("monitor", {"forward_only": True, "backward_only": True}, "forward_only"),
    ("monitor", {"trace_steps": 3}, "trace_steps"),  # on_anomaly is 'log'
    ("free_benchmark", {"handler": "fix", "perturb": "add_noise"}, "handler"),
    ("free_benchmark", {"handler": "fix", "preheat": True}, "preheat"),
    ("fake_quant", {"plan": "all", "recipe": None}, "recipe"),
])
def test_values_each_valid_but_not_together_are_refused_naming_one(tmp_path, mode, options, named):
    """The config's validate() path: each value passes its own check, the pair does not."""
    with pytest.raises(ProbeError, match=f"'{named}'"):
        probe.mode(mode, out=tmp_path / "run", **{**_base(mode), **options})
    assert not (tmp_path / "run").exists()


# -- msprobe's config.json ------------------------------------------------------------------------

def _mode_of(session: probe.Session, name: str) -> Any:
    (built,) = [m for m in session.modes if m.name == name]
    return built


def _fb(name: str) -> Callable[[probe.Session], Any]:
    return lambda session: getattr(_mode_of(session, "free_benchmark"), name)


# msprobe key -> (value classes accepted, the session's reading of it, what an accepted value must give;
# null means msprobe's default, as msprobe reads it)
MSPROBE: dict[str, tuple[frozenset[str], Callable[[probe.Session], Any], Callable[[Any], Any]]] = {
    "task": (frozenset(), lambda s: None, lambda v: None),
    "dump_path": (_SHORT_STRS, lambda s: s.options.out, Path),  # relative: under the working directory
    "rank": (frozenset({"none", "empty_list"}), lambda s: s.options.ranks.ranges, lambda v: None),
    "step": (frozenset({"none", "empty_list"}), lambda s: s.options.steps.ranges, lambda v: None),
    "level": (frozenset(), lambda s: None, lambda v: None),
    "async_dump": (_BOOL, lambda s: s.options.async_flush, lambda v: v),
    "extra_info": (_BOOL, lambda s: s.options.stack, lambda v: v),
    "statistics": (frozenset({"empty_dict"}), lambda s: (s.options.modes, s.options.ops.globs),
                   lambda v: (("stats",), None)),
    "block.scope": (frozenset({"none", "empty_list"}),
                    lambda s: (s.options.ops.globs, s.options.modules.globs), lambda v: (None, None)),
    "block.list": (frozenset({"none", "empty_list", "big_range_str", "truthy_str", "false_str", "long_str"}),
                   lambda s: s.options.ops.globs, lambda v: (f"*{v}*",) if v else None),
    "block.data_mode": (frozenset({"none", "empty_list"}), lambda s: s.options.phases,
                        lambda v: frozenset(PHASES)),
    "block.summary_mode": (frozenset(), lambda s: None, lambda v: None),
    "block.pert_mode": (_NONE, lambda s: _mode_of(s, "free_benchmark").perturbation.name,
                        lambda v: "improve_precision"),
    "block.handler_type": (_NONE, _fb("handler"), lambda v: "check"),
    "block.if_preheat": (_BOOL | _NONE, _fb("preheat"), lambda v: bool(v)),
    "block.preheat_step": (_NONE | {"int", "huge"}, _fb("preheat_steps"), lambda v: 15 if v is None else v),
    "block.max_sample": (_NONE | {"int", "huge"}, _fb("max_sample"), lambda v: 20 if v is None else v),
    "block.fuzz_stage": (frozenset(), lambda s: None, lambda v: None),
    "block.fuzz_device": (frozenset(), lambda s: None, lambda v: None),
    "block.fuzz_level": (frozenset(), lambda s: None, lambda v: None),
}


_JSON_BREAKERS = ("huge", "long_str", "nested_list")


def _json_cases(table: dict[str, tuple[frozenset[str], Any, Any]]) -> list[tuple[str, str]]:
    """(key, value class) for a table of msprobe keys, whose checks are the adapters' own: each value
    class the key accepts, the first refused one of each JSON type (a check refuses a type on one
    path) and the values that once broke them."""
    cases = []
    for key, (accepted, _, _) in sorted(table.items()):
        refused_types: set[type] = set()
        for name, value in JSON_HOSTILE.items():
            first_refused = name not in accepted and type(value) not in refused_types
            if first_refused:
                refused_types.add(type(value))
            if name in accepted or first_refused or name in _JSON_BREAKERS:
                cases.append((key, name))
    return cases


@pytest.mark.parametrize(("key", "value"), _json_cases(MSPROBE))
def test_hostile_value_in_an_msprobe_config(tmp_path, monkeypatch, key, value):
    monkeypatch.chdir(tmp_path)  # a relative dump_path lands here
    hostile = JSON_HOSTILE[value]
    name = key.removeprefix("block.")
    if key.startswith("block."):
        config = {"task": "free_benchmark", "dump_path": str(tmp_path / "run"),
                  "free_benchmark": {name: hostile}}
    else:
        config = {"task": "statistics", "dump_path": str(tmp_path / "run"), name: hostile}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    accepted, read, expected = MSPROBE[key]
    session = _outcome(lambda: probe.mode(config=path), name, value in accepted, value)
    if session is not None:
        assert read(session) == expected(hostile), f"{key}={value}: {read(session)!r}"


# -- msprobe's monitor config.json ----------------------------------------------------------------

def _monitor(field: str) -> Callable[[probe.Session], Any]:
    return lambda session: getattr(_mode_of(session, "monitor").config, field)


def _targets(session: probe.Session) -> list[tuple[str, list[str]]]:
    return [(t.pattern, sorted(t.slots)) for t in _mode_of(session, "monitor").config.targets]


MONITOR_FILE: dict[str, tuple[frozenset[str], Callable[[probe.Session], Any], Callable[[Any], Any]]] = {
    # empty or absent: msprobe's full monitoring, every slot of every module
    "targets": (frozenset({"none", "empty_dict"}), _targets, lambda v: [("*", sorted(SLOTS))]),
    "module_ranks": (frozenset({"none", "empty_list", "empty_str", "int", "huge", "big_range_str"}),
                     lambda s: s.options.ranks, lambda v: IntSet.parse("ranks", v or None)),
    "ops": (frozenset(), lambda s: None, lambda v: None),
    "eps": (frozenset({"int", "huge", "float"}), _monitor("eps"), float),
    "start_step": (frozenset({"int", "huge"}), _monitor("start_step"), lambda v: v),
    "step_interval": (frozenset({"int", "huge"}), _monitor("step_interval"), lambda v: v),
    "alert": (frozenset({"empty_dict"}), _monitor("turbulence"), lambda v: None),
    "xy_distribution": (_BOOL, _monitor("xy_distribution"), lambda v: v),
    "format": (frozenset(), lambda s: None, lambda v: None),  # ignored, but only one of msprobe's values
    # not implemented: accepted only disabled, changing nothing
    "cc_distribution": (frozenset({"none", "false", "empty_dict", "empty_list", "empty_str"}),
                        lambda s: s.options.modes, lambda v: ("monitor",)),
}


@pytest.mark.parametrize(("key", "value"), _json_cases(MONITOR_FILE))
def test_hostile_value_in_a_monitor_config(tmp_path, key, value):
    config: dict[str, Any] = {"targets": {"*": {"output": "tensor"}}, key: JSON_HOSTILE[value]}
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(config))
    accepted, read, expected = MONITOR_FILE[key]
    session = _outcome(lambda: probe.mode(config=path, out=tmp_path / "run", model=torch.nn.Linear(2, 2)),
                       key, value in accepted, value)
    if session is not None:
        assert read(session) == expected(JSON_HOSTILE[value]), f"{key}={value}: {read(session)!r}"


_HOSTILE_ALERTS = [
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": "x"}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"warmup": -1}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"decay": [1]}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"decay": 1}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"kinds": [["weight"]]}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"metrics": ["shape"]}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": []}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"window": 3}}]},
    {"rules": [{"rule_name": ["AnomalyNan"]}]}, {"rules": [5]}, {"rules": {}}, {"dump": "yes"},
    {"rules": [], "email": "ops@example.com"},
]


@pytest.mark.parametrize("alert", range(len(_HOSTILE_ALERTS)))
def test_hostile_alert_in_a_monitor_config(tmp_path, alert):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"targets": {"*": {"output": "tensor"}}, "alert": _HOSTILE_ALERTS[alert]}))
    with pytest.raises(ProbeError, match="alert") as refused:
        probe.mode(config=path, out=tmp_path / "run", model=torch.nn.Linear(2, 2))
    assert not (tmp_path / "run").exists(), str(refused.value)


def test_an_alert_in_a_monitor_config_is_honoured(tmp_path):
    path = tmp_path / "monitor.json"
    rule = {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "warmup": 2, "kinds": ["weight"]}}
    path.write_text(json.dumps({"targets": {"*": {"output": "tensor"}},
                                "alert": {"rules": [rule], "dump": True}}))
    session = probe.mode(config=path, out=tmp_path / "run", model=torch.nn.Linear(2, 2))
    turbulence = _mode_of(session, "monitor").config.turbulence
    assert (turbulence.threshold, turbulence.warmup, turbulence.kinds) == (0.5, 2, ("weight",))


def test_a_slot_spec_past_any_tuple_is_refused_naming_the_target(tmp_path):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"targets": {"*": {"output": "tuple[99999999999999]:0"}}}))
    with pytest.raises(ProbeError, match=r"monitor target '\*' output"):
        probe.mode(config=path, out=tmp_path / "run", model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("value", ["csv", "tensorboard", "api"])
def test_msprobe_monitor_formats_are_accepted_and_ignored(tmp_path, value):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"targets": ["*"], "format": value}))
    with pytest.warns(probe.ProbeWarning, match="'format' ignored"):
        session = probe.mode(config=path, out=tmp_path / "run", model=torch.nn.Linear(2, 2))
    assert session.options.modes == ("monitor",)


@pytest.mark.parametrize(("content", "message"), [
    (b"\xff\xfe{}", "is not UTF-8"),
    (b"[1, 2]", "must hold a JSON object, not list"),
    (b'"stats"', "must hold a JSON object, not str"),
    (b"null", "must hold a JSON object, not NoneType"),
    (b'{"mode": "stats", "steps": [', "cannot read"),
    (b"", "cannot read"),
    (b'{"mode": "stats", "eps": NaN}', "NaN is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "config"),
])
def test_unreadable_config_files(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ProbeError, match="option 'config'") as error:
        probe.mode(config=path, out=tmp_path / "run")
    assert message in str(error.value)


def test_a_config_naming_a_config_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"mode": "stats", "config": str(path)}))
    with pytest.raises(ProbeError, match="configs do not nest"):
        probe.mode(config=path, out=tmp_path / "run")


def test_a_config_that_is_not_a_small_file_is_refused(tmp_path):
    directory = tmp_path / "dir.json"
    directory.mkdir()
    with pytest.raises(ProbeError, match="cannot read"):
        probe.mode(config=directory)
    huge = tmp_path / "checkpoint.json"
    with huge.open("wb") as f:
        f.truncate(17 << 20)  # sparse: nothing is written
    with pytest.raises(ProbeError, match="a config file is at most"):
        probe.mode(config=huge)


# -- values with a defined meaning ------------------------------------------------------------


def test_huge_step_ranges_are_held_as_ranges():
    started = time.perf_counter()
    text = IntSet.parse("steps", "0-1000000000")
    span = IntSet.parse("steps", range(10**12))
    mixed = IntSet.parse("steps", [7, "0-2", 3, range(20, 30, 5), range(9, 4, -1)])
    assert time.perf_counter() - started < 0.1
    assert 1_000_000_000 in text and 1_000_000_001 not in text
    assert 10**12 - 1 in span and 10**12 not in span
    assert [s for s in range(32) if s in mixed] == [0, 1, 2, 3, 5, 6, 7, 8, 9, 20, 25]
    assert mixed.to_json() == ["0-3", "5-9", "range(20, 30, 5)"]
    assert IntSet.parse("steps", None).to_json() is None and 10**30 in IntSet.parse("steps", None)


def test_selected_steps_are_recorded_and_summarized(tmp_path):
    model = torch.nn.Linear(2, 2)
    with probe.mode("stats", out=tmp_path / "run", steps=[range(0, 10**12, 3), "4"]) as session:
        for _ in range(6):
            model(torch.ones(1, 2)).sum().backward()
            session.step()
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 3, 4]
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["options"]["steps"]
    assert recorded == [4, "range(0, 1000000000000, 3)"]


@pytest.mark.parametrize(("key", "value"), [
    ("steps", []), ("ranks", ()), ("steps", "4-1"), ("steps", [True]), ("ranks", b"\x00"),
    ("steps", range(-3, 2)), ("steps", "9" * 40), ("ops", ""), ("modules", {"fc": 1}),
])
def test_selections_that_select_nothing_or_guess_are_refused(tmp_path, key, value):
    with pytest.raises(ProbeError, match=f"option '{key}'"):
        probe.mode("stats", out=tmp_path / "run", **{key: value})


@pytest.mark.parametrize(("mode", "key", "value"), [
    ("stats", "overwrite", 1), ("stats", "stack", "yes"), ("stats", "async_flush", "false"),
    ("stats", "inputs", 0), ("dump", "checksum", "True"), ("free_benchmark", "preheat", "no"),
    ("free_benchmark", "preheat", 1), ("monitor", "xy_distribution", "false"),
])
def test_bool_options_take_only_bools(tmp_path, mode, key, value):
    with pytest.raises(ProbeError, match=f"option '{key}': expected True or False"):
        probe.mode(mode, out=tmp_path / "run", **_base(mode), **{key: value})
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"mode": mode, **({"targets": ["*"]} if mode == "monitor" else {}),
                                  key: value}))
    with pytest.raises(ProbeError, match=f"option '{key}': expected True or False"):
        probe.mode(config=config, out=tmp_path / "run", **({"model": torch.nn.Linear(2, 2)}
                                                          if mode == "monitor" else {}))


def test_preheat_false_string_does_not_turn_preheat_on(tmp_path):
    assert probe.mode("free_benchmark", out=tmp_path / "a", preheat=True).modes[0].preheat is True
    with pytest.raises(ProbeError, match="'preheat'"):
        probe.mode("free_benchmark", out=tmp_path / "b", preheat="no")


@pytest.mark.parametrize("key", ["async_dump", "extra_info"])
def test_msprobe_flags_take_only_json_booleans(tmp_path, key):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "statistics", "dump_path": str(tmp_path / "run"), key: "false"}))
    with pytest.raises(ProbeError, match=f"option '{key}'"):
        probe.mode(config=path)
    path.write_text(json.dumps({"task": "statistics", "dump_path": str(tmp_path / "run"), key: False}))
    session = probe.mode(config=path)
    assert (session.options.async_flush, session.options.stack)[key == "extra_info"] is False


def test_module_ranks_given_directly_is_refused_naming_ranks(tmp_path):
    with pytest.raises(ProbeError, match=r"module_ranks.*use the session option ranks="):
        probe.mode("monitor", out=tmp_path / "run", targets=["*"], module_ranks=[0],
                   model=torch.nn.Linear(2, 2))


def test_module_ranks_in_a_monitor_config_selects_the_ranks(tmp_path):
    model = torch.nn.Linear(2, 2)
    for ranks, recorded in (("1", False), ("0", True), ([], True)):
        path = tmp_path / "monitor.json"
        path.write_text(json.dumps({"targets": {"*": {"output": "tensor"}}, "module_ranks": ranks}))
        out = tmp_path / f"run{ranks}"
        with probe.mode(config=path, out=out, model=model) as session:
            model(torch.ones(1, 2)).sum().backward()
            session.step()
        assert (out / "rank0").exists() is recorded
        if recorded:
            assert probe.load(out).monitor(0)
    path.write_text(json.dumps({"targets": ["*"], "module_ranks": "0,x"}))
    with pytest.raises(ProbeError, match="option 'module_ranks'"):
        probe.mode(config=path, out=tmp_path / "bad", model=model)


def test_upcast_dtype_from_a_json_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"mode": "upcast", "upcast_dtype": "float64"}))
    assert probe.mode(config=path, out=tmp_path / "run").modes[0].dtype == torch.float64
    path.write_text(json.dumps({"mode": "upcast", "upcast_dtype": "float16"}))
    with pytest.raises(ProbeError, match="option 'upcast_dtype': 'float16' is not one of"):
        probe.mode(config=path, out=tmp_path / "run")


@pytest.mark.parametrize(("out", "message"), [
    (b"runs/a", "expected a path"), ("", "is not a usable path"), ("a\0b", "is not a usable path"),
    ("x" * 1000, "is not a usable path"), (123, "expected a path"),
])
def test_unusable_out_paths(tmp_path, monkeypatch, out, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProbeError, match="option 'out'") as error:
        probe.mode("stats", out=out)
    assert message in str(error.value)
    assert len(str(error.value)) < 400, "a message shows a long value shortened"


def test_a_dangling_symlink_out_is_refused(tmp_path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ProbeError, match=r"option 'out': .* is a symbolic link to nothing"):
        probe.mode("stats", out=link)


def test_a_value_whose_repr_fails_is_still_named(tmp_path):
    with pytest.raises(ProbeError, match=r"option 'steps': expected .* got <_BadRepr"):
        probe.mode("stats", out=tmp_path / "run", steps=_BadRepr())


def test_memory_budget_beyond_this_machine_is_refused(tmp_path):
    with pytest.raises(ProbeError, match=r"option 'memory_budget'.*more than this machine's memory"):
        probe.mode("dump", out=tmp_path / "run", memory_budget=10**30, shard_size=10**30)


def test_options_given_directly_win_over_the_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"mode": "stats", "ops": ["mm"], "stack": True}))
    session = probe.mode(config=path, out=tmp_path / "run", stack=False)
    assert session.options.stack is False and session.options.ops.globs == ("mm",)
    assert isinstance(Path(session.options.out), Path)
