"""What the stats mode's ``distribution=True``, ``histogram=True`` and ``sketch=True`` add to a training step.

Run from the repository root::

    python -m benchmarks.distribution [--model hf-llama-small] [--rounds N] [--warmup N] [--threads N]

Configurations, alternating step by step in one process (the starting one rotating per round,
so drift of a shared machine reaches them alike), each with its own model built from the same
seed: ``baseline`` (no probe), ``stats``, ``stats+distribution``, ``stats+histogram``,
``stats+sketch``. A session
is entered around each step in a fresh directory; the step and its flush (``session.step()``)
are timed. Reported: the median step time and the overhead over ``stats`` and over ``baseline``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import probe
from benchmarks.models import MODELS

CONFIGS: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "stats": {},
    "stats+distribution": {"distribution": True},
    "stats+histogram": {"histogram": True},
    "stats+sketch": {"sketch": True},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf-llama-small", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    trainers = {name: spec.trainer(seed=0) for name in CONFIGS}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    root = Path(tempfile.mkdtemp(prefix="probe-distribution-bench-"))
    try:
        for round_ in range(args.warmup + args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                options = CONFIGS[name]
                trainer = trainers[name]
                if options is None:
                    start = time.perf_counter()
                    trainer.step()
                    trainer.synchronize()
                    elapsed = time.perf_counter() - start
                else:
                    out = root / f"{name}-{round_}"
                    with probe.mode("stats", out=out, **options) as session:
                        start = time.perf_counter()
                        trainer.step()
                        session.step()
                        trainer.synchronize()
                        elapsed = time.perf_counter() - start
                    shutil.rmtree(out, ignore_errors=True)
                if round_ >= args.warmup:
                    times[name].append(elapsed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"model {args.model} ({spec.describe()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, median in medians.items():
        over_stats = median / medians["stats"] - 1
        over_base = median / medians["baseline"] - 1
        print(f"{name:20s} {median * 1e3:9.1f} ms   vs stats {over_stats:+7.1%}   "
              f"vs baseline {over_base:+7.1%}")


if __name__ == "__main__":
    main()
