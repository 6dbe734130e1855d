"""Option values, one per path through each option's check: refused with a ProbeError naming the
option, or accepted and honoured (the value the session resolved is read back from it).

The options are read from the registry: the session's common options and each registered mode's
config fields (``probe.vocabulary.option_fields``). An option whose check a factory made (bool,
integer, number, choice, globs, int set) gets its cases from that check alone: for an integer
``>= m``, ``m`` accepted, ``m - 1``, a bool and a float refused, None by what the check says; so a
new option of those kinds is tried without editing this file. An option with a check of its own
says its family (which values reach different paths of such a check) and what it accepts. The
same cases are given through a JSON config file (one accepted, one refused per option: the file
is one more way to the same check), and msprobe's config keys per JSON type the first value
accepted and the first refused. Never another exception type, never a run directory left by a
refused option.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import probe
from probe import ProbeError
from probe.modes.config import CONFIGS
from probe.modes.monitor.config import SLOTS
from probe.modes.monitor.options import TRACE_KEYS
from probe.modes.registry import MODES
from probe.options import _COMMON_KEYS, DEFAULT_CHECKSUMS, PHASES, IntSet
from probe.vocabulary.option_fields import OptionSpec, boolean, default_of, option_specs
from probe.vocabulary.option_values import Patterns
from probe.vocabulary.session_options import Options


@pytest.fixture(autouse=True)
def _own_warn_once_state(monkeypatch):
    """The config keys tried here warn once per process: keep those notices from other tests' files."""
    monkeypatch.setattr(probe.errors, "_warned", set())


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr fails")


# The value classes of msprobe's config keys, as JSON writes them ("none" is null).
JSON_HOSTILE = {
    "int": 5, "negative": -1, "huge": 10**30, "true": True, "false": False, "float": 1.5, "none": None,
    "empty_str": "", "truthy_str": "no", "false_str": "false", "long_str": "x" * 100_000,
    "big_range_str": "0-1000000000", "empty_list": [], "nested_list": [[1]], "list_of_null": [None],
    "dict": {"a": 1}, "empty_dict": {}, "list_of_dict": [{}],
}


