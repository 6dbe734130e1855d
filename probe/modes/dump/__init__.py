"""The dump mode: the tensors themselves, to safetensors shards, with the calls that made them.

``mode`` is the plug-in and writer, ``files`` the reader, ``options`` the options object.
"""

from __future__ import annotations

from probe.modes.dump.files import DumpIndex
from probe.modes.dump.mode import DumpMode
from probe.modes.dump.options import Dump

__all__ = ["Dump", "DumpIndex", "DumpMode"]
