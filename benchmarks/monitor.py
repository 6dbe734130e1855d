"""Step-time overhead of the training-state monitor, left on as users leave it.

Run from the repository root::

    python -m benchmarks.monitor [--model llama7b-shaped] [--steps N] [--device cuda] [--markdown]

Two trainers of the same model, seed and data: one plain, one under one
``probe.mode("monitor")`` session kept open for the whole run (the always-on
use; a session per step would time its set-up instead). After warm-up their
steps alternate, so both sides see the same machine state; the table gives
median and fastest step times and their ratios, and the ratio of the process's CPU
time per step (the monitor's writer thread included; steadier than wall time on a
shared machine). Configurations: ``layers``, every decoder layer watched for input,
output and both gradients (the issue's benchmark; msprobe's seed report watched 10
of 40 layers for +6%), ``submodules``, every module under the decoder layers with
its four slots (``layers.*``: 96 series on the 2-layer demo model), and
``layers+optimizer``, the layers plus weight gradients, Adam's moments and the
update ratio (``wg``/``mv``/``ur_distribution``). TensorBoard events are written
when the ``tensorboard`` package is installed, as users run it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.models import MODELS, ModelSpec
from benchmarks.overhead import machine_line

# Every decoder layer, as a monitor config spells it ("?": layers.0 to layers.99, not their submodules).
_LAYER_SLOTS = {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0",
                "output_grad": "tensor"}
MONITOR_EVERY_LAYER = {"targets": {"layers.?": _LAYER_SLOTS, "layers.??": _LAYER_SLOTS}}

CONFIGS: dict[str, dict[str, Any]] = {
    "layers": MONITOR_EVERY_LAYER,
    "submodules": {"targets": {"layers.*": _LAYER_SLOTS}},
    "layers+optimizer": {**MONITOR_EVERY_LAYER, "wg_distribution": True, "mv_distribution": True,
                         "ur_distribution": True},
    # Not in the default run: the opt-in distribution options (docs/monitor.md).
    "submodules+distribution": {"targets": {"layers.*": _LAYER_SLOTS}, "distribution": True},
    "submodules+histogram": {"targets": {"layers.*": _LAYER_SLOTS}, "histogram": True},
}
DEFAULT_CONFIGS = ("layers", "submodules", "layers+optimizer")


def measure(spec: ModelSpec, options: dict[str, Any], warmup: int, steps: int, device: str
            ) -> tuple[list[float], list[float], int, float]:
    """Alternating plain and monitored step times, the series monitored per step, and the
    ratio of the median CPU times per step (the process's, all threads)."""
    import probe

    plain, monitored = spec.trainer(device=device), spec.trainer(device=device)
    base: list[float] = []
    probed: list[float] = []
    cpu: dict[str, list[float]] = {"plain": [], "monitored": []}
    with tempfile.TemporaryDirectory() as out, \
            probe.mode("monitor", out=out, model=monitored.model, **options) as session:
        def plain_step() -> float:
            start, cpu_start = time.perf_counter(), time.process_time()
            plain.step()
            plain.synchronize()
            cpu["plain"].append(time.process_time() - cpu_start)
            return time.perf_counter() - start

        def monitored_step() -> float:
            start, cpu_start = time.perf_counter(), time.process_time()
            monitored.step()
            session.step()
            monitored.synchronize()
            cpu["monitored"].append(time.process_time() - cpu_start)
            return time.perf_counter() - start

        for i in range(warmup + steps):
            # Alternate which side goes first: whatever a step leaves behind (freed
            # memory, a busy writer thread) falls on both sides alike.
            if i % 2:
                b, p = plain_step(), monitored_step()
            else:
                p, b = monitored_step(), plain_step()
            if i >= warmup:
                base.append(b)
                probed.append(p)
        series = len(probe.load(out).monitor(0))
    cpu_ratio = statistics.median(cpu["monitored"][warmup:]) / statistics.median(cpu["plain"][warmup:])
    return base, probed, series, cpu_ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama7b-shaped")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"from {list(CONFIGS)}")
    parser.add_argument("--quick", action="store_true", help="demo model, 1 warm-up, 3 steps (CI)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, warmup, steps = ("demo", 1, 3) if args.quick else (args.model, args.warmup, args.steps)
    spec = MODELS[model] if args.seq is None else MODELS[model].with_seq(args.seq)
    names = [c.strip() for c in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    warnings.filterwarnings("ignore", message="probe: compiled regions run eagerly")
    console = Console(width=None if sys.stdout.isatty() else 140)
    title = (f"monitor overhead  {machine_line(args.device)}\n"
             f"{model}: {spec.describe()}; {steps} steps per side")
    table = Table(title=title, title_justify="left")
    columns = ("config", "series/step", "plain median ms", "monitored median ms", "x (medians)",
               "plain min ms", "monitored min ms", "x (minima)", "x (CPU time)")
    for column in columns:
        table.add_column(column, justify="left" if column == "config" else "right")
    lines = []
    for name in names:
        with console.status(f"{name}: {warmup + steps} steps per side"):
            base, probed, series, cpu_ratio = measure(spec, CONFIGS[name], warmup, steps, args.device)
        median_base, median_probed = statistics.median(base), statistics.median(probed)
        cells = (name, str(series), f"{1e3 * median_base:.1f}", f"{1e3 * median_probed:.1f}",
                 f"{median_probed / median_base:.3f}", f"{1e3 * min(base):.1f}", f"{1e3 * min(probed):.1f}",
                 f"{min(probed) / min(base):.3f}", f"{cpu_ratio:.3f}")
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    if args.markdown:
        print(f"\n{title}\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
