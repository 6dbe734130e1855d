"""The performance report: our modes and today's tools, side by side, per device.

Run from the repository root::

    python -m benchmarks.report [--device cpu|cuda] [--dtype fp32|bf16|fp16|autocast]
                                [--workloads a,b] [--steps N] [--quick] [--out FILE]

For each workload (``benchmarks.workloads``) it measures a baseline (mean step
time of ``--steps`` steps after warm-up, the first excluded; peak memory: the
device allocator's, or max RSS on the CPU; throughput in tokens or samples per
device per second; MFU against the device's peak), then one row per mode and
option of the seed reports (statistics, tensor dump, free-benchmark checks,
monitor), and the peers when they are installed: msprobe's statistics and tensor
dump (run by the Python of ``--msprobe-python``, default ``.venv-msprobe``) and
torch's own ``DebugMode``. Each row runs in a fresh process (its memory peak is
its own), alternating baseline and instrumented steps on one model so that
drift falls on both; it reports min/median/max of the time ratio per step pair
and the memory ratio. The markdown goes to ``benchmarks/results/<device>.md``
(``--out``); ``--quick`` is a one-step smoke run of two small workloads (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.overhead import machine_line, peak_memory_mb
from benchmarks.workloads import DTYPE_MODES, Trainer, peak_flops, workloads
from probe.exporters.console import progress_bar

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Row:
    """One instrumented configuration: ours (``probe``) or a peer's."""

    label: str
    runner: str
    """``probe``, ``msprobe`` or ``debugmode``."""
    spec: dict[str, Any] = field(default_factory=dict)
    seed: str = ""
    """msprobe's figure from the seed reports (Ascend), for reference."""
    families: tuple[str, ...] = ("llama", "gpt", "resnet", "yolo")
    peer_of: str | None = None
    """For a peer's row: the label of our row it is set beside."""

    @property
    def runner_name(self) -> str:
        return {"msprobe": "msprobe 26", "msprobe-fb": "msprobe 8.3.3", "debugmode": "torch DebugMode"}.get(
            self.runner, self.runner
        )


