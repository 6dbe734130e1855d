"""The JSON form of an op call's arguments, so a dumped op can be re-executed exactly.

Tensors become references to the op's dumped inputs (``{"tensor": position}``);
everything else an aten schema can take is encoded by type: numbers (with
non-finite floats spelled out), bools, strings, None, lists, dtypes, devices,
layouts, memory formats, complex numbers. A value with no faithful encoding
(a generator, an opaque object) becomes ``{"unreplayable": repr}``, and
:func:`decode` refuses it, naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from probe.errors import ProbeError

_MEMORY_FORMATS = {
    str(f).removeprefix("torch."): f
    for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
}
_LAYOUTS = {str(layout).removeprefix("torch."): layout for layout in (torch.strided, torch.sparse_coo)}


def _encode_float(x: float) -> Any:
    return x if math.isfinite(x) else {"float": repr(x)}


def encode_args(
    args: Sequence[Any], kwargs: dict[str, Any], tensor_ids: dict[int, int]
) -> dict[str, Any]:
    """``{"args": [...], "kwargs": {...}}``; ``tensor_ids`` maps ``id(tensor)`` to its input position."""

    def enc(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            position = tensor_ids.get(id(value))
            return {"tensor": position} if position is not None else {"unreplayable": "tensor"}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return _encode_float(value)
        if isinstance(value, complex):
            return {"complex": [_encode_float(value.real), _encode_float(value.imag)]}
        if isinstance(value, (list, tuple)):
            return [enc(v) for v in value]
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, torch.memory_format):
            return {"memory_format": str(value).removeprefix("torch.")}
        if isinstance(value, torch.layout):
            return {"layout": str(value).removeprefix("torch.")}
        return {"unreplayable": repr(value)[:200]}

    return {"args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kwargs.items()}}


def decode_args(
    encoded: dict[str, Any],
    tensor: Callable[[int], torch.Tensor],
    device: torch.device | str | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """Rebuild ``(args, kwargs)``; ``tensor(position)`` supplies the dumped inputs.

    ``device`` moves device arguments (``device=`` of factory ops) to the replay device.
    """

    def dec(value: Any) -> Any:
        if isinstance(value, list):
            return [dec(v) for v in value]
        if not isinstance(value, dict):
            return value
        (kind, payload), = value.items()
        if kind == "tensor":
            return tensor(payload)
        if kind == "float":
            return float(payload)
        if kind == "complex":
            return complex(dec(payload[0]), dec(payload[1]))
        if kind == "dtype":
            return getattr(torch, payload)
        if kind == "device":
            return torch.device(device) if device is not None else torch.device(payload)
        if kind == "memory_format":
            return _MEMORY_FORMATS[payload]
        if kind == "layout":
            return _LAYOUTS[payload]
        raise ProbeError(f"argument {payload!r} was recorded but cannot be rebuilt for a replay")

    return [dec(a) for a in encoded["args"]], {k: dec(v) for k, v in encoded["kwargs"].items()}
