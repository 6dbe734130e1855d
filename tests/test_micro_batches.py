"""Gradient accumulation against one full batch (``probe.analysis.micro_batches``): the micro-batches'
forward and backward are "not compared" with the reason, never paired op for op; the optimizer step
on the accumulated gradients is compared, and a fault there is found."""

from __future__ import annotations

import torch
from torch import nn

import probe
from probe.analysis.verdicts import NOT_COMPARED, PASS, WARNING


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


def _train(out, micro_batches: int, lr: float = 1e-2, steps: int = 2) -> None:
    """AdamW steps on a batch of 8, in ``micro_batches`` slices whose gradients accumulate
    (each loss divided by their number, as gradient accumulation does)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=str(out), model=model) as session:
        for _ in range(steps):
            x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
                (nn.functional.cross_entropy(model(xs), ys) / micro_batches).backward()
            opt.step()
            opt.zero_grad()
            session.step()


def test_two_micro_batches_against_one_batch_compare_the_optimizer_step_and_nothing_else(tmp_path):
    _train(tmp_path / "a", 1)
    _train(tmp_path / "b", 2)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    rows = report.comparisons
    micro = [c for c in rows if (c.a or c.b).phase in ("forward", "backward")]
    optimizer = [c for c in rows if (c.a or c.b).phase == "optimizer"]
    assert micro and all(c.verdict == NOT_COMPARED and "micro-batches: 2 calls" in c.message for c in micro)
    # Run B's second micro-batch (its gradients added into .grad) is shown, not left unmatched.
    assert any(c.a is None and c.b.name.startswith("aten.add_") and c.b.phase == "backward" for c in micro)
    assert optimizer and all(c.a is not None and c.b is not None and c.verdict in (PASS, WARNING)
                             for c in optimizer)
    assert {c.step for c in optimizer} == {0, 1}
    assert not report.ok  # missing data is never agreement
    assert "not compared" in report.conclusion and "did not start alike" not in report.conclusion


def test_a_fault_in_the_optimizer_step_of_accumulated_gradients_is_found_there(tmp_path):
    _train(tmp_path / "a", 1)
    _train(tmp_path / "b", 2, lr=1.5e-2)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    d = report.divergence
    assert d is not None and d.step == 0 and d.op.phase == "optimizer", report.conclusion
