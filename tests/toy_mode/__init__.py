"""A toy mode, whole in this package: what a new mode is (issue 34). It counts the ops it sees
in each phase of a step (``mode``), writes them to ``toy.json`` (``mode``'s step result), and
reads them back over a run as ``probe.load(out).mode("toy").counts()`` (``files``); its option
is one field of its config (``config``). Importing the package registers it; nothing outside the
package names it. ``tests/test_toy_mode.py`` checks all of that."""

from __future__ import annotations

from toy_mode.config import Toy
from toy_mode.files import ToyFiles, ToyReader
from toy_mode.mode import ToyMode

__all__ = ["Toy", "ToyFiles", "ToyMode", "ToyReader"]
