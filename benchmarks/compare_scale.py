"""How ``probe compare`` scales with ranks: a simulated 64-rank run built from real records.

Run from the repository root::

    python -m benchmarks.compare_scale [--quick] [--ranks 64] [--steps 3] [--processes 2] [--markdown]

1. Records a real run: the small transformer of ``tests/distributed/tp_worker.py`` (two
   pre-norm blocks, attention and MLP) under tensor parallelism (DTensor, TP2: 2 ranks, gloo,
   CPU), 3 SGD steps, stats mode.
2. Builds a simulated run of ``--ranks`` ranks (and ``--steps`` steps: more than the real 3
   repeat them) from those records: ranks ``2k`` and ``2k+1``
   are copies of the real ranks 0 and 1, each pair one tensor-parallel group (its meshes' and
   process groups' ranks, ``rank.json`` and the manifests rewritten to the new rank, ``run.json``
   the new world size): what a job of ``ranks / 2`` data-parallel replicas of TP2 records, each
   replica on the same batch. ``probe.load`` reads it as any run; the copy is compared against
   a second copy (twin runs on shards: both fold into logical ops).
3. Times each stage in one process (open the runs, plan: whether to fold, fold every step,
   match and measure, judge in step order, write the report), then the whole
   ``probe.compare`` in one process against ``--processes`` spawned processes (the pieces,
   one per step, ``probe.analysis.compare_pieces``), side by side, and checks the reports agree.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.overhead import machine_line, print_measures

WORKER = Path(__file__).resolve().parent.parent / "tests" / "distributed" / "tp_worker.py"
JOB_TIMEOUT_S = 300
_RANKS_FIELD = re.compile(r'"ranks":\[(\d+(?:,\d+)*)\]')


def record(out: Path) -> float:
    """The real TP2 transformer run (torchrun, 2 ranks, gloo); its wall time."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(WORKER), "--out", str(out), "--model", "transformer", "--plan", "tp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise SystemExit(f"the TP2 job hung (killed after {JOB_TIMEOUT_S} s)") from None
    if process.returncode != 0:
        raise SystemExit(f"the TP2 job failed:\n{output[-4000:]}")
    return time.perf_counter() - start


def simulate(real: Path, out: Path, world: int, steps: int) -> None:
    """A run of ``world`` ranks and ``steps`` steps from the 2-rank, 3-step run ``real``: rank
    ``r`` is a copy of real rank ``r % 2`` in tensor-parallel group ``r // 2``, step ``s`` a copy
    of real step ``s % 3`` (see the module docstring)."""
    real_world = 2
    if world % real_world:
        raise SystemExit(f"--ranks must be a multiple of {real_world}, got {world}")
    out.mkdir(parents=True)
    manifest = json.loads((real / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**manifest, "world_size": world}, indent=1))
    for rank in range(world):
        source, base = real / f"rank{rank % real_world}", rank - rank % real_world

        def moved(match: re.Match[str], base: int = base) -> str:
            return '"ranks":[' + ",".join(str(base + int(r)) for r in match.group(1).split(",")) + "]"

        target = out / f"rank{rank}"
        target.mkdir()
        info = json.loads((source / "rank.json").read_text())
        info.update(rank=rank, local_rank=rank % 8, world_size=world)
        (target / "rank.json").write_text(json.dumps(info, indent=1))
        real_steps = sorted(int(d.name[len("step"):]) for d in source.glob("step*"))
        for step in range(steps):
            step_dir = target / f"step{step}"
            shutil.copytree(source / f"step{real_steps[step % len(real_steps)]}", step_dir)
            ops = step_dir / "ops.jsonl"
            ops.write_text(_RANKS_FIELD.sub(moved, ops.read_text()))
            step_manifest = json.loads((step_dir / "manifest.json").read_text())
            (step_dir / "manifest.json").write_text(json.dumps({**step_manifest, "rank": rank, "step": step}))


