"""What the probe adds to a training step, against no probe and a bare dispatch mode.

Run from the repository root::

    python -m benchmarks.overhead [--quick] [--model demo|llama7b-shaped|hf-llama-small|
                                  hf-llama7b-width|all] [--steps N] [--warmup N]
                                  [--threads N] [--dtype fp32|bf16] [--peers] [--calls] [--markdown]

Configurations (each trains its own model and optimizer, built from the same seed):

- ``baseline``: the training step, no dispatch mode;
- ``passthrough``: inside a bare ``TorchDispatchMode`` that runs and counts each
  op, the cost floor of any dispatch mode;
- ``python-floor``: inside a dispatch mode that does the least any Python tracer of
  values must do per op: each tensor argument's identity (address, shape, stride,
  version) looked up in a dict, each result's registered, one record appended; no
  module, phase, op id or written-argument tracking. What ``probe-structure`` could
  reach with all its own bookkeeping gone;
- ``probe-notrace``: inside ``probe.mode("stats", ops=["__nothing__"])``, the
  probe's routing with no op selected;
- ``probe-structure``: inside ``probe.mode("structure")``, every op recorded
  with no per-op work: the tracer's bookkeeping;
- ``probe-stats``: inside ``probe.mode("stats")``;
- ``probe-stats-eager`` (with ``--eager``): the same with ``stats_backend="eager"``;
- ``debugmode`` (with ``--peers``): inside torch's ``DebugMode`` (an op log), a peer
  measured in the same rounds (msprobe runs in its own venv: ``benchmarks.report``).

With ``--calls``, one more step of each configuration runs under ``cProfile`` and a second
table gives its Python calls (functions and C methods) per op over the baseline's: host work
per op counted, which a loaded machine's clock cannot blur.

Each row's overhead (its median minus the baseline's) is also given as a multiple of the
passthrough's overhead (``x bare ovh``), in wall time and in the main thread's CPU time
(``time.thread_time``: every dispatch mode's per-op work runs on the main thread, and a CPU
clock counts none of the time other processes of a shared machine take from it).

All run in one process, alternating step by step (one step of each configuration
per round, the starting configuration rotating from round to round), so that
drift of a shared machine reaches them alike. A probe
session is entered around each single step, in a fresh directory; only the
step and its flush (``session.step()``) are timed, not entering or leaving the
session. Warm-up rounds (the first compiles the probe's statistics kernel) are
not timed.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from benchmarks.models import MODELS, ModelSpec, WorkloadSpec
from probe.demo.train import DemoTraining
from probe.vocabulary.op_tensors import tensors_in, tensors_out

# -- configurations -------------------------------------------------------------


class CountingMode(TorchDispatchMode):
    """The cost floor of any dispatch mode: run each op as it is, and count it."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class PythonFloorMode(TorchDispatchMode):
    """The least a Python tracer of values does per op (see ``python-floor`` above)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[tuple[Any, ...], tuple[int, int]] = {}
        self.records: list[tuple[Any, ...]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        values, index = self.values, len(self.records)
        sources = [
            values.get((t.data_ptr(), t.shape, t.stride(), t._version))
            for t in tensors_in(args, kwargs or {})
        ]
        out = func(*args, **(kwargs or {}))
        shapes = []
        for position, t in enumerate([out] if type(out) is torch.Tensor else tensors_out(out)):
            shape = t.shape
            values[(t.data_ptr(), shape, t.stride(), t._version)] = (index, position)
            shapes.append(tuple(shape))
        self.records.append((index, func, tuple(sources), tuple(shapes)))
        return out


@dataclass(frozen=True)
class Sample:
    """One timed step, and how many ops the configuration saw in it (None: not counted)."""

    seconds: float
    ops: int | None
    cpu_seconds: float = 0.0
    """The main thread's CPU time over the same span (``time.thread_time``)."""


