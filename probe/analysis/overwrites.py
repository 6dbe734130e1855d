"""Inputs an op overwrites whole without reading them: ``out=`` arguments and ``copy_``'s (or
``fill_``'s, ``zero_``'s) destination. Their old contents (a reused buffer's, uninitialized
memory, a pending collective's output) are no value the op reads."""

from __future__ import annotations

from probe.rundir.run import OpRecord

_OVERWRITES_SELF = frozenset({"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor",
                              "aten.zero_.default"})


def overwritten_inputs(op: OpRecord) -> set[int]:
    """Positions of the inputs ``op`` overwrites whole without reading them."""
    if op.name.split(".")[-1].startswith("out"):
        written = sum(t.mutated for t in op.outputs)
        return set(range(len(op.inputs) - written, len(op.inputs)))
    if op.name in _OVERWRITES_SELF and op.inputs and op.outputs and op.inputs[0].shape == op.outputs[0].shape:
        return {0}
    return set()
