"""Validated options of a probe session.

Everything a user can pass to ``probe.mode(...)`` (or put in a JSON config file)
is checked here, once, before any op is traced. Each bad value raises
:class:`ProbeError` naming the option, the value and what is accepted.
"""

from __future__ import annotations

import bisect
import fnmatch
import json
import math
import numbers
import os
import re
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.hparams import parse_hparams
from probe.rundir import layout
from probe.tracer.rank import current_rank, world_size

PHASES = ("forward", "backward", "recompute", "optimizer")
CHECKSUM_KINDS = ("parameters", "inputs", "rng", "parameters_each_step")
"""What ``checksums=`` may record when ``model=`` is given (``probe.modes.checksums``)."""
DEFAULT_CHECKSUMS = frozenset({"parameters", "inputs", "rng"})
"""``checksums=True`` (the default): parameters at the session's first step, inputs and RNG each step."""
COMPILED_POLICIES = ("eager", "keep")

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlevel = 3


def show(value: Any) -> str:
    """A short, safe ``repr`` of a user's value for a message (bounded, never raising)."""
    try:
        return _SHOW.repr(value)
    except Exception:  # a value whose own __repr__ fails still gets named
        return f"<{type(value).__name__} object>"


def parse_bool(option: str, value: Any) -> bool:
    """A real bool: a truthy string such as ``"no"`` or an int is refused, not guessed at."""
    if isinstance(value, bool):
        return value
    raise ProbeError(f"option {option!r}: expected True or False (true/false in a JSON config), "
                     f"got {show(value)}")


def parse_int(option: str, value: Any, minimum: int) -> int:
    """An int ``>= minimum``; bools (an int subclass) are refused."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum:
        return int(value)
    raise ProbeError(f"option {option!r}: expected an int >= {minimum}, got {show(value)}")


def parse_number(option: str, value: Any, minimum: float) -> float:
    """A finite real number ``>= minimum``; bools, NaN and infinities are refused."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond float range
            number = math.inf
        if math.isfinite(number) and number >= minimum:
            return number
    raise ProbeError(f"option {option!r}: expected a finite number >= {minimum}, got {show(value)}")


def host_memory_bytes() -> int | None:
    """This machine's physical memory, where the OS says (``None`` elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def parse_checksums(value: Any) -> frozenset[str]:
    """``checksums=``: True (:data:`DEFAULT_CHECKSUMS`), False (none), or some of :data:`CHECKSUM_KINDS`."""
    if isinstance(value, bool):
        return DEFAULT_CHECKSUMS if value else frozenset()
    kinds = _str_list("checksums", value, f"True, False, or a name from {list(CHECKSUM_KINDS)}") \
        if isinstance(value, (str, list, tuple, set, frozenset)) else None
    if kinds is None or not kinds or any(k not in CHECKSUM_KINDS for k in kinds):
        raise ProbeError(f"option 'checksums': expected True, False, or a non-empty list from "
                         f"{list(CHECKSUM_KINDS)}, got {show(value)}")
    return frozenset(kinds)


def parse_choice(option: str, value: Any, choices: Iterable[str]) -> str:
    """One of the strings ``choices``."""
    choices = tuple(choices)
    if isinstance(value, str) and value in choices:
        return value
    raise ProbeError(f"option {option!r}: {show(value)} is not one of {list(choices)}")


def _str_list(option: str, value: Any, what: str) -> list[str]:
    """A string or a list/tuple/set of strings (no nesting, no generators: they are read once)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ProbeError(f"option {option!r}: expected {what} or a list of them, got {show(value)}")


@dataclass(frozen=True)
class Patterns:
    """Glob patterns compiled to one regex; ``None`` means "everything"."""

    globs: tuple[str, ...] | None

    @classmethod
    def parse(cls, option: str, value: Any) -> Patterns:
        if value is None:
            return cls(None)
        globs = tuple(_str_list(option, value, "a glob string"))
        if not globs:
            raise ProbeError(f"option {option!r}: an empty list selects nothing; omit it to select all")
        if "" in globs:
            raise ProbeError(f"option {option!r}: an empty glob matches no name; omit it to select all")
        return cls(globs)

    @property
    def regex(self) -> re.Pattern[str] | None:
        if self.globs is None:
            return None
        return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in self.globs))


_INT_SET_ACCEPTS = "an int >= 0, a string like '0,4-6', a range, or a list/tuple/set of those"


