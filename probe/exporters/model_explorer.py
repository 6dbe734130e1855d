"""Op graphs for Model Explorer (``ai-edge-model-explorer``), with node-data overlays.

Model Explorer is a hierarchical WebGL graph viewer that lays out graphs of
10^5 nodes. It reads a *graph collection* JSON (its "JSON graph" adapter) and,
separately, *node data* JSON files that colour nodes by a value; both formats
are documented in its ``graph_builder.py`` and ``node_data_builder.py``.

What is written:

- one collection per step and rank, one graph per phase at op level (op
  nodes in namespaces = the module hierarchy; incoming edges name the producer's
  output and the consumer's input) and one per phase at module level (one node
  per module call, ``probe.analysis.module_graph``);
- one node-data file per finding present (``OVERLAYS``): values per node of
  every graph, with thresholds or a gradient for the colours. Group nodes show
  the spread of their children's values.

``probe view`` serves these with Model Explorer's own server (the optional
``viewer`` extra); without it, open the files in any Model Explorer.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import socket
import sys
import threading
import time
import webbrowser
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import networkx as nx

from probe.analysis.module_graph import module_namespace
from probe.analysis.verdicts import ERROR, NOT_COMPARED, PASS, UNMATCHED, WARNING
from probe.errors import ProbeError
from probe.exporters.graph_formats import COLOURS

STAT_KEYS = ("min", "max", "mean", "norm", "nan", "inf")
_PASS_COLOUR, _SKIP_COLOUR = "#c8e6c9", "#eeeeee"
_GRADIENT = [{"stop": 0, "bgColor": "#ffffff"}, {"stop": 0.5, "bgColor": "#ffcc80"},
             {"stop": 1, "bgColor": "#e53935"}]


@dataclass(frozen=True)
class Overlay:
    """One node-data file: the values of one node attribute."""

    name: str
    attr: str
    colours: dict[str, Any]
    """``thresholds`` or ``gradient`` (numbers), or ``categories`` (value -> colour)."""


OVERLAYS = (
    Overlay("nan-inf count", "nonfinite",
            {"thresholds": [{"value": 0, "bgColor": _PASS_COLOUR},
                            {"value": 1e300, "bgColor": COLOURS["nonfinite"]}]}),
    Overlay("max abs", "abs_max", {"gradient": _GRADIENT}),
    Overlay("norm", "norm", {"gradient": _GRADIENT}),
    Overlay("free-benchmark verdict", "check_verdict",
            {"categories": {"pass": _PASS_COLOUR, "fail": COLOURS["fail"], "skip": _SKIP_COLOUR}}),
    Overlay("free-benchmark deviation over bound", "check_excess",
            {"thresholds": [{"value": 1, "bgColor": _PASS_COLOUR},
                            {"value": 1e300, "bgColor": COLOURS["fail"]}]}),
    Overlay("compare verdict", "compare_verdict",
            {"categories": {PASS: _PASS_COLOUR, WARNING: COLOURS[WARNING], ERROR: COLOURS[ERROR],
                            NOT_COMPARED: COLOURS[NOT_COMPARED], UNMATCHED: _SKIP_COLOUR}}),
    Overlay("compare max relative error", "compare_max_rel_err", {"gradient": _GRADIENT}),
    Overlay("compare cosine", "compare_cosine",
            {"gradient": [{"stop": 0, "bgColor": COLOURS["nonfinite"]}, {"stop": 1, "bgColor": "#ffffff"}]}),
)


def _finite(value: Any) -> bool:
    return not (isinstance(value, float) and not math.isfinite(value))


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _tensor(dtype: str, shape: list[int]) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _attrs(pairs: Mapping[str, Any]) -> list[dict[str, str]]:
    return [{"key": k, "value": _fmt(v)} for k, v in pairs.items() if v is not None]


def _op_node(op_id: str, node: Mapping[str, Any], incoming: list[dict[str, str]]) -> dict[str, Any]:
    outputs = []
    for i, (dtype, shape) in enumerate(zip(node["output_dtypes"], node["output_shapes"], strict=True)):
        stats = node["output_stats"][i] or {}
        outputs.append({"id": str(i), "attrs": [{"key": "tensor_shape", "value": _tensor(dtype, shape)},
                                                 *_attrs({k: stats.get(k) for k in STAT_KEYS})]})
    inputs = [
        {"id": str(i), "attrs": [{"key": "tensor_shape", "value": _tensor(dtype, shape)}]}
        for i, (dtype, shape) in enumerate(zip(node["input_dtypes"], node["input_shapes"], strict=True))
    ]
    findings = {k: node.get(k) for k in ("check_verdict", "check_excess", "check_perturb",
                                         "compare_verdict", "compare_message", "compare_cosine",
                                         "compare_max_rel_err", "compare_max_ulp")}
    return {
        "id": op_id,
        "label": node["name"].removeprefix("aten.").removesuffix(".default"),
        "namespace": "/".join(module_namespace(node["module"], node["module_call"])),
        "attrs": _attrs({"op": node["name"], "id": op_id, "index": node["index"], "phase": node["phase"],
                         "module": node["module"] or "<outside modules>", **findings}),
        "incomingEdges": incoming,
        "outputsMetadata": outputs,
        "inputsMetadata": inputs,
    }


def _module_node(key: str, node: Mapping[str, Any], incoming: list[dict[str, str]]) -> dict[str, Any]:
    parts = module_namespace(node["module"], node["module_call"])
    label = parts[-1] if parts else "<outside modules>"
    top = ", ".join(f"{name.removeprefix('aten.')} x{n}" for name, n in node["op_names"].items())
    return {
        "id": key,
        "label": f"{label} ({node['type']})" if node.get("type") else label,
        "namespace": "/".join(parts[:-1]),
        "attrs": _attrs({"module": node["module"] or "<outside modules>", "call": node["module_call"],
                         "type": node.get("type") or None, "phase": node["phase"], "ops": node["ops"],
                         "most frequent ops": top, "first op": node["first_op"],
                         **{k: node.get(k) for k in ("abs_max", "nonfinite", "check_verdict",
                                                     "compare_verdict")}}),
        "incomingEdges": incoming,
    }


def to_graph(graph_id: str, graph: nx.DiGraph) -> dict[str, Any]:
    """One Model Explorer graph from an op graph or a module graph."""
    nodes = []
    modules = graph.graph.get("level") == "module"
    for key, node in graph.nodes(data=True):
        if modules:
            incoming = [{"sourceNodeId": src, "sourceNodeOutputId": "0", "targetNodeInputId": str(i)}
                        for i, src in enumerate(graph.predecessors(key))]
            nodes.append(_module_node(key, node, incoming))
        else:
            incoming = [
                {"sourceNodeId": src, "sourceNodeOutputId": str(edge["output"]),
                 "targetNodeInputId": str(position)}
                for src, _, edge in graph.in_edges(key, data=True) for position in edge["inputs"]
            ]
            nodes.append(_op_node(key, node, incoming))
    return {"id": graph_id, "nodes": nodes}


def to_collection(label: str, graphs: Mapping[str, nx.DiGraph]) -> dict[str, Any]:
    """A graph collection: graph id -> op or module graph."""
    return {"label": label, "graphs": [to_graph(gid, g) for gid, g in graphs.items()]}


def to_node_data(graphs: Mapping[str, nx.DiGraph]) -> dict[str, dict[str, Any]]:
    """Overlay name -> Model Explorer node data (graph id -> values), for findings present."""
    out: dict[str, dict[str, Any]] = {}
    for overlay in OVERLAYS:
        per_graph: dict[str, Any] = {}
        for graph_id, graph in graphs.items():
            results: dict[str, Any] = {}
            for key, node in graph.nodes(data=True):
                value = node.get(overlay.attr)
                if value is None or not _finite(value):
                    continue
                result: dict[str, Any] = {"value": value}
                if "categories" in overlay.colours:
                    result["bgColor"] = overlay.colours["categories"].get(value, _SKIP_COLOUR)
                results[key] = result
            if results:
                colours = {k: v for k, v in overlay.colours.items() if k != "categories"}
                if "categories" in overlay.colours:
                    # Group nodes then list each verdict's share rather than one colour bar.
                    colours["showExpandedSummaryOnGroupNode"] = True
                per_graph[graph_id] = {"name": overlay.name, "results": results, **colours}
        if per_graph:
            out[overlay.name] = per_graph
    return out


def overlay_path(graph_path: Path, overlay: str) -> Path:
    return graph_path.with_name(f"{graph_path.stem}.{overlay.replace(' ', '_')}.json")


def write_model_explorer(path: str | Path, label: str, graphs: Mapping[str, nx.DiGraph]) -> list[Path]:
    """Writes the collection to ``path`` and each overlay beside it; returns the paths."""
    path = Path(path)
    with open(path, "w") as f:
        json.dump(to_collection(label, graphs), f, allow_nan=False)
    written = [path]
    for name, data in to_node_data(graphs).items():
        target = overlay_path(path, name)
        with open(target, "w") as f:
            json.dump(data, f, allow_nan=False)
        written.append(target)
    return written


# What the viewer opens on, most severe first (the order of ``finding_colour``),
# and the overlay it then shows. The earliest comparison error of a step is its first
# divergence (its producers are earlier, so none is an error); ops whose data is missing
# come after it: they are shown by the same overlay, in their own colour.
_FOCUS_FINDINGS = (
    (lambda node: bool(node.get("nonfinite")), "nan-inf count"),
    (lambda node: node.get("check_verdict") == "fail", "free-benchmark verdict"),
    (lambda node: node.get("compare_verdict") == ERROR, "compare verdict"),
    (lambda node: node.get("compare_verdict") == NOT_COMPARED, "compare verdict"),
)


@dataclass(frozen=True)
class Focus:
    """Where the viewer opens: a graph, an op in it (or none), and the overlay shown."""

    graph_id: str | None
    node_id: str | None
    overlay: str


def focus(graphs: Mapping[str, nx.DiGraph]) -> Focus:
    """The earliest op with the most severe finding (NaN/Inf, then a failed check, then
    a comparison error: the first divergence, then an op not compared), coloured by that
    finding; else the first graph, coloured by the comparison if there is one, else by
    NaN/Inf counts."""
    op_graphs = {gid: g for gid, g in graphs.items() if g.graph.get("level") != "module"}
    for found, overlay in _FOCUS_FINDINGS:
        hits = [(node["index"], gid, key) for gid, g in op_graphs.items()
                for key, node in g.nodes(data=True) if found(node)]
        if hits:
            _, graph_id, node_id = min(hits)
            return Focus(graph_id, node_id, overlay)
    compared = any(n.get("compare_verdict") for g in op_graphs.values() for _, n in g.nodes(data=True))
    return Focus(next(iter(graphs), None), None, "compare verdict" if compared else "nan-inf count")


def viewer_url(config: Any, host: str, port: int, label: str, where: Focus) -> str:
    """The address that opens Model Explorer on ``config``'s model and node data,
    showing ``where`` (Model Explorer's own address opens on the largest graph of
    the collection, often the optimizer's)."""
    pane = {"deepestExpandedGroupNodeIds": [], "selectedNodeId": where.node_id or "",
            "selectedGraphId": where.graph_id or "", "selectedCollectionLabel": label, "widthFraction": 1}
    data = {"models": config.model_sources, "nodeData": config.node_data_sources,
            "nodeDataTargets": config.node_data_target_models, "uiState": {"paneStates": [pane]}}
    return f"http://{host}:{port}/?data={quote(json.dumps(data))}"


def serve(paths: list[Path], label: str, graphs: Mapping[str, nx.DiGraph], host: str = "localhost",
          port: int = 8080, open_browser: bool = True, announce: Callable[[str], None] | None = None) -> None:
    """Serves a written collection (``paths[0]``) and its overlays with Model Explorer's
    server, opened on :func:`focus`; blocks until interrupted. ``announce`` gets the
    address (default: printed to the standard output as it is now; bind a console
    to ``sys.stdout`` before calling, as the server's own output is kept off it)."""
    announce = announce or functools.partial(print, file=sys.stdout, flush=True)
    try:
        import model_explorer
    except ImportError:
        raise ProbeError(
            "probe view needs Model Explorer: pip install 'probe[viewer]' (ai-edge-model-explorer); "
            f"or open {str(paths[0])!r} in a Model Explorer you have"
        ) from None
    where = focus(graphs)
    config = model_explorer.config().add_model_from_path(str(paths[0]))
    # Model Explorer colours the graph by the node data added last.
    shown = overlay_path(paths[0], where.overlay)
    for overlay in sorted(paths[1:], key=lambda p: p == shown):
        config.add_node_data_from_path(str(overlay))
    url = viewer_url(config, host, port, label, where)

    def announce_when_up() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host, port), timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        announce(url)
        if open_browser:
            webbrowser.open_new_tab(url)

    threading.Thread(target=announce_when_up, daemon=True).start()
    # Its own banner names an address without the focus: keep it off our output.
    with contextlib.redirect_stdout(io.StringIO()):
        model_explorer.visualize_from_config(config, host=host, port=port, no_open_in_browser=True)
