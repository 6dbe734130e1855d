"""The statistics engine's device cost per step, modelled on the CPU (``benchmarks.device_cost``),
against issue 35's budget.

Run from the repository root::

    python -m benchmarks.cost_model [--models hf-llama-small,hf-llama7b-width] [--unstaged]
                                    [--ops N] [--markdown]

For each model, one training step (forward, backward, AdamW foreach) on ``meta`` tensors in the
model's dtype, its tensors handed to the engine as the stats mode does, the engine on its
accelerator path: the values reduced, the bytes the engine reads and writes and the kernels it
launches per step, the host syncs, each against its budget (bytes read at most 1.1x the bytes
reduced, written at most 1%, launches at most one per 32 values plus one per 64 MiB, no sync),
then the ops that cost most. ``--unstaged``: small tensors queued with the large ones instead
of staged (the monitor across ranks, ``stats_backend`` other than "auto").

``--session``: a real ``probe.mode("stats")`` session over the step instead (the tracer, the
stats mode's hand-over and its engine, AdamW ``--optimizers`` foreach and fused), every op the
probe issues counted with the probe function that issued it (``device_cost.session_step_cost``).
``--sketch``: the session with ``probe.Stats(sketch=True)`` beside it (the sketches' own passes).
"""

from __future__ import annotations

import argparse
import sys

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import device_cost
from benchmarks.workloads import HF_LLAMA7B_WIDTH, HF_LLAMA_SMALL

MODELS = {
    "hf-llama-small": (HF_LLAMA_SMALL, torch.float32),
    "hf-llama7b-width": (HF_LLAMA7B_WIDTH, torch.bfloat16),
    # CI's: hf-llama-small's shapes, one layer (the same ops per layer).
    "hf-llama-small-1layer": ((*HF_LLAMA_SMALL[:3], 1, *HF_LLAMA_SMALL[4:]), torch.float32),
}


def model_tally(name: str, stage: bool = True, multi_tensor: bool = True) -> device_cost.Tally:
    shape, dtype = MODELS[name]
    return device_cost.stats_step_cost(*device_cost.hf_llama(shape, dtype), device_cost.lm_loss, stage=stage,
                                       multi_tensor=multi_tensor)


