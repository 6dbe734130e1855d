"""One model, any layout (issue 25): a small MLP, and a small transformer, trained 3 SGD steps
in one process, with tensor parallelism (DTensor ColwiseParallel/RowwiseParallel, 2 ranks),
DDP and FSDP2 (2 ranks, each a slice of the batch) and FSDP2 x TP2 (a 2-D mesh, 4 ranks), gloo,
CPU, same weights and global batch. The placements are recorded, the ranks' records fold into
logical ops whose statistics are the single process's, and compare finds no divergence between
any two plans, or a halved shard at its module. The jobs are tests/distributed/tp_worker.py, recorded once
per module fixture."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import probe
from probe.analysis.folded_dumps import FoldedPiece, LogicalDump, fold_parts
from probe.analysis.layouts import (
    LogicalRun,
    MissingPartitions,
    combine_stats,
    fold_step,
    normalize_partitions,
)
from probe.analysis.local_placements import local_placement
from probe.analysis.matching import match_ops
from probe.cli import main
from probe.errors import ProbeError
from probe.modes.dump.records import DumpedTensor
from probe.rundir.records import OpRecord, TensorRecord

WORKER = Path(__file__).parent / "distributed" / "tp_worker.py"
JOB_TIMEOUT_S = 300
HALVED = "1.down"

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def _job(out: Path, *args: str, nproc: int = 0) -> None:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    command = [sys.executable, *launcher, str(WORKER), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the job hung (killed after {JOB_TIMEOUT_S} s):\n{output[-3000:]}")
    assert process.returncode == 0, f"the job failed:\n{output[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    paths = {name: root / name for name in ("single", "tp2", "halved")}
    _job(paths["single"], "--plan", "single")
    _job(paths["tp2"], "--plan", "tp", nproc=2)
    _job(paths["halved"], "--plan", "tp", "--halve", f"1:{HALVED}", nproc=2)
    return paths


def _op(run: probe.Run, op_id: str, step: int = 0, rank: int = 0) -> OpRecord:
    return next(op for op in run.ops(step, rank) if op.id == op_id)


def test_ops_on_dtensors_record_their_mesh_and_placements(runs):
    tp = probe.load(runs["tp2"])
    mesh = {"shape": [2], "names": ["tp"], "ranks": [0, 1]}
    up = _op(tp, "forward:0.up[0]:aten.addmm.default:0")
    assert up.layout == {"of": "aten.addmm.default", "role": "compute", "mesh": mesh,
                         "in": [["S(0)"], ["R"], ["S(1)"]], "out": [["S(1)"]]}
    assert up.outputs[0].shape == (8, 16)  # the local shard of (8, 32)
    down = [op for op in tp.ops(0, 0) if op.module == "0.down" and op.phase == "forward"]
    roles = {(op.name, op.layout["role"], tuple(map(tuple, op.layout["out"]))) for op in down if op.layout}
    # RowwiseParallel: the replicated bias is divided locally to make it partial, then added.
    assert ("aten.div.Tensor", "redistribute", (("P(sum)",),)) in roles
    assert ("aten.addmm.default", "compute", (("P(sum)",),)) in roles
    # The SGD update of a column-sharded weight, and the ops on plain tensors: no layout.
    updates = [op for op in tp.ops(0, 1) if op.phase == "optimizer" and op.layout]
    assert {tuple(op.layout["out"][0]) for op in updates} >= {("S(0)",), ("S(1)",), ("R",)}
    assert _op(tp, "forward:0.act[0]:aten.gelu.default:0").layout is None
    assert all(op.layout is None for op in probe.load(runs["single"]).ops(0, 0))  # read as before


def _stats_difference(expected: TensorRecord, folded: TensorRecord) -> float:
    """The largest difference of a folded tensor's statistics from the single process's, relative to
    the larger of the value and the tensor's RMS (a mean near zero is judged at the tensor's scale);
    the NaN and Inf counts must be equal."""
    assert expected.stats is not None and folded.stats is not None, (expected.stats, folded.stats)
    worst = 0.0
    for key in ("min", "max", "mean", "norm"):
        scale = max(abs(expected.stats[key]),
                    expected.stats["norm"] / math.sqrt(max(math.prod(expected.shape), 1)))
        difference = abs(expected.stats[key] - folded.stats[key])
        worst = max(worst, difference / scale if scale else difference)
    assert (expected.stats["nan"], expected.stats["inf"]) == (folded.stats["nan"], folded.stats["inf"])
    return worst


def _folded_like(single: probe.Run, run: probe.Run,
                 partitions: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Each step of ``run`` folded against the single process's ops, paired as compare pairs
    them: the lowest share of the single run's ops matched over the steps, the largest relative
    difference of a folded statistic (to the larger of the value and the tensor's RMS), and the
    number of outputs compared. Shapes must be equal; partial values (a data-parallel rank's
    weight gradient before its reduction) may lack statistics."""
    share, worst, compared = 1.0, 0.0, 0
    for step in single.steps:
        folded = fold_step(run, step, partitions).ops
        pairs = [m for m in match_ops(single.ops(step, 0), folded) if m.a is not None]
        matched = [m for m in pairs if m.b is not None]
        share = min(share, len(matched) / len(pairs))
        for m in matched:
            for a, b in zip(m.a.outputs, m.b.outputs, strict=True):
                assert a.shape == b.shape, m.a.id
                if a.stats is None or b.stats is None:
                    continue
                worst = max(worst, _stats_difference(a, b))
                compared += 1
    return share, worst, compared


