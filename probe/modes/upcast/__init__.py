"""The upcast mode: chosen modules computed in higher precision, the higher-precision values
carried across their ops (an active mode: it changes training).

``mode`` is the plug-in, ``options`` the options object; it writes no files of its own.
"""

from __future__ import annotations

from probe.modes.upcast.mode import UpcastMode
from probe.modes.upcast.options import Upcast

__all__ = ["Upcast", "UpcastMode"]
