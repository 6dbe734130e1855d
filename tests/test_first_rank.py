"""Which rank a NaN started on: a real 2-rank DDP job on CPU (gloo) with a NaN planted on
one rank before the gradient all-reduce that hands it to the other (the job is
tests/distributed/first_rank_worker.py, its two ranks started here under a timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import probe
from probe.cli import main
from probe.rundir.rank_origin import collective_clock, is_collective

WORKER = Path(__file__).parent / "distributed" / "first_rank_worker.py"
JOB_TIMEOUT_S = 120
PLANTED = "forward:module.plant[0]:aten.mul.Tensor:0"
ALL_REDUCE = "c10d.allreduce_.default"

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The runs of the three scenarios (healthy, rank1, both), each a 2-rank run."""
    base = tmp_path_factory.mktemp("first_rank")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), "--out", str(base / "runs"),
                               "--store", str(base / "store"), "--rank", str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True) for rank in (0, 1)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=JOB_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for process in ranks:
            os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the 2-rank job hung (killed after {JOB_TIMEOUT_S} s)")
    for process, output in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, f"a rank failed:\n{output[-3000:]}"
    return base / "runs"


def test_a_nan_planted_on_rank_1_is_named_there_not_where_the_all_reduce_brought_it(runs):
    run = probe.load(runs / "rank1")
    assert run.ranks == [0, 1]
    bad = run.first_nonfinite()
    assert bad is not None
    assert (bad.rank, bad.step, bad.id, bad.module) == (1, 1, PLANTED, "module.plant")
    # Rank 0's own first non-finite op is the all-reduce that brought it (the lowest rank at the
    # step, which the ranks-blind answer would give): it sits later on the collective clock.
    received = run.first_nonfinite(step=1, rank=0)
    assert received is not None and received.name == ALL_REDUCE and is_collective(received)
    origin = run.first_nonfinite_ranks()
    assert origin is not None
    assert origin.ranks == [1] and origin.ops[0].id == PLANTED and origin.step == 1
    # Step 1 starts with DDP's two bucket-rebuild broadcasts; the planted op comes after them
    # and before the gradient all-reduce, which rank 0 completes as its third collective.
    assert origin.clock == 2 == collective_clock(run.ops(1, 1), origin.ops[0])
    assert origin.origins[0].next_collective is not None
    assert origin.origins[0].next_collective.name == ALL_REDUCE
    [later] = origin.later
    assert (later.rank, later.step, later.clock, later.received) == (0, 1, 3, True)
    assert later.op.id == received.id
    line = origin.describe()
    assert line == (f"first non-finite: rank 1 op {PLANTED} (step 1, before collective #2 ({ALL_REDUCE})); "
                    "ranks 0 received it")
    assert run.first_nonfinite_ranks(step=0) is None  # step 0 was healthy on every rank


def test_nans_planted_on_both_ranks_in_the_same_collective_interval_name_both(runs):
    run = probe.load(runs / "both")
    origin = run.first_nonfinite_ranks()
    assert origin is not None
    assert origin.ranks == [0, 1]
    assert [op.id for op in origin.ops] == [PLANTED, PLANTED]
    assert (origin.step, origin.clock) == (0, 0)
    assert origin.later == []
    bad = run.first_nonfinite()
    assert bad is not None and (bad.rank, bad.id) == (0, PLANTED)  # the lowest of the tied ranks
    assert origin.describe() == (f"first non-finite: ranks 0, 1 op {PLANTED} "
                                 f"(step 0, before collective #0 ({ALL_REDUCE}))")


def test_a_healthy_multi_rank_run_has_no_first_nonfinite(runs):
    run = probe.load(runs / "healthy")
    assert run.ranks == [0, 1]
    assert run.first_nonfinite() is None
    assert run.first_nonfinite_ranks() is None
    # The run did record its collectives: the answer is None because nothing went non-finite.
    assert any(is_collective(op) for op in run.ops(0, 1))


def test_probe_summary_names_the_rank_a_nan_started_on(runs, capsys):
    main(["summary", str(runs / "rank1")])
    out = capsys.readouterr().out
    assert f"first non-finite: rank 1 op {PLANTED}" in out and "ranks 0 received it" in out
    main(["summary", str(runs / "healthy")])
    assert "first non-finite: rank" not in capsys.readouterr().out


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_clock_counts_each_functional_collective_once(one_rank_group, tmp_path):
    import torch
    import torch.distributed._functional_collectives as funcol

    with probe.mode("stats", out=tmp_path / "r") as session:
        y = funcol.all_reduce(torch.linspace(-1, 1, 8), "sum", one_rank_group)
        z = funcol.all_reduce(y * 2, "sum", one_rank_group)
        (z + 1).sum()
        session.step()
    ops = probe.load(tmp_path / "r").ops()
    # The autograd wrapper of each result is in the collectives' namespace but exchanges nothing.
    assert [op.name for op in ops].count("_c10d_functional._wrap_tensor_autograd.default") == 2
    assert [op.name for op in ops if is_collective(op)] == ["_c10d_functional.all_reduce.default"] * 2
    clocks = {op.name: collective_clock(ops, op) for op in ops if op.name.startswith("aten.")}
    # The collective itself counts as completed (its output holds the exchanged result).
    assert clocks == {"aten.linspace.default": 0, "aten.mul.Tensor": 1, "aten.add.Tensor": 2,
                      "aten.sum.default": 2}
