"""The free benchmark's deviation measure, computed on the device for many output pairs at once.

A check compares two versions of an output, ``o`` (reference) and ``p``, and needs three
numbers: the largest element ratio (docs/free_benchmark.md, "The verdict"), how many
elements became or stopped being NaN/Inf, and how many changed sign. A step checks
hundreds of outputs, most of them small: one device launch (or ``torch.compile``d call,
whose guard evaluation alone costs tens of microseconds) per pair would cost more than
the arithmetic. :class:`DeviationQueue` copies each small pair into a per-device staging
buffer (fp64, where the ratios are computed) as it comes, so a later in-place write to the
original output cannot change what is measured, and reduces the whole buffer in one
segmented pass when it is full or the step ends. A pair large enough that its own pass
outweighs a compiled call (32K elements on a CPU, 4M on an accelerator:
``perturbations.worth_compiling``) is reduced on its own at once (:func:`deviation`),
without the copies.

Results stay on the device in blocks; :meth:`DeviationQueue.values` reads them all with one
transfer when the step is written.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.compiled import CompiledKernel
from probe.modes.free_benchmark.perturbations import worth_compiling

_TINY = torch.finfo(torch.float64).tiny
RATIO_CAP = 1e30  # "no bits kept" needs no larger number, and JSON has no Infinity
# Elements of a staging buffer (each of the two holds fp64): 2 x 8 MiB, plus the segment ids
# and the reduction's temporaries at a flush (the peak memory a batch adds).
BATCH_ELEMENTS = 1 << 20


def _deviation(original: torch.Tensor, perturbed: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
    """``[max_i ratio_i, NaN/Inf mismatches, sign flips]`` of one pair, fused once compiled.

    ``floors`` (fp64): the output dtype's smallest normal, and the inputs' rounding scale.
    ``ratio_i = |p_i - o_i| / max(|o_i|, rms(o), smallest normal)``; where ``o`` is zero
    everywhere it is ``|p_i| / floor``, or 0 when ``|p_i|`` is below ``floor``, the larger
    of the two floors.
    """
    o, p = original.to(torch.float64), perturbed.to(torch.float64)  # sums and ratios in fp64
    fo, fp = (o - o) == 0, (p - p) == 0
    same = (o == p) | ((o != o) & (p != p))
    mismatch = ((fo != fp) | (~fo & ~fp & ~same)).to(torch.int64).sum()
    both = fo & fp
    zero = torch.zeros((), dtype=torch.float64, device=o.device)
    zo, zp = torch.where(both, o, zero), torch.where(both, p, zero)
    rms = torch.sqrt((zo * zo).sum() / both.to(torch.int64).sum().clamp(min=1))
    # Below the smallest normal a dtype keeps an absolute precision, not a relative one:
    # underflow is not a loss of significant bits to the op's conditioning.
    tiny, floor = floors[0], floors.max()
    change = (zp - zo).abs()
    relative = change / torch.maximum(torch.maximum(zo.abs(), rms), tiny)
    absolute = torch.where(change > floor, change / floor.clamp(min=_TINY), zero)
    ratio = torch.where(rms > 0, relative, absolute)
    flips = ((zo * zp) < 0).to(torch.int64).sum()
    return torch.stack([ratio.max().clamp(max=RATIO_CAP), mismatch.to(torch.float64),
                        flips.to(torch.float64)])


def _segmented_deviation(o: torch.Tensor, p: torch.Tensor, segment: torch.Tensor, tiny: torch.Tensor,
                         floor: torch.Tensor) -> torch.Tensor:
    """:func:`_deviation` of every pair in a staging buffer: ``[pairs, 3]``.

    ``o``, ``p``: fp64, the pairs flattened one after another; ``segment``: each element's
    pair (int64, nondecreasing); ``tiny``, ``floor``: per pair, the output dtype's smallest
    normal and the larger of it and the inputs' rounding scale. The same arithmetic as
    :func:`_deviation`, with each reduction per segment (sums in another order: the ratio
    can differ in its last bits, as the compiled and eager forms of one kernel do).
    """
    pairs = tiny.shape[0]
    fo, fp = (o - o) == 0, (p - p) == 0
    same = (o == p) | ((o != o) & (p != p))
    mismatch = (fo != fp) | (~fo & ~fp & ~same)
    both = fo & fp
    zero = torch.zeros((), dtype=torch.float64, device=o.device)
    zo, zp = torch.where(both, o, zero), torch.where(both, p, zero)
    totals = torch.zeros(pairs, dtype=torch.float64, device=o.device)
    # One sum per quantity (a stacked [elements, 4] operand would be a temporary of 4 buffers).
    squares, counts, mismatches, flips = (
        totals.index_add(0, segment, value.to(torch.float64))
        for value in (zo * zo, both, mismatch, (zo * zp) < 0)
    )
    rms = torch.sqrt(squares / counts.clamp(min=1))
    rms_e, tiny_e, floor_e = rms[segment], tiny[segment], floor[segment]
    change = (zp - zo).abs()
    relative = change / torch.maximum(torch.maximum(zo.abs(), rms_e), tiny_e)
    absolute = torch.where(change > floor_e, change / floor_e.clamp(min=_TINY), zero)
    ratio = torch.where(rms_e > 0, relative, absolute)
    largest = torch.zeros(pairs, dtype=torch.float64, device=o.device).scatter_reduce(
        0, segment, ratio, "amax", include_self=True)
    return torch.stack([largest.clamp(max=RATIO_CAP), mismatches, flips], dim=1)


# Compiled once the process has reduced this many elements eagerly: the eager forms make ~30
# passes over fp64 values (~20 ns an element more than the fused kernel on a CPU core), so
# 2^29 elements cost about the ~10 s a compile does; a short run (the demo: ~5e7 elements in
# 3 steps, where the compiles were 60-110 of its 150 s) never compiles, a large model does in
# its first step.
EAGER_ELEMENTS = 1 << 29
_DEVIATION = CompiledKernel(_deviation, compile_after=EAGER_ELEMENTS)
_SEGMENTED = CompiledKernel(_segmented_deviation, compile_after=EAGER_ELEMENTS)


def deviation(reference: torch.Tensor, other: torch.Tensor, tiny: float, floor: torch.Tensor | None,
              ) -> torch.Tensor:
    """The ``[3]`` deviation of one pair, computed now (one fused pass: for large pairs)."""
    # One working dtype for both: the kernel is compiled for two dtypes only.
    work = torch.float64 if torch.float64 in (reference.dtype, other.dtype) else torch.float32
    device = reference.device
    floors = torch.tensor([tiny, tiny], dtype=torch.float64, device=device)
    if floor is not None:
        floors = torch.stack([floors[0], floor.to(device=device, dtype=torch.float64).reshape(())])
    return _DEVIATION(_flat(reference).to(work), _flat(other.to(device)).to(work), floors)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1) if t.numel() else t.detach().reshape(-1)


class _Staging:
    """One device's buffer of pairs waiting to be reduced together."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.reference = torch.empty(capacity, dtype=torch.float64, device=device)
        self.other = torch.empty(capacity, dtype=torch.float64, device=device)
        self.used = 0
        self.lengths: list[int] = []
        self.tiny: list[float] = []
        self.floors: list[torch.Tensor] = []
        self.rows: list[int] = []

    def add(self, reference: torch.Tensor, other: torch.Tensor, tiny: float, floor: torch.Tensor,
            row: int) -> None:
        n = reference.numel()
        # copy_ converts dtype, layout and device in one pass: the buffer owns the values from now on.
        self.reference[self.used:self.used + n].view(reference.shape).copy_(reference.detach())
        self.other[self.used:self.used + n].view(other.shape).copy_(other.detach())
        self.used += n
        self.lengths.append(n)
        self.tiny.append(tiny)
        self.floors.append(floor)
        self.rows.append(row)

    def reduce(self) -> torch.Tensor:
        device = self.device
        lengths = torch.tensor(self.lengths, dtype=torch.int64).to(device, non_blocking=True)
        segment = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), lengths,
                                          output_size=self.used)
        tiny = torch.tensor(self.tiny, dtype=torch.float64).to(device, non_blocking=True)
        floor = torch.maximum(torch.stack(self.floors), tiny)
        return _SEGMENTED(self.reference[:self.used], self.other[:self.used], segment, tiny, floor)


