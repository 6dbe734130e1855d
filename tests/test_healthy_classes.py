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


class _Scores(torch.nn.Module):
    """Attention-like scores of the tokens against each other (``scores``), read through a
    projection of the keys' axis (``out``); subclasses mask or pad them in between."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(TOKENS, WIDTH)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) @ x.transpose(0, 1)


class _MaskFill(_Scores):
    """Attention scores masked with ``finfo(float32).min`` made in the scores' dtype: -inf in
    bf16, whose largest value (3.39e38) is below it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.scores(x)
        fill = torch.tensor(torch.finfo(torch.float32).min, dtype=scores.dtype)
        causal = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
        return self.out(torch.where(causal, scores, fill).softmax(-1))


class _PaddedScores(_Scores):
    """Scores written into part of a buffer filled with -inf (padding keys no token sees, as
    DeepSeek-V4's compressor pads), widened before their softmax: under autocast the widening
    copies the bf16 buffer, in fp32 it is no op and the softmax reads the buffer itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.scores(x)
        padded = scores.new_full((TOKENS, TOKENS + 8), -math.inf)
        padded[:, :TOKENS] = scores
        return self.out(padded.float().softmax(-1)[:, :TOKENS])


class _AssembledKeys(torch.nn.Module):
    """Multi-head latent attention's keys: a projection (fp16 under autocast) and an fp32 rotated
    part written into one buffer of the projection's dtype, widened before the scores: under
    autocast the widening copies the buffer (an op of run B only), in fp32 it is no op."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(WIDTH, 64)
        self.nope = torch.nn.Linear(64, 16)
        self.near = torch.nn.Linear(64, 16)
        with torch.no_grad():  # their difference cancels: fp16's rounding is large relative to it
            self.near.weight.copy_(self.nope.weight * 0.98)
            self.near.bias.copy_(self.nope.bias * 0.98)
        self.q = torch.nn.Linear(WIDTH, 24)
        self.out = torch.nn.Linear(TOKENS, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(x))
        nope = self.nope(hidden) - self.near(hidden)
        keys = nope.new_empty(x.shape[0], 24)
        keys[:, :16] = nope
        keys[:, 16:] = torch.tanh(x[:, :8]) * 1e-3  # fp32 in both runs: it barely differs
        return self.out((self.q(x) @ keys.float().transpose(0, 1)).softmax(-1))


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


def test_a_buffer_filled_with_one_value_and_written_in_part_is_judged_by_its_parts(tmp_path):
    # Run A's softmax reads the buffer whose recorded source is the slice written: the rest
    # still holds the fill, so the whole's statistics are the part's with the fill's (-inf)
    # counted in. Unknown, the thresholds called run B's bf16 rounding a divergence there.
    _healthy_and_fault(tmp_path, _PaddedScores, "out")


def test_a_buffer_read_through_ops_of_one_run_is_bounded_by_all_its_written_parts(tmp_path):
    # Run B's widening copy is an op of its own: its input's difference is bounded by what the
    # matched ops upstream hand it, which were the last write alone (the fp32 part, rounded to
    # fp16 once) while the projection's part, fp16 matmuls away, differs more.
    runs = sgd_autocast_pair(tmp_path / "healthy", _AssembledKeys, torch.float16, TOKENS, WIDTH)
    report = probe.compare(*runs)
    assert report.first_divergence is None and report.ok, report.conclusion
    faulty = probe.compare(*sgd_autocast_pair(tmp_path / "fault", _AssembledKeys, torch.float16, TOKENS,
                                              WIDTH, "out"))
    d = faulty.divergence
    assert d is not None and d.step == 1 and d.op.module == "out", faulty.conclusion


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



