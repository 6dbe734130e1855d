"""Op and module graphs as files: GraphML, DOT and node-link JSON.

GraphML holds only scalar attributes, so attributes that are lists, dicts or
sometimes None (shapes, statistics, findings of ops that have none) are written
as JSON text and named in the graph attributes ``probe_json_node_keys`` and
``probe_json_edge_keys``; :func:`read_graphml` decodes them, giving back the
graph that was written. Other GraphML readers see those attributes as strings.

DOT is for rendering with graphviz (``dot -Tsvg``): nodes are nested in one
cluster per module, labelled with the op and its first output, and filled by
what the modes found (see :func:`finding_colour`). Graphviz lays out a few
thousand nodes; export the module level (``level="module"``) for a larger step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import networkx as nx

from probe.analysis.module_graph import module_namespace
from probe.analysis.verdicts import ERROR, NOT_COMPARED, WARNING
from probe.rundir.op_graph import GraphEdge, GraphNode

_NATIVE = (str, int, float)
JSON_NODE_KEYS, JSON_EDGE_KEYS = "probe_json_node_keys", "probe_json_edge_keys"

# Fill colours of findings; the legend is in docs/graph.md. "not compared" (an output's data is
# missing in either run) gets a hue of its own: it is unknown, neither agreement nor an error.
COLOURS = {"nonfinite": "#e53935", "fail": "#fb8c00", ERROR: "#fb8c00", NOT_COMPARED: "#8e7cc3",
           WARNING: "#fdd835"}


def finding_colour(node: Mapping[str, Any]) -> str | None:
    """The fill of an op or module node, the most severe finding first: NaN/Inf red, a
    failed check or comparison error orange, not compared violet, a comparison warning
    yellow; None when nothing was found."""
    if node.get("nonfinite"):
        return COLOURS["nonfinite"]
    if node.get("check_verdict") == "fail" or node.get("compare_verdict") == ERROR:
        return COLOURS["fail"]
    if node.get("compare_verdict") in (NOT_COMPARED, WARNING):
        return COLOURS[node["compare_verdict"]]
    return None


# -- GraphML ---------------------------------------------------------------------


def _json_keys(attrs: Iterable[Mapping[str, Any]]) -> set[str]:
    """Keys whose values GraphML cannot hold as one scalar type."""
    types: dict[str, set[type]] = {}
    for data in attrs:
        for key, value in data.items():
            types.setdefault(key, set()).add(type(value))
    return {key for key, found in types.items() if len(found) > 1 or not found <= set(_NATIVE)}


def write_graphml(graph: nx.DiGraph, path: str | Path) -> Path:
    node_keys = _json_keys(data for _, data in graph.nodes(data=True))
    edge_keys = _json_keys(data for _, _, data in graph.edges(data=True))
    out = nx.DiGraph()
    out.graph.update({k: v if isinstance(v, _NATIVE) else json.dumps(v) for k, v in graph.graph.items()})
    out.graph[JSON_NODE_KEYS] = json.dumps(sorted(node_keys))
    out.graph[JSON_EDGE_KEYS] = json.dumps(sorted(edge_keys))
    for node, data in graph.nodes(data=True):
        out.add_node(node, **{k: json.dumps(v) if k in node_keys else v for k, v in data.items()})
    for a, b, data in graph.edges(data=True):
        out.add_edge(a, b, **{k: json.dumps(v) if k in edge_keys else v for k, v in data.items()})
    path = Path(path)
    nx.write_graphml(out, path)
    return path


def read_graphml(path: str | Path) -> nx.DiGraph:
    """A graph written by :func:`write_graphml`, with its JSON-coded attributes decoded."""
    graph = nx.read_graphml(path)
    node_keys = set(json.loads(graph.graph.pop(JSON_NODE_KEYS, "[]")))
    edge_keys = set(json.loads(graph.graph.pop(JSON_EDGE_KEYS, "[]")))
    for _, data in graph.nodes(data=True):
        for key in node_keys & data.keys():
            data[key] = json.loads(data[key])
    for _, _, data in graph.edges(data=True):
        for key in edge_keys & data.keys():
            data[key] = json.loads(data[key])
    return graph


# -- node-link JSON --------------------------------------------------------------


_JSON = json.JSONEncoder()
"""``json.dump``'s encoding (its separators; non-finite numbers as ``NaN``/``Infinity``), used one
value at a time: a one-shot ``encode`` runs in C, where ``json.dump`` walks the whole document in
Python."""


class _ArrayWriter:
    """The items of a JSON array, written to ``file`` comma separated, many to a write."""

    BATCH = 1024

    def __init__(self, file: IO[str]) -> None:
        self.file, self.pending, self.started = file, [], False

    def add(self, text: str) -> None:
        self.pending.append(text)
        if len(self.pending) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.file.write((", " if self.started else "") + ", ".join(self.pending))
            self.started, self.pending = True, []


def write_json_elements(
    path: str | Path, graph_attrs: Mapping[str, Any], elements: Iterable[tuple[GraphNode, list[GraphEdge]]],
) -> Path:
    """networkx node-link JSON (what :func:`read_json` reads) written as the graph's nodes come,
    each with the edges into it (``probe.rundir.op_graph.graph_elements``): the graph is never
    held whole, nor its text. Nodes are written as they come, edges to a temporary file beside
    ``path`` and copied after them. Edges are in the order of the nodes they enter."""
    path = Path(path)
    encode = _JSON.encode
    with open(path, "w") as out, tempfile.TemporaryFile("w+", dir=path.parent) as edges_file:
        header = {"directed": True, "multigraph": False, "graph": dict(graph_attrs)}
        out.write(encode(header)[:-1] + ', "nodes": [')
        nodes, edges = _ArrayWriter(out), _ArrayWriter(edges_file)
        for (node, attrs), into in elements:
            nodes.add(encode({**attrs, "id": node}))
            for a, b, data in into:
                edges.add(encode({**data, "source": a, "target": b}))
        nodes.flush()
        edges.flush()
        out.write('], "edges": [')
        edges_file.seek(0)
        shutil.copyfileobj(edges_file, out, 1 << 20)
        out.write("]}")
    return path


def write_json(graph: nx.DiGraph, path: str | Path) -> Path:
    """networkx node-link JSON; non-finite statistics are written as ``NaN``/``Infinity``."""
    elements = (((node, data), [(a, node, edge) for a, _, edge in graph.in_edges(node, data=True)])
                for node, data in graph.nodes(data=True))
    return write_json_elements(path, graph.graph, elements)


def read_json(path: str | Path) -> nx.DiGraph:
    with open(path) as f:
        return nx.node_link_graph(json.load(f), edges="edges")


# -- DOT -------------------------------------------------------------------------


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tensor_label(dtype: str, shape: list[int]) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def _dot_label(node: Mapping[str, Any], module_call: bool) -> tuple[str, str]:
    """(label, tooltip) of an op node or a module-call node."""
    if module_call:
        title = node["module"] or "<outside modules>"
        kind = f" ({node['type']})" if node.get("type") else ""
        return f"{title}{kind}\n{node['ops']} ops", f"{node['phase']} {title} call {node['module_call']}"
    short = node["name"].removeprefix("aten.").removesuffix(".default")
    outputs = node["output_dtypes"]
    first = f"\n{_tensor_label(outputs[0], node['output_shapes'][0])}" if outputs else ""
    tooltip = f"{node['name']} @ {node['module'] or '<outside modules>'}"
    if node.get("compare_message"):
        tooltip += f"\n{node['compare_verdict']}: {node['compare_message']}"
    return short + first, tooltip


def write_dot(graph: nx.DiGraph, path: str | Path, name: str = "probe") -> Path:
    """Graphviz DOT, one cluster per module (nested as the module hierarchy)."""
    modules = graph.graph.get("level") == "module"
    tree: dict[str, Any] = {"nodes": [], "children": {}}
    for node, data in graph.nodes(data=True):
        branch = tree
        parts = module_namespace(data["module"], data["module_call"])
        if modules:  # a module call is drawn inside its parent's cluster
            parts = parts[:-1]
        for part in parts:
            branch = branch["children"].setdefault(part, {"nodes": [], "children": {}})
        branch["nodes"].append(node)
    ids = {node: f"n{i}" for i, node in enumerate(graph.nodes)}
    lines = [f"digraph {_quote(name)} {{", "  node [shape=box, style=\"rounded,filled\", fillcolor=white, "
             "fontname=Helvetica, fontsize=10];", "  edge [fontname=Helvetica, fontsize=8];"]
    clusters = 0

    def emit(branch: dict[str, Any], label: str | None, indent: str) -> None:
        nonlocal clusters
        if label is not None:
            lines.append(f"{indent}subgraph cluster_{clusters} {{")
            lines.append(f"{indent}  label={_quote(label)}; style=rounded; color=gray60;")
            clusters += 1
        inner = indent + ("  " if label is not None else "")
        for node in branch["nodes"]:
            data = graph.nodes[node]
            text, tooltip = _dot_label(data, modules)
            fill = finding_colour(data)
            extra = f", fillcolor={_quote(fill)}" if fill else ""
            lines.append(f"{inner}{ids[node]} [label={_quote(text)}, tooltip={_quote(tooltip)}{extra}];")
        for part, child in branch["children"].items():
            emit(child, part, inner)
        if label is not None:
            lines.append(f"{indent}}}")

    emit(tree, None, "  ")
    for a, b, data in graph.edges(data=True):
        label = _tensor_label(data["dtype"], data["shape"])
        if data.get("tensors", 1) > 1:
            label += f" x{data['tensors']}"
        lines.append(f"  {ids[a]} -> {ids[b]} [label={_quote(label)}];")
    lines.append("}")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path
