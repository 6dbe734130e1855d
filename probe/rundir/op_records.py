"""The JSON form of one op record (a line of ``ops.jsonl``), both directions.

Tensor lists are compact arrays (the tracer's tuples, see ``probe.tracer.op_call``):
an input is ``[dtype, shape, source]`` where source is ``[producer index, output
position, exact]`` or null; an output is ``[dtype, shape, mutated]``.
"""

from __future__ import annotations

from typing import Any

from probe.tracer.op_call import OpCall


def encode(call: OpCall) -> dict[str, Any]:
    frame = call.frame.origin
    row: dict[str, Any] = {
        "i": call.index,
        "id": call.op_id,
        "name": call.info.name,
        "phase": call.phase,
        "module": frame.fqn,
        "call": frame.call,
        "stack": frame.stack(),
        "in": call.inputs,
        "out": call.outputs,
    }
    if call.callsite is not None:
        row["site"] = call.callsite
    return row
