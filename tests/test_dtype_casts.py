"""Casts one run makes only because of its dtype: a norm computing in float32 whatever its input's
dtype casts a bf16 model's activations up and back, casts the fp32 reference does not need. The
extra cast regroups autograd's sum of that input's gradients (the norm's terms summed before the
cast back, the residual's added after, where the fp32 run adds the three in turn); compare must not
take the regrouped sums for one quantity, and must still find a fault after them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import probe

HIDDEN, VOCAB = 16, 32


class _Fp32Norm(nn.Module):
    """Computes in float32 and returns its input's dtype, as HF norms do; its input is read twice
    (``h * weight + h``), so the input's gradient from it is a sum of two terms."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * self.weight + h).to(x.dtype)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(F.gelu(self.up(x)))
        return out * self.scale if self.scale != 1.0 else out


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.mlp = nn.Embedding(VOCAB, HIDDEN), _Fp32Norm(), _Mlp()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.norm(x)  # the residual reads the norm's input too
        return self.head(x + self.mlp(x))


def _run(out, dtype: torch.dtype, scaled_from: int | None = None):
    """Two AdamW steps of the tiny model in ``dtype`` (seeded alike in every run); from step
    ``scaled_from`` on, the MLP's output is 1.5 times what it should be."""
    torch.manual_seed(0)
    model = _Model().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=out, model=model) as session:
        for step in range(2):
            model.mlp.scale = 1.5 if scaled_from is not None and step >= scaled_from else 1.0
            ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
            F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return out


def test_a_bf16_model_whose_norm_casts_to_fp32_is_no_divergence(tmp_path):
    report = probe.compare(_run(tmp_path / "a", torch.float32), _run(tmp_path / "b", torch.bfloat16))
    assert report.first_divergence is None and report.ok, report.conclusion
    assert report.conclusion.startswith("no divergence: differences consistent with the precision of run B")


def test_a_fault_after_a_bf16_models_norm_casts_is_found_at_its_module_and_step(tmp_path):
    report = probe.compare(_run(tmp_path / "a", torch.float32),
                           _run(tmp_path / "b", torch.bfloat16, scaled_from=1))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.op.module, d.step) == ("mlp", 1), report.conclusion