def test_folded_statistics_equal_the_single_process_ones(runs):
    single, tp = probe.load(runs["single"]), probe.load(runs["tp2"])
    share, worst, compared = _folded_like(single, tp)
    assert share >= 0.95 and worst <= 1e-6 and compared > 150
    # The partial sum of a RowwiseParallel addmm takes the all-reduced value's statistics.
    partial = {op.id: op for op in fold_step(tp, 0).ops}["forward:0.down[0]:aten.addmm.default:0"]
    reference = _op(single, "forward:0.down[0]:aten.addmm.default:0")
    assert partial.outputs[0].stats["norm"] == pytest.approx(reference.outputs[0].stats["norm"], rel=1e-6)
    assert LogicalRun(tp).findings() == []  # every replica agrees


ROW_PARALLEL_SUMS = {"forward:0.down[0]:aten.addmm.default:0", "forward:1.down[0]:aten.addmm.default:0",
                     "backward:1.up[0]:aten.mm.default:0"}
"""The MLP's sums TP2 splits over its ranks (a partial sum each, all-reduced): RowwiseParallel's
products, and the input gradient of 1.up (ColwiseParallel: its hidden features)."""


def test_single_process_and_tp2_compare_as_logical_ops(runs, capsys):
    report = probe.compare(runs["single"], runs["tp2"])
    assert report.first_divergence is None
    assert report.counts["error"] == 0 and report.counts["pass"] > 150
    assert report.conclusion.startswith("no divergence")
    # Sums whose order TP changed are judged, by the statistics' propagation bound with each
    # run's own number of terms (no dumps here), not passed silently.
    reordered = [c for c in report.comparisons if c.rule == "reduction order"]
    assert {c.a.id for c in reordered} == ROW_PARALLEL_SUMS and len(reordered) == 3 * len(ROW_PARALLEL_SUMS)
    assert all(c.verdict == "pass" and c.message.startswith(
        "consistent with a different reduction order (statistics): run A sums 32 terms in one, run B in 2 "
        "partial sums of 16") for c in reordered)
    assert "sum(s) in a different reduction order" in report.conclusion
    assert main(["compare", str(runs["single"]), str(runs["tp2"]), "--fail-on-divergence"]) == 0
    assert "9 sum(s) in a different reduction order" in capsys.readouterr().out


def test_a_halved_shard_is_the_first_divergence_at_its_module(runs, capsys):
    for reference in ("single", "tp2"):
        report = probe.compare(runs[reference], runs["halved"])
        divergence = report.divergence
        assert divergence is not None
        assert (divergence.op.module, divergence.op.phase, report.first_divergence[0].step) == \
            (HALVED, "forward", 0)
        assert divergence.op.name == "aten.t.default"  # the first op reading the weight
    assert main(["compare", str(runs["single"]), str(runs["halved"]), "--fail-on-divergence"]) == 1
    assert HALVED in capsys.readouterr().out


def test_a_folded_divergence_propagates_through_logical_ops(runs):
    """The chain a divergence propagates through follows the folded ops' graph: each op in it is a
    logical op that diverged too, reached from the one where it entered."""
    report = probe.compare(runs["tp2"], runs["halved"])
    divergence = report.divergence
    (step,) = [s for s in report.steps if s.divergence is divergence]
    rows = {c.a.id: c for c in step.comparisons if c.a is not None}
    logical = LogicalRun(probe.load(runs["tp2"]))
    graph = logical.graph(divergence.step)
    assert set(graph.nodes) == {op.id for op in logical.ops(divergence.step)}
    assert divergence.chain[0] == divergence.op.id and len(divergence.chain) > 5
    for op_id in divergence.chain[1:]:
        assert rows[op_id].verdict in ("error", "warning"), op_id
        assert any(p in divergence.chain for p in graph.predecessors(op_id)), op_id


