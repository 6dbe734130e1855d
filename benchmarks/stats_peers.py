"""The stats mode beside its peers on one workload, with the floor of its cost.

Run from the repository root::

    python -m benchmarks.stats_peers [--workload hf-llama-small] [--device cpu|cuda]
                                     [--dtype fp32|bf16] [--steps N] [--profile]

Each row runs in a fresh child process of ``benchmarks.report`` (its memory peak is its
own), alternating baseline and instrumented steps on one model; the ratio is the median
(min-max) of the per-pair step-time ratios. Rows: our statistics (every op's inputs and
outputs, as msprobe's L1 statistics dump), msprobe 26's statistics dump (its venv,
``.venv-msprobe``, when present), torch's ``DebugMode`` and our ``structure`` mode (op
records, no per-op work). The floor is the bytes the stats mode reads in one step
(each distinct value once) over the device's copy bandwidth. ``--profile`` prints a
``torch.profiler`` summary of one stats step (host and device time per op).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.overhead import machine_line
from benchmarks.report import ROWS, _default_python, _ratio, _run_child
from benchmarks.workloads import DTYPE_MODES, workloads

_ROW_LABELS = (
    "statistics, all ops",
    "statistics, all ops (msprobe)",
    "op log (torch DebugMode)",
    "op records, all ops (structure)",
)


def _row_index(label: str) -> int:
    return next(i for i, row in enumerate(ROWS) if row.label == label)


def _bandwidth(device: str) -> float:
    """Bytes per second of a large device copy (read + write), the best of five."""
    n = (1 << 28) if torch.device(device).type != "cpu" else (1 << 26)
    x = torch.empty(n, dtype=torch.float32, device=device).normal_()
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        if x.device.type != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        if x.device.type != "cpu":
            torch.accelerator.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() * x.element_size() / best


def stats_bytes(workload: str, device: str, dtype: str, profile: bool) -> tuple[int, int, str]:
    """(bytes the stats mode reads in one step, distinct values reduced, profiler table)."""
    import probe

    warnings.filterwarnings("ignore")
    trainer = workloads()[workload].trainer(device, dtype)
    trainer.step()
    sizes = {name: torch.empty(0, dtype=getattr(torch, name)).element_size()
             for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool", "uint8")}
    table = ""
    with tempfile.TemporaryDirectory() as out:
        for attempt in range(2 if profile else 1):  # the first step compiles and warms up
            run_dir = Path(out) / f"r{attempt}"
            profiler = None
            if profile and attempt == 1:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.device(device).type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                profiler = torch.profiler.profile(activities=activities)
                profiler.__enter__()
            with probe.mode("stats", out=run_dir, model=trainer.model, inputs=True) as session:
                trainer.step()
                session.step()
            trainer.synchronize()
            if profiler is not None:
                profiler.__exit__(None, None, None)
                on_gpu = torch.device(device).type == "cuda"
                key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
                table = profiler.key_averages().table(sort_by=key, row_limit=20)
        seen: set[int] = set()
        total = 0
        for op in probe.load(run_dir).ops(0):
            for record in (*op.inputs, *op.outputs):
                if record.stats is None or id(record.stats) in seen:
                    continue
                seen.add(id(record.stats))
                numel = 1
                for d in record.shape:
                    numel *= d
                total += numel * sizes.get(record.dtype, 4)
    return total, len(seen), table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stats_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="hf-llama-small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPE_MODES, default="fp32")
    parser.add_argument("--steps", type=int, default=5, help="step pairs per row after one warm-up pair")
    parser.add_argument("--profile", action="store_true",
                        help="print a torch.profiler summary of a stats step")
    parser.add_argument("--msprobe-python", default=None, help="Python with mindstudio-probe 26.x")
    args = parser.parse_args(argv)
    args.quick = False
    if args.workload not in workloads():
        parser.error(f"--workload: unknown {args.workload!r}; known: {list(workloads())}")
    msprobe = args.msprobe_python or _default_python("PROBE_MSPROBE_PYTHON", ".venv-msprobe")
    print(f"{args.workload}, {args.device}, {args.dtype}; {machine_line(args.device)}", flush=True)
    base = _run_child(sys.executable, args, args.workload, -1, args.steps)
    results: list[tuple[str, dict[str, Any] | None]] = []
    for label in _ROW_LABELS:
        row = ROWS[_row_index(label)]
        python = msprobe if row.runner == "msprobe" else sys.executable
        result = _run_child(python, args, args.workload, _row_index(label), args.steps) if python else None
        results.append((label, result))
        print(f"  {label}: {_ratio(result)[0] or 'not installed'}", flush=True)
    total, values, table = stats_bytes(args.workload, args.device, args.dtype, args.profile)
    bandwidth = _bandwidth(args.device)
    lines = [
        "| configuration | x step time, median (min-max) | x peak memory |",
        "|---|---:|---:|",
    ]
    for label, result in results:
        time_cell, memory_cell = _ratio(result) if result is not None else ("not installed", "")
        lines.append(f"| {label} | {time_cell} | {memory_cell} |")
    if "error" not in base:
        floor_s = total / bandwidth
        lines += [
            "",
            f"Baseline step: {1e3 * base['mean_s']:.1f} ms (mean of {args.steps}), peak memory "
            f"{base['memory_mb']:.0f} MB.",
            f"Floor: the stats mode reads {total / 1e9:.2f} GB a step ({values} distinct values); at "
            f"{bandwidth / 1e9:.0f} GB/s (a device copy, read + write) that is {1e3 * floor_s:.2f} ms, "
            f"x{1 + floor_s / base['mean_s']:.3f} of the baseline step.",
        ]
    text = "\n".join(lines)
    print(text)
    if table:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
