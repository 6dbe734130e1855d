"""Per-tensor statistics on the tensor's device, without a host sync.

A tensor's statistics are reduced to one raw row (:data:`RAW_COLUMNS`) on its
device; ``finalize`` turns raw rows into min/max/mean/norm and the NaN, Inf, +Inf
and -Inf counts on the host after the step's single transfer.

Values are upcast before they are reduced, never reduced in their own dtype:
an fp16 sum of squares overflows on perfectly finite data. Sums and sums of
squares accumulate in fp64 on CPU and CUDA, on every path (fp32 accumulation
loses 1e-4 relative on an fp16 tensor of a million equal values; fp64 keeps
sums and norms within 1e-7 of exact, the squares of values at the top of fp32's
range, such as a ``finfo.min`` attention mask, still fit, and counts stay exact)
and in fp32 on other devices. Before reducing, a tensor is reduced
to a compact view of the same multiset of values: broadcast (stride-0) dims are
dropped and counted as a multiplicity, and a permuted tensor is read in storage
order, so transposed and expanded tensors are never copied.

Two interchangeable kernels compute the raw row: a single-pass ``torch.compile``d
kernel (one fused loop on CPU, one Triton kernel on GPU) for large tensors, and a
few eager reductions for small ones (cheaper than a compiled call there) and
wherever compilation is unavailable or fails.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probe.compiled import CompiledKernel

RAW_COLUMNS = ("min", "max", "sum", "sumsq", "nan", "inf", "ninf")
"""``inf`` counts +Inf and -Inf alike, ``ninf`` the -Inf among them."""
STAT_COLUMNS = ("min", "max", "mean", "norm", "nan", "inf", "posinf", "neginf")
"""``inf`` = ``posinf`` + ``neginf``: kept whole for readers that do not ask for the sign."""
BACKENDS = ("auto", "compiled", "eager")

# Below this many elements a few eager reductions cost less than one call of the
# compiled kernel (guards and buffer set-up); above it one fused pass wins.
COMPILED_MIN_NUMEL = 1 << 15
COMPILED_MAX_NUMEL = 1 << 31  # its int32 counters could overflow beyond


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """fp64 where the device has fast fp64 (sums of fp32 squares cannot overflow it
    and counts stay exact, and on CPU the fused fp64 pass is as fast as fp32);
    fp32 elsewhere."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def compact_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A view holding each distinct element of ``t`` once, and how often each repeats.

    Statistics are invariant under permutation, and a stride-0 dim repeats the
    same elements ``size`` times, so both can be undone without copying.
    """
    multiplicity = 1
    if t.dim() == 0:
        return t.reshape(1), 1
    strides = t.stride()
    if 0 in strides:
        for dim in range(t.dim() - 1, -1, -1):
            if strides[dim] == 0 and t.shape[dim] > 1:
                multiplicity *= t.shape[dim]
                t = t.narrow(dim, 0, 1)
    if not t.is_contiguous():
        order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
        permuted = t.permute(order)
        if permuted.is_contiguous():
            t = permuted
    return t, multiplicity


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


def _eager_raw(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """A handful of small kernels; reads strided tensors in place. Without autograd: the
    row is read on the host (``numpy()``) and ``x`` may require grad."""
    with torch.no_grad():
        return _eager_raw_values(x, acc)


def _eager_raw_values(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
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
    return torch.stack([mn, mx, xa.sum(), sumsq, nan, inf, ninf])


def _fused_raw(flat: torch.Tensor) -> torch.Tensor:
    """One pass over a 1-D tensor once compiled: every reduction fuses into one loop.

    Low-precision values are widened to fp32 for min, max and the counts and to
    fp64 only inside the sums (measured: faster than widening everything to fp64,
    and a plain fp32 sum makes the compiler emit a slower cascaded reduction).
    NaN and Inf are counted through ``x != x`` and ``(x - x) != (x - x)`` (NaN for
    any non-finite x), which lower to plain comparisons, unlike isnan/isinf, in
    int32 lanes (faster than int64; callers keep tensors of 2^31 elements or more
    away from this kernel); -Inf by ``x == -inf``.
    """
    x = flat if flat.dtype == torch.float64 else flat.to(torch.float32)
    wide = x.to(torch.float64)
    diff = x - x
    nan = (x != x).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    nonfinite = (diff != diff).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    ninf = (x == -math.inf).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    return torch.stack(
        [x.amin().to(torch.float64), x.amax().to(torch.float64), wide.sum(), (wide * wide).sum(),
         nan, nonfinite - nan, ninf]
    )


_COMPILED = CompiledKernel(_fused_raw)
_COMPILED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class TensorStats:
    """Reduces one tensor to its raw row with the kernel ``backend`` selects.

    ``"auto"`` uses the compiled kernel for large tensors on CPU and CUDA and the
    eager one otherwise; ``"compiled"`` and ``"eager"`` force one kernel.
    """

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def _use_compiled(self, x: torch.Tensor) -> bool:
        if self.backend == "eager" or not _COMPILED.usable(x.device):
            return False
        if not 2 <= x.numel() < COMPILED_MAX_NUMEL:  # one element would be compiled apart (size 1)
            return False
        return self.backend == "compiled" or x.numel() >= COMPILED_MIN_NUMEL

    def row(self, x: torch.Tensor, saturated: bool = False) -> torch.Tensor:
        """The raw row of a non-empty compact tensor (see :func:`compact_view`), on its device.

        ``saturated``: overflow on this device writes +-max of the dtype instead of
        inf (Ascend NPU saturation mode), so values at +max count as +Inf, at -max as -Inf.
        """
        acc = accumulation_dtype(x.device)
        if saturated and x.is_floating_point():
            row = _eager_raw(x, acc)
            with torch.no_grad():
                top = torch.finfo(x.dtype).max
                at_max = (x.abs() == top).sum().to(acc)
                at_min = (x == -top).sum().to(acc)
                # Added to the Inf and -Inf columns, the last two.
                return row + torch.nn.functional.pad(torch.stack([at_max, at_min]), (len(RAW_COLUMNS) - 2, 0))
        if self._use_compiled(x):
            flat = (x if x.is_contiguous() else x.contiguous()).view(-1)
            if flat.dtype not in _COMPILED_DTYPES:
                # Integers, bool, fp8: widened here as the kernel would, so that it is compiled
                # for four dtypes only (dynamo compiles a function 8 times at most).
                flat = flat.to(torch.float32)
            return _COMPILED(flat).to(acc)
        return _eager_raw(x, acc)


def finalize(raw: np.ndarray, numel: np.ndarray, multiplicity: np.ndarray) -> np.ndarray:
    """Raw rows (:data:`RAW_COLUMNS`) -> rows of :data:`STAT_COLUMNS` in fp64.

    Rows of empty tensors (numel 0) get min/max/mean NaN (read back as None),
    norm 0 and no NaN/Inf.
    """
    out = np.empty((raw.shape[0], len(STAT_COLUMNS)), dtype=np.float64)
    if raw.shape[0] == 0:
        return out
    empty = numel == 0
    safe_numel = np.where(empty, 1, numel).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        out[:, 0] = raw[:, 0]
        out[:, 1] = raw[:, 1]
        out[:, 2] = raw[:, 2] / safe_numel
        out[:, 3] = np.sqrt(raw[:, 3] * multiplicity)
        out[:, 4] = raw[:, 4] * multiplicity
        out[:, 5] = raw[:, 5] * multiplicity
        out[:, 6] = (raw[:, 5] - raw[:, 6]) * multiplicity
        out[:, 7] = raw[:, 6] * multiplicity
    out[empty] = (math.nan, math.nan, math.nan, 0.0, 0.0, 0.0, 0.0, 0.0)
    return out
