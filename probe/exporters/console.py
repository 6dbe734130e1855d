"""Terminal rendering of run summaries with rich tables."""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from probe.analysis.compare import Report
from probe.analysis.consistency import ConsistencyReport
from probe.analysis.run_identity import Identity
from probe.analysis.run_summary import RunSummary
from probe.analysis.summary import Extreme, StepSummary
from probe.analysis.verdicts import NOT_COMPARED, VERDICTS
from probe.rundir.run import OpRecord
from probe.vocabulary.option_values import PHASES

LOG_WIDTH = 200
"""Columns when the output is not a terminal (a log, CI): wide enough that op ids stay on one line."""


def make_console(file: object = None) -> Console:
    """The console of the ``probe`` command: the terminal's width on a terminal, else
    :data:`LOG_WIDTH`, so tables in logs do not wrap op ids over several lines."""
    stream = sys.stdout if file is None else file
    is_terminal = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream, width=None if is_terminal else LOG_WIDTH)  # type: ignore[arg-type]


def progress_bar(console: Console, label: str = "{task.description}") -> Progress:
    """The progress bar of long commands: label, bar, done/total, elapsed; gone when done."""
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


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
    if summary.unreadable is not None:
        console.print(_step_line(summary), style="red", markup=False, highlight=False)
        return
    status = "" if summary.complete else f" [red]incomplete: {summary.reason}[/red]"
    console.rule(f"step {summary.step} · rank {summary.rank}{status}")
    counts = Table(show_edge=False, pad_edge=False)
    phases = [p for p in PHASES if p in summary.phase_counts]
    for phase in phases:
        counts.add_column(phase, justify="right")
    counts.add_column("total", justify="right")
    total = sum(summary.phase_counts.values())
    counts.add_row(*(str(summary.phase_counts[p]) for p in phases), str(total))
    # A step of no ops that a mode's section speaks for (the monitor's hooks): its lines alone.
    by_sections = not total and bool(summary.sections)
    if not by_sections:
        console.print(counts)
    untraced = _untraced_line(summary)
    if untraced is not None:
        console.print(untraced, style="red", markup=False, highlight=False)
    for name, reason in sorted(summary.mode_failures.items()):
        console.print(f"MODE FAILED: {name} ({reason}); detached so that training went on: "
                      "its data is missing from there on", style="red", markup=False, highlight=False)
    bad = summary.first_nonfinite
    if by_sections:
        pass  # its sections below say what it saw
    elif not summary.has_stats:
        console.print("first non-finite op: [dim]unknown (no statistics recorded: add the stats mode)[/dim]")
    elif bad is None and summary.unmeasured:
        console.print(f"first non-finite op: [green]none[/green] among the measured "
                      f"([yellow]{summary.unmeasured} tensor(s) not measured[/yellow]: their memory was "
                      "freed before it was read)")
    elif bad is None:
        console.print("first non-finite op: [green]none[/green]")
    else:
        finite = {True: "finite", False: "non-finite",
                  None: "not all known (add inputs=True to record them)"}[bad.inputs_finite]
        if summary.overflow_handled:
            console.print(f"first non-finite op: [yellow]{_op_label(bad)}[/yellow]  id {bad.id} "
                          f"({HANDLED})")
        else:
            console.print(f"first non-finite op: [red]{_op_label(bad)}[/red]  id {bad.id}")
        console.print(f"  its inputs were {finite}")
    _render_loss_scaler(console, summary)
    if summary.nonfinite_parameters is not None:
        for line in summary.nonfinite_parameters.describe():
            console.print(line, style="red", markup=False, highlight=False)
    if summary.largest_abs_max:
        console.print(_extremes_table("largest |max|", summary.largest_abs_max))
        console.print(_extremes_table("largest norm", summary.largest_norm))
    if summary.check_counts:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(summary.check_counts.items()))
        console.print(f"free-benchmark checks: {counts}")
        if summary.failed_checks:
            table = Table(title="failed checks (worst first)", title_justify="left", show_edge=False,
                          pad_edge=False)
            for column in ("op id", "perturb", "dtype", "deviation", "bound", "NaN/Inf", "sign flips"):
                table.add_column(column, justify="left" if column == "op id" else "right", overflow="fold")
            for c in summary.failed_checks:
                table.add_row(c.op_id, c.perturb, c.dtype or "-", _fmt(c.ratio), _fmt(c.threshold),
                              str(c.nonfinite_mismatch), str(c.sign_flips))
            console.print(table)
    for section in summary.sections.values():
        for line in section.lines:
            console.print(line.text, style=line.style, markup=False, highlight=False)