_LAYER = {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0", "output_grad": "tensor"}
ROWS = [
    Row(
        "statistics, all ops",
        "probe",
        {"modes": ["stats"], "options": {"inputs": True}},
        "YOLOv5s 7 s; GPT-3 3.3 s (dump of one step)",
    ),
    Row("statistics, all ops (msprobe)", "msprobe", {"task": "statistics"}, peer_of="statistics, all ops"),
    Row(
        "tensor dump, forward and backward ops + stacks",
        "probe",
        # Forward and backward, as msprobe's L1 dump hooks them (the optimizer's own ops
        # would add ~8 GB a step on the 7B-wide layer).
        {"modes": ["stats", "dump"], "options": {"stack": True, "phases": ["forward", "backward"]}},
        "YOLOv5s 11 s, 13 GB; GPT-3 53 s, 145 GB",
    ),
    Row(
        "tensor dump, forward and backward (msprobe)",
        "msprobe",
        {"task": "tensor"},
        peer_of="tensor dump, forward and backward ops + stacks",
    ),
    Row(
        "free benchmark: check, forward, add_noise",
        "probe",
        {"modes": ["free_benchmark"], "options": {"perturb": "add_noise", "phases": ["forward"]}},
        "19.5x",
    ),
    Row(
        "free benchmark: check, backward, add_noise",
        "probe",
        {"modes": ["free_benchmark"], "options": {"perturb": "add_noise", "phases": ["backward"]}},
        "43-124x",
    ),
    Row(
        "free benchmark: fix, forward, improve_precision",
        "probe",
        {
            "modes": ["free_benchmark"],
            "options": {"perturb": "improve_precision", "handler": "fix", "phases": ["forward"]},
        },
        "3.7-6.2x",
    ),
    Row(
        "monitor: every layer, x and grads",
        "probe",
        {"modes": ["monitor"], "options": {"targets": {"layers.?": _LAYER, "layers.??": _LAYER}}},
        "+6% (10 of 40 layers)",
        families=("llama", "gpt"),
    ),
    Row("op log (torch DebugMode)", "debugmode", peer_of="op records, all ops (structure)"),
    # Appended, not inserted: a row's index names it to its child process.
    Row("op records, all ops (structure)", "probe", {"modes": ["structure"]}),
    *[
        Row(
            f"free benchmark: {handler}, {phase}, {scope}, {perturb}",
            "probe",
            {
                "modes": ["free_benchmark"],
                "options": {
                    "perturb": perturb,
                    "handler": handler,
                    "phases": [phase],
                    **({"ops": [f"*{scope}*"]} if scope != "all ops" else {}),
                },
            },
            seed,
        )
        for handler, phase, scope, perturb, seed in (
            ("check", "forward", "all ops", "improve_precision", "14.4x"),
            ("check", "forward", "all ops", "bit_noise", "70.8x"),
            ("check", "forward", "all ops", "no_change", "13.4x"),
            ("check", "backward", "softmax", "improve_precision", "26x"),
            ("fix", "forward", "softmax", "to_cpu", "40x"),
        )
    ],
    Row(
        "free benchmark: check, forward, add_noise (msprobe 8.3.3)",
        "msprobe-fb",
        {"pert_mode": "add_noise", "handler_type": "check", "fuzz_stage": "forward"},
        peer_of="free benchmark: check, forward, add_noise",
    ),
]


def _prune_steps(out: Path, keep: int = 1) -> None:
    """Delete all but the newest ``keep`` step directories of every parent under ``out``:
    a dump of a 7B-wide layer writes several GB a step, and the rows time the writing,
    not the keeping. The newest is kept: the asynchronous writer may still be at it."""
    by_parent: dict[Path, list[tuple[int, Path]]] = {}
    for path in out.rglob("step*"):
        match = re.fullmatch(r"step(\d+)", path.name)
        if match and path.is_dir():
            by_parent.setdefault(path.parent, []).append((int(match.group(1)), path))
    for steps in by_parent.values():
        for _, path in sorted(steps)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


def _timed(trainer: Trainer, around: Any = None) -> float:
    start = time.perf_counter()
    if around is None:
        trainer.step()
    else:
        around(trainer.step)
    trainer.synchronize()
    return time.perf_counter() - start


# -- instrumented steps, one kind per runner ---------------------------------------------


class _ProbeSteps:
    """A probe session around each instrumented step, in a directory of its own: a
    session left open would trace the baseline steps too. Only the newest directory is
    kept (a dump of the 7B-wide layer writes several GB a step)."""

    def __init__(self, spec: dict[str, Any], trainer: Trainer, out: str) -> None:
        self.spec, self.model, self.out = spec, trainer.model, Path(out)
        self.calls = 0

    def __call__(self, step: Any) -> None:
        import probe

        run = self.out / f"session{self.calls}"
        # A session per step: the once-per-session parameter checksums of model= would be charged
        # to every step (benchmarks.checksums measures them on their own).
        options = {"checksums": False, **self.spec.get("options", {})}
        with probe.mode(self.spec["modes"], out=run, model=self.model, **options) as s:
            step()
            s.step()
        shutil.rmtree(self.out / f"session{self.calls - 1}", ignore_errors=True)
        self.calls += 1

    def close(self) -> None:
        pass


class _MsprobeSteps:
    """msprobe's PrecisionDebugger around each step: ``spec["task"]`` statistics or tensor
    (26.x), or a free_benchmark block (8.3.3, whose spec holds the block's keys)."""

    def __init__(self, spec: dict[str, Any], trainer: Trainer, out: str) -> None:
        from msprobe.pytorch import PrecisionDebugger

        task = spec.get("task", "free_benchmark")
        block = {"scope": [], "list": []}
        if task == "free_benchmark":
            block.update(
                fuzz_device="npu", fuzz_level="L1", if_preheat=False, preheat_step=15, max_sample=20, **spec
            )
        else:
            block.update(data_mode=["all"], summary_mode="statistics")
        config = {"task": task, "dump_path": out, "rank": [], "step": [], "level": "L1", task: block}
        path = Path(out) / "config.json"
        path.write_text(json.dumps(config))
        self.debugger = PrecisionDebugger(config_path=str(path))
        self.model = trainer.model

    def __call__(self, step: Any) -> None:
        self.debugger.start(self.model)
        step()
        self.debugger.stop()
        self.debugger.step()

    def close(self) -> None:
        pass


class _DebugModeSteps:
    def __init__(self, spec: dict[str, Any], trainer: Trainer, out: str) -> None:
        from torch.utils._debug_mode import DebugMode

        self._mode = DebugMode

    def __call__(self, step: Any) -> None:
        with self._mode():
            step()

    def close(self) -> None:
        pass


_RUNNERS = {
    "probe": _ProbeSteps,
    "msprobe": _MsprobeSteps,
    "msprobe-fb": _MsprobeSteps,
    "debugmode": _DebugModeSteps,
}


def child(workload: str, row_index: int, device: str, dtype: str, steps: int, quick: bool) -> dict[str, Any]:
    """One measurement in this process: the baseline (``row_index`` -1) or a row."""
    warnings.filterwarnings("ignore")
    work = workloads(quick)[workload]
    trainer = work.trainer(device, dtype)
    trainer.step()
    trainer.synchronize()
    if row_index < 0:
        times = [_timed(trainer) for _ in range(steps + 1)][1:]
        mean = statistics.fmean(times)
        peak, peak_source = peak_flops(device, dtype)
        flops = work.flops_per_step(trainer)
        return {
            "mean_s": mean,
            "min_s": min(times),
            "max_s": max(times),
            "memory_mb": peak_memory_mb(device),
            "throughput": work.units / mean,
            "unit": work.unit,
            "flops": flops,
            "mfu": flops / mean / peak,
            "peak": peak,
            "peak_source": peak_source,
        }
    row = ROWS[row_index]
    base_memory = peak_memory_mb(device)
    with tempfile.TemporaryDirectory() as out:
        runner = _RUNNERS[row.runner](row.spec, trainer, out)
        try:
            pairs = []
            for i in range(steps + 1):
                # Alternate which side goes first; the first pair warms the instrumented side up.
                if i % 2:
                    base, probed = _timed(trainer), _timed(trainer, runner)
                else:
                    probed, base = _timed(trainer, runner), _timed(trainer)
                pairs.append((base, probed))
                _prune_steps(Path(out))
        finally:
            runner.close()
    ratios = [p / b for b, p in pairs[1:]]
    return {
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "base_s": statistics.median(b for b, _ in pairs[1:]),
        "probed_s": statistics.median(p for _, p in pairs[1:]),
        "memory_ratio": peak_memory_mb(device) / base_memory,
    }


# -- the parent: runs the children, writes the report -------------------------------------


def _python_for(row: Row, pythons: dict[str, str | None]) -> str | None:
    if row.runner in pythons:
        return pythons[row.runner]
    if row.runner == "debugmode":
        try:
            from torch.utils._debug_mode import DebugMode  # noqa: F401
        except ImportError:
            return None
    return sys.executable


def _run_child(python: str, args: argparse.Namespace, workload: str, row: int, steps: int) -> dict[str, Any]:
    command = [
        python,
        "-m",
        "benchmarks.report",
        "--child",
        workload,
        str(row),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--steps",
        str(steps),
        *(["--quick"] if args.quick else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1][:160]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _default_python(variable: str, venv: str) -> str | None:
    for candidate in (os.environ.get(variable), str(REPO / venv / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _ratio(r: dict[str, Any] | None) -> tuple[str, str]:
    if r is None:
        return "", ""
    if "error" in r:
        return r["error"], ""
    return (
        f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})",
        f"{r['memory_ratio']:.2f}",
    )


def render(report: dict[str, Any]) -> str:
    """The markdown of a report's results (``results/<device>.json``)."""
    results = {(w, int(i)): r for w, i, r in report["results"]}
    names = report["workloads"]
    lines = [
        f"# Performance report: {report['device']}, {report['dtype']}",
        "",
        f"Machine: `{report['machine']}`.",
        f"Command: `{report['command']}`; {report['date']}.",
        "",
        f"Peers: {report['peers']}.",
        "",
        "## Baselines",
        "",
        "| workload | step time mean (min-max) | peak memory | throughput per device | MFU | peak used |",
        "|---|---|---:|---:|---:|---|",
    ]
    for w in names:
        r = results.get((w, -1), {"error": "not run"})
        if "error" in r:
            lines.append(f"| {w} | failed: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {w} | {1e3 * r['mean_s']:.1f} ms ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f}) "
            f"| {r['memory_mb']:.0f} MB | {r['throughput']:.1f} {r['unit']}/s | {100 * r['mfu']:.1f}% "
            f"| {r['peak'] / 1e12:.2f} TFLOP/s, {r['peak_source']} |"
        )
    lines += [
        "",
        "## Modes, with the peers beside them",
        "",
        "Step-time ratio to the same baseline, per alternated step pair: median (min-max); peak "
        "memory ratio. Peers ran in the same report, each in its own process. The seed column is "
        "msprobe on Ascend from the seed reports (not a side-by-side measurement). Our rows open a "
        "session around each instrumented step, so its set-up (run directory, writer thread) is in "
        "the ratio, as msprobe's start/stop around each step is in its.",
        "",
        "| workload | configuration | x step time | x memory | peer | peer x step time | peer x memory "
        "| seed (msprobe, Ascend) |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    peers = {row.peer_of: i for i, row in enumerate(ROWS) if row.peer_of}
    for w in names:
        for i, row in enumerate(ROWS):
            if row.peer_of or (w, i) not in results:
                continue
            ours = _ratio(results[(w, i)])
            peer = peers.get(row.label)
            theirs = _ratio(results.get((w, peer))) if peer is not None else ("", "")
            peer_name = ROWS[peer].runner_name if peer is not None and (w, peer) in results else ""
            lines.append(
                f"| {w} | {row.label} | {ours[0]} | {ours[1]} | {peer_name} | {theirs[0]} | "
                f"{theirs[1]} | {row.seed} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPE_MODES, default="fp32")
    parser.add_argument("--workloads", help="comma-separated (default: all)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (baseline) and step pairs (rows)")
    parser.add_argument(
        "--quick", action="store_true", help="two small workloads, one step pair per row (CI)"
    )
    parser.add_argument("--msprobe-python", default=None, help="Python with mindstudio-probe 26.x")
    parser.add_argument(
        "--msprobe-fb-python", default=None, help="Python with mindstudio-probe 8.3.3 (its free_benchmark)"
    )
    parser.add_argument("--out", help="markdown file (default: benchmarks/results/<device>.md, and .json)")
    parser.add_argument("--render", help="re-render the markdown of a results .json, run nothing")
    parser.add_argument(
        "--runners",
        help="run only the rows of these runners (probe, msprobe, msprobe-fb, "
        "debugmode); baselines always run",
    )
    parser.add_argument("--reuse", help="a results .json whose rows stand in for those not run now")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = 1 if args.quick else args.steps
    if args.child:
        result = child(args.child[0], int(args.child[1]), args.device, args.dtype, steps, args.quick)
        print(json.dumps(result))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())), end="")
        return 0
    available = workloads(args.quick)
    default = ["llama-small", "resnet50"] if args.quick else list(available)
    names = args.workloads.split(",") if args.workloads else default
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known: {list(available)}")
    pythons = {
        "msprobe": args.msprobe_python or _default_python("PROBE_MSPROBE_PYTHON", ".venv-msprobe"),
        "msprobe-fb": args.msprobe_fb_python
        or _default_python("PROBE_MSPROBE_FB_PYTHON", ".venv-msprobe-fb"),
    }
    jobs = [(w, -1) for w in names] + [
        (w, i) for w in names for i, row in enumerate(ROWS) if available[w].family in row.families
    ]
    results: list[tuple[str, int, dict[str, Any]]] = []
    if args.runners:
        runners = set(args.runners.split(","))
        reused = (
            {(w, int(i)): r for w, i, r in json.loads(Path(args.reuse).read_text())["results"]}
            if args.reuse
            else {}
        )
        for w, i in [(w, i) for w, i in jobs if i >= 0 and ROWS[i].runner not in runners]:
            if (w, i) in reused:
                results.append((w, i, reused[(w, i)]))
        jobs = [(w, i) for w, i in jobs if i < 0 or ROWS[i].runner in runners]
    with progress_bar(console) as progress:
        task = progress.add_task("report", total=len(jobs))
        for workload, row in jobs:
            progress.update(task, description=f"{workload}: {'baseline' if row < 0 else ROWS[row].label}")
            python = sys.executable if row < 0 else _python_for(ROWS[row], pythons)
            result = _run_child(python, args, workload, row, steps) if python else {"error": "not installed"}
            results.append((workload, row, result))
            progress.advance(task)
    peers = [f"{name} from {python}" for name, python in pythons.items() if python]
    report = {
        "device": args.device,
        "dtype": args.dtype,
        "machine": machine_line(args.device),
        "command": f"python -m benchmarks.report --device {args.device} --dtype {args.dtype}"
        f"{' --quick' if args.quick else ''} --steps {steps}"
        + (f" --runners {args.runners}" if args.runners else "")
        + (f" (other rows from {args.reuse})" if args.reuse else ""),
        "date": time.strftime("%Y-%m-%d"),
        "workloads": names,
        "results": results,
        "peers": "; ".join([*peers, "torch DebugMode"])
        if peers
        else "msprobe not installed; torch DebugMode",
    }
    text = render(report)
    out = (
        Path(args.out)
        if args.out
        else REPO / "benchmarks" / "results" / f"{torch.device(args.device).type}.md"
    )
    if not args.quick or args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        console.print(f"report written to {out} (results in {out.with_suffix('.json')})")
    console.print(text, markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
