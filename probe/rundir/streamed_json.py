"""Reading a large JSON object of a run one item at a time, through a bounded window of text.

``json.loads`` of a whole document holds its bytes, its text and the Python objects of every
value at once: a 250 MiB dump index of 2M small entries took 2.1 GB (a dict of a dozen keys and
two lists per entry, about 1 KB each; the depth check walked them all again, and the cyclic
garbage collector kept walking millions of live containers while they were made). Here the file
is read in chunks and decoded a value at a time, and the items of the members the caller names
(an array's items, an object's key-value pairs) are handed to it one by one and not kept, so
it stores what it needs of each in its own compact form. At most a chunk of text plus the
longest item is held at once, whatever the file's size or encoding.

The file is opened like every file of a run (:func:`~probe.rundir.confined_files.open_in_run`);
its damage raises ValueError, which the caller's :func:`~probe.rundir.untrusted_reads.reading`
turns into the ``ProbeError`` naming the file.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from probe.rundir.confined_files import open_in_run
from probe.rundir.untrusted_reads import DOCUMENT_LIMIT, LINE_LIMIT, check_json_depth, expect, reading

CHUNK = 256 << 10
"""Bytes read from the file at a time."""
ITEM_LIMIT = 1 << 20
"""The most bytes of one streamed item (a dump index entry is ~150 bytes; parts make it a few KB)."""

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()

OnItem = Callable[[Any], None]
"""Takes one item of a streamed member: an array's item, or an object's ``(key, value)``."""


class _Window:
    """The file's text from the reading position on, refilled from the file as it is consumed."""

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file, self._left = file, size
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._dropped = 0  # characters consumed and let go before ``text``
        self.text, self.pos = "", 0

    @property
    def where(self) -> str:
        return f"character {self._dropped + self.pos}"

    def refill(self, at_least: int = 0) -> bool:
        """Let the consumed text go and append the text of the next :data:`CHUNK` bytes of the
        file (``at_least`` bytes if more); False at the end of the file."""
        if self._left == 0:
            return False
        data = self._file.read(min(max(at_least, CHUNK), self._left))
        if not data:
            raise ValueError(f"the file ended at {self.where}, before its size when opened")
        self._left -= len(data)
        self._dropped += self.pos
        self.text = self.text[self.pos :] + self._decoder.decode(data, final=self._left == 0)
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not JSON whitespace ("" at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.refill():
                return ""

    def expect(self, chars: str) -> str:
        """Consume the next character, one of ``chars``."""
        char = self.peek()
        if not char or char not in chars:
            raise ValueError(f"expected {' or '.join(map(repr, chars))} at {self.where}")
        self.pos += 1
        return char

    def value(self, limit: int, what: str) -> Any:
        """Decode the next JSON value, at most ``limit`` bytes of text."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
                if end < len(self.text) or self._left == 0:  # a number may go on past the window
                    self.pos = end
                    return value
            except json.JSONDecodeError as e:
                if self._left == 0:
                    raise ValueError(f"{what} at {self.where}: {e.msg}") from None
            except RecursionError:
                raise ValueError(f"{what} at {self.where} nests JSON deeper than the interpreter's "
                                 "stack") from None
            held = len(self.text) - self.pos
            if held > limit:
                raise ValueError(f"{what} at {self.where} is not a JSON value of at most {limit} bytes")
            self.refill(held)  # doubles the text held: a long value is decoded a few times at most


def read_object_streamed(path: Path, streamed: dict[str, tuple[type, OnItem]], *, run: Path | None = None,
                         limit: int = DOCUMENT_LIMIT, item_limit: int = ITEM_LIMIT,
                         value_limit: int = LINE_LIMIT) -> dict[str, Any]:
    """The members of the JSON object in ``path`` (a file of ``run``, at most ``limit`` bytes).

    ``streamed`` names members whose value must be a ``list`` or a ``dict`` (the type given)
    that is not kept: each item is handed to the callback as it is decoded (at most
    ``item_limit`` bytes each), and the member's value in the result is the number of items.
    Other members are decoded whole (at most ``value_limit`` bytes, nesting at most
    :data:`~probe.rundir.untrusted_reads.MAX_JSON_DEPTH` deep). A key that appears twice is
    damage. Damage is a ``ProbeError`` naming ``path``; so is what a callback raises of
    :data:`~probe.rundir.untrusted_reads.READ_ERRORS`.
    """
    with open_in_run(path, run) as f, reading(path):
        f.check_size(limit)
        window = _Window(f.file, f.size)
        members: dict[str, Any] = {}
        window.expect("{")
        if window.peek() == "}":
            window.pos += 1
        else:
            while True:
                key = expect(window.value(value_limit, "a key"), str, "a key")
                if key in members:
                    raise ValueError(f"the key {key!r} appears twice")
                window.expect(":")
                if key in streamed:
                    kind, on_item = streamed[key]
                    members[key] = _stream(window, key, kind, on_item, item_limit)
                else:
                    value = members[key] = window.value(value_limit, f"the value of {key!r}")
                    if isinstance(value, (dict, list)):
                        check_json_depth(value, f"the value of {key!r}")
                if window.expect(",}") == "}":
                    break
        if window.peek():
            raise ValueError(f"extra data after the object at {window.where}")
    return members


def _stream(window: _Window, key: str, kind: type, on_item: OnItem, item_limit: int) -> int:
    """Hand each item of the array or object ``key`` to ``on_item``; how many there were."""
    opening, closing = ("[", "]") if kind is list else ("{", "}")
    if window.peek() != opening:
        raise ValueError(f"{key} is not a JSON {'array' if kind is list else 'object'} (at {window.where})")
    window.pos += 1
    if window.peek() == closing:
        window.pos += 1
        return 0
    count = 0
    while True:
        what = f"item {count} of {key}"
        if kind is list:
            on_item(window.value(item_limit, what))
        else:
            name = expect(window.value(item_limit, f"the key of {what}"), str, f"the key of {what}")
            window.expect(":")
            on_item((name, window.value(item_limit, what)))
        count += 1
        if window.expect("," + closing) == closing:
            return count
