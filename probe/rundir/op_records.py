"""The JSON form of one op record (a line of ``ops.jsonl``), both directions.

Tensor lists are compact arrays (the tracer's tuples, see ``probe.tracer.op_call``):
an input is ``[dtype, shape, source]`` where source is ``[producer index, output
position, exact]`` or null; an output is ``[dtype, shape, mutated]``. Collectives
also carry ``group``: ``{"size", "name", "ranks"}`` of their process group.
"""

from __future__ import annotations

from typing import Any

from probe.tracer.op_call import OpRecordTuple


def encode(record: OpRecordTuple) -> dict[str, Any]:
    index, op_id, name, phase, module, call, stack, inputs, outputs, callsite, group = record
    row: dict[str, Any] = {
        "i": index,
        "id": op_id,
        "name": name,
        "phase": phase,
        "module": module,
        "call": call,
        "stack": stack,
        "in": inputs,
        "out": outputs,
    }
    if callsite is not None:
        row["site"] = callsite
    if group is not None:
        size, group_name, ranks = group
        row["group"] = {"size": size, "name": group_name, "ranks": list(ranks)}
    return row