@dataclass(frozen=True)
class IntSet:
    """A set of non-negative ints (steps, ranks); ``ranges=None`` means "all".

    Held as ranges, never expanded: ``"0-1000000000"`` or ``range(10**12)`` costs
    what ``[0]`` costs. ``ranges`` are the step-1 ranges, sorted, disjoint and not
    adjacent, then any ranges with a larger step, as given.
    """

    ranges: tuple[range, ...] | None
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _spans: int = field(init=False, repr=False, compare=False)  # how many leading ranges have step 1

    def __post_init__(self) -> None:
        spans = [r for r in self.ranges or () if r.step == 1]
        object.__setattr__(self, "_starts", tuple(r.start for r in spans))
        object.__setattr__(self, "_spans", len(spans))

    @classmethod
    def parse(cls, option: str, value: Any) -> IntSet:
        if value is None:
            return cls(None)
        if isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
        elif isinstance(value, (numbers.Integral, str, range)) and not isinstance(value, bool):
            items = [value]
        else:
            raise ProbeError(f"option {option!r}: expected {_INT_SET_ACCEPTS}, got {show(value)}")
        ranges: list[range] = []
        for item in items:
            if isinstance(item, str):
                ranges += _parse_int_ranges(option, item)
            elif isinstance(item, range):
                ranges.append(_checked_range(option, item))
            elif isinstance(item, numbers.Integral) and not isinstance(item, bool) and item >= 0:
                ranges.append(range(int(item), int(item) + 1))
            else:
                raise ProbeError(f"option {option!r}: {show(item)} is not an int >= 0, a range or a string "
                                 f"like '4-6' (expected {_INT_SET_ACCEPTS})")
        ranges = [r for r in ranges if r]
        if not ranges:
            raise ProbeError(f"option {option!r}: {show(value)} selects nothing; omit it to select all")
        return cls(_merged(ranges))

    def __contains__(self, item: int) -> bool:
        if self.ranges is None:
            return True
        i = bisect.bisect_right(self._starts, item) - 1
        if i >= 0 and item in self.ranges[i]:
            return True
        return any(item in r for r in self.ranges[self._spans:])

    def to_json(self) -> list[int | str] | None:
        """The set as ``probe.mode`` accepts it: ints and ``"lo-hi"`` strings (``None``: all)."""
        if self.ranges is None:
            return None
        out: list[int | str] = []
        for r in self.ranges:
            if r.step == 1:
                out.append(r.start if len(r) == 1 else f"{r.start}-{r[-1]}")
            else:
                out.append(f"range({r.start}, {r.stop}, {r.step})")  # for the record only
        return out


def _checked_range(option: str, r: range) -> range:
    if r.step < 0:
        r = r[::-1]
    if r and r.start < 0:
        raise ProbeError(f"option {option!r}: {r!r} holds negative values; expected {_INT_SET_ACCEPTS}")
    return r


def _merged(ranges: list[range]) -> tuple[range, ...]:
    """Step-1 ranges sorted and merged where they touch or overlap; strided ones after them."""
    spans = sorted((r for r in ranges if r.step == 1), key=lambda r: r.start)
    merged: list[range] = []
    for r in spans:
        if merged and r.start <= merged[-1].stop:
            last = merged[-1]
            merged[-1] = range(last.start, max(last.stop, r.stop))
        else:
            merged.append(r)
    strided = list(dict.fromkeys(r for r in ranges if r.step != 1))
    return tuple(merged + strided)


