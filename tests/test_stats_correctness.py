"""Statistics agree with torch computed in fp64, for every layout and precision."""

from __future__ import annotations

import math

import pytest
import torch

import probe


def _reference(t: torch.Tensor) -> dict:
    x = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
    x = x.to(torch.float64)
    finite = x[torch.isfinite(x)]
    return {
        "min": x.min().item() if x.numel() else None,
        "max": x.max().item() if x.numel() else None,
        "mean": x.mean().item() if x.numel() else None,
        "norm": torch.linalg.vector_norm(x).item(),
        "nan": int(torch.isnan(x).sum()),
        "inf": int(torch.isinf(x).sum()),
        "finite_count": finite.numel(),
    }


def _traced_outputs(tmp_path, backend, make):
    """Run ``make()`` under the stats mode and return (tensors it produced, their records)."""
    out = tmp_path / backend
    with probe.mode("stats", out=out, stats_backend=backend, ops=["aten.clone.default"]):
        tensors = make()
    records = [op.outputs[0] for op in probe.load(out).ops(0)]
    assert len(records) == len(tensors)
    return tensors, records


def _check(record, tensor, rel: float):
    ref = _reference(tensor)
    stats = record.stats
    assert stats["nan"] == ref["nan"] and stats["inf"] == ref["inf"]
    if ref["min"] is None:
        assert stats["min"] is None and stats["max"] is None and stats["mean"] is None
        assert stats["norm"] == 0.0
        return
    assert stats["min"] == ref["min"] and stats["max"] == ref["max"]  # exact: no rounding in min/max
    scale = max(ref["norm"] / math.sqrt(max(ref["finite_count"], 1)), 1e-30)
    assert abs(stats["mean"] - ref["mean"]) <= rel * scale
    assert stats["norm"] == pytest.approx(ref["norm"], rel=rel)


LAYOUTS = {
    "contiguous": lambda g, dt: torch.randn(64, 33, generator=g).to(dt),
    "empty": lambda g, dt: torch.empty(0, 5, dtype=dt),
    "zero_dim": lambda g, dt: torch.tensor(-2.5).to(dt),
    "transposed": lambda g, dt: torch.randn(40, 24, generator=g).to(dt).t(),
    "sliced": lambda g, dt: torch.randn(40, 24, generator=g).to(dt)[::3, 5:17],
    "expanded": lambda g, dt: torch.randn(7, 1, 5, generator=g).to(dt).expand(7, 9, 5),
    "permuted_3d": lambda g, dt: torch.randn(6, 5, 4, generator=g).to(dt).permute(2, 0, 1),
    "large": lambda g, dt: (torch.randn(200_003, generator=g) * 3 + 1).to(dt),
}


@pytest.mark.parametrize("backend", ["auto", "compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stats_match_fp64_reference(tmp_path, backend, dtype):
    gen = torch.Generator().manual_seed(0)
    inputs = {name: make(gen, dtype) for name, make in LAYOUTS.items()}

    def make():
        # clone keeps the layout (preserve_format) of dense and expanded-free tensors;
        # views are taken of the clones so the recorded tensor has the same layout.
        return [torch.ops.aten.clone.default(t) for t in inputs.values()]

    tensors, records = _traced_outputs(tmp_path, backend, make)
    for name, tensor, record in zip(inputs, tensors, records, strict=True):
        assert record.dtype == str(dtype).removeprefix("torch."), name
        assert record.shape == tuple(tensor.shape), name
        _check(record, tensor, rel=1e-5)


@pytest.mark.parametrize("backend", ["auto", "compiled", "eager"])
def test_views_and_expanded_outputs_reduce_without_copying_their_values(tmp_path, backend):
    base = torch.randn(8, 1, 6, generator=torch.Generator().manual_seed(1))
    out = tmp_path / backend
    with probe.mode("stats", out=out, stats_backend=backend, ops=["expand", "transpose", "slice"]):
        expanded = base.expand(8, 11, 6)
        transposed = base.transpose(0, 2)
        sliced = base[2:7]
    ops = probe.load(out).ops(0)
    for op, tensor in zip(ops, (expanded, transposed, sliced), strict=True):
        _check(op.outputs[0], tensor, rel=1e-6)


@pytest.mark.parametrize("backend", ["auto", "compiled", "eager"])
def test_nonfinite_counts_and_fp16_norm_that_would_overflow(tmp_path, backend):
    big = torch.full((4096,), 60000.0, dtype=torch.float16)  # finite; fp16 sum of squares overflows
    assert torch.isinf(torch.linalg.vector_norm(big))  # ... as computed in fp16
    bad = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    bad[[3, 50, 999]] = float("nan")
    bad[[7, 8]] = float("inf")
    bad[100] = float("-inf")
    near_max = torch.full((64,), torch.finfo(torch.float32).min)  # an attention mask's fill
    ints = torch.arange(-5, 12)
    flags = torch.tensor([True, False, True])
    cplx = torch.randn(10, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    with probe.mode("stats", out=tmp_path / "r", stats_backend=backend, ops=["aten.clone.default"]):
        tensors = [t.clone() for t in (big, bad, near_max, ints, flags, cplx)]
    records = [op.outputs[0] for op in probe.load(tmp_path / "r").ops(0)]
    stats = records[0].stats
    assert math.isfinite(stats["norm"])
    assert stats["norm"] == pytest.approx(60000.0 * 64.0, rel=1e-6)
    assert stats["nan"] == 0 and stats["inf"] == 0
    bad_stats = records[1].stats
    assert bad_stats["nan"] == 3 and bad_stats["inf"] == 3
    assert records[1].finite is False
    # Finite values at the top of fp32's range: the norm and mean stay finite.
    mask_stats = records[2].stats
    assert math.isfinite(mask_stats["norm"]) and math.isfinite(mask_stats["mean"])
    assert mask_stats["norm"] == pytest.approx(abs(torch.finfo(torch.float32).min) * 8.0, rel=1e-6)
    assert mask_stats["mean"] == pytest.approx(torch.finfo(torch.float32).min, rel=1e-6)
    for record, tensor in zip(records[3:], tensors[3:], strict=True):
        _check(record, tensor, rel=1e-6)
