"""A small MLP trained 3 SGD steps under the probe, in one process or under a parallel plan.

``--plan single`` runs in one process; the others under torchrun (gloo, CPU):

- ``tp``: each block's ``up`` is ``ColwiseParallel``, its ``down`` ``RowwiseParallel``, on a
  1-D mesh of every rank;
- ``ddp``: ``DistributedDataParallel``, each rank a slice of the batch;
- ``fsdp``: ``fully_shard`` on each block and the root, each rank a slice of the batch;
- ``fsdp_tp``: a 2-D mesh ``(dp, tp)`` with two ranks on ``tp``: tensor parallelism as ``tp``
  on it, ``fully_shard`` over ``dp``, each ``dp`` coordinate a slice of the batch.

All build the same weights (seed 0) and feed the same global batch, so every plan trains the
same model as the single process. ``--halve RANK:MODULE`` halves that rank's shard of
``MODULE.weight`` before training (a corrupted shard; tensor-parallel plans).
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


def tensor_parallel(model: nn.Module, mesh) -> None:
    """Each block's ``up`` column-wise, its ``down`` row-wise over ``mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for name, _ in model.named_children():
        plan[f"{name}.up"], plan[f"{name}.down"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, mesh, plan)


def fully_shard_blocks(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.children():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", choices=["single", "tp", "ddp", "fsdp", "fsdp_tp"], default="single")
    parser.add_argument("--out", required=True)
    parser.add_argument("--halve", default=None, help="RANK:MODULE")
    args = parser.parse_args()

    model = build()
    trained = model
    shard, shards = 0, 1  # this rank's slice of the batch, of how many
    if args.plan != "single":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        if args.plan == "tp":
            tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
        elif args.plan == "ddp":
            trained = nn.parallel.DistributedDataParallel(model)
            shard, shards = dist.get_rank(), world
        elif args.plan == "fsdp":
            fully_shard_blocks(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
            shard, shards = dist.get_rank(), world
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            tensor_parallel(model, mesh["tp"])
            fully_shard_blocks(model, mesh["dp"])
            shard, shards = mesh["dp"].get_local_rank(), world // 2
        if args.halve is not None:
            rank, module = args.halve.split(":")
            if int(rank) == dist.get_rank():
                with torch.no_grad():
                    model.get_submodule(module).weight.to_local().mul_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Each rank's slice of the batch, cut before the probe starts: the data come from outside
    # the traced steps, as a loader's would.
    data = [(x.chunk(shards)[shard], y.chunk(shards)[shard]) for x, y in batches()]
    with probe.mode("stats", out=args.out) as session:
        for x, y in data:
            loss = nn.functional.mse_loss(trained(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    if args.plan != "single":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
