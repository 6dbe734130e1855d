"""Tensors that are not one strided view of bytes, as the dump stores them: in parts.

The dump stores a strided tensor as a view of its storage's bytes (``probe.modes.dump``). A
sparse, nested, quantized or zero tensor has no such single view, but each is a few plain
strided tensors and a handful of numbers:

- ``sparse_coo``: parts ``indices``, ``values``; params ``coalesced``;
- ``sparse_csr``, ``sparse_bsr``: parts ``crow_indices``, ``col_indices``, ``values``;
- ``sparse_csc``, ``sparse_bsc``: parts ``ccol_indices``, ``row_indices``, ``values``;
- ``nested`` (``torch.nested``, strided): part ``buffer`` (its storage, 1-D); params ``sizes``,
  ``strides``, ``offsets`` (one row per component);
- ``quantized_per_tensor``: part ``int`` (its integers, read through its own storage); params
  ``scale``, ``zero_point``;
- ``quantized_per_channel``: parts ``int``, ``scales``, ``zero_points``; params ``axis``;
- ``zero`` (``aten._efficientzerotensor``): nothing.

The dump copies each part as it copies any tensor and names the layout, its parts and its
numbers in the index entry (``docs/format.md``). :func:`join` rebuilds the tensor from parts
read back, checking them first: a run is untrusted input, so indices past the size, a component
past its buffer, a scale that is no positive finite number are refused (``ValueError``), never
handed to a kernel that would read out of bounds. A sparse or nested tensor comes back in its
layout; a quantized one contiguous (its integers, scale and zero point kept); a zero tensor as
plain zeros (a ZeroTensor is autograd's storage-free stand-in, not a layout a user keeps).

Jagged nested tensors (``layout=torch.jagged``) are Python subclasses: the tracer sees the ops
on their values and offsets, plain tensors dumped as such, and never meets the jagged tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

STRIDED = "strided"
"""The layout of an entry whose bytes are one view of a blob (entries without ``layout``)."""

_COMPRESSED = {
    torch.sparse_csr: ("sparse_csr", "crow_indices", "col_indices"),
    torch.sparse_bsr: ("sparse_bsr", "crow_indices", "col_indices"),
    torch.sparse_csc: ("sparse_csc", "ccol_indices", "row_indices"),
    torch.sparse_bsc: ("sparse_bsc", "ccol_indices", "row_indices"),
}
_COMPRESSED_BY_NAME = {name: (layout, compressed, plain)
                       for layout, (name, compressed, plain) in _COMPRESSED.items()}
_QUANTIZED_INTS = {torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32}
_AFFINE = (torch.per_tensor_affine, torch.per_channel_affine, torch.per_channel_affine_float_qparams)
LAYOUTS = frozenset({"sparse_coo", *_COMPRESSED_BY_NAME, "nested", "quantized_per_tensor",
                     "quantized_per_channel", "zero"})
"""Every layout :func:`join` rebuilds."""


@dataclass
class InParts:
    """A tensor as the dump stores it: its layout, its strided parts and its numbers."""

    layout: str
    parts: dict[str, torch.Tensor]
    params: dict[str, Any]


def split(t: torch.Tensor) -> InParts | str | None:
    """``t`` as parts; None when it is not one of :data:`LAYOUTS`; a string when it is, but
    cannot be stored faithfully (the reason, e.g. ``"quantized quint4x2"``).

    Reads only metadata and aliases of ``t``'s own tensors: nothing is copied or computed.
    """
    if t.layout is torch.sparse_coo:
        return InParts("sparse_coo", {"indices": t._indices(), "values": t._values()},
                       {"coalesced": t.is_coalesced()})
    if t.layout in _COMPRESSED:
        name, compressed, plain = _COMPRESSED[t.layout]
        return InParts(name, {compressed: getattr(t, compressed)(), plain: getattr(t, plain)(),
                              "values": t.values()}, {})
    if t.is_nested:
        if t.layout is not torch.strided:
            return f"nested {t.layout}"
        buffer = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        return InParts("nested", {"buffer": buffer}, {
            "sizes": t._nested_tensor_size().tolist(), "strides": t._nested_tensor_strides().tolist(),
            "offsets": t._nested_tensor_storage_offsets().tolist()})
    if t.is_quantized:
        return _split_quantized(t)
    if t.layout is torch.strided and t._is_zerotensor():
        return InParts("zero", {}, {})
    return None


def _split_quantized(t: torch.Tensor) -> InParts | str:
    ints = _QUANTIZED_INTS.get(t.dtype)
    scheme = t.qscheme()
    if ints is None or scheme not in _AFFINE:
        return f"quantized {str(t.dtype).removeprefix('torch.')} {str(scheme).removeprefix('torch.')}"
    # The integers as they lie in the tensor's own storage: no int_repr() copy on the training thread.
    values = torch.empty(0, dtype=ints, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    if scheme is torch.per_tensor_affine:
        return InParts("quantized_per_tensor", {"int": values},
                       {"scale": float(t.q_scale()), "zero_point": int(t.q_zero_point())})
    return InParts("quantized_per_channel", {"int": values, "scales": t.q_per_channel_scales(),
                                             "zero_points": t.q_per_channel_zero_points()},
                   {"axis": int(t.q_per_channel_axis())})


def join(layout: str, parts: dict[str, torch.Tensor], params: dict[str, Any], shape: tuple[int, ...],
         dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``layout`` rebuilt from ``parts`` (read back) and ``params``, of ``shape``
    and ``dtype`` as its entry says. Raises ``ValueError`` (or ``KeyError``/``TypeError``) on parts
    or numbers that do not make that tensor."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one this probe reads (one of {sorted(LAYOUTS)})")
    if layout == "zero":
        return torch.zeros(shape, dtype=dtype)
    if layout == "nested":
        return _join_nested(parts, params, dtype)
    if layout.startswith("quantized"):
        return _join_quantized(layout, parts, params, shape, dtype)
    values = parts["values"]
    if values.dtype != dtype:
        raise ValueError(f"its values are {values.dtype}, its entry says {dtype}")
    try:  # check_invariants: indices out of range or out of order are refused, not read
        if layout == "sparse_coo":
            coalesced = params["coalesced"]
            if not isinstance(coalesced, bool):
                raise ValueError(f"'coalesced' is {coalesced!r}, not true or false")
            indices = _ints(parts["indices"], "indices")
            if coalesced and not _sorted_unique(indices, shape):
                raise ValueError("its indices are not sorted and unique, though it says it is coalesced")
            return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True,
                                           is_coalesced=coalesced)
        torch_layout, compressed, plain = _COMPRESSED_BY_NAME[layout]
        return torch.sparse_compressed_tensor(
            _ints(parts[compressed], compressed), _ints(parts[plain], plain), values, shape,
            layout=torch_layout, check_invariants=True)
    except RuntimeError as e:
        raise ValueError(f"its parts do not make a {layout} tensor: {e}") from None


def _ints(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"its {name} are {t.dtype}, not int32 or int64")
    return t


def _sorted_unique(indices: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether COO ``indices`` are in row-major order without repeats (what coalesced promises)."""
    if indices.dim() != 2 or indices.shape[1] < 2 or indices.shape[0] > len(shape):
        return True  # nothing to order, or check_invariants refuses it by name
    if int(indices.min()) < 0 or any(int(indices[d].max()) >= shape[d] for d in range(indices.shape[0])):
        return True  # out of range: check_invariants refuses it by name
    linear = torch.zeros(indices.shape[1], dtype=torch.float64)  # exact up to 2**53 elements
    for d in range(indices.shape[0]):
        linear = linear * shape[d] + indices[d].double()
    return bool((linear[1:] > linear[:-1]).all())