def test_shard_statistics_combine_exactly():
    torch.manual_seed(0)
    whole = torch.randn(6, 10, dtype=torch.float64)
    whole[2, 3] = float("nan")

    def stats(t: torch.Tensor) -> dict:
        finite = t[t.isfinite()]
        return {"min": finite.min().item(), "max": finite.max().item(), "mean": finite.mean().item(),
                "norm": finite.norm().item(), "nan": int(t.isnan().sum()), "inf": 0}

    for dim in (0, 1):
        parts = [(stats(p), tuple(p.shape)) for p in whole.tensor_split(3, dim)]
        combined = combine_stats(parts)
        expected = stats(whole)
        assert combined["min"] == expected["min"] and combined["max"] == expected["max"]
        assert combined["norm"] == pytest.approx(expected["norm"], rel=1e-12)
        assert combined["nan"] == 1
    assert combine_stats([(None, (3,)), ({"min": 0.0}, (3,))]) is None


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> dict[str, Path]:
    """The MLP recorded with the dump mode beside the statistics: in one process, TP2, and TP2
    with rank 1's shard of 1.down halved."""
    root = tmp_path_factory.mktemp("dumped")
    paths = {name: root / name for name in ("single", "tp2", "halved")}
    _job(paths["single"], "--plan", "single", "--dump")
    _job(paths["tp2"], "--plan", "tp", "--dump", nproc=2)
    _job(paths["halved"], "--plan", "tp", "--dump", "--halve", f"1:{HALVED}", nproc=2)
    return paths


def _folded_tensors_like(single: probe.Run, logical: LogicalRun) -> tuple[float, int]:
    """Every dumped tensor of the folded run's ops against the single process's of the same op:
    the largest difference (relative to the single process's largest magnitude), and how many."""
    worst, compared = 0.0, 0
    for step in single.steps:
        reference = {op.id: op for op in single.ops(step, 0)}
        entries = logical.dump(step).entries
        for op in logical.ops(step):
            if op.id not in reference:
                continue
            for io, records in (("input", op.inputs), ("output", op.outputs)):
                for position in range(len(records)):
                    entry = entries.get((op.index, io, position))
                    assert entry is not None and entry.status is None, (op.id, io, position, entry)
                    whole = logical.tensor(op.id, io, position, step)
                    expected = single.tensor(op.id, io, position, step, 0)
                    assert (whole.shape, whole.dtype) == (expected.shape, expected.dtype), op.id
                    scale = float(expected.double().abs().max()) or 1.0
                    worst = max(worst, float((whole.double() - expected.double()).abs().max()) / scale)
                    compared += 1
    return worst, compared


def _dumps_hold_their_recorded_statistics(run: probe.Run) -> int:
    """Every rank's dumped floating-point tensors against the statistics the stats mode took of
    the same tensors (independently): extremes equal, norms within fp32 rounding. How many.
    Reads right after a collective included: gloo's emulated reduce-scatter all-reduces its input
    buffer unannounced, and the split after it reads the new values (``tests/test_moved_memory.py``)."""
    checked = 0
    for step in run.steps:
        for rank in run.ranks:
            dump = run.dump(step, rank)
            for op in run.ops(step, rank):
                for io, records in (("input", op.inputs), ("output", op.outputs)):
                    for position, record in enumerate(records):
                        entry = dump.entries.get((op.index, io, position))
                        if record.stats is None or entry is None or entry.status is not None \
                                or not record.dtype.startswith("float") or not math.prod(record.shape):
                            continue
                        data = dump.tensor(op.index, io, position).double()
                        where = (step, rank, op.id, io, position)
                        extremes = (float(data.min()), float(data.max()))
                        assert extremes == (record.stats["min"], record.stats["max"]), where
                        assert float(data.norm()) == pytest.approx(record.stats["norm"], rel=1e-5), where
                        checked += 1
    return checked


def test_dumped_tensors_fold_into_the_whole_tensors_of_the_single_process(dumped):
    single, tp = probe.load(dumped["single"]), probe.load(dumped["tp2"])
    # What a rank read of an async collective's buffer before its wait (the wrapper, a view,
    # wait_tensor's input) is its result, as its record says, not the bytes before it.
    assert _dumps_hold_their_recorded_statistics(tp) > 1000
    logical = LogicalRun(tp)
    worst, compared = _folded_tensors_like(single, logical)
    assert worst <= 1e-6 and compared > 400, (worst, compared)  # fp32 rounding of other sum orders
    # A column-parallel product is each rank's half of the features, concatenated; the
    # row-parallel one the all-reduce's result (the value the program went on with).
    up = "forward:0.up[0]:aten.addmm.default:0"
    assert tp.tensor(up, "output", 0, 0, 1).shape == (8, 16) and logical.tensor(up).shape == (8, 32)
    assert torch.equal(logical.tensor(up)[:, 16:], tp.tensor(up, "output", 0, 0, 1))
    down = "forward:0.down[0]:aten.addmm.default:0"
    all_reduce = next(op for op in tp.ops(0, 0) if op.name == "_c10d_functional.all_reduce.default")
    assert torch.equal(logical.tensor(down), tp.tensor(all_reduce.id, "output", 0, 0, 0))
    assert logical.findings() == []  # every replica holds the same bytes


