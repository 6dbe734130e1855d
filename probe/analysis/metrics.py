"""How far apart two tensors (or two tensors' statistics) are.

Tensor metrics follow msprobe's definitions where it has one, so users can read
them side by side: cosine similarity; max absolute error; max relative error
``|a - b| / |a|`` (``a`` the reference; a tiny epsilon where ``a == 0``); the
one- and five-thousandth ratios (fraction of elements whose relative error is
below 0.001 / 0.005). Added: RMSE, and the error in ULPs of the lower-precision
dtype of the pair (``|a - b|`` over the spacing of that dtype at
``max(|a|, |b|)``), which makes thresholds dtype-aware.

Element-wise ULP and relative error read elements near zero against their own tiny magnitude.
An element of a sum of products (a matmul, a norm, a softmax's denominator) that cancels to
near zero carries the round-off of its terms, ``~ eps * |terms|``, not ``eps * |element|``:
a healthy fp32 ``lm_head`` mm replayed in fp64 read as 8.7e5 ULP and relative error 0.066 with
a largest absolute error of 6.4e-7. So two measures at the tensor's scale are reported beside
them (what people read; the verdicts keep their own rules):

- ``max_ulp_at_scale``: ULPs at the spacing of ``max(|a|, |b|, rms(a))``: an element at or
  above the reference's root mean square is counted in its own ULPs as before, one below it
  in the ULPs of the rms (the magnitude the tensor's terms have, on the whole). Never more
  than ``max_ulp``; a healthy fp32 op against fp64 reads a few units.
- the largest error over the reference's rms (``max_abs_err / ref_rms``, :func:`scaled_error`):
  a healthy fp32 op reads ``~1e-7``-``1e-6``, bf16 ``~1e-3``-``1e-2``.

One fused pass computes every sum and maximum (a ``torch.compile``d kernel,
see ``probe.compiled``; the eager fallback works over chunks so its
temporaries stay bounded): values are compared in fp32 (fp64 when either side
is fp64) and sums accumulate in fp64. NaN and Inf must sit at the same
positions in both tensors; they are counted, and left out of the numeric
metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.compiled import CompiledKernel
from probe.rundir.tensor_layouts import dense_values

CHUNK = 1 << 22
_REL_EPS = 1e-12
# Mantissa bits including the implicit one, and the smallest positive subnormal.
_PRECISION = {
    torch.float64: (53, 2.0**-1074),
    torch.float32: (24, 2.0**-149),
    torch.float16: (11, 2.0**-24),
    torch.bfloat16: (8, 2.0**-133),
}
_RANK = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def lower_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes (fp8 counts as bf16, integers as fp64)."""
    ra = _RANK.get(a, 0 if a.is_floating_point else 3)
    rb = _RANK.get(b, 0 if b.is_floating_point else 3)
    return a if ra <= rb else b


class _NumbersOnly:
    """A dataclass whose fields are numbers: its dict is a shallow copy of its attributes
    (``dataclasses.asdict`` deep-copies each field: a tenth of a CNN's compare, 18,637 calls)."""

    def as_dict(self) -> dict[str, float | int]:
        return dict(vars(self))


@dataclass
class TensorMetrics(_NumbersOnly):
    cosine: float
    max_abs_err: float
    max_rel_err: float
    one_thousandth_ratio: float
    five_thousandth_ratio: float
    rmse: float
    max_ulp: float
    ref_rms: float
    """Root mean square of the reference: the scale errors are judged against."""
    nonfinite_mismatch: int
    """Positions where one tensor holds NaN/Inf and the other does not (or another one)."""
    numel: int
    max_ulp_at_scale: float = 0.0
    """ULPs at the spacing of ``max(|a|, |b|, ref_rms)``: elements below the reference's rms
    counted at its scale (see the module's docstring)."""



