"""Per-tensor statistics on the tensor's device, without a host sync.

A tensor's statistics are reduced to one raw row (:data:`RAW_COLUMNS`) on its
device; ``finalize`` turns raw rows into min/max/mean/norm/nan/inf on the host
after the step's single transfer.

Accumulation is in fp32 (fp64 for fp64 tensors): an fp16 sum of squares
overflows on perfectly finite data. fp32 itself overflows for values near its
range (a ``finfo.min`` attention mask), so the same pass also accumulates the
sum and the sum of squares of down-scaled values; the host uses those where
the plain ones overflowed on finite data. The raw row is stored in fp64 where
the device supports it, so counts stay exact. Before reducing, a tensor is reduced
to a compact view of the same multiset of values: broadcast (stride-0) dims are
dropped and counted as a multiplicity, and a permuted tensor is read in storage
order, so transposed and expanded tensors are never copied.

Two interchangeable kernels compute the raw row: a single-pass ``torch.compile``d
kernel (one fused loop on CPU, one Triton kernel on GPU) and an eager fallback of
a few reductions, used where compilation is unavailable or fails.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from probe.tracer.compat import default_compile_stance, warn_once

RAW_COLUMNS = ("min", "max", "sum", "sumsq", "nan", "inf", "sum_scaled", "sumsq_scaled")
# Powers of two, so scaling is exact; chosen so that fp32 values at the top of
# the range neither overflow the scaled sums nor lose what dominates them.
SUM_SCALE_LOG2 = -64
SUMSQ_SCALE_LOG2 = -100
STAT_COLUMNS = ("min", "max", "mean", "norm", "nan", "inf")
BACKENDS = ("auto", "compiled", "eager")

_LOW_PRECISION_FLOATS = {torch.float16, torch.bfloat16, torch.float32}


def row_dtype(device: torch.device) -> torch.dtype:
    """fp64 rows keep counts exact; devices without fp64 arithmetic use fp32."""
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


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """Complex tensors are reduced over their real and imaginary parts.

    The L2 norm of the parts equals the complex norm; min/max/mean are over parts.
    """
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def _eager_raw(x: torch.Tensor, acc: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    if x.dtype != acc:
        x = x.to(acc)
    # Reductions read strided tensors in place; only the squares need a temporary.
    mn, mx = torch.aminmax(x)
    nan = torch.isnan(x).sum().to(acc)
    inf = torch.isinf(x).sum().to(acc)
    scaled = x * 2.0**SUM_SCALE_LOG2
    scaled_sq = x * 2.0**SUMSQ_SCALE_LOG2
    row = [mn, mx, x.sum(), x.square().sum(), nan, inf, scaled.sum(), scaled_sq.square().sum()]
    return torch.stack(row).to(out_dtype)


def _fused_row(xf: torch.Tensor) -> torch.Tensor:
    # The compiler fuses every reduction below into one pass over xf.
    # NaN/Inf are counted through x != x and (x - x) != (x - x) (NaN for any
    # non-finite x), which lower to plain comparisons, unlike isnan/isinf.
    diff = xf - xf
    nan = (xf != xf).sum().to(xf.dtype)
    nonfinite = (diff != diff).sum().to(xf.dtype)
    scaled = xf * 2.0**SUM_SCALE_LOG2
    scaled_sq = xf * 2.0**SUMSQ_SCALE_LOG2
    return torch.stack(
        [
            xf.amin(), xf.amax(), xf.sum(), (xf * xf).sum(), nan, nonfinite - nan,
            scaled.sum(), (scaled_sq * scaled_sq).sum(),
        ]
    )


def _fused_raw_fp32(flat: torch.Tensor) -> torch.Tensor:
    return _fused_row(flat.to(torch.float32)).to(torch.float64)


def _fused_raw_fp64(flat: torch.Tensor) -> torch.Tensor:
    # A separate function from the fp32 one so that each has its own compile cache.
    return _fused_row(flat.to(torch.float64))


class _CompiledKernels:
    """Process-wide compiled kernels; a device type whose compile fails falls back to eager."""

    def __init__(self) -> None:
        self._fns: dict[torch.dtype, Any] = {}
        self.failed_devices: set[str] = set()

    def get(self, acc: torch.dtype) -> Any:
        fn = self._fns.get(acc)
        if fn is None:
            body = _fused_raw_fp64 if acc == torch.float64 else _fused_raw_fp32
            fn = self._fns[acc] = torch.compile(body, dynamic=True, fullgraph=True)
        return fn


_COMPILED = _CompiledKernels()


class RawStat(NamedTuple):
    """One tensor's raw row (None for an empty tensor) and what finalize needs."""

    row: torch.Tensor | None
    numel: int
    """Elements in the compact view the row was reduced over."""
    multiplicity: int
    """How often each of those elements occurs in the tensor (broadcast dims)."""


