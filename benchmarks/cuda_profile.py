"""Where a stats step's time goes on an accelerator: one prepared run for a lent GPU.

Run from the repository root (about 3 minutes on an H200)::

    python -m benchmarks.cuda_profile [--device cuda] [--workload hf-llama7b-width]
                                      [--dtype bf16] [--out DIR]

In one process, on one model: the bare step and the stats step timed alternately
(median of ``--steps``, the stats step inside one open session, ``session.step()``
included); one stats step under ``torch.profiler`` (device kernels and host ops by
self time, with counts); the same step under ``cProfile`` (the probe's host functions);
the step with its files written on the writer thread and on the training thread (where
the wall time goes that the training thread's CPU time does not show); and the
multi-tensor statistics kernel alone (single tensors and batches, against one read and
one copy's bandwidth, and its host cost per call on a small tensor). Tables are printed
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


def writer_share(workload: str, device: str, dtype: str, steps: int) -> str:
    """Where a stats step's wall time goes that the training thread's CPU time does not show: the
    step with its files written on the writer thread (the default) and on the training thread
    (``async_flush=False``), with the training thread's and the whole process's CPU time and the
    write's own wall and CPU time (what the writer thread does holds the GIL the training thread
    needs between its torch calls; the op records are encoded before, on the training thread)."""
    import probe
    from probe import session_writer

    writes: list[tuple[float, float]] = []
    original = session_writer.SessionWriter._write_step

    def timed_write(self: Any, *args: Any, **kwargs: Any) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        original(self, *args, **kwargs)
        writes.append(((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3))

    lines = ["| files written on | step ms | training thread cpu ms | process cpu ms | write ms | "
             "write cpu ms |", "|---|---:|---:|---:|---:|---:|"]
    session_writer.SessionWriter._write_step = timed_write
    try:
        for flush in (True, False):
            trainer = workloads()[workload].trainer(device, dtype)
            writes.clear()
            rows: list[tuple[float, float, float]] = []
            with probe.mode("stats", out=tempfile.mkdtemp(), overwrite=True, model=trainer.model,
                            async_flush=flush) as session:
                for index in range(3 + steps):
                    _sync(device)
                    wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
                    trainer.step()
                    session.step()
                    _sync(device)
                    if index >= 3:
                        rows.append(((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3,
                                     (time.process_time() - process) * 1e3))
            medians = [statistics.median(column) for column in zip(*rows, strict=True)]
            written = [statistics.median(column) for column in zip(*writes[3:], strict=True)]
            where = "the writer thread" if flush else "the training thread"
            lines.append(f"| {where} | {medians[0]:.1f} | {medians[1]:.1f} | {medians[2]:.1f} | "
                         f"{written[0]:.1f} | {written[1]:.1f} |")
    finally:
        session_writer.SessionWriter._write_step = original
    return "\n".join(lines)


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


def _median_ms(fn: Callable[[], object], device: str) -> float:
    for _ in range(3):
        fn()
    runs = sorted(_timed(fn, device) for _ in range(10))
    return runs[len(runs) // 2]


def kernel_alone(device: str) -> str:
    """The multi-tensor kernel alone on single tensors and batches, in GB/s of values read, beside
    one read (``x.sum()``) and one copy of the first tensor; then its host time per call."""
    from probe.modes.statistics.multi_tensor import rows as multi_rows

    cases = [(f"{str(dtype)[6:]} x {numel:,}", [torch.randn(numel, device=device).to(dtype)])
             for dtype, numel in ((torch.bfloat16, 4096 * 11008), (torch.float32, 4096 * 11008),
                                  (torch.bfloat16, 32000 * 4096))]
    cases += [(f"bf16 batch {count} x {numel:,}", [torch.randn(numel, device=device).bfloat16()
                                                    for _ in range(count)])
              for count, numel in ((8, 4096 * 11008), (64, 1 << 20), (400, 4096))]
    lines = ["GB/s of values read (median of 10 after 3 warm-ups)", "",
             "| values | multi-tensor rows | x.sum() | clone (r+w) |", "|---|---:|---:|---:|"]
    for label, xs in cases:
        nbytes = sum(x.numel() * x.element_size() for x in xs)
        cells = [f"{nbytes / _median_ms(lambda xs=xs: multi_rows(xs, 0.0), device) / 1e6:.0f}"]
        one = xs[0].numel() * xs[0].element_size()
        cells += [f"{one / _median_ms(fn, device) / 1e6:.0f}" for fn in (xs[0].sum, xs[0].clone)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    small = torch.randn(4096, device=device)
    multi_rows([small], 0.0)
    n = 500
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        multi_rows([small], 0.0)
    multi = (time.perf_counter() - t0) / n * 1e6
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        small.sum()
    eager = (time.perf_counter() - t0) / n * 1e6
    _sync(device)
    lines.append(f"\nhost time per call on 4096 fp32 values: multi-tensor rows {multi:.1f} us, "
                 f"eager sum {eager:.1f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workload", default="hf-llama7b-width")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sections", default="times,writer,profile,host,kernel")
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
    if "writer" in sections:
        report["writer"] = writer_share(args.workload, args.device, args.dtype, args.steps)
        print(report["writer"], "\n", flush=True)
    if "kernel" in sections:
        report["kernel"] = kernel_alone(args.device)
        print(report["kernel"], "\n", flush=True)
    name = f"profile-{args.workload}-{args.dtype}.md"
    (out / name).write_text("\n\n".join(f"## {k}\n\n{v}" for k, v in report.items()))
    print(f"written: {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