class Timer:
    """Wall and main-thread CPU time of one span: ``start()``, then ``sample(ops)``."""

    profiler: ClassVar[cProfile.Profile | None] = None
    """While set, each timed span is also profiled (``--calls``: :func:`calls_per_op`)."""

    def start(self) -> None:
        if Timer.profiler is not None:
            Timer.profiler.enable()
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def sample(self, ops: int | None) -> Sample:
        wall, cpu = time.perf_counter() - self._wall, time.thread_time() - self._cpu
        if Timer.profiler is not None:
            Timer.profiler.disable()
        return Sample(wall, ops, cpu)


class Config(Protocol):
    """One way of running a training step; ``run_step`` times it."""

    @property
    def name(self) -> str: ...

    def run_step(self, trainer: DemoTraining) -> Sample: ...


@dataclass(frozen=True)
class Baseline:
    name: str = "baseline"

    def run_step(self, trainer: DemoTraining) -> Sample:
        timer = Timer()
        timer.start()
        trainer.step()
        trainer.synchronize()
        return timer.sample(None)


def timed_under(mode: TorchDispatchMode, trainer: DemoTraining, ops: Callable[[], int | None]) -> Sample:
    """One step timed inside ``mode`` (entered before the clock starts); ``ops()`` counts its ops."""
    timer = Timer()
    with mode:
        timer.start()
        trainer.step()
        trainer.synchronize()
        return timer.sample(ops())


@dataclass(frozen=True)
class Passthrough:
    name: str = "passthrough"

    def run_step(self, trainer: DemoTraining) -> Sample:
        counter = CountingMode()
        return timed_under(counter, trainer, lambda: counter.ops)


@dataclass(frozen=True)
class PythonFloor:
    name: str = "python-floor"

    def run_step(self, trainer: DemoTraining) -> Sample:
        floor = PythonFloorMode()
        return timed_under(floor, trainer, lambda: len(floor.records))


def recorded_ops(out: Path) -> int:
    """Ops the probe recorded in step 0 of a run; a step with none is not written."""
    run = probe.load(out)
    return len(run.ops(step=0, rank=0)) if 0 in run.steps_of(0) else 0


@dataclass(frozen=True)
class ProbeConfig:
    """A session of ``mode`` with extra ``options``, entered around each step in a fresh directory."""

    name: str
    scratch: Path
    mode: str = "stats"
    options: Mapping[str, Any] = field(default_factory=dict)

    def run_step(self, trainer: DemoTraining) -> Sample:
        out = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.scratch))
        try:
            # A session per step would charge the once-per-session parameter checksums of model=
            # to every step; benchmarks.checksums measures them on their own.
            options = {"checksums": False, **self.options}
            timer = Timer()
            with probe.mode(self.mode, out=out, overwrite=True, model=trainer.model, **options) as session:
                timer.start()
                trainer.step()
                session.step()
                trainer.synchronize()
                sample = timer.sample(None)
            return Sample(sample.seconds, recorded_ops(out), sample.cpu_seconds)
        finally:
            shutil.rmtree(out, ignore_errors=True)


@dataclass(frozen=True)
class DebugModeConfig:
    """torch's ``DebugMode`` around the step: a peer's per-op cost in the same rounds."""

    name: str = "debugmode"

    def run_step(self, trainer: DemoTraining) -> Sample:
        from torch.utils._debug_mode import DebugMode

        return timed_under(DebugMode(), trainer, lambda: None)


# Every ratio is taken against these two, so a --configs selection always keeps them.
REQUIRED_CONFIGS = ("baseline", "passthrough")


def configurations(scratch: Path, eager: bool, peers: bool = False) -> list[Config]:
    configs: list[Config] = [
        Baseline(),
        Passthrough(),
        PythonFloor(),
        ProbeConfig("probe-notrace", scratch, options={"ops": ["__nothing__"]}),
        ProbeConfig("probe-structure", scratch, mode="structure"),
        ProbeConfig("probe-stats", scratch),
    ]
    if eager:
        configs.append(ProbeConfig("probe-stats-eager", scratch, options={"stats_backend": "eager"}))
    if peers:
        configs.append(DebugModeConfig())
    return configs


# -- measuring ------------------------------------------------------------------


