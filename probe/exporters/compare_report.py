"""Compare reports as files: CSV (msprobe-like columns), and a self-contained HTML page.

Plain data in (a report's rows and summary dicts), files out: this module depends on
nothing of the probe, so ``Report.to_csv``/``to_html`` call it without a cycle. The page's
chart is drawn with matplotlib (the ``plot`` extra), imported when a chart is drawn; without
it the page says how to get it. :mod:`probe.exporters.plots` (the run's charts) shares the
chart settings defined here.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from probe.analysis.report_writers import register_report_writer
from probe.vocabulary.csv_cells import csv_safe

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The verdict names and their order of severity, as probe.analysis.verdicts defines them (a test
# checks that they agree): this module imports no analysis but the writers' registry.
PASS, WARNING, ERROR, UNMATCHED, NOT_COMPARED = "pass", "warning", "error", "unmatched", "not compared"
SEVERITY = {PASS: 0, UNMATCHED: 1, WARNING: 2, NOT_COMPARED: 3, ERROR: 4}

# Our row keys and the CSV headers, close to msprobe's compare columns where one exists.
CSV_COLUMNS = (
    ("step", "Step"), ("rank", "Rank"), ("op_a", "Ref Name"), ("op_b", "Test Name"),
    ("name", "Op"), ("module", "Module"), ("phase", "Phase"), ("match", "Match"),
    ("dtype_a", "Ref Dtype"), ("dtype_b", "Test Dtype"),
    ("shape_a", "Ref Tensor Shape"), ("shape_b", "Test Tensor Shape"), ("compared", "Compared"),
    ("cosine", "Cosine"), ("max_abs_err", "MaxAbsErr"), ("max_rel_err", "MaxRelativeErr"),
    ("one_thousandth_ratio", "One Thousandth Err Ratio"),
    ("five_thousandth_ratio", "Five Thousandths Err Ratio"), ("rmse", "RMSE"), ("max_ulp", "Max ULP"),
    ("max_ulp_at_scale", "Max ULP At Scale"), ("max_rel", "MaxRelativeDiff"), ("min_rel", "MinRelativeDiff"),
    ("mean_rel", "MeanRelativeDiff"),
    ("norm_rel", "NormRelativeDiff"), ("nan_diff", "NaN Count Diff"), ("inf_diff", "Inf Count Diff"),
    ("verdict", "Result"), ("rule", "Rule"), ("message", "Err_message"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else f"{value:.6g}"
    return str(value)


def write_csv(rows: Iterable[dict[str, Any]], path: Path) -> None:
    """One line per row under :data:`CSV_COLUMNS`' headers, each written as it is read."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([header for _, header in CSV_COLUMNS])
        for row in rows:
            writer.writerow([csv_safe(_cell(row.get(key))) for key, _ in CSV_COLUMNS])


# -- the HTML page and its chart -------------------------------------------------------


VERDICT_COLOURS = {PASS: "#2e7d32", UNMATCHED: "#1e88e5", WARNING: "#f9a825", NOT_COMPARED: "#8e7cc3",
                   ERROR: "#d32f2f"}
"""A colour per verdict, shared by the HTML page and the charts ("not compared" violet as in graphs)."""
CARRIED_COLOUR = "#ef6c00"
"""An error carried from upstream (:func:`is_carried`): orange, so that red marks where a
difference entered and the first red row of the page is the cause."""
PROBLEMS = (WARNING, NOT_COMPARED, ERROR)
"""The verdicts the page's filter keeps: what needs a look."""
CHART_LIMIT = 8
"""Charts drawn per page, one per (step, rank); the step of the first divergence comes first."""
# The statistics the verdicts hold to a relative bound (a mean near zero has no useful relative error).
_STATS_ERRORS = ("max_rel", "min_rel", "norm_rel")
# Metric columns of the page (the CSV has them all), shown when some row has the value. Errors are
# shown at the tensor's scale (the Error column, ULP at scale): element-wise relative error and
# ULP read near-zero elements of a healthy op as alarms (probe.analysis.metrics).
_METRIC_COLUMNS = (("cosine", "Cosine"), ("max_abs_err", "MaxAbsErr"), ("max_ulp_at_scale", "ULP at scale"),
                   ("norm_rel", "NormRelDiff"))


