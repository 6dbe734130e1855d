"""Autocast's policy is recorded with each forward op, and compare judges casts by it: a cast
autocast did not make is never excused as autocast's, an op autocast keeps in float32 computed
lower inside an autocast region is lowered precision, and a model's own cast back to the dtype
autocast gave its value is no finding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import probe

HIDDEN, VOCAB = 16, 32


class _RMSNorm(nn.Module):
    """HF-style: computes in float32, returns ``.to(input_dtype)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class _Attention(nn.Module):
    def __init__(self, fault: str | None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.q_norm, self.k_norm = _RMSNorm(), _RMSNorm()
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_norm(self.q(x)), self.k_norm(self.k(x)), self.v(x)
        scores = (q @ k.transpose(-1, -2)).float() / HIDDEN**0.5  # the model's own upcast
        if self.fault == "softmax":  # rounds the logits to bf16 before the exp
            probs = torch.softmax(scores, -1, dtype=torch.bfloat16)
        elif self.fault == "fp16-softmax":  # exp / sum in fp16 of bf16 scores: overflows past 11
            e = (q @ k.transpose(-1, -2) / HIDDEN**0.5).half().exp()
            probs = (e / e.sum(-1, keepdim=True)).to(v.dtype)
        else:
            probs = torch.softmax(scores, -1).to(v.dtype)
        return self.o(probs @ v)


class _Mlp(nn.Module):
    def __init__(self, fault: str | None) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault == "matmul":  # an explicit bf16 matmul, in a run without autocast
            w, b = self.up.weight, self.up.bias
            h = F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16), b.to(torch.bfloat16)).float()
        else:
            h = self.up(x)
        return self.down(F.gelu(h))


