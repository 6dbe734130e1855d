"""One name per statistic: the monitor's files, records and alerts use the stats mode's names
(the statistics table's), and runs written with the monitor's old names (format 3 and before:
``nans``, ``infs``) still read."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

import probe
from probe.modes.monitor.options import Monitor
from probe.modes.statistics.columns import MONITOR_COLUMNS, STATS_FILE_COLUMNS
from tests.conftest import train_steps


class MaskedNet(nn.Module):
    """``mask``'s output holds -inf in a quarter of its elements and +inf in one (an attention
    mask's fill and an overflow), the rest finite."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.mask = nn.Identity()
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        masked = self.mask(h.masked_fill(torch.arange(16) < 4, -math.inf))
        masked = masked.clone()
        masked[0, 15] = math.inf
        return self.b(torch.nan_to_num(masked))


def _monitor_run(tmp_path, **options):
    torch.manual_seed(0)
    model = MaskedNet()
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets={"mask": {"output": "tensor"}},
                    tensorboard=False, **options) as session:
        train_steps(model, 2, session=session)
    return probe.load(tmp_path / "run")


def test_the_monitor_writes_the_stats_modes_names_and_signed_infs(tmp_path):
    run = _monitor_run(tmp_path)
    (csv,) = sorted((tmp_path / "run").rglob("monitor.csv"))[:1]
    header = csv.read_text().splitlines()[0].split(",")
    assert header == ["kind", "name", "slot", "call", *MONITOR_COLUMNS]
    assert set(STATS_FILE_COLUMNS) <= set(header) and "nans" not in header
    (row,) = run.monitor(0)
    # mask's output as its hook saw it: 4 columns of -inf in each of 4 rows, no +inf (set after).
    assert (row.nan, row.inf, row.posinf, row.neginf, row.numel) == (0, 16, 0, 16, 64)
    (alert,) = [a for a in run.anomalies() if a.step == 0]
    assert alert.metric == "output.inf" and alert.value == 16


def test_a_monitor_csv_with_the_old_names_still_reads(tmp_path):
    _monitor_run(tmp_path)
    for csv in (tmp_path / "run").rglob("monitor.csv"):
        lines = csv.read_text().splitlines()
        header = lines[0].split(",")
        drop = [header.index("posinf"), header.index("neginf")]
        old = [",".join(v for i, v in enumerate(line.split(",")) if i not in drop) for line in lines]
        old[0] = old[0].replace(",nan,inf,", ",nans,infs,")
        assert old[0] == "kind,name,slot,call,min,max,mean,norm,zeros,nans,infs,numel"  # format 3's
        csv.write_text("\n".join(old) + "\n")
    (row,) = probe.load(tmp_path / "run").monitor(0)
    assert (row.nan, row.inf, row.nans, row.infs) == (0, 16, 0, 16)
    assert row.posinf is None and row.neginf is None  # an Inf whose sign the old file did not record


def test_the_old_metric_names_are_accepted_as_options_and_in_user_rules(tmp_path):
    assert Monitor(targets=["x"], metrics=["norm", "nans"]).metrics == ("norm", "nan")
    seen = []

    def rule(observation):
        metrics = observation.metrics
        seen.append((metrics["nans"], metrics.get("infs"), metrics["inf"]))
        return None

    _monitor_run(tmp_path, anomaly_rules=[rule])
    assert seen and all(nans == 0 and infs == inf == 16 for nans, infs, inf in seen)
    assert np.isfinite([s[2] for s in seen]).all()
