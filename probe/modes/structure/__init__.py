"""The structure mode: the op records alone (ids, modules, phases, dtypes, shapes, the op graph);
the tracer writes them, so the mode itself does nothing per op.

``mode`` is the plug-in, ``options`` the options object.
"""

from __future__ import annotations

from probe.modes.structure.mode import StructureMode
from probe.modes.structure.options import Structure

__all__ = ["Structure", "StructureMode"]