def stages(path_a: Path, path_b: Path) -> tuple[list[tuple[str, float]], int, int]:
    """Each stage of a compare timed in this process: (stage, seconds), logical ops compared,
    rank-steps read."""
    import probe
    from probe.analysis.compare import Report, judge_step, match_step
    from probe.analysis.layouts import LogicalRun, logical_pair

    timed: list[tuple[str, float]] = []
    start = time.perf_counter()
    run_a, run_b = probe.load(path_a), probe.load(path_b)
    ranks_steps = sum(len(run.steps_of(r)) for run in (run_a, run_b) for r in run.ranks)
    timed.append(("open both runs (index ranks and steps)", time.perf_counter() - start))
    start = time.perf_counter()
    run_a, run_b = logical_pair(run_a, run_b)
    timed.append(("plan: compare folded? (reads each lead rank's first step)", time.perf_counter() - start))
    assert isinstance(run_a, LogicalRun) and isinstance(run_b, LogicalRun)
    steps = run_a.steps
    start = time.perf_counter()
    for step in steps:
        run_a.logical_step(step), run_b.logical_step(step)
    timed.append((f"fold: read and fold every rank's records, {len(steps)} steps x 2 runs",
                  time.perf_counter() - start))
    start = time.perf_counter()
    matched = [match_step(run_a, run_b, step, run_a.lead) for step in steps]
    timed.append(("match and measure the logical ops", time.perf_counter() - start))
    start = time.perf_counter()
    judged, carry = [], None
    for m in matched:
        judged.append(judge_step(run_a, m, carry=carry))
        carry = judged[-1].carry
    timed.append(("judge, in step order", time.perf_counter() - start))
    start = time.perf_counter()
    report = Report(run_a.path, run_b.path, judged, [])
    with tempfile.TemporaryDirectory() as scratch:
        report.to_json(Path(scratch) / "report.json")
    timed.append(("report (summary, rows, JSON)", time.perf_counter() - start))
    return timed, len(report.comparisons), ranks_steps


def timed_compare(path_a: Path, path_b: Path, processes: int,
                  executor: Executor | None = None) -> tuple[float, object]:
    import probe

    start = time.perf_counter()
    report = probe.compare(path_a, path_b, processes=processes, executor=executor)
    return time.perf_counter() - start, report


def _imported() -> int:
    """Run in each worker of the warm pool before timing: the imports a piece needs."""
    import probe.analysis.compare  # noqa: F401

    return os.getpid()


def _timed_piece(*args: object) -> tuple[float, float]:
    """One piece (``compare._match_piece``) in a worker: its CPU and wall seconds there."""
    from probe.analysis.compare import _match_piece

    cpu, wall = time.process_time(), time.perf_counter()
    _match_piece(*args)
    return time.process_time() - cpu, time.perf_counter() - wall


def pieces_alone(pool: Executor, path_a: Path, path_b: Path, steps: list[int]) -> tuple[float, list[float]]:
    """The pieces of the compare (one per step, both runs folded) on ``pool`` without the rest
    of the compare: the wall time of all of them and each one's CPU seconds in its worker."""
    start = time.perf_counter()
    futures = [pool.submit(_timed_piece, (str(path_a), True), (str(path_b), True), None, step, 0, None)
               for step in steps]
    cpu = [f.result()[0] for f in futures]
    return time.perf_counter() - start, cpu


def warm_pool(processes: int) -> ProcessPoolExecutor:
    """Spawned processes that have imported the compare: what ``executor=`` reuses across
    compares (a long-lived service, a Dask worker), so that a compare pays no start-up."""
    pool = ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"))
    pids: set[int] = set()
    while len(pids) < processes:  # each worker once at least (a fast one may take several)
        pids |= {f.result() for f in [pool.submit(_imported) for _ in range(processes * 2)]}
    return pool