def test_folded_dumps_compare_on_data_and_judge_a_split_sum_by_an_fp64_replay(dumped, capsys):
    report = probe.compare(dumped["single"], dumped["tp2"])
    assert report.first_divergence is None and report.conclusion.startswith("no divergence")
    assert report.counts["error"] == report.counts["not compared"] == 0
    matched = [c for c in report.comparisons if c.a is not None and c.b is not None]
    assert matched and all({t.kind for t in c.outputs} <= {"data"} for c in matched)
    assert any(c.rule == "replay" for c in matched)  # the fp64 replay ran on folded inputs
    reordered = [c for c in matched if c.rule == "reduction order"]
    assert {c.a.id for c in reordered} == ROW_PARALLEL_SUMS and len(reordered) == 9
    assert all(c.message.startswith("consistent with a different reduction order (fp64 replay on each run's "
                                    "inputs): run A sums 32 terms in one, run B in 2 partial sums of 16")
               for c in reordered)
    assert main(["compare", str(dumped["single"]), str(dumped["tp2"]), "--fail-on-divergence"]) == 0
    for reference in ("single", "tp2"):
        report = probe.compare(dumped[reference], dumped["halved"])
        assert report.divergence is not None, reference
        assert (report.divergence.op.id, report.divergence.rule, report.divergence.step) == \
            (f"forward:{HALVED}[0]:aten.t.default:0", "outside input", 0), reference


def test_shards_partial_values_and_strided_shards_fold_by_placement():
    torch.manual_seed(0)
    whole = torch.randn(8, 6)
    # FSDP2 x TP2's column-parallel weight on a (dp, tp) mesh: (_S(0,2), S(0)); rank (i, j)
    # holds rows block j (of 2), then its i-th half of it.
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    parts = {rank: whole.chunk(2, 0)[j].chunk(2, 0)[i] for rank, (i, j) in enumerate(coords)}
    piece = FoldedPiece("output", 0, tuple((r, 0) for r in range(4)), ("_S(0,2)", "S(0)"), (8, 6), "float32")
    assert torch.equal(fold_parts(piece, (2, 2), parts), whole)
    # Shards of dim 1 on the second dim, replicas on the first (only the lowest coordinate's
    # parts are read); partial values summed in fp64, rounded once.
    replicated = FoldedPiece("output", 0, piece.sources, ("R", "S(1)"), (8, 6), "float32")
    assert torch.equal(fold_parts(replicated, (2, 2), {0: whole[:, :3], 1: whole[:, 3:]}), whole)
    halves = {0: whole / 3, 1: whole * 2 / 3}
    partial = FoldedPiece("output", 0, ((0, 0), (1, 0)), ("P(sum)",), (48,), "float32")
    summed = (halves[0].double() + halves[1].double()).float().reshape(48)
    assert torch.equal(fold_parts(partial, (2,), halves), summed)
    assert "summed in fp64" in partial.describe()
    # A transpose no rank recorded the data of (FSDP2 x TP2's unsharded weight in its first
    # step): the parts of what it read, the whole transposed.
    transposed = FoldedPiece("input", 0, piece.sources, ("R", "S(1)"), (6, 8), "float32", transposed=True)
    assert torch.equal(fold_parts(transposed, (2, 2), {0: whole[:, :3], 1: whole[:, 3:]}), whole.t())
    assert "transposed" in transposed.describe()


class _RankDump:
    """One rank's dump of one op's output, as ``run.dump`` hands it."""

    complete = True

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        entry = DumpedTensor(0, "output", 0, "float32", tuple(t.shape), t.stride(), 0, 0, None, None)
        self.entries = {(0, "output", 0): entry}

    def tensor(self, op: int, io: str, position: int) -> torch.Tensor:
        return self.t


class _Dumps:
    def __init__(self, by_rank: dict[int, torch.Tensor]) -> None:
        self.by_rank = by_rank

    def dump(self, step: int, rank: int) -> _RankDump:
        return _RankDump(self.by_rank[rank])


def test_a_replica_whose_bytes_differ_is_found_even_with_equal_statistics():
    value = torch.arange(6, dtype=torch.float32)
    piece = FoldedPiece("output", 0, ((0, 0), (1, 0)), ("R",), (6,), "float32")
    pieces = {(0, "output", 0): piece}
    agreeing = LogicalDump(_Dumps({0: value, 1: value.clone()}), 0, (2,), pieces, {0: 0}, 0)
    assert agreeing.disagreeing_replicas() == []
    swapped = value[[1, 0, 2, 3, 4, 5]]  # the same values, so the same statistics, elsewhere
    found = LogicalDump(_Dumps({0: value, 1: swapped}), 0, (2,), pieces, {0: 0}, 0).disagreeing_replicas()
    assert found == [((0, "output", 0), 1, 0, 2)]


class _Runs:
    """Two ranks' records of one op, as a run would hand them (for the fold's unit tests)."""

    path = Path("fake")
    ranks = [0, 1]

    def __init__(self, by_rank: dict[int, list[OpRecord]]) -> None:
        self.by_rank = by_rank

    def has_step(self, step: int, rank: int) -> bool:
        return True

    def ops(self, step: int, rank: int) -> list[OpRecord]:
        return self.by_rank[rank]


def _record(rank: int, stats: dict, shape: tuple[int, ...], layout: dict | None) -> OpRecord:
    return OpRecord(0, "forward:m[0]:aten.mul.Tensor:0", "aten.mul.Tensor", "forward", "m", 0, [], 0, rank,
                    inputs=[], outputs=[TensorRecord("float32", shape, stats)], layout=layout)


