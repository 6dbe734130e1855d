"""What the modes found, attached to the nodes of an op graph.

The op graph (``probe.rundir.op_graph``) already carries each op's output
statistics. This module adds the free-benchmark verdicts of the step and, when
given, the verdicts and metrics of a comparison against another run, so that
every exporter (GraphML, DOT, Model Explorer overlays) reads findings from one
place. ``AGGREGATES`` says how a group of ops (a module call) summarises each
finding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import networkx as nx

from probe.analysis.mode_records import Check
from probe.analysis.verdicts import SEVERITY
from probe.errors import ProbeError

CHECK_SEVERITY = {"skip": 0, "pass": 1, "fail": 2}
COMPARE_METRICS = ("cosine", "max_abs_err", "max_rel_err", "max_ulp")
"""Comparison metrics copied onto nodes as ``compare_<metric>``."""


def _worst(severity: Mapping[str, int]) -> Callable[[list[str]], str]:
    return lambda values: max(values, key=lambda v: severity.get(v, -1))


AGGREGATES: dict[str, Callable[[list[Any]], Any]] = {
    "abs_max": max,
    "norm": max,
    "nonfinite": sum,
    "check_verdict": _worst(CHECK_SEVERITY),
    "check_excess": max,
    "compare_verdict": _worst(SEVERITY),
    "compare_cosine": min,
    "compare_max_abs_err": max,
    "compare_max_rel_err": max,
    "compare_max_ulp": max,
}
"""Finding attribute -> how the values of several ops combine (None values are left out)."""


def findings_by_op(
    checks: Iterable[Check] = (),
    comparisons: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Op id -> the finding attributes its node gets (see :func:`annotate`), for the ops with any."""
    by_op: dict[str, list[Check]] = {}
    for check in checks:
        by_op.setdefault(check.op_id, []).append(check)
    found: dict[str, dict[str, Any]] = {}
    for op_id, op_checks in by_op.items():
        excess = [c.ratio / c.threshold for c in op_checks if c.ratio is not None and c.threshold]
        found[op_id] = {"check_verdict": AGGREGATES["check_verdict"]([c.verdict for c in op_checks]),
                        "check_excess": max(excess) if excess else None,
                        "check_perturb": op_checks[0].perturb}
    for op_id, row in (comparisons or {}).items():
        node = found.setdefault(op_id, {})
        node["compare_verdict"] = row.get("verdict")
        node["compare_message"] = row.get("message") or None
        for metric in COMPARE_METRICS:
            node[f"compare_{metric}"] = row.get(metric)
    return found


def annotate(
    graph: nx.DiGraph,
    checks: Iterable[Check] = (),
    comparisons: Mapping[str, Mapping[str, Any]] | None = None,
) -> nx.DiGraph:
    """Adds free-benchmark and comparison findings to ``graph``'s nodes, in place.

    ``checks`` are the step's checks (``run.checks(step, rank)``); ``comparisons`` maps op id
    (of this run) to a comparison row (``Report.overlay()`` for this step and rank).
    Nodes get ``check_verdict`` (worst over the op's outputs: fail, pass, skip),
    ``check_excess`` (largest measured deviation over its bound: above 1 failed),
    ``compare_verdict`` (pass, warning, error, unmatched, or "not compared" when the data
    of an output is missing or unreadable in either run), ``compare_message`` (why, for
    a verdict other than pass; else None) and ``compare_<metric>``.
    """
    for op_id, found in findings_by_op(checks, comparisons).items():
        if op_id in graph:
            graph.nodes[op_id].update(found)
    return graph


def aggregate(nodes: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The findings of a group of op nodes, combined by ``AGGREGATES``."""
    values: dict[str, list[Any]] = {}
    for node in nodes:
        for key in AGGREGATES:
            value = node.get(key)
            if value is not None:
                values.setdefault(key, []).append(value)
    return {key: AGGREGATES[key](found) for key, found in values.items()}


def load_comparisons(source: Any, step: int, rank: int) -> dict[str, dict[str, Any]]:
    """One step and rank of a comparison: op id of run A -> verdict and metrics.

    ``source`` is a :class:`probe.Report`, the directory ``probe compare -o`` wrote,
    or its ``overlay.json``.
    """
    if hasattr(source, "overlay"):
        layers = source.overlay()
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "overlay.json"
        try:
            layers = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProbeError(
                f"no comparison at {str(source)!r}: expected the directory `probe compare -o DIR` "
                "wrote, or its overlay.json"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise ProbeError(f"cannot read comparison {str(path)!r}: {e}") from None
    key = f"step{step}/rank{rank}"
    if key not in layers:
        raise ProbeError(
            f"the comparison has no step {step} rank {rank}; it holds {sorted(layers) or 'nothing'}"
        )
    return layers[key]