class DeviationQueue:
    """Deviations of one step's pairs: queued, reduced on the device in batches, read once.

    ``add`` returns the pair's row in :meth:`values`. ``capacity``: elements of a staging
    buffer; a pair with more, or worth a compiled pass of its own, is reduced at once.
    """

    def __init__(self, capacity: int = BATCH_ELEMENTS) -> None:
        self.capacity = capacity
        self._staging: dict[torch.device, _Staging] = {}
        self._zero: dict[torch.device, torch.Tensor] = {}
        self._blocks: list[torch.Tensor] = []
        self._block_rows: list[list[int]] = []
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    @property
    def reductions(self) -> int:
        """Device reductions launched so far (a batch of small pairs, or one large pair, each)."""
        return len(self._blocks)

    def add(self, reference: torch.Tensor, other: torch.Tensor, out_dtype: torch.dtype,
            floor: torch.Tensor | None) -> int:
        """Queue the deviation of ``other`` from ``reference`` (same shape; ``other`` may be on
        another device); ``floor``: the inputs' rounding scale (0-dim, fp64) or None."""
        row = self._rows
        self._rows += 1
        tiny = torch.finfo(out_dtype).tiny
        n = reference.numel()
        if n > self.capacity or worth_compiling(reference):
            self._blocks.append(deviation(reference, other, tiny, floor).reshape(1, 3))
            self._block_rows.append([row])
            return row
        device = reference.device
        staging = self._staging.get(device)
        if staging is not None and staging.used + n > self.capacity:
            self._flush(staging)
            staging = None
        if staging is None:
            staging = self._staging[device] = _Staging(device, self.capacity)
        if floor is None:
            floor = self._zero.get(device)
            if floor is None:
                floor = self._zero[device] = torch.zeros((), dtype=torch.float64, device=device)
        else:
            floor = floor.to(device=device, dtype=torch.float64).reshape(())
        staging.add(reference, other, tiny, floor, row)
        return row

    def _flush(self, staging: _Staging) -> None:
        del self._staging[staging.device]
        self._blocks.append(staging.reduce())
        self._block_rows.append(staging.rows)

    def finish(self) -> None:
        """Reduce what is still staged (at the step's end: the buffers are released)."""
        for staging in list(self._staging.values()):
            self._flush(staging)

    def values(self) -> np.ndarray:
        """``[rows, 3]`` on the host, in the order pairs were added (one transfer per device)."""
        self.finish()
        if not self._blocks:
            return np.zeros((0, 3))
        by_device: dict[torch.device, list[int]] = {}
        for i, block in enumerate(self._blocks):
            by_device.setdefault(block.device, []).append(i)
        out = np.zeros((self._rows, 3))
        for indices in by_device.values():
            host = torch.cat([self._blocks[i] for i in indices]).to("cpu").numpy()
            rows = [row for i in indices for row in self._block_rows[i]]
            out[rows] = host
        return out

