"""Random-sign sketches: how far two runs' tensors are apart element by element, where their
statistics cannot tell.

Two runs that round in another order (another attention kernel, another thread count, a lower
precision) differ element by element at random signs. Those differences leave a tensor's norm,
sum and extremes nearly as they were, so statistics understate them, often by the square root of
the element count; a sum with cancellation downstream (a norm's weight gradient, a router's
top-k) then shows them, and ``probe compare`` called a healthy pair divergent there.

A sketch is :data:`SKETCHES` projections of a tensor's values, in its logical (row-major) order,
on fixed random sign vectors: ``s_j = sum_i r_ij x_i`` with ``r_ij = +-1``, the same in every run
and process. The projections are linear, so two runs' sketches differ by the projection of
their difference, and ``E[(s_j(a) - s_j(b))^2] = ||a - b||^2`` whatever the values: the mean
over ``j`` estimates the element-wise L2 distance from a few numbers per tensor
(``analysis.precision.sketch_error``, which compare reads). Signs are pairwise independent:
element ``i`` (block ``i // BLOCK``, column ``i % BLOCK``) gets the block's sign times the
column's, so a tensor is one matrix product of its blocks, read once.

Sums are in the accumulation dtype (fp64 on CPU and CUDA): two runs' sketches differ by
``||a - b||`` only when their own rounding is far below it (fp64's is about 1e-16 of
``||a|| sqrt(BLOCK)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from probe.devices import is_accelerator, record_event
from probe.modes.statistics import pieces, reduce
from probe.modes.statistics.reduce import accumulation_dtype, as_real
from probe.modes.statistics.strided import contiguous_strides, strided_layout

SKETCHES = 8
"""Projections per tensor. The distance estimate is ``||a - b||`` times the square root of a
chi-square of this many degrees of freedom over their number: at 8, below 0.45 of the truth
once in a hundred tensors and above 1.6 of it once in a hundred."""
BLOCK = 1024
"""Elements per block of the sign pattern (the columns of one matrix product)."""
_SEED = 0x5EED
_BLOCK_SIGNS_CHUNK = 1 << 16
"""Block signs are generated this many at a time, each chunk from its own seed, so a longer
tensor extends the pattern without changing its start."""


class _Signs:
    """The sign pattern on each device, in each accumulation dtype, grown as tensors need it."""

    def __init__(self) -> None:
        self._columns: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._blocks: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._host_blocks = torch.empty(0, dtype=torch.int8)  # grown here: never read back from a device

    def columns(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[BLOCK, SKETCHES]`` signs."""
        key = (device, dtype)
        found = self._columns.get(key)
        if found is None:
            found = _random_signs((BLOCK, SKETCHES), _SEED).to(device, dtype)
            self._columns[key] = found
        return found

    def blocks(self, count: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The first ``count`` block signs, ``[count]``."""
        key = (device, dtype)
        found = self._blocks.get(key)
        if found is None or found.numel() < count:
            have = self._host_blocks.numel() // _BLOCK_SIGNS_CHUNK
            need = -(-count // _BLOCK_SIGNS_CHUNK)
            if need > have:
                more = [_random_signs((_BLOCK_SIGNS_CHUNK,), _SEED + 1 + c) for c in range(have, need)]
                self._host_blocks = torch.cat([self._host_blocks, *more])
            found = self._host_blocks.to(device, dtype)
            self._blocks[key] = found
        return found[:count]


def _random_signs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, shape, generator=generator, dtype=torch.int8).mul_(2).sub_(1)


_signs = _Signs()


def sketchable(t: torch.Tensor) -> bool:
    """Whether ``t`` gets a sketch: floating-point (complex as its parts) values in memory;
    integer and bool tensors differ exactly or not at all, which their statistics tell."""
    return (t.layout == torch.strided and not t.is_quantized and not t.is_meta and t.numel() > 0
            and (t.is_floating_point() or t.is_complex()))


KERNEL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""What the multi-tensor kernel sketches (``multi_tensor.rows`` with signs)."""


def signs(device: torch.device, numel: int) -> reduce.Signs:
    """The pattern as the multi-tensor kernel reads it: column signs ``[BLOCK, SKETCHES]`` and the
    block signs of a tensor of ``numel`` elements, int8 on ``device``."""
    return reduce.Signs(_signs.columns(device, torch.int8),
                        _signs.blocks(max(-(-numel // BLOCK), 1), device, torch.int8))


def batch_order(t: torch.Tensor) -> tuple[bool, list[int] | None]:
    """How the multi-tensor kernel sketches a non-contiguous ``t`` from the view the engine queues
    (``reduce.compact_view``): whether it can (at most ``strided.LEVELS`` levels merged in both
    orders) and, where that view is ``t`` permuted, the strides of its dims in ``t``'s logical
    order (its sketch's order; None: the view is ``t``)."""
    order = reduce.storage_order(t)
    positions = contiguous_strides(t.shape)
    if order is None:
        return strided_layout(t, positions) is not None, None
    positions = [positions[dim] for dim in order]
    return strided_layout(t.permute(order), positions) is not None, positions


def _in_batch(t: torch.Tensor) -> tuple[bool, list[int] | None]:
    """Whether a queued ``t`` is sketched with its batch by the multi-tensor kernel, and the
    positions of :func:`batch_order` that batch reads it with."""
    if t.dtype not in KERNEL_DTYPES or t.is_neg() or reduce.multi_tensor_kernel(t.device) is None:
        return False, None
    if t.is_contiguous():
        return True, None
    return batch_order(t) if reduce.multi_tensor_strided() else (False, None)


def _by_kernel(xs: list[torch.Tensor]) -> torch.Tensor | None:
    """``[len(xs), SKETCHES]`` (tensors of one device and dtype, contiguous) by the statistics'
    multi-tensor kernel, or None where it does not run or failed (``reduce._multi_tensor_block``:
    then off for the process, after one warning)."""
    if reduce.multi_tensor_kernel(xs[0].device) is None:  # (the CPU: no sign tables made)
        return None
    block = reduce._multi_tensor_block(xs, None, signs(xs[0].device, max(x.numel() for x in xs)))
    return None if block is None else block[:, reduce.WIDTH:]


def sketch(t: torch.Tensor) -> torch.Tensor:
    """The ``[SKETCHES]`` projections of ``t``'s values (a sketchable tensor), on its device, in
    its accumulation dtype; no host sync. Where the multi-tensor kernel runs (CUDA with Triton),
    one launch pair reading each value once; elsewhere large tensors are read a piece at a time
    (``statistics.pieces``), so the widened copy stays bounded."""
    x = as_real(t.detach()).reshape(-1)  # logical order (a copy only for a non-contiguous t)
    done = _by_kernel([x]) if x.dtype in KERNEL_DTYPES else None
    return done[0] if done is not None else eager_sketch(x)


def eager_sketch(x: torch.Tensor) -> torch.Tensor:
    """:func:`sketch` of a flat real tensor ``x`` by matrix products on its device (the widened
    copy a piece at a time), whatever kernels the device has."""
    acc = accumulation_dtype(x.device)
    columns = _signs.columns(x.device, acc)
    n = x.numel()
    blocks = _signs.blocks(-(-n // BLOCK), x.device, acc)
    with torch.no_grad():
        if n <= BLOCK:
            return (x.to(acc) @ columns[:n]).mul_(blocks[0])
        # The blocks' signed sum first (a [BLOCK] vector, one pass over the values), then its
        # projections: 8x fewer products than projecting each block (5x faster on a 352K-element
        # fp32 tensor on the CPU).
        folded = torch.zeros(BLOCK, dtype=acc, device=x.device)
        step = max(pieces.PIECE_NUMEL // BLOCK, 1) * BLOCK
        for start in range(0, n, step):
            piece = x[start : start + step].to(acc)
            whole = piece.numel() // BLOCK
            first = start // BLOCK
            if whole:
                folded.addmv_(piece[: whole * BLOCK].view(whole, BLOCK).t(), blocks[first : first + whole])
            rest = piece.numel() - whole * BLOCK
            if rest:
                folded[:rest].addcmul_(piece[whole * BLOCK :], blocks[first + whole])  # (no host read)
        return folded @ columns


class SketchRows:
    """One step's sketches, keyed by the stats row they go with: taken at capture, or with the
    engine's batch where the multi-tensor kernel runs (:meth:`add` of a queued value: one launch
    pair a batch)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._blocks: dict[torch.device, list[torch.Tensor]] = {}  # [k, SKETCHES] each
        self._counts: dict[torch.device, int] = {}
        self._entries: list[tuple[int, torch.device, int]] = []  # (row, device, position)
        self._later: set[int] = set()  # rows sketched with their batch (add_batch)
        self._positions: dict[int, list[int]] = {}  # such rows queued permuted: batch_order

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, t: torch.Tensor, row: int, queued: bool = False) -> None:
        """Sketch ``t``'s values for stats row ``row``: now (no host sync), or, where the engine
        ``queued`` them and the multi-tensor kernel can read the view it queued
        (``reduce.compact_view``: a permuted ``t`` in storage order) with each value signed as its
        place in ``t``'s logical order (:func:`batch_order`), when their batch is reduced
        (:meth:`take`, :meth:`add_batch`; lost with its statistics)."""
        if not sketchable(t) or any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True)):
            return  # a broadcast view: its repeated elements are another layout's in the other run
        later, positions = _in_batch(t) if queued else (False, None)
        if not later:
            self._append(t.device, sketch(t)[None], [row])
            return
        self._later.add(row)
        if positions is not None:
            self._positions[row] = positions

    def signs_for(self, xs: list[torch.Tensor], rows: list[int]) -> reduce.Signs | None:
        """The signs the engine's kernel takes to sketch a batch (``xs``, rows ``rows``) as it
        reduces it, where a row waits for it; else None."""
        later = self._later
        if not later or not any(row in later for row in rows):
            return None
        pattern = signs(xs[0].device, max(x.numel() for x in xs))
        if not self._positions:
            return pattern
        return pattern._replace(positions=[self._positions.get(row) for row in rows])

    def take(self, rows: list[int], block: torch.Tensor) -> None:
        """Sketches ``[len(rows), SKETCHES]`` the engine's kernel made with rows ``rows``: kept for
        the rows that wait for them."""
        later = self._later
        waiting = [row if row in later else None for row in rows]
        later.difference_update(rows)
        self._append(block.device, block, waiting)

    def add_batch(self, xs: list[torch.Tensor], rows: list[int]) -> None:
        """The engine reduced ``xs`` (rows ``rows``): sketch those still waiting (its kernel did not
        take them: another path reduced them), one kernel call per dtype."""
        later = self._later
        if not later:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        for x, row in zip(xs, rows, strict=True):
            if row in later:
                later.discard(row)
                groups.setdefault((x.device, x.dtype), []).append((x, row))
        for (device, _), group in groups.items():
            tensors = [x for x, _ in group]
            done = _by_kernel(tensors)
            if done is None:
                done = torch.stack([eager_sketch(x.reshape(-1)) for x in tensors])
            self._append(device, done, [row for _, row in group])

    def _append(self, device: torch.device, block: torch.Tensor, rows: list[int | None]) -> None:
        """``block``'s sketches, row ``rows[i]`` at its i-th (None: none kept from it)."""
        if all(row is None for row in rows):
            return
        at = self._counts.get(device, 0)
        self._blocks.setdefault(device, []).append(block)
        self._counts[device] = at + len(rows)
        self._entries.extend((row, device, at + i) for i, row in enumerate(rows) if row is not None)

    def end_step(self) -> PendingSketches:
        """Stack the step's sketches per device (queued, no sync) and start afresh."""
        with torch.no_grad():
            stacked = {d: torch.cat(blocks) for d, blocks in self._blocks.items()}
        events = [record_event(d) for d in stacked if is_accelerator(d)]
        pending = PendingSketches(stacked, self._entries, events)
        self._reset()
        return pending


class PendingSketches:
    """A step's sketches on their devices, handed to the writer thread."""

    def __init__(self, stacked: dict[torch.device, torch.Tensor],
                 entries: list[tuple[int, torch.device, int]], events: list[Any]) -> None:
        self.stacked, self.entries, self.events = stacked, entries, events

    def to_host(self, rows: int) -> np.ndarray:
        """``[rows, SKETCHES]`` fp64, NaN where a row has no sketch: one transfer per device."""
        for event in self.events:
            event.synchronize()
        host = {d: t.to("cpu", torch.float64).numpy() for d, t in self.stacked.items()}
        table = np.full((rows, SKETCHES), np.nan)
        for row, device, position in self.entries:
            table[row] = host[device][position]
        return table
