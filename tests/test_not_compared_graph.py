"""Graph exports and the viewer's focus with ops whose data is missing: "not compared" is its own
category (colour, overlay value, legend), never drawn as a pass, and the first divergence still
comes first."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import probe
from probe.analysis.verdicts import NOT_COMPARED, PASS
from probe.cli import main
from probe.demo.train import DemoTraining, train
from probe.exporters.graph_export import export_graph, model_explorer_graphs
from probe.exporters.graph_formats import COLOURS, finding_colour, read_graphml, read_json
from probe.exporters.model_explorer import OVERLAYS, focus
from probe.modes.dump.file_names import TENSOR_INDEX_FILE, tensors_dir
from probe.rundir import layout

DELETED = ("shard-00000.safetensors", "shard-00001.safetensors")
"""B's first shards: the embedding and the first layer's forward ops lose their data."""


def _lose_shards(run: Path) -> set[int]:
    """Deletes ``DELETED`` from step 0 of ``run``; returns the indices of the ops with outputs in them."""
    step_dir = layout.step_dir(run, 0, 0)
    index = json.loads((step_dir / TENSOR_INDEX_FILE).read_text())
    in_deleted = {int(blob) for blob, (shard, _) in index["blobs"].items() if shard in DELETED}
    for shard in DELETED:
        (tensors_dir(run, 0, 0) / shard).unlink()
    return {e["op"] for e in index["tensors"] if e["io"] == "output" and e["blob"] in in_deleted}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two dump runs of the demo model from other seeds (a divergence in every op), B's first shards
    deleted; and a copy of A with the same shards deleted (no divergence, only missing data)."""
    root = tmp_path_factory.mktemp("not_compared")
    for name, seed in (("a", 0), ("b", 1)):
        training = DemoTraining(seed=seed)
        # Small shards so that deleting two loses some ops, not the step.
        train(training, 1, session=probe.mode("dump", out=root / name, model=training.model,
                                              shard_size=1 << 20))
    shutil.copytree(root / "a", root / "a_copy", copy_function=os.link)
    lost = _lose_shards(root / "b")
    assert lost == _lose_shards(root / "a_copy")
    assert main(["compare", str(root / "a"), str(root / "b"), "-o", str(root / "cmp")]) == 0
    return {"a": root / "a", "b": root / "b", "a_copy": root / "a_copy", "cmp": root / "cmp", "lost": lost}


def _check_not_compared_nodes(graph, report: probe.Report, lost: set[int]) -> set[str]:
    """Every node carries its row's verdict; the not-compared ones lost data, say so, and are not
    drawn as a pass. Returns them."""
    rows = {row["op_a"]: row for row in report.rows if row["op_a"] is not None}
    for node, data in graph.nodes(data=True):
        assert data["compare_verdict"] == rows[node]["verdict"], node
    uncompared = {node for node, data in graph.nodes(data=True) if data["compare_verdict"] == NOT_COMPARED}
    assert uncompared
    for node in uncompared:
        data = graph.nodes[node]
        assert data["index"] in lost, node
        assert "run B" in data["compare_message"] and any(s in data["compare_message"] for s in DELETED)
        assert finding_colour(data) == COLOURS[NOT_COMPARED]
    return uncompared


def test_graphml_and_json_mark_the_ops_whose_data_is_missing(runs, tmp_path):
    report = probe.compare(runs["a"], runs["b"])
    graphml = export_graph(runs["a"], tmp_path / "g.graphml", "graphml", phase="all", compare=runs["cmp"])[0]
    from_graphml = _check_not_compared_nodes(read_graphml(graphml), report, runs["lost"])
    assert main(["graph", str(runs["a"]), "--format", "json", "--phase", "all",
                 "-o", str(tmp_path / "g.json"), "--compare", str(runs["cmp"])]) == 0
    from_json = _check_not_compared_nodes(read_json(tmp_path / "g.json"), report, runs["lost"])
    assert from_graphml == from_json == {r["op_a"] for r in report.rows if r["verdict"] == NOT_COMPARED}
    # Module level: a module call whose ops were all not compared is not compared, and not a pass.
    modules = read_graphml(export_graph(runs["a"], tmp_path / "m.graphml", "graphml", level="module",
                                        compare=report)[0])
    assert modules.nodes["forward:embed[0]"]["compare_verdict"] == NOT_COMPARED


def test_dot_fills_not_compared_ops_in_their_own_colour(runs, tmp_path):
    dot = export_graph(runs["a"], tmp_path / "g.dot", "dot", compare=runs["cmp"])[0].read_text()
    embedding = next(line for line in dot.splitlines() if 'label="embedding' in line)
    assert f'fillcolor="{COLOURS[NOT_COMPARED]}"' in embedding and "shard-0000" in embedding
    assert COLOURS[NOT_COMPARED] not in {colour for key, colour in COLOURS.items() if key != NOT_COMPARED}


def test_model_explorer_overlay_gives_not_compared_its_own_category(runs, tmp_path):
    paths = export_graph(runs["a"], tmp_path / "me.json", "model-explorer", compare=runs["cmp"])
    verdicts = json.loads((tmp_path / "me.compare_verdict.json").read_text())
    legend = next(o for o in OVERLAYS if o.attr == "compare_verdict").colours["categories"]
    assert legend[NOT_COMPARED] not in {legend[v] for v in legend if v != NOT_COMPARED}
    forward = verdicts["forward"]["results"]
    uncompared = {op: r for op, r in forward.items() if r["value"] == NOT_COMPARED}
    assert uncompared
    assert all(r["bgColor"] == legend[NOT_COMPARED] != legend[PASS] for r in uncompared.values())
    assert verdicts["forward (modules)"]["results"]["forward:embed[0]"]["value"] == NOT_COMPARED
    collection = json.loads(paths[0].read_text())
    nodes = {n["id"]: n for g in collection["graphs"] if g["id"] == "forward" for n in g["nodes"]}
    attrs = {kv["key"]: kv["value"] for kv in nodes[next(iter(uncompared))]["attrs"]}
    assert attrs["compare_verdict"] == NOT_COMPARED and "no data to compare" in attrs["compare_message"]


def test_the_viewer_opens_on_the_first_divergence_past_ops_not_compared(runs):
    report = probe.compare(runs["a"], runs["b"])
    divergence = report.divergence
    assert divergence is not None and divergence.inputs_assumed  # its inputs come from lost ops
    _, graphs = model_explorer_graphs(probe.load(runs["a"]), 0, 0, compare=report)
    where = focus(graphs)
    assert (where.node_id, where.overlay) == (divergence.op_a.id, "compare verdict")
    earlier = [n for n, d in graphs["forward"].nodes(data=True)
               if d["compare_verdict"] == NOT_COMPARED and d["index"] < divergence.op_a.index]
    assert earlier  # the focus skipped ops not compared that came before it


def test_the_viewer_opens_on_the_first_op_not_compared_when_nothing_diverges(runs):
    report = probe.compare(runs["a"], runs["a_copy"])
    assert report.divergence is None and not report.ok and report.counts[NOT_COMPARED]
    run = probe.load(runs["a"])
    _, graphs = model_explorer_graphs(run, 0, 0, compare=report)
    where = focus(graphs)
    first = min(runs["lost"] & {run.op(r["op_a"]).index for r in report.rows if r["verdict"] == NOT_COMPARED})
    assert (where.graph_id, where.overlay) == ("forward", "compare verdict")
    assert run.op(where.node_id).index == first
