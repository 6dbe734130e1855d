"""Hostile option values: each is accepted (and then works) or is a ProbeError naming the option.

Every option of ``probe.mode`` (the common ones and each registered mode's
``option_names``) is tried with wrong types, bools where ints are expected, extreme
numbers, empty and nested containers, a recursive list, a generator and very long
strings, directly and from JSON config files (ours, msprobe's and msprobe's monitor
form). Never another exception type, never a hang, never a huge allocation.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import probe
from probe import ProbeError
from probe.modes.registry import MODES
from probe.options import _COMMON_KEYS, IntSet


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
JSON_HOSTILE = {
    "int": 5, "negative": -1, "huge": 10**30, "true": True, "false": False, "float": 1.5, "null": None,
    "empty_str": "", "truthy_str": "no", "false_str": "false", "long_str": "x" * 100_000,
    "big_range_str": "0-1000000000", "empty_list": [], "nested_list": [[1]], "list_of_null": [None],
    "dict": {"a": 1}, "empty_dict": {}, "list_of_dict": [{}],
}


def _mode_cases() -> list[tuple[str, str]]:
    cases = [("stats", key) for key in sorted(_COMMON_KEYS | {"config"})]
    cases += [(name, key) for name, cls in sorted(MODES.items()) for key in sorted(cls.option_names)]
    return cases


def _base(mode: str) -> dict[str, Any]:
    """What a mode needs besides the option under test."""
    return {"targets": ["*"], "model": torch.nn.Linear(2, 2)} if mode == "monitor" else {}


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


def _try(mode: Any, kwargs: dict[str, Any], key: str) -> probe.Session | None:
    try:
        return probe.mode(mode, **kwargs)
    except ProbeError as error:
        assert _names_option(str(error), key), f"{key}: {error}"
        return None


@pytest.mark.parametrize("value", sorted(HOSTILE))
def test_hostile_modes_argument(tmp_path, value):
    session = _try(HOSTILE[value](), {"out": tmp_path / "run"}, "mode")
    assert session is None  # none of these names a mode
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", sorted(HOSTILE))
@pytest.mark.parametrize(("mode", "key"), _mode_cases())
def test_hostile_option_value(tmp_path, monkeypatch, mode, key, value):
    monkeypatch.chdir(tmp_path)  # a relative out= lands here
    kwargs = {"out": tmp_path / "run", **_base(mode), key: HOSTILE[value]()}
    started = time.perf_counter()
    session = _try(mode, kwargs, key)
    assert time.perf_counter() - started < 2, "validation must not expand or walk the value"
    if session is None:
        assert not (tmp_path / "run").exists(), "a refused option must leave nothing behind"
    elif key != "model":  # a model that is not the one trained would attribute nothing
        _use(session)


@pytest.mark.parametrize("value", sorted(JSON_HOSTILE))
@pytest.mark.parametrize(("mode", "key"), [c for c in _mode_cases() if c[1] not in ("config", "model")])
def test_hostile_value_in_a_config_file(tmp_path, mode, key, value):
    config = tmp_path / "config.json"
    base = {"targets": ["*"]} if mode == "monitor" else {}
    config.write_text(json.dumps({"mode": mode, **base, key: JSON_HOSTILE[value]}))
    extra = {"model": torch.nn.Linear(2, 2)} if mode == "monitor" else {}
    session = _try(None, {"config": config, "out": tmp_path / "run", **extra}, key)
    if session is not None:
        assert key not in _BOOL_OPTIONS or isinstance(JSON_HOSTILE[value], bool)


_BOOL_OPTIONS = {"overwrite", "stack", "async_flush", "inputs", "checksum", "preheat", "xy_distribution",
                 "wg_distribution", "mv_distribution", "param_distribution", "ur_distribution",
                 "forward_only", "backward_only", "reduce_ranks", "tensorboard"}

_MSPROBE_KEYS = ["task", "dump_path", "rank", "step", "level", "async_dump", "extra_info", "statistics"]
_MSPROBE_BLOCK_KEYS = ["scope", "list", "data_mode", "summary_mode", "pert_mode", "handler_type",
                       "if_preheat", "preheat_step", "max_sample", "fuzz_stage", "fuzz_device", "fuzz_level"]


@pytest.mark.parametrize("value", sorted(JSON_HOSTILE))
@pytest.mark.parametrize("key", _MSPROBE_KEYS + [f"block.{k}" for k in _MSPROBE_BLOCK_KEYS])
def test_hostile_value_in_an_msprobe_config(tmp_path, key, value):
    hostile = JSON_HOSTILE[value]
    if key.startswith("block."):
        key = key.removeprefix("block.")
        config = {"task": "free_benchmark", "dump_path": str(tmp_path / "run"),
                  "free_benchmark": {key: hostile}}
    else:
        config = {"task": "statistics", "dump_path": str(tmp_path / "run"), key: hostile}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with contextlib.suppress(ProbeError):
        probe.mode(config=path)


_MONITOR_FILE_KEYS = ["targets", "module_ranks", "ops", "eps", "start_step", "step_interval", "alert",
                      "xy_distribution", "format", "cc_distribution"]
_HOSTILE_ALERTS = [
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": "x"}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"warmup": -1}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"decay": [1]}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"kinds": [["weight"]]}}]},
    {"rules": [{"rule_name": "AnomalyTurbulence", "args": []}]},
    {"rules": [{"rule_name": ["AnomalyNan"]}]}, {"rules": [5]}, {"rules": {}}, {"dump": "yes"},
    {"targets": {"*": {"output": "tuple[99999999999999]:0"}}},
]


@pytest.mark.parametrize("value", sorted(JSON_HOSTILE) + [f"alert{i}" for i in range(len(_HOSTILE_ALERTS))])
@pytest.mark.parametrize("key", _MONITOR_FILE_KEYS)
def test_hostile_value_in_a_monitor_config(tmp_path, key, value):
    config: dict[str, Any] = {"targets": {"*": {"output": "tensor"}}}
    if value.startswith("alert"):
        config.update(_HOSTILE_ALERTS[int(value.removeprefix("alert"))])
    else:
        config[key] = JSON_HOSTILE[value]
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(config))
    with contextlib.suppress(ProbeError):
        probe.mode(config=path, out=tmp_path / "run", model=torch.nn.Linear(2, 2))


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
