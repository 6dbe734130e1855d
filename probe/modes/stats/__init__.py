"""The stats mode: min, max, mean, L2 norm and NaN/Inf counts of every op's tensors, one row
per value per step, reduced by the statistics engine (:mod:`probe.modes.statistics`).

``mode`` is the plug-in and writer, ``files`` the reader, ``options`` the options object;
``nonfinite_params`` checks parameters and gradients at step end, ``fp8_scales`` records fp8 scales.
"""

from __future__ import annotations

from probe.modes.stats.files import StatsFiles
from probe.modes.stats.mode import StatsMode
from probe.modes.stats.options import Stats

__all__ = ["Stats", "StatsFiles", "StatsMode"]
