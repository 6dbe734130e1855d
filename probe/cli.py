"""The ``probe`` command.

Exit codes: 0 success; 1 a check the command was asked to make failed; 2 bad
usage or unreadable input, with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only what --help needs is imported here: the commands import what they compute with (torch
# among it, 1-2 s) when they run. tests/test_cli_help.py holds every --help to importing no torch.
from probe.errors import ProbeError
from probe.vocabulary.option_values import PHASES

if TYPE_CHECKING:
    from rich.console import Console

    from probe.rundir.run import Run

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep its one line
        self.exit(EXIT_USAGE, f"probe: error: {message}\n")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0-65535")
    return port


_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(text: str) -> int:
    """``4GiB``, ``512M``, ``1000000``: a positive number of bytes (units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    size = int(float(match[1]) * _BYTE_UNITS[match[2].lower()]) if match else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size in bytes (e.g. 4GiB, 512M)")
    return size


def _dangling(path: Path) -> bool:
    return path.is_symlink() and not path.exists()


def _output_dir(text: str, option: str) -> Path:
    """The directory ``option`` names, created if absent; refused before any work when it cannot be."""
    path = Path(text)
    if _dangling(path):
        raise ProbeError(f"{option} {text!r} is a symbolic link to nothing")
    if path.exists() and not path.is_dir():
        raise ProbeError(f"{option} {text!r} is a file; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ProbeError(f"{option}: cannot create {text!r}: {e.strerror or e}") from None
    return path


def _output_file(text: str, option: str) -> Path:
    """The file ``option`` names: not a directory, not a dangling link, in an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise ProbeError(f"{option} {text!r} is a directory; give a file name")
    if _dangling(path):
        raise ProbeError(f"{option} {text!r} is a symbolic link to nothing")
    if not path.parent.is_dir():
        raise ProbeError(f"{option} {text!r}: {str(path.parent)!r} is not a directory")
    return path


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    import torch

    import probe
    from probe.analysis.run_summary import RunSummary
    from probe.analysis.summary import summarize
    from probe.demo.train import DemoTraining, train
    from probe.exporters.console import progress_bar, render_run

    if args.steps < 1:
        raise ProbeError(f"--steps must be at least 1, got {args.steps}")
    out = Path(args.out) if args.out else Path("probe_runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    # The demo model has no compiled regions: the notice that they would run eagerly is noise here.
    warnings.filterwarnings("ignore", message="probe: compiled regions run eagerly")
    # Upcast computes low-precision ops in fp32: on the fp32 model it would have nothing to do.
    dtype = torch.bfloat16 if "upcast" in modes else torch.float32
    training = DemoTraining(dtype=dtype)
    # The monitor watches what it is told to: in the demo, every decoder layer and the weight gradients.
    layer = {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0", "output_grad": "tensor"}
    demo_monitor = probe.Monitor(targets={"layers.?": layer}, wg_distribution=True)
    session = probe.mode(
        [demo_monitor if name == demo_monitor.mode else name for name in modes], out=out,
        overwrite=args.overwrite, stack=args.stack, model=training.model,
    )
    precision = str(dtype).removeprefix("torch.")
    console.print(f"training the built-in tiny LLaMA ({precision}) for {args.steps} steps under {modes} "
                  f"-> {out}")
    with progress_bar(console, "[progress.description]{task.description}") as progress:
        task = progress.add_task("steps", total=args.steps)

        def on_step(step: int, loss: float) -> None:
            progress.update(task, advance=1, description=f"loss {loss:.4f}")

        losses = train(training, args.steps, session=session, on_step=on_step)
    console.print("losses: " + ", ".join(f"{loss:.4f}" for loss in losses))
    if "upcast" in modes:
        _show_upcast(console, args.steps, losses)
    run = probe.load(out)
    render_run(console, RunSummary(run, summarize(run, top=args.top)))
    return EXIT_OK


def _show_upcast(console: Console, steps: int, upcast: list[float]) -> None:
    """What upcast did on the demo: its losses beside the same training, unprobed, in bf16 and
    in fp32 (what upcasting every module approaches)."""
    import torch

    from probe.demo.train import DemoTraining, train

    plain = {dtype: train(DemoTraining(dtype=dtype), steps) for dtype in (torch.bfloat16, torch.float32)}

    def gap(losses: list[float]) -> float:
        return max(abs(a - b) for a, b in zip(losses, plain[torch.float32], strict=True))

    console.print("upcast computed the bf16 model's ops in float32, carrying float32 from op to op "
                  "(the program sees bf16):")
    for label, losses in (("bf16, no probe", plain[torch.bfloat16]), ("bf16 + upcast", upcast),
                          ("fp32, no probe", plain[torch.float32])):
        console.print(f"  {label:<15} losses {', '.join(f'{v:.4f}' for v in losses)}  "
                      f"(largest difference from fp32 {gap(losses):.2g})")


def _cmd_summary(args: argparse.Namespace, console: Console) -> int:
    import probe
    from probe.analysis.run_summary import RunSummary
    from probe.analysis.summary import summarize
    from probe.exporters.console import render_run

    plot = None
    if args.plot is not None:  # checked before the run is read: a typo costs nothing
        from probe.exporters import plots

        plots.check_format(args.plot)
        plots.require("--plot")
        plot = _output_file(args.plot, "--plot")
    elif args.step is not None or args.rank is not None:
        raise ProbeError("--step and --rank choose the step to plot: give --plot FILE.png or FILE.svg")
    run = probe.load(args.run)
    place = run.resolve(_one_int(args.step), _one_int(args.rank)) if plot is not None else None
    render_run(console, RunSummary(run, summarize(run, top=args.top)))
    if plot is not None and place is not None:
        _write_module_plot(console, run, plot, *place)
    return EXIT_OK


def _write_module_plot(console: Console, run: Run, path: Path, step: int, rank: int) -> None:
    from probe.analysis.summary import module_magnitudes
    from probe.exporters import plots

    magnitudes = module_magnitudes(run, step, rank)
    title = f"{run.path.name}: largest |output| per module, step {step}, rank {rank}"
    plots.save(plots.module_chart(magnitudes, title), path)
    console.print(f"wrote {path} ({len(magnitudes)} modules, step {step}, rank {rank})")


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ProbeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    import probe
    from probe.exporters.msprobe import export_msprobe

    run = probe.load(args.run)
    paths = export_msprobe(run, args.out, steps=_int_list(args.steps), ranks=_int_list(args.ranks))
    console.print(f"wrote {len(paths)} msprobe dump(s) under {args.out}; compare two exports with")
    console.print("  msprobe compare -tp <target>/step<N> -gp <golden>/step<N> -o <dir>")
    return EXIT_OK


def _cmd_consistency(args: argparse.Namespace, console: Console) -> int:
    import probe
    from probe.analysis.consistency import check_consistency
    from probe.exporters.console import render_consistency

    run = probe.load(args.run)
    if len(run.ranks) < 2:
        raise ProbeError(f"{args.run!r} holds only rank(s) {run.ranks}: a consistency check needs two")
    report = check_consistency(run, steps=_int_list(args.steps), tolerance=args.tolerance)
    if args.out:
        _output_file(args.out, "-o").write_text(json.dumps(report.summary, indent=1, default=repr))
    render_consistency(console, report, limit=args.top)
    return EXIT_OK if report.consistent else EXIT_CHECK_FAILED


def _pairs(texts: list[str], option: str, expected: str) -> dict[str, str] | None:
    """``KEY=VALUE`` items, separated by commas (in one text or several), as a dict."""
    pairs = [item.split("=", 1) for text in texts for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 or not pair[0].strip() or not pair[1].strip() for pair in pairs):
        raise ProbeError(f"{option}: expected {expected}, got {','.join(texts)!r}")
    return {key.strip(): value.strip() for key, value in pairs} or None


def _partitions(items: list[str] | None) -> dict[str, str | int] | None:
    """``--partition MODULE=colwise|rowwise|DIM`` (repeated, or comma-separated) as a dict."""
    pairs = _pairs(items or [], "--partition", "MODULE=colwise|rowwise|DIM")
    return {module: int(value) if value.isdigit() else value for module, value in pairs.items()} \
        if pairs else None


def _module_map(text: str | None) -> dict[str, str] | None:
    return _pairs([text] if text else [], "--module-map", "b_name=a_name pairs separated by commas")


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    import probe
    from probe.analysis.compare_pieces import cluster_executor
    from probe.exporters.console import progress_bar, render_compare

    out = _output_dir(args.out, "-o") if args.out else None
    if args.processes is not None and args.processes < 1:
        raise ProbeError(f"--processes must be at least 1, got {args.processes}")
    with contextlib.ExitStack() as stack, progress_bar(console, "comparing") as bar:
        executor = stack.enter_context(cluster_executor(args.scheduler)) if args.scheduler else None
        task = bar.add_task("compare", total=None)
        report = probe.compare(
            args.run_a, args.run_b, steps=_int_list(args.steps), ranks=_int_list(args.ranks),
            module_map=_module_map(args.module_map), partitions=_partitions(args.partition),
            **({} if args.replay_limit is None else {"replay_limit": args.replay_limit}),
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            processes=args.processes, executor=executor,
        )
    if out is not None:
        report.to_csv(out / "report.csv")
        report.to_json(out / "report.json")
        report.to_html(out / "report.html")
        report.write_overlay(out / "overlay.json")
        if report.identity is not None:
            report.identity.to_csv(out / "identity.csv")
    render_compare(console, report, args.out)
    if args.fail_on_divergence and not report.ok:  # a divergence, or ops whose data was missing
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _cmd_graph(args: argparse.Namespace, console: Console) -> int:
    from probe.exporters.graph_export import export_graph

    out = _output_file(args.out, "-o")
    paths = export_graph(args.run, out, args.format, step=_one_int(args.step), rank=_one_int(args.rank),
                         phase=args.phase, level=args.level, compare=args.compare)
    console.print(f"wrote {paths[0]}")
    for extra in paths[1:]:
        console.print(f"  overlay {extra}")
    if args.format == "model-explorer":
        console.print("view with: probe view RUN (or model-explorer FILE --node_data_paths=OVERLAY,...)")
    return EXIT_OK


def _cmd_view(args: argparse.Namespace, console: Console) -> int:
    import tempfile

    from rich.console import Console

    import probe
    from probe.exporters.graph_export import model_explorer_graphs
    from probe.exporters.model_explorer import serve, write_model_explorer

    run = probe.load(args.run)
    step, rank = run.resolve(_one_int(args.step), _one_int(args.rank))
    label, graphs = model_explorer_graphs(run, step, rank, args.phase, args.compare)
    kept = _output_dir(args.out, "--out") if args.out else None
    with tempfile.TemporaryDirectory(prefix="probe-view-") as scratch:
        out = kept or Path(scratch)
        paths = write_model_explorer(out / "graph.json", label, graphs)
        console.print(f"graph and {len(paths) - 1} overlay(s) in {out}")
        stdout = Console(file=sys.stdout, soft_wrap=True)  # bound now: the server's output is hidden
        serve(paths, label, graphs, host=args.host, port=args.port, open_browser=not args.no_browser,
              announce=lambda url: stdout.print(f"Model Explorer: {url}", markup=False, highlight=False))
    return EXIT_OK


_DTYPES = {"float64": "float64", "fp64": "float64", "float32": "float32", "fp32": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _cmd_replay(args: argparse.Namespace, console: Console) -> int:
    import torch

    import probe
    from probe.exporters.console import progress_bar, render_replay

    dtype = None
    if args.dtype is not None:
        if args.dtype not in _DTYPES:
            raise ProbeError(f"--dtype {args.dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = getattr(torch, _DTYPES[args.dtype])
    step, rank = _one_int(args.step), _one_int(args.rank)
    run = probe.load(args.run)
    step, rank = run.resolve(step, rank)
    if not run.has_dump(step, rank):  # said before anything runs, not as a table of "no dump" rows
        raise ProbeError(f"replay needs dumps: step {step} of rank {rank} of {args.run!r} holds none; "
                         "record with probe.mode('dump', ...) or probe.mode(['stats', 'dump'], ...) "
                         "(probe demo --mode stats,dump)")
    if args.op_id is None:
        total = run.op_count(step, rank)
        with progress_bar(console, "replaying") as progress:
            task = progress.add_task("replay", total=total)
            results = probe.replay_step(run, step, rank, device=args.device, dtype=dtype,
                                        progress=lambda: progress.advance(task),
                                        memory_budget=args.memory_budget)
        ranked = [r for r in results if "skipped" not in r]
        render_replay(console, ranked[: args.top], skipped=[r for r in results if "skipped" in r])
        return EXIT_OK
    result = probe.replay(run, args.op_id, device=args.device, dtype=dtype, step=step, rank=rank,
                          memory_budget=args.memory_budget)
    render_replay(console, [result])
    return EXIT_OK


def _one_int(text: str | None) -> int | None:
    values = _int_list(text)
    return None if values is None else values[0]


BUILTIN_MODES: dict[str, str] = {
    "stats": "min, max, mean, L2 norm and NaN/Inf counts of every op's tensors (what compare reads)",
    "dump": "the tensors themselves, with the calls that made them (what replay re-runs)",
    "free_benchmark": "each op re-run on perturbed inputs: fragile ops, without a reference run",
    "upcast": "low-precision modules computed in fp32 (changes training; the demo trains in bf16 for it)",
    "monitor": "always-on series of chosen modules, parameters and gradients, with anomaly alerts",
    "structure": "the op records and op graph alone (the cheapest trace)",
    "checksums": "checksums of the parameters, inputs and RNG states at each step",
    "whatif": "each matmul operand's losses under low-precision recipes (what probe plan ranks)",
    "fake_quant": "the matmuls of a plan computed from quantized operands (changes training)",
}
"""The built-in modes and what each records, for ``--help`` without importing them (and torch):
``tests/test_cli_help.py`` checks the names against the registry."""


def _help_formatter(prog: str) -> argparse.HelpFormatter:
    # The epilogs are examples laid out by hand: keep their lines.
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def _subcommand(sub: Any, name: str, summary: str, example: str, more: str = "") -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with ``more`` (laid out by hand) and ``example``
    (one or more command lines)."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                          epilog=more + "example:\n" + example + "\n", formatter_class=_help_formatter)


def _run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", help="step (default: the run's first)")
    parser.add_argument("--rank", help="rank (default: the run's first)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="probe", description="Precision debugging for PyTorch training.",
                     epilog="example:\n  probe demo --mode stats --out runs/a\n  probe summary runs/a\n\n"
                            "`probe COMMAND --help` shows a command's options and an example\n",
                     formatter_class=_help_formatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    demo = _subcommand(sub, "demo", "train the built-in tiny LLaMA-style model under a mode",
                       "  probe demo --mode stats,dump --steps 2 --out runs/demo\n"
                       "  probe replay runs/demo",
                       more="modes:\n" + "".join(f"  {name:<15}{what}\n"
                                                  for name, what in BUILTIN_MODES.items()) + "\n")
    demo.add_argument("--out", help="run directory (default: probe_runs/demo-<time>)")
    demo.add_argument("--mode", default="stats", metavar="MODE[,MODE...]",
                      help=f"the mode, or several joined by commas: {', '.join(BUILTIN_MODES)} "
                           "(described below; default: stats)")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    demo.add_argument("--stack", action="store_true", help="record Python call sites (default: off)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace an existing run directory (default: refuse)")
    demo.add_argument("--top", type=int, default=5, help="rows in the largest-value tables (default: 5)")
    demo.set_defaults(func=_cmd_demo)

    summary = _subcommand(sub, "summary", "per-step summary of a run directory",
                          "  probe summary runs/a --top 10\n"
                          "  probe summary runs/a --plot modules.svg --step 2")
    summary.add_argument("run", help="run directory")
    summary.add_argument("--top", type=int, default=5, help="rows in the largest-value tables (default: 5)")
    summary.add_argument("--plot", metavar="FILE",
                         help="also write a chart of one step's largest |output| per module, .png or .svg "
                              "(needs probe[plot]; default: no chart)")
    summary.add_argument("--step", help="with --plot: the step to plot (default: the first)")
    summary.add_argument("--rank", help="with --plot: the rank to plot (default: the first)")
    summary.set_defaults(func=_cmd_summary)

    export = _subcommand(sub, "export", "write a run in another tool's format",
                         "  probe export msprobe runs/a exports/a")
    export_kind = export.add_subparsers(dest="format", required=True, parser_class=_Parser,
                                        metavar="FORMAT")
    msprobe = _subcommand(export_kind, "msprobe", "msprobe's dump layout (dump.json, .pt tensors)",
                          "  probe export msprobe runs/a exports/a --steps 0,1\n"
                          "  msprobe compare -tp exports/b/step0 -gp exports/a/step0 -o cmp")
    msprobe.add_argument("run", help="run directory")
    msprobe.add_argument("out", help="empty output directory")
    msprobe.add_argument("--steps", help="comma-separated steps (default: all)")
    msprobe.add_argument("--ranks", help="comma-separated ranks (default: all)")
    msprobe.set_defaults(func=_cmd_export)

    compare = _subcommand(sub, "compare", "compare run B against the reference run A",
                          "  probe compare runs/fp32 runs/bf16 -o cmp\n"
                          "  probe compare runs/a runs/b --steps 0 --fail-on-divergence")
    compare.add_argument("run_a", help="reference run directory")
    compare.add_argument("run_b", help="run directory under test")
    compare.add_argument("-o", "--out", help="write report.csv, report.json, report.html, overlay.json, "
                         "identity.csv here (default: print only)")
    compare.add_argument("--steps", help="comma-separated steps (default: all in common)")
    compare.add_argument("--ranks", help="comma-separated ranks (default: all in common)")
    compare.add_argument("--module-map", help="rename run B's modules: b_name=a_name,... (default: none)")
    compare.add_argument("--partition", action="append", metavar="MODULE=colwise|rowwise|DIM",
                         help="tensor parallelism written by hand (no DTensor): the dim a module's "
                              "weight is sharded along (colwise: output features, rowwise: input "
                              "features), so that its shards fold into whole tensors; repeatable, "
                              "MODULE may be a glob (default: none)")
    compare.add_argument("--replay-limit", type=int, metavar="N",
                         help="replay an op in fp64 to judge it only when its inputs hold at most N "
                              "elements (default: probe.compare's, 4M; 0: never)")
    compare.add_argument("--processes", type=int, metavar="N",
                         help="compare the pieces of work (a step of a rank; a step of a folded run) in N "
                              "processes (default: one per rank compared rank by rank, else 1)")
    compare.add_argument("--scheduler", metavar="ADDRESS",
                         help="compare the pieces on the Dask cluster whose scheduler is at ADDRESS "
                              "(tcp://host:8786; the cluster extra), whose workers read the runs "
                              "under the same paths (default: this machine)")
    compare.add_argument("--fail-on-divergence", action="store_true",
                         help="exit 1 if a divergence is found or an op could not be compared "
                              "(default: exit 0 whatever was found)")
    compare.set_defaults(func=_cmd_compare)

    consistency = _subcommand(sub, "consistency",
                              "check that ranks agree on replicated values (exit 1 if one differs)",
                              "  probe consistency runs/ddp --steps 0,1 -o findings.json")
    consistency.add_argument("run", help="run directory of a multi-rank job (mode stats)")
    consistency.add_argument("--steps", help="comma-separated steps (default: all on two or more ranks)")
    consistency.add_argument("--tolerance", type=float, default=0.0,
                             help="relative difference still taken as equal (default: 0, bit-identical)")
    consistency.add_argument("-o", "--out",
                             help="write the findings as JSON to this file (default: print only)")
    consistency.add_argument("--top", type=int, default=10, help="disagreements to print (default: 10)")
    consistency.set_defaults(func=_cmd_consistency)

    graph = _subcommand(sub, "graph", "write a step's op graph (GraphML, DOT, JSON, Model Explorer)",
                        "  probe graph runs/a --format dot -o step0.dot --level module\n"
                        "  probe graph runs/b --format graphml -o b.graphml --compare cmp")
    graph.add_argument("run", help="run directory")
    graph.add_argument("--format", required=True, choices=["graphml", "dot", "json", "model-explorer"],
                       help="graphml (yEd, Gephi, networkx), dot (Graphviz), json (node-link), or "
                            "model-explorer (Google's Model Explorer: every phase, op and module level, "
                            "with overlays); required")
    graph.add_argument("-o", "--out", required=True, help="output file (overlays are written beside it)")
    _run_options(graph)
    graph.add_argument("--phase", help=f"the phase to draw: {', '.join(PHASES)} or all "
                       "(default: forward; model-explorer: every phase)")
    graph.add_argument("--level", default="op", choices=["op", "module"],
                       help="op: a node per op call; module: a node per module call, ops folded in "
                            "(default: op)")
    graph.add_argument("--compare", help="colour by a comparison: the directory `probe compare -o` wrote "
                       "(default: no colours)")
    graph.set_defaults(func=_cmd_graph)

    view = _subcommand(sub, "view", "open a step's graph in Model Explorer (needs probe[viewer])",
                       "  probe view runs/b --compare cmp --no-browser --port 8081")
    view.add_argument("run", help="run directory")
    _run_options(view)
    view.add_argument("--phase", help=f"only this phase: {', '.join(PHASES)} (default: every phase)")
    view.add_argument("--compare", help="colour by a comparison: the directory `probe compare -o` wrote "
                      "(default: no colours)")
    view.add_argument("--out", help="keep the exported files here (default: a temporary directory)")
    view.add_argument("--host", default="localhost",
                      help="the address the viewer listens on; 0.0.0.0 for every interface "
                           "(default: localhost)")
    view.add_argument("--port", type=_port, default=8080, help="the port it listens on (default: 8080)")
    view.add_argument("--no-browser", action="store_true",
                      help="print the address, do not open a browser (default: open one)")
    view.set_defaults(func=_cmd_view)

    replay = _subcommand(sub, "replay", "re-run dumped ops from their dumped inputs and compare",
                         "  probe demo --mode dump --out runs/d\n"
                         "  probe replay runs/d --dtype float64 --top 10\n"
                         "  probe replay runs/d <op id from the table> --step 0")
    replay.add_argument("run", help="run directory (recorded with the dump mode)")
    replay.add_argument("op_id", nargs="?", help="the op to replay (default: every dumped op of the step)")
    replay.add_argument("--device", default="cpu", help="device to replay on (default: cpu)")
    replay.add_argument("--dtype", metavar="DTYPE",
                        help="compute in this precision: float64, float32, bfloat16, float16 or their "
                             "short names fp64, fp32, bf16, fp16 (default: the dumped inputs' own)")
    _run_options(replay)
    replay.add_argument("--top", type=int, default=20, help="rows of the ranking (default: 20)")
    replay.add_argument("--memory-budget", type=_byte_size, metavar="SIZE",
                        help="refuse, before anything is allocated, an op whose replay would take more "
                             "(e.g. 4GiB; default: a quarter of physical memory)")
    replay.set_defaults(func=_cmd_replay)

    plan = _subcommand(sub, "plan", "rank a run's matmuls by the risk of a low-precision recipe and write "
                       "which keep high precision",
                       "  probe plan runs/w --recipe mxfp8 --keep-fraction 0.1 -o plan.json")
    plan.add_argument("run", help="run directory (recorded with the whatif mode)")
    plan.add_argument("--recipe", required=True,
                      help="a recipe the run recorded (fp8-e4m3, fp8-e5m2, fp8-e4m3-delayed, mxfp8, "
                           "nvfp4, or one of its own)")
    plan.add_argument("--keep-fraction", type=float, default=0.1,
                      help="share of the matmuls, the riskiest, kept in high precision (default: 0.1)")
    plan.add_argument("-o", "--output", default="plan.json", help="the plan file (default: plan.json)")
    plan.add_argument("--rank", type=int, help="rank (default: the run's first)")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranking shown (default: 10)")
    plan.set_defaults(func=_cmd_plan)

    repro = _subcommand(sub, "repro", "reduce a compiled region to a standalone script that "
                        "fails compiled and passes eager",
                        "  probe repro runs/c compiled.forward -o repro.py && python repro.py")
    repro.add_argument("run", help="run directory (compiled='keep', compiled_inputs=True)")
    repro.add_argument("op_id", help="the compiled region op (compiled.<function>)")
    repro.add_argument("-o", "--output", required=True, help="the script to write (its inputs go beside it)")
    repro.add_argument("--step", type=int, help="step (default: the first that recorded the region's inputs)")
    repro.set_defaults(func=_cmd_repro)
    return parser


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from probe.modes.registry import RUN_COMMANDS
    from probe.rundir.run import load

    made, path = RUN_COMMANDS["plan"](load(args.run), args.recipe, args.output, args.keep_fraction, args.rank)
    for entry in made.ranking[: args.top]:
        kept = "keep" if entry["op"] in made.keep else "    "
        console.print(f"{kept}  {entry['reason']}", highlight=False, markup=False)
    console.print(f"{len(made.keep)} of {len(made.ranking)} matmuls keep high precision under "
                  f"{made.recipe.name}; plan written to {path}", highlight=False, markup=False)
    return EXIT_OK


def _cmd_repro(args: argparse.Namespace, console: Console) -> int:
    from probe.analysis.compiled_judge import load_region, region_calls
    from probe.analysis.repro import reduce_region, write_script
    from probe.rundir.run import Run

    run = Run(args.run)
    calls = region_calls(run, args.op_id, args.step)
    if not calls:
        raise ProbeError(f"{args.run!r} recorded no inputs of compiled region {args.op_id!r}"
                         + (f" in step {args.step}" if args.step is not None else "")
                         + " (record with compiled='keep', compiled_inputs=True)")
    step, rank = calls[0]
    region = load_region(run, step, rank, args.op_id)
    reduction = reduce_region(region)
    path = write_script(region, reduction, Path(args.output), str(run.path))
    console.print(f"wrote {path} ({len(reduction.nodes)} graph node(s): {', '.join(reduction.nodes)}; "
                  f"{reduction.compiles} Inductor compiles); it fails compiled and passes with --eager")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # --help and usage errors exit here, before torch
    from probe.exporters.console import make_console

    console = make_console()
    try:
        return args.func(args, console)
    except ProbeError as e:
        print(f"probe: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # an output the checks above could not foresee (disk full, a race)
        where = f" {e.filename!r}" if e.filename else ""
        print(f"probe: error: cannot write or read{where}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
