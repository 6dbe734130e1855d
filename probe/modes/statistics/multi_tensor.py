"""Raw rows of many tensors in two launches: a multi-tensor Triton kernel for accelerators.

The statistics of one value are eight numbers (``columns.RAW_COLUMNS``), and a step reduces
hundreds of values. ``torch.compile``'s kernel for one tensor is several launches on a GPU
(measured on an H200, a 45M-element bf16 tensor: 9 kernels, a widened copy written and read
back, 0.54 ms against the 0.05 ms of one read; 230 us of host time per call), and a step of a
7B-wide model calls it 470 times. Here a batch of tensors of one dtype is one launch of
:func:`_partials` over a table of their addresses (as apex's ``multi_tensor_apply`` and
PyTorch's ``_foreach`` kernels take a list of pointers), each program of a flat grid reading a
strided share of one tensor once (each tensor its own number of programs: a batch's small
tensors do not run as many as its largest) and keeping its partial row in registers: min and max
in the tensor's precision widened to fp32 (exact), sum and sum of squares in fp64 (within 1e-7
of exact, as on every other path), NaN, Inf, -Inf and ``|x| < threshold`` counted in int32
lanes. A second launch (:func:`_combine`) folds each tensor's partials into its row; a NaN
anywhere makes its min and max NaN, as ``amin``/``amax`` do.

With a sketch pattern's signs (the stats mode's ``sketch=True``, ``statistics.sketch``), each
row is followed by the value's projections on them, summed in fp64 from the same read.

The table goes to the device from pinned host memory without a sync. The kernels are
plain Triton and run under Triton's interpreter on CPU tensors, which is how CI checks them
(``tests/test_multi_tensor_rows.py``) on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from probe.modes.statistics.strided import LEVELS, Signs, StridedLayout, contiguous_strides, strided_layout

BLOCK = 2048
"""Elements a program reads per iteration (8 per thread of 8 warps: 16-byte loads of bf16)."""
MAX_PROGRAMS = 1024
"""Programs per tensor at most: a 45M-element tensor is read by 1,024 programs of 22 blocks."""
MIN_BLOCKS_PER_PROGRAM = 4
WIDTH = 8

_ELEMENT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64, torch.int8: tl.int8, torch.uint8: tl.uint8, torch.int16: tl.int16,
            torch.int32: tl.int32, torch.int64: tl.int64,
            torch.bool: tl.int8}  # (one byte of 0 or 1: read as int8, not Triton's i1)
DTYPES = frozenset(_ELEMENT)
_WIDENED_TO_FP32 = frozenset({torch.float16, torch.bfloat16, torch.float32})
"""``reduce.MULTI_TENSOR_DTYPES``: integers are widened to fp64 (exact below 2^53, as the staged
copies were), floating-point values below fp64 to fp32 (exact)."""


def _partials(table, count, owners_at, partials, threshold, iterations, column_signs, block_signs,
              ELEMENT: tl.constexpr, WIDE: tl.constexpr, ALIGNED: tl.constexpr, STRIDED: tl.constexpr,
              BLOCK: tl.constexpr, SKETCHES: tl.constexpr, SKETCH_BLOCK: tl.constexpr):
    # One program of a flat grid: the table says whose (``owners``) and which of its programs.
    pid = tl.program_id(0)
    tensor = tl.load(table + owners_at + pid)
    programs = tl.load(table + 2 * count + tensor)
    program = pid - tl.load(table + 3 * count + tensor)
    base = tl.load(table + tensor).to(tl.pointer_type(ELEMENT))
    if ALIGNED:  # 16-byte aligned (the host checked): vector loads (an address loaded from memory
        base = tl.multiple_of(base, 16)  # has no alignment the compiler can see)
    n = tl.load(table + count + tensor)
    if STRIDED:  # nested levels, the innermost contiguous (see strided.StridedLayout)
        cols = tl.load(table + 4 * count + tensor)
        rows = tl.load(table + 5 * count + tensor)
        blocks = tl.load(table + 6 * count + tensor)
        row_stride = tl.load(table + 7 * count + tensor)
        block_stride = tl.load(table + 8 * count + tensor)
        plane_stride = tl.load(table + 9 * count + tensor)
        if SKETCHES:  # each level's stride in the sketch's order (all 0: none, see _combine)
            col_at = tl.load(table + 10 * count + tensor)
            row_at = tl.load(table + 11 * count + tensor)
            block_at = tl.load(table + 12 * count + tensor)
            plane_at = tl.load(table + 13 * count + tensor)
    lanes = tl.arange(0, BLOCK)
    low = tl.full([BLOCK], float("inf"), WIDE)
    high = tl.full([BLOCK], float("-inf"), WIDE)
    total = tl.zeros([BLOCK], tl.float64)
    squares = tl.zeros([BLOCK], tl.float64)
    nan = tl.zeros([BLOCK], tl.int32)
    nonfinite = tl.zeros([BLOCK], tl.int32)
    ninf = tl.zeros([BLOCK], tl.int32)
    small = tl.zeros([BLOCK], tl.int32)
    if SKETCHES:
        which = tl.arange(0, SKETCHES)
        sketch = tl.zeros([SKETCHES], tl.float64)
    # A host-given count of iterations (the batch's longest), not a loop to ``n``: Triton's
    # interpreter cannot loop to a loaded bound; a shorter tensor's programs skip the rest.
    for i in range(0, iterations):
        start = (i * programs + program).to(tl.int64) * BLOCK
        if start < n:
            offsets = start + lanes
            if STRIDED:
                row = offsets // cols
                col = offsets - row * cols
                block = row // rows
                row -= block * rows
                plane = block // blocks
                block -= plane * blocks
                where = plane * plane_stride + block * block_stride + row * row_stride + col
                if SKETCHES:  # read in storage order, signed as its place in the sketch's order
                    at = plane * plane_at + block * block_at + row * row_at + col * col_at
                else:
                    at = offsets
            else:
                where = offsets
                at = offsets
            if start + BLOCK <= n:  # a whole block: unmasked (a mask against a loaded bound
                inside = lanes < BLOCK  # would make every load a scalar one)
                x = tl.load(base + where).to(WIDE)
            else:
                inside = offsets < n
                x = tl.load(base + where, mask=inside, other=0.0).to(WIDE)
            low = tl.minimum(low, tl.where(inside, x, float("inf")))
            high = tl.maximum(high, tl.where(inside, x, float("-inf")))
            wide = x.to(tl.float64)
            total += wide
            squares += wide * wide
            nan += (x != x).to(tl.int32)
            spread = x - x  # NaN for any non-finite x
            nonfinite += (spread != spread).to(tl.int32)
            ninf += (x == float("-inf")).to(tl.int32)
            small += (inside & (tl.abs(x) < threshold)).to(tl.int32)
            if SKETCHES:  # value i: its block's sign times its column's (the pattern's tables, cached)
                block_sign = tl.load(block_signs + at // SKETCH_BLOCK, mask=inside, other=0)
                signed = tl.where(inside, wide, 0.0) * block_sign.to(tl.float64)
                column = column_signs + (at % SKETCH_BLOCK) * SKETCHES
                for j in tl.static_range(SKETCHES):  # one projection at a time: a [BLOCK] temporary
                    projected = tl.sum(signed * tl.load(column + j).to(tl.float64), 0)
                    sketch += tl.where(which == j, projected, 0.0)
    out = partials + pid.to(tl.int64) * (8 + SKETCHES)
    tl.store(out + 0, tl.min(low, 0).to(tl.float64))
    tl.store(out + 1, tl.max(high, 0).to(tl.float64))
    tl.store(out + 2, tl.sum(total, 0))
    tl.store(out + 3, tl.sum(squares, 0))
    tl.store(out + 4, tl.sum(nan, 0).to(tl.float64))
    tl.store(out + 5, tl.sum(nonfinite, 0).to(tl.float64))
    tl.store(out + 6, tl.sum(ninf, 0).to(tl.float64))
    tl.store(out + 7, tl.sum(small, 0).to(tl.float64))
    if SKETCHES:
        tl.store(out + 8 + which, sketch)


def _combine(table, count, partials, rows, PROGRAMS: tl.constexpr, SKETCHES: tl.constexpr,
             STRIDED: tl.constexpr):
    tensor = tl.program_id(0)
    programs = tl.load(table + 2 * count + tensor)
    index = tl.arange(0, PROGRAMS)
    inside = index < programs
    part = partials + (tl.load(table + 3 * count + tensor) + index) * (8 + SKETCHES)
    nan = tl.sum(tl.load(part + 4, mask=inside, other=0.0), 0)
    low = tl.min(tl.load(part + 0, mask=inside, other=float("inf")), 0)
    high = tl.max(tl.load(part + 1, mask=inside, other=float("-inf")), 0)
    out = rows + tensor.to(tl.int64) * (8 + SKETCHES)
    tl.store(out + 0, tl.where(nan > 0, float("nan"), low))
    tl.store(out + 1, tl.where(nan > 0, float("nan"), high))
    tl.store(out + 2, tl.sum(tl.load(part + 2, mask=inside, other=0.0), 0))
    tl.store(out + 3, tl.sum(tl.load(part + 3, mask=inside, other=0.0), 0))
    tl.store(out + 4, nan)
    tl.store(out + 5, tl.sum(tl.load(part + 5, mask=inside, other=0.0), 0) - nan)
    tl.store(out + 6, tl.sum(tl.load(part + 6, mask=inside, other=0.0), 0))
    tl.store(out + 7, tl.sum(tl.load(part + 7, mask=inside, other=0.0), 0))
    if SKETCHES:
        which = tl.arange(0, SKETCHES)
        sketches = tl.sum(tl.load(part[:, None] + 8 + which[None, :], mask=inside[:, None], other=0.0), 0)
        if STRIDED:  # a tensor read in an order that is not the sketch's: NaN, never a wrong sketch
            sketches = tl.where(tl.load(table + 10 * count + tensor) == 0, float("nan"), sketches)
        tl.store(out + 8 + which, sketches)


@functools.cache
def _kernels() -> tuple[Callable, Callable]:
    # Jitted at first use: with TRITON_INTERPRET=1 set before triton is imported, triton.jit
    # gives the interpreter's functions, which run on CPU tensors.
    return triton.jit(_partials), triton.jit(_combine)


def rows(xs: Sequence[torch.Tensor], threshold: float = 0.0, signs: Signs | None = None) -> torch.Tensor:
    """Raw rows ``[len(xs), 8]`` in fp64 of tensors of one dtype in :data:`DTYPES` and one
    device, each contiguous or of a :func:`strided_layout`, where they are, in two launches and
    one host-to-device copy of the table.

    ``threshold``: ``|x| < threshold`` is counted (0 counts none); Triton takes it as fp32.
    ``signs``: a sketch pattern's signs (``reduce.Signs``: column signs ``[SKETCH_BLOCK,
    SKETCHES]`` and block signs, int8, on the device, as many blocks as the longest tensor has):
    each row is followed by the value's ``SKETCHES`` projections (``statistics.sketch``, in its
    logical order or the one ``signs.positions`` gives), from the same read: ``[len(xs), 8 +
    SKETCHES]``; NaN for a tensor whose sketch order has more than ``strided.LEVELS`` levels.
    """
    first = xs[0]
    device, dtype = first.device, first.dtype
    addresses = [x.data_ptr() for x in xs]
    numels = np.array([x.numel() for x in xs], dtype=np.int64)
    orders = signs.positions if signs is not None and signs.positions is not None else [None] * len(xs)
    plain = [x.is_contiguous() and order is None for x, order in zip(xs, orders, strict=True)]
    strided = not all(plain)
    # Each tensor's own number of programs: one per MIN_BLOCKS_PER_PROGRAM blocks, at most
    # MAX_PROGRAMS (a small tensor's one program does not wait on a large one's).
    counts = np.clip(-(-numels // (BLOCK * MIN_BLOCKS_PER_PROGRAM)), 1, MAX_PROGRAMS)
    firsts = np.cumsum(counts) - counts
    columns = [addresses, numels, counts, firsts]
    if strided:
        layouts = [_layout(x, order, signs is not None) if not whole else
                   StridedLayout((x.numel(), 1, 1), (1, 0, 0, 0), (1, 0, 0, 0))
                   for x, order, whole in zip(xs, orders, plain, strict=True)]
        columns += [[layout.sizes[i] for layout in layouts] for i in range(3)]
        columns += [[layout.strides[i] for layout in layouts] for i in range(1, LEVELS)]
        columns += [[layout.positions[i] if layout.positions else 0 for layout in layouts]
                    for i in range(LEVELS)]
    owners = np.repeat(np.arange(len(xs), dtype=np.int64), counts)
    table = torch.from_numpy(np.concatenate([np.asarray(columns, dtype=np.int64).reshape(-1), owners]))
    if device.type != "cpu":
        table = table.pin_memory().to(device, non_blocking=True)
    iterations = int(np.max(-(-numels // (counts * BLOCK))))
    # (without signs, any tensor: unread without SKETCHES)
    column_signs, block_signs = (signs.columns, signs.blocks) if signs is not None else (table, table)
    sketch_block, sketches = column_signs.shape if signs is not None else (1, 0)
    partials = torch.empty((len(owners), WIDTH + sketches), dtype=torch.float64, device=device)
    out = torch.empty((len(xs), WIDTH + sketches), dtype=torch.float64, device=device)
    partial, combine = _kernels()
    # Triton launches on the current device: made the tensors' own (a rank's second GPU).
    elsewhere = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if elsewhere else contextlib.nullcontext():
        partial[(len(owners),)](
            table, len(xs), len(columns) * len(xs), partials, float(threshold), iterations, column_signs,
            block_signs,
            ELEMENT=_ELEMENT[dtype], WIDE=tl.float32 if dtype in _WIDENED_TO_FP32 else tl.float64,
            ALIGNED=not strided and all(a % 16 == 0 for a in addresses), STRIDED=strided, BLOCK=BLOCK,
            SKETCHES=sketches, SKETCH_BLOCK=sketch_block, num_warps=8)
        combine[(len(xs),)](table, len(xs), partials, out, PROGRAMS=triton.next_power_of_2(int(counts.max())),
                            SKETCHES=sketches, STRIDED=strided)
    return out


def _layout(x: torch.Tensor, order: Sequence[int] | None, sketched: bool) -> StridedLayout:
    """How the kernel reads ``x``: in the sketch's order where ``sketched`` and it fits
    :data:`strided.LEVELS` levels (``order``: its dims' strides in that order, None: its own
    logical order), else for its statistics alone."""
    layout = strided_layout(x, contiguous_strides(x.shape) if order is None else order) if sketched else None
    layout = layout or strided_layout(x)
    if layout is None:
        raise ValueError("multi_tensor.rows: a tensor neither contiguous nor of a strided_layout")
    return layout
