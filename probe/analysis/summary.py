"""What ``probe summary`` reports for each (step, rank) of a run, one step at a time.

:func:`summarize` yields step by step and decodes only the ops a step summary names, so
summarizing a run of any length holds a few steps in memory (the run's cache).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from probe.analysis.bookkeeping import model_outputs
from probe.analysis.mode_records import Alert, Check, NonfiniteParameters
from probe.errors import ProbeError
from probe.rewind.verdict import read_verdicts
from probe.rundir import layout
from probe.rundir.loss_scaler import ScalerStep, handled_by_scaler
from probe.rundir.nonfinite_origins import nonfinite_origins_in
from probe.rundir.records import TensorRecord
from probe.rundir.run import OpRecord, Run
from probe.rundir.step_section import StepSection
from probe.rundir.untrusted_reads import expect, reading

MASK_FRACTION = 0.5
"""An output whose largest magnitude reaches this fraction of its dtype's largest finite value
is a fill (an attention mask of ``finfo.min``, or what adding one gives), not a magnitude."""


@dataclass
class Extreme:
    op: OpRecord
    value: float


@dataclass
class StepSummary:
    step: int
    rank: int
    complete: bool
    reason: str | None
    phase_counts: dict[str, int]
    has_stats: bool
    first_nonfinite: OpRecord | None
    largest_abs_max: list[Extreme]
    largest_norm: list[Extreme]
    check_counts: dict[str, int]
    """Free-benchmark verdicts (empty without that mode)."""
    failed_checks: list[Check]
    """The failed checks, worst (largest deviation over its bound) first."""
    nonfinite_parameters: NonfiniteParameters | None = None
    """Parameters non-finite at the step's start, gradients before its optimizer step (stats mode)."""
    sections: dict[str, StepSection] = field(default_factory=dict)
    """Mode name -> what its reader says of the step (``probe.rundir.step_section``), for the
    modes that say something, in the manifest's order."""
    anomalies: list[Alert] = field(default_factory=list)
    unmeasured: int = 0
    """Tensors recorded without statistics, their memory freed before it was read (stats mode)."""
    loss_scaler: ScalerStep | None = None
    """What ``GradScaler`` did in the step (stats mode; None without a scaler)."""
    overflow_handled: bool = False
    """The step's non-finite values are a gradient overflow the loss scaler handled: it skipped
    the step (see :func:`probe.rundir.loss_scaler.handled_by_scaler`); no fault of the model."""
    untraced_threads: dict[str, int] = field(default_factory=dict)
    """Thread name -> module and optimizer calls that ran there unseen by the dispatch mode (it
    is per thread): the step's records lack their ops (the manifest's ``untraced_threads``)."""
    mode_failures: dict[str, str] = field(default_factory=dict)
    """Mode name -> where its per-op work raised and what: the probe detached it there so that
    training went on, and the step holds none of its data from that op on (the manifest's
    ``mode_failures``)."""
    unreadable: str | None = None
    """Why the step could not be read (a damaged file, named): it is reported and skipped, the
    other fields are empty. None for a step that was read."""

    @classmethod
    def of_unreadable(cls, step: int, rank: int, reason: str) -> StepSummary:
        """The summary of a step that could not be read: only where it is and why."""
        return cls(step=step, rank=rank, complete=False, reason=None, phase_counts={}, has_stats=False,
                   first_nonfinite=None, largest_abs_max=[], largest_norm=[], check_counts={},
                   failed_checks=[], unreadable=reason)

    @property
    def fault(self) -> OpRecord | None:
        """The first non-finite op when it is a fault: None in a step whose only non-finite
        values are an overflow the loss scaler handled."""
        return None if self.overflow_handled else self.first_nonfinite


def ranked(tensor: TensorRecord) -> bool:
    """Whether an output takes part in the magnitude rankings: floating point, finite, and not
    a mask fill (see :data:`MASK_FRACTION`). Integer and bool tensors (token ids, positions,
    masks) and tensors holding Inf or NaN (the non-finite report's business) do not."""
    if not tensor.floating or tensor.finite is not True or tensor.abs_max is None:
        return False
    try:
        largest = float(torch.finfo(getattr(torch, tensor.dtype)).max)
    except (AttributeError, TypeError):  # a dtype this torch does not know
        return True
    return tensor.abs_max < MASK_FRACTION * largest


