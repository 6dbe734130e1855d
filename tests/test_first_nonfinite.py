"""first_nonfinite() finds the op where a NaN or Inf first appears."""

from __future__ import annotations

import torch
from torch import nn

import probe
from probe.demo.model import LlamaConfig, TinyLlama, synthetic_batch


class Scale(nn.Module):
    """Multiplies by a factor the test can poison."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_injected_inf_is_found_at_its_op_and_module(tmp_path):
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(num_layers=3))
    poison = Scale()
    model.layers[1].mlp.up_proj = nn.Sequential(model.layers[1].mlp.up_proj, poison)
    opt = torch.optim.AdamW(model.parameters())
    data = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=tmp_path / "r", model=model) as session:
        for step in range(3):
            poison.factor = float("inf") if step == 1 else 1.0
            loss = model.loss(synthetic_batch(model.config, 2, 16, data))
            loss.backward()
            opt.zero_grad()  # keep the weights finite for the next step
            session.step()
    run = probe.load(tmp_path / "r")
    assert run.first_nonfinite(step=0) is None
    bad = run.first_nonfinite()
    assert bad is not None
    assert (bad.step, bad.name, bad.module, bad.phase) == (
        1, "aten.mul.Tensor", "layers.1.mlp.up_proj.1", "forward",
    )
    assert bad.inputs_finite is True
    assert bad.outputs[0].stats["inf"] > 0
    # Everything before it in the step was finite.
    ops = run.ops(1)
    assert all(op.outputs_finite is not False for op in ops[: bad.index])


def test_nan_from_a_backward_op_is_attributed_to_backward(tmp_path):
    torch.manual_seed(0)

    class SqrtNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).clamp(min=0).sqrt()

    model = SqrtNet()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()
    with probe.mode("stats", out=tmp_path / "r", model=model):
        model(torch.randn(2, 4)).sum().backward()  # d sqrt(x)/dx at 0 is inf
    bad = probe.load(tmp_path / "r").first_nonfinite()
    assert bad is not None and bad.phase == "backward" and bad.module == ""
    assert bad.inputs_finite is True


def test_an_unread_causal_mask_is_no_origin_the_first_overflow_is(tmp_path):
    # nn.TransformerEncoder is given the causal mask and is_causal=True: its attention then calls
    # SDPA with is_causal and never reads the mask's full(-inf). In fp16, layer 1's linear1 grows
    # until its addmm overflows (finite inputs, Inf out): that is where the fault starts.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(torch.float16)
    with torch.no_grad():
        model.layers[1].linear1.weight.mul_(1e5)
    x = torch.randn(2, 8, 32, dtype=torch.float16)
    with probe.mode("stats", out=tmp_path, model=model) as session:
        for _ in range(2):
            mask = nn.Transformer.generate_square_subsequent_mask(8, dtype=torch.float16)
            model(x, mask=mask, is_causal=True).float().square().mean().backward()
            session.step()
    run = probe.load(tmp_path)
    first = run.first_nonfinite()
    assert first is not None
    assert (first.module, first.name, first.step) == ("layers.1.linear1", "aten.addmm.default", 0), first
    assert first.inputs_finite
    for step in run.steps:
        assert all(op.name.split(".")[1] not in ("full", "triu") for op in run.nonfinite_origins(step))