def test_a_replica_that_disagrees_is_a_finding_and_shards_concatenate():
    def layout(out: str) -> dict:
        mesh = {"shape": [2], "names": None, "ranks": [0, 1]}
        return {"of": "aten.mul.Tensor", "role": "compute", "mesh": mesh, "in": [], "out": [[out]]}

    s0 = {"min": -1.0, "max": 2.0, "mean": 0.5, "norm": 3.0, "nan": 0, "inf": 0}
    s1 = {"min": -3.0, "max": 1.0, "mean": -0.5, "norm": 4.0, "nan": 0, "inf": 1}
    replicated = fold_step(_Runs({r: [_record(r, s, (4, 2), layout("R"))] for r, s in ((0, s0), (1, s1))}), 0)
    assert [(f.rank, f.reference_rank, f.statistic) for f in replicated.findings] == [(1, 0, "min")]
    assert replicated.ops[0].outputs[0].stats == s0 and replicated.ops[0].outputs[0].shape == (4, 2)
    sharded = fold_step(_Runs({r: [_record(r, s, (4, 2), layout("S(1)"))] for r, s in ((0, s0), (1, s1))}), 0)
    out = sharded.ops[0].outputs[0]
    assert sharded.findings == [] and out.shape == (4, 4)
    assert (out.stats["min"], out.stats["max"], out.stats["mean"], out.stats["norm"], out.stats["inf"]) == \
        (-3.0, 2.0, 0.0, 5.0, 1)
    partial = fold_step(_Runs({r: [_record(r, s, (4, 2), layout("P(sum)"))]
                               for r, s in ((0, s0), (1, s1))}), 0)
    assert partial.ops[0].outputs[0].stats is None  # known only once a collective reduces it


@pytest.fixture(scope="module")
def plans(runs, tmp_path_factory) -> dict[str, Path]:
    """The data-parallel plans (HSDP: a (replicate, shard) mesh of 2 x 2), and FSDP2 x TP2 with
    rank 1's shard of 1.down halved."""
    root = tmp_path_factory.mktemp("plans")
    paths = {"single": runs["single"], "tp2": runs["tp2"]}
    for name, plan, nproc in (("ddp", "ddp", 2), ("fsdp2", "fsdp", 2), ("hsdp", "hsdp", 4),
                              ("fsdp2_tp2", "fsdp_tp", 4)):
        paths[name] = root / name
        _job(paths[name], "--plan", plan, nproc=nproc)
    paths["fsdp2_tp2_halved"] = root / "fsdp2_tp2_halved"
    _job(paths["fsdp2_tp2_halved"], "--plan", "fsdp_tp", "--halve", f"1:{HALVED}", nproc=4)
    return paths


@pytest.mark.slow  # five torchrun jobs, two of them 4 ranks
def test_every_plan_folds_to_the_single_process_and_every_pair_compares_clean(plans):
    _assert_every_plan_agrees(plans, ["single", "tp2", "ddp", "fsdp2", "hsdp", "fsdp2_tp2"], min_compared=100)


def _assert_every_plan_agrees(runs: dict, names: list[str], min_compared: int) -> None:
    """Each plan folds to the first (single process): >= 95% of its ops matched, statistics
    within 1e-6, no replica finding; and every pair compares with no divergence."""
    single = probe.load(runs[names[0]])
    for name in names[1:]:
        run = probe.load(runs[name])
        share, worst, compared = _folded_like(single, run)
        assert share >= 0.95 and worst <= 1e-6 and compared > min_compared, (name, share, worst, compared)
        assert LogicalRun(run).findings() == [], name
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            report = probe.compare(runs[a], runs[b], processes=1)
            assert report.first_divergence is None, (a, b, report.conclusion)
            assert report.counts["error"] == 0 and report.conclusion.startswith("no divergence"), (a, b)


DATA_PARALLEL_SUMS = {"backward:1.down[0]:aten.mm.default:1", "forward::aten.mse_loss.default:0"}
"""Sums each data-parallel rank computes over its slice of the batch (a weight's gradient, the loss)."""