def _render_loss_scaler(console: Console, summary: StepSummary) -> None:
    """The loss scaler's line: the step it skipped and the scale, or the scale of a clean step."""
    scaler = summary.loss_scaler
    if scaler is None:
        return
    if not scaler.skipped:
        console.print(scaler.describe(), style="dim", markup=False, highlight=False)
    elif summary.first_nonfinite is not None and not summary.overflow_handled:
        console.print(f"{scaler.describe()}; the NaN/Inf started before the backward, where the scale "
                      "does not reach: a fault of the model, not an overflow", style="red", markup=False,
                      highlight=False)
    else:
        console.print(scaler.describe(), style="yellow", markup=False, highlight=False)


HANDLED = "step skipped by the loss scaler: the overflow was handled"
"""Said after the first non-finite op of a step whose overflow the loss scaler handled."""

DETAILED_STEPS = 10
"""Runs with more (step, rank) pairs than this are summarized one line a step (tables are slow
and unreadable by the thousand); the first step with a non-finite op still gets its tables."""


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _untraced_line(summary: StepSummary) -> str | None:
    """What a step's records lack: the ops of threads the dispatch mode did not see."""
    if not summary.untraced_threads:
        return None
    threads = ", ".join(f"{name!r} ({calls} module/optimizer calls)"
                        for name, calls in sorted(summary.untraced_threads.items()))
    return (f"NOT TRACED: ops on thread(s) {threads}: the probe's dispatch mode was not active there; "
            "start the session on the thread that trains, or use session.trace_thread()")


def _step_line(summary: StepSummary) -> str:
    if summary.unreadable is not None:
        return f"step {summary.step} rank {summary.rank}: UNREADABLE, skipped: {summary.unreadable}"
    parts = [f"step {summary.step} rank {summary.rank}: {sum(summary.phase_counts.values())} ops"]
    if not summary.complete:
        parts.append(f"INCOMPLETE ({summary.reason})")
    if summary.mode_failures:
        parts.append(f"mode(s) {', '.join(sorted(summary.mode_failures))} FAILED, detached")
    if summary.untraced_threads:
        parts.append(f"ops on thread(s) {', '.join(map(repr, sorted(summary.untraced_threads)))} NOT TRACED")
    if summary.first_nonfinite is not None:
        handled = f" ({HANDLED})" if summary.overflow_handled else ""
        parts.append(f"first non-finite {summary.first_nonfinite.id}{handled}")
    elif summary.has_stats:
        parts.append("finite")
    if summary.loss_scaler is not None and summary.loss_scaler.skipped:
        parts.append(summary.loss_scaler.describe())
    if summary.nonfinite_parameters is not None:
        parts += summary.nonfinite_parameters.describe()
    if summary.largest_abs_max:
        top = summary.largest_abs_max[0]
        parts.append(f"largest |max| {_fmt(top.value)} ({top.op.id})")
    if summary.check_counts:
        parts.append("checks " + ", ".join(f"{k} {v}" for k, v in sorted(summary.check_counts.items())))
    parts += [s.brief for s in summary.sections.values() if s.brief]
    return " | ".join(parts)


def render_run(console: Console, summary_of_run: RunSummary) -> None:
    """The run's header, then each step's summary as it comes (steps are read one at a time), then
    the findings over the run (``probe.analysis.run_summary``)."""
    run = summary_of_run.run
    modes = run.info.get("modes")
    pairs = sum(len(run.steps_of(rank)) for rank in run.ranks)
    console.print(f"[bold]{run.path}[/bold]  modes {modes}  ranks {run.ranks}  steps {_ranges(run.steps)}")
    detailed_nonfinite = False
    followed: dict[tuple[str, str], _Followed] = {}  # (mode, title) -> its series over the run
    for summary in summary_of_run.steps():
        _follow(followed, summary)
        if pairs <= DETAILED_STEPS:
            render_step(console, summary)
            continue
        style = "red" if summary.fault is not None or not summary.complete else None
        console.print(_step_line(summary), style=style, markup=False, highlight=False)
        if summary.fault is not None and not detailed_nonfinite:
            detailed_nonfinite = True
            render_step(console, summary)
    found = summary_of_run.findings()
    for link in found.links:
        console.print(link.describe(), style="red" if link.recurred else None, markup=False, highlight=False)
    for table in followed.values():
        render_series(console, table.values, table.title, table.read_all)
    for line in found.lost:
        console.print(line, style="red", markup=False, highlight=False)
    if found.unreadable:
        console.print(f"{len(found.unreadable)} step(s) unreadable, skipped: "
                      + ", ".join(f"step {s.step} rank {s.rank}" for s in found.unreadable),
                      style="red", markup=False, highlight=False)
    for line in found.tails:
        console.print(line, markup=False, highlight=False)
    for line in found.rewinds:
        console.print(line, style="red", markup=False, highlight=False)
    if found.not_observed is not None:
        console.print(found.not_observed, style="yellow", markup=False, highlight=False)
    ranks = found.across_ranks
    if ranks is not None:
        if ranks.origin is not None:  # which rank a NaN started on, before it spread
            console.print(ranks.origin.describe(), style="red", markup=False, highlight=False)
        if ranks.consistency is not None:
            render_consistency(console, ranks.consistency, limit=3)
        if ranks.not_checked is not None:
            console.print(f"across ranks: not checked ({ranks.not_checked})", style="red", markup=False,
                          highlight=False)


