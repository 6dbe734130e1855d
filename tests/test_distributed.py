"""Multi-process training under the probe: 2-rank DDP and FSDP2 jobs on CPU (gloo),
launched with torchrun from the test, each bounded by a timeout so a hang fails
the test instead of stalling the suite. The job itself is tests/distributed/worker.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import probe
from probe.analysis.consistency import check_consistency
from probe.cli import main
from probe.exporters.graph_formats import read_graphml

WORKER = Path(__file__).parent / "distributed" / "worker.py"
JOB_TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


# gloo itself can abort a process at random as it tears down (std::terminate from a C++
# thread; pytorch/pytorch#65237, #179291): seen once in CI on a job that passes hundreds of
# runs here. Such a job is run once more, and the first failure is shown as a warning.
_BACKEND_ABORT = "terminate called without an active exception"


def torchrun(out: Path, *args: str, nproc: int = 2) -> dict[int, dict]:
    """Run the worker on ``nproc`` ranks; the per-rank reports it wrote."""
    report = out.with_name(out.name + "-report")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), "--out", str(out), "--report", str(report), *args]
    # PYTHONFAULTHANDLER: a rank killed by a signal prints where it was.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    for attempt in (1, 2):
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=env, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"the {nproc}-rank job hung (killed after {JOB_TIMEOUT_S} s):\n{output[-3000:]}")
        if process.returncode == 0 or attempt == 2 or _BACKEND_ABORT not in output:
            break
        warnings.warn(f"a rank aborted in the backend; running the job again:\n{output[-6000:]}",
                      stacklevel=2)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(report, ignore_errors=True)
    assert process.returncode == 0, f"the job failed:\n{output[-6000:]}"
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in report.glob("rank*.json")}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    return out, torchrun(out, "--wrap", "ddp", "--modes", "stats")


@pytest.fixture(scope="module")
def ddp_desync(tmp_path_factory):
    out = tmp_path_factory.mktemp("desync") / "run"
    return out, torchrun(out, "--wrap", "ddp", "--modes", "stats", "--desync-rank", "1")


def _ops(run: probe.Run, step: int, rank: int, name: str) -> list[probe.OpRecord]:
    return [op for op in run.ops(step, rank) if op.name == name]


def test_ddp_ranks_write_their_own_runs_and_training_is_unchanged(ddp):
    out, reports = ddp
    run = probe.load(out)
    assert run.ranks == [0, 1]
    for rank in (0, 1):
        assert run.steps_of(rank) == [0, 1]
        process = run.process(rank)
        assert (process["rank"], process["world_size"], process["backend"]) == (rank, 2, "gloo")
        assert run.step_info(0, rank).manifest["parallel"] == "replicated"
        # Passive mode: the same losses and weights as the run without the probe, on every rank.
        assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
        assert reports[rank]["identical_params"]
    assert reports[0]["plain_losses"] != reports[1]["plain_losses"]  # each rank trains on its own data


def test_ddp_gradient_all_reduce_is_recorded_in_backward_with_its_group_and_result(ddp):
    out, _ = ddp
    run = probe.load(out)
    for step in (0, 1):
        reduced = {rank: _ops(run, step, rank, "c10d.allreduce_.default") for rank in (0, 1)}
        grads = {rank: [op for op in ops if op.phase == "backward"] for rank, ops in reduced.items()}
        assert grads[0] and len(grads[0]) == len(grads[1])
        for a, b in zip(grads[0], grads[1], strict=True):
            assert a.group == {"size": 2, "name": a.group["name"], "ranks": [0, 1]}
            assert a.id == b.id
            # Taken after the wait: the reduced gradient, the same on both ranks, whose
            # local gradients (the all-reduce's input) differ.
            assert a.outputs[0].stats == b.outputs[0].stats
            assert a.outputs[0].stats["norm"] > 0
            producer_a = run.ops(step, 0)[a.inputs[0].source[0]]
            producer_b = run.ops(step, 1)[b.inputs[0].source[0]]
            assert producer_a.outputs[0].stats != producer_b.outputs[0].stats


def test_ddp_ranks_are_consistent(ddp, capsys):
    out, _ = ddp
    report = check_consistency(probe.load(out))
    assert report.consistent, [f.describe() for f in report.findings]
    assert report.steps == [0, 1]
    assert report.checked > 20  # all-reduce results and every parameter update
    assert main(["consistency", str(out)]) == 0
    assert main(["summary", str(out)]) == 0
    assert "consistent" in capsys.readouterr().out


def test_a_desynchronised_rank_is_named_by_the_consistency_check(ddp_desync, capsys):
    out, _ = ddp_desync
    report = check_consistency(probe.load(out))
    first = report.first
    assert first is not None
    # Rank 1's head weight was nudged after step 0: its first update in step 1 disagrees.
    assert (first.step, first.rank, first.phase) == (1, 1, "optimizer")
    assert first.reference_ranks == (0,)
    assert first.value != first.reference
    assert all(f.rank == 1 for f in report.findings)
    assert main(["consistency", str(out), "-o", str(out.parent / "consistency.json")]) == 1
    printed = capsys.readouterr().out
    assert "rank 1" in printed and first.op_id in printed
    saved = json.loads((out.parent / "consistency.json").read_text())
    assert saved["first"]["rank"] == 1 and not saved["consistent"]


def test_compare_goes_rank_by_rank_and_summarises_across_ranks(ddp, ddp_desync):
    report = probe.compare(ddp[0], ddp_desync[0])
    per_rank = {row["rank"]: row for row in report.by_rank()}
    assert set(per_rank) == {0, 1}
    # Rank 0 only sees rank 1's drift through the averaged gradients (small differences);
    # rank 1 diverges at the op of its own that nudged the weight (traced: the worker's
    # add_ runs inside the session), named with the head's ops that read it.
    assert per_rank[0]["first_divergence"] is None
    first = per_rank[1]["first_divergence"]
    assert first["step"] == 1 and first["op_a"] is None and first["name"] == "aten.add_.Tensor"
    assert first["rule"] == "unmatched producer" and "module.head[0]:aten.t.default" in first["message"]
    assert report.divergence.rank == 1
    assert report.summary["per_rank"] == report.by_rank()


def test_fsdp2_collectives_are_attributed_to_their_modules(tmp_path):
    out = tmp_path / "run"
    reports = torchrun(out, "--wrap", "fsdp2", "--modes", "stats")
    for rank in (0, 1):
        assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
        assert reports[rank]["identical_params"]
    run = probe.load(out)
    assert run.step_info(0, 0).manifest["parallel"] == "sharded"
    gathers = _ops(run, 1, 0, "c10d._allgather_base_.default")
    scatters = _ops(run, 1, 0, "c10d._reduce_scatter_base_.default")
    sharded_modules = {"", "inp", "mlp", "head"}  # the root and the three fully_shard'ed layers
    assert {op.module for op in gathers if op.phase == "forward"} == sharded_modules
    assert {op.module for op in scatters} == sharded_modules
    assert all(op.phase == "backward" for op in scatters)
    for op in gathers + scatters:
        assert op.group["size"] == 2 and op.group["ranks"] == [0, 1]
        stats = op.outputs[0].stats
        # After the wait: real parameters and gradients, not the empty buffer's garbage.
        assert stats["nan"] == 0 and stats["inf"] == 0 and stats["norm"] < 100
    # FSDP2's copy-in buffer is written by the all-gather: no statistics before that.
    copy_in = _ops(run, 1, 0, "fsdp.all_gather_copy_in.default")
    assert copy_in and all(t.stats is None for op in copy_in for t in op.outputs)
    # Every rank gathers the same full parameters; reduce-scatter shards differ by rank.
    report = check_consistency(run)
    assert report.consistent and report.checked >= len(gathers)
    other = {op.id: op for op in _ops(run, 1, 1, "c10d._reduce_scatter_base_.default")}
    assert any(op.outputs[0].stats != other[op.id].outputs[0].stats for op in scatters)
    # The op graph carries the group for review, through GraphML too.
    path = probe.export_graph(out, tmp_path / "g.graphml", "graphml", step=1, rank=0, phase="backward")[0]
    graph = read_graphml(path)
    grouped = {data["name"] for _, data in graph.nodes(data=True) if data.get("group")}
    assert grouped == {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"}


def worker_module():
    """tests/distributed/worker.py imported (its model and data)."""
    spec = importlib.util.spec_from_file_location("probe_test_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fsdp2_parameters_freed_between_uses_have_the_statistics_of_their_values(tmp_path):
    # Width 256: parameters large enough to be queued. FSDP2 frees the unsharded parameters
    # after each use and reallocates them (a storage resize_, no op): a queued tensor on that
    # memory would be read freed or rewritten. They are reduced at once instead.
    out = tmp_path / "run"
    reports = torchrun(out, "--wrap", "fsdp2", "--modes", "stats", "--width", "256")
    for rank in (0, 1):
        assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
        assert reports[rank]["identical_params"]
        assert reports[rank]["probe_warnings"] == []  # no lost nor later-value statistics
    torch.manual_seed(0)
    initial = dict(worker_module().TinyNet(256).named_modules())
    run = probe.load(out)
    for rank in (0, 1):
        assert "unmeasured_tensors" not in run.step_info(0, rank).manifest["modes"]["stats"]
        ops = run.ops(0, rank)
        # Each sharded module's parameters, unsharded in forward: [world, shard] per parameter.
        copies = {op.module: op for op in ops
                  if op.name == "fsdp.split_with_sizes_copy.default" and op.phase == "forward"}
        assert sorted(copies) == ["", "head", "inp", "mlp"]
        for module in ("head", "inp", "mlp"):  # mlp's weights (65k) are the queued kind
            values = [p.detach() for p in initial[module].parameters()]
            for o, value in zip(copies[module].outputs, values, strict=True):
                assert o.stats["max"] == value.max().item()
                assert o.stats["norm"] == pytest.approx(value.norm().item(), rel=1e-5)
        # The forward's views of the unsharded weights: used, then freed by the reshard.
        views = [op for op in ops if op.name == "aten.t.default" and op.phase == "forward"]
        assert sorted(op.module for op in views) == ["head", "inp", "mlp.0", "mlp.2"]
        for op in views:
            weight = initial[op.module].weight.detach()
            assert op.outputs[0].stats["max"] == weight.max().item()
            assert op.outputs[0].stats["norm"] == pytest.approx(weight.norm().item(), rel=1e-5)


def test_two_fsdp2_runs_compare_clean_though_fsdp2_refills_reallocated_buffers(tmp_path):
    # After each reshard FSDP2 reallocates the unsharded parameters (a storage resize_, no op)
    # and views them as [world, shard] to copy the all-gather into: those views hold whatever
    # the allocator handed back. Recorded, that garbage (NaN now and then) made a healthy run
    # report non-finite values and two identical runs a divergence at FSDP2's view.
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        torchrun(out, "--wrap", "fsdp2", "--modes", "stats,dump")
    for out in runs:
        run = probe.load(out)
        for rank in (0, 1):
            for step in (0, 1):
                assert run.step_info(step, rank).manifest["modes"]["stats"]["nonfinite_rows"] == 0
            views = [op for op in run.ops(1, rank) if op.name == "aten.view.default"
                     and any(o.stats is None for o in op.outputs)]
            assert views  # the views of the refilled buffers: no statistics, not garbage
    report = probe.compare(*runs)
    assert report.first_divergence is None
    assert report.counts["error"] == 0 and report.counts["warning"] == 0 and report.counts["pass"] > 500


def first_step_gradients(worker) -> dict[str, torch.Tensor]:
    """The gradients of the first step on the whole model: both ranks' batches, averaged."""
    torch.manual_seed(0)
    model = worker.TinyNet()
    for rank in (0, 1):
        x, y = worker.batches(rank, 1)[0]
        (torch.nn.functional.cross_entropy(model(x), y) / 2).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("wrap", ["fsdp2", "hsdp"])