@pytest.mark.slow  # one or two more torchrun jobs
@pytest.mark.parametrize(("plan", "nproc", "split_sums"), [
    ("fsdp", 2, DATA_PARALLEL_SUMS),
    # FSDP2 x TP2: FSDP2's unsharded tensor-parallel parameters (views of the all-gathered
    # buffer the recording keeps no statistics of) are placed by the DTensor op reading them;
    # RowwiseParallel's bias is the bias its div read, not the div's halved result.
    ("fsdp_tp", 4, DATA_PARALLEL_SUMS | ROW_PARALLEL_SUMS),
])
def test_data_parallel_dumps_fold_and_their_split_sums_are_another_reduction_order(
        dumped, tmp_path, plan, nproc, split_sums):
    _job(tmp_path / plan, "--plan", plan, "--dump", nproc=nproc)
    single, run = probe.load(dumped["single"]), probe.load(tmp_path / plan)
    worst, compared = _folded_tensors_like(single, LogicalRun(run))
    assert worst <= 1e-6 and compared > 400, (worst, compared)
    assert LogicalRun(run).findings() == []
    assert _dumps_hold_their_recorded_statistics(run) > 1000
    report = probe.compare(dumped["single"], tmp_path / plan)
    assert report.first_divergence is None and report.counts["not compared"] == 0, report.conclusion
    assert report.counts["error"] == 0
    # Each rank sums its slice of the batch (and under TP its features): the weights' and
    # biases' gradients, the loss, the row-parallel products.
    reordered = {c.a.id for c in report.comparisons if c.rule == "reduction order"}
    assert split_sums <= reordered, split_sums - reordered
    if plan == "fsdp_tp":  # a halved shard is found with dumps too, at its module
        _job(tmp_path / "halved", "--plan", plan, "--dump", "--halve", f"1:{HALVED}", nproc=nproc)
        for reference in (dumped["single"], tmp_path / plan):
            report = probe.compare(reference, tmp_path / "halved", processes=1)
            assert report.divergence is not None, reference
            assert (report.divergence.op.id, report.divergence.rule, report.divergence.step) == \
                (f"forward:{HALVED}[0]:aten.t.default:0", "outside input", 0), reference


@pytest.mark.slow  # two jobs per loss, one of them torchrun
@pytest.mark.parametrize("loss", ["mean_square", "sum_over_count", "mean_abs", "cross_entropy"])
def test_a_hand_written_loss_folds_under_ddp_as_the_single_process_computes_it(tmp_path, loss):
    # A loss written out (tp_worker.LOSSES) rather than F.mse_loss: its backward broadcasts the
    # scalar gradient back over the rank's slice (the mean's or sum's expand, replicated by its
    # inputs alone, a slice of the batch by the reduction it undoes), and divides it by the
    # rank's own count (a mean's div, sum / n's on the scalar), where the gradient becomes the
    # degree times the single process's; sum / n's forward div makes the slice's mean.
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    _job(single, "--plan", "single", "--dump", "--loss", loss)
    _job(ddp, "--plan", "ddp", "--dump", "--loss", loss, nproc=2)
    worst, compared = _folded_tensors_like(probe.load(single), LogicalRun(probe.load(ddp)))
    assert worst <= 1e-6 and compared > 450, (worst, compared)
    report = probe.compare(single, ddp, processes=1)
    assert report.first_divergence is None, report.conclusion
    assert report.conclusion.startswith("no divergence")
    assert report.counts["error"] == report.counts["not compared"] == 0


@pytest.mark.slow
def test_a_halved_shard_under_fsdp2_x_tp2_is_the_first_divergence_at_its_module(plans):
    for reference in ("single", "fsdp2_tp2"):
        report = probe.compare(plans[reference], plans["fsdp2_tp2_halved"], processes=1)
        assert report.divergence is not None, reference
        assert (report.divergence.op.module, report.divergence.op.phase, report.first_divergence[0].step) == \
            (HALVED, "forward", 0)


def test_a_local_op_moves_the_sharded_dim_by_its_shapes():
    # A data-parallel rank's linear layer: rows of the batch through addmm, the weight's
    # gradient a partial sum over them, the bias's a sum over dim 0, the loss a mean.
    linear = local_placement("aten.addmm.default", [(32,), (4, 16), (16, 32)], ["R", "S(0)", "R"], (4, 32))
    assert linear == "S(0)"
    assert local_placement("aten.t.default", [(4, 16)], ["S(0)"], (16, 4)) == "S(1)"
    assert local_placement("aten.mm.default", [(16, 4), (4, 32)], ["S(1)", "S(0)"], (16, 32)) == "P(sum)"
    assert local_placement("aten.sum.dim_IntList", [(4, 16)], ["S(0)"], (1, 16)) == "P(sum)"
    assert local_placement("aten.sum.dim_IntList", [(4, 16)], ["S(0)"], (4,)) == "S(0)"
    assert local_placement("aten.mse_loss.default", [(4, 16), (4, 16)], ["S(0)", "S(0)"], ()) == "P(avg)"
    # Elementwise with broadcasting, a reshape that keeps the batch outermost, and one that does not.
    assert local_placement("aten.add.Tensor", [(4, 8, 16), (16,)], ["S(0)", "R"], (4, 8, 16)) == "S(0)"
    assert local_placement("aten.view.default", [(4, 8, 16)], ["S(0)"], (32, 16)) == "S(0)"
    assert local_placement("aten.view.default", [(4, 8, 16)], ["S(0)"], (2, 256)) is None
    # A transpose swaps the two dims where the shapes differ; of two dims of one size it says
    # nothing (unless the sharded dim's size is no other dim's); partial values stay partial.
    assert local_placement("aten.transpose.int", [(2, 6, 2, 4)], ["S(0)"], (2, 2, 6, 4)) == "S(0)"
    assert local_placement("aten.transpose.int", [(2, 6, 2, 4)], ["S(2)"], (2, 2, 6, 4)) == "S(1)"
    assert local_placement("aten.transpose.int", [(4, 4, 8)], ["S(1)"], (4, 4, 8)) is None
    assert local_placement("aten.transpose.int", [(4, 4, 8)], ["S(2)"], (4, 4, 8)) == "S(2)"
    assert local_placement("aten.transpose.int", [(4, 4, 8)], ["S(0)"], (4, 8, 4)) == "S(0)"
    assert local_placement("aten.permute.default", [(4, 4, 8)], ["S(0)"], (4, 8, 4)) is None
    assert local_placement("aten.view.default", [(1, 16)], ["P(sum)"], (16,)) == "P(sum)"
    assert local_placement("aten.add.Tensor", [(4, 16), (4, 16)], ["S(0)", "P(sum)"], (4, 16)) is None


