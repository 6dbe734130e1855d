"""The tracer coexists with torch.compile, higher-order ops, autocast, fake and DTensor tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import probe


def test_compiled_function_still_compiles_fullgraph_after_a_traced_step(tmp_path):
    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return torch.sin(x) * 2 + 1

    x = torch.randn(8)
    with probe.mode("stats", out=tmp_path / "r") as session:
        y = f(x)
        session.step()
    # force_eager while the probe was active: the function's ops were traced.
    assert "aten.sin.default" in {op.name for op in probe.load(tmp_path / "r").ops(0)}
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    assert torch.equal(f(x), y)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compiled_keep_leaves_compiled_code_compiled(tmp_path):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def g(x):
        return torch.cos(x) - 1

    g(torch.randn(4))
    with probe.mode("stats", out=tmp_path / "r", compiled="keep") as session:
        g(torch.randn(4))
        torch.relu(torch.randn(4))
        session.step()
    names = {op.name for op in probe.load(tmp_path / "r").ops(0)}
    assert "aten.relu.default" in names


def test_torch_cond_passes_through(tmp_path):
    x = torch.randn(5)
    with probe.mode("stats", out=tmp_path / "r"):
        out = torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))
    expected = x.sin() if x.sum() > 0 else x.cos()
    assert torch.equal(out, expected)
    names = [op.name for op in probe.load(tmp_path / "r").ops(0)]
    assert "hop.cond" in names


def test_cpu_bf16_autocast_casts_are_their_own_ops(tmp_path):
    lin = nn.Linear(8, 8)
    with probe.mode("stats", out=tmp_path / "r", model=lin), torch.autocast("cpu", dtype=torch.bfloat16):
        lin(torch.randn(2, 8))
    ops = probe.load(tmp_path / "r").ops(0)
    casts = [op for op in ops if op.name == "aten._to_copy.default"]
    assert casts and {op.outputs[0].dtype for op in casts} == {"bfloat16"}
    assert [op.outputs[0].dtype for op in ops if op.name == "aten.addmm.default"] == ["bfloat16"]


def test_fake_tensor_ops_are_skipped(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with probe.mode("stats", out=tmp_path / "r") as session:
        real = torch.ones(3) * 2
        with FakeTensorMode():
            fake = torch.empty(4, 4)
            (fake @ fake).sum()
        session.step()
    names = [op.name for op in probe.load(tmp_path / "r").ops(0)]
    assert names == ["aten.ones.default", "aten.mul.Tensor"]
    assert torch.equal(real, torch.full((3,), 2.0))


def test_dtensor_local_ops_are_recorded_and_the_result_stays_a_dtensor(tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
        a = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
        b = distribute_tensor(torch.randn(6, 3), mesh, [Replicate()])
        with probe.mode("stats", out=tmp_path / "r", ranks=[0]):
            c = a @ b
        assert isinstance(c, DTensor)
        ops = probe.load(tmp_path / "r").ops(0)
        mm = [op for op in ops if op.name == "aten.mm.default"]
        # The local shard's matmul: 2 of 4 rows on each of the 2 ranks.
        assert mm and mm[0].inputs[0].shape == (2, 6) and mm[0].outputs[0].shape == (2, 3)
    finally:
        dist.destroy_process_group()
