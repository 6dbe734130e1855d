"""probe: precision debugging for PyTorch training.

One TorchDispatchMode sees every aten op, forward and backward, and runs
pluggable modes per op. The public interface is this module:

- :func:`mode` starts a session (a context manager, or ``start()``/``stop()``) over one or more
  modes, named or given as objects carrying their options (:class:`Stats`, :class:`Dump`,
  :class:`Monitor`, ...); :func:`active_session` is the running one;
- :func:`load` opens a run directory it wrote;
- :func:`seed_all` seeds every generator (and turns on deterministic kernels) so runs compare;
- :func:`check_consistency` checks that the ranks of a job agree on replicated values;
- :func:`export_graph` writes a step's op graph for review (GraphML, DOT, JSON, Model Explorer);
- :class:`ProbeError` is raised for bad options and unreadable input.
"""

from probe import modes as _modes  # noqa: F401  (registers the built-in modes)
from probe.analysis.compare import Report, compare
from probe.analysis.consistency import ConsistencyReport, check_consistency
from probe.analysis.replay import replay, replay_step
from probe.errors import ProbeError, ProbeWarning, warn_once
from probe.exporters import compare_report as _compare_report  # noqa: F401  (registers Report.to_csv/to_html's writers)
from probe.exporters.graph_export import export_graph
from probe.modes.dump import Dump
from probe.modes.free_benchmark import FreeBenchmark
from probe.modes.free_benchmark.cpu_reference import register_cpu_reference
from probe.modes.mode_options import ModeOptions
from probe.modes.monitor import Monitor
from probe.modes.monitor.mode import AnomalyStop
from probe.modes.stats import Stats
from probe.modes.structure import Structure
from probe.modes.upcast import Upcast
from probe.rundir.run import OpRecord, Run, TensorRecord, load
from probe.seeding import seed_all
from probe.session import Session, active_session, mode
from probe.version import __version__

__all__ = [
    "AnomalyStop", "ConsistencyReport", "Dump", "FreeBenchmark", "ModeOptions", "Monitor", "OpRecord",
    "ProbeError", "ProbeWarning", "Report", "Run", "Session", "Stats", "Structure", "TensorRecord",
    "Upcast", "__version__", "active_session", "check_consistency", "compare", "export_graph", "load",
    "mode", "register_cpu_reference", "replay", "replay_step", "seed_all", "warn_once",
]
