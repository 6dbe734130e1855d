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
_DTYPES = {str(t).removeprefix("torch."): t for t in vars(torch).values() if isinstance(t, torch.dtype)}
_LAYOUTS = {str(layout).removeprefix("torch."): layout for layout in (torch.strided, torch.sparse_coo)}


def encode_float(x: float) -> Any:
    """A float's JSON form: itself, or ``{"float": "inf"}`` where JSON has no spelling for it."""
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
            return encode_float(value)
        if isinstance(value, complex):
            return {"complex": [encode_float(value.real), encode_float(value.imag)]}
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
    ``encoded`` comes from a run, which may have been edited: a value that is not one this
    module writes (an unknown dtype name, an input position the op does not have, a tagged
    value with two tags) is a ``ProbeError`` naming it, never another exception and never a
    look-up of an arbitrary name (a "dtype" of ``load`` is not ``torch.load``).
    """

    def refuse(value: Any, why: str) -> ProbeError:
        return ProbeError(f"recorded argument {_short(value)} {why}")

    def dec(value: Any) -> Any:
        if isinstance(value, list):
            return [dec(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1:
            raise refuse(value, "is not one tagged value")
        (kind, payload), = value.items()
        named = payload if isinstance(payload, str) else None  # the tables' keys are names
        if kind == "tensor":
            if not isinstance(payload, int) or isinstance(payload, bool) or payload < 0:
                raise refuse(value, "is not an input position")
            try:
                return tensor(payload)
            except IndexError:
                raise refuse(value, "names an input the op does not have") from None
        if kind == "float" and isinstance(payload, str):
            try:
                return float(payload)
            except ValueError:
                raise refuse(value, "is not a number") from None
        if kind == "complex" and isinstance(payload, list) and len(payload) == 2:
            parts = [dec(v) for v in payload]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parts):
                return complex(parts[0], parts[1])
        if kind == "dtype" and named in _DTYPES:
            return _DTYPES[named]
        if kind == "device" and isinstance(payload, str):
            try:
                return torch.device(device) if device is not None else torch.device(payload)
            except RuntimeError:
                raise refuse(value, "is not a device") from None
        if kind == "memory_format" and named in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[named]
        if kind == "layout" and named in _LAYOUTS:
            return _LAYOUTS[named]
        if kind == "unreplayable":
            raise ProbeError(f"argument {payload!r} was recorded but cannot be rebuilt for a replay")
        raise refuse(value, "is not a value a replay can rebuild")

    args, kwargs = encoded["args"], encoded["kwargs"]
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ProbeError("a recorded call's args must be a list and its kwargs an object")
    return [dec(a) for a in args], {k: dec(v) for k, v in kwargs.items()}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