SPARK = "▁▂▃▄▅▆▇█"
"""The sparkline's levels, lowest first."""
SERIES_ROWS = 60
"""Monitored series shown in the run's table; the others are counted."""


def sparkline(values: list[float]) -> str:
    """One character per value, its height the value's place between the smallest and the
    largest (a flat series is a flat line; NaN and Inf are ``!``)."""
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    top = len(SPARK) - 1

    def level(v: float) -> str:
        if not math.isfinite(v):
            return "!"
        return SPARK[round((v - lo) / (hi - lo) * top) if hi > lo else 0]

    return "".join(level(v) for v in values)


def _unicode(console: Console) -> bool:
    return console.encoding.lower().replace("-", "").startswith("utf")


@dataclass
class _Followed:
    """A mode's followed series (``StepSection.followed``) gathered over the run's steps."""

    title: str
    read_all: str
    values: dict[tuple[int, str], dict[int, float]] = field(default_factory=dict)
    """(rank, label) -> step -> value."""


def _follow(followed: dict[tuple[str, str], _Followed], summary: StepSummary) -> None:
    """Add the series the step's sections follow to ``followed``."""
    for mode, section in summary.sections.items():
        series = section.followed
        if series is None:
            continue
        table = followed.setdefault((mode, series.title), _Followed(series.title, series.read_all))
        for label, value in series.values.items():
            table.values.setdefault((summary.rank, label), {})[summary.step] = value


def render_series(console: Console, series: dict[tuple[int, str], dict[int, float]],
                  title: str, read_all: str) -> None:
    """Series followed over the run ((rank, label) -> step -> value): each one's value at the last
    step, its range over the steps, and (where the terminal shows unicode) a sparkline of it, step
    by step; the first :data:`SERIES_ROWS`, the others counted (``read_all`` reads them)."""
    ranks = {rank for rank, _ in series}
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    columns = ["series", "last", "min", "max", *(["steps"] if _unicode(console) else [])]
    for column in columns:
        table.add_column(column, justify="left" if column in ("series", "steps") else "right",
                         overflow="fold")
    for (rank, label), by_step in list(series.items())[:SERIES_ROWS]:
        values = [by_step[s] for s in sorted(by_step)]
        name = label if len(ranks) == 1 else f"rank {rank}: {label}"
        table.add_row(escape(name), _fmt(values[-1]), _fmt(min(values)), _fmt(max(values)),
                      *([sparkline(values)] if _unicode(console) else []))
    console.print(table)
    if len(series) > SERIES_ROWS:
        console.print(f"  ... {len(series) - SERIES_ROWS} more series ({read_all} reads them all)")


def render_identity(console: Console, identity: Identity, limit: int = 10) -> None:
    """The runs' start (weights, inputs, RNG) and what differs in their environments."""
    style = {"same": "green", "differ": "red"}
    for check in identity.checks:
        console.print(f"  {check.what}: [{style.get(check.status, 'yellow')}]{check.status}[/] "
                      f"[dim]({escape(check.message)})[/dim]")
    if identity.differences:
        console.print(f"  environments differ in {len(identity.differences)} thing(s):")
        for d in identity.differences[:limit]:
            console.print(f"    {d.describe()}", markup=False, highlight=False)
        if len(identity.differences) > limit:
            console.print(f"    ... {len(identity.differences) - limit} more (report.json, identity.csv)")
    for note in identity.notes:
        console.print(f"  [yellow]{escape(note)}[/yellow]")


