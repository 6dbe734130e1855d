"""A value moved to other positions by one run only (a mask shifted by one key): statistics are
blind to a permutation, so under a mixed-precision pair, where the attention's own rounding
bounds its output loosely, the shift was within the bound (issue 33: the zoo's mask-shift
faults under a bf16 model, 10 of 25 architectures missed). No precision policy moves a value:
the op that does, in one run only, is where the runs part."""

from __future__ import annotations

import torch
from torch import nn

import probe

TOKENS, WIDTH = 32, 16


class _Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        mask = torch.ones(TOKENS, TOKENS, dtype=torch.bool)
        self.register_buffer("causal", mask.tril() if causal else mask)
        self.shift = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.causal.roll(1, dims=-1) if self.shift else self.causal
        scores = self.q(x) @ self.k(x).transpose(0, 1) / WIDTH**0.5
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1) @ self.v(x)


class _Net(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.attn = _Attention(causal)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x))


def _run(path, dtype: torch.dtype | None, shift_at: int | None = None, causal: bool = True):
    torch.manual_seed(0)
    model = _Net(causal).to(dtype or torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1)).to(dtype or torch.float32)
    with probe.mode("stats", out=path, model=model) as session:
        for step in range(2):
            model.attn.shift = step == shift_at
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return path


def test_a_mask_shifted_in_a_bf16_model_is_found_where_it_moves(tmp_path):
    a = _run(tmp_path / "a", None)
    healthy = probe.compare(a, _run(tmp_path / "b", torch.bfloat16))
    assert healthy.first_divergence is None, healthy.conclusion
    report = probe.compare(a, _run(tmp_path / "shifted", torch.bfloat16, shift_at=1))
    d = report.divergence
    assert d is not None and (d.step, d.op.module, d.op.name) == (1, "attn", "aten.roll.default"), \
        report.conclusion


def test_a_constant_rolled_moves_nothing(tmp_path):
    # Rolling a mask of one value (no mask at all) changes nothing: no entry there.
    a = _run(tmp_path / "a", None, causal=False)
    report = probe.compare(a, _run(tmp_path / "b", torch.bfloat16, shift_at=1, causal=False))
    assert report.first_divergence is None, report.conclusion
