"""A small model trained 3 SGD steps under the probe, in one process or under a parallel plan.

``--model mlp``: two residual MLP blocks (``up``, ``down``) on rows of width 16;
``--model transformer``: two pre-norm transformer blocks on sequences (batch 4, length 6,
width 16): layer norm, hand-written attention (``q``, ``k``, ``v``, ``o``; 4 heads of 4, the
local heads found by ``view(..., -1, head_dim)`` as torchtitan's attention does), layer norm,
MLP (``up``, ``down``).

``--plan single`` runs in one process; the others under torchrun (gloo, CPU):

- ``tp``: each block's ``up`` (and ``q``, ``k``, ``v``) is ``ColwiseParallel``, its ``down``
  (and ``o``) ``RowwiseParallel``, on a 1-D mesh of every rank;
- ``ddp``: ``DistributedDataParallel``, each rank a slice of the batch;
- ``fsdp``: ``fully_shard`` on each block and the root, each rank a slice of the batch;
- ``hsdp``: ``fully_shard`` on a 2-D mesh ``(replicate, shard)`` with two ranks on each dim
  (HSDP: parameters sharded over ``shard``, replicated over ``replicate``), each rank a slice
  of the batch;
- ``fsdp_tp``: a 2-D mesh ``(dp, tp)`` with two ranks on ``tp``: tensor parallelism as ``tp``
  on it, ``fully_shard`` over ``dp``, each ``dp`` coordinate a slice of the batch.

- ``manual``: Megatron-style tensor parallelism written by hand, no DTensor (``--model
  megatron`` only): each block's ``up`` a :class:`ColumnParallelLinear` (its rows of the weight
  and bias; the input's gradient all-reduced), ``down`` a :class:`RowParallelLinear` (its
  columns of the weight; the partial output all-reduced with ``torch.distributed.all_reduce``,
  then the whole bias added), over every rank. ``--model megatron --plan single`` runs the same
  layers whole in one process.

All build the same weights (seed 0) and feed the same global batch, so every plan trains the
same model as the single process. ``--halve RANK:MODULE`` halves that rank's shard of
``MODULE.weight`` before training (a corrupted shard; tensor-parallel plans, ``manual`` too).
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


class Attention(nn.Module):
    """Multi-head self-attention written out, so that tensor parallelism shards its heads: each
    rank's ``q``, ``k``, ``v`` give it whole heads, ``o`` sums the ranks' heads."""

    def __init__(self, width: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        # No biases (as Llama's): the gradient of k's bias is zero but for rounding (softmax
        # ignores a shift of each row), noise no two plans share.
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1: the heads this rank holds (all of them in one process).
        q, k, v = (p(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class TransformerBlock(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), Attention(width)
        self.norm2, self.mlp = nn.LayerNorm(width), FeedForward(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region``: the identity forward; backward,
    the ranks' partial gradients of the replicated input summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``reduce_from_tensor_model_parallel_region``: the ranks' partial outputs
    summed in place forward; backward, the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _tp_rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``full``'s weight and bias (output features); the output stays
    sharded along its last dim."""

    def __init__(self, full: nn.Linear) -> None:
        super().__init__()
        rank, size = _tp_rank_and_size()
        self.weight = nn.Parameter(full.weight.detach().chunk(size, 0)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(size, 0)[rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_CopyToParallel.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``full``'s weight (input features), the whole bias: the local
    product is a partial sum, all-reduced before the bias is added."""

    def __init__(self, full: nn.Linear) -> None:
        super().__init__()
        rank, size = _tp_rank_and_size()
        self.weight = nn.Parameter(full.weight.detach().chunk(size, 1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromParallel.apply(nn.functional.linear(x, self.weight)) + self.bias


def megatron_parallel(model: nn.Module) -> None:
    """Each block's ``up`` column-parallel, its ``down`` row-parallel, over every rank (one
    rank: the whole layers), built from the blocks' own weights."""
    for block in model.children():
        block.up, block.down = ColumnParallelLinear(block.up), RowParallelLinear(block.down)


MANUAL_PARTITIONS = {"0.up": "colwise", "0.down": "rowwise", "1.up": "colwise", "1.down": "rowwise"}
"""The ``megatron`` model's partitions, as ``probe.compare(..., partitions=)`` takes them."""


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy written out: each row's target class is where its ``y`` is largest."""
    target = y.argmax(-1, keepdim=True)
    return -out.log_softmax(-1).gather(-1, target).mean()


LOSSES = {
    "mse_loss": nn.functional.mse_loss,
    # Losses written by hand as means over this rank's slice of the batch: their backward
    # broadcasts the scalar loss's gradient back to the slice.
    "mean_square": lambda out, y: out.sub(y).square().mean(),
    "sum_over_count": lambda out, y: out.sub(y).square().sum() / out.numel(),
    "mean_abs": lambda out, y: out.sub(y).abs().mean(),
    "cross_entropy": _cross_entropy,
}
"""``--loss``: the loss of the model's output and the target, each rank's own slice's mean."""


def build(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    if kind == "transformer":
        return nn.Sequential(TransformerBlock(), TransformerBlock())
    return nn.Sequential(Block(), Block())


def batches(kind: str = "mlp") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (4, 6, 16) if kind == "transformer" else (8, 16)
    return [(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for _ in range(STEPS)]


def tensor_parallel(model: nn.Module, mesh) -> None:
    """Column-wise: each MLP's ``up``, each attention's ``q``, ``k``, ``v``; row-wise: ``down``
    and ``o`` (torchtitan's plan for these layers), over ``mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, Block | FeedForward):
            plan[f"{name}.up"], plan[f"{name}.down"] = ColwiseParallel(), RowwiseParallel()
        elif isinstance(module, Attention):
            for part in ("q", "k", "v"):
                plan[f"{name}.{part}"] = ColwiseParallel()
            plan[f"{name}.o"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def fully_shard_blocks(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.children():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def main() -> None:
    parser = argparse.ArgumentParser()
    plans = ["single", "tp", "ddp", "fsdp", "hsdp", "fsdp_tp", "manual"]
    parser.add_argument("--plan", choices=plans, default="single")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=["mlp", "transformer", "megatron"], default="mlp")
    parser.add_argument("--halve", default=None, help="RANK:MODULE")
    parser.add_argument("--dump", action="store_true", help="record the dump mode beside the statistics")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="mse_loss")
    args = parser.parse_args()

    if (args.plan == "manual") != (args.model == "megatron") and args.plan != "single":
        parser.error("--plan manual goes with --model megatron, the other parallel plans without it")
    model = build("mlp" if args.model == "megatron" else args.model)
    trained = model
    shard, shards = 0, 1  # this rank's slice of the batch, of how many
    if args.plan != "single":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        if args.plan == "manual":
            megatron_parallel(model)
        elif args.plan == "tp":
            tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
        elif args.plan == "ddp":
            trained = nn.parallel.DistributedDataParallel(model)
            shard, shards = dist.get_rank(), world
        elif args.plan == "fsdp":
            fully_shard_blocks(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
            shard, shards = dist.get_rank(), world
        elif args.plan == "hsdp":
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
            fully_shard_blocks(model, mesh)
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
                    weight = model.get_submodule(module).weight
                    (weight if args.plan == "manual" else weight.to_local()).mul_(0.5)
    if args.model == "megatron" and args.plan == "single":
        megatron_parallel(model)  # the same layers, whole
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Each rank's slice of the batch, cut before the probe starts: the data come from outside
    # the traced steps, as a loader's would.
    data = [(x.chunk(shards)[shard], y.chunk(shards)[shard])
            for x, y in batches("mlp" if args.model == "megatron" else args.model)]
    with probe.mode(["stats", "dump"] if args.dump else "stats", out=args.out) as session:
        for x, y in data:
            loss = LOSSES[args.loss](trained(x), y)
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