def render_compare(console: Console, report: Report, out: str | None) -> None:
    counts = report.counts
    console.print(f"[bold]compare[/bold] {report.path_a} (reference) vs {report.path_b}")
    if report.identity is not None:
        render_identity(console, report.identity)
        if report.identity.cause is not None:
            console.print(f"[red]{escape(report.conclusion)}[/red]")
    console.print("  ".join(f"{k} {v}" for k, v in counts.items()))
    if counts[NOT_COMPARED]:
        console.print(f"[yellow]{counts[NOT_COMPARED]} op(s) not compared: their data is missing or "
                      "unreadable (see the rows marked 'not compared')[/yellow]")
    for line in report.missing:
        console.print(f"[yellow]not compared: {line}[/yellow]")
    for unread in (s for s in report.steps if s.unreadable is not None):
        console.print(f"not compared: step {unread.step} rank {unread.rank}, {unread.unreadable}",
                      style="yellow", markup=False, highlight=False)
    d = report.divergence
    if d is None and (counts[NOT_COMPARED] or report.unreadable):
        console.print("first divergence: [yellow]none among the ops compared[/yellow]")
    elif d is None:
        console.print("first divergence: [green]none[/green]")
    else:
        console.print(f"first divergence: [red]{_op_label(d.op)}[/red] step {d.step} rank {d.rank}")
        console.print(f"  id {d.op.id} (rule: {d.rule})")
        console.print(f"  {d.comparison.message}")
        if d.inputs_assumed:
            console.print("  [yellow]the producer of an input was not matched or not compared: "
                          "assumed to agree[/yellow]")
        if len(d.chain) > 1:
            console.print(f"  propagates through {len(d.chain) - 1} ops: " + ", ".join(d.chain[1:6])
                          + (" ..." if len(d.chain) > 6 else ""))
    reordered = report.reduction_orders
    if reordered:
        first = reordered[0].a or reordered[0].b
        assert first is not None
        console.print(f"{len(reordered)} sum(s) in a different reduction order across the layouts, each "
                      f"consistent with its own (rule: reduction order), e.g. {first.id}",
                      markup=False, highlight=False)
    per_rank = report.by_rank()
    if len(per_rank) > 1:
        table = Table(title="per rank", title_justify="left", show_edge=False, pad_edge=False)
        for column in ("rank", "steps", *VERDICTS, "first divergence"):
            table.add_column(column, justify="left" if column == "first divergence" else "right",
                             overflow="fold")
        for row in per_rank:
            first = row["first_divergence"]
            label = "[green]none[/green]" if first is None else f"step {first['step']} {first['op_a']}"
            table.add_row(str(row["rank"]), str(len(row["steps"])), *(str(v) for v in row["counts"].values()),
                          label)
        console.print(table)
    if out:
        console.print(f"reports in {out}: report.csv, report.json, report.html, overlay.json, identity.csv")


def render_consistency(console: Console, report: ConsistencyReport, limit: int = 10) -> None:
    """The cross-rank consistency check: its verdict, then the disagreements, earliest first."""
    for note in report.notes:
        console.print(f"[yellow]{note}[/yellow]")
    if len(report.ranks) < 2:
        return
    verdict = ("[green]consistent[/green]" if report.consistent
               else f"[red]{len(report.findings)} disagreement(s)[/red]")
    console.print(f"cross-rank consistency over ranks {report.ranks}, steps {report.steps}: "
                  f"{report.checked} replicated outputs compared, {verdict}")
    for finding in report.findings[:limit]:
        console.print(f"  {finding.describe()}", style="red", markup=False, highlight=False)
    if len(report.findings) > limit:
        console.print(f"  ... {len(report.findings) - limit} more")


def render_replay(console: Console, results: list[dict], skipped: list[dict] | None = None) -> None:
    """The replayed ops, worst first, then the ops that could not be replayed, counted by reason."""
    table = Table(title="replay (worst first)", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("op id", "ULP at scale", "max err / rms", "max abs err", "cosine"):
        table.add_column(column, justify="left" if column == "op id" else "right", overflow="fold")
    for r in results:
        table.add_row(r["op_id"], _fmt(r["max_ulp_at_scale"]), _fmt(r["scaled_err"]), _fmt(r["max_abs_err"]),
                      _fmt(r["cosine"]))
    console.print(table)
    if results:
        console.print("[dim]ULP at scale: ULPs of the output's dtype, elements below the output's rms "
                      "counted at the rms; max err / rms: the largest error against the output's rms "
                      "(probe.replay() also returns the element-wise max_ulp and max_rel_err)[/dim]")
    if skipped:
        console.print(f"{len(skipped)} ops could not be replayed:")
        for reason, n in Counter(r["reason"] for r in skipped).most_common():
            example = next(r for r in skipped if r["reason"] == reason)
            console.print(f"  {n} {reason} (e.g. {example['op_id']}: {example['skipped']})",
                          markup=False, highlight=False)