# -- one case per path of each option's check ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One value that takes one path through an option's check: accepted (and then ``honoured``
    must hold for the value the session resolved), or refused naming the option."""

    path: str
    make: Callable[[], Any]  # a fresh value per use: lists may be mutated, generators are consumed
    accepted: bool
    honoured: Callable[[Any], bool] = lambda resolved: True


def _refused(path: str, value: Any) -> Case:
    return Case(path, lambda: value, False)


def _equal(value: Any) -> Callable[[Any], bool]:
    return lambda resolved: resolved == value and type(resolved) is type(value)


def _accepted(path: str, value: Any, expected: Any) -> Case:
    return Case(path, lambda: value, True, _equal(expected))


def _holds(held: int, not_held: int) -> Callable[[Any], bool]:
    return lambda resolved: isinstance(resolved, IntSet) and held in resolved and not_held not in resolved


def _bool_cases(default: Any) -> list[Case]:
    # parse_bool: a bool, or refused (an int is the value a truthiness check would let through)
    other = not default if isinstance(default, bool) else True
    return [_accepted("a bool", other, other), _refused("not a bool", 1)]


def _integer_cases(minimum: int, none: bool, default: Any) -> list[Case]:
    # parse_int: an Integral >= minimum; a bool is an Integral and is refused; None where allowed
    given = minimum if minimum != default else minimum + 1  # a value the default cannot pass for
    return [_accepted("an int at or above the minimum", given, given),
            _refused("below the minimum", minimum - 1), _refused("a bool", True),
            _refused("not an int", float(given)),
            _accepted("None", None, None) if none else _refused("None", None)]


def _number_cases(minimum: float, default: Any) -> list[Case]:
    # parse_number: a Real (not a bool) whose float is finite and >= minimum; an int past float
    # range overflows to inf
    given = minimum if minimum != default else minimum + 1
    return [_accepted("a number at or above the minimum", int(given), float(given)),
            _refused("below the minimum", minimum - 1), _refused("a bool", True),
            _refused("not a number", "1"),
            _refused("not finite", math.nan), _refused("past float range", 10**400)]


def _choice_cases(choices: list[str], default: Any) -> list[Case]:
    # parse_choice: one of the strings; a near-miss string and a non-string are refused
    given = next((c for c in choices if c != default), choices[0])
    return [_accepted("a choice", given, given),
            _refused("a string not among the choices", given.upper() + "?"),
            _refused("not a string", [given])]


def _globs_cases() -> list[Case]:
    # Patterns.parse over _str_list: None, a string, a list of strings; the other types, a list with
    # a non-string, an empty list, an empty glob refused
    return [_accepted("None: all", None, None), _accepted("a glob", "fc*", ("fc*",)),
            _accepted("a list of globs", ["fc*", "mm"], ("fc*", "mm")), _refused("not a string or list", 5),
            _refused("a list holding a non-string", ["fc*", 5]), _refused("an empty list", []),
            _refused("an empty glob", "")]


def _int_set_cases() -> list[Case]:
    # IntSet.parse: None (all), an int, a string of ranges, a range, a list of those; refused: another
    # type, a bool, an item of another type or negative, a negative range, an unreadable or empty
    # string range, a set selecting nothing
    return [Case("None: all", lambda: None, True, lambda resolved: resolved.ranges is None),
            Case("an int", lambda: 10**30, True, _holds(10**30, 0)),
            Case("a string of ranges", lambda: "0-1000000000,5", True, _holds(10**9, 10**9 + 1)),
            Case("a range", lambda: range(3, 10**12, 3), True, _holds(10**12 - 1, 4)),
            Case("a list of those", lambda: {2, "4-5", range(7, 8)}, True, _holds(7, 6)),
            _refused("another type", 1.5), _refused("a bool", True),
            _refused("an item of another type", [[1]]),
            _refused("a negative item", [-1]), _refused("a negative range", range(-3, 2)),
            _refused("an unreadable string", "0,x"), _refused("an empty string range", "5,4-1"),
            _refused("selects nothing", [])]


def _option_field(mode: str, key: str) -> tuple[dataclasses.Field[Any], OptionSpec] | None:
    """The option field behind ``key`` and its spec (``config`` has none: it is read before any field)."""
    return (option_specs(Options) if key in _COMMON_KEYS else option_specs(CONFIGS[mode])).get(key)


def _derived_cases(mode: str, key: str) -> list[Case] | None:
    """The cases of an option whose check was made by a factory of ``option_fields`` (read from the
    check itself: its parser, or the range or choices its docs line states); None for a check of its
    own."""
    found = _option_field(mode, key)
    if found is None or key in OWN_CHECK:
        return None
    field, spec = found
    check, default = spec.check, default_of(field)
    if check.parse == Patterns.parse:  # bound classmethods: equal, not identical
        return _globs_cases()
    if check.parse == IntSet.parse:
        return _int_set_cases()
    if check.accepts == boolean().accepts:
        return _bool_cases(default)
    if made := re.fullmatch(r"int >= (-?\d+)(, `None`)?", check.accepts):
        return _integer_cases(int(made[1]), made[2] is not None, default)
    if made := re.fullmatch(r"number >= (-?[\d.]+)", check.accepts):
        return _number_cases(float(made[1]), default)
    if re.fullmatch(r"`'[^`]*'`( \\\| `'[^`]*'`)*", check.accepts):
        return _choice_cases(re.findall(r"`'([^`]*)'`", check.accepts), default)
    return None


# -- options whose field declares a check of its own ---------------------------------------------

# The family of each such option (for ``config``: no field, it is read before any): which values
# reach different paths through checks of that family.
OWN_CHECK: dict[str, str] = {
    "out": "path", "config": "mapping", "hparams": "mapping", "alert": "mapping", "trace_options": "mapping",
    "phases": "names", "checksums": "names", "metrics": "names", "trace_modes": "names", "recipes": "names",
    "targets": "names", "anomaly_rules": "names",
    "model": "object", "scaler": "object", "plan": "object", "recipe": "object", "upcast_dtype": "object",
    "inputs": "object", "saturation": "object", "module_ranks": "object",
}
# family -> the value classes of HOSTILE tried (one per path a check of that family takes).
FAMILY_PATHS: dict[str, tuple[str, ...]] = {
    "path": ("none", "truthy_str", "long_str", "empty_str", "bytes", "int"),
    "mapping": ("none", "dict", "empty_dict", "empty_list", "truthy_str", "int"),
    "names": ("none", "truthy_str", "empty_str", "empty_list", "nested_str_list", "list_of_object", "int",
              "true"),
    "object": ("none", "true", "int", "truthy_str", "dtype", "tensor", "object", "dict", "empty_list"),
}
HOSTILE: dict[str, Callable[[], Any]] = {
    "int": lambda: 5, "huge": lambda: 10**30, "true": lambda: True, "false": lambda: False,
    "bytes": lambda: b"stats", "dict": lambda: {"a": 1}, "empty_dict": dict, "none": lambda: None,
    "object": object, "empty_str": lambda: "", "truthy_str": lambda: "no", "long_str": lambda: "x" * 100_000,
    "empty_list": list, "nested_str_list": lambda: [["a"]], "tensor": lambda: torch.ones(2),
    "dtype": lambda: torch.float16, "list_of_object": lambda: [object()],
}
# The value classes each such option accepts (the others must be refused naming it).
_BOOL = frozenset({"true", "false"})
_NONE = frozenset({"none"})
_SHORT_STRS = frozenset({"big_range_str", "truthy_str", "false_str"})  # msprobe's paths
ACCEPTED: dict[str, frozenset[str]] = {
    "out": _NONE | {"truthy_str"},  # a relative path; 100,000 characters is no usable path
    "model": _NONE, "config": _NONE | {"empty_dict"}, "hparams": _NONE | {"dict", "empty_dict"},
    "checksums": _BOOL, "phases": frozenset(), "inputs": _BOOL, "saturation": _BOOL,
    "alert": frozenset({"empty_dict"}), "anomaly_rules": frozenset({"empty_list"}), "scaler": _NONE,
    "targets": frozenset(), "metrics": frozenset(), "module_ranks": frozenset(), "trace_modes": frozenset(),
    "trace_options": frozenset({"empty_dict"}),
    "upcast_dtype": frozenset(), "recipes": frozenset(), "plan": frozenset(), "recipe": frozenset(),
}
_MONITOR_FIELDS = {"alert": "turbulence"}  # the rule the alert block leaves in force


def _expected(key: str, given: Any) -> Any:
    """What the session resolves an accepted ``given`` of an own-check option to."""
    if key == "out":
        return None if given is None else Path(given)
    if key == "checksums":
        return DEFAULT_CHECKSUMS if given else frozenset()
    if key == "config":
        return ("stats",)
    if key in ("alert", "anomaly_rules"):  # an alert block with no rules turns the default rule off
        return None if key == "alert" else ()
    return given


def _own_cases(key: str) -> list[Case]:
    cases = []
    for name in FAMILY_PATHS[OWN_CHECK[key]]:
        accepted = name in ACCEPTED[key]
        honoured = _equal(_expected(key, HOSTILE[name]())) if accepted else Case.honoured
        cases.append(Case(name, HOSTILE[name], accepted, honoured))
    return cases


def option_cases(mode: str, key: str) -> list[Case]:
    """The cases of one option, one per path of its check."""
    derived = _derived_cases(mode, key)
    if derived is not None:
        return derived
    return _own_cases(key)


def _resolved(session: probe.Session, mode: str, key: str) -> Any:
    """The value of ``key`` as the session will use it."""
    if key in _COMMON_KEYS:
        value = getattr(session.options, key)
        return value.globs if isinstance(value, Patterns) else value
    if key == "config":
        return session.options.modes
    (built,) = [m for m in session.modes if m.name == mode]  # with model=, checksums is one too
    return getattr(built.config, _MONITOR_FIELDS.get(key, key))


def _mode_cases() -> list[tuple[str, str]]:
    """(mode, option): the common options (under stats) and each registered mode's config fields."""
    cases = [("stats", key) for key in sorted(_COMMON_KEYS | {"config"})]
    cases += [(name, key) for name, cls in sorted(MODES.items()) for key in sorted(cls.option_names)]
    return cases


