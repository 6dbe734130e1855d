"""``probe graph`` / :func:`export_graph`: a step's graphs, with findings, to files.

The graphs come from the run (``Run.graph``), findings are attached once
(``probe.analysis.graph_findings``), and each format writes them:

- ``graphml``, ``json``, ``dot``: one graph per file, of one phase (default
  forward) or of the whole step (``phase="all"``), at op or module level;
- ``model-explorer``: every phase of the step, op and module level, as one
  collection, plus one node-data overlay file per finding present.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import networkx as nx

from probe.analysis.graph_findings import annotate, findings_by_op, load_comparisons
from probe.analysis.module_graph import build_module_graph
from probe.errors import ProbeError
from probe.exporters import graph_formats, model_explorer
from probe.rundir.op_graph import GraphEdge, GraphNode, graph_elements
from probe.rundir.run import Run, collections_paused, load
from probe.vocabulary.option_values import PHASES

FORMATS = ("graphml", "dot", "json", "model-explorer")
LEVELS = ("op", "module")
_WRITERS = {"graphml": graph_formats.write_graphml, "dot": graph_formats.write_dot,
            "json": graph_formats.write_json}


def step_graph(
    run: Run, step: int | None = None, rank: int | None = None, phase: str = "forward",
    level: str = "op", compare: Any = None,
) -> nx.DiGraph:
    """One graph of a step: ``phase`` (or ``"all"``), at ``level`` op or module, with findings.

    ``compare``: a :class:`probe.Report` of this run against another, the directory
    ``probe compare -o`` wrote, or its ``overlay.json``.
    """
    if phase != "all" and phase not in PHASES:
        raise ProbeError(f"phase {phase!r} is not one of {[*PHASES, 'all']}")
    if level not in LEVELS:
        raise ProbeError(f"level {level!r} is not one of {list(LEVELS)}")
    step, rank = run.resolve(step, rank)
    graph = run.graph(step, rank, None if phase == "all" else [phase])
    comparisons = load_comparisons(compare, step, rank) if compare is not None else None
    annotate(graph, run.checks(step, rank), comparisons)
    graph.graph.update(run=str(run.path), step=step, rank=rank, phase=phase)
    if level == "module":
        graph = build_module_graph(graph, run.module_types(step, rank))
    return graph


def export_graph(
    run: Run | str | Path, path: str | Path, format: str = "graphml", *, step: int | None = None,
    rank: int | None = None, phase: str | None = None, level: str = "op", compare: Any = None,
) -> list[Path]:
    """Writes a step's graph to ``path`` in ``format``; returns the files written.

    For ``graphml``, ``json`` and ``dot``, ``phase`` defaults to ``"forward"``
    (``"all"`` keeps the whole step in one graph). ``model-explorer`` writes every
    phase present (or only ``phase``), op and module level, and the overlays.
    """
    if format not in FORMATS:
        raise ProbeError(f"format {format!r} is not one of {list(FORMATS)}")
    run = run if isinstance(run, Run) else load(run)
    step, rank = run.resolve(step, rank)
    path = Path(path)
    if not path.parent.is_dir():
        raise ProbeError(f"cannot write {str(path)!r}: {str(path.parent)!r} is not a directory")
    if format == "json" and level == "op":
        return [_write_op_json(run, path, step, rank, phase or "forward", compare)]
    if format != "model-explorer":
        graph = step_graph(run, step, rank, phase or "forward", level, compare)
        return [_WRITERS[format](graph, path)]
    label, graphs = model_explorer_graphs(run, step, rank, phase, compare)
    return model_explorer.write_model_explorer(path, label, graphs)


def _write_op_json(run: Run, path: Path, step: int, rank: int, phase: str, compare: Any) -> Path:
    """The op graph :func:`step_graph` makes, written as node-link JSON as the step's records are
    read (``Run.iter_ops``): the same file, in memory one batch of records and ~100 bytes an op,
    where the graph of a step of 10^6 ops takes gigabytes."""
    if phase != "all" and phase not in PHASES:
        raise ProbeError(f"phase {phase!r} is not one of {[*PHASES, 'all']}")
    comparisons = load_comparisons(compare, step, rank) if compare is not None else None
    found = findings_by_op(run.checks(step, rank), comparisons)

    def with_findings(elements: Iterable[tuple[GraphNode, list[GraphEdge]]]
                      ) -> Iterator[tuple[GraphNode, list[GraphEdge]]]:
        for (op_id, attrs), edges in elements:
            attrs.update(found.get(op_id, ()))
            yield (op_id, attrs), edges

    elements = graph_elements(run.iter_ops(step, rank), None if phase == "all" else [phase])
    attrs = {"level": "op", "run": str(run.path), "step": step, "rank": rank, "phase": phase}
    # Each batch of records, and the ids and output kinds kept of every op, would otherwise be
    # walked by the collector as they age: a sixth of the export's time, for no cycle.
    with collections_paused():
        return graph_formats.write_json_elements(path, attrs, with_findings(elements))


def model_explorer_graphs(
    run: Run, step: int, rank: int, phase: str | None = None, compare: Any = None,
) -> tuple[str, dict[str, nx.DiGraph]]:
    """The collection's label and graphs: each phase present (or only ``phase``), op and module level."""
    present = [p for p in PHASES if any(op.phase == p for op in run.ops(step, rank))]
    phases = present if phase in (None, "all") else [phase]
    graphs: dict[str, nx.DiGraph] = {}
    for p in phases:
        ops = step_graph(run, step, rank, p, "op", compare)
        graphs[p] = ops
        graphs[f"{p} (modules)"] = build_module_graph(ops, run.module_types(step, rank))
    return f"{run.path.name} step {step} rank {rank}", graphs
