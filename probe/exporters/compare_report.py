"""Compare reports as files: CSV (msprobe-like columns), and a self-contained HTML page.

Plain data in (a report's rows and summary dicts), files out: this module depends
on nothing of the probe, so ``Report.to_csv``/``to_html`` call it without a cycle.
"""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path
from typing import Any

# Our row keys and the CSV headers, close to msprobe's compare columns where one exists.
CSV_COLUMNS = (
    ("step", "Step"), ("rank", "Rank"), ("op_a", "Ref Name"), ("op_b", "Test Name"),
    ("name", "Op"), ("module", "Module"), ("phase", "Phase"), ("match", "Match"),
    ("dtype_a", "Ref Dtype"), ("dtype_b", "Test Dtype"),
    ("shape_a", "Ref Tensor Shape"), ("shape_b", "Test Tensor Shape"), ("compared", "Compared"),
    ("cosine", "Cosine"), ("max_abs_err", "MaxAbsErr"), ("max_rel_err", "MaxRelativeErr"),
    ("one_thousandth_ratio", "One Thousandth Err Ratio"),
    ("five_thousandth_ratio", "Five Thousandths Err Ratio"), ("rmse", "RMSE"), ("max_ulp", "Max ULP"),
    ("max_rel", "MaxRelativeDiff"), ("min_rel", "MinRelativeDiff"), ("mean_rel", "MeanRelativeDiff"),
    ("norm_rel", "NormRelativeDiff"), ("nan_diff", "NaN Count Diff"), ("inf_diff", "Inf Count Diff"),
    ("verdict", "Result"), ("rule", "Rule"), ("message", "Err_message"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else f"{value:.6g}"
    return str(value)


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(text: str) -> str:
    """``text`` as a spreadsheet shows it, never as a formula: a leading = + - @ tab or CR
    gets a quote in front (OWASP's CSV-injection rule), except plain numbers such as -0.5."""
    if text.startswith(_FORMULA_STARTS):
        try:
            float(text)
        except ValueError:
            return "'" + text
    return text


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """One line per row under :data:`CSV_COLUMNS`' headers."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([header for _, header in CSV_COLUMNS])
        for row in rows:
            writer.writerow([csv_safe(_cell(row.get(key))) for key, _ in CSV_COLUMNS])


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;white-space:nowrap}
th{background:#f3f3f3;cursor:pointer;position:sticky;top:0}
tr.error td{background:#fde2e2}tr.warning td{background:#fff4d6}tr.unmatched td{background:#eef}
tr.not-compared td{background:#e8e8e8;font-style:italic}
.box{border:1px solid #ccc;padding:.8em;margin:1em 0;background:#fafafa}
code{font-size:12px}
"""
_SCRIPT = """
document.querySelectorAll('th').forEach((th, col) => th.addEventListener('click', () => {
  const body = th.closest('table').tBodies[0];
  const rows = Array.from(body.rows);
  const asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
  const key = r => { const t = r.cells[col].textContent; const n = parseFloat(t);
                     return isNaN(n) ? t : n; };
  rows.sort((a, b) => { const x = key(a), y = key(b);
                        return (x > y ? 1 : x < y ? -1 : 0) * (asc ? 1 : -1); });
  rows.forEach(r => body.appendChild(r));
}));
"""


def write_html(summary: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """The page: both runs, counts, the first divergence and every row (sortable by column)."""
    counts = summary["counts"]
    d = summary["first_divergence"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>probe compare</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>probe compare</h1>",
        f"<p>reference (A) <code>{html.escape(summary['run_a'])}</code> &nbsp; "
        f"test (B) <code>{html.escape(summary['run_b'])}</code><br>steps {summary['steps']} "
        f"ranks {summary['ranks']}</p>",
        "<p>" + " &nbsp; ".join(f"<b>{k}</b> {v}" for k, v in counts.items()) + "</p>",
    ]
    if summary.get("conclusion"):
        parts.append(f"<p><b>{html.escape(summary['conclusion'])}</b></p>")
    if summary["missing"]:
        parts.append("<p>not compared: " + html.escape("; ".join(summary["missing"])) + "</p>")
    uncompared = counts.get("not compared", 0)
    if d is None and uncompared:
        parts.append(f"<div class='box'>No divergence among the ops compared, but {uncompared} op(s) could "
                     "not be compared (their data is missing or unreadable): see the rows marked "
                     "<b>not compared</b>.</div>")
    elif d is None:
        parts.append("<div class='box'>No divergence: every matched op compared clean.</div>")
    else:
        chain = " &rarr; ".join(html.escape(op) for op in d["chain"][:20])
        stack = "<br>".join(html.escape(line) for line in (d["stack"] or []))
        parts.append(
            "<div class='box'><b>First divergence</b> (step {step}, rank {rank}): "
            "<code>{op}</code> in module <code>{module}</code> ({phase}), rule <b>{rule}</b><br>{message}<br>"
            "{assumed}<br><b>Propagates through</b>: {chain}<br>{stack}</div>".format(
                step=d["step"], rank=d["rank"], op=html.escape(d["op_a"] or d["op_b"] or ""),
                rule=html.escape(str(d.get("rule") or "")),
                module=html.escape(d["module"] or "<outside modules>"), phase=html.escape(d["phase"]),
                message=html.escape(d["message"]),
                assumed="some inputs could not be compared and were assumed equal"
                if d["inputs_assumed"] else "its inputs compared clean",
                chain=chain, stack=stack,
            )
        )
    parts.append("<table><thead><tr>")
    parts += [f"<th>{html.escape(header)}</th>" for _, header in CSV_COLUMNS]
    parts.append("</tr></thead><tbody>")
    for row in rows:
        parts.append(f"<tr class='{html.escape(str(row['verdict']).replace(' ', '-'))}'>")
        parts += [f"<td>{html.escape(_cell(row.get(key)))}</td>" for key, _ in CSV_COLUMNS]
        parts.append("</tr>")
    parts.append(f"</tbody></table><script>{_SCRIPT}</script>")
    embedded = html.escape(json.dumps(summary, default=str))
    parts.append(f"<script type='application/json' id='summary'>{embedded}</script></body></html>")
    path.write_text("".join(parts))
