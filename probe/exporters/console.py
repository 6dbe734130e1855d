"""Terminal rendering of run summaries with rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from probe.analysis.summary import Extreme, StepSummary
from probe.rundir.reader import OpRecord, Run

PHASE_ORDER = ("forward", "backward", "recompute", "optimizer")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _op_label(op: OpRecord) -> str:
    return f"{op.name} [dim]@ {op.module or '<outside modules>'} ({op.phase})[/dim]"


def _extremes_table(title: str, rows: list[Extreme]) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("op id")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(str(row.op.index), row.op.id, _fmt(row.value))
    return table


def render_step(console: Console, summary: StepSummary) -> None:
    status = "" if summary.complete else f" [red]incomplete: {summary.reason}[/red]"
    console.rule(f"step {summary.step} · rank {summary.rank}{status}")
    counts = Table(show_edge=False, pad_edge=False)
    phases = [p for p in PHASE_ORDER if p in summary.phase_counts]
    for phase in phases:
        counts.add_column(phase, justify="right")
    counts.add_column("total", justify="right")
    total = sum(summary.phase_counts.values())
    counts.add_row(*(str(summary.phase_counts[p]) for p in phases), str(total))
    console.print(counts)
    bad = summary.first_nonfinite
    if bad is None:
        console.print("first non-finite op: [green]none[/green]")
    else:
        finite = {True: "finite", False: "non-finite", None: "unknown"}[bad.inputs_finite]
        console.print(f"first non-finite op: [red]{_op_label(bad)}[/red]  id {bad.id}")
        console.print(f"  its inputs were {finite}")
    console.print(_extremes_table("largest |max|", summary.largest_abs_max))
    console.print(_extremes_table("largest norm", summary.largest_norm))


def render_run(console: Console, run: Run, summaries: list[StepSummary]) -> None:
    modes = run.info.get("modes")
    console.print(f"[bold]{run.path}[/bold]  modes {modes}  ranks {run.ranks}  steps {run.steps}")
    for summary in summaries:
        render_step(console, summary)
    for step, rank in run.unfinished_steps:
        console.print(f"[red]step {step} rank {rank}: flush never finished (the process died)[/red]")
