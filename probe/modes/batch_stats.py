"""Raw statistics rows of many tensors at once: the queued path of the stats mode.

The stats mode does not reduce a large tensor when the op producing it returns: it
queues it (see ``stat_rows.ReductionQueue``) and reduces a batch of queued tensors
with a handful of calls, so that the per-op host work is a list append. Nothing here
is compiled: a ``torch.compile``d call costs tens of microseconds of guard evaluation
and wrapper code per call, more than the reduction of a tensor of a few hundred
thousand elements.

- **CPU** (:func:`cpu_rows`): one pass per tensor computing min, max, sum and sum of
  squares, the sums accumulated in fp64 whatever the tensor's length and dtype (fp32
  accumulation in that loop, which does not cascade, is 1e-6 relative off at 2^20
  elements and 1e-4 on an fp16 tensor of a million equal values): a C++ loop generated
  once per process and dtype by inductor (``standalone_compile`` of a symbolically traced
  graph: no dynamo frame, no guards, about 15 us of host time a call against 100+ for a
  ``torch.compile``d function; a slice with gaps is copied for it), or where that is
  unavailable, ``_foreach_max`` and ``_foreach_powsum`` over the batch with an ``amin`` and
  a ``sum`` per tensor. The generated loop widens fp32 to fp64 at full vector speed but
  16-bit floats three to four times slower, so a bf16 tensor is read as pairs of values in
  int32 lanes (a bf16 value is the top half of an fp32 one) and an fp16 one is widened to
  fp32 first (one copy).
  The rows are already in host memory, so they are checked there, without a device sync:
  a row whose min, max, sum or sum of squares is not finite (a NaN or Inf in the tensor)
  is computed again exactly, in fp64 with NaN, Inf and -Inf counts. Every other row has
  no NaN and no Inf (``amin``/``amax`` propagate NaN, and an Inf is the min or the max).
- **Accelerators** (:func:`device_rows`): everything stays on the device and nothing
  branches on a value (that would be a host sync): min and max by ``_foreach_max`` of
  the values and of their negation, sums of squares by ``_foreach_powsum`` in the
  accumulation dtype (multi-tensor kernels on CUDA), plus a sum and NaN, Inf and -Inf
  counts per tensor. It is the portable form (NPU, any device with ``_foreach_*``
  reductions); one generated multi-tensor kernel per batch would do the same work in one
  launch.

Both return rows of :data:`tensor_stats.RAW_COLUMNS` for non-empty floating-point
compact tensors of one device and dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.compiled import StandaloneCpuKernel
from probe.modes.tensor_stats import RAW_COLUMNS, _eager_raw, accumulation_dtype

QUEUED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
"""Dtypes whose tensors are queued; others (integers, bool, fp8) are reduced one by one."""


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


COPY_MAX_NUMEL = 1 << 24
"""Slices with gaps up to this many elements are copied for the compiled pass; longer ones are
read in place by the eager reductions (no copy of that size)."""


def _compiled_moments(x: torch.Tensor) -> torch.Tensor | None:
    """The compiled pass over ``x``, or None where it cannot run."""
    if x.numel() < 2 or (not x.is_contiguous() and x.numel() > COPY_MAX_NUMEL):
        return None
    # A slice with gaps (rotate_half's halves, a split) is copied: the copy and the pass take a
    # third of the time of the eager reductions reading it in place (measured, 131k elements:
    # 53-71 us against 163-346).
    flat = x.contiguous().view(-1)
    if flat.dtype == torch.bfloat16 and flat.numel() % 2 == 0 and flat.data_ptr() % 4 == 0:
        return _MOMENTS(flat.view(torch.int32))
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()  # exact; faster than widening 16-bit values inside the loop
    return _MOMENTS(flat)


def cpu_rows(xs: list[torch.Tensor], compiled: bool = True) -> np.ndarray:
    """Raw rows of CPU tensors of one dtype, ``[len(xs), len(RAW_COLUMNS)]`` fp64 on the host.
    ``compiled=False``: the eager reductions only. The tensors may require grad (an
    activation, a view of a parameter): nothing here is recorded by autograd."""
    with torch.no_grad():
        rows = [_compiled_moments(x) if compiled else None for x in xs]
        eager = [i for i, r in enumerate(rows) if r is None]
        if eager:  # slices with gaps, or no compiler: read in place by the eager reductions
            for i, r in zip(eager, _eager_moments([xs[i] for i in eager]), strict=True):
                rows[i] = r
        table = torch.stack([r.to(torch.float64) for r in rows])  # type: ignore[union-attr]
        out = np.zeros((len(xs), len(RAW_COLUMNS)), dtype=np.float64)
        out[:, :4] = table.numpy()  # host memory already: no transfer, no sync
        for i in np.flatnonzero(~np.isfinite(out[:, :4]).all(axis=1)).tolist():
            # A NaN or Inf in the tensor (or an fp64 overflow): the exact pass, with counts.
            out[i] = _eager_raw(xs[i], torch.float64).numpy()
    return out


def _sumsq(xs: list[torch.Tensor], acc: torch.dtype) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_powsum(xs, 2, dtype=acc))
    except RuntimeError:  # a backend without the dtype argument: per tensor
        return [torch.linalg.vector_norm(x, 2, dtype=acc).square() for x in xs]


def device_rows(xs: list[torch.Tensor]) -> torch.Tensor:
    """Raw rows of tensors of one device and dtype, ``[len(xs), len(RAW_COLUMNS)]`` on that
    device in its accumulation dtype, without reading any value on the host."""
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
        return torch.stack([mins, maxes, sums, sumsq, nan, inf, ninf], 1)