def run_rounds(
    configs: Sequence[Config],
    trainers: Sequence[DemoTraining],
    warmup: int,
    steps: int,
    on_round: Callable[[int], None],
) -> dict[str, list[Sample]]:
    """Round-robin: each round runs one step of every configuration, starting one later each round."""
    samples: dict[str, list[Sample]] = {config.name: [] for config in configs}
    pairs = list(zip(configs, trainers, strict=True))
    for round_index in range(warmup + steps):
        shift = round_index % len(pairs)
        for config, trainer in pairs[shift:] + pairs[:shift]:
            gc.collect()  # start each step from the same heap, outside the timing
            sample = config.run_step(trainer)
            if round_index >= warmup:
                samples[config.name].append(sample)
        on_round(round_index + 1)
    return samples


@dataclass(frozen=True)
class Row:
    """One configuration's line of the results table (times in ms)."""

    name: str
    median_ms: float
    min_ms: float
    max_ms: float
    ratio: float
    ops: int | None
    us_per_op: float | None = None
    per_routed_op: bool = False
    """``us_per_op`` is per op passed through, as this configuration recorded none."""
    cpu_ms: float = 0.0
    """Median main-thread CPU time."""
    overhead_vs_bare: float | None = None
    """(median - baseline median) / (passthrough median - baseline median), wall time;
    None for the baseline and where the passthrough's overhead is not positive."""
    cpu_overhead_vs_bare: float | None = None
    """The same ratio in main-thread CPU time."""


def overhead_ratio(value: float, baseline: float, bare: float) -> float | None:
    """``value``'s overhead over ``baseline`` as a multiple of ``bare``'s."""
    return (value - baseline) / (bare - baseline) if bare > baseline else None


def summarize(samples: Mapping[str, list[Sample]]) -> list[Row]:
    medians = {name: statistics.median(s.seconds for s in runs) for name, runs in samples.items()}
    cpu = {name: statistics.median(s.cpu_seconds for s in runs) for name, runs in samples.items()}
    passthrough_ops = samples[Passthrough.name][-1].ops
    return [
        summary_row(name, runs, medians, passthrough_ops, cpu) for name, runs in samples.items()
    ]


def summary_row(
    name: str, runs: list[Sample], medians: Mapping[str, float], passthrough_ops: int | None,
    cpu: Mapping[str, float] | None = None,
) -> Row:
    """Times against baseline; overheads against the passthrough's; for probe rows, the cost
    per op above the passthrough floor."""
    seconds = [s.seconds for s in runs]
    median, ops = medians[name], runs[-1].ops
    cpu = cpu or {n: 0.0 for n in medians}
    vs_bare = cpu_vs_bare = None
    if name != Baseline.name:
        vs_bare = overhead_ratio(median, medians[Baseline.name], medians[Passthrough.name])
        cpu_vs_bare = overhead_ratio(cpu[name], cpu[Baseline.name], cpu[Passthrough.name])
    us_per_op, per_routed = None, False
    if name.startswith("probe-"):
        per_routed = not ops
        divisor = passthrough_ops if per_routed else ops
        if divisor:
            us_per_op = 1e6 * (median - medians[Passthrough.name]) / divisor
    return Row(
        name, 1e3 * median, 1e3 * min(seconds), 1e3 * max(seconds),
        median / medians[Baseline.name], ops, us_per_op, per_routed,
        1e3 * cpu[name], vs_bare, cpu_vs_bare,
    )