def test_fsdp2_monitor_reduces_each_ranks_shard_into_the_whole_gradient(tmp_path, wrap):
    # FSDP2's gradients are DTensors: reduced as DTensors, the monitor's metrics issued
    # collectives of their own and failed on partial placements (training stopped at the first
    # optimizer step). Each rank reduces its shard; reduce_ranks makes the whole gradient's,
    # each element counted once: HSDP's replicas (every rank holds all of it here) too.
    out = tmp_path / "run"
    reports = torchrun(out, "--wrap", wrap, "--modes", "monitor", "--monitor-reduce")
    for rank in (0, 1):
        assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
        assert reports[rank]["identical_params"]
        assert reports[rank]["probe_warnings"] == []
    expected = first_step_gradients(worker_module())
    run = probe.load(out)
    grads = {r.name: r for r in run.monitor(0, 0) if r.kind == "weight_grad"}
    assert sorted(grads) == sorted(expected)
    for name, grad in expected.items():
        assert grads[name].numel == grad.numel()  # the shards of both ranks, once each
        assert grads[name].norm == pytest.approx(grad.norm().item(), rel=1e-5)
        assert grads[name].max == pytest.approx(grad.max().item(), rel=1e-5, abs=1e-7)


def test_fsdp2_parameter_checks_and_checksums_read_each_ranks_shard(tmp_path):
    out = tmp_path / "run"
    reports = torchrun(out, "--wrap", "fsdp2", "--modes", "stats", "--model")
    for rank in (0, 1):
        assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
        assert reports[rank]["probe_warnings"] == []  # "cannot check parameters for NaN/Inf" before
    run = probe.load(out)
    names = [name for name, _ in worker_module().TinyNet().named_parameters()]
    for rank in (0, 1):
        for step in (0, 1):
            checks = run.step_info(step, rank).manifest["modes"]["stats"]["nonfinite_parameters"]
            clean = {"checked": len(names), "names": [], "count": 0}
            assert checks["parameters"] == checks["gradients"] == clean
    # Each rank checksums its own shard of every parameter.
    sums = [json.loads((out / f"rank{rank}" / "step0" / "checksums.json").read_text())["parameters"]
            for rank in (0, 1)]
    assert sums[0]["names"] == sums[1]["names"] == names
    for name, a, b in zip(names, sums[0]["checksums"], sums[1]["checksums"], strict=True):
        assert (a == b) == name.startswith("norm.")  # LayerNorm's ones and zeros: equal halves


