"""A 2-rank DDP job with a NaN planted on chosen ranks, run by tests/test_first_rank.py.

Each rank joins a gloo group through a file store (no torchrun: the test starts the ranks
itself, which is quicker) and trains a tiny DDP model for two steps under the stats mode,
once per scenario, each into its own run directory under ``--out``:

- ``healthy``: nothing planted;
- ``rank1``: rank 1 multiplies its activations by NaN in step 1's forward, before the
  gradient all-reduce that spreads the NaN to rank 0;
- ``both``: ranks 0 and 1 do so in step 0's forward, before the same all-reduce.

The NaN is planted by the module ``plant`` (an ``aten.mul`` by a Python float), so the
test can name the op it expects.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import probe

SCENARIOS = {"healthy": {}, "rank1": {1: 1}, "both": {0: 0, 1: 0}}
"""Scenario -> {rank: the step whose forward it plants a NaN in}."""


class Plant(nn.Module):
    """Multiplies by ``scale``: 1.0, or NaN in the step chosen for this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0  # a Python float, not a buffer: DDP would broadcast a buffer from rank 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.plant = Plant()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.plant(self.inp(x))))


def run_scenario(name: str, out: str, rank: int) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    net = TinyNet()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    planted_step = SCENARIOS[name].get(rank)
    with probe.mode("stats", out=os.path.join(out, name)) as session:
        for step in range(2):
            net.plant.scale = float("nan") if step == planted_step else 1.0
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            session.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--store", required=True, help="file for the gloo group's file store")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.world_size)
    for name in SCENARIOS:
        run_scenario(name, args.out, args.rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