def measure(
    spec: ModelSpec | WorkloadSpec, warmup: int, steps: int, eager: bool, only: set[str] | None,
    console: Console, device: str = "cpu", peers: bool = False, calls: dict[str, float] | None = None,
) -> list[Row]:
    """The rows of ``spec``'s table; with ``calls`` (a dict), also each configuration's Python
    calls per op (:func:`calls_per_op`), put there."""
    with tempfile.TemporaryDirectory(prefix="probe-overhead-") as scratch:
        configs = configurations(Path(scratch), eager, peers)
        if only is not None:
            configs = [c for c in configs if c.name in only or c.name in REQUIRED_CONFIGS]
        with console.status(f"{spec.name}: building {len(configs)} models"):
            trainers = [spec.trainer(device=device) for _ in configs]
        rounds = warmup + steps
        with console.status(f"{spec.name}: round 1/{rounds}") as status:

            def on_round(done: int) -> None:
                status.update(f"{spec.name}: round {min(done + 1, rounds)}/{rounds}")

            samples = run_rounds(configs, trainers, warmup, steps, on_round)
        if calls is not None:
            with console.status(f"{spec.name}: one profiled step each"):
                calls.update(calls_per_op(configs, trainers))
        del trainers
        gc.collect()
    return summarize(samples)


def calls_per_op(configs: Sequence[Config], trainers: Sequence[DemoTraining]) -> dict[str, float]:
    """Python calls (functions and C methods, as ``cProfile`` counts them) per op in one more
    timed span of each configuration, over the baseline's calls in its span; by configuration
    name, those that ran ops (each divided by the ops it recorded, or passed through)."""
    calls: dict[str, int] = {}
    ops: dict[str, int | None] = {}
    for config, trainer in zip(configs, trainers, strict=True):
        gc.collect()
        Timer.profiler = cProfile.Profile()
        try:
            ops[config.name] = config.run_step(trainer).ops
            calls[config.name] = pstats.Stats(Timer.profiler).total_calls  # type: ignore[attr-defined]
        finally:
            Timer.profiler = None
    base = calls.pop(Baseline.name)
    routed = ops.get(Passthrough.name)
    found = {}
    for name, n in calls.items():
        divisor = ops[name] or routed
        if divisor:
            found[name] = (n - base) / divisor
    return found


# -- reporting ------------------------------------------------------------------

COLUMNS = (
    "config", "median ms", "min ms", "max ms", "x baseline", "x bare ovh", "cpu ms",
    "x bare ovh (cpu)", "ops/step", "us/op over passthrough",
)
ROUTED_MARK = "*"
ROUTED_NOTE = (
    f"{ROUTED_MARK} no op recorded: per op passed through the mode (the passthrough count)"
)


def per_op_cell(row: Row) -> str:
    if row.us_per_op is None:
        return ""
    return f"{row.us_per_op:.1f}{ROUTED_MARK if row.per_routed_op else ''}"


def ratio_cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def row_cells(row: Row) -> list[str]:
    return [
        row.name,
        f"{row.median_ms:.1f}",
        f"{row.min_ms:.1f}",
        f"{row.max_ms:.1f}",
        f"{row.ratio:.2f}",
        ratio_cell(row.overhead_vs_bare),
        f"{row.cpu_ms:.1f}",
        ratio_cell(row.cpu_overhead_vs_bare),
        "" if row.ops is None else str(row.ops),
        per_op_cell(row),
    ]


def caption(spec: ModelSpec | WorkloadSpec, warmup: int, steps: int) -> str:
    return (
        f"{spec.name}: {spec.num_params() / 1e6:.1f}M params; {spec.describe()}; "
        f"{steps} timed step(s) per config after {warmup} warm-up"
    )


def rich_table(title: str, rows: Sequence[Row]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row_cells(row))
    return table


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def print_measures(console: Console, title: str, rows: Sequence[tuple[str, str]], markdown: bool) -> None:
    """A two-column "measure | value" table on the console, and in markdown when asked."""
    table = Table(title=title, title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if markdown:
        print("\n| measure | value |\n|---|---:|")
        for name, value in rows:
            print(f"| {name} | {value} |")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: str = "cpu") -> dict[str, str]:
    found = {
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
    }
    if torch.device(device).type == "cuda":
        found["device"] = torch.cuda.get_device_name(torch.device(device))
    return found


