"""``probe summary`` shows the model, not the bookkeeping (issue 36): its "largest" tables leave
out by-products (nll_loss's total_weight), optimizer counters (AdamW's step) and repeats of an
input (detach, views); a monitor-only run shows each series' values over the steps."""

from __future__ import annotations

import torch
from torch import nn

import probe
from probe.analysis.summary import summarize
from probe.cli import main


class SmallHead(nn.Module):
    """Activations far below the batch's 96 targets and the step counter's 3."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x).view(-1, 5)
        return nn.functional.cross_entropy(logits, target)


def test_largest_tables_leave_out_by_products_counters_and_repeats(tmp_path):
    torch.manual_seed(0)
    model = SmallHead()
    with torch.no_grad():
        model.proj.weight.mul_(0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x, target = torch.randn(96, 8) * 0.1, torch.randint(0, 5, (96,))
    with probe.mode("stats", out=tmp_path / "run", model=model) as session:
        for _ in range(3):
            model(x, target).backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step()
    summaries = list(summarize(probe.load(tmp_path / "run"), top=50))
    assert len(summaries) == 3
    for summary in summaries:
        rows = summary.largest_abs_max + summary.largest_norm
        names = {row.op.name for row in rows}
        assert "aten.nll_loss_forward.default" in names  # the loss itself stays
        assert not {n for n in names if n.split(".")[1] in ("detach", "view", "t", "expand")}, names
        # nll_loss_forward's total_weight (the 96 targets), AdamW's step counter (1, 2, 3)
        assert all(row.value != 96.0 for row in rows), [row.op.id for row in rows if row.value == 96.0]
        counters = [row.op.id for row in rows if row.op.phase == "optimizer" and row.value in (1.0, 2.0, 3.0)]
        assert counters == []


def test_a_monitor_only_summary_shows_each_series_over_the_steps(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = probe.Monitor(targets={"0": {"output": "tensor"}}, wg_distribution=True)
    with probe.mode([monitor], out=tmp_path / "run", model=model) as session:
        for _ in range(4):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step()
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    run = probe.load(tmp_path / "run")
    last = {r.name: r.norm for r in run.monitor(3) if r.kind == "activation"}
    assert "monitored series (norm per step)" in out
    line = next(line for line in out.splitlines() if line.startswith("activation 0 output"))
    assert f"{last['0']:.4g}" in line
    assert any(c in line for c in "▁▂▃▄▅▆▇█")
    assert "weight_grad 2.weight" in out
