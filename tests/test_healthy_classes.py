"""Healthy fp32 vs bf16-autocast pairs the zoo called divergent, one tiny module per class
(issue 33): a buffer filled in place slice by slice, routing decided on near-tied scores, a
``finfo(float32).min`` mask fill that is -inf in bf16. Each is no divergence, and a fault
planted after it is still found at its module."""

from __future__ import annotations

import math

import torch

import probe
from tests.conftest import sgd_autocast_pair

TOKENS, WIDTH = 64, 16


class _SliceFilledQuery(torch.nn.Module):
    """Multi-head latent attention's query: a projection split into a part kept as it is and a
    part rotated by an fp32 table, written into the two slices of one ``new_empty`` buffer, read
    whole by the scores' transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, 24)
        self.k = torch.nn.Linear(WIDTH, 24)
        self.out = torch.nn.Linear(TOKENS, WIDTH)
        self.register_buffer("cos", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe = self.q(x).split([16, 8], dim=-1)
        q_pe = q_pe * self.cos  # fp32 under autocast: the buffer's parts differ in precision
        query = q_nope.new_empty(x.shape[0], 24)
        query[:, :16] = q_nope
        query[:, 16:] = q_pe
        scores = self.k(x) @ query.float().transpose(0, 1)  # float: run B's copy, run A's buffer
        return self.out(scores.softmax(-1))


class _Experts(torch.nn.Module):
    """A mixture-of-experts block on near-tied logits: ``topk`` picks each token's expert, the
    tokens are counted per expert (``histc``, ``cumsum``) and a sparse mixer masks the scores
    below expert 0's with -inf, as PhiMoE's sparse mixer does."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, 4, bias=False)
        self.experts = torch.nn.Linear(WIDTH, 4 * WIDTH)
        with torch.no_grad():  # experts 0 and 1 nearly tied: bf16 rounding flips some choices
            self.router.weight[1] = self.router.weight[0] * (1 + 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x).float()
        chosen = logits.topk(1, dim=-1).indices.reshape(-1)
        counts = torch.histc(chosen.float(), bins=4, min=0, max=3)
        offsets = torch.cumsum(counts, 0)
        kept = logits.masked_fill(logits < logits[:, :1], -math.inf).softmax(-1)
        experts = self.experts(x).view(x.shape[0], 4, WIDTH)
        picked = experts[torch.arange(x.shape[0]), chosen] * offsets[chosen].unsqueeze(-1) / x.shape[0]
        return picked * kept.gather(-1, chosen.unsqueeze(-1))


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.moe = _Experts()
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


class _MaskFill(torch.nn.Module):
    """Attention scores masked with ``finfo(float32).min`` made in the scores' dtype: -inf in
    bf16, whose largest value (3.39e38) is below it."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(TOKENS, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(0, 1)
        fill = torch.tensor(torch.finfo(torch.float32).min, dtype=scores.dtype)
        causal = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
        return self.out(torch.where(causal, scores, fill).softmax(-1))


def _pair(root, build, fault=None):
    return sgd_autocast_pair(root, build, torch.bfloat16, TOKENS, WIDTH, fault)


def _healthy_and_fault(tmp_path, build, fault_module):
    report = probe.compare(*_pair(tmp_path / "healthy", build))
    assert report.first_divergence is None and report.ok, report.conclusion
    faulty = probe.compare(*_pair(tmp_path / "fault", build, fault_module))
    d = faulty.divergence
    assert d is not None and d.step == 1 and d.op.module == fault_module, faulty.conclusion
    return report


def test_a_buffer_filled_slice_by_slice_is_judged_by_its_parts(tmp_path):
    # Read whole, the buffer's recorded source is the last slice written: its statistics are a
    # part's, the difference of the tensor read was unknown and the thresholds called the bf16
    # rounding a divergence. Its parts' statistics combined are the whole's.
    _healthy_and_fault(tmp_path, _SliceFilledQuery, "out")


def test_routing_on_near_tied_logits_differs_consistently_with_precision(tmp_path):
    # bf16 flips some tokens' expert and some scores across the mask's threshold: the counts per
    # expert, their cumulative sums and the -inf fills differ. No numeric bound relates them to
    # the logits' rounding: routing, a warning, never a pass.
    # A fault upstream of the router is no routing: found where it enters. (Downstream of the
    # block, the outputs differ by what the other choices made, 20% here: the propagation bound
    # on that difference is loose, see docs/compare.md.)
    report = _healthy_and_fault(tmp_path, _Router, "inp")
    routed = [c for c in report.comparisons if c.rule == "routing"]
    assert routed and all(c.verdict == "warning" for c in routed)
    assert any(c.a.name == "aten.cumsum.default" for c in routed)
    assert "routing differs" in report.conclusion


def test_a_float32_mask_fill_that_is_minus_inf_in_bf16_is_no_new_nonfinite_value(tmp_path):
    _healthy_and_fault(tmp_path, _MaskFill, "out")


class _FusedProjection(torch.nn.Module):
    """Attention over one fused query/key/value projection whose bias is the three biases
    concatenated (WavLM's, ``multi_head_attention_forward``'s): backward slices the fused bias's
    gradient into three, and the key's part is zero but for rounding (the softmax ignores a
    shift its row shares)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([self.q.weight, self.k.weight, self.v.weight])
        bias = torch.cat([self.q.bias, self.k.bias, self.v.bias])
        q, k, v = torch.nn.functional.linear(x, weight, bias).chunk(3, dim=-1)
        return self.out((q @ k.transpose(0, 1) / WIDTH**0.5).softmax(-1) @ v)


def test_a_slice_of_a_gradient_that_is_rounding_alone_is_judged_by_the_part_it_selects(tmp_path):
    # The fused bias's gradient differs by bf16's rounding over the whole; the key's slice of it
    # is rounding alone in both runs (1e-13 against 1e-8), a relative difference of 1. A slice
    # computes nothing: the whole's difference may all sit in the part it selects.
    _healthy_and_fault(tmp_path, _FusedProjection, "out")