def test_a_rank_filter_records_only_the_selected_ranks_without_hanging(tmp_path):
    out = tmp_path / "run"
    reports = torchrun(out, "--wrap", "ddp", "--modes", "stats", "--ranks", "0")
    run = probe.load(out)
    assert run.ranks == [0]
    assert not (out / "rank1").exists()
    assert sorted(reports) == [0, 1]  # both ranks finished the job
    for rank in (0, 1):
        assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
    assert _ops(run, 0, 0, "c10d.allreduce_.default")


def test_a_per_step_cross_rank_reduction_refuses_a_rank_filter(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    session = probe.mode("monitor", out=tmp_path / "r", ranks=[0], reduce_ranks=True, targets=["*"])
    with pytest.raises(probe.ProbeError, match=r"ranks.*would never join"):
        session.__enter__()


def test_a_rank_writes_beside_the_other_ranks_but_not_over_its_own_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with probe.mode("stats", out=tmp_path / "r") as session:
            torch.ones(3).exp()
            session.step()
    assert probe.load(tmp_path / "r").ranks == [0, 1]
    with pytest.raises(probe.ProbeError, match="rank0"):
        probe.mode("stats", out=tmp_path / "r")


def test_an_unselected_rank_runs_its_steps_untraced(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with probe.mode("stats", out=tmp_path / "r", ranks=[0]) as session:
        assert torch._C._len_torch_dispatch_stack() == 0  # no dispatch mode: nothing per op
        torch.ones(3).exp()
        session.step()
    assert not (tmp_path / "r").exists()