def is_carried(row: Mapping[str, Any]) -> bool:
    """An error that entered upstream and was carried to this op, not one that entered here.

    A row's ``enters`` (``OpComparison.enters``) says where a difference entered; an error
    without it (rule "carried", or an op downstream of a divergence judged by the thresholds,
    the shape or NaN/Inf) is carried. Rows without the key (written by hand) are carried only
    by rule "carried"; any other error is shown as entered, never played down.
    """
    if row["verdict"] != ERROR:
        return False
    enters = row.get("enters")
    return enters is False or (enters is None and row.get("rule") == "carried")


def row_error(row: dict[str, Any]) -> float | None:
    """A row's difference as one relative number (None: nothing measured, or not compared).

    On data: the largest error over the reference's rms (``max_abs_err / ref_rms``); on
    statistics: the largest relative difference of max, min and norm; infinite when
    NaN or Inf differ. What the page's "Error" column shows and the charts draw.
    """
    if row.get("nan_diff") or row.get("inf_diff"):
        return math.inf
    max_abs, rms = row.get("max_abs_err"), row.get("ref_rms")
    if max_abs is not None and rms is not None:
        if max_abs == 0:
            return 0.0
        value = max_abs / rms if rms > 0 else math.inf
        return value if math.isfinite(value) else math.inf  # NaN: the data differ in NaNs
    stats = [abs(row[key]) for key in _STATS_ERRORS if row.get(key) is not None]
    if not stats:
        return None
    worst_stat = max(stats)
    return worst_stat if math.isfinite(worst_stat) else math.inf


# -- charts (matplotlib, the ``plot`` extra) -------------------------------------------

INSTALL_HINT = "pip install 'probe[plot]'"
"""How to get the charts: the optional extra that installs matplotlib."""
POINTS_RASTERIZED = 2000
"""Above this many ops a chart's markers are drawn as an image inside the SVG: thousands of
vector markers would make the report heavy to open, the axes and labels stay text."""
CHART_RC = {"svg.fonttype": "none", "svg.hashsalt": "probe", "font.size": 8}
"""Text stays text in an SVG (small, searchable); ids are salted so that a page holding several
charts is the same from one write to the next."""


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (the ``plot`` extra is installed); it is imported when a
    chart is drawn, never when this module is."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def mpl_text(name: str) -> str:
    """A name from a run as literal matplotlib text: a "$" would start its math mode."""
    return name.replace("$", r"\$")


def chart_style() -> Any:
    """The probe's matplotlib settings, as a context manager (:data:`CHART_RC`)."""
    import matplotlib

    return matplotlib.rc_context(CHART_RC)


def inline_svg(figure: Figure) -> str:
    """``figure`` as an ``<svg>`` element to place in an HTML page (no XML prolog, no DOCTYPE)."""
    buffer = io.StringIO()
    with chart_style():
        figure.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib figure (no pyplot: no global state, no GUI backend), laid out to fit."""
    from matplotlib.figure import Figure

    with chart_style():
        return Figure(figsize=(width, height), layout="constrained")


def _segments(modules: Sequence[str]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive equal module names: a module call, in order."""
    out, start = [], 0
    for i in range(1, len(modules) + 1):
        if i == len(modules) or modules[i] != modules[start]:
            out.append((start, i))
            start = i
    return out


FLOOR = 1e-16
"""The lowest error a chart draws apart from 0: below fp64's rounding, differences of subnormals
(1e-40) would stretch the axis over decades that say nothing."""


def _floor(errors: Iterable[float | None]) -> float:
    """Where an error of 0 (bit-identical) is drawn on the log axis: a decade below the smallest
    nonzero error, at least :data:`FLOOR`; 1e-12 when no error is above 0."""
    positive = [e for e in errors if e is not None and 0 < e < math.inf]
    if not positive:
        return 1e-12
    return max(10.0 ** (math.floor(math.log10(min(positive))) - 1), FLOOR)


def _is_divergence(row: Mapping[str, Any], divergence: Mapping[str, Any] | None) -> bool:
    if divergence is None or (row["step"], row["rank"]) != (divergence["step"], divergence["rank"]):
        return False
    return (row.get("op_a"), row.get("op_b")) == (divergence.get("op_a"), divergence.get("op_b"))


