"""How fast ``probe compare`` reads and compares dumped tensors, per core.

Run from the repository root::

    python -m benchmarks.compare_throughput [--quick] [--threads N] [--markdown]

Dumps the same training step twice (a LLaMA-style model; the second run with a
shifted bias so the comparison has work to do on every later tensor), then
times ``probe.compare`` over the two dumps with ``torch.set_num_threads(N)``
(default 1: the figure is per core). Throughput counts the tensor bytes of both
runs that were compared on their data.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console

from benchmarks.overhead import machine_line, print_measures


def _dump(out: Path, quick: bool, shift: float) -> None:
    import probe
    from probe.demo.model import LlamaConfig
    from probe.demo.train import DemoTraining

    if quick:
        training = DemoTraining()
    else:
        config = LlamaConfig(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_layers=2,
                             num_heads=12, max_seq_len=256)
        training = DemoTraining(config, batch=4, seq=256)
    with torch.no_grad():
        training.model.layers[0].mlp.up_proj.weight[0, 0] += shift
    with probe.mode("dump", out=out, model=training.model) as session:
        training.step()
        session.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_throughput")
    parser.add_argument("--quick", action="store_true", help="the demo model: a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while comparing (1)")
    parser.add_argument("--dir", default=None, help="where to write the dumps (default: a temp dir)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import probe

    console = Console()
    console.print(f"[bold]compare throughput[/bold]  {machine_line()}")
    scratch = Path(tempfile.mkdtemp(prefix="probe-compare-bench-", dir=args.dir))
    try:
        with console.status("dumping two runs"):
            _dump(scratch / "a", args.quick, 0.0)
            _dump(scratch / "b", args.quick, 1e-3)
        torch.set_num_threads(args.threads)
        # Cold: the dumps' pages are not cached (direct I/O wrote them) and the
        # fused kernel compiles; warm: the same compare again, in this process.
        start = time.perf_counter()
        report = probe.compare(scratch / "a", scratch / "b")
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        probe.compare(scratch / "a", scratch / "b")
        warm_seconds = time.perf_counter() - start
        data_bytes = 0
        for c in report.comparisons:
            for op in (c.a, c.b):
                if op is None:
                    continue
                for t in c.outputs:
                    if t.kind == "data":
                        record = op.outputs[t.position]
                        itemsize = torch.empty((), dtype=getattr(torch, record.dtype)).element_size()
                        data_bytes += record.numel * itemsize
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gbs = data_bytes / seconds / 1e9
    warm_gbs = data_bytes / warm_seconds / 1e9
    rows = [
        ("ops compared", str(len(report.comparisons))),
        ("tensor data compared (both runs)", f"{data_bytes / 1e9:.2f} GB"),
        ("compare wall time: cold (reads disk, compiles) / warm", f"{seconds:.2f} s / {warm_seconds:.2f} s"),
        ("torch threads", str(args.threads)),
        ("throughput per core: cold / warm",
         f"{gbs / args.threads:.2f} / {warm_gbs / args.threads:.2f} GB/s"),
        ("first divergence", report.divergence.op_a.id if report.divergence else "none"),
    ]
    print_measures(console, "compare throughput", rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
