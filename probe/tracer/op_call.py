"""The record of one traced op call, as the tracer keeps it during a step.

Tensor metadata are plain tuples, built once per tensor on the hot path:

- an input is ``(dtype, shape, source)``: ``source`` is where the value came
  from, ``(producer op index, its output position, exact)``, or None;
- an output is ``(dtype, shape, mutated)``: ``mutated`` is True for an
  argument the op wrote in place rather than a fresh result.

``exact`` is False when only the storage matched (a read after an in-place
write through another view): the producer wrote these bytes, but its output
was another view of them.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.tracer.frames import Frame
from probe.tracer.op_class import OpClass

Source = tuple[int, int, bool]
InputMeta = tuple[str, tuple[int, ...], Source | None]
OutputMeta = tuple[str, tuple[int, ...], bool]

GroupMeta = tuple[int, str, tuple[int, ...]]
"""A collective's process group: ``(size, group name, global ranks)``."""

OpRecordTuple = tuple[
    int, str, str, str, str, int, tuple[str, ...], tuple[InputMeta, ...], tuple[OutputMeta, ...],
    int | None, GroupMeta | None,
]
"""What the tracer keeps of an op until the step is written:
``(index, op id, name, phase, module, module call, module stack, inputs, outputs,
call site, process group)``. Only strings, numbers and tuples of them: the garbage
collector stops tracking such tuples, so a long step's records add little to its scans."""
RECORD_PHASE, RECORD_CALLSITE = 3, 9


class OpCall:
    """One traced op call, handed to the modes while it runs; kept as an :data:`OpRecordTuple`."""

    __slots__ = (
        "args", "callsite", "frame", "func", "index", "info", "input_tensors", "inputs", "kwargs",
        "op_id", "output_tensors", "outputs", "phase", "uninitialized",
    )

    def __init__(
        self,
        index: int,
        op_id: str,
        info: OpClass,
        phase: str,
        frame: Frame,
        inputs: list[InputMeta],
        input_tensors: list[torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        callsite: int | None,
        func: Any = None,
    ) -> None:
        self.func = func
        """The op overload itself (for modes that run it again)."""
        self.index = index
        """Position in the step's execution order (per rank)."""
        self.op_id = op_id
        self.info = info
        self.phase = phase
        self.frame = frame
        self.inputs = inputs
        self.outputs: list[OutputMeta] = []
        self.callsite = callsite
        self.input_tensors: list[torch.Tensor] | None = input_tensors
        self.output_tensors: list[torch.Tensor] | None = None
        self.args: tuple[Any, ...] = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.uninitialized = info.uninitialized_output
        """The outputs hold memory nothing wrote yet (``empty``, or a view of such memory)."""

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def module(self) -> str:
        return self.frame.origin.fqn

    def release(self) -> None:
        """Drop every reference to live tensors once the modes are done with the op."""
        self.input_tensors = None
        self.output_tensors = None
        self.args = ()
        self.kwargs = None
