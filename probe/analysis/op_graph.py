"""A step's op graph as a networkx DiGraph.

Nodes are op calls keyed by op id, carrying name, phase, module and tensor
metadata; an edge ``producer -> consumer`` means the consumer read a value the
producer wrote (views and in-place writes were resolved by the tracer through
storage and version, see ``probe.tracer.value_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from probe.rundir.reader import OpRecord


def build_graph(ops: Sequence[OpRecord]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for op in ops:
        graph.add_node(
            op.id,
            index=op.index,
            name=op.name,
            phase=op.phase,
            module=op.module,
            module_call=op.module_call,
            input_dtypes=[t.dtype for t in op.inputs],
            input_shapes=[list(t.shape) for t in op.inputs],
            output_dtypes=[t.dtype for t in op.outputs],
            output_shapes=[list(t.shape) for t in op.outputs],
        )
    for op in ops:
        for position, tensor in enumerate(op.inputs):
            if tensor.source is None:
                continue
            producer = ops[tensor.source[0]]
            out = producer.outputs[tensor.source[1]]
            if graph.has_edge(producer.id, op.id):
                graph.edges[producer.id, op.id]["inputs"].append(position)
                continue
            graph.add_edge(
                producer.id,
                op.id,
                dtype=out.dtype,
                shape=list(out.shape),
                output=tensor.source[1],
                inputs=[position],
            )
    return graph
