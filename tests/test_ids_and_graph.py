"""Stable op ids across runs, and the producer -> consumer graph."""

from __future__ import annotations

import networkx as nx
import torch

import probe
from probe.demo.train import DemoTraining, train


def _demo_ids(out, phases=("forward", "backward", "optimizer")):
    training = DemoTraining()
    train(training, 2, session=probe.mode("stats", out=out, model=training.model))
    run = probe.load(out)
    return [[op.id for op in run.ops(step) if op.phase in phases] for step in run.steps]


def test_two_identical_runs_give_identical_id_sequences(tmp_path):
    a, b = _demo_ids(tmp_path / "a"), _demo_ids(tmp_path / "b")
    assert a == b
    assert len(a) == 2 and len(a[0]) > 500
    assert all(len(set(ids)) == len(ids) for ids in a)  # unique within a step
    # Every step runs the same forward and backward: the same ids in each step.
    fwd_bwd = _demo_ids(tmp_path / "c", phases=("forward", "backward"))
    assert fwd_bwd[0] == fwd_bwd[1]


def test_graph_edges_follow_values_through_views_and_inplace_writes(tmp_path):
    with probe.mode("stats", out=tmp_path / "r"):
        x = torch.randn(4, 4)       # 0 randn
        y = x.exp()                 # 1 exp          <- randn
        v = y.t()                   # 2 t            <- exp
        v.mul_(2.0)                 # 3 mul_         <- t (writes y's storage)
        z = y.sum()                 # 4 sum          <- mul_ (y read after the write)
        w = v.add(1.0)              # 5 add          <- mul_ (the view it wrote)
        del z, w
    run = probe.load(tmp_path / "r")
    ops = run.ops(0)
    assert [op.name for op in ops] == [
        "aten.randn.default", "aten.exp.default", "aten.t.default", "aten.mul_.Tensor",
        "aten.sum.default", "aten.add.Tensor",
    ]
    g = run.graph(0)
    ids = [op.id for op in ops]
    assert isinstance(g, nx.DiGraph) and list(g.nodes) == ids
    expected = {(0, 1), (1, 2), (2, 3), (3, 4), (3, 5)}
    assert {(ids.index(a), ids.index(b)) for a, b in g.edges} == expected
    assert ops[3].outputs[0].mutated
    edge = g.edges[ids[1], ids[2]]
    assert edge["dtype"] == "float32" and edge["shape"] == [4, 4]
    assert g.nodes[ids[4]]["module"] == "" and g.nodes[ids[4]]["phase"] == "forward"


def test_a_dtype_view_and_its_base_are_each_read_with_their_own_dtype(tmp_path):
    # view(torch.int32) of float32 values has its base's key (memory, shape, stride, version):
    # a read of either is linked to the latest op that exposed the value, described in its own dtype.
    with probe.mode("structure", out=tmp_path / "r"):
        y = torch.randn(4, 4).exp()
        bits = y.view(torch.int32)
        bits.bitwise_and(1)
        y.neg()
        y.abs()
    ops = {op.name: op for op in probe.load(tmp_path / "r").ops(0)}
    view = ops["aten.view.dtype"]
    assert view.inputs[0].dtype == "float32" and view.inputs[0].source[0] == ops["aten.exp.default"].index
    assert view.outputs[0].dtype == "int32"
    assert ops["aten.bitwise_and.Scalar"].inputs[0].dtype == "int32"
    for name in ("aten.neg.default", "aten.abs.default"):
        read = ops[name].inputs[0]
        assert read.dtype == "float32" and tuple(read.shape) == (4, 4) and read.source is not None


def test_freed_storage_reuse_does_not_link_to_a_stale_producer(tmp_path):
    with probe.mode("stats", out=tmp_path / "r", ops=["aten.exp.default", "aten.neg.default"]):
        a = torch.randn(1024).exp()  # traced producer
        del a                        # storage freed; the allocator may hand it out again
        b = torch.randn(1024)        # untraced producer, possibly at the same address
        b.neg()
    ops = probe.load(tmp_path / "r").ops(0)
    assert [op.name for op in ops] == ["aten.exp.default", "aten.neg.default"]
    assert ops[1].inputs[0].source is None


def test_call_sites_are_recorded_once_per_site(tmp_path):
    lin = torch.nn.Linear(3, 3)
    with probe.mode("stats", out=tmp_path / "r", stack=True, model=lin):
        for _ in range(3):
            lin(torch.ones(1, 3))  # the call site line
    ops = probe.load(tmp_path / "r").ops(0)
    addmm = [op for op in ops if op.name == "aten.addmm.default"]
    assert len(addmm) == 3
    site = addmm[0].stack
    assert site and site[-1].startswith(f"{__file__}:") and "test_call_sites" in site[-1]
    assert addmm[1].stack == site
