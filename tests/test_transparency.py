"""Passive modes must leave training bit-identical: loss, gradients, parameters, RNG."""

from __future__ import annotations

import pytest
import torch

import probe
from probe.demo.train import DemoTraining, train
from tests.conftest import train_under


def _run(session_factory, checkpointed: bool):
    return train_under(session_factory, seed=1234, checkpointed=checkpointed)


def _assert_bitwise_equal(a, b):
    losses_a, grads_a, params_a, rng_a = a
    losses_b, grads_b, params_b, rng_b = b
    for la, lb in zip(losses_a, losses_b, strict=True):
        assert torch.equal(la, lb)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
        assert torch.equal(params_a[name], params_b[name]), name
    assert torch.equal(rng_a, rng_b)


@pytest.mark.parametrize("backend", ["auto", "compiled", "eager"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_stats_mode_is_bitwise_transparent(tmp_path, backend, checkpointed):
    baseline = _run(lambda m: None, checkpointed)
    traced = _run(
        lambda m: probe.mode("stats", out=tmp_path / "run", model=m, inputs=True, stats_backend=backend),
        checkpointed,
    )
    _assert_bitwise_equal(baseline, traced)
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1]
    addmm = [op for op in run.ops(0) if op.name == "aten.addmm.default"]
    assert addmm and all(op.outputs[0].stats is not None for op in addmm)


def test_demo_training_is_bitwise_transparent(tmp_path):
    plain = train(DemoTraining(), 2)
    rng_plain = torch.get_rng_state()
    training = DemoTraining()
    traced = train(training, 2, session=probe.mode("stats", out=tmp_path / "r", model=training.model))
    assert plain == traced
    assert torch.equal(rng_plain, torch.get_rng_state())
