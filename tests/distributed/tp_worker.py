"""A small MLP trained 3 SGD steps under the probe, in one process or with tensor parallelism.

``--plan single`` runs in one process; ``--plan tp`` under torchrun (gloo, CPU): each block's
``up`` is ``ColwiseParallel``, its ``down`` ``RowwiseParallel``, on a 1-D mesh of every rank.
Both build the same weights (seed 0) and feed the same data. ``--halve RANK:MODULE`` halves
that rank's shard of ``MODULE.weight`` before training (a corrupted shard).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import probe

STEPS = 3


class Block(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", choices=["single", "tp"], default="single")
    parser.add_argument("--out", required=True)
    parser.add_argument("--halve", default=None, help="RANK:MODULE")
    args = parser.parse_args()

    model = build()
    if args.plan == "tp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        plan = {}
        for name, module in model.named_children():
            plan[f"{name}.up"], plan[f"{name}.down"] = ColwiseParallel(), RowwiseParallel()
            del module
        parallelize_module(model, mesh, plan)
        if args.halve is not None:
            rank, module = args.halve.split(":")
            if int(rank) == dist.get_rank():
                with torch.no_grad():
                    model.get_submodule(module).weight.to_local().mul_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probe.mode("stats", out=args.out) as session:
        for x, y in batches():
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    if args.plan == "tp":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
