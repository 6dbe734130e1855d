"""A step's op graph as a networkx DiGraph.

Nodes are op calls keyed by op id, carrying name, phase, module, tensor
metadata and, when the stats mode ran, the outputs' statistics; an edge
``producer -> consumer`` means the consumer read a value the producer wrote
(views and in-place writes were resolved by the tracer through storage and
version, see ``probe.tracer.value_ids``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import networkx as nx

from probe.errors import ProbeError
from probe.rundir.records import OpRecord, TensorRecord
from probe.vocabulary.option_values import PHASES


def _largest(values: list[float | int | None]) -> float | int | None:
    # NaN would make max() depend on order; a NaN output is counted in "nonfinite".
    known = [v for v in values if v is not None and not math.isnan(v)]
    return max(known) if known else None


def _node_attrs(op: OpRecord) -> dict:
    outputs: list[TensorRecord] = op.outputs
    return {
        "index": op.index,
        "name": op.name,
        "phase": op.phase,
        "module": op.module,
        "module_call": op.module_call,
        "input_dtypes": [t.dtype for t in op.inputs],
        "input_shapes": [list(t.shape) for t in op.inputs],
        "output_dtypes": [t.dtype for t in outputs],
        "output_shapes": [list(t.shape) for t in outputs],
        "output_stats": [t.stats for t in outputs],
        # None when the stats mode did not run: "unknown" must not read as "zero".
        "abs_max": _largest([t.abs_max for t in outputs]),
        "norm": _largest([t.stats["norm"] if t.stats else None for t in outputs]),
        "nonfinite": None if all(t.nonfinite is None for t in outputs)
        else sum(t.nonfinite or 0 for t in outputs),
        "group": op.group,  # collectives: {"size", "name", "ranks"} of their process group
    }


GraphNode = tuple[str, dict[str, Any]]
"""``(op id, attributes)``."""
GraphEdge = tuple[str, str, dict[str, Any]]
"""``(producer id, consumer id, attributes)``: ``dtype``, ``shape`` and ``output`` (position) of
the value read, ``inputs`` (the consumer's input positions that read it)."""


def _check_phases(phases: Collection[str] | None) -> None:
    if phases is not None:
        unknown = sorted(set(phases) - set(PHASES))
        if unknown:
            raise ProbeError(f"phase {unknown[0]!r} is not one of {list(PHASES)}")


def graph_elements(ops: Iterable[OpRecord], phases: Collection[str] | None = None
                   ) -> Iterator[tuple[GraphNode, list[GraphEdge]]]:
    """The graph of ``ops`` (one step's records, in order: each op's producers before it), one op
    at a time: its node and the edges into it, for ops of ``phases`` (all when None).

    The records go by as they come (from ``Run.iter_ops``, a batch at a time); of each op only
    what an edge out of it needs is kept (its id and its outputs' dtypes and shapes, shared
    between ops with the same ones), so a step of any size costs ~100 bytes an op.
    """
    _check_phases(phases)
    ids: list[str | None] = []  # op #i's id, None when it is not in the graph
    outputs: list[tuple[tuple[str, tuple[int, ...]], ...]] = []  # op #i's outputs' (dtype, shape)
    shared: dict[tuple[tuple[str, tuple[int, ...]], ...], tuple[tuple[str, tuple[int, ...]], ...]] = {}
    for op in ops:
        kinds = tuple((t.dtype, t.shape) for t in op.outputs)
        outputs.append(shared.setdefault(kinds, kinds))
        if phases is not None and op.phase not in phases:
            ids.append(None)
            continue
        ids.append(op.id)
        edges: dict[str, GraphEdge] = {}  # producer id -> the edge from it, its inputs gathered
        for position, tensor in enumerate(op.inputs):
            if tensor.source is None:
                continue
            producer, output = tensor.source
            producer_id = ids[producer]
            if producer_id is None:
                continue
            edge = edges.get(producer_id)
            if edge is not None:
                edge[2]["inputs"].append(position)
                continue
            dtype, shape = outputs[producer][output]
            edges[producer_id] = (producer_id, op.id, {"dtype": dtype, "shape": list(shape), "output": output,
                                                        "inputs": [position]})
        yield (op.id, _node_attrs(op)), list(edges.values())


def build_graph(ops: Iterable[OpRecord], phases: Collection[str] | None = None) -> nx.DiGraph:
    """The graph of ``ops`` (one step's records, in order), optionally of some phases only.

    With ``phases``, edges from ops outside them (the forward activations a backward
    op reads) are left out; the consumer's inputs still name their dtypes and shapes.
    """
    graph = nx.DiGraph(level="op")
    for (op_id, attrs), edges in graph_elements(ops, phases):
        graph.add_node(op_id, **attrs)
        for producer, consumer, data in edges:
            graph.add_edge(producer, consumer, **data)
    return graph