def scaled_error(max_abs_err: float | None, ref_rms: float | None) -> float | None:
    """The largest error over the reference's rms: the error relative to the tensor's scale
    (0 when nothing differs, inf when the reference is all zeros and something differs; None
    when either is unknown)."""
    if max_abs_err is None or ref_rms is None:
        return None
    if max_abs_err == 0:
        return 0.0
    value = max_abs_err / ref_rms if ref_rms > 0 else math.inf
    return value if math.isfinite(value) else math.inf


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return torch.view_as_real(t) if t.is_complex() else t


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that is not a view: the compiled kernel then needs no guards
    on a base tensor's sizes (which multiplied its compiled forms past dynamo's limit)."""
    t = t.contiguous()
    alias = torch.empty((0,), dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _paired_flat(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors as 1-D views in the reference's storage order, copying only ``b`` when that needs it.

    The metrics pair elements and do not care about their order, but their fp64 sums do: the
    same values read in another order round differently in the last bit. A weight and its
    transposed view are one storage, so reading the reference ``a`` in storage order gives them
    bit-identical measures; in logical order, a difference a step wrote and the same difference
    read back through a view compared as two numbers one fp64 ulp apart, and which one was
    larger depended on the machine's vector width (``tests/test_layouts.py``'s FSDP2 x TP2 dump
    job failed on some machines and passed on others).
    """
    a, b = _real(a), _real(b)
    if a.shape == b.shape and a.dim() > 1 and not a.is_contiguous():
        order = sorted(range(a.dim()), key=lambda d: (a.stride(d), a.shape[d]), reverse=True)
        pa, pb = a.permute(order), b.permute(order)
        if pa.is_contiguous():  # dense in some order of its dims: that order is its storage's
            return pa.reshape(-1), pb.reshape(-1)
    return a.reshape(-1), b.reshape(-1)


