"""Two data-parallel ranks train a tiny MLP through ``session.step_fn``, gradients all-reduced by
hand, by DDP (``--wrap ddp``) or reduce-scattered by FSDP2 (``--wrap fsdp``: sharded parameters,
gradients and optimizer state); rank 1's batch at step 2 holds an inf in sample 3. Run under
torchrun by tests/test_rewind.py; each rank writes its verdicts to ``--report``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import probe

BAD_STEP, BAD_RANK, BAD_SAMPLE = 2, 1, 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--wrap", choices=["none", "ddp", "fsdp"], default="none")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif args.wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = ((model(batch[0]) - batch[1]) ** 2).mean()
        loss.backward()
        for p in model.parameters() if args.wrap == "none" else ():  # by hand: ranks wait on each other
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        return loss

    generator = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator))
               for _ in range(4)]
    if rank == BAD_RANK:
        batches[BAD_STEP][0][BAD_SAMPLE, 1] = float("inf")
    with probe.mode("stats", out=args.out, model=model) as session:
        for batch in batches:
            session.step_fn(fn, batch, optimizer=optimizer)
    verdicts = [dataclasses.asdict(v) for v in probe.rewind.rewinder_of(session).verdicts]
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / f"rank{rank}.json").write_text(json.dumps({"verdicts": verdicts}, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
