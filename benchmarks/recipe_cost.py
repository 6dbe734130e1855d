"""What the whatif mode costs beside the stats mode (issue 37: at most 2x the stats mode's
overhead), on the worked example's tiny LLaMA, CPU.

Run from the repository root::

    python -m benchmarks.recipe_cost [--steps 3] [--repeats 5]

Each configuration trains ``--steps`` steps in a session of its own, the configurations
alternating, ``--repeats`` times; a configuration's time is its least process CPU time (the
machine is shared: CPU time is what another process's load changes least), one torch thread.
Overhead: the time less plain training's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.recipe_envelope import train

CONFIGURATIONS: dict[str, tuple[Any, dict[str, Any]]] = {
    "plain": (None, {}),
    "stats": ("stats", {}),
    "whatif, mxfp8": ("whatif", {"recipes": ["mxfp8"]}),
    "whatif, fp8-e4m3 + mxfp8 + nvfp4": ("whatif", {"recipes": ["fp8-e4m3", "mxfp8", "nvfp4"]}),
}


def measure(steps: int, repeats: int) -> dict[str, float]:
    """The least CPU seconds of each configuration."""
    best = dict.fromkeys(CONFIGURATIONS, float("inf"))
    for _ in range(repeats):
        for name, (modes, options) in CONFIGURATIONS.items():
            with tempfile.TemporaryDirectory() as tmp:
                start = time.process_time()
                train(steps, 0, Path(tmp) / "run", modes, **options)
                best[name] = min(best[name], time.process_time() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    best = measure(args.steps, args.repeats)
    stats_overhead = best["stats"] - best["plain"]
    print("| configuration | CPU s | overhead s | overhead / stats' |")
    print("| --- | ---: | ---: | ---: |")
    for name, seconds in best.items():
        overhead = seconds - best["plain"]
        ratio = f"{overhead / stats_overhead:.2f}" if name != "plain" and stats_overhead > 0 else ""
        print(f"| {name} | {seconds:.2f} | {overhead:.2f} | {ratio} |")
    print(f"\n{args.steps} steps a session, least of {args.repeats}; torch {torch.__version__}, 1 thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