def _pow2_floor(m: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 m)`` for non-negative normal ``m`` (0 for subnormals and zero), by bit masking.

    Five times faster than log2/exp2 in the fused kernel (measured): keep only
    the exponent bits of the float.
    """
    if m.dtype == torch.float64:
        return (m.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)
    return (m.view(torch.int32) & 0x7F800000).view(torch.float32)


def _metric_sums(x: torch.Tensor, y: torch.Tensor, step: torch.Tensor, tiny: torch.Tensor,
                 scale: torch.Tensor) -> torch.Tensor:
    """One pass over two 1-D tensors once compiled; the sums and maxima the metrics need.

    ``[dot, |x|^2, |y|^2, sum (x-y)^2, max |x-y|, max rel, n rel < 1e-3, n rel < 5e-3,
    max ULP, NaN/Inf mismatches, finite pairs, max ULP at scale]``. Values are compared in
    fp32 (fp64 when either side is fp64); sums accumulate in fp64. The ULP spacing at ``m`` is
    ``2^floor(log2 m) * step`` (``step`` = 2^-(mantissa bits)), at least ``tiny``; at scale,
    ``m`` is at least ``scale`` (the reference's rms).
    """
    work = torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32
    xf, yf = x.to(work), y.to(work)
    fx, fy = (xf - xf) == 0, (yf - yf) == 0  # finite
    both = fx & fy
    same_nonfinite = (xf == yf) | ((xf != xf) & (yf != yf))
    mismatch = ((fx != fy) | (~fx & ~fy & ~same_nonfinite)).to(torch.int64).sum()
    zero = torch.zeros((), dtype=work, device=x.device)
    zx, zy = torch.where(both, xf, zero), torch.where(both, yf, zero)
    wx, wy = zx.to(torch.float64), zy.to(torch.float64)
    diff = (zx - zy).abs()
    wdiff = diff.to(torch.float64)
    rel = diff / zx.abs().clamp(min=_REL_EPS)
    magnitude = torch.maximum(zx.abs(), zy.abs())
    spacing = torch.maximum(_pow2_floor(magnitude).to(torch.float64) * step, tiny)
    at_scale = torch.maximum(_pow2_floor(torch.maximum(magnitude, scale.to(work))).to(torch.float64) * step,
                             tiny)
    return torch.stack([
        (wx * wy).sum(), (wx * wx).sum(), (wy * wy).sum(), (wdiff * wdiff).sum(),
        wdiff.max(), rel.max().to(torch.float64),
        (both & (rel < 1e-3)).to(torch.int64).sum().to(torch.float64),
        (both & (rel < 5e-3)).to(torch.int64).sum().to(torch.float64),
        (wdiff / spacing).max(), mismatch.to(torch.float64), both.to(torch.int64).sum().to(torch.float64),
        (wdiff / at_scale).max(),
    ])


def _finite_rms(x: torch.Tensor) -> float:
    """Root mean square of the finite elements of a 1-D tensor, chunk by chunk (0 if none)."""
    total, count = 0.0, 0
    for start in range(0, x.numel(), CHUNK):
        chunk = x[start : start + CHUNK].to(torch.float64)
        finite = chunk.isfinite()
        if not bool(finite.all()):
            chunk = chunk[finite]
        total += float(chunk.square().sum())
        count += chunk.numel()
    return math.sqrt(total / count) if count else 0.0


_FUSED = CompiledKernel(_metric_sums)


def tensor_metrics(a: torch.Tensor, b: torch.Tensor) -> TensorMetrics:
    """Metrics of ``b`` against the reference ``a`` (same number of elements); a sparse, nested or
    quantized tensor is measured by the values it holds (``tensor_layouts.dense_values``)."""
    a, b = dense_values(a), dense_values(b)
    fa, fb = _paired_flat(a, b)
    if fa.numel() != fb.numel():
        raise ValueError(f"cannot compare {fa.numel()} elements with {fb.numel()}")
    n = fa.numel()
    if n == 0:
        return TensorMetrics(1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0, 0, 0.0)
    bits, tiny = _PRECISION.get(lower_precision(a.dtype, b.dtype), _PRECISION[torch.bfloat16])
    step_t = torch.tensor(2.0 ** (1 - bits), dtype=torch.float64, device=fa.device)
    tiny_t = torch.tensor(tiny, dtype=torch.float64, device=fa.device)
    # Both sides in the working dtype before the kernel, so it is compiled for
    # two dtypes only; fixed-size chunks bound its temporaries even if it runs eagerly.
    exact_in_fp32 = all(
        d in (torch.float32, torch.float16, torch.bfloat16) or (d.itemsize == 1 and d.is_floating_point)
        for d in (fa.dtype, fb.dtype)
    )
    work = torch.float32 if exact_in_fp32 else torch.float64  # integers compare exactly in fp64
    fa, fb = fa.to(work), fb.to(work)
    # The reference's scale, before the pass that measures against it (a read of ``a`` alone).
    scale_t = torch.tensor(_finite_rms(fa), dtype=work, device=fa.device)
    parts = []
    for start in range(0, n, CHUNK):
        xa = _standalone(fa[start : start + CHUNK])
        xb = _standalone(fb[start : start + CHUNK])
        parts.append(_FUSED(xa, xb, step_t, tiny_t, scale_t).cpu())
    sums = torch.stack(parts)
    dot, norm_a, norm_b, sq_err = (float(v) for v in sums[:, :4].sum(0))
    max_abs, max_rel = float(sums[:, 4].max()), float(sums[:, 5].max())
    within_1e3, within_5e3 = float(sums[:, 6].sum()), float(sums[:, 7].sum())
    max_ulps, mismatch, finite = float(sums[:, 8].max()), int(sums[:, 9].sum()), int(sums[:, 10].sum())
    if norm_a == 0.0 and norm_b == 0.0:
        cosine = 1.0
    elif norm_a == 0.0 or norm_b == 0.0:
        cosine = 0.0
    else:
        cosine = dot / math.sqrt(norm_a * norm_b)
    counted = max(finite, 1)
    return TensorMetrics(
        cosine=cosine,
        max_abs_err=max_abs,
        max_rel_err=max_rel,
        one_thousandth_ratio=within_1e3 / counted if finite else 1.0,
        five_thousandth_ratio=within_5e3 / counted if finite else 1.0,
        rmse=math.sqrt(sq_err / counted) if finite else 0.0,
        max_ulp=max_ulps,
        ref_rms=math.sqrt(norm_a / counted) if finite else 0.0,
        nonfinite_mismatch=mismatch,
        numel=n,
        max_ulp_at_scale=float(sums[:, 11].max()),
    )


@dataclass
class StatsMetrics(_NumbersOnly):
    """Relative differences of statistics (``|b - a| / max(|a|, |b|)``), and count differences."""

    max_rel: float
    min_rel: float
    mean_rel: float
    norm_rel: float
    mean_abs: float
    nan_diff: int
    inf_diff: int



def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return math.inf if math.isinf(scale) else abs(a - b) / scale


def stats_metrics(a: dict, b: dict) -> StatsMetrics:
    mean_a, mean_b = a.get("mean"), b.get("mean")
    mean_abs = abs(mean_a - mean_b) if mean_a is not None and mean_b is not None else 0.0
    return StatsMetrics(
        max_rel=_rel(a["max"], b["max"]),
        min_rel=_rel(a["min"], b["min"]),
        mean_rel=_rel(mean_a, mean_b),
        norm_rel=_rel(a["norm"], b["norm"]),
        mean_abs=mean_abs if not math.isnan(mean_abs) else 0.0,
        nan_diff=int(b["nan"]) - int(a["nan"]),
        inf_diff=int(b["inf"]) - int(a["inf"]),
    )
