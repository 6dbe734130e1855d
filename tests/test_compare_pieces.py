"""A compare split into pieces (issue 25 item 5, ``probe.analysis.compare_pieces``): a folded
tensor-parallel run (2 ranks, gloo, 3 SGD steps, rank 1's shard of ``1.down`` halved) against
the single process gives the same report, row for row and the same first divergence, whether its
pieces run here, in spawned processes, on an executor, or on a local Dask cluster."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

import probe
from probe.analysis.compare_pieces import run_pieces
from probe.cli import main
from tests.test_layouts import HALVED, _job

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pieces")
    paths = {"single": root / "single", "halved": root / "halved"}
    _job(paths["single"], "--plan", "single")
    _job(paths["halved"], "--plan", "tp", "--halve", f"1:{HALVED}", nproc=2)
    return paths


def _everything(report: probe.Report) -> str:
    """The whole report as text: summary (conclusion, counts, first divergence and its chain,
    per rank) and every row with its metrics."""
    return json.dumps({**report.summary, "rows": report.rows}, default=str, sort_keys=True)


def test_pieces_in_processes_give_the_serial_report(runs):
    serial = probe.compare(runs["single"], runs["halved"], processes=1)
    assert probe.load(runs["halved"]).ranks == [0, 1]
    assert len({s.step for s in serial.steps}) == 3 and {s.rank for s in serial.steps} == {0}  # folded
    d = serial.divergence
    assert d is not None and (d.op.module, d.step) == (HALVED, 0)
    # Steps 1 and 2 are judged with what step 0 handed on (a divergence entered): in pieces too.
    assert [s.carry.before for s in serial.steps] == [1, 2, 3]
    assert not serial.steps[1].carry.explained
    spawned = probe.compare(runs["single"], runs["halved"], processes=2)
    assert _everything(spawned) == _everything(serial)
    with ThreadPoolExecutor(2) as executor:
        threaded = probe.compare(runs["single"], runs["halved"], executor=executor)
    assert _everything(threaded) == _everything(serial)


def test_progress_counts_every_op_once_when_pieces_run_elsewhere(runs):
    seen: list[tuple[int, int]] = []
    with ThreadPoolExecutor(2) as executor:
        probe.compare(runs["single"], runs["halved"], executor=executor,
                      progress=lambda done, total: seen.append((done, total)))
    ops = sum(len(probe.load(runs["single"]).ops(step, 0)) for step in range(3))
    assert seen and seen[-1] == (ops, ops)


def test_a_failing_piece_fails_the_run_and_the_rest_are_cancelled():
    def boom(piece: int) -> int:
        if piece == 0:
            raise ValueError("piece 0 failed")
        time.sleep(0.05)
        return piece

    done: list[int] = []
    with ThreadPoolExecutor(1) as executor, pytest.raises(ValueError, match="piece 0 failed"):
        run_pieces(list(range(50)), boom, boom, lambda p: (p,), lambda p, r: done.append(r),
                   executor=executor)
    assert len(done) < 49  # the pieces still queued were cancelled


def test_a_local_dask_cluster_gives_the_serial_report(runs, capsys):
    distributed = pytest.importorskip(
        "distributed", reason="the cluster extra (dask's distributed) is not installed: "
                              "pip install 'probe[cluster]'")
    serial = probe.compare(runs["single"], runs["halved"], processes=1)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None) \
            as cluster, distributed.Client(cluster) as client:
        on_cluster = probe.compare(runs["single"], runs["halved"], executor=client.get_executor())
        assert _everything(on_cluster) == _everything(serial)
        # The command line connects to the scheduler by address; the halved shard fails the check.
        code = main(["compare", str(runs["single"]), str(runs["halved"]), "--scheduler",
                     cluster.scheduler_address, "--fail-on-divergence"])
    assert code == 1
    assert HALVED in capsys.readouterr().out
