"""The compare HTML page read as a person reads it: the verdict first and coloured, one op-id
column where both runs' ids agree, ops grouped by module in collapsible sections, the error
along execution order as an inline chart marking the first divergence, and a filter that
keeps errors and warnings (checked in headless Chromium when it is installed)."""

from __future__ import annotations

import json
import math
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from hf_models import tiny_llama

import probe
from probe.analysis import verdicts
from probe.cli import main
from probe.exporters import compare_report
from probe.exporters.compare_report import PROBLEMS, row_error, write_html

pytest.importorskip("transformers", reason="transformers is an optional test dependency")
pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) draws the charts")

FAULTY = "model.layers.1.self_attn.o_proj"
VOID = {"br", "input", "meta", "img", "hr", "link"}


class Node:
    """An element of the page: tag, attributes, children (elements and text, in order)."""

    def __init__(self, tag: str, attrs: dict[str, str | None], parent: Node | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node | str] = []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def all(self, tag: str, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if child.tag == tag and (cls is None or cls in child.classes):
                    found.append(child)
                found += child.all(tag, cls)
        return found

    def first(self, tag: str, cls: str | None = None) -> Node:
        return self.all(tag, cls)[0]

    def find_id(self, ident: str) -> Node | None:
        for child in self.children:
            if isinstance(child, Node):
                if child.attrs.get("id") == ident:
                    return child
                if (found := child.find_id(ident)) is not None:
                    return found
        return None


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = self.node = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.node)
        self.node.children.append(node)
        if tag not in VOID:
            self.node = node

    def handle_startendtag(self, tag, attrs):
        self.node.children.append(Node(tag, dict(attrs), self.node))

    def handle_endtag(self, tag):
        node = self.node
        while node is not None and node.tag != tag:
            node = node.parent
        assert node is not None and node.parent is not None, f"</{tag}> closes nothing"
        self.node = node.parent

    def handle_data(self, data):
        self.node.children.append(data)


def parse(page: str) -> Node:
    builder = _Builder()
    builder.feed(page)
    builder.close()
    assert builder.node is builder.root, f"<{builder.node.tag}> left open"
    return builder.root


def _record(out: Path, fault: bool) -> Path:
    model = tiny_llama()
    if fault:  # one weight element off: the divergence enters at the op reading it
        with torch.no_grad():
            model.get_submodule(FAULTY).weight[3, 5] += 1e-2
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=out, model=model):
        model(input_ids=ids, labels=ids).loss.backward()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("html")
    return _record(root / "a", fault=False), _record(root / "b", fault=True)


@pytest.fixture(scope="module")
def written(runs, tmp_path_factory) -> tuple[probe.Report, Path]:
    report = probe.compare(*runs)
    path = tmp_path_factory.mktemp("page") / "report.html"
    report.to_html(path)
    return report, path


def test_the_verdict_comes_first_and_coloured(written):
    report, path = written
    page = path.read_text()
    doc = parse(page)
    body = doc.first("body")
    banner = next(c for c in body.children if isinstance(c, Node))
    assert banner.tag == "header" and "error" in banner.classes  # a divergence: red
    assert banner.first("p", "conclusion").text == report.conclusion
    assert "first divergence at" in report.conclusion and FAULTY in report.conclusion
    badges = {b.text for b in banner.all("span", "badge")}
    assert {f"{verdict} {n}" for verdict, n in report.counts.items()} == badges
    # The banner is above the divergence box, the chart and the tables.
    marks = ["id='verdict'", "First divergence", "<svg", "<table>"]
    if report.summary.get("identity"):  # did the runs start alike: right under the verdict
        marks.insert(1, "id='identity'")
        checks = report.summary["identity"].get("checks") or []
        identity = doc.find_id("identity")
        assert all(c["message"] in identity.text for c in checks)
    order = [page.index(mark) for mark in marks]
    assert order == sorted(order)
    assert f"rule <b>{report.divergence.rule}</b>" in page  # the weight itself: "outside input"


