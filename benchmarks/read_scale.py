"""How reading a run scales with the size of a step: ``probe summary``, ``probe compare`` (with its
reports written), ``probe replay`` (every op of the step) and ``probe graph --format json`` on one
step of 10^4 and 10^5 ops (and 10^6 with ``--full``).

Run from the repository root::

    python -m benchmarks.read_scale [--full] [--sizes 10000,100000] [--markdown]

For each size N: one step of N tiny ops (a loop of ``x * 1.0001`` and ``x + 0.0001`` on a
4-element tensor, so the step is all bookkeeping and no arithmetic) is traced under
``probe.mode("stats")``; a copy of the run is the second run of the compare; a second copy gets a
synthetic ``callsites.json`` where every op has its own call site of ``--frames`` distinct frames
(a ``stack=True`` run of a program with N call sites; ~70 MB by default, under the 256 MiB a
call site table may hold), to time summary's reading of call sites. The replay reads the same
program traced under ``probe.mode(["stats", "dump"])``, at its own sizes (``--replay-sizes``, default
1,000 and 4,000 ops): replaying an op costs tens of milliseconds of arithmetic and metrics, so
a step of 10^5 ops takes hours whatever the reading costs.
Each command then runs in a fresh process, which reports its wall time and its peak RSS; the RSS
of a process that only imports the same modules is given too, so "MB over imports" is what the
command itself held. The goal (issue 32): linear in what is read, a step of 10^6 ops to JSON in
under a minute within 1 GB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.overhead import machine_line

_TRACE = """
import resource, sys, time, torch, probe
from torch import nn
n, out, modes = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
class Tiny(nn.Module):
    def forward(self, x):
        for _ in range(n // 2):
            x = x * 1.0001
            x = x + 0.0001
        return x
model = Tiny()
start = time.perf_counter()
with probe.mode(modes, out=out, model=model, async_flush=False) as session:
    model(torch.ones(4))
    session.step()
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""

_COMMAND = """
import contextlib, io, os, resource, sys, time
from probe.cli import main
start, times = time.perf_counter(), os.times()
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
cpu = sum(os.times()[:2]) - sum(times[:2])
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, cpu, code)
"""

_IMPORTS = """
import resource
import probe.cli, probe.analysis.summary, probe.exporters.graph_export, probe.exporters.console
print(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def _child(code: str, *args: str) -> tuple[float, float, float | None]:
    """(seconds, peak RSS in MB, CPU seconds when it reports them) of a fresh Python process
    running ``code``: on a machine shared with other work the wall time is loose, the CPU time
    much less so."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed ({args}):\n{done.stderr[-2000:]}")
    seconds, peak, *rest = done.stdout.split()
    return float(seconds), float(peak), float(rest[0]) if len(rest) > 1 else None


def with_call_sites(run: Path, out: Path, frames: int) -> float:
    """A copy of ``run`` whose every op has a call site of its own, ``frames`` frames deep; returns
    the size of its ``callsites.json`` in MB."""
    shutil.copytree(run, out)
    step = out / "rank0" / "step0"
    ops = step / "ops.jsonl"
    count = 0
    with open(ops) as source, open(step / "ops.tmp", "w") as target:
        for number, line in enumerate(source):
            count += 1
            row = json.loads(line)
            row["site"] = number
            target.write(json.dumps(row, separators=(",", ":")) + "\n")
    (step / "ops.tmp").replace(ops)
    with open(step / "callsites.json", "w") as sites:
        sites.write("{")
        for number in range(count):
            stack = [f"/home/user/project/training/part_{k}/layer_{(number * 7 + k) % 997}.py:"
                     f"{(number + k) % 5000} in forward_{k}" for k in range(frames)]
            sites.write(("," if number else "") + json.dumps(str(number)) + ":"
                        + json.dumps(stack, separators=(",", ":")))
        sites.write("}")
    return (step / "callsites.json").stat().st_size / 1e6


def _size(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


Row = tuple[int, str, float, float | None, float, float]
"""(ops, what, seconds, CPU seconds or None, peak MB, MB read)."""


def measure(sizes: list[int], replay_sizes: list[int], frames: int | None, workdir: Path) -> list[Row]:
    """A row for each command at each size."""
    rows: list[Row] = []
    for n in replay_sizes:
        dumped = workdir / f"dumped{n}"
        seconds, peak, _ = _child(_TRACE, str(n), str(dumped), "stats,dump")
        rows.append((n, "trace (stats, dump)", seconds, None, peak, 0.0))
        seconds, peak, cpu = _child(_COMMAND, "replay", str(dumped), "--top", "5")
        rows.append((n, "replay (every op)", seconds, cpu, peak, _size(dumped)))
        shutil.rmtree(dumped)
    for n in sizes:
        run, twin, sites = workdir / f"run{n}", workdir / f"twin{n}", workdir / f"sites{n}"
        seconds, peak, _ = _child(_TRACE, str(n), str(run), "stats")
        rows.append((n, "trace (stats)", seconds, None, peak, 0.0))
        shutil.copytree(run, twin)
        sites_mb = with_call_sites(run, sites, frames or min(64, max(1, 1_000_000 // n)))
        measured = [
            ("summary", ["summary", str(run)], _size(run)),
            (f"summary, callsites.json {sites_mb:.0f} MB", ["summary", str(sites)], _size(sites)),
            ("compare", ["compare", str(run), str(twin), "-o", str(workdir / f"cmp{n}")], 2 * _size(run)),
            ("graph --format json", ["graph", str(run), "--format", "json", "-o",
                                     str(workdir / f"graph{n}.json")], _size(run)),
        ]
        for what, argv, read in measured:
            seconds, peak, cpu = _child(_COMMAND, *argv)
            rows.append((n, what, seconds, cpu, peak, read))
        for path in (twin, sites, workdir / f"cmp{n}", workdir / f"graph{n}.json"):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        shutil.rmtree(run)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.read_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="add a step of 10^6 ops (~2 GB to trace)")
    parser.add_argument("--sizes", help="comma-separated op counts (default 10000,100000)")
    parser.add_argument("--replay-sizes", help="comma-separated op counts of the replay (default 1000,4000)")
    parser.add_argument("--frames", type=int, help="frames of each synthetic call site (default: a "
                        "callsites.json of ~70 MB, at most 64 frames: 10 at 10^5 ops)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [10_000, 100_000]
    if args.full:
        sizes.append(1_000_000)
    _, imports, _ = _child(_IMPORTS)
    with tempfile.TemporaryDirectory(prefix="probe-read-scale-") as tmp:
        replay_sizes = [int(s) for s in (args.replay_sizes or "1000,4000").split(",")]
        rows = measure(sizes, replay_sizes, args.frames, Path(tmp))
    print(f"reading a step of N ops  {machine_line()}")
    print(f"a process that only imports the reader peaks at {imports:.0f} MB RSS\n")
    header = ("ops", "what", "seconds", "CPU s", "peak MB", "MB over imports", "MB on disk")
    lines = [(f"{n:,}", what, f"{seconds:.1f}", "" if cpu is None else f"{cpu:.1f}", f"{peak:.0f}",
              "" if what.startswith("trace") else f"{peak - imports:.0f}", f"{read:.0f}" if read else "")
             for n, what, seconds, cpu, peak, read in rows]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    for cells in (header, *lines):  # the "what" column left-aligned, the numbers right
        print("  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths, strict=True))))


if __name__ == "__main__":
    main()
