"""The reducer: a tensor (or a batch of them) -> raw rows of :data:`columns.RAW_COLUMNS`, on the
tensor's device, without a host sync.

Values are widened before they are reduced, never reduced in their own dtype: an fp16 sum of
squares overflows on perfectly finite data. Sums and sums of squares accumulate in fp64 on CPU
and CUDA, on every path (fp32 accumulation loses 1e-4 relative on an fp16 tensor of a million
equal values; fp64 keeps sums and norms within 1e-7 of exact, the squares of values at the top
of fp32's range, such as a ``finfo.min`` attention mask, still fit, and counts stay exact) and
in fp32 on other devices. A tensor is first reduced to a compact view of the same multiset of
values (:func:`compact_view`): broadcast (stride-0) dims are dropped and counted as a
multiplicity (applied by ``columns.whole``), and a permuted tensor is read in storage order.

Every path computes the columns of the table (``columns.RAW``; ``columns.raw_row`` is their
reference), each as fast as its place allows:

- :class:`TensorStats` (one tensor): a single-pass ``torch.compile``d kernel (one fused loop on
  CPU, one Triton kernel on GPU) for large tensors, a few eager reductions for small ones;
- :func:`cpu_rows` (a queued batch on the CPU): a generated C++ loop per dtype computing min,
  max, sum and sum of squares (no dynamo frame: about 5 us a call; split across the intra-op
  threads from :data:`PARALLEL_MIN_NUMEL` elements), NaN and Inf counted only
  in rows whose moments are not finite; bf16 read as int32 pairs (a bf16 value is the top half
  of an fp32 one: widened at full vector speed);
- :func:`device_rows` (a queued batch on an accelerator): on CUDA with Triton, the multi-tensor
  kernel (:mod:`probe.modes.statistics.multi_tensor`: the whole batch in two launches, one read
  of each value); elsewhere the compiled kernel for large tensors (one read each) and
  ``_foreach_*`` reductions for the rest (a handful of launches per batch);
- :class:`StageChunk` (many small tensors copied into one buffer): ``reduceat`` per segment on
  the host, after the step's transfer (see ``capture``);
- :func:`adam_update_row`: Adam's update, never materialized.

``zeros`` (``|x| < eps``, the monitor's) is counted where an ``eps`` is given, compared with
``eps`` as fp32 holds it (fp64 for fp64 tensors); the stats mode gives none (0).

Every path that would make a temporary of its input's size (a widened or contiguous copy, a
mask) reduces a tensor of more than ``pieces.PIECE_NUMEL`` elements piece by piece and
combines the pieces' rows (:mod:`probe.modes.statistics.pieces`); the fused passes that read a
contiguous floating-point tensor in place take it whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from probe.compiled import CompiledKernel, StandaloneCpuKernel
from probe.errors import warn_once
from probe.modes.statistics import pieces
from probe.modes.statistics.columns import RAW_COLUMNS
from probe.modes.statistics.strided import Signs, strided_layout

BACKENDS = ("auto", "compiled", "eager")
WIDTH = len(RAW_COLUMNS)

# Below this many elements a few eager reductions cost less than one call of the
# compiled kernel (guards and buffer set-up); above it one fused pass wins.
COMPILED_MIN_NUMEL = 1 << 15
COMPILED_MAX_NUMEL = 1 << 31  # its int32 counters could overflow beyond

QUEUED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
"""Dtypes whose tensors are queued; others (integers, bool, fp8) are reduced one by one, except
where the multi-tensor kernel reads them (:data:`MULTI_TENSOR_DTYPES`: integers and bool too)."""


FP64_DEVICES = ("cpu", "cuda")
"""Device types that accumulate in fp64 (read at call time: the device cost model,
``benchmarks.device_cost``, adds the device it simulates CUDA on)."""


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """fp64 where the device has fast fp64 (sums of fp32 squares cannot overflow it and counts
    stay exact, and on CPU the fused fp64 pass is as fast as fp32); fp32 elsewhere."""
    return torch.float64 if device.type in FP64_DEVICES else torch.float32


def zeros_threshold(dtype: torch.dtype, eps: float) -> float:
    """``eps`` as the comparison reads it: rounded to fp32, except for fp64 tensors."""
    return eps if dtype == torch.float64 else float(np.float32(eps))


def compact_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A view holding each distinct element of ``t`` once, and how often each repeats.

    Statistics are invariant under permutation, and a stride-0 dim repeats the
    same elements ``size`` times, so both can be undone without copying.
    """
    if t.is_contiguous() and t.numel():  # most tensors: no broadcast dim, nothing to reorder
        return (t, 1) if t.dim() else (t.reshape(1), 1)
    multiplicity = 1  # (a 0-d tensor is contiguous: returned above)
    strides = t.stride()
    if 0 in strides:
        for dim in range(t.dim() - 1, -1, -1):
            if strides[dim] == 0 and t.shape[dim] > 1:
                multiplicity *= t.shape[dim]
                t = t.narrow(dim, 0, 1)  # (keeps the other dims' strides)
    order = storage_order(t)
    return (t if order is None else t.permute(order)), multiplicity


