"""Distribution of values against their dtype's range: shares, log2 histograms, fp8 scales."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.modes.statistics.distribution import (
    DistributionRows,
    dtype_range,
    exponent_counts,
    read_histograms,
    share_counts,
)
from probe.modes.stats.fp8_scales import Fp8Scales, scale_arguments, scales_json


def _planted(dtype: torch.dtype, n: int = 1000, seed: int = 0) -> tuple[torch.Tensor, dict[str, int]]:
    """Random normal values with known numbers of zeros, subnormals and values near the max."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    planted = {"zeros": 37, "underflow": 11, "near_overflow": 5}
    x[:37] = 0
    x[37:48] = info.tiny * torch.linspace(0.05, 0.9, 11)  # subnormals of dtype
    x[48:53] = torch.tensor([0.6, -0.7, 0.8, -0.99, 1.0]) * info.max
    x[53] = info.max * 0.49  # just below the factor-2 line: not near overflow
    x[54] = -info.tiny  # the smallest normal is not an underflow
    x[55] = math.inf
    x[56] = math.nan
    return x.to(dtype), planted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("histogram", [False, True])
def test_shares_of_planted_values(dtype, histogram):
    x, planted = _planted(dtype)
    rows = DistributionRows(histogram=histogram)
    rows.add(x, 1)
    rows.add(x[::2], 0)  # a strided view: read in place
    shares, hist = rows.end_step().to_host(3)
    assert (hist is not None) == histogram
    assert np.isnan(shares[2]).all()  # a row nothing was counted for stays unknown
    for name, column in zip(("zeros", "underflow", "near_overflow"), range(3), strict=True):
        assert shares[1, column] == planted[name] / x.numel(), name
    # torch recomputation on the values, as fp64
    w = x[::2].double().abs()
    r = torch.finfo(dtype)
    expected = [(w == 0).sum(), ((w > 0) & (w < r.tiny)).sum(), ((w > r.max / 2) & w.isfinite()).sum()]
    assert shares[0].tolist() == [int(e) / w.numel() for e in expected]


def test_histogram_matches_floor_log2_and_counts_every_element():
    x, _ = _planted(torch.bfloat16)
    x = x.reshape(10, 100)[:, None, :].expand(10, 3, 100)  # broadcast: each value counted 3 times
    rows = DistributionRows(histogram=True)
    rows.add(x, 0)
    _, entries = rows.end_step().to_host(1)
    h = read_histograms(entries)[0]
    assert h["zero"] + h["nonfinite"] + sum(h["exponents"].values()) == x.numel()
    w = x.double().abs().reshape(-1)
    finite = w[(w > 0) & w.isfinite()]
    exponents = torch.floor(torch.log2(finite)).to(torch.int64)
    expected = dict(zip(*[t.tolist() for t in torch.unique(exponents, return_counts=True)], strict=True))
    assert h["exponents"] == expected
    assert h["zero"] == 3 * 37 and h["nonfinite"] == 3 * 2
    r = dtype_range(torch.bfloat16)
    assert min(h["exponents"]) >= r.low and max(h["exponents"]) == r.high == 127


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float64])
def test_every_exponent_of_a_dtype_lands_in_its_own_bin(dtype):
    r = dtype_range(dtype)
    # 2**e for every exponent the dtype has, subnormals included, and the largest value
    values = [2.0**e for e in range(r.low, r.high + 1)] + [torch.finfo(dtype).max, 0.0]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    counts = exponent_counts(x)
    assert counts.shape == (r.bins + 2,)
    assert counts[0] == 1 and counts[1] == 0
    assert counts[2:-1].tolist() == [1] * (r.bins - 1) and counts[-1] == 2
    zeros, under, near = share_counts(x).tolist()
    assert (zeros, under, near) == (1, r.normal - r.low, 2)


