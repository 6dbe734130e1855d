"""Checksums of tensors' bit patterns, computed on their device, many tensors per launch.

Two tensors of the same dtype and shape with the same checksum hold the same bits (up
to a 2**-64 chance); one flipped bit changes it. The checksum is exact integer arithmetic
modulo 2**64, so it is the same on any device, any thread count and any order of
summation: a CPU run and a GPU run loading the same weights agree.

How (per tensor): its bytes read as int32 (pairs of bf16/fp16, halves of fp64/int64; the
1- and 2-byte dtypes as themselves when a row's bytes are not a multiple of 4), summed
along the last dimension with int32 wrap-around (one reduction kernel, reading the
tensor once: the cost of a ``sum``), then the row sums combined with weights ``2j + 1``
for row ``j``, so that permuted rows (a transposed or shuffled weight) change the
checksum. Values moved within a row leave it unchanged: this is a checksum for "did the
runs start from the same data", not a cryptographic hash.

Batched: the row sums of every tensor of one device are concatenated and weighted and
segment-summed by a handful of kernels (``cat``, ``mul``, ``cumsum``, a gather and a
subtraction), whatever the number of tensors; the per-composition constants (weights,
segment bounds) are built once on the device and cached. Nothing synchronises with the
host: the result is a device tensor that the writer thread reads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from probe.local_part import local_part

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CACHED = 16
"""Compositions (device, row counts) whose weights and bounds are kept."""

def local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose bits are checksummed: this rank's shard of a DTensor, detached."""
    return local_part(tensor).detach()


def checksummable(tensor: torch.Tensor) -> bool:
    """Dense tensors with storage (not meta, sparse, nested or a subclass the probe cannot read)."""
    return (tensor.layout == torch.strided and tensor.device.type != "meta" and not tensor.is_nested
            and type(tensor) in (torch.Tensor, torch.nn.Parameter))


def _int_view(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    elif t.is_neg():
        t = t.resolve_neg()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.dim() == 0:
        t = t.reshape(1)
    size = t.element_size()
    if t.size(-1) > 1 and t.stride(-1) != 1:
        t = t.contiguous()  # a strided last dimension (rare for weights and inputs): one copy
    if size == 4:
        return t.view(torch.int32)
    if (t.size(-1) * size) % 4 == 0:
        try:
            return t.view(torch.int32)
        except RuntimeError:  # an unaligned storage offset: read an aligned copy the same way
            return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).view(torch.int32)
    return t.view(_SAME_SIZE_INT[size])  # 1- and 2-byte rows whose bytes are not a multiple of 4


def row_sums(tensor: torch.Tensor) -> torch.Tensor:
    """int32 sums (wrapping) of the last dimension of ``tensor``'s bits, flattened."""
    return _int_view(tensor).sum(dim=-1, dtype=torch.int32).reshape(-1)


@dataclass
class _Composition:
    weights: torch.Tensor
    """int64, per row: 2j + 1 for row j of its tensor."""
    bounds: torch.Tensor
    """int64 [2n]: each tensor's first row, then its end (into the cumulative sums, after a 0)."""


@dataclass
class ChecksumCache:
    """The per-device constants of the compositions seen lately (parameters: the same each step)."""

    _entries: OrderedDict[tuple[torch.device, tuple[int, ...]], _Composition] = field(
        default_factory=OrderedDict)

    def composition(self, device: torch.device, lengths: tuple[int, ...]) -> _Composition:
        key = (device, lengths)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            return found
        # Built on the device from scalars (no host-to-device copy, which would wait for the stream).
        weights = torch.cat([torch.arange(1, 2 * n + 1, 2, device=device, dtype=torch.int64)
                             for n in lengths])
        starts, ends, offset = [], [], 0
        for n in lengths:
            starts.append(offset)
            offset += n
            ends.append(offset)
        bounds = torch.cat([torch.full((1,), i, dtype=torch.int64, device=device) for i in starts + ends])
        found = self._entries[key] = _Composition(weights, bounds)
        if len(self._entries) > _CACHED:
            self._entries.popitem(last=False)
        return found


def checksums(tensors: list[torch.Tensor], cache: ChecksumCache) -> torch.Tensor:
    """int64 checksums of ``tensors`` (all on one device, plain and dense, see :func:`local`),
    as one tensor on that device; queued, never waited for."""
    return combine([row_sums(t) for t in tensors], cache)


def combine(rows: list[torch.Tensor], cache: ChecksumCache) -> torch.Tensor:
    """The checksums of tensors from their :func:`row_sums` (all on one device)."""
    if not rows:
        raise ValueError("checksums of no tensor")
    device = rows[0].device
    composition = cache.composition(device, tuple(r.numel() for r in rows))
    weighted = torch.cat(rows) * composition.weights  # int32 x int64 -> int64; each |product| < 2**63
    # Segment sums as differences of a running sum: integer arithmetic wraps, so they are exact mod 2**64.
    running = torch.nn.functional.pad(weighted.cumsum(0), (1, 0))
    ends = running.index_select(0, composition.bounds)
    return ends[len(rows):] - ends[:len(rows)]


def hex_checksum(value: int) -> str:
    """A checksum as 16 hex digits (its two's complement)."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"
