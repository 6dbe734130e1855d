"""The monitor family, apart from the per-op modes: training-state statistics of chosen modules,
parameters, gradients and optimizer state, collected from module and optimizer hooks (no
dispatch mode, no per-op work), with anomaly alerts and escalation's trigger.

``mode`` is the plug-in, ``hooks`` where series are captured (module, gradient and optimizer
hooks), ``series`` a step's rows and the derived series (Adam's update ratio, the loss scale),
``reduction`` the cross-rank reduction, ``step`` a collected step resolved and written; ``files``
the reader, ``options`` the options object; ``config`` reads msprobe's monitor config,
``anomaly`` the detectors and alerts, ``distribution`` the series' value distributions.
"""

from __future__ import annotations

from probe.modes.monitor.files import MonitorFiles
from probe.modes.monitor.mode import MonitorMode
from probe.modes.monitor.options import Monitor

__all__ = ["Monitor", "MonitorFiles", "MonitorMode"]
