"""Graph export: GraphML / JSON round trips, DOT through graphviz, module-level
summaries, Model Explorer collections and overlays, and the ``probe graph`` CLI."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import networkx as nx
import pytest
import torch
from torch import nn

import probe
from probe.analysis.module_graph import build_module_graph
from probe.cli import main
from probe.exporters.graph_export import export_graph, step_graph
from probe.exporters.graph_formats import read_graphml, read_json
from tests.conftest import SharedBlockNet, train_steps

# CI sets this so that a missing tool fails the test instead of skipping it.
REQUIRE_TOOLS = os.environ.get("PROBE_REQUIRE_TOOLS") == "1"


class NaNHead(nn.Module):
    """A head whose log of a shifted value goes NaN for some inputs: the planted fault."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.proj(x) - 0.5).nan_to_num(0.0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = SharedBlockNet(width=16)
        self.body.head = nn.Identity()
        self.head = NaNHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _run(path, modes=("stats", "free_benchmark"), seed=0, **options):
    torch.manual_seed(seed)
    model = Net()
    with probe.mode(list(modes), out=path, model=model, **options) as session:
        train_steps(model, 2, session=session)
    return probe.load(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("graph") / "run", perturb="add_noise")


def _same(a, b) -> bool:
    """Equality that treats NaN as equal to NaN, through lists and dicts."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _assert_same_graph(got: nx.DiGraph, want: nx.DiGraph) -> None:
    assert list(got.nodes) == list(want.nodes)
    assert set(got.edges) == set(want.edges)
    for node in want.nodes:
        assert _same(dict(got.nodes[node]), dict(want.nodes[node])), node
    for edge in want.edges:
        assert _same(dict(got.edges[edge]), dict(want.edges[edge])), edge


def test_nodes_carry_stats_findings_and_phases_split(run):
    ops = run.ops(0)
    forward = step_graph(run, 0, 0, "forward")
    backward = step_graph(run, 0, 0, "backward")
    assert set(forward.nodes) == {op.id for op in ops if op.phase == "forward"}
    assert set(backward.nodes) == {op.id for op in ops if op.phase == "backward"}
    log = next(op for op in ops if op.name == "aten.log.default" and op.phase == "forward")
    node = forward.nodes[log.id]
    assert node["module"] == "head" and node["nonfinite"] == log.outputs[0].stats["nan"] > 0
    assert node["output_stats"][0] == log.outputs[0].stats
    mm = next(op for op in ops if op.name == "aten.addmm.default" and op.phase == "forward")
    stats = mm.outputs[0].stats
    assert forward.nodes[mm.id]["abs_max"] == max(abs(stats["min"]), abs(stats["max"]))
    assert forward.nodes[mm.id]["check_verdict"] in ("pass", "fail")
    assert forward.nodes[mm.id]["check_perturb"] == "add_noise"
    # Edges stay inside the phase; a backward op's forward inputs are not edges.
    assert all(backward.nodes[b]["phase"] == "backward" for _, b in backward.edges)
    assert backward.number_of_edges() > 0


def test_graphml_round_trip_gives_back_the_graph(run, tmp_path):
    for level in ("op", "module"):
        want = step_graph(run, 1, 0, "all", level)
        path = tmp_path / f"{level}.graphml"
        assert export_graph(run, path, "graphml", step=1, phase="all", level=level) == [path]
        _assert_same_graph(read_graphml(path), want)
        # Any GraphML reader gets scalar attributes with their types.
        plain = nx.read_graphml(path)
        first = next(iter(want.nodes))
        assert plain.nodes[first]["index"] == want.nodes[first]["index"]
        assert plain.nodes[first]["phase"] == want.nodes[first]["phase"]


def test_json_round_trip_gives_back_the_graph(run, tmp_path):
    want = step_graph(run, 0, 0, "backward")
    path = export_graph(run, tmp_path / "g.json", "json", phase="backward")[0]
    _assert_same_graph(read_json(path), want)


def _graphviz():
    dot = shutil.which("dot")
    if dot is None:
        if REQUIRE_TOOLS:
            pytest.fail("graphviz's dot is not installed (PROBE_REQUIRE_TOOLS=1)")
        pytest.skip("graphviz's dot is not installed")
    return dot


@pytest.mark.parametrize("level", ["op", "module"])
def test_dot_renders_with_graphviz_and_colours_the_nan(run, tmp_path, level):
    dot = _graphviz()
    path = export_graph(run, tmp_path / "g.dot", "dot", level=level)[0]
    svg = subprocess.run([dot, "-Tsvg", str(path)], capture_output=True, text=True, check=True).stdout
    graph = step_graph(run, 0, 0, "forward", level)
    assert svg.count('class="node"') == graph.number_of_nodes()
    assert svg.count('class="edge"') == graph.number_of_edges()
    assert "#e53935" in svg  # the NaN op (or its module call) is filled red
    if level == "op":
        assert ">log<" in svg and ">addmm<" in svg
        assert svg.count('class="cluster"') >= 4  # body, body.inp, body.block.fc, head, ...
    else:
        assert "head.proj" in svg or ">proj" in svg


def test_module_graph_has_one_node_per_module_call(run):
    ops = step_graph(run, 0, 0, "forward")
    modules = build_module_graph(ops, run.module_types(0))
    keys = set(modules.nodes)
    # The shared block is called twice: two calls of each of its modules.
    assert {"forward:body.block.fc[0]", "forward:body.block.fc[1]",
            "forward:body.block.act[0]", "forward:body.block.act[1]"} <= keys
    assert sum(n["ops"] for _, n in modules.nodes(data=True)) == ops.number_of_nodes()
    assert modules.nodes["forward:body.block.fc[0]"]["type"] == "Linear"
    assert modules.has_edge("forward:body.block.fc[0]", "forward:body.block.act[0]")
    assert modules.has_edge("forward:body.block.act[0]", "forward:body.block.fc[1]")
    head = [n for k, n in modules.nodes(data=True) if n["module"] == "head"]
    assert head and head[0]["nonfinite"] > 0
    assert all(not n.get("nonfinite") for _, n in modules.nodes(data=True) if n["module"].startswith("body"))


def _strict_json(path):
    def refuse(constant):
        raise AssertionError(f"{path.name} holds {constant}: not valid JSON for a browser")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_model_explorer_collection_and_overlays(tmp_path):
    a = _run(tmp_path / "a", modes=("stats", "dump", "free_benchmark"), perturb="add_noise")
    _run(tmp_path / "b", modes=("stats", "dump"), seed=1)  # other weights: a divergence
    assert main(["compare", str(a.path), str(tmp_path / "b"), "-o", str(tmp_path / "cmp")]) == 0
    paths = export_graph(a, tmp_path / "me.json", "model-explorer", compare=tmp_path / "cmp")
    collection = _strict_json(paths[0])
    graphs = {g["id"]: g for g in collection["graphs"]}
    assert {"forward", "backward", "optimizer", "forward (modules)", "backward (modules)"} <= set(graphs)
    forward = graphs["forward"]
    ids = {n["id"] for n in forward["nodes"]}
    assert ids == {op.id for op in a.ops(0) if op.phase == "forward"}
    for node in forward["nodes"]:
        for edge in node["incomingEdges"]:
            assert edge["sourceNodeId"] in ids
    by_id = {n["id"]: n for n in forward["nodes"]}
    fc_op = next(op for op in a.ops(0) if op.module == "body.block.fc" and op.module_call == 1)
    assert by_id[fc_op.id]["namespace"] == "body/block/fc#1"
    output = by_id[fc_op.id]["outputsMetadata"][0]
    shapes = [kv["value"] for kv in output["attrs"] if kv["key"] == "tensor_shape"]
    assert shapes == [f"{fc_op.outputs[0].dtype}[{', '.join(map(str, fc_op.outputs[0].shape))}]"]

    overlays = {p.name: _strict_json(p) for p in paths[1:]}
    assert {"me.nan-inf_count.json", "me.max_abs.json", "me.free-benchmark_verdict.json",
            "me.compare_verdict.json"} <= set(overlays)
    nan = overlays["me.nan-inf_count.json"]["forward"]["results"]
    log = next(op for op in a.ops(0) if op.name == "aten.log.default" and op.phase == "forward")
    assert nan[log.id]["value"] > 0
    module_nan = overlays["me.nan-inf_count.json"]["forward (modules)"]["results"]
    assert module_nan["forward:head.proj[0]"]["value"] == 0
    verdicts = overlays["me.compare_verdict.json"]["forward"]["results"]
    assert {r["value"] for r in verdicts.values()} >= {"error"}
    assert all(r["bgColor"] for r in verdicts.values())
    checks = overlays["me.free-benchmark_verdict.json"]["backward"]["results"]
    assert {r["value"] for r in checks.values()} <= {"pass", "fail", "skip"} and checks


def test_graph_cli_writes_files_and_names_bad_values(run, tmp_path, capsys):
    out = tmp_path / "g.graphml"
    assert main(["graph", str(run.path), "--format", "graphml", "-o", str(out), "--step", "1",
                 "--level", "module", "--phase", "backward"]) == 0
    assert read_graphml(out).graph["phase"] == "backward"
    assert main(["graph", str(run.path), "--format", "graphml", "-o", str(out), "--phase", "sideways"]) == 2
    assert "'sideways' is not one of" in capsys.readouterr().err
    assert main(["graph", str(run.path), "--format", "dot", "-o", str(out), "--step", "7"]) == 2
    assert "step 7" in capsys.readouterr().err
    assert main(["graph", str(run.path), "--format", "dot", "-o", str(tmp_path / "no" / "g.dot")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["graph", str(run.path), "--format", "json", "-o", str(out), "--compare",
                 str(tmp_path / "nowhere")]) == 2
    assert "no comparison at" in capsys.readouterr().err


def test_view_without_model_explorer_says_how_to_install(run, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "model_explorer", None)  # import fails as if absent
    assert main(["view", str(run.path), "--out", str(tmp_path / "v"), "--no-browser"]) == 2
    assert "pip install 'probe[viewer]'" in capsys.readouterr().err
    assert (tmp_path / "v" / "graph.json").is_file()  # the export is kept for another viewer