def test_one_op_column_when_both_runs_ids_agree_and_the_verdict_is_the_first_column(written):
    report, path = written
    doc = parse(path.read_text())
    assert all(row["op_a"] == row["op_b"] for row in report.rows)  # same program: same ids
    tables = doc.find_id("ops").all("table")
    assert tables
    for table in tables:
        headers = [th.text for th in table.all("th")]
        assert headers[:5] == ["Verdict", "Op", "Phase", "Rule", "Error"]
        assert "Ref Name" not in headers and "Test Name" not in headers
    rows = [tr for table in tables for tr in table.first("tbody").all("tr")]
    assert len(rows) == len(report.rows)
    by_id = {row["op_a"]: row for row in report.rows}
    for tr in rows:
        verdict_cell, op_cell = tr.all("td")[:2]
        ids = [code.text for code in op_cell.all("code")]
        assert len(ids) == 1, ids
        row = by_id[ids[0]]
        assert verdict_cell.first("span", "badge").text == row["verdict"]
        assert row["verdict"].replace(" ", "-") in tr.classes


def test_ops_are_grouped_by_module_in_collapsible_sections(written):
    report, path = written
    doc = parse(path.read_text())
    groups = doc.all("details", "module")
    modules = list(dict.fromkeys(row["module"] for row in report.rows))  # order of first op
    assert [g.attrs["data-module"] for g in groups] == modules
    for group, module in zip(groups, modules, strict=True):
        rows = [row for row in report.rows if row["module"] == module]
        assert len(group.first("tbody").all("tr")) == len(rows)
        summary = group.first("summary")
        assert summary.first("code").text == (module or "<outside modules>")
        worst = max((row["verdict"] for row in rows), key=["pass", "unmatched", "warning", "not compared",
                                                            "error"].index)
        assert summary.first("span", "badge").text == worst
        assert ("clean" in group.classes) == all(row["verdict"] not in PROBLEMS for row in rows)
    # Only the module where the divergence enters is open, and it says so.
    opened = [g for g in groups if "open" in g.attrs]
    assert [g.attrs["data-module"] for g in opened] == [FAULTY]
    assert "first divergence" in opened[0].first("summary").text
    first = [tr for tr in opened[0].all("tr") if "first" in tr.classes]
    assert len(first) == 1 and first[0].first("code").text == report.divergence.op.id


def test_the_chart_shows_the_error_along_execution_order_with_the_first_divergence(written):
    report, path = written
    page = path.read_text()
    chart = parse(page).find_id("chart")
    assert chart is not None
    svg = chart.first("svg")
    marker = svg.find_id("first-divergence")
    assert marker is not None and "first divergence: aten.t.default" in marker.text
    assert FAULTY in marker.text
    assert f"step 0, rank 0 ({len(report.rows)} ops)" in svg.text
    # One file that opens offline: nothing fetched.
    assert "<link" not in page and " src=" not in page and "@import" not in page
    # The error column and the chart plot the same number; the faulty op is far above rounding.
    error = row_error(next(r for r in report.rows if r["op_a"] == report.divergence.op.id))
    assert error is not None and error > 1e-4


def test_the_page_is_the_same_each_time(written, tmp_path):
    report, path = written
    report.to_html(tmp_path / "again.html")
    assert (tmp_path / "again.html").read_text() == path.read_text()