def _parse_int_ranges(option: str, text: str) -> list[range]:
    out: list[range] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d{1,30})(?:-(\d{1,30}))?", part)
        if not m:
            raise ProbeError(f"option {option!r}: cannot read {show(part)}; use ints or ranges like '4-6'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo:
            raise ProbeError(f"option {option!r}: range {part!r} is empty")
        out.append(range(lo, hi + 1))
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
    hparams: dict[str, Any] | None = None
    checksums: frozenset[str] = DEFAULT_CHECKSUMS
    mode_options: dict[str, Any] = field(default_factory=dict)


_COMMON_KEYS = {
    "out", "overwrite", "model", "ops", "modules", "steps", "ranks", "phases", "stack", "compiled",
    "async_flush", "hparams", "checksums",
}
CONFIG_MAX_BYTES = 16 << 20  # a config is a few keys; more is a wrong path (a checkpoint, a dataset)


def parse_options(modes: Any, kwargs: dict[str, Any], mode_option_names: dict[str, set[str]]) -> Options:
    """Validate ``probe.mode(modes, **kwargs)``.

    ``mode_option_names`` maps each known mode name to the option names it accepts;
    an option no selected mode accepts is an error. Options given directly win
    over the same keys of ``config``.
    """
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    if config is not None:
        for key, value in _config_options(config).items():
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
            opts.out = _parse_out(value)
        elif key == "model":
            opts.model = _parse_model(value)
        elif key in ("ops", "modules"):
            setattr(opts, key, Patterns.parse(key, value))
        elif key in ("steps", "ranks"):
            setattr(opts, key, IntSet.parse(key, value))
        elif key == "phases":
            opts.phases = _parse_phases(value)
        elif key in ("overwrite", "stack", "async_flush"):
            setattr(opts, key, parse_bool(key, value))
        elif key == "compiled":
            opts.compiled = parse_choice(key, value, COMPILED_POLICIES)
        elif key == "hparams":
            opts.hparams = parse_hparams(value)
        elif key == "checksums":
            opts.checksums = parse_checksums(value)

    if "monitor" in mode_names and "targets" not in kwargs and opts.modules.globs is not None:
        kwargs["targets"] = list(opts.modules.globs)  # API.md: modules= serves as the monitor's targets
    accepted = set().union(*(mode_option_names[m] for m in mode_names))
    for key in kwargs:
        if key not in accepted:
            known = sorted(_COMMON_KEYS | {"config"} | accepted)
            raise ProbeError(
                f"unknown option {show(key)} for mode(s) {list(mode_names)}; accepted options: {known}"
            )
    opts.mode_options = kwargs
    rank = current_rank()
    if opts.out is not None and rank in opts.ranks:
        check_out_dir(opts.out, opts.overwrite, rank, world_size())
    return opts


def _parse_modes(modes: Any, known: dict[str, set[str]]) -> tuple[str, ...]:
    if modes is None:
        raise ProbeError(f"no mode given; accepted modes: {sorted(known)}")
    if isinstance(modes, str):
        names = [modes]
    elif isinstance(modes, (list, tuple)) and all(isinstance(name, str) for name in modes):
        names = list(modes)
    else:
        raise ProbeError(f"modes: expected a mode name or a list of them from {sorted(known)}, "
                         f"got {show(modes)}")
    if not names:
        raise ProbeError(f"no mode given; accepted modes: {sorted(known)}")
    for name in names:
        if name not in known:
            raise ProbeError(f"unknown mode {show(name)}; accepted modes: {sorted(known)}")
    if len(set(names)) != len(names):
        raise ProbeError(f"mode list {names!r} names a mode twice")
    return tuple(names)


def _path(option: str, value: Any) -> Path:
    """A filesystem path given as a ``str`` or ``os.PathLike`` (bytes paths are refused)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ProbeError(f"option {option!r}: expected a path (str or pathlib.Path), got {show(value)}")
    if not text or "\0" in text:
        raise ProbeError(f"option {option!r}: {show(text)} is not a usable path")
    return Path(text)


def _parse_out(value: Any) -> Path | None:
    if value is None:
        return None
    out = _path("out", value)
    try:
        dangling = out.is_symlink() and not out.exists()  # a name too long for the filesystem fails here
    except OSError as e:
        raise ProbeError(f"option 'out': {show(str(out))} is not a usable path: {e.strerror}") from None
    if dangling:
        raise ProbeError(f"option 'out': {show(str(out))} is a symbolic link to nothing "
                         f"({show(os.readlink(out))}); remove it or point it at a directory")
    return out


def _parse_model(value: Any) -> Any:
    if value is None or isinstance(value, torch.nn.Module):
        return value
    if isinstance(value, dict) and value and all(
        isinstance(k, str) and isinstance(v, torch.nn.Module) for k, v in value.items()
    ):
        return value
    raise ProbeError(
        "option 'model': expected an nn.Module or a non-empty dict of name -> nn.Module, "
        f"got {show(value)}"
    )


def _parse_phases(value: Any) -> frozenset[str]:
    phases = frozenset(_str_list("phases", value, f"a phase from {list(PHASES)}"))
    bad = sorted(p for p in phases if p not in PHASES)
    if bad or not phases:
        raise ProbeError(f"option 'phases': {bad or show(value)} not a non-empty subset of {list(PHASES)}")
    return phases


def _config_options(config: Any) -> dict[str, Any]:
    """``config=``: a JSON file (or a dict) of options, or of msprobe's config or monitor config."""
    from probe.modes.monitor_config import from_msprobe_monitor, is_monitor_config
    from probe.msprobe_config import from_msprobe, is_msprobe_config

    data = _read_config(config)
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise ProbeError(f"option 'config': keys must be option names (strings), got {show(bad_keys)}")
    if "config" in data:
        raise ProbeError(f"option 'config': a config names another config ({show(data['config'])}); "
                         "configs do not nest: merge the two into one file")
    if is_msprobe_config(data):
        return from_msprobe(data)
    if is_monitor_config(data):
        return from_msprobe_monitor(data)
    return data


def _no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (write a number)")


def _read_config(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ProbeError(f"option 'config': expected a path to a JSON file or a dict, got {show(config)}")
    path = _path("config", config)
    where = show(str(path))
    try:
        size = path.stat().st_size
        if size > CONFIG_MAX_BYTES:
            raise ProbeError(f"option 'config': {where} holds {size} bytes; a config file is at most "
                             f"{CONFIG_MAX_BYTES} (is it the right file?)")
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_json_constant)
    except FileNotFoundError:
        raise ProbeError(f"option 'config': file {where} does not exist") from None
    except UnicodeDecodeError as e:
        raise ProbeError(f"option 'config': {where} is not UTF-8 text ({e.reason} at byte {e.start})"
                         ) from None
    except RecursionError:
        raise ProbeError(f"option 'config': {where} nests too deeply to be a config") from None
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ProbeError(f"option 'config': cannot read {where}: {e}") from None
    if not isinstance(data, dict):
        raise ProbeError(f"option 'config': {where} must hold a JSON object, not {type(data).__name__}")
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
