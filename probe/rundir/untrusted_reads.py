"""Reading a run's files defensively: any damage is a :class:`ProbeError` naming the file.

A run directory may be cut short (a killed process, a full disk), edited by hand, or
written by another probe version. Every reader goes through these helpers, so whatever is
wrong with a file (unreadable, not UTF-8, not JSON, a key missing, a value of the wrong
type, a name that leaves the run) reaches the user as one ``ProbeError`` that names the
file, and the ``probe`` command exits 2 with that line.

A run is untrusted input: every file is opened through :mod:`probe.rundir.confined_files`
(regular files inside the run only) and read within the format's limits below, so a hostile
run costs a bounded amount of memory and time: a JSON document is at most
:data:`DOCUMENT_LIMIT` bytes (the dump index and the call sites :data:`INDEX_LIMIT`), a line of
a JSON-lines file :data:`LINE_LIMIT` (an op record :data:`OP_LINE_LIMIT`), JSON nests at most
:data:`MAX_JSON_DEPTH` deep, and a ``.npy`` array must fill its file exactly.
"""

from __future__ import annotations

import csv
import json
import struct
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from probe.errors import ProbeError
from probe.rundir.confined_files import open_in_run

# What decoding damaged bytes raises: bad JSON and bad UTF-8 are ValueErrors, a missing key
# a KeyError, a value of the wrong type a TypeError/AttributeError/IndexError where it is used,
# JSON nested past the interpreter's stack a RecursionError, a damaged CSV a csv.Error.
READ_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError,
               struct.error, RecursionError, csv.Error)

DOCUMENT_LIMIT = 64 << 20
"""The most bytes a JSON document of a run may hold (run, rank, manifest, modules, checksums):
a step's metadata is kilobytes; a field of hundreds of megabytes is damage, refused unread."""
INDEX_LIMIT = 256 << 20
"""The most bytes of a step's dump index (``tensors.json``, ~200 bytes a tensor) and call sites."""
LINE_LIMIT = 16 << 20
"""The most bytes of one line of a JSON-lines file (a recorded call, a check, an alert)."""
OP_LINE_LIMIT = 1 << 20
"""The most bytes of one op record (``ops.jsonl``: a few hundred bytes each)."""
MAX_JSON_DEPTH = 64
"""How deep JSON in a run may nest (the format nests a few levels; recorded call arguments a few
more): deeper is refused before anything walks it recursively."""

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


def parse_json(data: bytes | str, what: str = "the file") -> Any:
    """The JSON value of ``data``, refused (ValueError) when it nests deeper than
    :data:`MAX_JSON_DEPTH`."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    opened = data.count(b"[" if isinstance(data, bytes) else "[") + \
        data.count(b"{" if isinstance(data, bytes) else "{")
    if opened >= MAX_JSON_DEPTH:  # fewer brackets cannot nest that deep: nothing to walk
        check_json_depth(value, what)
    return value


def check_json_depth(value: Any, what: str) -> None:
    """Refuse (ValueError) a decoded JSON ``value`` nested deeper than :data:`MAX_JSON_DEPTH`,
    walking its containers without recursion (the walk itself must not overflow)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def read_json(path: Path, kind: type = dict, *, run: Path | None = None, limit: int = DOCUMENT_LIMIT) -> Any:
    """The JSON value of ``path``, which must be a ``kind`` (an object by default).

    ``path`` is opened through :func:`~probe.rundir.confined_files.open_in_run`: a regular file
    inside ``run`` (the run directory; default the file's own directory), at most ``limit`` bytes.
    """
    with open_in_run(path, run) as f:
        data = f.read(limit)
    with reading(path):
        return expect(parse_json(data.decode("utf-8")), kind, "the file")


def read_lines(path: Path, *, run: Path | None = None, line_limit: int = LINE_LIMIT) -> list[str]:
    """The non-blank lines of a JSON-lines file, undecoded, streamed within ``line_limit``."""
    with open_in_run(path, run) as f, reading(path):
        # JSON lines end in "\n" only (str.splitlines would also split at U+2028 inside a string)
        return [text for line in f.lines(line_limit) if (text := line.decode("utf-8")).strip()]


def read_jsonl(path: Path, *, run: Path | None = None, line_limit: int = LINE_LIMIT) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file; none when the file is absent (its mode did not run)."""
    if not path.exists():
        return []
    rows = []
    with open_in_run(path, run) as f, reading(path):
        for number, line in enumerate(f.lines(line_limit), 1):
            if line.strip():
                what = f"line {number}"
                rows.append(expect(parse_json(line.decode("utf-8"), what), dict, what))
    return rows


def read_npy(path: Path, *, run: Path | None = None) -> np.ndarray:
    """A ``.npy`` array (no pickles), refused unless its header's shape and dtype fill the
    file exactly: a header claiming more than the file holds is refused before any allocation."""
    with open_in_run(path, run) as f, reading(path):
        version = np.lib.format.read_magic(f.file)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"unknown .npy version {version}")
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(f.file)
        if dtype.hasobject:
            raise ValueError("the array holds Python objects")
        count = 1
        for n in shape:
            count *= n
        start = f.file.tell()
        if start + count * dtype.itemsize != f.size:
            raise ValueError(f"its header says {count} items of {dtype} ({count * dtype.itemsize} bytes), "
                             f"the file holds {f.size - start} bytes of data")
        data = np.frombuffer(f.file.read(count * dtype.itemsize), dtype=dtype, count=count)
        return data.reshape(shape[::-1]).T if fortran else data.reshape(shape)


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