def _largest(run: Run, step: int, rank: int, op_of_row: np.ndarray, values: np.ndarray, top: int,
             value_of: Callable[[TensorRecord], float | None], scaler: ScalerStep | None = None
             ) -> list[tuple[OpRecord, float]]:
    """The ``top`` ops with the largest ranked output value (:func:`ranked`), largest first,
    the loss scaler's own ops aside (``ScalerStep.owns``: a scale of 65536 and the loss times
    it are no magnitudes of the model), and bookkeeping outputs too (by-products, counters,
    repeats of an input: :func:`probe.analysis.bookkeeping.model_outputs`).

    Candidates are decoded a batch at a time in the order of their raw rows (an op's ranked
    value is at most its largest raw row), until no op left can beat the ``top`` found."""
    known = np.flatnonzero(np.isfinite(values))
    ops, values = op_of_row[known], values[known]
    # Each op's largest raw value and the first row holding it, then the ops by that value,
    # descending (ties: the earlier row first): in numpy, as a step may hold 10^6 rows.
    by_op = np.lexsort((-values, ops))
    grouped = ops[by_op]
    first = np.ones(len(by_op), dtype=bool)
    first[1:] = grouped[1:] != grouped[:-1]
    best = by_op[first]
    order = best[np.lexsort((best, -values[best]))]
    candidate_ops, candidate_values = ops[order], values[order]
    found: list[tuple[OpRecord, float]] = []
    batch = max(2 * top, 16)
    for start in range(0, len(order), batch):
        chunk = candidate_ops[start:start + batch].tolist()
        for record in run.ops_at(chunk, step, rank):
            if scaler is not None and scaler.owns(record):
                continue
            eligible = [v for t in model_outputs(record) if ranked(t) and (v := value_of(t)) is not None]
            if eligible:
                found.append((record, max(eligible)))
        found.sort(key=lambda item: -item[1])
        following = float(candidate_values[start + batch]) if start + batch < len(order) else -np.inf
        if len(found) >= top and found[top - 1][1] >= following:
            break
    return found[:top]


def _phase_counts(run: Run, step: int, rank: int, manifest: dict) -> dict[str, int]:
    phases = manifest.get("phases")
    if isinstance(phases, dict) and all(type(n) is int for n in phases.values()):
        return {phase: n for phase, n in phases.items() if n}
    return dict(Counter(op.phase for op in run.ops(step, rank)))


def summarize_step(run: Run, step: int, rank: int, top: int = 5) -> StepSummary:
    """One step's summary, from its manifest and statistics table. Only the ops it names are
    decoded, and the whole step when its statistics hold a NaN or Inf (the first non-finite
    op is found in the step's graph)."""
    info = run.step_info(step, rank)
    checks = run.checks(step, rank)
    failed = [c for c in checks if c.verdict == "fail"]
    failed.sort(key=lambda c: -(c.ratio or 0.0) / (c.threshold or 1.0))
    stats = run.output_stats(step, rank)
    first, by_abs_max, by_norm, scaler, handled = None, [], [], None, False
    origins: list[OpRecord] = []
    if stats is not None:
        op_of_row, rows = stats
        lo, hi = np.abs(rows[:, 0]), np.abs(rows[:, 1])
        # max(|min|, |max|) as TensorRecord.abs_max computes it (NaN when |min| is NaN)
        abs_max = np.where(hi > lo, hi, lo)
        if np.any(rows[:, 4] + rows[:, 5] > 0):  # only then is the step's graph needed
            origins = nonfinite_origins_in(run.ops(step, rank))
            first = origins[0] if origins else None
        handled = handled_by_scaler(origins, scaler := run.loss_scaler(step, rank))  # after run.ops
        by_abs_max = _largest(run, step, rank, op_of_row, abs_max, top, lambda t: t.abs_max, scaler)
        by_norm = _largest(run, step, rank, op_of_row, rows[:, 3], top,
                           lambda t: None if t.stats is None else t.stats["norm"], scaler)
    if stats is None:
        scaler = run.loss_scaler(step, rank)  # the monitor's series (scaler=), if any
    return StepSummary(
        step=step,
        rank=rank,
        complete=info.complete,
        reason=info.reason,
        phase_counts=_phase_counts(run, step, rank, info.manifest),
        has_stats=stats is not None and len(stats[0]) > 0,
        first_nonfinite=first,
        largest_abs_max=[Extreme(op, value) for op, value in by_abs_max],
        largest_norm=[Extreme(op, value) for op, value in by_norm],
        check_counts=dict(Counter(c.verdict for c in checks)),
        failed_checks=failed[:top],
        nonfinite_parameters=run.nonfinite_parameters(step, rank),
        sections=_sections(run, step, rank, info.manifest),
        anomalies=run.anomalies_of(step, rank),
        unmeasured=_unmeasured(info.manifest),
        untraced_threads=_untraced_threads(run, step, rank, info.manifest),
        mode_failures=_mode_failures(run, step, rank, info.manifest),
        loss_scaler=scaler,
        overflow_handled=handled,
    )


def _sections(run: Run, step: int, rank: int, manifest: dict) -> dict[str, StepSection]:
    """What each mode the step's manifest lists says of the step (its reader's ``section()``)."""
    modes = manifest.get("modes")
    found = {}
    for mode in modes if isinstance(modes, dict) else ():
        files = run.mode_files(mode, step, rank)
        section = None if files is None else files.section()
        if section is not None:
            found[mode] = section
    return found