def _fuzz_cases() -> list[Any]:
    return [pytest.param(mode, key, case, id=f"{mode}.{key}-{case.path}")
            for mode, key in _mode_cases() for case in option_cases(mode, key)]


def test_every_option_has_cases():
    """An option whose check is its own must say its family and what it accepts before it can be
    judged; every other option's cases come from its check."""
    unjudged = [f"{mode}.{key}" for mode, key in _mode_cases()
                if _derived_cases(mode, key) is None and (key not in OWN_CHECK or key not in ACCEPTED)]
    assert not unjudged, f"a check of its own: say its family (OWN_CHECK) and what it accepts: {unjudged}"


def _base(mode: str, key: str = "") -> dict[str, Any]:
    """What a mode needs besides the option under test (``key``)."""
    if mode == "monitor":
        needs = {"on_anomaly": "trace"} if key in TRACE_KEYS else {}  # what they configure
        return {"targets": ["*"], "model": torch.nn.Linear(2, 2), **needs}
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


@pytest.mark.parametrize("value", FAMILY_PATHS["names"] + ("bytes", "dtype"))
def test_hostile_modes_argument(tmp_path, value):
    _outcome(lambda: probe.mode(HOSTILE[value](), out=tmp_path / "run"), "mode", False, value)
    assert not (tmp_path / "run").exists()  # none of these names a mode


