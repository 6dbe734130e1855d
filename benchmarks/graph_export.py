"""Graph export at the size the issue asks for: a step of ~10^5 ops.

Run from the repository root::

    python -m benchmarks.graph_export [--layers N] [--quick] [--markdown]

One run: a deep, narrow demo LLaMA (``--layers`` decoder layers, 256 by default, at width 32, so
that the step is dominated by op count, not by arithmetic) trains one step under
``probe.mode("stats")``; then, timed one by one on that step: loading the op
records and building the whole-step graph (``Run.graph``), attaching findings,
collapsing it to module calls, and writing each format (GraphML, node-link
JSON, DOT, Model Explorer) at op and module level, with the file sizes, and
reading GraphML and JSON back. ``--quick`` uses 4 layers (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.overhead import machine_line


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _size(paths: list[Path]) -> float:
    return sum(p.stat().st_size for p in paths) / 1e6


def trace_step(layers: int, out: Path) -> float:
    """Trains one step of the deep demo model under the stats mode; returns seconds."""
    import probe
    from probe.demo.model import LlamaConfig
    from probe.demo.train import DemoTraining

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers,
                         num_heads=2, max_seq_len=16)
    training = DemoTraining(config, batch=1, seq=8)
    with probe.mode("stats", out=out, model=training.model, async_flush=False) as session:
        _, seconds = _timed(training.step)
        session.step()
    return seconds


def measure(layers: int, workdir: Path) -> tuple[list[tuple[str, str, float, float | None]], int]:
    """Rows of (what, level, seconds, MB written) and the number of ops in the step."""
    import probe
    from probe.analysis.graph_findings import annotate
    from probe.analysis.module_graph import build_module_graph
    from probe.exporters import graph_formats, model_explorer

    run_dir = workdir / "run"
    rows: list[tuple[str, str, float, float | None]] = []
    rows.append(("trace one training step (stats)", "op", trace_step(layers, run_dir), None))
    run = probe.load(run_dir)
    graph, seconds = _timed(lambda: run.graph(0, 0))
    ops = graph.number_of_nodes()
    rows.append(("load records + build graph", "op", seconds, None))
    _, seconds = _timed(lambda: annotate(graph, run.checks(0, 0), None))
    rows.append(("attach findings", "op", seconds, None))
    modules, seconds = _timed(lambda: build_module_graph(graph, run.module_types(0, 0)))
    rows.append(("collapse to module calls", "module", seconds, None))

    for level, g in (("op", graph), ("module", modules)):
        for name, write in (("graphml", graph_formats.write_graphml), ("json", graph_formats.write_json),
                            ("dot", graph_formats.write_dot)):
            target = workdir / f"{level}.{name}"
            path, seconds = _timed(lambda write=write, g=g, target=target: write(g, target))
            rows.append((f"write {name}", level, seconds, _size([path])))
        if level == "op":
            _, seconds = _timed(lambda: graph_formats.read_graphml(workdir / "op.graphml"))
            rows.append(("read graphml back", level, seconds, None))
            _, seconds = _timed(lambda: graph_formats.read_json(workdir / "op.json"))
            rows.append(("read json back", level, seconds, None))
    graphs = {"step": graph, "step (modules)": modules}
    paths, seconds = _timed(lambda: model_explorer.write_model_explorer(workdir / "me.json", "bench", graphs))
    rows.append(("write model-explorer (+ overlays)", "both", seconds, _size(paths)))
    return rows, ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.graph_export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=256, help="decoder layers (256: ~10^5 ops per step)")
    parser.add_argument("--quick", action="store_true", help="4 layers: a smoke run")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    layers = 4 if args.quick else args.layers
    warnings.filterwarnings("ignore", message="probe: compiled regions run eagerly")
    console = Console(width=None if sys.stdout.isatty() else 160)
    with tempfile.TemporaryDirectory(prefix="probe-graph-bench-") as tmp:
        rows, ops = measure(layers, Path(tmp))
    title = f"graph export  {machine_line()}  model: demo LLaMA, {layers} layers, {ops} ops in the step"
    if args.markdown:
        print(title + "\n")
        print("| step | level | seconds | MB written |")
        print("| --- | --- | ---: | ---: |")
        for what, level, seconds, mb in rows:
            print(f"| {what} | {level} | {seconds:.2f} | {'' if mb is None else f'{mb:.1f}'} |")
        return
    table = Table(title=title)
    for column in ("step", "level", "seconds", "MB written"):
        table.add_column(column, justify="right" if column in ("seconds", "MB written") else "left")
    for what, level, seconds, mb in rows:
        table.add_row(what, level, f"{seconds:.2f}", "" if mb is None else f"{mb:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
