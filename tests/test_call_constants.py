"""The constants of a call (an eps, a fill value, an approximation's name), recorded for every op
and compared in any pair of runs: another constant is another computation at that op, whatever
each run's precision and however small its effect (issue 33: a LayerNorm's eps raised from 1e-12
to 1e-3 in a bf16 model was 'consistent with precision', its effect below bf16's rounding)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import probe
from probe.analysis.judging.arguments import of_dtype_limits
from probe.errors import ProbeError
from probe.rundir.op_record_json import decode, encode
from probe.tracer.call_constants import call_constants
from probe.vocabulary.op_class import class_of


class _Masked(nn.Module):
    """A norm with a given eps, a tanh-approximated GELU and a causal mask filled with its own
    dtype's lowest number (what each run takes from its dtype differs, and is no fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16, eps=1e-5)
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.inp(x)))
        scores = h @ h.transpose(-1, -2)
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        return self.out(scores.softmax(-1) @ h)


def _run(path, precision: str = "fp32", eps_at_step_1: float | None = None):
    torch.manual_seed(0)
    model = _Masked()
    if precision == "bf16-model":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=path, model=model) as session:
        for step in range(2):
            if step == 1 and eps_at_step_1 is not None:
                model.norm.eps = eps_at_step_1
            x = torch.randn(8, 16, generator=gen)
            if precision == "bf16-model":
                x = x.to(torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return path


def test_the_tracer_records_the_floats_and_words_of_each_call():
    info = class_of(torch.ops.aten.native_layer_norm.default)
    x = torch.randn(2, 4)
    assert call_constants(info, (x, [4], None, None, 1e-3), {}) == (("4", 1e-3),)
    add = class_of(torch.ops.aten.add.Tensor)
    assert call_constants(add, (x, 1e-6), {}) == (("1", 1e-6),)  # a Python number, unwrapped
    assert call_constants(add, (x, x), {}) == ()
    assert call_constants(add, (x, 2), {}) == ()  # integers are counts and sizes: left out
    gelu = class_of(torch.ops.aten.gelu.default)
    assert call_constants(gelu, (x,), {"approximate": "tanh"}) == (("approximate", "tanh"),)


def test_constants_survive_the_run_format_and_a_bad_form_is_named():
    record = (0, "forward::aten.masked_fill.Scalar:0", "aten.masked_fill.Scalar", "forward", "", 0, (),
              (), (), None, None, (), None, 0, (("2", float("-inf")), ("approximate", "tanh")), None)
    row = json.loads(json.dumps(encode(record)))
    assert row["const"] == {"2": {"float": "-inf"}, "approximate": "tanh"}
    assert decode(row) == record
    assert "const" not in encode((*record[:-2], (), None))  # absent when the call had none
    with pytest.raises(ProbeError, match="'const'"):
        decode({**row, "const": {"2": [1.0]}})


def test_a_changed_eps_is_found_at_its_norm_in_a_mixed_pair_however_small_its_effect(tmp_path):
    a = _run(tmp_path / "a")
    healthy = probe.compare(a, _run(tmp_path / "b", "bf16-autocast"))
    assert healthy.first_divergence is None, healthy.conclusion
    # 1e-5 -> 1e-4 on rows of unit variance: the output moves by 5e-5, far below bf16's rounding.
    report = probe.compare(a, _run(tmp_path / "eps", "bf16-autocast", eps_at_step_1=1e-4))
    d = report.divergence
    assert d is not None and (d.step, d.op.module, d.rule) == (1, "norm", "arguments"), report.conclusion
    assert d.op.name == "aten.native_layer_norm.default"
    entered = next(c for c in report.comparisons if c.enters)
    assert "argument 4: 1e-05 in run A, 0.0001 in run B" in entered.message


def test_a_limit_each_run_takes_from_its_own_dtype_is_told_from_a_changed_number():
    f32, bf16, f16 = (torch.finfo(d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert of_dtype_limits(f32.min, bf16.min) and of_dtype_limits(f16.max - 1000, f32.max - 1000)
    assert of_dtype_limits(f32.eps, bf16.eps)  # nn.RMSNorm's default eps is its input dtype's
    # Each near some limit (fp32's eps, fp16's eps), but not the same limit of two dtypes: GLM-4's
    # eps raised by the zoo.
    assert not of_dtype_limits(1.5625e-07, 1e-3) and not of_dtype_limits(1e-5, 1e-3)


def test_numbers_each_run_takes_from_its_own_dtype_are_no_difference(tmp_path):
    # The mask's fill is finfo(float32).min in run A and finfo(bfloat16).min in run B's bf16 model.
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", "bf16-model")
    fills = [{op.constants.get("2") for op in probe.Run(run).ops(0)
              if op.name == "aten.masked_fill.Scalar" and op.phase == "forward"} for run in (a, b)]
    assert fills == [{torch.finfo(torch.float32).min}, {torch.finfo(torch.bfloat16).min}]
    report = probe.compare(a, b)
    assert all(c.rule != "arguments" for c in report.comparisons), report.conclusion


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = [p(x).view(1, 64, 2, 8).transpose(1, 2) for p in (self.q, self.k, self.v)]
        mixed = torch.nn.functional.scaled_dot_product_attention(*heads, dropout_p=0.0)
        return self.o(mixed.transpose(1, 2).reshape(64, 16))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.attn(x))


def test_attention_given_no_dropout_draws_nothing_and_what_follows_it_is_judged(tmp_path):
    # SDPA may draw (its dropout), so its results in another dtype in each run were taken for random
    # numbers drawn otherwise: a routing, and what read them inside the attention was judged by no
    # bound. Given dropout_p = 0 it draws nothing: a fault in the output projection is found.
    from tests.conftest import sgd_autocast_pair

    healthy = probe.compare(*sgd_autocast_pair(tmp_path / "healthy", _Block, torch.bfloat16, 64, 16))
    assert healthy.first_divergence is None, healthy.conclusion
    assert all(c.rule != "routing" for c in healthy.comparisons), healthy.conclusion
    faulty = probe.compare(*sgd_autocast_pair(tmp_path / "fault", _Block, torch.bfloat16, 64, 16, "attn.o"))
    d = faulty.divergence
    assert d is not None and (d.step, d.op.module) == (1, "attn.o"), faulty.conclusion
