"""The zoo: ``probe compare`` as a detector over every architecture of transformers' Auto mappings.

Run from the repository root::

    python -m benchmarks.zoo --task causal-lm --pairs bf16-autocast --faults none \\
        --markdown benchmarks/results/zoo-causal-lm-autocast-bf16.md [--archs llama,qwen3] [--limit N]
    python -m benchmarks.zoo --quick [--check]

Every architecture an Auto mapping lists for the task (``benchmarks.zoo_architectures``: causal
LM, masked LM, seq2seq LM, image and audio classification, and a small CNN with BatchNorm) is
built from its default config shrunk to a tiny size; those that do not build are listed with the
reason. Each case trains the model twice for a few AdamW steps under the stats mode, a reference
run A (fp32) and a run B, compares them with :func:`probe.compare` and scores the answer with
``benchmarks.diagnosis.judge``:

- **healthy pairs** (B differs only in how it computes; any divergence is a false alarm): fp32
  (B the same as A), bf16 autocast, fp16 autocast with a GradScaler (both runs scale), a bf16
  model, 1 thread instead of 2, eager attention instead of the default (SDPA) where both exist,
  ``torch.compile`` (traced with ``compiled="keep"``), gradients accumulated over 2 micro-batches
  of half the batch (not for models with BatchNorm: its statistics are the micro-batch's);
- **planted faults** (``benchmarks.zoo_faults``, at a seeded random eligible site, on top of the
  fp32 pair and of a mixed-precision pair in rotation): the answer is right when the first
  divergence is at the planted step, in the planted module, and the conclusion names it.

Targets: at most 1% false divergences over all healthy pairs, at least 95% of faults at their
module and step, no crash. The zoo runs in slices (a task, some pairs, some faults); each slice's
table goes to ``benchmarks/results/zoo-*.md``. ``--quick`` is a fixed-seed sample covering every
pair and fault kind on a few architectures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks import diagnosis
from benchmarks.diagnosis import Pair, Planted, _machine, _table, _threads, judge
from benchmarks.zoo_architectures import (
    TASKS,
    Architecture,
    Built,
    NotBuilt,
    architectures,
    build,
    first_line,
    loss_of,
)
from benchmarks.zoo_faults import KINDS, Fault, FaultKind, Policy, choose, plant

STEPS = 2
LR = 1e-3

PAIRS = {**diagnosis.PAIRS, **{p.name: p for p in [  # the matrix's pairs, and those only the zoo runs
    Pair("eager-attention", attn="eager"),
    Pair("compiled", compiled=True),
    Pair("accumulate-2", accumulate=2),
]}}
"""Run B's policies; run A is fp32, 2 threads, the architecture's default attention, eager."""
MIXED = ("bf16-autocast", "fp16-autocast", "bf16-model")
"""The mixed-precision pairs faults are planted on besides fp32 (one per architecture and
fault, in rotation)."""


@dataclass(frozen=True)
class Case:
    """One comparison: an architecture, run B's pair, and the fault planted in B (or None)."""

    arch: Architecture
    pair: str
    fault: str | None = None
    steps: int = STEPS
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.arch.task}/{self.arch.name}/{self.pair}/{self.fault or 'healthy'}"

    @property
    def kind(self) -> FaultKind | None:
        return KINDS[self.fault] if self.fault is not None else None

    @property
    def rng(self) -> random.Random:
        """The case's own random stream (the site, the step, delta): the same on every run."""
        return random.Random(zlib.crc32(f"{self.seed}/{self.label}".encode()))


@dataclass
class Outcome:
    case: Case
    ok: bool
    answer: str = ""
    expected: str = ""
    conclusion: str = ""
    site: str = ""
    """Where and what was planted ("" for a healthy pair)."""
    error: str | None = None
    """A crash of the case (the model, the probe or the compare), in one line."""
    skipped: str | None = None
    """Why the case does not apply (no eligible site, no second attention implementation)."""
    rule: str = ""
    op: str = ""
    module: str = ""
    seconds: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.case.fault is None


