"""A non-finite value is reported where it becomes a fault (it reaches the loss, a gradient or
a parameter), not where an intentional -inf mask is built; non-finite parameters and
gradients are named; magnitude rankings leave out integer tensors and mask fills.

On HF GPT-2 in fp16 with its default attention: on CPU, SDPA builds its causal mask with
``aten.scalar_tensor(-inf)`` and softmax turns it into zeros."""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import tiny_gpt2

import probe
from probe.analysis.summary import summarize_step
from probe.cli import main

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

VOCAB = 128


def _gpt2() -> torch.nn.Module:
    return tiny_gpt2(vocab_size=VOCAB, n_layer=3, bos_token_id=0, eos_token_id=0).to(torch.float16)


def _train(model: torch.nn.Module, out, steps: int = 1, **options) -> probe.Run:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=out, model=model, **options) as session:
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return probe.load(out)


def test_healthy_fp16_gpt2_has_no_nonfinite_fault_despite_its_inf_mask(tmp_path):
    run = _train(_gpt2(), tmp_path / "r")
    ops = run.ops(0)
    # The mask is there, non-finite: it is absorbed by softmax, so it is no fault.
    masks = [op for op in ops if op.outputs_finite is False]
    assert any(op.name == "aten.scalar_tensor.default" for op in masks)
    assert run.first_nonfinite() is None
    assert run.nonfinite_origins(0) == []
    checks = run.nonfinite_parameters(0)
    assert checks is not None and checks.parameters == ([], 0) and checks.gradients == ([], 0)
    assert not any("foreach_norm" in op.name for op in ops)  # the probe's own checks are not traced


def test_overflow_planted_in_c_fc_is_the_first_nonfinite_op(tmp_path, capsys):
    model = _gpt2()
    with torch.no_grad():
        model.transformer.h[2].mlp.c_fc.weight[0].fill_(6e4)  # fp16 addmm overflows
    run = _train(model, tmp_path / "r")
    bad = run.first_nonfinite()
    assert bad is not None
    assert (bad.name, bad.module, bad.phase) == ("aten.addmm.default", "transformer.h.2.mlp.c_fc", "forward")
    assert bad.inputs_finite is True  # its weight and bias come from outside the step: measured
    assert run.nonfinite_origins(0)[0].id == bad.id
    # Every gradient the optimizer was about to apply is poisoned, named by parameter.
    names, count = run.nonfinite_parameters(0).gradients
    assert "transformer.h.2.mlp.c_fc.weight" in names and count == len(names)
    assert main(["summary", str(tmp_path / "r")]) == 0
    shown = capsys.readouterr().out
    assert "transformer.h.2.mlp.c_fc" in shown.split("first non-finite op:")[1].splitlines()[0]
    assert "gradients non-finite before the optimizer step" in shown


def test_nan_in_embedding_weight_is_named_at_step_start_and_inputs_not_finite(tmp_path, capsys):
    model = _gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[:, 3] = float("nan")  # every token's embedding
    run = _train(model, tmp_path / "r", steps=2)
    checks = run.nonfinite_parameters(0)
    assert checks.parameters == (["transformer.wte.weight"], 1)
    bad = run.first_nonfinite()
    assert (bad.step, bad.name, bad.module) == (0, "aten.embedding.default", "transformer.wte")
    assert bad.inputs_finite is not True
    assert main(["summary", str(tmp_path / "r")]) == 0
    assert "parameters non-finite at the step's start: 1 (transformer.wte.weight)" in capsys.readouterr().out


def test_gradients_poisoned_in_backward_are_named_before_the_optimizer_step(tmp_path):
    model = _gpt2()
    # A backward-only fault: the gradient of ln_f's output turns NaN, the forward stays finite.
    model.transformer.ln_f.register_full_backward_hook(
        lambda module, grad_in, grad_out: (grad_in[0] * float("nan"),))
    run = _train(model, tmp_path / "r", steps=2)
    assert run.nonfinite_parameters(0).parameters == ([], 0)
    names, count = run.nonfinite_parameters(0).gradients
    assert "transformer.h.0.mlp.c_fc.weight" in names and count == len(names)
    assert "lm_head.weight" not in names and "transformer.ln_f.weight" not in names
    bad = run.first_nonfinite(step=0)
    assert bad is not None and bad.phase == "backward"
    # SGD applied them: the next step starts with those parameters non-finite.
    assert "transformer.h.0.mlp.c_fc.weight" in run.nonfinite_parameters(1).parameters[0]


def test_inputs_finite_is_none_when_an_input_is_unknown(tmp_path):
    run = _train(_gpt2(), tmp_path / "r", inputs=False)
    embedding = next(op for op in run.ops(0) if op.name == "aten.embedding.default")
    assert embedding.inputs[0].stats is None  # the weight, read from outside the step, not recorded
    assert embedding.inputs_finite is None


def test_inputs_from_outside_the_step_are_measured_by_default(tmp_path):
    model = _gpt2()
    weight = model.transformer.wte.weight.detach().double().clone()
    run = _train(model, tmp_path / "r")
    embedding = next(op for op in run.ops(0) if op.name == "aten.embedding.default")
    assert embedding.inputs[0].source is None and embedding.inputs_finite is True
    assert embedding.inputs[0].stats["norm"] == pytest.approx(float(weight.norm()), rel=1e-7)


def test_magnitude_rankings_skip_integer_tensors_and_mask_fills(tmp_path):
    from probe.demo.train import DemoTraining, train

    training = DemoTraining()
    train(training, 1, session=probe.mode("stats", out=tmp_path / "r", model=training.model))
    run = probe.load(tmp_path / "r")
    summary = summarize_step(run, 0, 0, top=5)
    for rows in (summary.largest_abs_max, summary.largest_norm):
        assert len(rows) == 5
        for row in rows:
            assert all(t.dtype.startswith(("float", "bfloat")) for t in row.op.outputs), row.op.id
            assert "masked_fill" not in row.op.name and row.value < 1e30, row.op.id
    # The fills are there, ranked out: the causal mask of finfo.min and the token ids.
    names = {op.name for op in run.ops(0)}
    assert {"aten.masked_fill.Scalar", "aten.randint.low_generator"} <= names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_parameter_checks_are_exact_at_the_edges_of_the_range(tmp_path, dtype):
    """Finite values at +-max of the dtype are not reported; a lone -Inf, +Inf or NaN is."""
    top = torch.finfo(dtype).max
    model = torch.nn.Module()
    model.edges = torch.nn.Parameter(torch.tensor([top, top, -top], dtype=dtype))
    model.top = torch.nn.Parameter(torch.tensor([top, top], dtype=dtype))  # max + min overflows fp32
    model.minus_inf = torch.nn.Parameter(torch.tensor([1.0, -math.inf], dtype=dtype))
    model.plus_inf = torch.nn.Parameter(torch.tensor([math.inf, -1.0], dtype=dtype))
    model.nan = torch.nn.Parameter(torch.tensor([0.0, math.nan], dtype=dtype))
    with probe.mode("stats", out=tmp_path / "run", model=model) as session:
        torch.ones(1) * 2
        session.step()
    found = probe.load(tmp_path / "run").nonfinite_parameters(step=0)
    names, count = found.parameters
    assert sorted(names) == ["minus_inf", "nan", "plus_inf"] and count == 3
