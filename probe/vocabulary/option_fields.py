"""Options declared as dataclass fields: type, default, check and doc in one place.

A config (a mode's, :mod:`probe.modes.config`, or the session's common options,
:mod:`probe.vocabulary.session_options`) is a dataclass whose option fields are made by
:func:`option`. The field's metadata holds a :class:`Check` (how a given value is validated and
normalized, and what the docs table says it accepts) and a one-line doc. :func:`check_given`
validates the given values of such a dataclass in one loop, so a new field is validated, and
appears in the option table (``probe/option_docs.py``), without a parse call of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from probe.vocabulary.option_values import parse_bool, parse_choice, parse_int, parse_number

_OPTION = "probe.option"
"""The metadata key of an option field."""


@dataclass(frozen=True)
class Check:
    """How an option's given value is validated (``parse(option, value)`` returns the value in force
    or raises ``ProbeError`` naming the option) and what the docs say it accepts."""

    parse: Callable[[str, Any], Any]
    accepts: str


@dataclass(frozen=True)
class OptionSpec:
    """An option field's metadata."""

    check: Check
    doc: str


def boolean() -> Check:
    return Check(parse_bool, "`True`, `False`")


def choice(*choices: str) -> Check:
    return Check(lambda option, value: parse_choice(option, value, choices),
                 " \\| ".join(f"`{c!r}`" for c in choices))


def integer(minimum: int, *, none: bool = False) -> Check:
    """An int ``>= minimum`` (and None when ``none``)."""
    def parse(option: str, value: Any) -> int | None:
        return None if none and value is None else parse_int(option, value, minimum)
    return Check(parse, f"int >= {minimum}" + (", `None`" if none else ""))


def number(minimum: float) -> Check:
    return Check(lambda option, value: parse_number(option, value, minimum), f"number >= {minimum}")


def option(default: Any = dataclasses.MISSING, *, check: Check, doc: str,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is an option: ``check`` validates a given value, ``doc`` is its line in
    the option table."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_OPTION: OptionSpec(check, doc)})


def option_specs(cls: Any) -> dict[str, tuple[dataclasses.Field[Any], OptionSpec]]:
    """The option fields of a dataclass (class or instance), in declaration order."""
    return {f.name: (f, f.metadata[_OPTION]) for f in dataclasses.fields(cls) if _OPTION in f.metadata}


def check_given(target: Any, given: Iterable[str]) -> None:
    """Validate the fields of ``target`` named in ``given``, replacing each by the value in force
    (a frozen dataclass too). The defaults are the values in force already and are not checked."""
    specs = option_specs(target)
    for name in given:
        spec = specs[name][1]
        object.__setattr__(target, name, spec.check.parse(name, getattr(target, name)))


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (its factory called)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING

