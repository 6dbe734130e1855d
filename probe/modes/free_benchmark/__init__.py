"""The free benchmark: each selected op re-run perturbed (or on a reference: higher precision,
the CPU) and compared, finding fragile ops without a reference run; its ``fix`` handler
replaces the output.

``mode`` is the plug-in and writer, ``files`` the reader, ``options`` the options object;
``perturbations`` and ``deviation`` are the perturbed re-runs and how far their results may
differ, ``cpu_reference`` the registry of ops' CPU references.
"""

from __future__ import annotations

from probe.modes.free_benchmark.files import ChecksFiles
from probe.modes.free_benchmark.mode import FreeBenchmarkMode
from probe.modes.free_benchmark.options import FreeBenchmark

__all__ = ["ChecksFiles", "FreeBenchmark", "FreeBenchmarkMode"]
