"""Reading is linear and bounded: what reading a step holds grows with the step at a small,
fixed cost an op, and what it reads it reads once.

Measured, never timed: ``tracemalloc`` peaks of the pure-Python reading paths on two sizes of
one step, and counts of the files opened. Before: a step's graph held its op records and a
networkx graph of them (kilobytes an op) and ``json.dump`` its text; ``callsites.json`` was read
and parsed whole again for every few ops decoded (each ``ops_at`` of ``probe summary``), at 4x
its size; the op records' file was held as lines; a step's records were written as one string.
"""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn

import probe
import probe.rundir.run as run_module
from probe.analysis.summary import summarize
from probe.exporters.graph_export import export_graph, step_graph
from probe.exporters.graph_formats import read_json
from probe.rundir.writer import StepWriter
from tests.conftest import SharedBlockNet, train_steps


class Chain(nn.Module):
    """``n`` tiny ops in a row: a step that is all records and no arithmetic."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n // 2):
            x = x * 1.0001
            x = x + 0.0001
        return x


def _chain_run(path: Path, n: int, mode: str = "structure") -> probe.Run:
    model = Chain(n)
    with probe.mode(mode, out=path, model=model) as session:
        model(torch.ones(4))
        session.step()
    return probe.load(path)


def _peak(fn) -> int:
    """Bytes ``fn()`` allocated at most, beyond what was allocated when it began."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_graph_json_export_holds_a_bounded_amount_an_op(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "OPS_BATCH", 500, raising=False)  # several batches a step
    small, large = _chain_run(tmp_path / "small", 2_000), _chain_run(tmp_path / "large", 8_000)
    peaks = {}
    for name, run in (("small", small), ("large", large)):
        target = tmp_path / f"{name}.json"
        peaks[name] = _peak(lambda run=run, target=target: export_graph(run, target, "json", phase="all"))
    # What the larger step costs over the smaller, per op it adds: its id and a reference to its
    # outputs' shapes, and the text of the nodes and edges waiting to be written (~220 bytes).
    # Before: ~5,000 bytes (records, networkx attributes, the node-link copy).
    per_op = (peaks["large"] - peaks["small"]) / 6_000
    assert per_op < 600, f"{per_op:.0f} bytes an op"
    # And the file is the graph.
    graph = read_json(tmp_path / "large.json")
    ops = large.ops(0)
    assert graph.number_of_nodes() == len(ops) > 8_000  # the chain and the ones it starts from
    assert graph.number_of_edges() == sum(t.source is not None for op in ops for t in op.inputs)
    assert graph.graph == {"level": "op", "run": str(large.path), "step": 0, "rank": 0, "phase": "all"}


def test_graph_json_export_runs_no_cyclic_collection(tmp_path, monkeypatch):
    """The export makes containers an op (records, node attributes) and keeps the ids and output
    kinds of every op, none in a cycle: the collector, which walked them again and again as they
    aged (a sixth of the export of 10^6 ops: 55.5 s CPU before, 45.6 after), is paused throughout
    and back on after. Before, it ran between the batches of records decoded."""
    monkeypatch.setattr(run_module, "OPS_BATCH", 500, raising=False)  # several batches a step
    run = _chain_run(tmp_path / "run", 4_000)
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        export_graph(run, tmp_path / "g.json", "json", phase="all")
    finally:
        gc.callbacks.remove(count)
    # At most the one that the first allocation after the collector is back on sets off
    # (before: 8 here, one every ~700 containers made between batches).
    assert len(collections) <= 1, collections
    assert gc.isenabled()
    assert read_json(tmp_path / "g.json").number_of_nodes() == run.op_count(0)


def test_batched_reading_gives_the_records_and_graph_of_a_whole_read(tmp_path, monkeypatch):
    """A training step (backward ops read forward activations many batches back) read 7 ops at a
    time: the same records, statistics and graph as read whole."""
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode(["stats", "free_benchmark"], out=tmp_path / "run", model=model, stack=True) as session:
        train_steps(model, 2, session=session)
    monkeypatch.setattr(run_module, "OPS_BATCH", 7, raising=False)
    batched = list(probe.load(tmp_path / "run").iter_ops(1))
    whole = probe.load(tmp_path / "run").ops(1)
    assert len(whole) > 100 and batched == whole
    assert any(t.stats is not None for op in batched for t in op.inputs)  # shared producer rows too
    assert all(op.stack for op in batched)
    run = probe.load(tmp_path / "run")
    export_graph(run, tmp_path / "g.json", "json", step=1, phase="all")
    got, want = read_json(tmp_path / "g.json"), step_graph(probe.load(tmp_path / "run"), 1, 0, "all")
    assert list(got.nodes) == list(want.nodes) and set(got.edges) == set(want.edges)
    assert json.dumps(dict(got.nodes(data=True)), sort_keys=True) == \
        json.dumps(dict(want.nodes(data=True)), sort_keys=True)
    assert all(got.edges[e] == want.edges[e] for e in want.edges)


