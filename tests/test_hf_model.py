"""End to end on a model nobody here wrote: HF transformers' Llama with random weights."""

from __future__ import annotations

import pytest
import torch
from hf_models import assert_trained_alike, tiny_llama, train_steps

import probe

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")


def _model():
    return tiny_llama()


def test_hf_llama_two_steps_bitwise_transparent_and_attributed(tmp_path):
    plain_model = _model()
    plain = train_steps(plain_model)
    rng = torch.get_rng_state()

    model = _model()
    with probe.mode("stats", out=tmp_path / "r", model=model) as session:
        traced = train_steps(model, session)
    assert_trained_alike(plain_model, plain, model, traced, rng)

    run = probe.load(tmp_path / "r")
    assert run.steps == [0, 1]
    ops = run.ops(1)
    modules = {op.module for op in ops}
    assert {"model.layers.0.mlp.act_fn", "model.layers.1.self_attn.q_proj", "lm_head"} <= modules
    silu_bwd = [op for op in ops if op.name == "aten.silu_backward.default"]
    assert [op.module for op in silu_bwd] == ["model.layers.1.mlp.act_fn", "model.layers.0.mlp.act_fn"]
    # HF masks with finfo.min, not -inf: a healthy run has no non-finite value.
    assert run.first_nonfinite() is None
