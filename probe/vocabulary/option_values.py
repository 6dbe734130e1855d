"""Option values every layer may read: the validators of ``probe.mode``'s options.

:mod:`probe.options` parses a call of ``probe.mode`` (and a ``config=`` file) with these; the
option fields (:mod:`probe.vocabulary.option_fields`) of the session's common options and of each
mode's config name them as their checks, and msprobe's config adapters use the same functions, so
every refusal reads alike: a :class:`ProbeError` naming the option, the value (shortened by
:func:`show`) and what is accepted. Nothing here imports another layer.
"""

from __future__ import annotations

import bisect
import fnmatch
import math
import numbers
import os
import re
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from probe.errors import ProbeError

PHASES = ("forward", "backward", "recompute", "optimizer")
CHECKSUM_KINDS = ("parameters", "inputs", "rng", "parameters_each_step")
"""What ``checksums=`` may record when ``model=`` is given (``probe.modes.checksums.mode``)."""
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



def same_value(a: Any, b: Any) -> bool:
    """Whether two option values are the same value (a tensor is only the same as itself)."""
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # a tensor, or a value whose == is not a truth value
        return False
