"""A step's call sites (``callsites.json``, written with ``stack=True``) read back.

The file maps a call site id (``"0"``, ``"1"``, ...; an op record's ``site``) to its stack,
``file:line in function`` strings, outermost first. It can be large (every unique call site of
a step, each with its whole stack, 89 MiB seen), and most readers need the stacks of a few ops
(``probe summary`` decodes a handful), so a :class:`CallSiteTable` is read once per step
(``Run`` keeps it with the step), checked whole, and holds the file's text and where each entry
is in it: a stack is decoded when an op that names it is decoded, once, its frame strings
interned (the outer frames of a training loop are in every stack). Reading it holds about twice
the file while its bytes are decoded, then the text and what the stacks asked for hold. Before,
every few ops decoded (each ``ops_at`` of ``probe summary``) parsed it whole again, at four
times its size.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path

from probe.rundir.confined_files import open_in_run
from probe.rundir.untrusted_reads import INDEX_LIMIT, MAX_JSON_DEPTH, expect, reading

_SPACE = re.compile(r"[ \t\n\r]*")
_decode_value = json.JSONDecoder().raw_decode
_decode_string = json.decoder.scanstring


class CallSiteTable:
    """One step's call sites: :meth:`get` a stack by id."""

    def __init__(self, path: Path, run: Path) -> None:
        """Reads and checks the whole file: anything but an object of decimal ids to lists of
        strings is a :class:`~probe.errors.ProbeError` naming it."""
        with open_in_run(path, run) as f:
            data = f.read(INDEX_LIMIT)
        # Where each entry's stack is in the text, by id: 24 bytes an entry (a dict of tuples
        # took ~220), ids ascending (the writer's order; sorted when a file is not in it).
        ids, starts, ends = array("q"), array("q"), array("q")
        with reading(path):
            self._text = data.decode("utf-8")
            del data  # the text alone from here on
            for key, stack, start, end in _object_entries(self._text):
                if not (key.isascii() and key.isdigit()) or len(key) > 18:
                    raise ValueError(f"call site id {key!r} is not a number")
                what = f"the stack of call site {key}"
                if not all(type(line) is str for line in expect(stack, list, what)):
                    raise ValueError(f"{what} holds a line that is not a string")
                ids.append(int(key))
                starts.append(start)
                ends.append(end)
        if any(ids[i] > ids[i + 1] for i in range(len(ids) - 1)):
            order = sorted(range(len(ids)), key=ids.__getitem__)  # stable: a repeated id's last wins
            ids, starts, ends = (array("q", (a[i] for i in order)) for a in (ids, starts, ends))
        self._ids, self._starts, self._ends = ids, starts, ends
        self._stacks: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, site: int) -> list[str] | None:
        """The stack of call site ``site`` (decoded on first use, then shared), or None when the
        table has no such site."""
        stack = self._stacks.get(site)
        if stack is None:
            at = bisect_right(self._ids, site) - 1  # a repeated id: its last entry, as json.loads
            if at < 0 or self._ids[at] != site:
                return None
            text = self._text[self._starts[at]:self._ends[at]]
            stack = self._stacks[site] = list(map(sys.intern, json.loads(text)))
        return stack


def _object_entries(text: str) -> Iterator[tuple[str, object, int, int]]:
    """``(key, value, start, end)`` of each entry of the JSON object ``text``, decoded one value
    at a time (``text[start:end]`` is the value's JSON). Damage is a ValueError; a value nested
    past the interpreter's stack is refused as nesting too deep, as a whole document is."""
    space = _SPACE.match
    pos = space(text).end()
    if text[pos:pos + 1] != "{":
        raise ValueError("the file is not a JSON object")
    pos = space(text, pos + 1).end()
    closed = text[pos:pos + 1] == "}"
    while not closed:
        if text[pos:pos + 1] != '"':
            raise ValueError(f"expected a key at character {pos}")
        key, pos = _decode_string(text, pos + 1)
        if text[pos:pos + 1] != ":":  # the probe writes compact JSON: most often no space to skip
            pos = space(text, pos).end()
            if text[pos:pos + 1] != ":":
                raise ValueError(f"expected ':' at character {pos}")
        start = space(text, pos + 1).end()
        try:
            value, pos = _decode_value(text, start)
        except RecursionError:
            raise ValueError(f"the file nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
        yield key, value, start, pos
        follows = text[pos:pos + 1]
        if follows not in (",", "}"):
            pos = space(text, pos).end()
            follows = text[pos:pos + 1]
        if follows == ",":
            pos = space(text, pos + 1).end()
        elif follows == "}":
            closed = True
        else:
            raise ValueError(f"expected ',' or '}}' at character {pos}")
    if space(text, pos + 1).end() != len(text):
        raise ValueError(f"extra data after the object at character {pos + 1}")