def test_attention_reshapes_move_the_heads_shard():
    # Tensor parallelism's local heads: (b, s, h*d) split into (b, s, h, d) shards h; merged
    # with the batch for a bmm, the shard is a block within each batch index (strided), which
    # the bmm keeps and the split back by the batch returns to h.
    assert local_placement("aten.view.default", [(4, 6, 8)], ["S(2)"], (4, 6, 2, 4)) == "S(2)"
    assert local_placement("aten._unsafe_view.default", [(4, 6, 2, 4)], ["S(2)"], (4, 6, 8)) == "S(2)"
    assert local_placement("aten._unsafe_view.default", [(4, 2, 6, 4)], ["S(1)"], (8, 6, 4)) == "_S(0,4)"
    assert local_placement("aten.bmm.default", [(8, 6, 4), (8, 4, 6)], ["_S(0,4)", "_S(0,4)"], (8, 6, 6)) == \
        "_S(0,4)"
    assert local_placement("aten._softmax.default", [(8, 6, 6)], ["_S(0,4)"], (8, 6, 6)) == "_S(0,4)"
    assert local_placement("aten._unsafe_view.default", [(8, 6, 6)], ["_S(0,4)"], (4, 2, 6, 6)) == "S(1)"
    # The batch shard merged with the heads stays outermost; a size-1 dim is skipped.
    assert local_placement("aten._unsafe_view.default", [(2, 2, 6, 4)], ["S(0)"], (4, 6, 4)) == "S(0)"
    assert local_placement("aten.view.default", [(4, 6, 8)], ["S(2)"], (4, 6, 1, 8)) == "S(3)"


TRANSFORMER_HALVED = "1.attn.o"


@pytest.fixture(scope="module")
def transformer(tmp_path_factory) -> dict[str, Path]:
    """A 2-block transformer (layer norm, attention, MLP) in one process, TP2, FSDP2 and
    FSDP2 x TP2, and TP2 and FSDP2 x TP2 with rank 1's shard of a RowwiseParallel module halved."""
    root = tmp_path_factory.mktemp("transformer")
    jobs = {"single": ("single", 0, None), "tp2": ("tp", 2, None), "fsdp2": ("fsdp", 2, None),
            "fsdp2_tp2": ("fsdp_tp", 4, None), "tp2_halved": ("tp", 2, TRANSFORMER_HALVED),
            "fsdp2_tp2_halved": ("fsdp_tp", 4, TRANSFORMER_HALVED)}
    paths = {}
    for name, (plan, nproc, halve) in jobs.items():
        paths[name] = root / name
        extra = ("--halve", f"1:{halve}") if halve else ()
        _job(paths[name], "--model", "transformer", "--plan", plan, *extra, nproc=nproc)
    return paths


@pytest.mark.slow  # five torchrun jobs, two of them 4 ranks
def test_a_transformer_folds_to_the_single_process_under_every_plan(transformer):
    _assert_every_plan_agrees(transformer, ["single", "tp2", "fsdp2", "fsdp2_tp2"], min_compared=700)


@pytest.mark.slow
def test_a_halved_row_parallel_shard_is_the_first_divergence_in_both_tp_pairs(transformer):
    for reference, halved in (("single", "tp2_halved"), ("tp2", "tp2_halved"),
                              ("single", "fsdp2_tp2_halved"), ("fsdp2_tp2", "fsdp2_tp2_halved")):
        report = probe.compare(transformer[reference], transformer[halved], processes=1)
        assert report.divergence is not None, (reference, halved)
        assert (report.divergence.op.module, report.divergence.op.phase, report.first_divergence[0].step) == \
            (TRANSFORMER_HALVED, "forward", 0), (reference, halved, report.conclusion)


