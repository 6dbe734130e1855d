"""Where a stats step's time goes on an accelerator: one prepared run for a lent GPU.

Run from the repository root (about 3 minutes on an H200)::

    python -m benchmarks.cuda_profile [--device cuda] [--workload hf-llama7b-width]
                                      [--dtype bf16] [--out DIR]

In one process, on one model: the bare step and the stats step timed alternately
(median of ``--steps``, the stats step inside one open session, ``session.step()``
included); one stats step under ``torch.profiler`` (device kernels and host ops by
self time, with counts); the same step under ``cProfile`` (the probe's host functions);
and the statistics kernel alone (``reduce._COMPILED`` on one large tensor against a
plain copy's bandwidth, and its host cost per call on a small one). Tables are printed
and written under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import workloads


def _sync(device: str) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def step_times(workload: str, device: str, dtype: str, steps: int, backends: list[str]
               ) -> tuple[str, Callable[[], None], Any]:
    """The bare step, then the stats step under each ``stats_backend`` (one open session each,
    ``session.step()`` included); returns the table and the first backend's step and session,
    left open for the profiles."""
    import probe

    def timed_steps(step: Callable[[], object]) -> tuple[list[float], list[float]]:
        for _ in range(3):  # the first compiles the probe's kernels and warms the allocator
            step()
        wall, cpu = [], []
        for _ in range(steps):
            c0 = time.thread_time()
            wall.append(_timed(step, device))
            cpu.append((time.thread_time() - c0) * 1e3)
        return wall, cpu

    bare = workloads()[workload].trainer(device, dtype)
    times = {"bare": timed_steps(bare.step)}
    kept: tuple[Callable[[], None], Any] | None = None
    for backend in reversed(backends):  # the first last: its session stays open (one at a time)
        traced = workloads()[workload].trainer(device, dtype)
        session = probe.mode("stats", out=tempfile.mkdtemp(), overwrite=True, model=traced.model,
                             stats_backend=backend)
        session.__enter__()

        def stats_step(traced: Any = traced, session: Any = session) -> None:
            traced.step()
            session.step()

        times[f"stats ({backend})"] = timed_steps(stats_step)
        if backend == backends[0]:
            kept = (stats_step, session)
        else:
            session.__exit__(None, None, None)
    base = statistics.median(times["bare"][0])
    lines = ["| step | median ms | min ms | x bare | main-thread cpu ms |", "|---|---:|---:|---:|---:|"]
    for name, (wall, cpu) in times.items():
        med = statistics.median(wall)
        cpu_ms = statistics.median(cpu)
        lines.append(f"| {name} | {med:.1f} | {min(wall):.1f} | {med / base:.2f} | {cpu_ms:.1f} |")
    assert kept is not None
    return "\n".join(lines), *kept


def profiled(stats_step: Callable, device: str) -> str:
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        stats_step()
        _sync(device)
    averages = prof.key_averages()
    parts = []
    if on_gpu:
        total = sum(e.self_device_time_total for e in averages) / 1e3
        parts.append(f"self device time, all ops: {total:.1f} ms")
        parts.append(averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
    total_cpu = sum(e.self_cpu_time_total for e in averages) / 1e3
    parts.append(f"self cpu time, all ops: {total_cpu:.1f} ms")
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    return "\n\n".join(parts)


def host_profile(stats_step: Callable, device: str) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    stats_step()
    _sync(device)
    profiler.disable()
    text = io.StringIO()
    view = pstats.Stats(profiler, stream=text)
    view.sort_stats("tottime").print_stats(40)
    view.sort_stats("cumulative").print_stats(60)
    return text.getvalue()


def kernel_alone(device: str) -> str:
    from probe.modes.statistics import reduce
    from probe.modes.statistics.multi_tensor import rows as multi_rows

    lines = ["| tensor | what | ms | GB/s read |", "|---|---|---:|---:|"]
    shapes = ((torch.bfloat16, 4096 * 11008), (torch.float32, 4096 * 11008), (torch.bfloat16, 32000 * 4096))
    for dtype, numel in shapes:
        x = torch.randn(numel, device=device).to(dtype)
        thr = reduce._threshold(x, None)
        candidates = {
            "compiled row": lambda x=x, thr=thr: reduce._COMPILED(x, thr),
            "multi-tensor row": lambda x=x: multi_rows([x], 0.0),
            "x.sum()": lambda x=x: x.sum(),
            "x.float().sum()": lambda x=x: x.float().sum(),
            "clone (r+w)": lambda x=x: x.clone(),
        }
        for name, fn in candidates.items():
            for _ in range(3):
                fn()
            runs = sorted(_timed(fn, device) for _ in range(10))
            ms = runs[len(runs) // 2]
            rate = numel * x.element_size() / ms / 1e6
            lines.append(f"| {dtype} x {numel} | {name} | {ms:.3f} | {rate:.0f} |")
    for count, numel in ((64, 1 << 20), (400, 4096), (8, 4096 * 11008)):
        batch = [torch.randn(numel, device=device).bfloat16() for _ in range(count)]
        for _ in range(3):
            multi_rows(batch, 0.0)
        runs = sorted(_timed(lambda batch=batch: multi_rows(batch, 0.0), device) for _ in range(10))
        ms = runs[len(runs) // 2]
        lines.append(f"| bf16 batch {count} x {numel} | multi-tensor rows | {ms:.3f} | "
                     f"{count * numel * 2 / ms / 1e6:.0f} |")
    small = torch.randn(4096, device=device)
    thr = reduce._threshold(small, None)
    for _ in range(5):
        reduce._COMPILED(small, thr)
    _sync(device)
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        reduce._COMPILED(small, thr)
    host = (time.perf_counter() - t0) / n * 1e6
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        small.sum()
    eager = (time.perf_counter() - t0) / n * 1e6
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        multi_rows([small], 0.0)
    multi = (time.perf_counter() - t0) / n * 1e6
    _sync(device)
    lines.append(f"\nhost time per call on 4096 fp32 values: compiled row {host:.1f} us, "
                 f"multi-tensor row {multi:.1f} us, eager sum {eager:.1f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workload", default="hf-llama7b-width")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sections", default="times,profile,host,kernel")
    parser.add_argument("--backends", default="auto,compiled",
                        help="stats_backend values, the first profiled")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    title = f"{args.workload} {args.dtype} on {args.device}"
    if torch.device(args.device).type == "cuda":
        title += f" ({torch.cuda.get_device_name()}, torch {torch.__version__})"
    print(f"# {title}\n", flush=True)
    table, stats_step, session = step_times(args.workload, args.device, args.dtype, args.steps,
                                            args.backends.split(","))
    print(table, "\n", flush=True)
    report = {"times": table}
    if "profile" in sections:
        report["profile"] = profiled(stats_step, args.device)
    if "host" in sections:
        report["host"] = host_profile(stats_step, args.device)
    session.__exit__(None, None, None)
    if "kernel" in sections:
        report["kernel"] = kernel_alone(args.device)
        print(report["kernel"], "\n", flush=True)
    name = f"profile-{args.workload}-{args.dtype}.md"
    (out / name).write_text("\n\n".join(f"## {k}\n\n{v}" for k, v in report.items()))
    print(f"written: {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