@dataclass
class ArchResult:
    arch: Architecture
    built: bool
    reason: str = ""
    params: int = 0
    outcomes: list[Outcome] = field(default_factory=list)


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Reference:
    """What run A shares with the cases it serves (one run A per value)."""

    attn: str | None
    clip: bool
    scaler: bool
    steps: int


def train(built: Built, pair: Pair, out: Path, steps: int, attn: str | None, clip: bool, scaler: bool,
          planting: Callable[[torch.nn.Module], Fault] | None = None, sketch: bool = True) -> Fault | None:
    """Trains ``built``'s model for ``steps`` AdamW steps under the stats mode (with sketches), computing as
    ``pair`` says (run A: the fp32 pair), with the fault ``planting`` plants in it. ``clip``: the
    gradients are clipped every step (without bound, but where the fault says); ``scaler``: both
    runs of a GradScaler pair scale their losses alike (run A's in fp32 never overflows);
    ``sketch``: whether the runs take sketches."""
    import probe

    policy = Policy(pair)
    model = policy.prepare(built.model(pair.attn or attn))
    fault = planting(model) if planting is not None else None
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    if pair.compiled:
        # What dynamo compiles depends on the process's history: a frame shared by models (a
        # transformers decorator's wrapper) past its recompile limit runs eagerly from then on,
        # and a worker's ninth architecture was no longer compiled at its top.
        torch._dynamo.reset()
    runner = torch.compile(model) if pair.compiled else model
    gen = torch.Generator().manual_seed(1)
    options: dict[str, Any] = {"compiled": "keep"} if pair.compiled else {}
    # Sketches: compare sees how far the runs' elements are apart where statistics cannot.
    with _threads(pair.threads), probe.mode("stats", out=str(out), model=model, sketch=sketch,
                                            **options) as session:
        for step in range(steps):
            batch = policy.cast(built.batch(gen))
            if fault is not None:
                with session.paused():  # switching the fault on is no op of the training
                    fault.before_step(model, step)
            parts = _micro_batches(batch, pair.accumulate)
            for part in parts:
                around = fault.around_loss() if fault is not None else contextlib.nullcontext()
                with policy.autocast(), around:
                    loss = loss_of(runner, part)
                loss = loss / len(parts) if len(parts) > 1 else loss
                (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
            if clip:
                if grad_scaler is not None:
                    grad_scaler.unscale_(opt)
                with session.paused():
                    bound = fault.max_norm(params, step) if fault is not None else math.inf
                torch.nn.utils.clip_grad_norm_(params, bound)
            if fault is not None:
                with session.paused():
                    fault.before_optimizer(opt, step)
            if grad_scaler is not None:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            session.step()
    return fault


def _micro_batches(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` split along its first dimension into ``parts`` equal micro-batches."""
    if parts == 1:
        return [batch]
    return [dict(zip(batch, values, strict=True)) for values in
            zip(*(v.chunk(parts) for v in batch.values()), strict=True)]


# --------------------------------------------------------------------------- cases


def applies(case: Case, built: Built) -> str | None:
    """Why ``case`` does not apply to ``built`` (None: it does)."""
    pair = PAIRS[case.pair]
    if pair.attn is not None and pair.attn not in built.attentions[1:]:
        return f"one attention implementation ({built.attentions[0]})"
    if pair.accumulate > 1 and built.has_batchnorm:
        return "BatchNorm: micro-batches normalise otherwise"
    return case.kind.not_applicable(pair) if case.kind is not None else None


def run_case(case: Case, built: Built, root: Path, references: dict[Reference, Path]) -> Outcome:
    """Records run B (and run A, once per reference) and judges the comparison."""
    import probe

    start = time.perf_counter()
    pair = PAIRS[case.pair]
    kind = case.kind
    not_applicable = applies(case, built)
    if not_applicable is not None:
        return Outcome(case, True, skipped=not_applicable)
    attn = kind.attn if kind is not None and kind.attn in built.attentions else None
    ref = Reference(attn, kind is not None and kind.clip, pair.scaler, case.steps)
    planted: Planted | None = None
    site = ""
    try:
        planting = None
        if kind is not None:
            chosen = choose(kind, built, pair, case.rng, case.steps)
            if isinstance(chosen, str):
                return Outcome(case, True, skipped=chosen, seconds=time.perf_counter() - start)
            where, seed = chosen
            site = where or "<outside modules>"

            def planting(model: torch.nn.Module) -> Fault:
                return plant(kind, model, where, random.Random(seed), pair, case.steps)
        if ref not in references:
            out_a = Path(tempfile.mkdtemp(prefix="a", dir=root))
            train(built, PAIRS["fp32"], out_a, case.steps, ref.attn, ref.clip, ref.scaler)
            references[ref] = out_a  # only once whole: a crash in run A is its cases' crash
        out_b = Path(tempfile.mkdtemp(prefix="b", dir=root))
        fault = train(built, pair, out_b, case.steps, ref.attn, ref.clip, ref.scaler, planting)
        if fault is not None:
            planted = fault.planted
            site = f"step {planted.step} {fault.site or '<outside modules>'} {fault.detail}"
        report = probe.compare(references[ref], out_b)
    except Exception as e:  # a crash is an outcome of the benchmark, reported per case
        own = _fails_without_probe(built, pair)
        if own is not None:  # the model's own failure under B's policy is no crash of the probe
            return Outcome(case, True, skipped=f"the model fails under {case.pair} without the probe: {own}",
                           seconds=time.perf_counter() - start)
        return Outcome(case, False, site=site, error=first_line(e), seconds=time.perf_counter() - start)
    answer = judge(report, planted)
    d = report.divergence
    ok = not answer.found if planted is None else answer.found
    own = _fails_without_probe(built, pair) if not ok else None
    if own is not None:
        # A pair the model itself breaks is no pair: not applicable, healthy or with a fault
        # (whose answer is the model's own failure first: LongT5's local attention under fp16).
        return Outcome(case, True, skipped=f"the model fails under {case.pair} without the probe: {own}",
                       seconds=time.perf_counter() - start)
    if kind is None or kind.name == "overflow":  # a fault of another kind may overflow for real
        wrong_origin = _nonfinite_misplaced(out_b, planted)
        if wrong_origin is not None:
            ok = False
            answer = replace(answer, answer=f"{answer.answer}; {wrong_origin}")
    return Outcome(case, ok, answer.answer, answer.expected, answer.conclusion, site,
                   rule=d.rule if d is not None else "", op=d.op.name if d is not None else "",
                   module=d.op.module if d is not None else "", seconds=time.perf_counter() - start)


def _nonfinite_misplaced(run: Path, overflow: Planted | None) -> str | None:
    """What is wrong with ``Run.first_nonfinite()`` of run B (a healthy run, or one with an
    ``overflow`` planted), in a few words; None when it is right: None on a healthy run (a mask's
    ``-inf``, read or not, is no fault), the planted module's op at the planted step on a run
    with an overflow."""
    import probe

    origin = probe.Run(run).first_nonfinite()
    if origin is None:
        return None if overflow is None else "first_nonfinite: none"
    if overflow is not None and origin.step == overflow.step \
            and diagnosis.inside(origin.module, overflow.module):
        return None
    return f"first_nonfinite: step {origin.step} {origin.module or '<outside modules>'} {origin.name}"


def _fails_without_probe(built: Built, pair: Pair) -> str | None:
    """Why ``built``'s model fails its first forward under ``pair``'s policy with no probe
    around it (DeBERTa's attention fills bf16 scores with float32's minimum under autocast), or
    gives a non-finite loss or gradient (unscaled), in one line; None when it runs to finite ones."""
    policy = Policy(pair)
    try:
        model = policy.prepare(built.model(pair.attn))
        loss = policy.loss(built, model, grad=True)
        loss.backward()
    except Exception as e:  # the model's own error, reported as the reason the case does not apply
        return first_line(e)
    if not torch.isfinite(loss).all():
        return f"its loss is {loss.float().item():g} on the first batch"
    # LongT5's -1e10 position-bias mask overflows fp16 scores to -inf, whole rows of it make the
    # softmax NaN and every gradient with it: no run of that policy trains (a GradScaler skips
    # every step), and what the probe names is that overflow.
    bad = next((name for name, p in model.named_parameters()
                if p.grad is not None and not torch.isfinite(p.grad).all()), None)
    return None if bad is None else f"the gradient of {bad} is not finite on the first batch"


def cases_for(arch: Architecture, pairs: Iterable[str], faults: Iterable[str], steps: int,
              fault_pairs: Iterable[str] | None = None) -> list[Case]:
    """The healthy pairs, then each fault on the fp32 pair and on a mixed-precision pair chosen
    (seeded) for this architecture and fault, or on each of ``fault_pairs`` where given."""
    cases = [Case(arch, p, None, steps) for p in pairs]
    for fault in faults:
        mixed = MIXED[zlib.crc32(f"{arch.name}/{fault}".encode()) % len(MIXED)]
        on = list(fault_pairs) if fault_pairs is not None else ["fp32", mixed]
        cases += [Case(arch, pair, fault, steps) for pair in on]
    return cases


QUICK = [
    ("causal-lm", "llama", ["fp32", "bf16-autocast", "fp16-autocast", "eager-attention"],
     [("scale-output", "bf16-autocast"), ("cast-matmul", "fp32"), ("cast-matmul", "bf16-autocast"),
      ("cast-softmax", "fp32"),
      ("mask-shift", "fp32"), ("bitflip-exponent", "bf16-autocast")]),
    ("causal-lm", "gpt2", ["threads-1", "accumulate-2"],
     [("bitflip-mantissa", "fp32"), ("eps", "fp32"), ("loss-bf16", "bf16-autocast"),
      ("overflow", "fp16-autocast"), ("scale-output", "accumulate-2")]),
    ("masked-lm", "bert", ["bf16-model"], [("dropout", "fp32"), ("cast-norm", "bf16-autocast")]),
    ("image-classification", "vit", ["bf16-autocast"], [("clip", "fp32")]),
    ("cnn", "cnn-batchnorm", ["compiled", "bf16-autocast"], [("cast-norm", "fp32")]),
]
"""The fixed sample ``--quick`` runs: every pair kind and every fault kind at least once, over
the tasks, on architectures that build (and ``cast-matmul`` under bf16 autocast, a case the table
lists as not applicable; a fault in micro-batches, which compare folds into one batch)."""


def quick_cases(steps: int) -> dict[Architecture, list[Case]]:
    by_arch: dict[Architecture, list[Case]] = {}
    for task, name, pairs, faults in QUICK:
        arch = next(a for a in architectures(task) if a.name == name)
        by_arch[arch] = [Case(arch, p, None, steps) for p in pairs] + \
            [Case(arch, p, f, steps) for f, p in faults]
    return by_arch


def run_cases(arch: Architecture, cases: list[Case]) -> ArchResult:
    """Builds ``arch`` and runs ``cases`` on it (in a temporary directory of their own)."""
    import logging

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    built = build(arch)
    if isinstance(built, NotBuilt):
        return ArchResult(arch, False, built.reason)
    result = ArchResult(arch, True, params=built.params)
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        references: dict[Reference, Path] = {}
        for case in cases:
            result.outcomes.append(run_case(case, built, Path(tmp), references))
    return result


# --------------------------------------------------------------------------- report


def summarise(results: list[ArchResult]) -> dict[str, Any]:
    outcomes = [o for r in results for o in r.outcomes if o.skipped is None]
    healthy = [o for o in outcomes if o.healthy]
    faults = [o for o in outcomes if not o.healthy]
    crashes = [o for o in outcomes if o.error is not None]
    return {
        "architectures": len(results), "built": sum(r.built for r in results),
        "healthy": len(healthy), "false_divergences": sum(not o.ok for o in healthy if o.error is None),
        "faults": len(faults), "found": sum(o.ok for o in faults),
        "crashes": len(crashes), "skipped": sum(o.skipped is not None for r in results for o in r.outcomes),
    }


def met(totals: dict[str, Any]) -> bool:
    """The zoo's targets: <= 1% false divergences, >= 95% of faults found, no crash."""
    healthy_ok = totals["false_divergences"] <= 0.01 * totals["healthy"]
    faults_ok = totals["faults"] == 0 or totals["found"] >= 0.95 * totals["faults"]
    return healthy_ok and faults_ok and totals["crashes"] == 0


def _column(o: Outcome) -> str:
    return o.case.pair if o.healthy else f"{o.case.fault}@{o.case.pair}"


CELLS = ("ok", "DIV", "found", "MISS", "crash", "-")


def _cell(o: Outcome) -> str:
    if o.skipped is not None:
        return "-"
    if o.error is not None:
        return "crash"
    if o.healthy:
        return "ok" if o.ok else "DIV"
    return "found" if o.ok else "MISS"


def _where(module: str) -> str:
    """A module FQN without its indices, its last two names: the part of the model it is."""
    if not module:
        return "<outside modules>"
    return ".".join(re.sub(r"\.\d+(?=\.|$)", "", module).split(".")[-2:])


def breakdown(results: list[ArchResult]) -> list[str]:
    """The false divergences of the healthy pairs: counted by pair, rule, op and module, then
    each one (markdown lines)."""
    false = [o for r in results for o in r.outcomes if o.healthy and o.skipped is None and not o.ok
             and o.error is None]
    lines = [f"## False divergences: {len(false)}", ""]
    if not false:
        return lines
    for title, key in (("pair", lambda o: o.case.pair), ("rule", lambda o: o.rule or "(conclusion only)"),
                       ("op", lambda o: o.op.removeprefix("aten.") or "-"),
                       ("module", lambda o: _where(o.module)),
                       ("step", lambda o: str(o.answer.split()[1]) if o.answer.startswith("step") else "-")):
        counts = Counter(key(o) for o in false)
        lines += [f"By {title}: " + ", ".join(f"{k} {n}" for k, n in counts.most_common()), ""]
    lines += ["| architecture | pair | answer | conclusion |", "|---|---|---|---|"]
    lines += [f"| {o.case.arch.name} | {o.case.pair} | {_md(o.answer)} | {_md(o.conclusion[:200])} |"
              for o in false]
    return [*lines, ""]


def by_kind(results: list[ArchResult]) -> list[str]:
    """Each pair and fault kind over the architectures: how many right of how many that applied
    (markdown lines)."""
    counts: dict[str, list[int]] = {}
    for o in (o for r in results for o in r.outcomes if o.skipped is None):
        right = counts.setdefault(_column(o), [0, 0])
        right[0] += o.ok and o.error is None
        right[1] += 1
    if not counts:
        return []
    lines = ["## By pair and fault", "", "| pair or fault@pair | right | of |", "|---|---|---|"]
    lines += [f"| {name} | {right} | {n} |" for name, (right, n) in sorted(counts.items())]
    return [*lines, ""]


def _md(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "probe"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return head + (" with uncommitted changes under probe/" if dirty else "")


def report(results: list[ArchResult], console: Console | None, markdown: Path | None, command: str,
           seconds: float, planned: int | None = None) -> dict[str, Any]:
    """Prints and writes the tables: totals, one row per architecture (a column per pair and
    fault), the false divergences broken down, the misses, crashes, what did not build, and
    every case. ``planned``: the architectures of a run still going."""
    totals = summarise(results)
    columns = list(dict.fromkeys(_column(o) for r in results for o in r.outcomes))
    rows = []
    for r in results:
        if not r.built:
            continue
        cells = {_column(o): _cell(o) for o in r.outcomes}
        rows.append([f"{r.arch.task}/{r.arch.name}", f"{r.params / 1e3:.0f}k",
                     *(cells.get(c, "") for c in columns)])
    header = ["architecture", "params", *columns]
    summary = (f"{totals['built']} of {totals['architectures']} architectures built; healthy pairs: "
               f"{totals['false_divergences']} false divergences of {totals['healthy']}; faults: "
               f"{totals['found']} of {totals['faults']} found at their module and step; "
               f"{totals['crashes']} crashes; {totals['skipped']} cases not applicable")
    misses = [o for r in results for o in r.outcomes if not o.healthy and not o.ok]
    crashes = [o for r in results for o in r.outcomes if o.error is not None]
    not_built = [r for r in results if not r.built]
    if console is not None:
        counts = [[f"{r.arch.task}/{r.arch.name}", *(str(sum(_cell(o) == c for o in r.outcomes))
                                                      for c in CELLS)] for r in results if r.built]
        console.print(_table("Zoo (cases per answer)", counts, ["architecture", *CELLS]))
        wrong = [[o.case.label, o.site, o.error or o.answer] for o in misses + crashes]
        if wrong:
            console.print(_table("Faults missed, crashes", wrong, ["case", "planted", "answer"]))
        console.print(summary)
    if markdown is not None:
        lines = ["# The zoo", "", f"`{command}`: {len(results)} architectures"
                 + (f" (in progress: {len(results)} of {planned})" if planned else "")
                 + f" in {seconds:.0f} s on {_machine()}, probe at {_commit()}.", "",
                 "Targets: at most 1% false divergences over the healthy pairs; at least 95% of planted "
                 "faults named at their module and step; no crash.", "", f"**{summary}.**", "",
                 "Cells: ok / DIV (a healthy pair called divergent), found / MISS (a fault), crash, "
                 "- (not applicable: why under Every case).", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", *by_kind(results), *breakdown(results)]
        if misses:
            lines += [f"## Faults missed: {len(misses)}", "", "| case | planted | expected | answer |",
                      "|---|---|---|---|"]
            lines += [f"| {o.case.label} | {_md(o.site)} | {o.expected} | {_md(o.error or o.answer)} |"
                      for o in misses]
            lines += [""]
        if crashes:
            lines += [f"## Crashes: {len(crashes)}", "", "| case | error |", "|---|---|"]
            lines += [f"| {o.case.label} | {_md(o.error or '')} |" for o in crashes] + [""]
        lines += [f"## Not built: {len(not_built)}", "", "| architecture | class | reason |", "|---|---|---|"]
        lines += [f"| {r.arch.task}/{r.arch.name} | {r.arch.class_name} | {_md(r.reason)} |"
                  for r in not_built]
        lines += ["", "## Every case", "", "| case | planted | answer | seconds |", "|---|---|---|---|"]
        lines += [f"| {o.case.label} | {_md(o.site)} | {_md(o.skipped or o.error or o.answer)} "
                  f"| {o.seconds:.1f} |" for r in results for o in r.outcomes]
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text("\n".join(lines) + "\n")
    return totals


# --------------------------------------------------------------------------- command line


def _names(value: str, known: Iterable[str], what: str, parser: argparse.ArgumentParser) -> list[str]:
    known = list(known)
    if value == "all":
        return known
    if value == "none":
        return []
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="causal-lm", help=f"one of {', '.join(TASKS)}, or all")
    parser.add_argument("--pairs", default="all", help="healthy pairs, comma-separated, all or none")
    parser.add_argument("--faults", default="all", help="fault kinds, comma-separated, all or none")
    parser.add_argument("--fault-on", default=None,
                        help="plant the faults on these pairs (comma-separated) instead of fp32 and a "
                             "mixed-precision pair in rotation")
    parser.add_argument("--archs", default=None, help="only these model types (comma-separated)")
    parser.add_argument("--from", dest="start", default=None,
                        help="start at this model type (in the listing's order): a slice, or a run resumed")
    parser.add_argument("--limit", type=int, default=None, help="only the first N architectures")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--jobs", type=int, default=1, help="architectures run in parallel processes")
    parser.add_argument("--quick", action="store_true", help="the fixed sample covering every pair and fault")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables there too")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--resume", action="store_true",
                        help="keep the architectures in the --markdown table's .jsonl, run the rest")
    args = parser.parse_args(argv)
    if args.resume and args.markdown is None:
        parser.error("--resume continues the run of a --markdown table: name it")
    warnings.filterwarnings("ignore")
    if args.quick:
        plan = quick_cases(args.steps)
    else:
        tasks = _names(args.task, TASKS, "task", parser)
        pairs = _names(args.pairs, PAIRS, "pair", parser)
        faults = _names(args.faults, KINDS, "fault", parser)
        archs = [a for t in tasks for a in architectures(t)]
        if args.archs is not None:
            wanted = set(args.archs.split(","))
            archs = [a for a in archs if a.name in wanted]
            if not archs:
                parser.error(f"no architecture of {args.task} is named {args.archs}")
        if args.start is not None:
            names = [a.name for a in archs]
            if args.start not in names:
                parser.error(f"--from {args.start}: no such architecture of {args.task}")
            archs = archs[names.index(args.start):]
        archs = archs[: args.limit] if args.limit is not None else archs
        fault_pairs = _names(args.fault_on, PAIRS, "pair", parser) if args.fault_on is not None else None
        plan = {a: cases_for(a, pairs, faults, args.steps, fault_pairs) for a in archs}
    command = "python -m benchmarks.zoo " + " ".join(argv if argv is not None else sys.argv[1:])
    console = Console()
    results: list[ArchResult] = []
    planned = len(plan)
    saved = args.markdown.with_suffix(".jsonl") if args.markdown is not None else None
    if saved is not None and args.resume and saved.exists():
        results = [r for r in load_results(saved) if r.arch in plan]
        plan = {a: c for a, c in plan.items() if a not in {r.arch for r in results}}
    elif saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text("")
    start = time.perf_counter()
    from rich.progress import Progress

    def done(result: ArchResult) -> None:
        results.append(result)
        if saved is not None:  # a run killed half way resumes from here (--resume)
            with saved.open("a") as f:
                f.write(json.dumps(result_record(result)) + "\n")
        for o in result.outcomes:
            if not o.ok:
                console.print(f"[red]{_cell(o)}[/red] {o.case.label}: {o.site} expected {o.expected}, "
                              f"got {o.error or o.answer}")
        if args.markdown is not None:  # a long run leaves its part
            report(sorted(results, key=_order), None, args.markdown, command, time.perf_counter() - start,
                   planned)

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("architectures", total=len(plan))
        if args.jobs <= 1:
            for arch, cases in plan.items():
                progress.update(task, description=arch.name)
                done(run_cases(arch, cases))
                progress.advance(task)
        else:
            import multiprocessing

            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [pool.submit(run_cases, arch, cases) for arch, cases in plan.items()]
                for future in as_completed(futures):
                    done(future.result())
                    progress.advance(task)
    results.sort(key=_order)
    totals = report(results, console, args.markdown, command, time.perf_counter() - start)
    return 1 if args.check and not met(totals) else 0


def result_record(result: ArchResult) -> dict[str, Any]:
    """``result`` as JSON (a line of the table's ``.jsonl``)."""
    record = asdict(result)
    for outcome in record["outcomes"]:
        del outcome["case"]["arch"]
    return record


def load_results(path: Path) -> list[ArchResult]:
    """The architectures a run recorded in ``path`` (``result_record`` lines), in its order."""
    results = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        arch = Architecture(**record.pop("arch"))
        outcomes = []
        for o in record.pop("outcomes"):
            case = Case(arch, **o.pop("case"))
            outcomes.append(Outcome(case, **o))
        results.append(ArchResult(arch, outcomes=outcomes, **record))
    return results


def _order(result: ArchResult) -> tuple[str, str]:
    return result.arch.task, result.arch.name


if __name__ == "__main__":
    sys.exit(main())
