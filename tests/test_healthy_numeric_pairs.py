"""Healthy numeric pairs the zoo called divergent outside bf16 autocast (issue 33): fp32 against
fp16 autocast, a bf16 model, gradient accumulation, one thread. One tiny model per class; each
pair is no divergence, and a fault planted in it is still found at its module and step."""

from __future__ import annotations

import torch

import probe
from tests.conftest import sgd_autocast_pair

TOKENS, WIDTH = 32, 16


class _TinyProducts(torch.nn.Module):
    """Products of two small activations (1e-4 each, 16 terms: about 1e-7), below fp16's
    smallest normal (6e-5), as a Mamba2 mixer's chunked scan makes them, added to a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        small = (h * 1e-4).view(2, TOKENS // 2, WIDTH)
        products = torch.bmm(small, small.transpose(1, 2))  # fp16 under autocast: subnormal
        return self.out(h + products.sum(-1).reshape(TOKENS, 1))


def _fp16_pair(root, build, fault=None):
    return sgd_autocast_pair(root, build, torch.float16, TOKENS, WIDTH, fault, widen_loss=True)


def test_fp16_results_below_the_normal_range_round_absolutely(tmp_path):
    # The bmm's fp16 result (rms 1e-8) is a few multiples of fp16's smallest subnormal (6e-8):
    # its statistics differ from fp32's by 20-100%, all of it rounding. Judged relatively (4 ULPs
    # of its terms) it was a divergence entering at the bmm.
    report = probe.compare(*_fp16_pair(tmp_path / "healthy", _TinyProducts))
    assert report.first_divergence is None, report.conclusion
    assert "fp16 autocast" in report.conclusion
    bmm = [c for c in report.comparisons if c.a is not None and c.a.name == "aten.bmm.default"
           and c.a.phase == "forward"]
    assert bmm and all(c.b is not None and c.b.outputs[0].dtype == "float16" for c in bmm)
    faulty = probe.compare(*_fp16_pair(tmp_path / "fault", _TinyProducts, "inp"))
    d = faulty.divergence
    assert d is not None and d.step == 1 and d.op.module == "inp", faulty.conclusion


def test_a_grouped_gemm_sums_its_contracted_dimension():
    # A mixture of experts' _grouped_mm was judged as one term per element: its weight gradient
    # (tokens summed per expert) in a 1-thread run against a 2-thread run differed by 9.7e-6 in
    # granitemoe against a bound of 5.6e-6 (4 eps over 1 term per run, plus the inputs'). Each
    # element sums its group's rows, up to all of them: the forward over the features, the weight
    # gradient over the tokens.
    from probe.vocabulary.rounding import reduction_length

    tokens, features, out, experts = 64, 16, 8, 4
    offs = torch.tensor([13, 30, 47, 64], dtype=torch.int32)
    x, w = torch.randn(tokens, features), torch.randn(experts, features, out)
    forward = torch._grouped_mm(x, w, offs)
    assert reduction_length("aten._grouped_mm.default", [x, w, offs]) == features
    grad = torch.randn_like(forward)
    weight_grad = torch._grouped_mm(x.t(), grad, offs)  # (experts, features, out)
    assert weight_grad.shape == (experts, features, out)
    assert reduction_length("aten._grouped_mm.default", [x.t(), grad, offs]) == tokens


def test_a_convolution_sums_its_input_channels_and_kernel():
    # Convolutions were judged as one term per element: under fp16 autocast the zoo's bit, pvt,
    # pvt_v2 and mobilevit were 'propagation' at a convolution (4 ULPs where each output sums
    # in_channels x kernel products). The counts are checked against the real ops' sums: an
    # output element of ones-by-ones is the number of terms it sums.
    from probe.vocabulary.rounding import reduction_length

    for groups in (1, 4):
        x, w = torch.ones(2, 8, 6, 6), torch.ones(16, 8 // groups, 3, 3)
        y = torch.nn.functional.conv2d(x, w, groups=groups)  # no padding: every term is a product of ones
        assert reduction_length("aten.convolution.default", [x, w]) == int(y.max())
        grad = torch.ones_like(y)
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, x, w, [16], [1, 1], [0, 0], [1, 1], False, [0, 0], groups, [True, True, True])
        name = "aten.convolution_backward.default"
        assert reduction_length(name, [grad, x, w], 0) == int(grad_input.max())  # the centre's
        assert reduction_length(name, [grad, x, w], 1) == int(grad_weight.max())
        assert reduction_length(name, [grad, x, w], 2) == int(grad_bias.max())


def test_a_producer_that_passes_on_statistics_hands_on_its_difference(tmp_path):
    # Two layouts of one input make the sum reduce in another order (as another thread count
    # does): its results differ by a few ULPs. Concatenated with a constant that holds the
    # maximum and copied into a buffer, the statistics pass, with the max statistic equal.
    # That pass was read as no difference at all ("max_rel" 0 is bit-identical data's, not
    # the max statistic's): the slice after it was judged as if its input agreed exactly, and
    # in rwkv's backward (threads-1) a slice of such a buffer was called the divergence.
    x = torch.randn(65536, 4, generator=torch.Generator().manual_seed(0))
    for name, layout in (("a", x), ("b", x.t().contiguous().t())):
        with probe.mode("stats", out=tmp_path / name) as session:
            whole = torch.empty(5).copy_(torch.cat([layout.sum(0), torch.full((1,), 1000.0)]))
            whole[:4] * 2  # a part of a buffer written in place, as autograd's copy_ writes one
            session.step()
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    by_name = {c.a.name: c for c in report.comparisons}
    written, sliced = by_name["aten.copy_.default"], by_name["aten.slice.Tensor"]
    assert written.verdict == "pass" and written.outputs[0].metrics["max_rel"] == 0
    assert written.outputs[0].metrics["norm_rel"] > 0 or written.outputs[0].metrics["mean_rel"] > 0
    assert sliced.input_error > 0  # the pass's difference, within rounding, not none
    assert report.first_divergence is None, report.conclusion
