"""CPU reference implementations for ops the free-benchmark ``to_cpu`` check cannot run on the CPU.

Fused device ops (torch_npu's ``npu.*``, a library's CUDA-only kernel) have no
CPU kernel, or a CPU kernel that is not a reference. Register one:

>>> probe.register_cpu_reference("mylib::fused_gelu", lambda x: torch.nn.functional.gelu(x))

The reference receives the op's arguments (tensors moved to the CPU) and returns
what the op returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from probe.errors import ProbeError

_REFERENCES: dict[str, Callable[..., Any]] = {}


def _key(op: str | torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name.replace('::', '.')}.default"
    if not isinstance(op, str) or not op:
        raise ProbeError(f"register_cpu_reference: expected an op or its name, got {op!r}")
    name = op.replace("::", ".")
    return name if name.count(".") >= 2 else f"{name}.default"


def register_cpu_reference(op: Any, fn: Callable[..., Any]) -> None:
    """Use ``fn`` as the CPU reference of ``op`` (``"ns::name"``, ``"ns.name.overload"`` or the op)."""
    if not callable(fn):
        raise ProbeError(f"register_cpu_reference: {fn!r} is not callable")
    _REFERENCES[_key(op)] = fn


def cpu_reference(name: str) -> Callable[..., Any] | None:
    """The registered reference of the op named ``name`` (``"ns.op.overload"``), if any."""
    return _REFERENCES.get(name)
