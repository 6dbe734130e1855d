"""NaN, +Inf and -Inf are counted apart, and the first non-finite op is judged by kind.

The origin of a fault is the op that made a kind (NaN, +Inf or -Inf) none of its inputs held,
whose values reach the loss, a gradient or a parameter. An intentional -inf (a mask written by
``masked_fill`` or an ``add``) that every reader absorbs never is: not even where the reader
(``exp``) makes +Inf of its own. The failing case: a softmax computed as
``exp(x) / exp(x).sum()`` without subtracting the max, in fp16, in layer 1 of an HF Qwen2 with a
causal mask, was reported at the mask's ``add`` instead of the ``exp`` that overflowed.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hf_models import tiny_qwen2

import probe
from probe.modes.stats.file_names import STATS_FILE
from probe.rundir import layout
from probe.rundir.records import NAN, NEGINF, POSINF


def _record(tmp_path, fn, **options) -> probe.Run:
    with probe.mode("stats", out=tmp_path / "r", **options) as session:
        fn()
        session.step()
    return probe.load(tmp_path / "r")


def _names(ops) -> list[str]:
    return [op.name for op in ops]


def _scores() -> torch.Tensor:
    return torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0)) * 3


def _causal(n: int = 8) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def test_signed_infs_are_counted_apart(tmp_path):
    def fn():
        x = torch.tensor([1.0, math.inf, -math.inf, -math.inf, math.nan])
        (x * 1).clone()

    run = _record(tmp_path, fn)
    stats = run.ops(0)[0].outputs[0].stats
    assert (stats["nan"], stats["inf"], stats["posinf"], stats["neginf"]) == (1, 3, 1, 2)
    assert run.ops(0)[0].outputs[0].nonfinite_kinds == {NAN, POSINF, NEGINF}


@pytest.mark.parametrize("how", ["masked_fill", "add"])
def test_a_minus_inf_mask_that_softmax_absorbs_is_no_fault(tmp_path, how):
    def fn():
        scores = _scores().requires_grad_()
        if how == "masked_fill":
            masked = scores.masked_fill(_causal(), -math.inf)
        else:
            masked = scores + torch.zeros(8, 8).masked_fill(_causal(), -math.inf)
        masked.softmax(-1).square().sum().backward()

    run = _record(tmp_path, fn)
    assert any(op.outputs_finite is False for op in run.ops(0))  # the mask is there
    assert run.first_nonfinite() is None
    assert run.nonfinite_origins(0) == []


@pytest.mark.parametrize("how", ["masked_fill", "add"])
def test_exp_overflowing_behind_a_minus_inf_mask_is_the_origin(tmp_path, how):
    # softmax without subtracting the max, in fp16: exp overflows to +Inf on the large scores,
    # and turns the mask's -Inf into 0 (absorbed). +Inf / +Inf makes NaN, which reaches the loss.
    def fn():
        scores = (_scores() * 10).half().requires_grad_()
        if how == "masked_fill":
            masked = scores.masked_fill(_causal(), -math.inf)
        else:
            masked = scores + torch.zeros(8, 8, dtype=torch.half).masked_fill(_causal(), -math.inf)
        e = masked.exp()
        (e / e.sum(-1, keepdim=True)).float().sum().backward()

    run = _record(tmp_path, fn)
    bad = run.first_nonfinite()
    assert bad is not None and bad.name == "aten.exp.default"
    assert bad.inputs_finite is False  # the mask's -Inf came in ...
    assert bad.outputs[0].nonfinite_kinds == {POSINF}  # ... +Inf came out: made here
    origins = _names(run.nonfinite_origins(0))
    assert "aten.masked_fill.Scalar" not in origins and "aten.add.Tensor" not in origins
    assert origins[:2] == ["aten.exp.default", "aten.div.Tensor"]  # the div made NaN of inf / inf


def test_a_nan_from_inf_minus_inf_is_an_origin(tmp_path):
    # The Inf comes from outside the step: the op that makes NaN of it is where the fault starts.
    big = torch.tensor([math.inf, 1.0, 2.0])

    def fn():
        (big - big).sum()

    for inputs in (False, True):
        run = _record(tmp_path / str(inputs), fn, inputs=inputs)
        bad = run.first_nonfinite()
        assert bad is not None and bad.name == "aten.sub.Tensor"
        assert bad.outputs[0].nonfinite_kinds == {NAN}


def test_an_overflow_made_nan_later_is_reported_where_it_overflowed(tmp_path):
    def fn():
        x = torch.full((4,), 1e30)
        sq = x * x  # +Inf: fp32 overflows
        (sq - sq).sum()  # inf - inf: NaN

    run = _record(tmp_path, fn)
    assert _names(run.nonfinite_origins(0)) == ["aten.mul.Tensor", "aten.sub.Tensor"]
    assert run.first_nonfinite().name == "aten.mul.Tensor"
    assert run.first_nonfinite().inputs_finite is True


def test_an_inf_that_changes_sign_is_passed_on_not_made(tmp_path):
    def fn():
        lg = torch.zeros(4).log()  # -Inf
        (-lg).sum()  # +Inf: the same Inf, negated

    run = _record(tmp_path, fn)
    assert _names(run.nonfinite_origins(0)) == ["aten.log.default"]


def test_a_kind_a_reader_does_not_pass_on_is_absorbed(tmp_path):
    # clamp turns -Inf into a finite value and keeps +Inf: only the +Inf is a fault.
    def fn():
        minus = torch.zeros(4).log()  # -Inf, absorbed by clamp
        plus = torch.full((4,), 1e30) * 1e30  # +Inf, reaches the sum
        torch.cat([minus, plus]).clamp(min=-1.0).sum()

    run = _record(tmp_path, fn)
    assert _names(run.nonfinite_origins(0)) == ["aten.mul.Tensor"]


def _naive_softmax_attention(original, layer: int):
    """HF's eager attention with the softmax of layer ``layer`` computed as exp / sum(exp),
    without subtracting the max: it overflows in fp16."""
    from transformers.models.qwen2 import modeling_qwen2

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if module.layer_idx != layer:
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        key = modeling_qwen2.repeat_kv(key, module.num_key_value_groups)
        value = modeling_qwen2.repeat_kv(value, module.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        e = torch.exp(weights)
        weights = e / e.sum(dim=-1, keepdim=True)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return attention


def _qwen2_fp16(monkeypatch, naive: bool) -> torch.nn.Module:
    pytest.importorskip("transformers")
    from transformers.models.qwen2 import modeling_qwen2

    if naive:
        monkeypatch.setattr(modeling_qwen2, "eager_attention_forward",
                            _naive_softmax_attention(modeling_qwen2.eager_attention_forward, layer=1))
    model = tiny_qwen2().to(torch.float16)
    with torch.no_grad():  # scores of +-90: exp overflows fp16 (above 11), the mask add to -Inf
        attention = model.model.layers[1].self_attn
        attention.q_proj.weight.mul_(30)
        attention.k_proj.weight.mul_(30)
    return model


def _train_one_step(model: torch.nn.Module, out) -> probe.Run:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=out, model=model) as session:
        model(input_ids=ids, labels=ids).loss.backward()
        session.step()
    return probe.load(out)


def test_qwen2_fp16_naive_softmax_is_reported_at_exp_not_the_mask(tmp_path, monkeypatch):
    run = _train_one_step(_qwen2_fp16(monkeypatch, naive=True), tmp_path / "r")
    ops = run.ops(0)
    # The causal mask's add overflowed to -Inf (finfo.min + a negative score): no fault.
    masked = [op for op in ops if op.name == "aten.add.Tensor" and op.module == "model.layers.1.self_attn"
              and op.outputs[0].stats["neginf"]]
    assert masked and masked[0].outputs[0].nonfinite_kinds == {NEGINF} and masked[0].inputs_finite is True
    bad = run.first_nonfinite()
    assert bad is not None
    assert (bad.name, bad.module, bad.phase) == ("aten.exp.default", "model.layers.1.self_attn", "forward")
    assert bad.outputs[0].stats["posinf"] > 0 and bad.outputs[0].stats["neginf"] == 0
    assert masked[0].id not in {op.id for op in run.nonfinite_origins(0)}


def test_qwen2_fp16_with_torch_softmax_has_no_fault_despite_its_minus_inf_mask(tmp_path, monkeypatch):
    run = _train_one_step(_qwen2_fp16(monkeypatch, naive=False), tmp_path / "r")
    assert any(op.outputs_finite is False for op in run.ops(0))  # the mask overflowed to -Inf
    assert run.first_nonfinite() is None


def _as_version_2(run_dir) -> None:
    """Rewrite a run as format version 2 wrote it: ``stats.npy`` without posinf/neginf."""
    for path in run_dir.rglob(STATS_FILE):
        np.save(path, np.load(path)[:, :6])
    for name in (layout.RUN_FILE, layout.MANIFEST_FILE):
        for path in run_dir.rglob(name):
            info = json.loads(path.read_text())
            if "format_version" in info:
                info["format_version"] = 2
                path.write_text(json.dumps(info))


def test_runs_of_format_version_2_still_load(tmp_path):
    def fn():
        scores = (_scores() * 10).half()
        masked = scores.masked_fill(_causal(), -math.inf)
        e = masked.exp()
        (e / e.sum(-1, keepdim=True)).float().sum()

    run = _record(tmp_path, fn)
    assert run.first_nonfinite().name == "aten.exp.default"
    _as_version_2(tmp_path / "r")
    old = probe.load(tmp_path / "r")
    fill = next(op for op in old.ops(0) if op.name == "aten.masked_fill.Scalar")
    assert fill.outputs[0].stats["inf"] > 0 and fill.outputs[0].stats["posinf"] is None
    assert fill.outputs[0].nonfinite_kinds == {POSINF, NEGINF}  # the sign is unknown: either
    finite = old.ops(0)[0].outputs[0].stats
    assert finite["inf"] == 0 and (finite["posinf"], finite["neginf"]) == (0, 0)
    # Without signs, the mask's Inf may be what exp passed on: the mask is reported, as before.
    assert old.first_nonfinite().id == fill.id
