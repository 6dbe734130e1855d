"""Upcast mode: higher precision carried across a selected module's ops, rounded at its edge."""

from __future__ import annotations

import gc
import types

import pytest
import torch
from torch import nn

import probe
from probe import ProbeError


class Fragile(nn.Module):
    """(x + 1000) - 1000 in fp16: the intermediate rounds to 0.5, an error of up to 0.25."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 1000
        y.add_(1)          # in place, inside the scope
        return (y - 1000) - 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.fragile = Fragile()
        self.post = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.fragile(self.pre(x)))


def _net():
    torch.manual_seed(0)
    return Net().half()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_upcast_carries_precision_across_the_module_and_rounds_once(tmp_path, dtype):
    net = _net()
    x = torch.randn(8, 16).half().requires_grad_()
    plain_pre = net.pre(x)
    reference = plain_pre.double() + 1000 + 1 - 1000 - 1
    plain = net.fragile(plain_pre)
    assert (plain.double() - reference).abs().max() > 0.1  # the planted error

    with probe.mode("upcast", out=tmp_path / "r", model=net, modules=["fragile"], upcast_dtype=dtype):
        pre = net.pre(x)
        upcast = net.fragile(pre)
        out = net.post(upcast)
        out.float().sum().backward()
    assert torch.equal(pre, plain_pre)  # outside the module nothing changes
    assert upcast.dtype == torch.float16 and upcast.shape == plain.shape
    error = (upcast.double() - reference).abs()
    fp16_eps = torch.finfo(torch.float16).eps
    if dtype == torch.float64:  # every element within its own fp16 rounding
        assert (error <= fp16_eps * reference.abs() + 2**-24).all()
    else:  # fp32 cancels 1000 too, at ~3e-5: within fp16 rounding of the tensor's scale
        assert error.max() <= fp16_eps * reference.abs().max()
    assert x.grad is not None and x.grad.dtype == torch.float16
    assert all(p.grad.dtype == torch.float16 for p in net.parameters())


def test_upcast_under_autocast_keeps_the_autocast_dtypes(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = lin(x)
    with probe.mode("upcast", out=tmp_path / "r", model=lin), torch.autocast("cpu", dtype=torch.bfloat16):
        upcast = lin(x)
    exact = nn.functional.linear(x.double(), lin.weight.bfloat16().double(), lin.bias.bfloat16().double())
    assert upcast.dtype == plain.dtype == torch.bfloat16
    assert (upcast.double() - exact).abs().max() <= (plain.double() - exact).abs().max()


def test_only_fp32_or_fp64_are_upcast_targets(tmp_path):
    with pytest.raises(ProbeError, match="upcast_dtype"):
        probe.mode("upcast", out=tmp_path / "r", upcast_dtype=torch.float16)


def test_upcast_leaves_no_reference_cycle_behind_an_op(tmp_path):
    # The re-run's argument walk must hold nothing past the op (the snapshot of a written input,
    # the op's arguments): a closure that calls itself would, until Python's cyclic collector.
    net = _net()
    x = torch.randn(8, 16).half()
    with probe.mode("upcast", out=tmp_path / "r", model=net, modules=["fragile"]):
        gc.collect()
        gc.disable()
        try:
            net.fragile(net.pre(x))
            left = [o.__qualname__ for o in gc.get_objects()
                    if type(o) is types.FunctionType and o.__qualname__.startswith("UpcastMode.")
                    and "<locals>" in o.__qualname__]
        finally:
            gc.enable()
    assert left == []