@pytest.mark.slow
def test_hsdp_folds_over_its_two_dimensional_mesh(plans):
    # HSDP's parameters are DTensors on the (replicate, shard) mesh: the step's mesh is that
    # one, each of its dims a slice of the batch; the optimizer's sharded parameters fold
    # to whole ones.
    hsdp = probe.load(plans["hsdp"])
    step = fold_step(hsdp, 0)
    meshes = {tuple(op.layout["mesh"]["shape"]) for op in hsdp.ops(0, 0) if op.layout is not None}
    assert meshes == {(2, 2)}
    single = {op.id: op for op in probe.load(plans["single"]).ops(0, 0)}
    updates = [op for op in step.ops if op.phase == "optimizer"]
    assert updates and all(op.outputs[0].shape == single[op.id].outputs[0].shape for op in updates)
    # The sharded updates fold to the single process's statistics (fp32 rounding of the gradients'
    # other sum order: the batch is split over the replicate and shard dims).
    differences = {op.id: _stats_difference(single[op.id].outputs[0], op.outputs[0]) for op in updates}
    assert max(differences.values()) <= 1e-6, differences


PARTITIONS = {"*.up": "colwise", "*.down": "rowwise"}
"""tp_worker's megatron model: each block's up column-parallel, its down row-parallel."""


@pytest.fixture(scope="module")
def manual(tmp_path_factory) -> dict[str, Path]:
    """Megatron-style tensor parallelism written by hand (no DTensor; the row-parallel output
    all-reduced with torch.distributed.all_reduce): the layers whole in one process, over 2
    ranks, and over 2 ranks with rank 1's shard of 1.down halved."""
    root = tmp_path_factory.mktemp("manual")
    paths = {name: root / name for name in ("single", "tp2", "halved")}
    _job(paths["single"], "--model", "megatron", "--plan", "single")
    _job(paths["tp2"], "--model", "megatron", "--plan", "manual", nproc=2)
    _job(paths["halved"], "--model", "megatron", "--plan", "manual", "--halve", f"1:{HALVED}", nproc=2)
    return paths


def test_hand_written_tensor_parallelism_folds_by_the_partitions(manual, capsys):
    single, tp = probe.load(manual["single"]), probe.load(manual["tp2"])
    assert all(op.layout is None for op in tp.ops(0, 0))  # nothing recorded a layout
    share, worst, compared = _folded_like(single, tp, PARTITIONS)
    assert share >= 0.95 and worst <= 1e-6 and compared > 150, (share, worst, compared)
    # The row-parallel product: the partial sums' all-reduced value, read by the bias's add.
    folded = {op.id: op for op in fold_step(tp, 0, PARTITIONS).ops}
    for op_id in ("forward:1.down[0]:aten.mm.default:0", "forward:1.down[0]:aten.view.default:0"):
        reference = _op(single, op_id).outputs[0]
        assert folded[op_id].outputs[0].shape == reference.shape
        assert folded[op_id].outputs[0].stats["norm"] == pytest.approx(reference.stats["norm"], rel=1e-6)
    assert LogicalRun(tp, PARTITIONS).findings() == []
    report = probe.compare(manual["single"], manual["tp2"], partitions=PARTITIONS)
    assert report.first_divergence is None and report.conclusion.startswith("no divergence")
    assert report.counts["error"] == report.counts["unmatched"] == report.counts["not compared"] == 0
    assert main(["compare", str(manual["single"]), str(manual["tp2"]), "--partition", "*.up=colwise",
                 "--partition", "*.down=rowwise", "--fail-on-divergence"]) == 0


def test_a_halved_hand_written_shard_is_the_first_divergence_at_its_module(manual):
    for reference in ("single", "tp2"):
        report = probe.compare(manual[reference], manual["halved"], partitions=PARTITIONS)
        assert report.divergence is not None, reference
        assert (report.divergence.op.module, report.divergence.op.phase, report.first_divergence[0].step) == \
            (HALVED, "forward", 0), (reference, report.conclusion)


def test_without_the_partitions_compare_names_the_option(manual, capsys):
    with pytest.raises(MissingPartitions, match=r"0\.down, 1\.down.*partitions=.*--partition"):
        probe.compare(manual["single"], manual["tp2"])
    assert main(["compare", str(manual["single"]), str(manual["tp2"])]) == 2
    assert "--partition 0.down=rowwise" in capsys.readouterr().err
    with pytest.raises(ProbeError, match="partitions name no module of either run"):
        probe.compare(manual["single"], manual["tp2"], partitions={"layers.*.up": "colwise"})
    # Twin runs sharded alike compare rank by rank without it, as twin DDP runs do.
    assert probe.compare(manual["tp2"], manual["tp2"]).first_divergence is None


def test_partitions_are_checked_and_a_square_matrix_transpose_moves_its_shard():
    assert normalize_partitions({"a": "colwise", "b": "Rowwise", "c": 2}) == {"a": 0, "b": 1, "c": 2}
    for bad in ({"a": "diagonal"}, {"a": -1}, {"": "colwise"}, ["a"]):
        with pytest.raises(ProbeError, match="partitions"):
            normalize_partitions(bad)
    # aten.t of a 2-D tensor swaps its dims even when they have one size (a square shard).
    assert local_placement("aten.t.default", [(16, 16)], ["S(0)"], (16, 16)) == "S(1)"
