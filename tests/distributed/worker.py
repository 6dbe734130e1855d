"""A small data-parallel training job run under torchrun by tests/test_distributed.py.

Each rank trains the same tiny model on its own batches for a few steps, first
without the probe and then (same seeds) under it, and writes what it saw to
``--report`` (one JSON file per rank): the losses and final parameters of both
runs, so the test can check that the probe left training bit-identical.

``--wrap ddp|fsdp2|hsdp`` picks the engine, ``--width`` the model's (256: parameters
large enough for the statistics to queue them, which FSDP2 frees and reallocates
between uses); ``--desync-rank R`` perturbs one parameter on rank R after the first
step (a planted desynchronisation the cross-rank consistency check must find).
``--monitor-reduce`` runs the monitor mode with ``reduce_ranks=True`` (the head's
output and the weight gradients) alongside the engine's own collectives; ``--model``
passes the model to the session (parameter checks, checksums).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import probe


class TinyNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.mlp(h)
        return self.head(self.norm(h))


def build(wrap: str, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyNet(width)
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif wrap in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        # HSDP: every rank holds all of each parameter (replicated over ranks, sharded over one)
        mesh = (init_device_mesh("cpu", (world,)) if wrap == "fsdp2" else
                init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
        for layer in (model.inp, model.mlp, model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise SystemExit(f"unknown --wrap {wrap!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as in data parallelism
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list, session: object | None,
          desync: bool) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if session is not None:
            session.step()
        if desync and step == 0:
            with torch.no_grad():  # a silent corruption of one rank's copy of the weights
                local = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
                local.head.weight.add_(1e-3)
    return losses


def full_params(model: nn.Module) -> list[list[float]]:
    out = []
    for p in model.parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(value.detach().flatten().tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", default="ddp")
    parser.add_argument("--out", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--modes", default="stats")
    parser.add_argument("--ranks", default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--desync-rank", type=int, default=None)
    parser.add_argument("--monitor-reduce", action="store_true")
    parser.add_argument("--model", action="store_true", help="pass the model to the session")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = batches(rank, args.steps)
    desync = args.desync_rank == rank

    model, opt = build(args.wrap, args.width)
    plain_losses = train(model, opt, data, None, desync)
    plain_params = full_params(model)

    model, opt = build(args.wrap, args.width)
    ranks = None if args.ranks is None else [int(r) for r in args.ranks.split(",")]
    options: dict = {"model": model} if args.model else {}
    if args.monitor_reduce:
        head = "module.head" if args.wrap == "ddp" else "head"  # FSDP2 keeps the module's names
        options = dict(model=model, targets={head: {"output": "tensor"}}, wg_distribution=True,
                       reduce_ranks=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", probe.ProbeWarning)
        with probe.mode(args.modes.split(","), out=args.out, ranks=ranks, **options) as session:
            probed_losses = train(model, opt, data, session, desync)
    probed_params = full_params(model)

    Path(args.report).mkdir(parents=True, exist_ok=True)
    (Path(args.report) / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": dist.get_world_size(), "pid": os.getpid(),
        "plain_losses": plain_losses, "probed_losses": probed_losses,
        "identical_params": plain_params == probed_params,
        "probe_warnings": [str(w.message) for w in said if issubclass(w.category, probe.ProbeWarning)],
    }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
