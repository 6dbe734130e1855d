"""What Python's garbage collector costs a training step traced by the probe, as users run it:
one session kept open over many steps, no collection forced between them.

Run from the repository root::

    python -m benchmarks.gc_pressure [--model hf-llama-small] [--steps N] [--rounds N]
                                     [--threads N] [--markdown]

``benchmarks.overhead`` collects before every step (so that its rows start from one heap)
and enters a session per step: it never meets the full collections a long session causes.
Here each configuration runs ``--steps`` steps in one session, and the table gives the mean
and median step, the time spent in collections per step (from ``gc.callbacks``) and the full
collections per step. Configurations: ``baseline`` (no probe), and ``structure`` and ``stats``
each with ``gc_freeze=False`` (every collection walks the whole heap) and with the default
(the program's objects frozen while tracing: ``probe.tracer.frozen_heap``). The blocks run
one after another, ``--rounds`` times, the order rotating, each from a collected heap.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import probe
from benchmarks.models import MODELS, ModelSpec, WorkloadSpec
from benchmarks.overhead import machine_line

CONFIGS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "baseline": None,
    "structure, gc_freeze=False": ("structure", {"gc_freeze": False}),
    "structure": ("structure", {}),
    "stats, gc_freeze=False": ("stats", {"gc_freeze": False}),
    "stats": ("stats", {}),
}


@dataclass
class Collections:
    """Time spent in the collector and collections run, per generation, while attached."""

    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self.count[info["generation"]] += 1

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


@dataclass
class Block:
    """The timed steps of one configuration, and its collections over them."""

    steps: list[float] = field(default_factory=list)
    collections: Collections = field(default_factory=Collections)


def run_block(config: tuple[str, dict[str, Any]] | None, trainer: Any, warmup: int, steps: int,
              into: Block) -> None:
    gc.collect()  # each block from a collected heap, outside the timing
    with tempfile.TemporaryDirectory(prefix="probe-gc-") as out:
        session = (probe.mode(config[0], out=out, overwrite=True, model=trainer.model, checksums=False,
                              **config[1]) if config is not None else contextlib.nullcontext())
        with session:
            for k in range(warmup + steps):
                timed = k >= warmup
                with into.collections.attached() if timed else contextlib.nullcontext():
                    started = time.perf_counter()
                    trainer.step()
                    if config is not None:
                        session.step()
                    trainer.synchronize()
                    if timed:
                        into.steps.append(time.perf_counter() - started)


def table_rows(blocks: dict[str, Block]) -> list[list[str]]:
    rows = []
    for name, block in blocks.items():
        n = len(block.steps)
        gc_ms = [1e3 * s / n for s in block.collections.seconds]
        rows.append([
            name, f"{1e3 * statistics.fmean(block.steps):.1f}", f"{1e3 * statistics.median(block.steps):.1f}",
            f"{1e3 * max(block.steps):.1f}", f"{sum(gc_ms):.1f}", f"{gc_ms[2]:.1f}",
            f"{block.collections.count[2] / n:.2f}", f"{sum(block.collections.count[:2]) / n:.1f}",
        ])
    return rows


COLUMNS = ("config", "mean ms", "median ms", "max ms", "gc ms/step", "full gc ms/step", "full gcs/step",
           "young gcs/step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gc_pressure",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hf-llama-small", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per block (30)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block (2)")
    parser.add_argument("--rounds", type=int, default=2, help="blocks per configuration (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    parser.add_argument("--quick", action="store_true", help="smoke run: demo model, 3 steps, 1 round")
    parser.add_argument("--markdown", action="store_true", help="also print the table as GitHub markdown")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup, args.rounds = "demo", 3, 1, 1
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="probe: compiled regions run eagerly")
    spec: ModelSpec | WorkloadSpec = MODELS[args.model]
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(f"[bold]probe gc pressure[/bold]  {machine_line()}")
    trainers = {name: spec.trainer() for name in CONFIGS}  # built before any session freezes the heap
    blocks = {name: Block() for name in CONFIGS}
    names = list(CONFIGS)
    with console.status("") as status:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                status.update(f"round {r + 1}/{args.rounds}: {name}")
                run_block(CONFIGS[name], trainers[name], args.warmup, args.steps, blocks[name])
    title = (f"{spec.name}: {spec.describe()}; {args.rounds} block(s) of {args.steps} steps per config, "
             f"one session each, {len(gc.get_objects())} objects tracked by the collector at the end")
    table = Table(*COLUMNS, title=title)
    rows = table_rows(blocks)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if args.markdown:
        print(f"\n{title}\n\n{machine_line()}\n")
        print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
