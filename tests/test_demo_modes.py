"""``probe demo --mode M`` shows what M does (issue 36): upcast on a low-precision model, and a
free benchmark that does not spend a short run compiling its kernels."""

from __future__ import annotations

import torch
from torch import nn

import probe
from probe.cli import main
from probe.compiled import CompiledKernel
from probe.modes.free_benchmark import deviation, perturbations


def test_the_upcast_demo_trains_in_bf16_and_shows_what_upcast_changed(tmp_path, capsys):
    assert main(["demo", "--mode", "upcast", "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "(bfloat16)" in out
    assert "bf16, no probe" in out and "bf16 + upcast" in out and "fp32, no probe" in out
    ops = probe.load(tmp_path / "run").ops(0)
    dtypes = {t.dtype for op in ops if op.phase == "forward" for t in op.outputs}
    assert "bfloat16" in dtypes


def test_a_kernel_runs_eagerly_until_its_work_would_pay_for_a_compile():
    calls = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.numel())
        return x * 2

    kernel = CompiledKernel(double, compile_after=100)
    assert torch.equal(kernel(torch.ones(60)), torch.full((60,), 2.0))
    assert torch.equal(kernel(torch.ones(60)), torch.full((60,), 2.0))
    assert kernel._compiled is None and calls == [60, 60]  # 120 elements eager: the budget is spent


def test_a_short_free_benchmark_run_compiles_none_of_its_kernels(tmp_path):
    # A compile costs 10-30 s once per process on a small CPU (the demo's 150 s were mostly
    # these); a few small steps never earn it back.
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    with probe.mode("free_benchmark", out=tmp_path / "run", model=model) as session:
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            session.step()
    assert probe.load(tmp_path / "run").checks(1)
    kernels = [deviation._SEGMENTED, deviation._DEVIATION, *perturbations._COMPILED.values()]
    assert all(k._compiled is None for k in kernels)