class _ScaledLinear(nn.Linear):
    """A linear whose output is 1.25 times what it should be."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.25


class _Model(nn.Module):
    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn, self.mlp = _Attention(fault), _Mlp(fault)
        self.head = (_ScaledLinear if fault == "head" else nn.Linear)(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.head(x)


def _run(out, autocast: bool, fault: str | None = None, dtype: torch.dtype = torch.bfloat16,
         model_dtype: torch.dtype | None = None, changed: str | None = None):
    """Two AdamW steps of the tiny model (seeded alike in every run), under autocast to ``dtype``,
    its parameters in ``model_dtype`` when given. The loss reads the logits widened to float32
    (fault "loss": cast back to bf16 first). ``changed``: a parameter one element of which is
    x1.125 between the steps, where nothing traces it."""
    torch.manual_seed(0)
    model = _Model(fault)
    if model_dtype is not None:
        model = model.to(model_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=out, model=model) as session:
        for step in range(2):
            ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
            if changed is not None and step == 1:
                with session.paused(), torch.no_grad():
                    model.get_parameter(changed).view(-1)[3] *= 1.125
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                logits = model(ids).float()
                if fault == "loss":
                    logits = logits.to(torch.bfloat16)
                loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return out


def test_each_forward_op_carries_the_autocast_policy_it_ran_under(tmp_path):
    run = probe.load(_run(tmp_path / "b", autocast=True))
    assert run.step_info(0).manifest["autocast"] == [{}, {"cpu": "bfloat16"}]
    ops = run.ops(0)
    assert {op.autocast["cpu"] for op in ops if op.phase == "forward" and op.module} == {"bfloat16"}
    assert all(op.autocast is None for op in ops if op.phase in ("backward", "optimizer"))
    plain = probe.load(_run(tmp_path / "a", autocast=False))
    assert plain.step_info(0).manifest["autocast"] == [{}]
    assert {str(op.autocast) for op in plain.ops(0) if op.phase == "forward"} == {"{}"}


def test_an_explicit_bf16_matmul_in_an_fp32_pair_is_lowered_precision(tmp_path):
    # Neither run uses autocast: the casts feeding the matmul are the model's, never autocast's.
    report = probe.compare(_run(tmp_path / "a", False), _run(tmp_path / "b", False, fault="matmul"))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step) == ("lowered precision", "mlp", 0)
    assert "outside any autocast region" in d.comparison.message


def test_a_softmax_computed_in_bf16_inside_an_autocast_region_is_lowered_precision(tmp_path):
    # softmax(scores, dtype=bf16) rounds the float32 logits to bf16 before the exp. The cast puts
    # back the dtype the scores' matmul gave them, as a norm's output cast does, but here it decides
    # the precision of a softmax, which autocast leaves at its input's: it is the lowering.
    report = probe.compare(_run(tmp_path / "a", False), _run(tmp_path / "b", True, fault="softmax"))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step) == ("lowered precision", "attn", 0)
    assert d.op_b.name == "aten._to_copy.default"
    assert "precision lowered in attn: float32 -> bfloat16 by an explicit cast" in d.comparison.message


def test_a_loss_cast_back_to_bf16_in_a_bf16_model_is_lowered_precision(tmp_path):
    # Every run widens the logits to float32 for the loss; in a bf16 model a cast back to bf16
    # before cross entropy undoes that. B's model-wide dtype explains its bf16 results, but not a
    # cast that decides the precision of a loss after the program widened its input for it.
    a = _run(tmp_path / "a", False)
    healthy = probe.compare(a, _run(tmp_path / "h", False, model_dtype=torch.bfloat16))
    assert healthy.first_divergence is None, healthy.conclusion
    report = probe.compare(a, _run(tmp_path / "b", False, fault="loss", model_dtype=torch.bfloat16))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step) == ("lowered precision", "", 0)
    assert "float32 -> bfloat16 by an explicit cast" in d.comparison.message


def test_a_weight_changed_between_steps_of_a_bf16_model_is_named_at_its_first_reader(tmp_path):
    # One element of mlp.down's weight x1.125 (a bf16 mantissa flip) leaves the transposed weight
    # within bf16's thresholds of run A's, a pass by magnitude; but run B's step 0 never left that
    # value, which no precision explains: it enters at the op reading it first (the weight's `t`).
    report = probe.compare(_run(tmp_path / "a", False),
                           _run(tmp_path / "b", False, model_dtype=torch.bfloat16, changed="mlp.down.weight"))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step) == ("outside input", "mlp.down", 1)
    assert "changed between the steps" in d.comparison.message


def test_a_qk_norm_casting_back_under_autocast_is_no_divergence(tmp_path):
    report = probe.compare(_run(tmp_path / "a", False), _run(tmp_path / "b", True))
    assert report.first_divergence is None and report.ok, report.conclusion
    assert report.conclusion == "no divergence: differences consistent with bf16 autocast"


def test_a_bf16_matmul_under_fp16_autocast_is_lowered_precision(tmp_path):
    # fp16 autocast rounds a matmul's inputs to 11 bits of mantissa; the model's own cast to bf16
    # before it rounds them to 8: coarser than the policy recorded with the op, so not autocast's.
    report = probe.compare(_run(tmp_path / "a", False),
                           _run(tmp_path / "b", True, fault="matmul", dtype=torch.float16))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step) == ("lowered precision", "mlp", 0)
    assert "float32 -> bfloat16 by an explicit cast" in d.comparison.message
    assert "coarser than the autocast region's float16" in d.comparison.message


def test_an_fp16_autocast_pair_is_no_divergence(tmp_path):
    report = probe.compare(_run(tmp_path / "a", False), _run(tmp_path / "b", True, dtype=torch.float16))
    assert report.first_divergence is None and report.ok, report.conclusion
    assert report.conclusion == "no divergence: differences consistent with fp16 autocast"


def test_a_scaled_output_cast_up_for_the_loss_is_blamed_on_its_module(tmp_path):
    # Under autocast the head's bf16 logits are cast up to float32 for the loss, outside any module,
    # a cast run A does not have. That cast widens, which is exact: the difference the loss reads
    # entered at the head's scaling, the other op of run B only on its way.
    report = probe.compare(_run(tmp_path / "a", False), _run(tmp_path / "b", True, fault="head"))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step, d.op_b.name) == ("unmatched producer", "head", 0, "aten.mul.Tensor")


def test_a_cast_from_bf16_to_fp16_under_bf16_autocast_narrows_the_range(tmp_path):
    # fp16 is finer than bf16 but ends at 65504: the cast makes an overflow of any score past 11
    # (exp), which bf16 autocast never makes (it casts to bf16 only). Judged by the values at step
    # 0 the fault is within bf16's rounding; by the policy it is the cast that narrows the range.
    report = probe.compare(_run(tmp_path / "a", True), _run(tmp_path / "b", True, fault="fp16-softmax"))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.rule, d.op.module, d.step) == ("lowered precision", "attn", 0)
    assert "range narrowed" in d.comparison.message and "bfloat16 -> float16" in d.comparison.message
