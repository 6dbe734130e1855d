"""Free-benchmark and upcast overhead, in the rows of msprobe's seed report (002).

Run from the repository root::

    python -m benchmarks.free_benchmark [--quick] [--steps N] [--device cuda] [--seq N] [--markdown]

Each row runs in a fresh child process (so peak memory is its own) on the
LLaMA2-7B-shaped block of ``benchmarks.models``: warm-up, then baseline steps
and probe steps alternating on the same model, so both time ratios come from
one process. Step times are the fastest of the timed steps: on a shared machine
noise only ever adds time, so the minimum is the stablest estimate of each
side's own cost. Peak memory after the baseline steps, then after the probe
steps: the host's max RSS on the CPU, the device's allocations on an accelerator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.models import MODELS, ModelSpec
from benchmarks.overhead import machine_line, peak_memory_mb

# (mode, phase, op scope, perturbation, handler, seed ratio: msprobe on Ascend, LLaMA2-7B 1 layer fp16)
ROWS = [
    ("check", "forward", "all", "improve_precision", "check", "14.4x"),
    ("check", "forward", "all", "add_noise", "check", "19.5x"),
    ("check", "forward", "all", "bit_noise", "check", "70.8x"),
    ("check", "forward", "all", "no_change", "check", "13.4x"),
    ("check", "backward", "all", "add_noise", "check", "43-124x (7B models)"),
    ("check", "backward", "softmax", "improve_precision", "check", "26x"),
    ("fix", "forward", "softmax", "to_cpu", "fix", "40x"),
    ("fix", "forward", "all", "improve_precision", "fix", "3.7-6.2x (7B models)"),
]


def _spec(model: str, seq: int | None) -> ModelSpec:
    return MODELS[model] if seq is None else MODELS[model].with_seq(seq)


def child(row: int, spec: ModelSpec, steps: int, device: str) -> dict[str, Any]:
    import probe

    warnings.filterwarnings("ignore")
    _, phase, scope, perturb, handler, _ = ROWS[row]
    training = spec.trainer(device=device)
    training.step()
    training.step()
    training.synchronize()
    base_peak = peak_memory_mb(device)
    options: dict[str, Any] = {"perturb": perturb, "handler": handler, "phases": [phase]}
    if scope != "all":
        options["ops"] = [f"*{scope}*"]
    base, probed = [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(steps + 1):
            start = time.perf_counter()
            training.step()
            training.synchronize()
            base.append(time.perf_counter() - start)
            with probe.mode("free_benchmark", out=f"{out}/{i}", model=training.model, **options) as s:
                start = time.perf_counter()
                training.step()
                s.step()
                training.synchronize()
                probed.append(time.perf_counter() - start)
        checks = probe.load(f"{out}/{steps}").checks()
    return {
        "base_s": min(base[1:]), "probe_s": min(probed[1:]),
        "base_peak_mb": base_peak, "probe_peak_mb": peak_memory_mb(device), "checks": len(checks),
        "failed": sum(c.verdict == "fail" for c in checks),
        "failed_ops": dict(Counter(c.name.removeprefix("aten.") for c in checks if c.verdict == "fail")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.free_benchmark")
    parser.add_argument("--quick", action="store_true", help="demo model, one step per row (CI)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (5)")
    parser.add_argument("--rows", help="comma-separated row numbers, from 1 (default: all)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--device", default="cpu", help="device to train on (default cpu)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model = args.model or ("demo" if args.quick else "llama7b-shaped")
    steps = 1 if args.quick else args.steps
    if args.child is not None:
        print(json.dumps(child(args.child, _spec(model, args.seq), steps, args.device)))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(f"[bold]free benchmark[/bold]  {machine_line(args.device)}  model {model}")
    table = Table(title=f"{model}: {_spec(model, args.seq).describe()}", title_justify="left")
    columns = ("mode", "phase", "op scope", "perturbation", "step time", "x baseline",
               "peak memory", "x baseline ", "checks (failed)", "msprobe (seed)", "failed ops")
    for column in columns:
        table.add_column(column, justify="right" if "x" in column or "time" in column else "left")
    lines = []
    picked = [int(r) - 1 for r in args.rows.split(",")] if args.rows else range(len(ROWS))
    for i in picked:
        mode, phase, scope, perturb, _, seed = ROWS[i]
        with console.status(f"row {i + 1} of {len(ROWS)}: {mode} {phase} {scope} {perturb}"):
            command = [sys.executable, "-m", "benchmarks.free_benchmark", "--child", str(i), "--model", model,
                       "--steps", str(steps), "--device", args.device]
            if args.seq:
                command += ["--seq", str(args.seq)]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            console.print(f"[red]row {i} failed[/red]: {result.stderr[-2000:]}")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        time_ratio = r["probe_s"] / r["base_s"]
        memory_ratio = r["probe_peak_mb"] / r["base_peak_mb"]
        cells = (
            mode, phase, scope, perturb,
            f"{r['base_s']:.2f} -> {r['probe_s']:.2f} s", f"{time_ratio:.2f}",
            f"{r['base_peak_mb']:.0f} -> {r['probe_peak_mb']:.0f} MB", f"{memory_ratio:.2f}",
            f"{r['checks']} ({r['failed']})", seed,
            ", ".join(f"{name} x{n}" for name, n in r["failed_ops"].items()),
        )
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    if args.markdown:
        print("\n" + machine_line(args.device) + "\n")
        print("| " + " | ".join(c.strip() for c in columns) + " |")
        print("|" + "---|" * len(columns))
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