class ChartPoint(NamedTuple):
    """What a chart draws of one row (~100 bytes where the row is ~1.5 KB): the charts of a
    report of 10^6 ops hold these, not the rows."""

    error: float | None
    module: str
    verdict: str
    carried: bool
    phase: str
    first: bool
    """The first divergence (the report summary's ``first_divergence``) is this row."""


def chart_point(row: Mapping[str, Any], divergence: Mapping[str, Any] | None) -> ChartPoint:
    """The :class:`ChartPoint` of ``row``."""
    return ChartPoint(row_error(row), row["module"], row["verdict"], is_carried(row), row["phase"],
                      _is_divergence(row, divergence))


def _draw_errors(ax: Axes, rows: Sequence[ChartPoint], divergence: Mapping[str, Any] | None) -> None:
    errors = [row.error for row in rows]
    floor = _floor(errors)
    top = max([e for e in errors if e is not None and math.isfinite(e)] + [floor * 10])
    ceiling = top * 10  # where an infinite error (a NaN or Inf that differs) is drawn
    shown = [None if e is None else ceiling if math.isinf(e) else max(e, floor) for e in errors]
    rasterized = len(rows) > POINTS_RASTERIZED
    # Per module call: its largest error, a step line under the points.
    for start, end in _segments([row.module for row in rows]):
        values = [v for v in shown[start:end] if v is not None]
        if values:
            ax.hlines(max(values), start - 0.5, end - 0.5, colors="#607d8b", linewidth=2.5, alpha=0.45,
                      zorder=1)
    ax.plot([], [], color="#607d8b", linewidth=2.5, alpha=0.45, label="module call (largest)")
    # Errors carried from upstream apart from those that entered at their op (red).
    kinds = [(verdict, False, colour, verdict) for verdict, colour in VERDICT_COLOURS.items()]
    kinds.insert(-1, (ERROR, True, CARRIED_COLOUR, "error (carried)"))
    for verdict, carried, colour, label in kinds:
        xs = [i for i, row in enumerate(rows) if row.verdict == verdict and row.carried == carried]
        known = [i for i in xs if shown[i] is not None]
        unknown = [i for i in xs if shown[i] is None]  # nothing measured: a tick on the floor
        if known:
            ax.scatter(known, [shown[i] for i in known], s=9, color=colour, label=label, zorder=3,
                       edgecolors="none", rasterized=rasterized)
        if unknown:
            ax.scatter(unknown, [floor] * len(unknown), s=18, marker="|", color=colour, zorder=3,
                       label=None if known else label, rasterized=rasterized)
    phases = [row.phase for row in rows]
    for start, _ in _segments(phases)[1:]:
        ax.axvline(start - 0.5, color="#9e9e9e", linewidth=0.8, linestyle=":", zorder=0)
        # Above the frame: inside it the label would cover the first divergence's.
        ax.text(start, ceiling * 3, f" {phases[start]}", fontsize=7, color="#616161", va="bottom")
    marked = next((i for i, row in enumerate(rows) if row.first), None)
    if marked is not None:
        assert divergence is not None
        ax.axvline(marked, color=VERDICT_COLOURS["error"], linewidth=1.2, linestyle="--", zorder=2,
                   label="first divergence")
        where = divergence["module"] or "<outside modules>"
        ax.annotate(mpl_text(f"first divergence: {divergence['name']}\n{where}"), xy=(marked, ceiling),
                    xytext=(4, -4), textcoords="offset points", va="top", fontsize=7,
                    color=VERDICT_COLOURS["error"], gid="first-divergence")
    ax.axhline(floor, color="#bdbdbd", linewidth=0.6, zorder=0)
    ax.text(len(rows) - 0.5, floor, f"equal (0 or below {floor:.0e}) ", fontsize=6, color="#9e9e9e",
            ha="right", va="bottom")
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, ceiling * 3)
    ax.set_xlim(-1, max(len(rows), 1))
    ax.set_ylabel("relative error")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)


