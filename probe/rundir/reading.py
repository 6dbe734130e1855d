"""Reading a run's files defensively: any damage is a :class:`ProbeError` naming the file.

A run directory may be cut short (a killed process, a full disk), edited by hand, or
written by another probe version. Every reader goes through these helpers, so whatever is
wrong with a file (unreadable, not UTF-8, not JSON, a key missing, a value of the wrong
type, a name that leaves the run) reaches the user as one ``ProbeError`` that names the
file, and the ``probe`` command exits 2 with that line.
"""

from __future__ import annotations

import json
import struct
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

from probe.errors import ProbeError

# What decoding damaged bytes raises: bad JSON and bad UTF-8 are ValueErrors, a missing key
# a KeyError, a value of the wrong type a TypeError/AttributeError/IndexError where it is used.
READ_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError,
               struct.error)

T = TypeVar("T")


def _describe(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return f"missing key {error.args[0]!r}" if error.args else "missing key"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)


@contextmanager
def reading(path: Path | str) -> Iterator[None]:
    """Turn the damage found while decoding ``path`` into a ``ProbeError`` naming it."""
    try:
        yield
    except ProbeError:
        raise
    except READ_ERRORS as e:
        raise ProbeError(f"cannot read {str(path)!r}: {_describe(e)}") from None


def read_json(path: Path, kind: type = dict) -> Any:
    """The JSON value of ``path``, which must be a ``kind`` (an object by default)."""
    with reading(path):
        return expect(json.loads(path.read_bytes().decode("utf-8")), kind, "the file")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file; none when the file is absent (its mode did not run)."""
    if not path.exists():
        return []
    with reading(path):
        text = path.read_bytes().decode("utf-8")
        # JSON lines end in "\n" only (str.splitlines would also split at U+2028 inside a string)
        return [expect(json.loads(line), dict, f"line {n}")
                for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` when it is a ``kind`` (a bool is no int), else a ValueError naming ``what``."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"{what} is {type(value).__name__} {_short(value)}, expected {names}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def plain_name(name: Any, what: str) -> str:
    """A file name read from a run: one path component, so what it names stays inside the run."""
    expect(name, str, what)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{what} {name!r} is not a plain file name (it would leave the run directory)")
    return name


def record_from_row(cls: type[T], row: dict[str, Any], rename: dict[str, str] | None = None,
                    **fixed: Any) -> T:
    """A dataclass ``cls`` from one JSON object, each field checked against its annotation.

    ``rename`` maps row keys to field names; ``fixed`` fields come from the caller (the step
    and rank a file belongs to). Keys the class does not know are ignored (a newer probe may
    write more); a field without a default that the row lacks is a KeyError.
    """
    expect(row, dict, "a row")
    hints = _hints(cls)
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = dict(fixed)
    for key, value in row.items():
        name = (rename or {}).get(key, key)
        if name in names and name not in fixed:
            values[name] = _convert(value, hints[name], name)
    for name, f in names.items():
        if name not in values and f.default is MISSING and f.default_factory is MISSING:
            raise KeyError(next((k for k, v in (rename or {}).items() if v == name), name))
    return cls(**values)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(value: Any, hint: Any, what: str) -> Any:
    """``value`` as the annotated type: numbers checked, lists to tuples, floats from "nan"."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(value, option, what)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{what} is None")
    if hint is Any:
        return value
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return tuple(_convert(v, item, f"an item of {what}") for v in expect(value, list, what))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return [_convert(v, item, f"an item of {what}") for v in expect(value, list, what)]
    if origin is dict:
        return expect(value, dict, what)
    if hint is float:
        # Strict JSON spells non-finite numbers as strings ("nan", "inf").
        return float(value) if isinstance(value, str) else float(expect(value, (int, float), what))
    return expect(value, hint, what)
