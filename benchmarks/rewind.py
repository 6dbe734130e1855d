"""Rewind: the cost of keeping each step's start, and the right-label rate over planted faults.

Run from the repository root::

    python -m benchmarks.rewind [--seeds 5] [--steps 30] [--every 1,4] \
        [--markdown benchmarks/results/rewind.md]

**Cost.** The demo model (``probe.demo``) at two sizes trains with and without what
``session.step_fn`` adds to a step (``StepStart.keep``: the host copy of parameters, buffers,
optimizer state, RNGs and batch; with ``keep_every=N`` (``--every``) that copy every N steps and
each step's boundary and batch (``probe.rewind.interval``); then the loss held and the one-sync
finiteness check of the loss and parameters), steps alternating so both see the same machine; the
median wall and process-CPU time per step, and the host bytes kept against one copy of parameters +
buffers + optimizer state (+ the batches kept: two, or N + 1). The labels are measured at each
``--every`` too.

**Labels.** Per seed and kind, the demo model (a wrapper adding the planted fault) trains until two
steps after the bad step ``k = 1 + seed % 3`` under ``probe.mode("monitor")`` with
``session.step_fn``; the non-finite step is rewound on its own. Kinds: *transient*, bit 30 of one
element of ``layers.<l>.mlp.up_proj``'s output (one in [1, 2), which the flip makes inf) flipped
once at step k by a forward hook, out of sight of the probe (no op made it), right when its cause is
*hardware*; *non-determinism*, ``up_proj``'s output plus 1e-3 times a forward counter held outside
the model (even seeds: always, the program's non-determinism; odd seeds: only while torch's
deterministic algorithms are off, a kernel's), step k rewound by ``session.rewind()``, right when the
transient verdict's cause is that one and the first op differing between the reruns is in
``layers.<l>.mlp``; *precision*, the fp16
model (AdamW eps 1e-4, fp16's smallest normal being above 1e-8) whose ``layers.<l>.mlp.up_proj``
weight was scaled x1e5 before step k, its activations past fp16's 65504; *data*, sample j's loss
weight set to inf in batch k; *code*, the loss scaled by ``sqrt(k - 0.5 - calls)`` with ``calls`` a
buffer the wrapper counts forwards in. A case counts as right when the verdict is the kind and it
names the right place: the transient's first differing op in ``layers.<l>`` (this needs the original
traced: the session is ``probe.mode("stats")`` for that kind), the precision's first non-finite op
in ``layers.<l>.mlp``, the data's sample j, the code's ``aten.sqrt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import probe
from benchmarks.overhead import machine_line
from probe.demo.model import LlamaConfig, TinyLlama, synthetic_batch
from probe.rewind import StepStart, nonfinite_after_step
from probe.rewind.interval import KeptSteps

KINDS = ("transient", "non-determinism", "precision", "data", "code")
EVERY = (1, 4)
"""``keep_every`` of the cost table: the whole state copied every step, or every fourth."""
SIZES = {
    "demo (hidden 64, 2 layers, batch 4x32)": (LlamaConfig(), 4, 32),
    "hidden 256, 4 layers, batch 4x128": (LlamaConfig(hidden_size=256, intermediate_size=688, num_layers=4,
                                                      max_seq_len=128), 4, 128),
}


class Planted(nn.Module):
    """The demo model with a per-sample loss weight and a forward counter (the code fault's clock)."""

    def __init__(self, config: LlamaConfig, code_fault_at: int | None = None) -> None:
        super().__init__()
        self.model = TinyLlama(config)
        self.code_fault_at = code_fault_at
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1]).float()
        per_token = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss = (per_token.mean(1) * weights.float()).mean()
        if self.code_fault_at is not None:  # a schedule whose square root goes negative at step k
            loss = loss * torch.sqrt(self.code_fault_at - 0.5 - self.calls)
        with torch.no_grad():
            self.calls += 1
        return loss