def error_chart(rows: Sequence[Mapping[str, Any]], divergence: Mapping[str, Any] | None,
                title: str = "") -> Figure:
    """Error along execution order for the rows of one (step, rank): a point per op, coloured by
    verdict; a line per module call at its largest error; log scale; the first divergence (a
    report summary's ``first_divergence`` dict) marked when it is among ``rows``.

    The error is :func:`row_error`; an op compared equal is drawn
    on the "equal" floor (:func:`_floor`), one with nothing measured (unmatched, not compared) as
    a tick on it.
    """
    return _chart([chart_point(row, divergence) for row in rows], divergence, title)


def _chart(points: Sequence[ChartPoint], divergence: Mapping[str, Any] | None, title: str) -> Figure:
    figure = new_figure(10, 3.2)
    with chart_style():
        ax = figure.add_subplot()
        _draw_errors(ax, points, divergence)
        ax.set_xlabel("op, in execution order")
        if title:
            ax.set_title(mpl_text(title), loc="left", fontsize=9)
    return figure


# -- the page ---------------------------------------------------------------------------

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2em 1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.2em 0 .4em}h3{font-size:1em}
.banner{border-left:8px solid;padding:.6em 1em;margin:0 0 1em;background:#fafafa}
.banner.error{border-color:#d32f2f;background:#fdecea}.banner.ok{border-color:#2e7d32;background:#edf7ed}
.banner.not-compared{border-color:#8e7cc3;background:#f1edf9}
.conclusion{font-size:1.15em;font-weight:600;margin:.2em 0 .5em}
.badge{display:inline-block;border-radius:3px;padding:0 .45em;color:#fff;font-size:12px;font-weight:600;
 white-space:nowrap}
.badge.pass{background:#2e7d32}.badge.warning{background:#f9a825;color:#222}.badge.error{background:#d32f2f}
.badge.unmatched{background:#1e88e5}.badge.not-compared{background:#8e7cc3}.badge.unknown{background:#757575}
.badge.zero{opacity:.35}.badge.error.carried{background:#ef6c00}
.flow{font-size:11px;font-weight:600;margin-left:.3em}.flow.entered{color:#d32f2f}.flow.carried{color:#ef6c00}
.legend{font-size:12px;color:#555;margin:.2em 0}
table{border-collapse:collapse;font-size:12px;margin:.3em 0 .8em}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;white-space:nowrap;vertical-align:top}
td.msg{white-space:normal;min-width:30em;max-width:60em}
th{background:#f3f3f3;cursor:pointer;position:sticky;top:0}
tr.error td{background:#fde2e2}tr.error.carried td{background:#fdebd9}
tr.warning td{background:#fff4d6}tr.unmatched td{background:#e8f1fd}
tr.not-compared td{background:#efe9f8;font-style:italic}tr.first td{outline:2px solid #d32f2f}
details.module{margin:.15em 0}details.module>summary{cursor:pointer;padding:2px 0}
details.module>summary code{font-weight:600}.count{color:#555;font-size:12px}
.mark{color:#d32f2f;font-weight:700}
.box{border:1px solid #ccc;padding:.8em;margin:1em 0;background:#fafafa}.box h2{margin-top:0}
.identity.error{border-left:6px solid #d32f2f}.identity.not-compared{border-left:6px solid #757575}
.hint{color:#555;font-style:italic}.controls{margin:.5em 0;position:sticky;top:0;background:#fff;
 padding:.3em 0;z-index:2}
.chart svg{max-width:100%;height:auto}
code{font-size:12px}dl.notes dt{font-weight:600}dl.notes dd{margin:0 0 .3em 1.2em}
body.problems-only tr.pass,body.problems-only tr.unmatched,body.problems-only details.clean{display:none}
"""
_SCRIPT = """
document.querySelectorAll('th').forEach(th => th.addEventListener('click', () => {
  const col = th.cellIndex, body = th.closest('table').tBodies[0];
  const rows = Array.from(body.rows);
  const asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
  const key = r => { const c = r.cells[col]; const t = c.dataset.sort ?? c.textContent;
                     const n = parseFloat(t); return isNaN(n) ? t : n; };
  rows.sort((a, b) => { const x = key(a), y = key(b);
                        return (x > y ? 1 : x < y ? -1 : 0) * (asc ? 1 : -1); });
  rows.forEach(r => body.appendChild(r));
}));
const only = document.getElementById('problems-only');
const filter = () => {
  document.body.classList.toggle('problems-only', only.checked);
  if (only.checked) document.querySelectorAll('details.module:not(.clean)').forEach(d => d.open = true);
};
only.addEventListener('change', filter); filter();
document.getElementById('expand-all').addEventListener('click',
  () => document.querySelectorAll('details.module').forEach(d => d.open = true));
document.getElementById('collapse-all').addEventListener('click',
  () => document.querySelectorAll('details.module').forEach(d => d.open = false));
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _css_class(verdict: str) -> str:
    return _e(verdict.replace(" ", "-"))


def _badge(verdict: str, text: str | None = None, zero: bool = False, carried: bool = False) -> str:
    classes = _css_class(verdict) + (" carried" if carried else "") + (" zero" if zero else "")
    return f"<span class='badge {classes}'>{_e(text or verdict)}</span>"


def _flow(row: dict[str, Any]) -> str:
    """An error's "entered" (here: red) or "carried" (from upstream: orange) after its badge."""
    if row["verdict"] != ERROR:
        return ""
    flow = "carried" if is_carried(row) else "entered"
    return f" <span class='flow {flow}'>{flow}</span>"


def _notes(summary: dict[str, Any]) -> list[str]:
    """Report-level sections from the summary: ``identity`` (did the runs start alike: weights,
    inputs, RNG; how their environments differ) and ``notes``. A shape other than the one
    :func:`_identity` knows is shown as nested lists, never dropped."""
    parts = []
    identity = summary.get("identity")
    if isinstance(identity, dict) and isinstance(identity.get("checks"), list):
        parts.append(_identity(identity))
    elif identity:
        parts.append(f"<section class='box' id='identity'><h2>Identity</h2>{_value(identity)}</section>")
    if summary.get("notes"):
        parts.append(f"<section class='box' id='notes'><h2>Notes</h2>{_value(summary['notes'])}</section>")
    return parts


_CHECK_BADGES = {"same": PASS, "differ": ERROR}


def _identity(identity: dict[str, Any]) -> str:
    alike = identity.get("started_alike")
    status = "ok" if alike is True else "error" if alike is False else "not-compared"
    parts = [f"<section class='box identity {status}' id='identity'><h2>Did the runs start alike?</h2>"]
    if identity.get("conclusion"):
        parts.append(f"<p><b>{_e(identity['conclusion'])}</b></p>")
    checks = [c for c in identity["checks"] if isinstance(c, dict)]
    if checks:
        parts.append("<table class='identity'><thead><tr><th>Check</th><th>Status</th><th>Step</th>"
                     "<th>Rank</th><th>Message</th><th>What differs</th></tr></thead><tbody>")
        for c in checks:
            state = str(c.get("status", ""))
            names = [str(n) for n in c.get("names") or []]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            badge = _badge(_CHECK_BADGES.get(state, "unknown"), state)
            parts.append(
                f"<tr><td>{_e(c.get('what', ''))}</td><td>{badge}</td>"
                f"<td>{_e(_cell(c.get('step')))}</td><td>{_e(_cell(c.get('rank')))}</td>"
                f"<td class='msg'>{_e(c.get('message', ''))}</td><td class='msg'>{_e(shown)}</td></tr>")
        parts.append("</tbody></table>")
    differences = [d for d in identity.get("differences") or [] if isinstance(d, dict)]
    if differences:
        parts.append("<p><b>Environments differ</b></p><ul>")
        for d in differences:
            ranks = d.get("ranks")
            where = "" if not ranks else " (rank " + ", ".join(map(str, ranks)) + ")"
            parts.append(f"<li>{_e(d.get('kind', ''))} <code>{_e(d.get('name', ''))}</code>: "
                         f"{_e(_cell(d.get('a')))} in run A, {_e(_cell(d.get('b')))} in run B"
                         f"{_e(where)}</li>")
        parts.append("</ul>")
    if identity.get("notes"):
        parts.append(_value(identity["notes"]))
    parts.append("</section>")
    return "".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, dict):
        items = "".join(f"<dt>{_e(k)}</dt><dd>{_value(v)}</dd>" for k, v in value.items())
        return f"<dl class='notes'>{items}</dl>"
    if isinstance(value, (list, tuple)):
        return "<ul>" + "".join(f"<li>{_value(v)}</li>" for v in value) + "</ul>"
    return _e(_cell(value))


def _banner(summary: dict[str, Any]) -> str:
    counts = summary["counts"]
    status = "error" if summary["first_divergence"] else "not-compared" if counts.get(NOT_COMPARED) else "ok"
    badges = " ".join(_badge(verdict, f"{verdict} {n}", zero=not n) for verdict, n in counts.items())
    conclusion = summary.get("conclusion") or ("divergence found" if status == "error" else "no divergence")
    return (f"<header class='banner {status}' id='verdict'><h1>probe compare</h1>"
            f"<p class='conclusion'>{_e(conclusion)}</p><p>{badges}</p></header>")


def _divergence(summary: dict[str, Any]) -> str:
    d = summary["first_divergence"]
    uncompared = summary["counts"].get(NOT_COMPARED, 0)
    if d is None and uncompared:
        return (f"<div class='box'>No divergence among the ops compared, but {uncompared} op(s) could "
                "not be compared (their data is missing or unreadable): see the rows marked "
                f"{_badge(NOT_COMPARED)}.</div>")
    if d is None:
        return "<div class='box'>No divergence: every matched op compared clean or within precision.</div>"
    chain = " &rarr; ".join(_e(op) for op in d["chain"][:20]) + (" ..." if len(d["chain"]) > 20 else "")
    stack = "<br>".join(_e(line) for line in (d["stack"] or []))
    op = d["op_a"] or d["op_b"] or ""
    assumed = ("some inputs could not be compared and were assumed equal" if d["inputs_assumed"]
               else "its inputs compared clean")
    module = d["module"] or "<outside modules>"
    return (f"<div class='box' id='first-divergence'><b>First divergence</b> (step {_e(d['step'])}, rank "
            f"{_e(d['rank'])}): <code>{_e(op)}</code> in module <code>{_e(module)}</code> "
            f"({_e(d['phase'])}), rule <b>{_e(d.get('rule') or '')}</b><br>{_e(d['message'])}<br>"
            f"{assumed}<br><b>Propagates through</b>: {chain}<br>{stack}</div>")


class _Layout(NamedTuple):
    """Where each row goes on the page, found in one pass over the rows: per (step, rank), the
    numbers of its rows by module (modules in order of their first op), and its chart's points;
    the metric columns some row has."""

    places: dict[tuple[int, int], dict[str, list[int]]]
    points: dict[tuple[int, int], list[ChartPoint]]
    columns: list[tuple[str, str]]


def _layout(rows: Iterable[Mapping[str, Any]], first: Mapping[str, Any] | None) -> _Layout:
    places: dict[tuple[int, int], dict[str, list[int]]] = {}
    points: dict[tuple[int, int], list[ChartPoint]] = {}
    present: set[str] = set()
    for number, row in enumerate(rows):
        place = (row["step"], row["rank"])
        places.setdefault(place, {}).setdefault(row.get("module") or "", []).append(number)
        points.setdefault(place, []).append(chart_point(row, first))
        present.update(key for key, _ in _METRIC_COLUMNS if row.get(key) is not None)
    return _Layout(places, points, [(key, header) for key, header in _METRIC_COLUMNS if key in present])


def _charts(summary: dict[str, Any], places: dict[tuple[int, int], list[ChartPoint]]) -> str:
    head = "<section id='chart'><h2>Error along execution order</h2>"
    if not matplotlib_available():
        return (f"{head}<p class='hint'>The error chart needs matplotlib, which is not installed: "
                f"<code>{html.escape(INSTALL_HINT, quote=False)}</code></p></section>")
    d = summary["first_divergence"]
    order = sorted(places, key=lambda p: (d is None or p != (d["step"], d["rank"]), p))
    charts = []
    for place in order[:CHART_LIMIT]:
        title = f"step {place[0]}, rank {place[1]} ({len(places[place])} ops)"
        figure = _chart(places[place], d, title)
        charts.append(f"<div class='chart'>{inline_svg(figure)}</div>")
    more = (f"<p class='hint'>{len(order) - CHART_LIMIT} more (step, rank) not drawn; their rows are "
            "below.</p>") if len(order) > CHART_LIMIT else ""
    note = ("<p class='hint'>One point per op: data, max |A&minus;B| over the rms of A; statistics, the "
            "largest relative difference of max, min and norm. Grey bars: each module call's largest. "
            "Ops without a measure (unmatched, not compared) are ticks on the floor.</p>")
    return head + note + "".join(charts) + more + "</section>"


def _pair(a: Any, b: Any) -> str:
    """One value where both runs agree, "A &rarr; B" where they differ."""
    if a == b or b is None:
        return _e(_cell(a))
    if a is None:
        return _e(_cell(b)) + " (B)"
    return f"{_e(_cell(a))} &rarr; {_e(_cell(b))}"


def _op_cell(row: dict[str, Any]) -> str:
    a, b = row.get("op_a"), row.get("op_b")
    if a == b:
        return f"<code>{_e(a)}</code>"
    if b is None:
        return f"<code>{_e(a)}</code> <i>(A only)</i>"
    if a is None:
        return f"<code>{_e(b)}</code> <i>(B only)</i>"
    return f"A <code>{_e(a)}</code><br>B <code>{_e(b)}</code>"


def _row(row: dict[str, Any], columns: list[tuple[str, str]], first: bool) -> str:
    verdict = str(row["verdict"])
    error = row_error(row)
    carried = is_carried(row)
    cells = [
        f"<td data-sort='{SEVERITY.get(verdict, 0)}'>{_badge(verdict, carried=carried)}{_flow(row)}</td>",
        f"<td>{_op_cell(row)}{' <span class=mark>&#9664; first divergence</span>' if first else ''}</td>",
        f"<td>{_e(row.get('phase'))}</td>", f"<td>{_e(row.get('rule') or '')}</td>",
        f"<td data-sort='{'' if error is None else error}'>{_e(_cell(error))}</td>",
        *(f"<td>{_e(_cell(row.get(key)))}</td>" for key, _ in columns),
        f"<td>{_pair(row.get('dtype_a'), row.get('dtype_b'))}</td>",
        f"<td>{_pair(row.get('shape_a'), row.get('shape_b'))}</td>",
        f"<td class='msg'>{_e(row.get('message') or '')}</td>",
    ]
    classes = _css_class(verdict) + (" carried" if carried else "") + (" first" if first else "")
    return f"<tr class='{classes}'>{''.join(cells)}</tr>"


def _module_group(module: str, rows: Sequence[Mapping[str, Any]], numbers: list[int],
                  columns: list[tuple[str, str]], first: dict[str, Any] | None, open_problems: bool
                  ) -> Iterator[str]:
    """The section of one module's rows (``rows[n]`` for ``n`` in ``numbers``), a piece at a time:
    its summary, then a table row per op, each row read when its line is written."""
    counts: dict[str, int] = {}
    holds_first, carried, largest_error = False, 0, None
    for number in numbers:
        row = rows[number]
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
        holds_first = holds_first or (first is not None and _is_first(row, first))
        carried += is_carried(row)
        error = row_error(row)
        if error is not None and (largest_error is None or error > largest_error):
            largest_error = error
    worst = max(counts, key=lambda v: SEVERITY.get(v, 0))
    clean = not any(v in PROBLEMS for v in counts)
    largest = f"; largest error {_cell(largest_error)}" if largest_error is not None else ""
    spread = ", ".join(f"{n} {v}" + (f" ({carried} carried)" if v == ERROR and carried else "")
                       for v, n in sorted(counts.items(), key=lambda i: -SEVERITY.get(i[0], 0)))
    # Red only where a difference entered in this module; a module that only carries it is orange.
    only_carried = worst == ERROR and carried == counts[ERROR]
    opened = holds_first or (open_problems and worst in (ERROR, NOT_COMPARED))
    header = "".join([
        "<tr><th>Verdict</th><th>Op</th><th>Phase</th><th>Rule</th><th>Error</th>",
        *(f"<th>{_e(name)}</th>" for _, name in columns),
        "<th>Dtype</th><th>Shape</th><th>Message</th></tr>",
    ])
    yield (f"<details class='module{' clean' if clean else ''}' data-module='{_e(module)}'"
           f"{' open' if opened else ''}><summary>{_badge(worst, carried=only_carried)} "
           f"<code>{_e(module or '<outside modules>')}</code> "
           f"<span class='count'>{len(numbers)} op(s): {_e(spread)}{_e(largest)}</span>"
           f"{' <span class=mark>&#9664; first divergence</span>' if holds_first else ''}</summary>"
           f"<table><thead>{header}</thead><tbody>")
    for number in numbers:
        row = rows[number]
        yield _row(row, columns, first is not None and _is_first(row, first))
    yield "</tbody></table></details>"


def _is_first(row: dict[str, Any], first: dict[str, Any]) -> bool:
    return ((row["step"], row["rank"], row.get("op_a"), row.get("op_b"))
            == (first["step"], first["rank"], first.get("op_a"), first.get("op_b")))


def write_html(summary: dict[str, Any], rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """One self-contained page (no external asset; opens offline).

    From the top: the verdict (the conclusion, coloured, and the counts), the runs and any
    report-level notes (``summary["identity"]``, ``summary["notes"]``), the first divergence,
    the error along execution order as an inline SVG chart (with the ``plot`` extra; without it
    a line saying how to get it), then the ops grouped by module in collapsible sections,
    verdict first, one op-id column (both ids only where the runs' ids differ), with a filter
    that keeps errors, warnings and "not compared". Every string from the runs is escaped.

    ``rows`` is read twice, a row at a time (``rows[n]``): once to lay the page out, once as each
    line is written; the page is written as it is made. So a sequence that makes each row when
    it is read (``Report.to_html``'s) is never held whole, nor is the page's text.
    """
    first = summary["first_divergence"]
    layout = _layout(rows, first)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>probe compare</title>",
        f"<style>{_STYLE}</style></head><body>",
        _banner(summary),
        f"<p>reference (A) <code>{_e(summary['run_a'])}</code> &nbsp; test (B) <code>{_e(summary['run_b'])}"
        f"</code><br>steps {_e(summary['steps'])} ranks {_e(summary['ranks'])}</p>",
        *_notes(summary),
    ]
    if summary["missing"]:
        parts.append("<p>not compared: " + _e("; ".join(summary["missing"])) + "</p>")
    parts.append(_divergence(summary))
    parts.append(_charts(summary, layout.points))
    parts.append(
        "<section id='ops'><h2>Ops by module</h2><div class='controls'><label><input type='checkbox' "
        "id='problems-only'> only errors, warnings and not compared</label> &nbsp; "
        "<button id='expand-all'>expand all</button> <button id='collapse-all'>collapse all</button></div>"
        f"<p class='legend'>{_badge(ERROR)}<span class='flow entered'>entered</span>: the difference "
        f"enters at this op (the first such row is the first divergence); {_badge(ERROR, carried=True)}"
        "<span class='flow carried'>carried</span>: an error carried from a divergence upstream. "
        "A module's badge is red when a difference enters in it, orange when it only carries one.</p>"
    )
    with open(path, "w") as out:
        out.write("".join(parts))
        for (step, rank), modules in layout.places.items():
            if len(layout.places) > 1:
                out.write(f"<h3>step {_e(step)}, rank {_e(rank)}</h3>")
            # Without a divergence, open the modules with errors or ops not compared; with one, its module.
            for module, numbers in modules.items():
                out.writelines(_module_group(module, rows, numbers, layout.columns, first,
                                             open_problems=first is None))
        out.write("</section>")
        out.write(f"<script>{_SCRIPT}</script>")
        # JSON, parseable by JSON.parse (a "<" escaped as \\u003c, so no string can close the script).
        embedded = json.dumps(_plain(summary), default=str).replace("<", "\\u003c")
        out.write(f"<script type='application/json' id='summary'>{embedded}</script></body></html>")


def _plain(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan"): JSON.parse takes no Infinity or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# Report.to_csv / to_html find these here: the analysis layer sits below the exporters.
register_report_writer("compare_csv", lambda summary, rows, path: write_csv(rows, path))
register_report_writer("compare_html", write_html)
