"""Validated options of a probe session.

Everything a user can pass to ``probe.mode(...)`` (or put in a JSON config file)
is checked here, once, before any op is traced. Each bad value raises
:class:`ProbeError` naming the option, the value and what is accepted.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.rundir import layout
from probe.tracer.rank import current_rank, world_size

PHASES = ("forward", "backward", "recompute", "optimizer")
COMPILED_POLICIES = ("eager", "keep")


@dataclass(frozen=True)
class Patterns:
    """Glob patterns compiled to one regex; ``None`` means "everything"."""

    globs: tuple[str, ...] | None

    @classmethod
    def parse(cls, option: str, value: Any) -> Patterns:
        if value is None:
            return cls(None)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
            raise ProbeError(f"option {option!r}: expected a glob string or a list of them, got {value!r}")
        globs = tuple(value)
        if not globs:
            raise ProbeError(f"option {option!r}: an empty list selects nothing; omit it to select all")
        return cls(globs)

    @property
    def regex(self) -> re.Pattern[str] | None:
        if self.globs is None:
            return None
        return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in self.globs))


@dataclass(frozen=True)
class IntSet:
    """A set of ints (steps, ranks); ``None`` means "all"."""

    values: frozenset[int] | None

    @classmethod
    def parse(cls, option: str, value: Any) -> IntSet:
        if value is None:
            return cls(None)
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, str):
            value = _parse_int_ranges(option, value)
        try:
            items = list(value)
        except TypeError:
            raise ProbeError(f"option {option!r}: expected ints, got {value!r}") from None
        out: set[int] = set()
        for item in items:
            if isinstance(item, str):
                out.update(_parse_int_ranges(option, item))
            elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                out.add(item)
            else:
                raise ProbeError(
                    f"option {option!r}: {item!r} is not a non-negative int or a range like '4-6'"
                )
        return cls(frozenset(out))

    def __contains__(self, item: int) -> bool:
        return self.values is None or item in self.values


def _parse_int_ranges(option: str, text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ProbeError(f"option {option!r}: cannot read {part!r}; use ints or ranges like '4-6'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo:
            raise ProbeError(f"option {option!r}: range {part!r} is empty")
        out.extend(range(lo, hi + 1))
    return out


@dataclass
class Options:
    """Validated session options; see API.md for their meaning."""

    modes: tuple[str, ...]
    out: Path | None = None
    overwrite: bool = False
    model: Any = None
    ops: Patterns = field(default_factory=lambda: Patterns(None))
    modules: Patterns = field(default_factory=lambda: Patterns(None))
    steps: IntSet = field(default_factory=lambda: IntSet(None))
    ranks: IntSet = field(default_factory=lambda: IntSet(None))
    phases: frozenset[str] = frozenset(PHASES)
    stack: bool = False
    compiled: str = "eager"
    async_flush: bool = True
    mode_options: dict[str, Any] = field(default_factory=dict)


_COMMON_KEYS = {
    "out", "overwrite", "model", "ops", "modules", "steps", "ranks", "phases", "stack", "compiled",
    "async_flush",
}


def parse_options(modes: Any, kwargs: dict[str, Any], mode_option_names: dict[str, set[str]]) -> Options:
    """Validate ``probe.mode(modes, **kwargs)``.

    ``mode_option_names`` maps each known mode name to the option names it accepts;
    an option no selected mode accepts is an error.
    """
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    if config is not None:
        from probe.modes.monitor_config import from_msprobe_monitor, is_monitor_config
        from probe.msprobe_config import from_msprobe, is_msprobe_config

        data = _read_config(config)
        if is_msprobe_config(data):
            data = from_msprobe(data)
        elif is_monitor_config(data):
            data = from_msprobe_monitor(data)
        for key, value in data.items():
            kwargs.setdefault(key, value)
        if modes is None:
            modes = kwargs.pop("mode", None)
    kwargs.pop("mode", None)

    mode_names = _parse_modes(modes, mode_option_names)
    opts = Options(modes=mode_names)

    for key in list(kwargs):
        if key not in _COMMON_KEYS:
            continue
        value = kwargs.pop(key)
        if key == "out":
            opts.out = None if value is None else Path(os.fspath(value))
        elif key == "overwrite":
            opts.overwrite = _parse_bool(key, value)
        elif key == "model":
            opts.model = _parse_model(value)
        elif key in ("ops", "modules"):
            setattr(opts, key, Patterns.parse(key, value))
        elif key in ("steps", "ranks"):
            setattr(opts, key, IntSet.parse(key, value))
        elif key == "phases":
            opts.phases = _parse_phases(value)
        elif key in ("stack", "async_flush"):
            setattr(opts, key, _parse_bool(key, value))
        elif key == "compiled":
            if value not in COMPILED_POLICIES:
                raise ProbeError(f"option 'compiled': {value!r} is not one of {list(COMPILED_POLICIES)}")
            opts.compiled = value

    accepted = set().union(*(mode_option_names[m] for m in mode_names))
    for key in kwargs:
        if key not in accepted:
            known = sorted(_COMMON_KEYS | {"config"} | accepted)
            raise ProbeError(
                f"unknown option {key!r} for mode(s) {list(mode_names)}; accepted options: {known}"
            )
    opts.mode_options = kwargs
    rank = current_rank()
    if opts.out is not None and rank in opts.ranks:
        check_out_dir(opts.out, opts.overwrite, rank, world_size())
    return opts


def _parse_modes(modes: Any, known: dict[str, set[str]]) -> tuple[str, ...]:
    if modes is None:
        raise ProbeError(f"no mode given; accepted modes: {sorted(known)}")
    names = [modes] if isinstance(modes, str) else list(modes)
    if not names:
        raise ProbeError(f"no mode given; accepted modes: {sorted(known)}")
    for name in names:
        if name not in known:
            raise ProbeError(f"unknown mode {name!r}; accepted modes: {sorted(known)}")
    if len(set(names)) != len(names):
        raise ProbeError(f"mode list {names!r} names a mode twice")
    return tuple(names)


def _parse_bool(option: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ProbeError(f"option {option!r}: expected True or False, got {value!r}")


def _parse_model(value: Any) -> Any:
    if isinstance(value, torch.nn.Module):
        return value
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, torch.nn.Module) for k, v in value.items()
    ):
        return value
    raise ProbeError(
        f"option 'model': expected an nn.Module or a dict of name -> nn.Module, got {type(value).__name__}"
    )


def _parse_phases(value: Any) -> frozenset[str]:
    names = [value] if isinstance(value, str) else value
    try:
        phases = frozenset(names)
    except TypeError:
        raise ProbeError(f"option 'phases': expected a subset of {list(PHASES)}, got {value!r}") from None
    bad = sorted(p for p in phases if p not in PHASES)
    if bad or not phases:
        raise ProbeError(f"option 'phases': {bad or value!r} not a non-empty subset of {list(PHASES)}")
    return phases


def _read_config(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    path = Path(os.fspath(config))
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProbeError(f"option 'config': file {str(path)!r} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ProbeError(f"option 'config': cannot read {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ProbeError(f"option 'config': {str(path)!r} must hold a JSON object")
    return data


def check_out_dir(out: Path, overwrite: bool, rank: int = 0, world: int = 1) -> None:
    """Refuse an output location we could not (or should not) write.

    In a job of several processes the other ranks write their own ``rankN``
    directories (and ``run.json``) into the same place, possibly first: only this
    rank's directory, or anything that is not a probe entry, makes it "not empty".
    """
    if out.exists():
        if not out.is_dir():
            raise ProbeError(f"option 'out': {str(out)!r} exists and is not a directory")
        entries = [entry.name for entry in out.iterdir()]
        if world > 1:
            mine = layout.rank_dir(out, rank).name
            entries = [e for e in entries if e == mine or not layout.is_probe_entry(e)]
        if entries and not overwrite:
            what = "is not empty" if world == 1 else f"already holds {sorted(entries)[:3]}"
            raise ProbeError(
                f"option 'out': {str(out)!r} {what}; choose an empty directory or pass overwrite=True"
            )
        if not os.access(out, os.W_OK | os.X_OK):
            raise ProbeError(f"option 'out': {str(out)!r} is not writable")
        return
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ProbeError(f"option 'out': cannot create {str(out)!r}: {str(parent)!r} is not writable")
