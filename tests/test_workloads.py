"""The report's workloads train (every dtype mode) and count their FLOPs plausibly."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.workloads import DTYPE_MODES, peak_flops, workloads

QUICK = workloads(quick=True)


@pytest.mark.parametrize("name", sorted(QUICK))
def test_each_workload_trains_a_step(name):
    trainer = QUICK[name].trainer()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses = [trainer.step() for _ in range(2)]
    assert all(torch.isfinite(loss) for loss in losses)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
    assert QUICK[name].flops_per_step(trainer) > 0


@pytest.mark.parametrize("dtype_mode", DTYPE_MODES)
def test_dtype_modes(dtype_mode):
    trainer = QUICK["llama-small"].trainer(dtype_mode=dtype_mode)
    assert torch.isfinite(trainer.step())
    stored = {"fp32": torch.float32, "autocast": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    want = stored[dtype_mode]
    assert next(trainer.model.parameters()).dtype == want


def test_decoder_flops_formula_is_close_to_a_flop_count():
    # 6 * params * tokens counts the embedding's parameters too, which a FLOP counter
    # (matmuls only) does not see as matmuls; the two agree within a factor of two.
    work = QUICK["gpt-small"]
    trainer = work.trainer()
    with FlopCounterMode(display=False) as counter:
        trainer.step()
    counted = counter.get_total_flops()
    assert 0.5 < work.flops_per_step(trainer) / counted < 2.0


def test_the_cpu_peak_is_measured():
    peak, source = peak_flops("cpu", "fp32")
    assert math.isfinite(peak) and peak > 1e9 and "measured" in source