def _join_nested(parts: dict[str, torch.Tensor], params: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    buffer = parts["buffer"]
    if buffer.dtype != dtype or buffer.dim() != 1:
        raise ValueError(f"its buffer is {buffer.dtype} {list(buffer.shape)}, not 1-D {dtype}")
    sizes, strides, offsets = params["sizes"], params["strides"], params["offsets"]
    rows = [(size, stride, offset) for size, stride, offset in zip(sizes, strides, offsets, strict=True)]
    dims = {len(size) for size, _, _ in rows}
    if len(dims) > 1:
        raise ValueError("its components differ in their number of dimensions")
    for size, stride, offset in rows:
        numbers = [*size, *stride, offset]
        if len(size) != len(stride) or any(type(n) is not int or n < 0 for n in numbers):
            raise ValueError(f"a component's size {size}, stride {stride} or offset {offset} is not a view")
        reach = offset + (1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else 0)
        if reach > buffer.numel():
            raise ValueError(f"a component reaches element {reach}, past its buffer ({buffer.numel()})")
    width = dims.pop() if dims else 0
    size_rows, stride_rows = (torch.tensor(column, dtype=torch.int64).reshape(len(rows), width)
                              for column in (sizes, strides))
    return torch._nested_view_from_buffer(buffer.contiguous(), size_rows, stride_rows,
                                          torch.tensor(offsets, dtype=torch.int64))


def _join_quantized(layout: str, parts: dict[str, torch.Tensor], params: dict[str, Any],
                    shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    ints = parts["int"]
    if _QUANTIZED_INTS.get(dtype) != ints.dtype or tuple(ints.shape) != shape:
        raise ValueError(f"its integers are {ints.dtype} {list(ints.shape)}, not the {dtype} {list(shape)} "
                         "its entry says")
    if layout == "quantized_per_tensor":
        scale, zero_point = params["scale"], params["zero_point"]
        if not (type(scale) in (int, float) and math.isfinite(scale) and scale > 0
                and type(zero_point) is int):
            raise ValueError(f"scale {scale!r} / zero point {zero_point!r}: not a positive finite scale "
                             "and an integer")
        return torch._make_per_tensor_quantized_tensor(ints, scale, zero_point)
    axis, scales, zero_points = params["axis"], parts["scales"], parts["zero_points"]
    if type(axis) is not int or not 0 <= axis < len(shape):
        raise ValueError(f"axis {axis!r} is not a dimension of {list(shape)}")
    channels = (shape[axis],)
    if tuple(scales.shape) != channels or tuple(zero_points.shape) != channels \
            or not scales.is_floating_point():
        raise ValueError(f"scales {list(scales.shape)} / zero points {list(zero_points.shape)}: not one per "
                         f"channel of axis {axis} ({shape[axis]})")
    if not bool(torch.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError("a scale is not a positive finite number")
    try:
        return torch._make_per_channel_quantized_tensor(ints, scales.double(), zero_points, axis)
    except RuntimeError as e:
        raise ValueError(f"its parts do not make a {layout} tensor: {e}") from None


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` holds as a plain strided tensor, for numbers to be computed on: a sparse
    tensor densified, a quantized one dequantized, a nested one's components flattened and
    concatenated (two nested tensors compare element by element in that order)."""
    if t.layout is torch.sparse_coo or t.layout in _COMPRESSED:
        return t.to_dense()
    if t.is_nested:
        components = [c.reshape(-1) for c in t.unbind()]
        return torch.cat(components) if components else torch.empty(0, dtype=t.dtype, device=t.device)
    if t.is_quantized:
        return t.dequantize()
    return t
