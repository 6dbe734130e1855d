"""Collectives as ops, in one process (a gloo group of one rank): recorded with their
process group, statistics taken once the result is there (after the wait)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import probe

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _only(run: probe.Run, name: str) -> probe.OpRecord:
    found = [op for op in run.ops() if op.name == name]
    assert len(found) == 1, [op.name for op in run.ops()]
    return found[0]


def test_an_async_all_reduce_is_recorded_with_its_group_and_the_waited_result(group, tmp_path):
    t = torch.full((3,), 2.0)
    with probe.mode("stats", out=tmp_path / "r") as session:
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        t.mul_(3)  # the result is read (and changed) only after the wait
        session.step()
    run = probe.load(tmp_path / "r")
    reduce = _only(run, "c10d.allreduce_.default")
    assert reduce.group == {"size": 1, "name": group.group_name, "ranks": [0]}
    assert reduce.outputs[0].stats["max"] == 2.0 and reduce.outputs[0].mutated
    assert _only(run, "aten.mul_.Tensor").outputs[0].stats["max"] == 6.0
    assert run.process(0)["world_size"] == 1


def test_a_result_nothing_reads_in_the_step_is_waited_for_at_its_end(group, tmp_path):
    t = torch.arange(4.0)
    with probe.mode("stats", out=tmp_path / "r") as session:
        dist.all_reduce(t, async_op=True)
        session.step()
    reduce = _only(probe.load(tmp_path / "r"), "c10d.allreduce_.default")
    assert reduce.outputs[0].stats["norm"] == pytest.approx(float(torch.arange(4.0).norm()))


def test_a_functional_all_reduce_gets_its_statistics_after_wait_tensor(group, tmp_path):
    import torch.distributed._functional_collectives as funcol

    x = torch.linspace(-1, 1, 8)
    with probe.mode("stats", out=tmp_path / "r") as session:
        y = funcol.all_reduce(x, "sum", group)
        (y * 2).sum()
        session.step()
    run = probe.load(tmp_path / "r")
    reduce = _only(run, "_c10d_functional.all_reduce.default")
    assert reduce.group["size"] == 1 and reduce.group["ranks"] == [0]
    stats = reduce.outputs[0].stats
    assert (stats["min"], stats["max"]) == (-1.0, 1.0)
    assert _only(run, "aten.mul.Tensor").outputs[0].stats["max"] == 2.0


def test_an_all_gather_into_a_list_records_every_output(group, tmp_path):
    outputs = [torch.zeros(2)]
    with probe.mode("stats", out=tmp_path / "r") as session:
        dist.all_gather(outputs, torch.tensor([1.0, -3.0]))
        session.step()
    gather = _only(probe.load(tmp_path / "r"), "c10d.allgather_.default")
    assert len(gather.outputs) == 1
    assert (gather.outputs[0].stats["min"], gather.outputs[0].stats["max"]) == (-3.0, 1.0)


def test_a_failing_step_does_not_wait_for_collectives_in_flight(group, tmp_path):
    # A functional collective's result waits for wait_tensor, which never comes here.
    in_flight = []
    with pytest.raises(RuntimeError, match="boom"), probe.mode("stats", out=tmp_path / "r"):
        in_flight.append(torch.ops._c10d_functional.all_reduce(torch.arange(4.0), "sum", group.group_name))
        raise RuntimeError("boom")
    torch.ops._c10d_functional.wait_tensor(in_flight[0])  # the program's own clean-up
    run = probe.load(tmp_path / "r")
    assert not run.step_info(0).complete
    reduce = _only(run, "_c10d_functional.all_reduce.default")
    assert reduce.outputs[0].stats is None  # never read: its peers may have died


def test_a_functional_result_nothing_waits_for_is_waited_for_at_the_step_end(group, tmp_path):
    with probe.mode("stats", out=tmp_path / "r") as session:
        torch.ops._c10d_functional.all_reduce(torch.arange(4.0), "sum", group.group_name)
        session.step()
    reduce = _only(probe.load(tmp_path / "r"), "_c10d_functional.all_reduce.default")
    assert reduce.outputs[0].stats["max"] == 3.0


@pytest.mark.parametrize("async_op", [False, True])
def test_what_reads_an_in_place_collectives_result_reads_the_collectives_value(group, tmp_path, async_op):
    """An in-place collective writes without a version bump: what reads its tensor afterwards
    reads the collective's output (not the value before it), and a view taken before the wait
    shares the collective's statistics row (its values are the waited result's)."""
    x = torch.full((64,), 2.0)
    with probe.mode("stats", out=tmp_path / "r") as session:
        t = x * 1.0
        work = dist.all_reduce(t, async_op=async_op)
        v = t.view(8, 8)
        if work is not None:
            work.wait()
        v.sum()
        session.step()
    run = probe.load(tmp_path / "r")
    reduce, view = _only(run, "c10d.allreduce_.default"), _only(run, "aten.view.default")
    assert view.inputs[0].source == (reduce.index, 0)
    assert _only(run, "aten.sum.default").inputs[0].source == (view.index, 0)
    assert view.outputs[0].stats is reduce.outputs[0].stats  # one row: the waited result's