def storage_order(t: torch.Tensor) -> list[int] | None:
    """The order of ``t``'s dims in which :func:`compact_view` reads a (broadcast-free) ``t``:
    the permutation that makes it contiguous, or None where it reads ``t`` as it is."""
    if t.is_contiguous():
        return None
    strides = t.stride()
    order = sorted(range(t.dim()), key=strides.__getitem__, reverse=True)
    return order if t.permute(order).is_contiguous() else None


def as_real(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` holds, as a real tensor to reduce.

    Complex tensors are reduced over their real and imaginary parts (the L2 norm of
    the parts equals the complex norm; min/max/mean are over parts). Conjugate and
    negative views are resolved first (a copy, for those views only): their memory
    holds their base's values, not theirs.
    """
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj().resolve_neg())
    return t.resolve_neg() if t.is_neg() else t


def _zeros(x: torch.Tensor, eps: float | None, acc: torch.dtype) -> torch.Tensor:
    """``|x| < eps`` counted (0 without ``eps``), in ``acc``."""
    if eps is None:
        return torch.zeros((), dtype=acc, device=x.device)
    if pieces.too_large(x):
        return pieces.sum_counts([_zeros(p, eps, acc) for p in pieces.split(x)])
    wide = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    return torch.count_nonzero(wide.abs() < zeros_threshold(x.dtype, eps)).to(acc)


def eager_raw(x: torch.Tensor, acc: torch.dtype, eps: float | None = None) -> torch.Tensor:
    """A handful of small kernels over ``x`` widened to ``acc``, a piece at a time. Without
    autograd: the row is read on the host (``numpy()``) and ``x`` may require grad."""
    with torch.no_grad():
        if pieces.too_large(x):
            return pieces.combine_raw([eager_raw(p, acc, eps) for p in pieces.split(x)])
        xa = x.to(acc)
        mn, mx = torch.aminmax(xa)
        if xa.is_contiguous():
            flat = xa.view(-1)
            sumsq = torch.dot(flat, flat)
        else:
            sumsq = xa.square().sum()
        nan = torch.isnan(xa).sum().to(acc)
        inf = torch.isinf(xa).sum().to(acc)
        ninf = torch.isneginf(xa).sum().to(acc)
        return torch.stack([mn, mx, xa.sum(), sumsq, nan, inf, ninf, _zeros(x, eps, acc)])


def _fused_raw(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """One pass over a 1-D tensor once compiled: every column of the table in one loop.

    Low-precision values are widened to fp32 for min, max and the counts and to fp64 only
    inside the sums (measured: faster than widening everything to fp64, and a plain fp32 sum
    makes the compiler emit a slower cascaded reduction). NaN and Inf are counted through
    ``x != x`` and ``(x - x) != (x - x)`` (NaN for any non-finite x), which lower to plain
    comparisons, unlike isnan/isinf, in int32 lanes (faster than int64; callers keep tensors
    of 2^31 elements or more away from this kernel); -Inf by ``x == -inf``; zeros by
    ``|x| < threshold`` (a 0 threshold counts none).
    """
    x = flat if flat.dtype == torch.float64 else flat.to(torch.float32)
    wide = x.to(torch.float64)
    diff = x - x

    def count(mask: torch.Tensor) -> torch.Tensor:
        return mask.to(torch.int32).sum(dtype=torch.int32).to(torch.float64)

    nan = count(x != x)
    return torch.stack(
        [x.amin().to(torch.float64), x.amax().to(torch.float64), wide.sum(), (wide * wide).sum(),
         nan, count(diff != diff) - nan, count(x == -math.inf), count(x.abs() < threshold)]
    )


_COMPILED = CompiledKernel(_fused_raw)
_COMPILED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

MULTI_TENSOR_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                                 torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool})
"""Dtypes the multi-tensor kernel reads (``multi_tensor.DTYPES``; named here, where no Triton is
imported, for the routing)."""

MULTI_TENSOR_DEVICES = ("cuda",)
"""Device types whose tensors the multi-tensor Triton kernel reduces where Triton imports (read
at call time: the device cost model, ``benchmarks.device_cost``, adds the device it simulates)."""

MultiTensorRows = Callable[..., torch.Tensor]
"""``multi_tensor.rows(xs, threshold, signs=None)``."""
_multi_tensor: MultiTensorRows | None = None
_multi_tensor_tried = False


def multi_tensor_kernel(device: torch.device) -> MultiTensorRows | None:
    """``multi_tensor.rows`` for tensors on ``device``, or None: another device type, no Triton,
    or the kernel failed once in this process (then the compiled and eager paths, after one
    warning)."""
    global _multi_tensor, _multi_tensor_tried
    if device.type not in MULTI_TENSOR_DEVICES:
        return None
    if not _multi_tensor_tried:
        _multi_tensor_tried = True
        try:
            from probe.modes.statistics import multi_tensor
        except Exception:  # no Triton (optional; CUDA builds of torch bring it), or a broken one
            return None
        _multi_tensor = multi_tensor.rows
    return _multi_tensor


_multi_tensor_strided = True
"""Whether strided views go to the multi-tensor kernel (off once its strided form failed)."""


def multi_tensor_strided() -> bool:
    """Whether the multi-tensor kernel reads strided views (its strided form has not failed)."""
    return _multi_tensor_strided


def _turn_off_multi_tensor() -> None:
    global _multi_tensor, _multi_tensor_tried
    _multi_tensor, _multi_tensor_tried = None, True


@contextmanager
def multi_tensor_kernel_replaced(kernel: MultiTensorRows | None) -> Iterator[None]:
    """The multi-tensor kernel replaced by ``kernel`` (None: off) inside the block. For the device
    cost model, which counts what the kernel reads instead of running it, and for tests."""
    global _multi_tensor, _multi_tensor_tried
    saved = _multi_tensor, _multi_tensor_tried
    _multi_tensor, _multi_tensor_tried = kernel, True
    try:
        yield
    finally:
        _multi_tensor, _multi_tensor_tried = saved


def _multi_tensor_block(xs: Sequence[torch.Tensor], eps: float | None, signs: Signs | None = None
                        ) -> torch.Tensor | None:
    """Rows of floating-point tensors of one device and dtype, contiguous or all strided, through
    the multi-tensor kernel (``[len(xs), WIDTH]``; with ``signs``, each followed by its sketch),
    or None where it failed (that form turned off for the process, after one warning)."""
    kernel = multi_tensor_kernel(xs[0].device)
    if kernel is None:
        return None
    threshold = 0.0 if eps is None else zeros_threshold(xs[0].dtype, eps)
    try:
        with torch.no_grad():
            return kernel(xs, threshold) if signs is None else kernel(xs, threshold, signs)
    except Exception as error:  # a Triton that cannot build it here (a GPU without fp64, say)
        global _multi_tensor_strided
        if not all(x.is_contiguous() for x in xs) or (signs is not None and signs.positions is not None):
            # only its strided form: that one off
            _multi_tensor_strided = False
            what = "strided views are reduced by the compiled kernels"
        else:
            _turn_off_multi_tensor()
            what = "statistics are reduced by the compiled kernels"
        warn_once("multi-tensor-kernel-failed",
                  f"the multi-tensor statistics kernel failed ({type(error).__name__}: {error}); {what} "
                  "from now on")
        return None


_THRESHOLDS: dict[tuple[torch.device, torch.dtype, float], torch.Tensor] = {}


def _threshold(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """The zeros threshold as the compiled kernel takes it: a 0-d tensor on ``x``'s device, made
    once per device, dtype and ``eps`` (made per call, its fill was a launch per tensor reduced:
    one in two of the stats mode's launches on an accelerator, ``benchmarks.device_cost``)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    key = (x.device, dtype, 0.0 if eps is None else eps)
    threshold = _THRESHOLDS.get(key)
    if threshold is None:
        threshold = torch.full((), key[2], dtype=dtype, device=x.device)
        if type(threshold) is torch.Tensor:  # (not a fake or functional tensor of a tracing mode)
            _THRESHOLDS[key] = threshold
    return threshold


class TensorStats:
    """Reduces one tensor to its raw row with the kernel ``backend`` selects.

    ``"auto"`` uses the compiled kernel for large tensors on CPU and CUDA and the
    eager one otherwise; ``"compiled"`` and ``"eager"`` force one kernel.
    """

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def uses_compiled(self, x: torch.Tensor) -> bool:
        """Whether :meth:`row` reduces ``x`` with the compiled kernel."""
        if self.backend == "eager" or not _COMPILED.usable(x.device):
            return False
        if not 2 <= x.numel() < COMPILED_MAX_NUMEL:  # one element would be compiled apart (size 1)
            return False
        return self.backend == "compiled" or x.numel() >= COMPILED_MIN_NUMEL

    def uses_multi_tensor(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes to the multi-tensor kernel (``"auto"``, CUDA, Triton): tensors of
        :data:`MULTI_TENSOR_DTYPES` of any size, contiguous or of a :func:`strided_layout`, read
        once in place."""
        return (self.backend == "auto" and x.dtype in MULTI_TENSOR_DTYPES
                and multi_tensor_kernel(x.device) is not None
                and (x.is_contiguous() or (_multi_tensor_strided and strided_layout(x) is not None)))

    def reads_in_place(self, x: torch.Tensor) -> bool:
        """Whether :meth:`row` reduces ``x`` in one fused pass over its memory, copying nothing."""
        return (self.uses_compiled(x) and x.is_contiguous() and x.dtype in _COMPILED_DTYPES) or \
            self.uses_multi_tensor(x)

    def row(self, x: torch.Tensor, saturated: bool = False, eps: float | None = None) -> torch.Tensor:
        """The raw row of a non-empty compact tensor (see :func:`compact_view`), on its device.

        ``saturated``: overflow on this device writes +-max of the dtype instead of
        inf (Ascend NPU saturation mode), so values at +max count as +Inf, at -max as -Inf.
        A tensor of more than one piece is reduced piece by piece, unless read in place.
        """
        if pieces.too_large(x) and (saturated or not self.reads_in_place(x)):
            with torch.no_grad():
                return pieces.combine_raw([self.row(p, saturated, eps) for p in pieces.split(x)])
        acc = accumulation_dtype(x.device)
        if saturated and x.is_floating_point():
            row = eager_raw(x, acc, eps)
            with torch.no_grad():
                top = torch.finfo(x.dtype).max
                extra = torch.zeros(WIDTH, dtype=acc, device=x.device)
                extra[RAW_COLUMNS.index("inf")] = (x.abs() == top).sum()
                extra[RAW_COLUMNS.index("ninf")] = (x == -top).sum()
                return row + extra
        if self.uses_multi_tensor(x):
            block = _multi_tensor_block([x], eps)
            if block is not None:
                return block[0].to(acc)
        if self.uses_compiled(x):
            flat = (x if x.is_contiguous() else x.contiguous()).view(-1)
            if flat.dtype not in _COMPILED_DTYPES:
                # Integers, bool, fp8: widened here as the kernel would, so that it is compiled
                # for four dtypes only (dynamo compiles a function 8 times at most).
                flat = flat.to(torch.float32)
            with torch.no_grad():
                return _COMPILED(flat, _threshold(flat, eps)).to(acc)
        return eager_raw(x, acc, eps)


# -- queued batches -----------------------------------------------------------------------


def _moments(flat: torch.Tensor) -> torch.Tensor:
    """[min, max, sum, sum of squares] of a 1-D fp32 or fp64 tensor in one pass once compiled,
    the sums in fp64 (fp32 extremes are exact, and widening fp32 to fp64 costs the loop little)."""
    w = flat.to(torch.float64)
    return torch.stack([flat.amin().to(torch.float64), flat.amax().to(torch.float64), w.sum(), (w * w).sum()])


def _bf16_pair_moments(pairs: torch.Tensor) -> torch.Tensor:
    """As :func:`_moments` for a bf16 tensor read as int32 ``pairs`` (two values each).

    A bf16 value is the top 16 bits of the fp32 value it equals, so shifting and masking
    give both halves as fp32 exactly, in 16-lane vectors that widen to fp64 at full speed
    (bf16 read as such widens three to four times slower in the generated loop).
    """
    # One value of the pair each (which is first depends on byte order, which no statistic does).
    lo = (pairs << 16).view(torch.float32)
    hi = (pairs & -65536).view(torch.float32)
    wl, wh = lo.to(torch.float64), hi.to(torch.float64)
    return torch.stack([torch.minimum(lo.amin(), hi.amin()).to(torch.float64),
                        torch.maximum(lo.amax(), hi.amax()).to(torch.float64),
                        wl.sum() + wh.sum(), (wl * wl).sum() + (wh * wh).sum()])


# Compiled once per dtype: fp32 and fp64 tensors, and bf16 ones as int32 pairs.
_MOMENTS = StandaloneCpuKernel(lambda dtype: _bf16_pair_moments if dtype == torch.int32 else _moments,
                               "statistics")


def _eager_moments(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    acc = torch.float64
    maxes = torch._foreach_max(xs)
    sumsq = torch._foreach_powsum(xs, 2, dtype=acc)
    return [torch.stack([x.amin().to(acc), m.to(acc), x.sum(dtype=acc), q])
            for x, m, q in zip(xs, maxes, sumsq, strict=True)]


PARALLEL_MIN_NUMEL = 1 << 16
"""From this many elements the compiled pass is split across torch's intra-op threads (below,
starting the threads costs more than they save; measured, 2 threads: 131k fp32 elements 25
against 39 us, 4M 0.50 against 0.97 ms)."""

def _as_bf16_pairs(flat: torch.Tensor) -> bool:
    """Whether the compiled pass reads the contiguous ``flat`` as int32 pairs of bf16 values."""
    return flat.dtype == torch.bfloat16 and flat.numel() % 2 == 0 and flat.data_ptr() % 4 == 0


def _moments_read_in_place(x: torch.Tensor) -> bool:
    """Whether the compiled pass reads ``x`` as it is (no copy, no widened copy)."""
    return x.is_contiguous() and (x.dtype in (torch.float32, torch.float64) or _as_bf16_pairs(x))


def _compiled_moments(x: torch.Tensor, threads: bool | None = None) -> torch.Tensor | None:
    """The compiled pass over ``x`` (at most a piece, unless read in place), or None where it
    cannot run. ``threads``: whether torch has more than one intra-op thread (asked here when
    None; a batch asks once)."""
    numel = x.numel()
    if numel < 2:
        return None
    # A slice with gaps (rotate_half's halves, a split) is copied: the copy and the pass take a
    # third of the time of the eager reductions reading it in place (measured, 131k elements:
    # 53-71 us against 163-346).
    flat = x.contiguous().view(-1)
    if threads is None:
        threads = torch.get_num_threads() > 1
    parallel = threads and numel >= PARALLEL_MIN_NUMEL
    if flat.dtype is torch.float32:  # most tensors: no pairs, no widening
        return _MOMENTS(flat, parallel)
    if _as_bf16_pairs(flat):
        return _MOMENTS(flat.view(torch.int32), parallel)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()  # exact; faster than widening 16-bit values inside the loop
    return _MOMENTS(flat, parallel)


def _moments_row(x: torch.Tensor, compiled: bool, threads: bool | None = None) -> torch.Tensor | None:
    """``[min, max, sum, sumsq]`` of ``x`` in fp64, or None: left to the batched eager reductions.
    A tensor of more than one piece is never left to them (their sums widen it whole).
    ``threads``: as :func:`_compiled_moments` takes it."""
    if x.numel() <= pieces.PIECE_NUMEL:  # (pieces.too_large, spelled out: once per tensor)
        return _compiled_moments(x, threads) if compiled else None
    if compiled and _moments_read_in_place(x):
        row = _compiled_moments(x)
        if row is not None:
            return row
    parts = []
    for p in pieces.split(x):
        part = _compiled_moments(p) if compiled else None
        parts.append(part if part is not None else _eager_moments([p])[0])
    return pieces.combine_raw(parts)


def cpu_rows(xs: list[torch.Tensor], compiled: bool = True, eps: float | None = None) -> np.ndarray:
    """Raw rows of CPU tensors of one dtype, ``[len(xs), WIDTH]`` fp64 on the host.
    ``compiled=False``: the eager reductions only. The tensors may require grad (an
    activation, a view of a parameter): nothing here is recorded by autograd."""
    with torch.no_grad():
        threads = torch.get_num_threads() > 1
        rows = [_moments_row(x, compiled, threads) for x in xs]
        eager = [i for i, r in enumerate(rows) if r is None]
        if eager:  # no compiler (or one element): read in place by the eager reductions
            for i, r in zip(eager, _eager_moments([xs[i] for i in eager]), strict=True):
                rows[i] = r
        table = torch.stack(rows).to(torch.float64)  # type: ignore[arg-type]  # (fp64 already)
        out = np.zeros((len(xs), WIDTH), dtype=np.float64)
        out[:, :4] = table.numpy()  # host memory already: no transfer, no sync
        if eps is not None:
            out[:, 7] = [float(_zeros(x, eps, torch.float64)) for x in xs]
        for i in np.flatnonzero(~np.isfinite(out[:, :4]).all(axis=1)).tolist():
            # A NaN or Inf in the tensor (or an fp64 overflow): the exact pass, with counts.
            out[i] = eager_raw(xs[i], torch.float64, eps).numpy()
    return out


def _sumsq(xs: list[torch.Tensor], acc: torch.dtype) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_powsum(xs, 2, dtype=acc))
    except RuntimeError:  # a backend without the dtype argument: per tensor
        return [torch.linalg.vector_norm(x, 2, dtype=acc).square() for x in xs]


def device_rows(xs: list[torch.Tensor], eps: float | None = None, stats: TensorStats | None = None
                ) -> torch.Tensor:
    """Raw rows of tensors of one device and dtype, ``[len(xs), WIDTH]`` on that device in its
    accumulation dtype, without reading any value on the host.

    Tensors ``stats`` (default: ``"auto"``) reduces with the compiled kernel go through it, one
    read each; the others through ``_foreach_*`` reductions, a handful of launches per batch.
    The foreach form reads a tensor about eight times and writes a negated copy and three masks
    of it, which on a GPU made a 7B-wide bf16 step 14x slower (H200: 335 of 359 ms).
    """
    return torch.stack(device_row_list(xs, eps, stats))


def device_row_list(xs: list[torch.Tensor], eps: float | None = None, stats: TensorStats | None = None
                    ) -> list[torch.Tensor]:
    """As :func:`device_rows`, one row per tensor and no stack (from :func:`device_row_blocks`)."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    for indices, block in device_row_blocks(xs, eps, stats):
        for i, row in zip(indices, block.unbind(0), strict=True):
            out[i] = row
    return out  # type: ignore[return-value]


RowBlock = tuple[list[int], torch.Tensor]
"""Rows of some of a batch's tensors: their positions in the batch, and ``[len, WIDTH]`` rows."""


def device_row_blocks(xs: list[torch.Tensor], eps: float | None = None, stats: TensorStats | None = None,
                      signs: Signs | None = None) -> list[RowBlock]:
    """The rows of :func:`device_rows` as the kernels return them, a block per kernel call: the
    capture queue keeps the blocks until the step's end, where one ``cat`` gathers them (a stack
    per queued batch was a launch per batch: 74 a step of the 7B-wide model,
    ``benchmarks.device_cost``; a view per row, host work per tensor).

    ``signs``: the multi-tensor kernel's blocks are ``[len, WIDTH + SKETCHES]``, each row followed
    by the sketch of the values in the order it read them, from the same read (the others' blocks
    have none)."""
    stats = stats if stats is not None else TensorStats()
    blocks: list[RowBlock] = []
    multi = [i for i, x in enumerate(xs) if stats.uses_multi_tensor(x)]
    rest = list(range(len(xs)))
    if multi:
        # One launch pair per dtype, and apart the tensors not 16-byte aligned (a view at an
        # odd offset), whose loads cannot be vectorized, and the strided ones (their addresses
        # are computed per value).
        kinds = {i: (xs[i].dtype, xs[i].data_ptr() % 16 == 0,
                     xs[i].is_contiguous() and not (signs is not None and signs.reordered(i))) for i in multi}
        for kind in set(kinds.values()):
            group = [i for i in multi if kinds[i] == kind]
            group_signs = None if signs is None else signs.of(group)
            block = _multi_tensor_block([xs[i] for i in group], eps, group_signs)
            if block is None:  # failed, and off from now on: the paths below
                return device_row_blocks(xs, eps, stats)
            blocks.append((group, block))
        taken = set(multi)
        rest = [i for i in rest if i not in taken]
    if not rest:
        return blocks
    # The foreach reductions make negated copies and masks of each tensor: one of more than a
    # piece goes to ``stats.row``, which reduces it piece by piece.
    alone = {i for i in rest if stats.uses_compiled(xs[i]) or pieces.too_large(xs[i])}
    together = [i for i in rest if i not in alone]
    if together:
        blocks.append((together, _foreach_rows([xs[i] for i in together], eps)))
    blocks += [([i], stats.row(xs[i], eps=eps).reshape(1, -1)) for i in rest if i in alone]
    return blocks


def _foreach_rows(xs: list[torch.Tensor], eps: float | None) -> torch.Tensor:
    acc = accumulation_dtype(xs[0].device)
    with torch.no_grad():
        maxes = torch.stack(torch._foreach_max(xs)).to(acc)
        # min(x) == -max(-x) exactly; NaN stays NaN.
        mins = torch.stack(torch._foreach_max(torch._foreach_neg(xs))).to(acc).neg_()
        sums = torch.stack([x.sum(dtype=acc) for x in xs])
        sumsq = torch.stack(_sumsq(xs, acc))
        nan = torch.stack([torch.isnan(x).sum() for x in xs]).to(acc)
        inf = torch.stack([torch.isinf(x).sum() for x in xs]).to(acc)
        ninf = torch.stack([torch.isneginf(x).sum() for x in xs]).to(acc)
        zeros = torch.stack([_zeros(x, eps, acc) for x in xs])
        return torch.stack([mins, maxes, sums, sumsq, nan, inf, ninf, zeros], 1)


def chunk_rows(data: np.ndarray, offsets: np.ndarray, eps: float | None = None) -> np.ndarray:
    """Raw rows of the segments of a flat host array (``offsets``: where each starts), sums in
    fp64 (segments are short: ``reduceat``'s sequential sums stay within 1e-11 relative)."""
    out = np.empty((len(offsets), WIDTH), dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in a sum is a NaN row
        wide = data.astype(np.float64, copy=False)
        out[:, 0] = np.minimum.reduceat(data, offsets)  # propagates NaN, like amin
        out[:, 1] = np.maximum.reduceat(data, offsets)
        out[:, 2] = np.add.reduceat(wide, offsets)
        out[:, 3] = np.add.reduceat(wide * wide, offsets)
    # Counted only in segments whose sum is not finite: a NaN or an Inf makes it so (fp64 sums
    # of short fp32 segments cannot overflow), and finite ones are the rule, so three passes
    # over the whole chunk are saved.
    out[:, 4:] = 0
    if eps is not None:
        threshold = data.dtype.type(zeros_threshold(torch.float64 if data.dtype == np.float64 else
                                                    torch.float32, eps))
        out[:, 7] = np.add.reduceat((np.abs(data) < threshold).astype(np.int64), offsets)
    ends = [*offsets[1:].tolist(), len(data)]
    for i in np.flatnonzero(~np.isfinite(out[:, 2])).tolist():
        segment = data[offsets[i]:ends[i]]
        out[i, 4:7] = (np.count_nonzero(np.isnan(segment)), np.count_nonzero(np.isinf(segment)),
                       np.count_nonzero(np.isneginf(segment)))
    return out


# -- Adam's update ---------------------------------------------------------------------------


def _adam_update_raw(m: torch.Tensor, v: torch.Tensor, coefficients: torch.Tensor, threshold: torch.Tensor
                     ) -> torch.Tensor:
    """The raw row of Adam's update ``lr * (m / c1) / (sqrt(v / c2) + adam_eps)`` without
    materializing it; ``coefficients`` = [lr / c1, 1 / c2, adam_eps]."""
    update = coefficients[0] * m.to(torch.float32) / ((v.to(torch.float32) * coefficients[1]).sqrt()
                                                       + coefficients[2])
    return _fused_raw(update, threshold)


_ADAM_UPDATE = CompiledKernel(_adam_update_raw)


def adam_update_row(m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float, beta2: float, adam_eps: float,
                    step: torch.Tensor | float, eps: float) -> tuple[torch.Tensor, int]:
    """The raw row of the step Adam took from its moments (decoupled weight decay not included),
    and its element count.

    ``step`` is Adam's counter: a host number, or a device tensor (capturable and
    fused Adam), which is then used where it is, without a sync.
    """
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
        t = step.to(device=m.device, dtype=torch.float32)
        coefficients = torch.stack([lr / (1 - beta1**t), 1 / (1 - beta2**t), torch.full_like(t, adam_eps)])
    else:
        t = float(step)
        coefficients = torch.tensor([lr / (1 - beta1**t), 1 / (1 - beta2**t), adam_eps],
                                    dtype=torch.float32, device=m.device)
    threshold = torch.full((), eps, dtype=torch.float32, device=m.device)
    acc = accumulation_dtype(m.device)
    flat_m, flat_v = m.detach().reshape(-1), v.detach().reshape(-1)
    if COMPILED_MIN_NUMEL <= m.numel() < COMPILED_MAX_NUMEL and _ADAM_UPDATE.usable(m.device):
        return _ADAM_UPDATE(flat_m, flat_v, coefficients, threshold).to(acc), m.numel()
    # Eager, the update and its masks are made: a piece at a time.
    parts = [_adam_update_raw(piece_m, piece_v, coefficients, threshold).to(acc)
             for piece_m, piece_v in zip(pieces.split(flat_m), pieces.split(flat_v), strict=True)]
    return (parts[0] if len(parts) == 1 else pieces.combine_raw(parts)), m.numel()