def session_tally(name: str, optimizer: str = "foreach", multi_tensor: bool = True,
                  sketch: bool = False) -> device_cost.Tally:
    """What the probe issues on the device over one step of ``name`` under a real stats session
    (``multi_tensor=False``: on CUDA without Triton; ``sketch``: with ``sketch=True``)."""
    shape, dtype = MODELS[name]
    return device_cost.session_step_cost(*device_cost.hf_llama(shape, dtype), device_cost.lm_loss,
                                         optimizer=optimizer, multi_tensor=multi_tensor, sketch=sketch)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    rule = "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_model",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="hf-llama-small,hf-llama7b-width",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--unstaged", action="store_true", help="small tensors queued, not staged")
    parser.add_argument("--no-multi-tensor", action="store_true",
                        help="CUDA without Triton: no multi-tensor kernel (the compiled and foreach paths)")
    parser.add_argument("--ops", type=int, default=6, help="costliest ops listed per model (6)")
    parser.add_argument("--quick", action="store_true", help="CI's: hf-llama-small-1layer only")
    parser.add_argument("--session", action="store_true",
                        help="a real stats session: every op the probe issues, with its caller")
    parser.add_argument("--sketch", action="store_true",
                        help="with --session: also the session with sketch=True (the stats mode's sketches)")
    parser.add_argument("--optimizers", default=",".join(device_cost.OPTIMIZERS),
                        help="with --session: AdamW implementations, of foreach, fused")
    parser.add_argument("--markdown", action="store_true", help="also print the tables as GitHub markdown")
    args = parser.parse_args(argv)
    names = ["hf-llama-small-1layer"] if args.quick else args.models.split(",")
    for name in names:
        if name not in MODELS:
            parser.error(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.session:
        optimizers = args.optimizers.split(",")
        for optimizer in optimizers:
            if optimizer not in device_cost.OPTIMIZERS:
                parser.error(f"--optimizers: unknown {optimizer!r}; choose from "
                             f"{', '.join(device_cost.OPTIMIZERS)}")
        return _print_session(console, names, optimizers, args.markdown, not args.no_multi_tensor,
                              (False, True) if args.sketch else (False,))
    header = ["model", "values", "MiB reduced", "read x", "written x", "launches", "launch budget",
              "host syncs", "within budget"]
    rows, details = [], []
    for name in names:
        tally = model_tally(name, stage=not args.unstaged, multi_tensor=not args.no_multi_tensor)
        checks = device_cost.budgets(tally)
        allowed = device_cost.launch_budget(tally)
        over = [b.name.split(" /")[0] for b in checks if not b.met]
        rows.append([name, str(tally.values), f"{tally.value_bytes / 2**20:.0f}", f"{checks[0].value:.4f}",
                     f"{checks[1].value:.5f}", str(tally.launches), f"{allowed:.0f}", str(tally.syncs),
                     "yes" if not over else "no: " + ", ".join(over)])
        for op in list(tally.by_op().values())[: args.ops]:
            share = [f"{op.read / tally.value_bytes:.5f}", f"{op.written / tally.value_bytes:.5f}"]
            details.append([name, op.name, *share, str(op.launches), str(op.syncs)])
    title = "statistics engine, accelerator path, one step" + (" (unstaged)" if args.unstaged else "")
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="left" if h == "model" else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    op_header = ["model", "op", "read x", "written x", "launches", "syncs"]
    ops = Table(title="costliest ops (x: per byte reduced)")
    for h in op_header:
        ops.add_column(h, justify="left" if h in ("model", "op") else "right")
    for r in details:
        ops.add_row(*r)
    console.print(ops)
    if args.markdown:
        print(_markdown(header, rows))
        print()
        print(_markdown(op_header, details))
    return 0


def _budget_row(tally: device_cost.Tally) -> list[str]:
    checks = device_cost.budgets(tally)
    over = [b.name.split(" /")[0] for b in checks if not b.met]
    return [str(tally.values), f"{tally.value_bytes / 2**20:.0f}", f"{checks[0].value:.4f}",
            f"{checks[1].value:.5f}", str(tally.launches), f"{device_cost.launch_budget(tally):.0f}",
            str(tally.syncs),
            "yes" if not over else "no: " + ", ".join(over)]


def _op_row(op: device_cost.OpCost, tally: device_cost.Tally) -> list[str]:
    return [op.name, op.caller, str(op.launches), f"{op.read / 2**20:.1f}", f"{op.written / 2**20:.1f}",
            f"{op.read / tally.value_bytes:.5f}", f"{op.written / tally.value_bytes:.5f}", str(op.syncs)]


def _print_session(console: Console, names: list[str], optimizers: list[str], markdown: bool,
                   multi_tensor: bool = True, sketches: tuple[bool, ...] = (False,)) -> int:
    header = ["model", "AdamW", "sketch", "values", "MiB reduced", "read x", "written x", "launches",
              "launch budget", "host syncs", "within budget"]
    op_header = ["model", "AdamW", "sketch", "op", "issued by (probe/...)", "launches", "MiB read",
                 "MiB written", "read x", "written x", "syncs"]
    rows, details = [], []
    for name in names:
        for optimizer in optimizers:
            for sketch in sketches:
                tally = session_tally(name, optimizer, multi_tensor=multi_tensor, sketch=sketch)
                rows.append([name, optimizer, "yes" if sketch else "no", *_budget_row(tally)])
                details += [[name, optimizer, "yes" if sketch else "no", *_op_row(op, tally)]
                            for op in tally.by_caller()]
    left = ("model", "AdamW", "sketch", "op", "issued by (probe/...)")
    titles = ("stats session, accelerator path, one step (the probe's ops only)",
              "every op the probe issued (x: per byte reduced)")
    for title, head, body in zip(titles, (header, op_header), (rows, details), strict=True):
        table = Table(title=title)
        for h in head:
            table.add_column(h, justify="left" if h in left else "right")
        for r in body:
            table.add_row(*r)
        console.print(table)
    if markdown:
        print(_markdown(header, rows))
        print()
        print(_markdown(op_header, details))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
