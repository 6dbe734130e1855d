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

``import probe`` imports nothing of torch: the public names are bound on first use (PEP 562), all
at once, so the ``probe`` command answers ``--help`` without importing torch (1-2 s) and a
program that touches any public name gets the whole package as before (built-in modes and
report writers registered). The registries also load their built-ins on first lookup
(:func:`probe.rundir.mode_files.registered_mode_files`, :func:`probe.analysis.report_writers.write_report`),
so a process that imports a submodule directly (a spawned compare worker) reads runs the same.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from probe.version import __version__

if TYPE_CHECKING:
    from probe.analysis.compare import Report, compare
    from probe.analysis.consistency import ConsistencyReport, check_consistency
    from probe.analysis.replay import replay, replay_step
    from probe.errors import ProbeError, ProbeWarning, warn_once
    from probe.exporters.graph_export import export_graph
    from probe.modes.dump import Dump
    from probe.modes.free_benchmark import FreeBenchmark
    from probe.modes.free_benchmark.cpu_reference import register_cpu_reference
    from probe.modes.mode_options import ModeOptions
    from probe.modes.monitor import Monitor
    from probe.modes.monitor.mode import AnomalyStop
    from probe.modes.recipes import FakeQuant, WhatIf
    from probe.modes.stats import Stats
    from probe.modes.structure import Structure
    from probe.modes.upcast import Upcast
    from probe.rundir.run import OpRecord, Run, TensorRecord, load
    from probe.seeding import seed_all
    from probe.session import Session, active_session, mode

# Public name -> the module that defines it.
_PUBLIC: dict[str, str] = {
    "Report": "probe.analysis.compare", "compare": "probe.analysis.compare",
    "ConsistencyReport": "probe.analysis.consistency", "check_consistency": "probe.analysis.consistency",
    "replay": "probe.analysis.replay", "replay_step": "probe.analysis.replay",
    "ProbeError": "probe.errors", "ProbeWarning": "probe.errors", "warn_once": "probe.errors",
    "export_graph": "probe.exporters.graph_export",
    "Dump": "probe.modes.dump", "FreeBenchmark": "probe.modes.free_benchmark",
    "register_cpu_reference": "probe.modes.free_benchmark.cpu_reference",
    "ModeOptions": "probe.modes.mode_options", "Monitor": "probe.modes.monitor",
    "AnomalyStop": "probe.modes.monitor.mode", "Stats": "probe.modes.stats",
    "FakeQuant": "probe.modes.recipes", "WhatIf": "probe.modes.recipes",
    "Structure": "probe.modes.structure", "Upcast": "probe.modes.upcast",
    "OpRecord": "probe.rundir.run", "Run": "probe.rundir.run", "TensorRecord": "probe.rundir.run",
    "load": "probe.rundir.run", "seed_all": "probe.seeding",
    "Session": "probe.session", "active_session": "probe.session", "mode": "probe.session",
}

# Imported with the public names for what importing them does: register the built-in modes, and
# the report writers behind Report.to_csv / to_html.
_REGISTERING = ("probe.modes", "probe.exporters.compare_report")

__all__ = [
    "AnomalyStop", "ConsistencyReport", "Dump", "FakeQuant", "FreeBenchmark", "ModeOptions", "Monitor",
    "OpRecord", "ProbeError", "ProbeWarning", "Report", "Run", "Session", "Stats", "Structure",
    "TensorRecord", "Upcast", "WhatIf", "__version__", "active_session", "check_consistency", "compare",
    "export_graph", "load", "mode", "register_cpu_reference", "replay", "replay_step", "seed_all",
    "warn_once",
]

_loading = False


def _import_public() -> None:
    """Bind every public name (the package as ``import probe`` gave it before names were lazy)."""
    global _loading
    if _loading:  # a module being imported asked for a name: it is not there yet, as before
        return
    _loading = True
    try:
        for module in _REGISTERING:
            importlib.import_module(module)
        for name, module in _PUBLIC.items():
            globals()[name] = getattr(importlib.import_module(module), name)
    finally:
        _loading = False


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # interpreter and tool probes (__wrapped__, __path__ lookups)
        raise AttributeError(f"module 'probe' has no attribute {name!r}")
    if name not in _PUBLIC and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule (``from probe import errors``)
    _import_public()
    if name in globals():
        return globals()[name]
    raise AttributeError(f"module 'probe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