@pytest.mark.parametrize(("mode", "key", "case"), _fuzz_cases())
def test_option_value_by_path(tmp_path, monkeypatch, mode, key, case):
    monkeypatch.chdir(tmp_path)  # a relative out= lands here
    given = case.make()
    kwargs = {"out": tmp_path / "run", **_base(mode, key), key: given}
    session = _outcome(lambda: probe.mode(mode, **kwargs), key, case.accepted, case.path)
    if session is None:
        assert not (tmp_path / "run").exists(), "a refused option must leave nothing behind"
        return
    resolved = _resolved(session, mode, key)
    assert case.honoured(resolved), f"{key}={given!r}: {resolved!r}"
    if key != "model":  # a model that is not the one trained would attribute nothing
        _use(session)


def _as_json(value: Any) -> Any:
    """``value`` as a JSON config holds it (a set or range has no JSON form: ``_NO_JSON``)."""
    try:
        written = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return _NO_JSON
    return written if written == value and type(written) is type(value) else _NO_JSON


_NO_JSON = object()


def _config_file_cases() -> list[Any]:
    """Per option: the first accepted and the first refused case JSON can write. The file is one
    more way to reach the same check (the paths through it are the direct cases')."""
    params = []
    for mode, key in _mode_cases():
        if key in ("config", "model"):
            continue
        chosen: dict[bool, Case] = {}
        for case in option_cases(mode, key):
            if _as_json(case.make()) is not _NO_JSON:
                chosen.setdefault(case.accepted, case)
        params += [pytest.param(mode, key, case, id=f"{mode}.{key}-{case.path}") for case in chosen.values()]
    return params


@pytest.mark.parametrize(("mode", "key", "case"), _config_file_cases())
def test_option_value_in_a_config_file(tmp_path, monkeypatch, mode, key, case):
    monkeypatch.chdir(tmp_path)  # a relative out lands here
    config = tmp_path / "config.json"
    base = {k: v for k, v in _base(mode, key).items() if k not in (key, "model")}
    given = case.make()
    config.write_text(json.dumps({"mode": mode, **base, key: given}))
    extra: dict[str, Any] = {"model": torch.nn.Linear(2, 2)} if mode == "monitor" else {}
    if key != "out":  # given directly it would win over the file's
        extra["out"] = tmp_path / "run"
    session = _outcome(lambda: probe.mode(config=config, **extra), key, case.accepted, case.path)
    if session is not None:
        resolved = _resolved(session, mode, key)
        assert case.honoured(resolved), f"{key}={given!r}: {resolved!r}"


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


def _json_shape(value: Any) -> tuple[Any, ...]:
    """What an adapter's check may branch on in a JSON value: its type, and for a string whether it
    is empty or past a file name's length (255: a path's check fails there)."""
    if isinstance(value, str):
        return str, not value, len(value) > 255
    return (type(value),)


def _json_cases(table: dict[str, tuple[frozenset[str], Any, Any]]) -> list[tuple[str, str]]:
    """(key, value class) for a table of msprobe keys, whose checks are the adapters' own: per
    shape of JSON value (:func:`_json_shape`), the first value class the key accepts and the first
    it refuses."""
    cases = []
    for key, (accepted, _, _) in sorted(table.items()):
        seen: set[tuple[Any, ...]] = set()
        for name, value in JSON_HOSTILE.items():
            path = (*_json_shape(value), name in accepted)
            if path not in seen:
                seen.add(path)
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
    text = IntSet.parse("steps", "0-1000000000")
    span = IntSet.parse("steps", range(10**12))
    mixed = IntSet.parse("steps", [7, "0-2", 3, range(20, 30, 5), range(9, 4, -1)])
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