def worker_start() -> float:
    """What a spawned worker pays before its first piece: a fresh interpreter importing the
    compare (torch with it)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import probe.analysis.compare"], check=True)
    return time.perf_counter() - start


def _everything(report) -> str:
    return json.dumps({**report.summary, "rows": report.rows}, default=str, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_scale")
    parser.add_argument("--quick", action="store_true",
                        help="4 simulated ranks: a smoke run (under a minute on a 2-core VM)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="simulated ranks (default 64; 4 with --quick)")
    parser.add_argument("--steps", type=int, default=3,
                        help="simulated steps (default 3, the real run's; more repeat its steps)")
    parser.add_argument("--processes", type=int, default=2, help="spawned processes against one (2)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="rounds of the three compares, the best kept (2; 1 with --quick)")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: a temp dir)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    world = args.ranks or (4 if args.quick else 64)
    args.repeat = args.repeat or (1 if args.quick else 2)
    console = Console()
    console.print(f"[bold]compare scale[/bold]  {machine_line()}")
    scratch = Path(tempfile.mkdtemp(prefix="probe-compare-scale-", dir=args.dir))
    try:
        with console.status("recording the real TP2 run"):
            record_s = record(scratch / "tp2")
        start = time.perf_counter()
        for name in ("a", "b"):
            simulate(scratch / "tp2", scratch / name, world, args.steps)
        simulate_s = time.perf_counter() - start
        size = sum(f.stat().st_size for f in (scratch / "a").rglob("*") if f.is_file())
        with console.status("timing each stage"):
            timed, ops, rank_steps = stages(scratch / "a", scratch / "b")
        spawn_s = worker_start()
        # Alternated, best of --repeat: other load on the machine reaches every configuration alike.
        seconds: dict[str, list[float]] = {"serial": [], "cold": [], "warm": []}
        reports = {}
        with console.status("compare: one process, spawned processes, a warm pool"), \
                warm_pool(args.processes) as pool:
            for round_ in range(args.repeat):
                order = ["serial", "cold", "warm"]
                for name in order[round_ % 3:] + order[:round_ % 3]:
                    took, reports[name] = timed_compare(
                        scratch / "a", scratch / "b", 1 if name == "serial" else args.processes,
                        pool if name == "warm" else None)
                    seconds[name].append(took)
            steps = sorted({s.step for s in reports["serial"].steps})
            alone_s, piece_cpu = pieces_alone(pool, scratch / "a", scratch / "b", steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    serial = reports["serial"]
    same = all(_everything(reports[name]) == _everything(serial) for name in ("cold", "warm"))
    serial_s, cold_s, warm_s = (min(seconds[name]) for name in ("serial", "cold", "warm"))
    stage_total = sum(s for _, s in timed)
    table = Table(title=f"compare of two simulated {world}-rank runs, stage by stage (one process)",
                  title_justify="left")
    for column in ("stage", "seconds", "share"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for name, took in timed:
        table.add_row(name, f"{took:.2f}", f"{took / stage_total:.0%}")
    console.print(table)
    if args.markdown:
        print("\n| stage | seconds | share |\n|---|---:|---:|")
        for name, took in timed:
            print(f"| {name} | {took:.2f} | {took / stage_total:.0%} |")
    cpu_share = sum(piece_cpu) / (alone_s * args.processes)
    rows = [
        ("real run recorded (TP2 transformer, 2 ranks, 3 steps; wall)", f"{record_s:.1f} s"),
        (f"simulated runs built ({world} ranks x {args.steps} steps each, 2 copies)",
         f"{simulate_s:.1f} s, {size / 1e6:.0f} MB each"),
        ("rank-steps read (ranks x steps, both runs)", str(rank_steps)),
        ("logical ops compared", str(ops)),
        (f"probe.compare, 1 process (best of {args.repeat})", f"{serial_s:.1f} s"),
        (f"probe.compare, {args.processes} processes spawned for it (pieces: {len(steps)} steps)",
         f"{cold_s:.1f} s ({serial_s / cold_s:.2f}x)"),
        (f"probe.compare, a warm pool of {args.processes} processes (executor=)",
         f"{warm_s:.1f} s ({serial_s / warm_s:.2f}x)"),
        ("spawned worker start (a fresh interpreter importing the compare)", f"{spawn_s:.1f} s"),
        ("CPU time of one piece (a step of both runs: read, fold, match; in its worker)",
         f"{min(piece_cpu):.1f}-{max(piece_cpu):.1f} s"),
        (f"the pieces alone on the warm pool: wall, and the CPU the {args.processes} workers got",
         f"{alone_s:.1f} s, {cpu_share:.0%} of {args.processes} cores"),
        ("throughput, 1 process",
         f"{ops / serial_s:.0f} logical ops/s, {rank_steps / serial_s:.1f} rank-steps/s"),
        (f"throughput, {args.processes} processes spawned / warm",
         f"{ops / cold_s:.0f} / {ops / warm_s:.0f} logical ops/s, "
         f"{rank_steps / cold_s:.1f} / {rank_steps / warm_s:.1f} rank-steps/s"),
        ("reports equal (rows, first divergence)", "yes" if same else "NO"),
        ("conclusion", serial.conclusion),
    ]
    print_measures(console, f"compare scale ({world} simulated ranks)", rows, args.markdown)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
