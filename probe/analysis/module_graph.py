"""The module-level summary of an op graph: one node per module call.

A step of a large model has 10^4-10^5 ops; read op by op it is a wall. Here
each op joins the node of the innermost module call it ran in (its phase,
module FQN and call index), nodes carry the op count, the most frequent ops
and the findings of their ops combined (``graph_findings.AGGREGATES``), and an
edge ``A -> B`` counts the tensors ops of call A passed to ops of call B.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import networkx as nx

from probe.analysis.graph_findings import aggregate


def module_call_key(op_id: str) -> str:
    """The module call an op ran in, as its id names it: ``phase:fqn[call]``.

    Op ids are ``phase:fqn[call]:op name:n`` (``phase::op name:n`` outside modules).
    """
    return op_id.rsplit(":", 2)[0]


def common_module(modules: list[str]) -> str:
    """The innermost module holding all of ``modules`` ('' when none does)."""
    parts = [m.split(".") if m else [] for m in modules]
    common: list[str] = []
    for names in zip(*parts, strict=False):  # stops at the shortest
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def within(module: str, scope: str) -> bool:
    """Whether ``module`` is ``scope`` or inside it (every module is inside '')."""
    return not scope or module == scope or module.startswith(scope + ".")


def module_namespace(module: str, call: int) -> list[str]:
    """The module hierarchy an op (or module call) sits in, outermost first.

    ``layers.0.attn`` call 0 is ``["layers", "0", "attn"]``; a later call of the
    innermost module is set apart as ``attn#1``; outside modules it is ``[]``.
    """
    if not module:
        return []
    parts = module.split(".")
    if call > 0:
        parts[-1] = f"{parts[-1]}#{call}"
    return parts


def build_module_graph(ops: nx.DiGraph, module_types: Mapping[str, str] | None = None) -> nx.DiGraph:
    """Collapses an op graph (``Run.graph``, possibly annotated) to module calls."""
    types = module_types or {}
    members: dict[str, list[str]] = {}
    key_of: dict[str, str] = {}
    for op_id in ops.nodes:
        key = module_call_key(op_id)
        key_of[op_id] = key
        members.setdefault(key, []).append(op_id)
    graph = nx.DiGraph()
    graph.graph.update(ops.graph, level="module")
    for key, op_ids in members.items():
        first = ops.nodes[op_ids[0]]
        names = Counter(ops.nodes[i]["name"] for i in op_ids)
        graph.add_node(
            key,
            index=first["index"],
            phase=first["phase"],
            module=first["module"],
            module_call=first["module_call"],
            type=types.get(first["module"], ""),
            ops=len(op_ids),
            op_names=dict(names.most_common(8)),
            first_op=op_ids[0],
            last_op=op_ids[-1],
            **aggregate(ops.nodes[i] for i in op_ids),
        )
    for producer, consumer, edge in ops.edges(data=True):
        a, b = key_of[producer], key_of[consumer]
        if a == b:
            continue
        if graph.has_edge(a, b):
            graph.edges[a, b]["tensors"] += 1
        else:
            graph.add_edge(a, b, tensors=1, dtype=edge["dtype"], shape=list(edge["shape"]))
    return graph