class _CountingRouter(torch.nn.Module):
    """JetMoE's top-k gating: the router's logits cast to float (a cast only run B makes: run A's
    are float already), then each expert's load counted by a cast of the gates to integers."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, 4, bias=False)
        self.experts = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x).float()
        top, chosen = logits.topk(2, dim=1)
        gates = torch.softmax(top, dim=1).type_as(x)
        load = torch.zeros_like(logits).scatter(1, chosen, 1).long().sum(0)
        balance = load.max() - load.min()
        return self.out(self.experts(x) * gates[:, :1] + balance)


def test_a_cast_to_integers_is_not_paired_with_a_cast_to_float_only_one_run_makes(tmp_path):
    # Paired by id, run A's first cast (to int64, the load) was run B's first (to float, the
    # logits): the top-k reading B's logits then read a value of another op than run A's, the pair
    # was refused, and run B's top-k was judged as an unmatched producer of the logits.
    _healthy_and_fault(tmp_path, _CountingRouter, "out")


class _SplitMixing(torch.nn.Module):
    """Hyper-connection weights (HunYuan's): one parameter split into a scale near 1 and a mixing
    term near 1e-3, so a difference of the whole is a thousand times larger relative to its
    small part."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.mix = torch.nn.Parameter(torch.cat([torch.full((4,), 1.1), torch.full((4,), 1e-3)]))
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, mixing = self.mix.split(4)
        h = self.inp(x)
        return self.out(h * scale.repeat(4) + h.roll(1, -1) * mixing.repeat(4))


def test_a_split_of_a_parameter_is_judged_by_its_smallest_part(tmp_path):
    # Step 1's split reads the parameter step 0 updated: its statistics moved by 1e-7 relative,
    # the small part by 1e-5, all of it the update's rounding. A split computes nothing: the
    # whole's difference may sit in the part it selects.
    _healthy_and_fault(tmp_path, _SplitMixing, "out")


EXPERTS = 64


class _JitteredMixer(torch.nn.Module):
    """PhiMoE's sparse mixer: scores within a random jitter of the best are kept. The jitter is
    ``rand_like`` of the scores: fp32 in run A, fp16 under autocast in run B (64 experts, so that
    the draw, 4096 numbers, takes the generator's vectorized path for fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, EXPERTS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x)
        best = scores.max(-1, keepdim=True).values
        kept = (best - scores) <= 0.5 * torch.rand_like(scores)
        return scores.masked_fill(~kept, -math.inf).softmax(-1).float()


class _Jittered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _JitteredMixer()
        self.experts = torch.nn.Linear(WIDTH, EXPERTS * WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.mixer(x)
        experts = self.experts(x).view(x.shape[0], EXPERTS, WIDTH)
        return self.out((gates.unsqueeze(-1) * experts).sum(1))


def test_random_numbers_drawn_in_another_dtype_are_no_divergence(tmp_path):
    # The generator draws other numbers for fp16 than for fp32 from the same state (bf16's are
    # fp32's rounded, on this CPU): no numeric bound relates the two draws. Before, rand_like was
    # judged by 'propagation' from its input's rounding: within the bound here by the scale of its
    # 32x allowance, beyond it in PhiMoE's router (the zoo's fp16-autocast pair, 0.061 > 0.035).
    # What reads the draw inside the mixer is routed, never a pass; a fault after it is found.
    report = probe.compare(*sgd_autocast_pair(tmp_path / "healthy", _Jittered, torch.float16, TOKENS, WIDTH))
    assert report.first_divergence is None and report.ok, report.conclusion
    drawn = [c for c in report.comparisons if c.a is not None and c.a.name == "aten.rand_like.default"]
    assert drawn and all(c.rule == "routing" and c.verdict == "warning" for c in drawn), drawn
    faulty = probe.compare(*sgd_autocast_pair(tmp_path / "fault", _Jittered, torch.float16, TOKENS, WIDTH,
                                              "out"))
    d = faulty.divergence
    assert d is not None and d.step == 1 and d.op.module == "out", faulty.conclusion


class _NearlyUniformValues(torch.nn.Module):
    """Attention whose values barely differ between tokens (a shared row plus 1% of a
    projection): the gradient of each probability is nearly its row's mean, and softmax's
    backward, ``y * (g - sum(y * g))``, cancels down to 1% of its terms."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.shared = torch.nn.Parameter(torch.randn(WIDTH))
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = (self.q(x) @ self.k(x).transpose(0, 1) / WIDTH**0.5).softmax(-1)
        return self.out(probs @ (self.shared + 0.01 * self.v(x)))


def test_softmax_backward_that_cancels_is_judged_by_its_terms(tmp_path):
    # bf16 rounds the gradient of the probabilities by 0.4%; the backward's result is 1% of its
    # terms, so it differs by tens of percent. Before: the 32x allowance for an op of no known
    # condition (CPM-Ant's attention under a bf16 model and fp16 autocast, 0.75 against 0.51).
    _healthy_and_fault(tmp_path, _NearlyUniformValues, "out")


class _RoutedScores(torch.nn.Module):
    """Tokens routed on near-tied logits (bf16 flips some choices), then causal scores of the
    routed values: in run B the causal mask is rolled by one key from step 1 (a mask shift)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, 4, bias=False)
        self.experts = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.out = torch.nn.Linear(TOKENS, WIDTH)
        self.shifted = False
        with torch.no_grad():
            self.router.weight[1] = self.router.weight[0] * (1 + 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).float().topk(1, dim=-1).indices.reshape(-1)
        picked = self.experts(x).view(x.shape[0], 4, WIDTH)[torch.arange(x.shape[0]), chosen]
        causal = torch.full((TOKENS, TOKENS), -math.inf).triu(1)
        if self.shifted:
            causal = causal.roll(1, dims=-1)
        return self.out((picked @ picked.transpose(0, 1) + causal).softmax(-1))


def test_a_mask_one_run_rolls_is_found_inside_a_routing_that_differs(tmp_path):
    # What reads a routing that differs is judged by no numeric bound; a mask rolled in run B only
    # is read there too, and moving values to other positions is no precision's doing.
    runs = []
    for name, autocast in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = _RoutedScores()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1))
        with probe.mode("stats", out=tmp_path / name, model=model) as session:
            for step in range(2):
                model.shifted = autocast and step == 1
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                session.step()
        runs.append(tmp_path / name)
    report = probe.compare(*runs)
    assert any(c.rule == "routing" and c.step == 1 for c in report.comparisons), "no routing differs"
    d = report.divergence
    assert d is not None and (d.step, d.op.name) == (1, "aten.roll.default"), report.conclusion