def test_without_matplotlib_the_page_says_how_to_get_the_chart(written, tmp_path, monkeypatch):
    report, _ = written
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    report.to_html(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<svg" not in page
    assert "The error chart needs matplotlib" in page and "pip install 'probe[plot]'" in page
    assert len(parse(page).all("details", "module")) > 10


def _row(**fields) -> dict:
    op = "forward:m[0]:aten.add.Tensor:0"
    base = {"step": 0, "rank": 0, "op_a": op, "op_b": op, "name": "aten.add.Tensor", "module": "m",
            "phase": "forward", "match": "id", "dtype_a": "float32", "dtype_b": "float32", "shape_a": [2],
            "shape_b": [2], "verdict": "pass", "rule": "ulp", "message": ""}
    return {**base, **fields}


def test_every_string_from_the_runs_is_escaped_and_ids_that_differ_show_both(tmp_path):
    evil = "<script>alert(1)</script>"
    rows = [
        _row(module=evil, op_a=f"forward:{evil}[0]:aten.mm.default:0", op_b="forward:x[0]:aten.mm.default:1",
             match="structure", verdict="error", rule="propagation", message=evil, max_abs_err=math.inf,
             ref_rms=1.0, dtype_b="bfloat16"),
        _row(op_a=None, op_b="forward:m[0]:aten._to_copy.default:0", verdict="unmatched", rule="unmatched"),
        _row(op_b="forward:m[0]:aten.add.Tensor:0", verdict="not compared", rule="not compared",
             message="output 0: no data to compare (run B: not in the dump)"),
    ]
    summary = {
        "run_a": evil, "run_b": "b", "steps": [0], "ranks": [0],
        "counts": {"pass": 0, "warning": 0, "error": 1, "unmatched": 1, "not compared": 1}, "ok": False,
        "missing": [evil], "per_rank": [], "conclusion": f"first divergence at {evil}",
        "identity": {"weights": [f"{evil} differs"], "environment": {"torch": "2.13 vs 2.12"}},
        "first_divergence": {"step": 0, "rank": 0, "op_a": rows[0]["op_a"], "op_b": rows[0]["op_b"],
                             "name": "aten.mm.default", "module": evil, "phase": "forward", "stack": [evil],
                             "rule": "propagation", "message": evil, "inputs_assumed": False,
                             "chain": [rows[0]["op_a"]], "metrics": {"max_abs_err": math.inf}},
    }
    write_html(summary, rows, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert evil not in page and "alert(1)" in page  # always as text, never as markup
    doc = parse(page)
    identity = doc.find_id("identity")
    assert identity is not None and f"{evil} differs" in identity.text and "2.13 vs 2.12" in identity.text
    cells = [tr.all("td")[1] for tr in doc.all("tr") if tr.all("td")]
    assert [[c.text for c in cell.all("code")] for cell in cells] == [
        [rows[0]["op_a"], rows[0]["op_b"]], [rows[1]["op_b"]], [rows[2]["op_a"]]]
    assert "(B only)" in cells[1].text
    not_compared = doc.all("tr", "not-compared")
    assert len(not_compared) == 1 and not_compared[0].first("span", "badge").text == "not compared"
    dtype = doc.all("tr", "error")[0].all("td")[-3].text
    assert dtype == "float32 → bfloat16"
    embedded = doc.find_id("summary")
    assert json.loads(embedded.text)["first_divergence"]["metrics"]["max_abs_err"] == "inf"
    assert json.loads(embedded.text)["run_a"] == evil


def test_the_page_knows_the_verdicts_of_the_analysis():
    # The report writer imports nothing of the probe: its copy of the verdicts must agree.
    assert compare_report.SEVERITY == verdicts.SEVERITY
    assert set(compare_report.VERDICT_COLOURS) == set(verdicts.VERDICTS)


def test_cli_compare_writes_the_page(runs, tmp_path):
    out = tmp_path / "report"
    assert main(["compare", str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "<svg" in page and "problems-only" in page
    assert {p.name for p in out.iterdir()} >= {"report.html", "report.csv", "report.json", "overlay.json"}


_VISIBLE = """return Array.from(document.querySelectorAll(arguments[0]))
    .map(e => [e.checkVisibility(), e.className]);"""


def test_the_filter_keeps_errors_and_warnings_in_a_browser(written):
    from tests.test_viewer import CHROMEDRIVER, CHROMIUM, _browser, _need

    _need("Chromium", Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists())
    from selenium.webdriver.common.by import By

    report, path = written
    browser = _browser()

    def visible(selector: str) -> list[tuple[bool, str]]:  # one round trip for all rows
        return [tuple(item) for item in browser.execute_script(_VISIBLE, selector)]

    try:
        browser.get(path.as_uri())
        rows = visible("#ops tbody tr")
        assert len(rows) == len(report.rows)
        # Collapsed modules hide their rows; "expand all" shows every one, pass included.
        assert not all(shown for shown, _ in rows)
        browser.find_element(By.ID, "expand-all").click()
        assert all(shown for shown, _ in visible("#ops tbody tr"))
        first_cells = browser.execute_script("return Array.from(document.querySelectorAll("
                                             "'#ops tbody tr td:first-child .badge'), e => e.textContent)")
        assert sorted(first_cells) == sorted(row["verdict"] for row in report.rows)
        browser.find_element(By.ID, "problems-only").click()
        shown = [cls for is_shown, cls in visible("#ops tbody tr") if is_shown]
        kept = [row for row in report.rows if row["verdict"] in PROBLEMS]
        assert len(shown) == len(kept) > 0
        assert all(set(cls.split()) & {"error", "warning", "not-compared"} for cls in shown)
        clean = visible("details.module.clean")
        assert clean and not any(is_shown for is_shown, _ in clean)
        browser.find_element(By.ID, "problems-only").click()
        assert all(is_shown for is_shown, _ in visible("#ops tbody tr"))
        # The verdict column is the leftmost one on screen.
        header = browser.find_element(By.CSS_SELECTOR, "#ops th")
        assert header.text == "Verdict" and header.location["x"] < 60
        conclusion = browser.execute_script(
            "return JSON.parse(document.getElementById('summary').textContent).conclusion")
        assert conclusion == report.conclusion
        assert browser.find_element(By.CSS_SELECTOR, "#chart svg").is_displayed()
        severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
    finally:
        browser.quit()


def test_rows_say_whether_a_difference_entered_or_was_carried(written):
    report, path = written
    doc = parse(path.read_text())
    rows = [tr for table in doc.find_id("ops").all("table") for tr in table.first("tbody").all("tr")]
    by_id = {row["op_a"]: row for row in report.rows}
    flows = []
    for tr in rows:
        row = by_id[tr.all("td")[1].first("code").text]
        carried = row["verdict"] == "error" and not row["enters"]
        assert ("carried" in tr.classes) == carried
        labels = [span.text for span in tr.all("span", "flow")]
        flows.append(labels)
        assert labels == ([] if row["verdict"] != "error" else ["carried" if carried else "entered"])
    # The planted fault: entered at the op reading the changed weight, carried everywhere else.
    assert ["carried"] in flows and ["entered"] in flows
    assert all(row["module"] == FAULTY for row in report.rows if row["enters"])


# Each element's badge colour, groups' summaries and rows in document order.
_COLOURS = """return Array.from(document.querySelectorAll('#ops details.module > summary, #ops tbody tr'),
    e => [e.tagName, e.tagName === 'SUMMARY' ? e.parentElement.dataset.module
                                             : e.cells[1].querySelector('code').textContent,
          getComputedStyle(e.querySelector('.badge')).backgroundColor]);"""
ENTERED_RGB, CARRIED_RGB = "rgb(211, 47, 47)", "rgb(239, 108, 0)"  # #d32f2f, #ef6c00


def test_the_first_red_row_is_the_cause_in_a_browser(written):
    from tests.test_viewer import CHROMEDRIVER, CHROMIUM, _browser, _need

    _need("Chromium", Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists())
    report, path = written
    browser = _browser()
    try:
        browser.get(path.as_uri())
        shown = [tuple(item) for item in browser.execute_script(_COLOURS)]
    finally:
        browser.quit()
    red = [(tag, what) for tag, what, colour in shown if colour == ENTERED_RGB]
    # The first red element is the cause's module, the first red row its op: nothing before is red.
    assert red[0] == ("SUMMARY", FAULTY)
    assert next(what for tag, what in red if tag == "TR") == report.divergence.op.id
    by_id = {row["op_a"]: row for row in report.rows}
    rows = [(by_id[what], colour) for tag, what, colour in shown if tag == "TR"]
    assert len(rows) == len(report.rows)
    for row, colour in rows:
        if row["verdict"] == "error":
            assert colour == (ENTERED_RGB if row["enters"] else CARRIED_RGB), row["op_a"]
    # Modules before the cause only carry it (their backward ops): orange, not red.
    before = list(dict.fromkeys(row["module"] for row in report.rows))
    before = before[:before.index(FAULTY)]
    carrying = [(what, colour) for tag, what, colour in shown if tag == "SUMMARY" and what in before
                and any(r["verdict"] == "error" for r in report.rows if r["module"] == what)]
    assert carrying and all(colour == CARRIED_RGB for _, colour in carrying)