def _batches(config: LlamaConfig, batch: int, seq: int, steps: int,
             seed: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [(synthetic_batch(config, batch, seq, generator), torch.ones(batch)) for _ in range(steps)]


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[tuple], torch.Tensor]:
    """The ``fn`` of ``session.step_fn``: forward, backward, update; returns the loss."""

    def fn(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        return loss

    return fn


# -- cost -------------------------------------------------------------------------------


def measure_cost(config: LlamaConfig, batch: int, seq: int, steps: int, every: int = 1) -> dict[str, float]:
    """Plain steps alternating with kept ones (what ``step_fn`` adds: the start kept, whole every
    ``every`` kept steps, the loss held for a replay, the finiteness check)."""
    torch.manual_seed(0)
    model = Planted(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _batches(config, batch, seq, 2 * steps + 4, 0)

    fn = training_step(model, optimizer)
    start = StepStart(model, optimizer)
    interval = KeptSteps(start, every) if every > 1 else None
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "kept": []}
    for index, b in enumerate(data):
        kept = index % 2 == 1
        wall, cpu = time.perf_counter(), time.process_time()
        if kept and interval is not None:
            interval.keep(index // 2, b, fn)  # the kept steps numbered apart from the plain ones
        elif kept:
            start.keep(index, b)
        loss = fn(b)
        if kept:
            held = loss.detach().clone()
            if interval is not None:
                interval.ran(index // 2, held)
            nonfinite_after_step(loss, start.parameters)
        else:
            loss.item()  # the plain loop reads its loss too (a logged loss): the same one sync
        if index >= 4:  # warm-up
            times["kept" if kept else "plain"].append((time.perf_counter() - wall, time.process_time() - cpu))
    state = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    state += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    batch_bytes = sum(t.numel() * t.element_size() for t in data[0])

    def median(kind: str, column: int) -> float:
        return statistics.median(t[column] for t in times[kind])

    return {
        "plain_ms": 1e3 * median("plain", 0), "kept_ms": 1e3 * median("kept", 0),
        "plain_cpu_ms": 1e3 * median("plain", 1), "kept_cpu_ms": 1e3 * median("kept", 1),
        "kept_mb": (interval or start).nbytes() / 2**20, "state_mb": state / 2**20,
        "batch_kb": batch_bytes / 2**10,
    }


# -- labels -------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    kind: str
    seed: int
    verdict: str
    named: str
    right: bool
    seconds: float
    every: int = 1


def run_case(kind: str, seed: int, out: Path, every: int = 1) -> Case:
    config, batch, seq = LlamaConfig(), 4, 32
    bad = 1 + seed % 3
    layer = seed % config.num_layers
    sample = seed % batch
    torch.manual_seed(seed)
    model = Planted(config, code_fault_at=bad if kind == "code" else None)
    dtype = torch.float16 if kind == "precision" else torch.float32
    model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4 if dtype == torch.float16 else 1e-8)
    data = _batches(config, batch, seq, bad + 2, seed)
    if kind == "data":
        data[bad][1][sample] = float("inf")
    calls = []
    if kind == "non-determinism":
        # Even seeds: the program's (a value from a global counter, every run different); odd seeds:
        # a kernel's (the same, only while torch's deterministic algorithms are off).
        kernel_like = seed % 2 == 1
        forwards = [0]

        def counter(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            forwards[0] += 1
            if kernel_like and torch.are_deterministic_algorithms_enabled():
                return output
            return output + 1e-3 * forwards[0]

        model.model.layers[layer].mlp.up_proj.register_forward_hook(counter)
    if kind == "transient":
        def flip_once(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            calls.append(1)
            if len(calls) == bad + 1:
                from probe.tracer.mode_stack import untraced

                with untraced():  # out of sight: no op of the program made it
                    flat = output.detach().reshape(-1)
                    # Bit 30 of a value in [1, 2) is the exponent's top bit: the flip makes it inf. A
                    # flip that leaves a finite value may never show (see docs/rewind.md): not planted.
                    candidates = ((flat.abs() >= 1) & (flat.abs() < 2)).nonzero().reshape(-1)
                    index = (int(candidates[seed % len(candidates)]) if len(candidates)
                             else int(flat.abs().argmax()))
                    flat.view(torch.int32)[index] ^= 1 << 30

        model.model.layers[layer].mlp.up_proj.register_forward_hook(flip_once)

    fn = training_step(model, optimizer)
    began = time.perf_counter()
    traced = kind in ("transient", "non-determinism")  # the op that differed is named from the traces
    modes: dict[str, Any] = ({"modes": "stats"} if traced else
                             {"modes": "monitor", "targets": ["model.layers.?"]})
    with probe.mode(**modes, out=out, model=model) as session:
        for step, b in enumerate(data):
            if kind == "precision" and step == bad:
                with torch.no_grad():
                    model.model.layers[layer].mlp.up_proj.weight.mul_(1e5)
            session.step_fn(fn, b, optimizer=optimizer, keep_every=every)
            if kind == "non-determinism" and step == bad:
                session.rewind()  # the user's call: nothing non-finite, the step merely suspect
    verdicts = probe.rewind.read_verdicts(out)
    seconds = time.perf_counter() - began
    if not verdicts:
        return Case(kind, seed, "no rewind", "-", False, seconds, every)
    verdict = verdicts[0]
    located = verdict.located or {}
    named = (f"samples {verdict.samples}" if kind == "data" else
             f"{located.get('name', '-')} in {located.get('module', '-')}")
    if verdict.cause is not None:
        named += f" ({verdict.cause})"
    cause = {"transient": "hardware",
             "non-determinism": "non-determinism (kernel)" if seed % 2 else "non-determinism (program)"}
    place = {
        "transient": (f"model.layers.{layer}" in located.get("module", "")
                      and verdict.cause == cause.get(kind)),
        "non-determinism": (f"model.layers.{layer}.mlp" in located.get("module", "")
                            and verdict.cause == cause.get(kind)),
        "precision": f"model.layers.{layer}.mlp" in located.get("module", ""),
        "data": verdict.samples == [sample],
        "code": located.get("name") == "aten.sqrt.default",
    }[kind]
    right = verdict.verdict == ("transient" if kind == "non-determinism" else kind) and verdict.step == bad
    return Case(kind, seed, verdict.verdict, named, right and place, seconds, every)


# -- report -------------------------------------------------------------------------------


def report(costs: dict[tuple[str, int], dict[str, float]], cases: list[Case]) -> str:
    lines = ["# Rewind: cost of keeping the start, right-label rate", "",
             f"`python -m benchmarks.rewind` ({machine_line()}; load average {_load()} on a machine shared "
             "with other jobs: the process-CPU column is the steadier one).", "",
             "## Keeping each step's start (CPU)", "",
             "| model | whole copy every | step ms plain | step ms kept | wall ratio | CPU ms plain "
             "| CPU ms kept | CPU ratio | kept MB | params+buffers+optimizer MB | batch KB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (name, every), c in costs.items():
        lines.append(f"| {name} | {every} | {c['plain_ms']:.2f} | {c['kept_ms']:.2f} "
                     f"| {c['kept_ms'] / c['plain_ms']:.3f} | {c['plain_cpu_ms']:.2f} "
                     f"| {c['kept_cpu_ms']:.2f} "
                     f"| {c['kept_cpu_ms'] / c['plain_cpu_ms']:.3f} | {c['kept_mb']:.2f} "
                     f"| {c['state_mb']:.2f} | {c['batch_kb']:.1f} |")
    lines += ["", "## Right label over planted faults (demo model, CPU)", "",
              "| kind | whole copy every | right | verdicts | named (seed 0) | seconds per case (median) |",
              "| --- | ---: | ---: | --- | --- | ---: |"]
    for kind, every in dict.fromkeys((c.kind, c.every) for c in cases):
        mine = [c for c in cases if (c.kind, c.every) == (kind, every)]
        verdicts = ", ".join(sorted({c.verdict for c in mine}))
        lines.append(f"| {kind} | {every} | {sum(c.right for c in mine)}/{len(mine)} | {verdicts} "
                     f"| {mine[0].named} | {statistics.median(c.seconds for c in mine):.1f} |")
    wrong = [c for c in cases if not c.right]
    listed = "; ".join(f"{c.kind} seed {c.seed} every {c.every}: {c.verdict} ({c.named})" for c in wrong)
    lines += ["", "Wrong: " + (listed or "none"), ""]
    return "\n".join(lines)


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per side of the cost table")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--kinds", default=",".join(KINDS), help="planted kinds, comma-separated")
    parser.add_argument("--every", type=lambda text: [int(n) for n in text.split(",")], default=list(EVERY),
                        help="keep_every values of the cost table, comma-separated")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    costs = {(name, every): measure_cost(config, batch, seq, args.steps, every)
             for name, (config, batch, seq) in SIZES.items() for every in args.every}
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            for every in args.every:
                for seed in range(args.seeds):
                    cases.append(run_case(kind, seed, Path(tmp) / f"{kind}-{every}-{seed}", every))
                print(cases[-1], file=sys.stderr)
    text = report(costs, cases)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