def test_integer_tensors_have_only_a_zeros_share():
    rows = DistributionRows(histogram=True)
    rows.add(torch.tensor([0, 3, 0, -7]), 0)
    rows.add(torch.tensor([True, False]), 1)
    shares, entries = rows.end_step().to_host(2)
    assert shares[0, 0] == 0.5 and np.isnan(shares[0, 1:]).all()
    assert shares[1, 0] == 0.5 and np.isnan(shares[1, 1:]).all()
    assert entries is not None and len(entries) == 0  # no histogram of integers


def test_complex_tensors_count_their_parts():
    rows = DistributionRows()
    rows.add(torch.tensor([1 + 0j, 0 + 0j], dtype=torch.complex64), 0)
    shares, _ = rows.end_step().to_host(1)
    assert shares[0].tolist() == [0.75, 0.0, 0.0]


def test_tensorboard_reads_the_histograms(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from probe.exporters.tensorboard_events import ScalarEventWriter

    writer = ScalarEventWriter(tmp_path)
    writer.add_histograms(4, [("activation/mlp/output/log2", np.array([-3, 0, 2]), np.array([5, 7, 1]))])
    writer.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    (event,) = acc.Histograms("activation/mlp/output/log2")
    h = event.histogram_value
    assert event.step == 4 and h.num == 13 and h.min == -3 and h.max == 3
    assert list(h.bucket_limit) == [-3, -2, 1, 3] and list(h.bucket) == [0, 5, 7, 1]


def test_scaled_mm_scales_are_found_by_schema_name():
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(4.0)
    func = torch.ops.aten._scaled_mm.default
    args = (a, b, scale_a, scale_b)
    kwargs = {"scale_result": torch.tensor(2.0), "out_dtype": torch.bfloat16}
    found = scale_arguments(func, args, kwargs, [a, b, scale_a, scale_b, kwargs["scale_result"]])
    assert [name for name, _ in found] == ["scale_a", "scale_b", "scale_result"]
    scales = Fp8Scales()
    scales.add(7, func, args, kwargs, [a, b, scale_a, scale_b])
    scale_a.fill_(100.0)  # delayed scaling updates scales in place: the value at the op is kept
    (row,) = scales_json(scales.take())
    assert row["i"] == 7
    assert row["scales"]["scale_a"] == {"shape": [], "values": [0.5], "min": 0.5, "max": 0.5}
    assert row["scales"]["scale_result"]["values"] == [2.0]
    # an fp32 matmul with a tensor argument named like a scale is no fp8 op
    x = torch.randn(4, 4)
    assert scale_arguments(torch.ops.aten.mm.default, (x, x), {}, [x, x]) == []


@pytest.mark.slow  # compiles two kernels per dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_tensors_take_the_compiled_pass_with_the_same_counts(dtype):
    x, planted = _planted(dtype, n=1 << 16)
    rows = DistributionRows(histogram=False)
    rows.add(x, 0)
    rows.add(x.reshape(256, 256).t(), 1)  # a transpose: read in storage order
    hist_rows = DistributionRows(histogram=True)
    hist_rows.add(x, 0)
    shares, _ = rows.end_step().to_host(2)
    from_hist, entries = hist_rows.end_step().to_host(1)
    expected = [planted[k] / x.numel() for k in ("zeros", "underflow", "near_overflow")]
    assert shares[0].tolist() == shares[1].tolist() == from_hist[0].tolist() == expected
    h = read_histograms(entries)[0]
    w = x.double().abs()
    finite = w[(w > 0) & w.isfinite()]
    exponents = torch.floor(torch.log2(finite)).to(torch.int64)
    assert h["exponents"] == dict(zip(*[t.tolist() for t in torch.unique(exponents, return_counts=True)],
                                      strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_eager_and_compiled_counts_agree(dtype, monkeypatch):
    import probe.modes.statistics.distribution as distribution

    x, _ = _planted(dtype, n=3000)
    compiled = share_counts(x), exponent_counts(x)
    monkeypatch.setattr(distribution, "CPU_COMPILED_MIN_NUMEL", 1 << 40)  # the eager reductions
    eager = share_counts(x), exponent_counts(x)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