def peak_memory_mb(device: str = "cpu") -> float:
    """Peak memory so far: the accelerator allocator's (CUDA, or NPU through torch.accelerator),
    or the host's max RSS on the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    if kind != "cpu" and hasattr(torch.accelerator, "max_memory_allocated"):
        return torch.accelerator.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_line(device: str = "cpu") -> str:
    return "; ".join(f"{key}: {value}" for key, value in machine(device).items())


# -- command line -----------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    models: list[ModelSpec | WorkloadSpec]
    warmup: int
    steps: int
    markdown: bool
    eager: bool
    only: set[str] | None
    device: str
    peers: bool = False
    calls: bool = False


def parse_args(argv: Sequence[str] | None) -> tuple[Plan, int | None]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Step-time overhead of the probe, against no probe and a bare dispatch mode.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 warm-up, 1 timed step, demo model unless --model")
    parser.add_argument("--model", choices=[*MODELS, "all"], default=None,
                        help="model to time (default: all; demo with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per config (10)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed warm-up steps per config (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    parser.add_argument("--markdown", action="store_true",
                        help="also print each table as GitHub markdown")
    parser.add_argument("--eager", action="store_true",
                        help="also time stats_backend='eager' (slow on large tensors)")
    parser.add_argument("--seq", type=int, default=None,
                        help="train on sequences of N tokens instead of the model's default")
    parser.add_argument("--device", default="cpu", help="device to train on (cpu, cuda, npu; default cpu)")
    parser.add_argument("--peers", action="store_true",
                        help="also time torch's DebugMode in the same rounds")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="dtype of the HF workloads (default: fp32; hf-llama7b-width: bf16)")
    parser.add_argument("--calls", action="store_true",
                        help="also count Python calls per op (cProfile, one more step each)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated configurations to time (baseline and passthrough always)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (1 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if steps < 1 or warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    model = args.model or ("demo" if args.quick else "all")
    if model == "all":  # the 7B-wide seq-2048 HF model is for accelerators
        models = [s for s in MODELS.values() if s.name != "hf-llama7b-width" or args.device != "cpu"]
    else:
        models = [MODELS[model]]
    if args.dtype is not None:
        models = [s.with_dtype(args.dtype) if isinstance(s, WorkloadSpec) else s for s in models]
    if args.seq is not None:
        if args.seq < 1:
            parser.error("--seq must be at least 1")
        models = [spec.with_seq(args.seq) for spec in models]
    only = {c.strip() for c in args.configs.split(",")} if args.configs else None
    known = {c.name for c in configurations(Path("."), eager=True, peers=True)}
    if only is not None and not only <= known:
        parser.error(f"--configs: unknown {sorted(only - known)}; known: {sorted(known)}")
    if only is not None:  # the flags that add rows add them to a selection too
        added = ((DebugModeConfig.name, args.peers), ("probe-stats-eager", args.eager))
        only |= {name for name, asked in added if asked}
    plan = Plan(models, warmup, steps, args.markdown, args.eager, only, args.device, args.peers, args.calls)
    return plan, args.threads


def main(argv: Sequence[str] | None = None) -> int:
    plan, threads = parse_args(argv)
    if threads is not None:
        torch.set_num_threads(threads)
    # The models have no compiled regions; the notice that they would run eagerly is noise here.
    warnings.filterwarnings("ignore", message="probe: compiled regions run eagerly")
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(f"[bold]probe overhead[/bold]  {machine_line(plan.device)}")
    if plan.warmup == 0:
        console.print("[yellow]--warmup 0: the first probe-stats step includes torch.compile[/]")
    for spec in plan.models:
        calls: dict[str, float] | None = {} if plan.calls else None
        rows = measure(spec, plan.warmup, plan.steps, plan.eager, plan.only, console, plan.device, plan.peers,
                       calls)
        title = caption(spec, plan.warmup, plan.steps)
        console.print(rich_table(title, rows))
        if calls:
            print_measures(console, f"{spec.name}: Python calls per op over the baseline (cProfile)",
                           [(name, f"{n:.1f}") for name, n in calls.items()], plan.markdown)
        note = ROUTED_NOTE if any(row.per_routed_op for row in rows) else ""
        if note:
            console.print(note)
        if plan.markdown:
            print(f"\n{title}\n\n{machine_line(plan.device)}\n\n{markdown_table(rows)}\n\n{note}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
