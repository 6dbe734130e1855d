"""Dump throughput against the disk's own sequential write speed.

Run from the repository root::

    python -m benchmarks.dump_throughput [--steps N] [--dir DIR] [--quick] [--markdown]

In one run, on one disk: (1) a training step without the probe, for the
baseline step time; (2) the same training under ``probe.mode("dump")``, timing
each step and the wall time until the last shard is on disk (leaving the
session waits for the writer threads); (3) a plain sequential write of the same
number of bytes (64 MiB writes, then fsync), buffered and with direct I/O: the
disk's raw figures; (4) random access: ``run.tensor()`` of randomly chosen
dumped tensors, read cold from disk; (5) one tensor eight times larger than the
memory budget (512 MiB under 64 MiB; 128 under 16 with ``--quick``): the peak
host memory the dump adds must stay near the budget. Each measurement
runs in a fresh child process, so peak host memory (max RSS) is its own.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.overhead import machine_line, print_measures

CHUNK = 64 << 20


def _training(quick: bool) -> Any:
    from probe.demo.model import LlamaConfig
    from probe.demo.train import DemoTraining

    if quick:
        return DemoTraining(LlamaConfig(), batch=4, seq=32)
    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2752, num_layers=4,
                         num_heads=16, max_seq_len=256)
    return DemoTraining(config, batch=4, seq=256)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_baseline(args: argparse.Namespace) -> dict[str, Any]:
    training = _training(args.quick)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        training.step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]), "peak_rss_mb": _peak_rss_mb()}


def child_dump(args: argparse.Namespace) -> dict[str, Any]:
    import probe

    training = _training(args.quick)
    training.step()  # warm-up outside the session, as for the baseline
    out = Path(args.dir) / "run"
    times = []
    start = time.perf_counter()
    with probe.mode("dump", out=out, model=training.model, memory_budget=args.memory_budget) as session:
        for _ in range(args.steps):
            step_start = time.perf_counter()
            training.step()
            session.step()
            times.append(time.perf_counter() - step_start)
    wall = time.perf_counter() - start
    run = probe.load(out)
    summaries = [run.step_info(s).manifest["modes"]["dump"] for s in run.steps]
    files = sum(1 for _ in (out / "rank0").rglob("*") if _.is_file())
    return {
        "step_s": statistics.median(times),
        "step_times": times,
        "step_bytes": [s["bytes"] for s in summaries],
        "wall_s": wall,
        "bytes": sum(s["bytes"] for s in summaries),
        "shards": sum(s["shards"] for s in summaries),
        "tensors": sum(s["tensors"] for s in summaries),
        "files": files,
        "peak_rss_mb": _peak_rss_mb(),
    }


def child_raw(args: argparse.Namespace) -> dict[str, Any]:
    """Sequential write of ``--bytes`` in 64 MiB writes, then fsync: buffered, and direct."""
    path = Path(args.dir) / "raw.bin"
    block = mmap.mmap(-1, CHUNK)  # page-aligned, as direct I/O needs
    block.write(os.urandom(CHUNK))
    result = {"bytes": args.bytes}
    for name, extra in (("buffered_s", 0), ("direct_s", getattr(os, "O_DIRECT", 0))):
        if name == "direct_s" and not extra:
            continue
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra, 0o644)
        remaining = args.bytes
        while remaining > 0:
            n = min(CHUNK, remaining)
            remaining -= os.write(fd, memoryview(block)[: n + (-n % 4096)])
        os.fsync(fd)
        os.close(fd)
        result[name] = time.perf_counter() - start
        path.unlink()
    return result


def child_access(args: argparse.Namespace) -> dict[str, Any]:
    import probe

    run = probe.load(Path(args.dir) / "run")
    step = run.steps[-1]
    ops = run.ops(step)
    entries = [e for e in run.dump(step).entries.values() if e.status is None and e.blob is not None]
    rng = random.Random(0)
    picks = rng.sample(entries, min(200, len(entries)))
    times, nbytes = [], 0
    for e in picks:
        start = time.perf_counter()
        t = run.tensor(ops[e.op].id, e.io, e.position, step=step)
        t.sum()  # touch every element: the read happens here
        times.append(time.perf_counter() - start)
        nbytes += t.numel() * t.element_size()
    return {"median_ms": 1e3 * statistics.median(times), "mb_per_s": nbytes / sum(times) / 1e6,
            "samples": len(picks)}


def _large_case(quick: bool) -> tuple[int, int]:
    """(tensor bytes, memory budget) of the large-tensor measurement."""
    return (128 << 20, 16 << 20) if quick else (512 << 20, 64 << 20)


def child_large(args: argparse.Namespace) -> dict[str, Any]:
    """One tensor larger than the budget: the peak host memory the dump adds, and its speed."""
    import torch

    import probe

    nbytes, budget = _large_case(args.quick)
    big = torch.randn(nbytes // 4)
    out = Path(args.dir) / "large"
    before = _peak_rss_mb()
    start = time.perf_counter()
    with probe.mode("dump", out=out, memory_budget=budget, tensors="inputs") as session:
        big.sum()
        session.step()
    wall = time.perf_counter() - start
    summary = probe.load(out).step_info(0).manifest["modes"]["dump"]
    shutil.rmtree(out)
    return {"added_rss_mb": _peak_rss_mb() - before, "host_buffer_peak": summary["host_buffer_peak"],
            "wall_s": wall, "bytes": summary["bytes"]}


CHILDREN = {"baseline": child_baseline, "dump": child_dump, "raw": child_raw, "access": child_access,
            "large": child_large}


def run_child(kind: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.dump_throughput", "--child", kind, "--dir", args.dir,
           "--steps", str(args.steps), "--memory-budget", str(args.memory_budget)]
    if args.quick:
        cmd.append("--quick")
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"child {kind} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dump_throughput")
    parser.add_argument("--steps", type=int, default=3, help="dumped training steps (3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="the demo model: a smoke run")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--memory-budget", type=int, default=2 << 30,
                        help="the dump's memory_budget in bytes (default 2 GiB, the mode's default)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return 0

    scratch = tempfile.mkdtemp(prefix="probe-dump-bench-", dir=args.dir)
    args.dir = scratch
    console = Console()
    console.print(f"[bold]dump throughput[/bold]  {machine_line()}  dir {scratch}")
    try:
        with console.status("baseline steps"):
            base = run_child("baseline", args)
        with console.status("dumping"):
            dump = run_child("dump", args)
        with console.status(f"raw write of {dump['bytes'] / 1e9:.2f} GB"):
            raw = run_child("raw", args, bytes=dump["bytes"])
        with console.status("random access"):
            access = run_child("access", args)
        with console.status("a tensor larger than the memory budget"):
            large = run_child("large", args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    dump_gbs = dump["bytes"] / dump["wall_s"] / 1e9
    buffered_gbs = raw["bytes"] / raw["buffered_s"] / 1e9
    direct_gbs = raw["bytes"] / raw["direct_s"] / 1e9 if "direct_s" in raw else 0.0
    raw_gbs = max(buffered_gbs, direct_gbs)
    # The wall clock includes the training's own compute; the dump's cost is what it adds.
    added_s = max(dump["wall_s"] - args.steps * base["step_s"], 1e-9)
    added_gbs = dump["bytes"] / added_s / 1e9
    # Sustained: the steps after the first, once the host buffers exist (the first
    # step also pays their page faults).
    later_s = sum(max(t - base["step_s"], 1e-9) for t in dump["step_times"][1:])
    sustained_gbs = sum(dump["step_bytes"][1:]) / later_s / 1e9 if args.steps > 1 else added_gbs
    large_mb, large_budget_mb = (n >> 20 for n in _large_case(args.quick))
    rows = [
        ("dumped steps", str(args.steps)),
        ("data written", f"{dump['bytes'] / 1e9:.2f} GB in {dump['tensors']} tensors"),
        ("files", f"{dump['files']} ({dump['shards']} shards)"),
        ("dump wall time (until on disk)", f"{dump['wall_s']:.1f} s"),
        ("dump throughput, wall clock (training included)", f"{dump_gbs:.2f} GB/s"),
        ("dump throughput, time it adds to training", f"{added_gbs:.2f} GB/s "
                                                      f"({added_gbs / raw_gbs:.0%} of best raw)"),
        ("sustained (steps after the first), time it adds", f"{sustained_gbs:.2f} GB/s "
                                                            f"({sustained_gbs / raw_gbs:.0%} of best raw)"),
        ("raw sequential write, same bytes: buffered / direct I/O",
         f"{buffered_gbs:.2f} / {direct_gbs:.2f} GB/s"),
        ("wall-clock dump / best raw", f"{dump_gbs / raw_gbs:.0%}"),
        ("step time: baseline -> dump (median; each dumped step)",
         f"{base['step_s']:.2f} s -> {dump['step_s']:.2f} s (x{dump['step_s'] / base['step_s']:.2f}; "
         + ", ".join(f"{t:.2f}" for t in dump["step_times"]) + ")"),
        ("peak host memory: baseline -> dump", f"{base['peak_rss_mb']:.0f} MB -> "
                                                f"{dump['peak_rss_mb']:.0f} MB"),
        ("run.tensor() random access", f"{access['median_ms']:.2f} ms median, "
                                       f"{access['mb_per_s']:.0f} MB/s ({access['samples']} tensors)"),
        (f"one {large_mb} MiB tensor, {large_budget_mb} MiB budget: peak host memory added; "
         "largest buffers; speed",
         f"{large['added_rss_mb']:.0f} MB; {large['host_buffer_peak'] / 2**20:.0f} MiB; "
         f"{large['bytes'] / large['wall_s'] / 1e9:.2f} GB/s"),
    ]
    print_measures(console, "dump throughput", rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
