"""How a report is written to a file, registered by the exporters.

The analysis layer sits below the exporters (``tests/test_layers.py``): a report's ``to_csv`` or
``to_html`` finds its writer here, by name, and :mod:`probe.exporters.compare_report` registers
its writers when imported; :func:`write_report` imports it, by name, when no writer is
registered yet (``import probe`` binds its names lazily).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from probe.errors import ProbeError

BUILTIN_WRITERS = "probe.exporters.compare_report"
"""The module whose import registers the built-in writers."""

ReportWriter = Callable[[dict[str, Any], Iterable[dict[str, Any]], Path], None]
"""``writer(summary, rows, path)``: one report's summary and rows written to ``path`` (the rows
may be made as they are read: a CSV writer reads them once)."""

_WRITERS: dict[str, ReportWriter] = {}


def register_report_writer(name: str, writer: ReportWriter) -> None:
    """Register ``writer`` under ``name`` (``"compare_csv"``, ``"compare_html"``); a later
    registration replaces an earlier one (a reloaded exporter)."""
    _WRITERS[name] = writer


def write_report(name: str, summary: dict[str, Any], rows: Iterable[dict[str, Any]], path: Path) -> None:
    """Write a report with the writer registered as ``name``."""
    if name not in _WRITERS:
        importlib.import_module(BUILTIN_WRITERS)
    writer = _WRITERS.get(name)
    if writer is None:
        raise ProbeError(f"no report writer {name!r} is registered (registered: {sorted(_WRITERS)}); "
                         "import probe.exporters.compare_report")
    writer(summary, rows, path)