def _unmeasured(manifest: dict) -> int:
    stats = manifest.get("modes", {}).get("stats") if isinstance(manifest.get("modes"), dict) else None
    count = stats.get("unmeasured_tensors", 0) if isinstance(stats, dict) else 0
    return count if isinstance(count, int) else 0


def _untraced_threads(run: Run, step: int, rank: int, manifest: dict) -> dict[str, int]:
    """The manifest's ``untraced_threads``, checked: a damaged entry makes the step unreadable
    rather than hide that ops went unseen."""
    entry = manifest.get(layout.UNTRACED_THREADS_KEY, {})
    with reading(layout.step_dir(run.path, rank, step) / layout.MANIFEST_FILE):
        expect(entry, dict, layout.UNTRACED_THREADS_KEY)
        return {expect(name, str, "a thread name"): expect(calls, int, f"the calls on thread {name!r}")
                for name, calls in entry.items()}


def _mode_failures(run: Run, step: int, rank: int, manifest: dict) -> dict[str, str]:
    """The manifest's ``mode_failures``, checked as ``untraced_threads`` is."""
    entry = manifest.get(layout.MODE_FAILURES_KEY, {})
    with reading(layout.step_dir(run.path, rank, step) / layout.MANIFEST_FILE):
        expect(entry, dict, layout.MODE_FAILURES_KEY)
        return {expect(name, str, "a mode name"): expect(reason, str, f"why mode {name!r} failed")
                for name, reason in entry.items()}


def summarize(run: Run, top: int = 5) -> Iterator[StepSummary]:
    """The summary of every (step, rank), rank by rank, each step as it is read. A step that
    cannot be read (damaged, cut short) does not stop the others: its summary says why
    (:attr:`StepSummary.unreadable`)."""
    for rank in run.ranks:
        for step in run.steps_of(rank):
            try:
                summary = summarize_step(run, step, rank, top)
            except ProbeError as e:
                summary = StepSummary.of_unreadable(step, rank, str(e))
            yield summary


@dataclass
class ModuleMagnitude:
    """One module's largest output magnitude in a step, per phase (``probe summary --plot``)."""

    module: str
    """Innermost module FQN ("" outside modules)."""
    largest: dict[str, float] = field(default_factory=dict)
    """Phase -> the largest |value| among its ops' ranked outputs (:func:`ranked`)."""
    nonfinite: dict[str, int] = field(default_factory=dict)
    """Phase -> how many of its ops made a NaN or Inf."""


def module_magnitudes(run: Run, step: int, rank: int) -> list[ModuleMagnitude]:
    """Per module, in the order its first op ran, its largest output magnitude in each phase.

    Raises :class:`ProbeError` when the step holds no statistics (a run without mode stats)."""
    ops = run.ops(step, rank)
    if not any(t.stats is not None for op in ops for t in op.outputs):
        raise ProbeError(f"step {step} of rank {rank} of {str(run.path)!r} holds no output statistics: "
                         "record it with mode 'stats'")
    by_module: dict[str, ModuleMagnitude] = {}
    for op in ops:
        entry = by_module.setdefault(op.module, ModuleMagnitude(op.module))
        values = [t.abs_max for t in op.outputs if ranked(t)]
        if values:
            entry.largest[op.phase] = max(entry.largest.get(op.phase, 0.0), *values)
        if any(t.finite is False for t in op.outputs):
            entry.nonfinite[op.phase] = entry.nonfinite.get(op.phase, 0) + 1
    return list(by_module.values())



def lost_steps(run: Run) -> list[str]:
    """One line per step the run lost: each one the writer gave up (``write_failures.jsonl``:
    the file and the error), then each whose flush never finished for another reason (the
    process died while writing it)."""
    failures = run.write_failures()
    given_up = {(f.step, f.rank) for f in failures if not f.tail}
    return [failure.describe() for failure in failures] + [
        f"step {step} rank {rank}: flush never finished (the process died)"
        for step, rank in run.unfinished_steps if (step, rank) not in given_up
    ]


def tails(run: Run) -> list[str]:
    """One line per rank with a tail (ops recorded after the last ``session.step()``)."""
    lines = []
    for rank in run.ranks:
        tail = run.tail(rank)
        if tail:
            directory = layout.tail_dir(run.path, rank, tail[0].step).relative_to(run.path)
            lines.append(f"rank {rank}: a tail of {len(tail)} ops recorded after the last session.step() "
                         f"({directory}; run.tail({rank}))")
    return lines


def rewinds(run: Run) -> list[str]:
    """One line per rewound step (``session.step_fn``/``session.rewind()``): the verdict and what it named."""
    return [verdict.line() for verdict in read_verdicts(run.path)]
