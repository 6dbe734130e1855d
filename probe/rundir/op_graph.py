"""A step's op graph as a networkx DiGraph.

Nodes are op calls keyed by op id, carrying name, phase, module, tensor
metadata and, when the stats mode ran, the outputs' statistics; an edge
``producer -> consumer`` means the consumer read a value the producer wrote
(views and in-place writes were resolved by the tracer through storage and
version, see ``probe.tracer.value_ids``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

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


def build_graph(ops: Sequence[OpRecord], phases: Collection[str] | None = None) -> nx.DiGraph:
    """The graph of ``ops`` (one step's records, in order), optionally of some phases only.

    With ``phases``, edges from ops outside them (the forward activations a backward
    op reads) are left out; the consumer's inputs still name their dtypes and shapes.
    """
    if phases is not None:
        unknown = sorted(set(phases) - set(PHASES))
        if unknown:
            raise ProbeError(f"phase {unknown[0]!r} is not one of {list(PHASES)}")
    graph = nx.DiGraph(level="op")
    for op in ops:
        if phases is None or op.phase in phases:
            graph.add_node(op.id, **_node_attrs(op))
    for op in ops:
        if op.id not in graph:
            continue
        for position, tensor in enumerate(op.inputs):
            if tensor.source is None:
                continue
            producer = ops[tensor.source[0]]
            if producer.id not in graph:
                continue
            if graph.has_edge(producer.id, op.id):
                graph.edges[producer.id, op.id]["inputs"].append(position)
                continue
            out = producer.outputs[tensor.source[1]]
            graph.add_edge(
                producer.id,
                op.id,
                dtype=out.dtype,
                shape=list(out.shape),
                output=tensor.source[1],
                inputs=[position],
            )
    return graph