def _with_call_sites(run: probe.Run, sites: int) -> Path:
    """Give every op of step 0 its own call site among ``sites`` stacks of 30 frames, 25 of them
    the same outer frames (a training loop's), as ``stack=True`` writes them."""
    step = run.path / "rank0" / "step0"
    rows = [json.loads(line) for line in (step / "ops.jsonl").read_text().splitlines()]
    for number, row in enumerate(rows):
        row["site"] = number % sites
    (step / "ops.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    outer = [f"/home/user/train/loop_{k}.py:{10 * k} in outer_{k}" for k in range(25)]
    stacks = {str(i): outer + [f"/home/user/model/layer_{i}_{k}.py:{i} in inner_{k}" for k in range(5)]
              for i in range(sites)}
    path = step / "callsites.json"
    path.write_text(json.dumps(stacks, separators=(",", ":")))
    return path


def test_call_sites_are_read_once_a_step_within_twice_their_size(tmp_path):
    run = _chain_run(tmp_path / "run", 400, mode="stats")
    sites = _with_call_sites(run, 4_000)
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and str(args[0]).endswith("callsites.json"):
            opened.append(str(args[0]))

    sys.addaudithook(audit)  # (hooks cannot be removed: it only counts this file's opens)
    run = probe.load(run.path)
    peak = _peak(lambda: list(summarize(run, top=5)))
    # The summary decodes a few ops at a time (the largest values, batch by batch): before, each
    # batch read and parsed the call sites again, whole.
    assert len(opened) == 1
    size = sites.stat().st_size
    assert peak < 2.5 * size, f"peak {peak / size:.1f} times the file (before: 4.4)"
    op = run.ops_at([3])[0]
    assert op.stack is not None and len(op.stack) == 30 and op.stack[-1].endswith("in inner_4")
    assert len(opened) == 1


def test_a_damaged_call_site_table_is_refused_by_name(tmp_path):
    run = _chain_run(tmp_path / "run", 10)
    path = _with_call_sites(run, 5)
    for damage in ('{"0": ["a", 7]}', '{"x": []}', '{"0": "a"}', '{"0": []} extra', '[1]',
                   '{"0": ' + "[" * 100_000 + "]" * 100_000 + "}"):
        path.write_text(damage)
        with pytest.raises(probe.ProbeError, match=r"callsites\.json"):
            probe.load(run.path).ops(0)


def test_a_step_is_written_without_holding_its_text(tmp_path):
    rows = ({"i": i, "id": f"forward:layers.{i % 32}.mlp:aten.mm.default:{i}",
             "in": [["float32", [64, 64], None]]} for i in range(40_000))
    writer = StepWriter(tmp_path, 0, 0)
    peak = _peak(lambda: writer.write_jsonl("ops.jsonl", rows))
    written = (writer.directory / "ops.jsonl").stat().st_size
    assert written > 3_000_000
    assert peak < written / 4, f"peak {peak} bytes for a file of {written}"  # before: ~3x the file


def _decoded(monkeypatch) -> list[int]:
    """Counts the op records decoded from here on (each call of the record decoder)."""
    calls: list[int] = []
    decode = run_module.decode_op_record

    def counting(row):
        calls.append(1)
        return decode(row)

    monkeypatch.setattr(run_module, "decode_op_record", counting)
    return calls


def test_an_op_is_found_by_id_without_decoding_the_step(tmp_path, monkeypatch):
    """``Run.op`` (what ``probe replay`` and ``Run.tensor`` look ops up by) decodes the op and the
    producers of its inputs, whatever the step's size: before, it decoded the whole step, so a
    replay of each op of a step was quadratic in its ops."""
    run = _chain_run(tmp_path / "run", 4_000)
    ids = [op.id for op in run.ops(0)]
    run = probe.load(run.path)
    decoded = _decoded(monkeypatch)
    for number in (3_999, 17, 2_500, 0):
        assert run.op(ids[number]).index == number
    assert len(decoded) <= 2 * 4  # each op and the producer of its input
    with pytest.raises(probe.ProbeError, match=r"no op 'forward:nothing:aten\.mul\.Tensor:0' in step 0"):
        run.op("forward:nothing:aten.mul.Tensor:0")


def test_decoded_records_share_the_words_they_repeat(tmp_path):
    """A step's records hold one string per op name, phase, module and dtype, and one tuple per
    shape, however many ops repeat them (what ``probe compare`` holds of two whole steps). Before,
    every record had its own copy of each (a fifth of a compared step's memory)."""
    ops = _chain_run(tmp_path / "run", 1_000).ops(0)
    for words in ([op.name for op in ops], [op.phase for op in ops], [op.module for op in ops],
                  [t.dtype for op in ops for t in op.outputs], [t.shape for op in ops for t in op.outputs]):
        assert len({id(w) for w in words}) == len(set(words)) < 4


def test_the_json_report_is_written_without_holding_its_rows(tmp_path):
    """``Report.to_json`` writes a row at a time: what it holds beyond the report is a fraction of
    the file. Before, the rows and the whole text were held at once (~3x the file)."""
    a, b = _chain_run(tmp_path / "a", 3_000), _chain_run(tmp_path / "b", 3_000)
    report = probe.compare(a, b)
    target = tmp_path / "report.json"
    peak = _peak(lambda: report.to_json(target))
    written = target.stat().st_size
    assert written > 1_000_000
    assert peak < written / 4, f"peak {peak} bytes for a file of {written}"
    back = json.loads(target.read_text())
    assert back["counts"] == report.counts and back["rows"] == json.loads(json.dumps(report.rows))


def test_the_csv_report_is_written_without_holding_its_rows(tmp_path):
    """``Report.to_csv`` (as ``to_json``) writes a row at a time: what it holds does not grow
    with the rows (before: every row was made first, ~1.5 KB a row here)."""
    peaks, reports = {}, {}
    for n in (1_000, 3_000):
        a, b = _chain_run(tmp_path / f"a{n}", n), _chain_run(tmp_path / f"b{n}", n)
        report = reports[n] = probe.compare(a, b)
        peaks[n] = _peak(lambda report=report, n=n: report.to_csv(tmp_path / f"{n}.csv"))
    per_row = (peaks[3_000] - peaks[1_000]) / 2_000
    assert per_row < 64, f"{per_row:.0f} bytes a row"
    lines = (tmp_path / "3000.csv").read_text().splitlines()
    assert len(lines) == len(reports[3_000].comparisons) + 1 and "forward:[0]:aten.mul.Tensor:0" in lines[2]


def test_the_html_report_is_written_without_holding_its_rows(tmp_path):
    """``Report.to_html`` lays the page out in one pass over the rows, made one at a time, and
    writes it as it is made: what it holds a row is its place on the page (a number), its chart's
    point and the chart's drawing of it. Before: every row (~1.5 KB here), the page's pieces and
    their join (as much again as the file) at once."""
    peaks, reports = {}, {}
    for n in (3_000, 6_000):  # both over the chart's POINTS_RASTERIZED
        a, b = _chain_run(tmp_path / f"a{n}", n, "stats"), _chain_run(tmp_path / f"b{n}", n, "stats")
        report = reports[n] = probe.compare(a, b)
        report.to_html(tmp_path / "warm.html")  # matplotlib's imports and caches, once
        peaks[n] = _peak(lambda report=report, n=n: report.to_html(tmp_path / f"{n}.html"))
    per_row = (peaks[6_000] - peaks[3_000]) / 3_000
    # A row's number (~36 bytes), its chart point (~110) and the chart's lists and arrays of its
    # x and y (~130): ~280 measured. Before: ~2,550 (every row, the page's pieces and their join).
    assert per_row < 500, f"{per_row:.0f} bytes a row"
    page = (tmp_path / "6000.html").read_text()
    assert page.count("<tr class='pass'>") == len(reports[6_000].comparisons)
    assert page.endswith("</script></body></html>")