class TensorStats:
    """Computes raw stat rows for tensors; ``backend`` is one of :data:`BACKENDS`."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def _use_compiled(self, device: torch.device) -> bool:
        if self.backend == "eager" or device.type in _COMPILED.failed_devices:
            return False
        # Compiling for an accelerator without a compiler backend (Triton for
        # CUDA) cannot work; "auto" only tries where inductor supports the device.
        return self.backend == "compiled" or device.type in ("cpu", "cuda")

    def raw(self, t: torch.Tensor) -> RawStat | None:
        """The raw row of ``t`` on its device; None for tensors without values (meta, sparse)."""
        if t.device.type == "meta" or t.is_sparse or t.is_nested or t.is_quantized:
            return None
        x, multiplicity = compact_view(_as_real(t))
        numel = x.numel()
        if numel == 0:
            return RawStat(None, 0, multiplicity)
        device = x.device
        out_dtype = row_dtype(device)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        if self._use_compiled(device):
            flat = x if x.is_contiguous() else x.contiguous()
            flat = flat.view(-1)
            if flat.dtype not in _LOW_PRECISION_FLOATS and flat.dtype != torch.float64:
                flat = flat.to(acc)  # ints, bool, fp8: one eager cast, one compiled signature
            try:
                with default_compile_stance():
                    row = _COMPILED.get(acc)(flat)
                return RawStat(row if row.dtype == out_dtype else row.to(out_dtype), numel, multiplicity)
            except Exception as e:
                _COMPILED.failed_devices.add(device.type)
                warn_once(f"compile-stats-{device.type}", f"compiled statistics kernel unavailable on "
                          f"{device.type} ({type(e).__name__}: {e}); using the eager kernel")
        return RawStat(_eager_raw(x, acc, out_dtype), numel, multiplicity)


def finalize(raw: np.ndarray, numel: np.ndarray, multiplicity: np.ndarray) -> np.ndarray:
    """Raw rows (:data:`RAW_COLUMNS`) -> ``[min, max, mean, norm, nan, inf]``.

    Where the plain sums overflowed although the tensor was finite, the
    down-scaled sums are scaled back in fp64. Rows of empty tensors (numel 0)
    get min/max/mean NaN (read back as None), norm 0 and no NaN/Inf.
    """
    out = np.empty((raw.shape[0], len(STAT_COLUMNS)), dtype=np.float64)
    if raw.shape[0] == 0:
        return out
    empty = numel == 0
    safe_numel = np.where(empty, 1, numel).astype(np.float64)
    finite_input = (raw[:, 4] == 0) & (raw[:, 5] == 0)
    total = np.where(
        finite_input & ~np.isfinite(raw[:, 2]), np.ldexp(raw[:, 6], -SUM_SCALE_LOG2), raw[:, 2]
    )
    sumsq = np.where(
        finite_input & ~np.isfinite(raw[:, 3]), np.ldexp(raw[:, 7], -2 * SUMSQ_SCALE_LOG2), raw[:, 3]
    )
    with np.errstate(invalid="ignore", over="ignore"):
        out[:, 0] = raw[:, 0]
        out[:, 1] = raw[:, 1]
        out[:, 2] = total / safe_numel
        out[:, 3] = np.sqrt(sumsq * multiplicity)
        out[:, 4] = raw[:, 4] * multiplicity
        out[:, 5] = raw[:, 5] * multiplicity
    out[empty] = (math.nan, math.nan, math.nan, 0.0, 0.0, 0.0)
    return out
