"""Did two runs start alike? What ``probe compare`` reports before any op.

Two parts, both read from what each run recorded (no tensor data):

- **Environment**: the differences between the runs' ``rank.json`` ``environment`` (library
  versions, devices, torch's determinism and TF32 settings, allow-listed environment
  variables, package versions), their ``run.json`` hyperparameters (``hparams=``) and
  seeds (``probe.seed_all``). Differences are findings to read, not verdicts: another
  cuBLAS may or may not change a result.
- **Start**: the checksums mode's records (``probe.modes.checksums.mode``): whether the runs
  started from the same **weights** (the parameter and buffer checksums at the first step
  both recorded them: a buffer such as a rotary embedding's ``inv_freq`` is as much a
  starting point as a weight), were fed the same **inputs** and drew from the same **RNG
  state** at each step compared. A run without checksums is "not recorded": unknown, never
  a pass; runs written before buffers were recorded are compared on their parameters, with
  a note.

A difference at the start explains everything downstream of it: a different initial
weight changes every op that reads it, a different dropout RNG every dropout mask. So
when one is found at or before the first divergence, ``Report.conclusion`` names it as
the explanation instead of leaving the reader at the first dropout
(:meth:`Identity.explain`).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from probe.analysis.mode_records import ChecksumsOfRun, StepChecksums, TensorChecksum
from probe.errors import ProbeError
from probe.hparams import flatten
from probe.rundir.run import Run
from probe.vocabulary.csv_cells import csv_safe

SAME, DIFFER, NOT_RECORDED, NOT_COMPARABLE = "same", "differ", "not recorded", "not comparable"
CHECKS = ("weights", "inputs", "rng")
NAMES_SHOWN = 5
"""Differing parameter or input names given in a message (all of them are in ``names``)."""
_GENERATORS = {"torch": "torch CPU generator", "python": "Python random", "numpy": "NumPy global generator"}
HOST_GENERATORS = frozenset({"python", "numpy"})
"""Generators torch's ops never draw from (they shape the data, which the inputs check covers)."""
_ENV_SECTIONS = (("versions", "version"), ("devices", "device"), ("settings", "setting"),
                 ("variables", "variable"), ("packages", "package"))


@dataclass
class EnvironmentDifference:
    """One thing the runs' environments, hyperparameters or seeds disagree on."""

    kind: str
    """"version", "device", "setting", "variable", "package", "hparam" or "seed"."""
    name: str
    a: Any
    """Run A's value (None: not set / not installed / not recorded)."""
    b: Any
    ranks: list[int] | None = None
    """The ranks where it differs; None when on every rank compared (or run-wide)."""

    def describe(self) -> str:
        where = "" if self.ranks is None else f" on rank{'s' if len(self.ranks) > 1 else ''} " + \
            ", ".join(map(str, self.ranks))
        return f"{self.kind} {self.name}: {_word(self.a)} in run A, {_word(self.b)} in run B{where}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "a": self.a, "b": self.b, "ranks": self.ranks}


def _word(value: Any) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


@dataclass
class StartCheck:
    """Whether the runs agree on one thing they started from: weights, inputs or RNG state."""

    what: str
    """"weights", "inputs" or "rng"."""
    status: str
    """"same", "differ", "not recorded" (a run lacks the checksums) or "not comparable" (held in
    other dtypes, or recorded at no common step)."""
    message: str
    step: int | None = None
    """Where it differs (the first such step); for "same", the first step checked."""
    rank: int | None = None
    names: list[str] = field(default_factory=list)
    """What differs: parameter names, input paths, generators."""
    steps_checked: int = 0
    torch_step: int | None = None
    """RNG: the first step where one of torch's generators differs (None: only Python's or
    NumPy's do, which torch's ops never draw from)."""

    def explains_from(self, random_ops: bool | None) -> int | None:
        """The first step from which this difference can change what the traced ops compute;
        None when it cannot. Weights and inputs always can. An RNG difference can through
        torch's generators only, and only when an op drew from them (``random_ops``: whether
        a compared op draws random numbers; None: not known). Python's and NumPy's generators
        act on what the model is fed, which the inputs check covers."""
        if self.status != DIFFER:
            return None
        if self.what != "rng":
            return self.step
        return None if random_ops is False else self.torch_step

    def immaterial(self) -> str:
        """Why a difference that cannot explain the ops' differences does not (see explains_from)."""
        if self.torch_step is None:
            return "torch's ops do not draw from Python's or NumPy's generators"
        return "no compared op draws random numbers"

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "status": self.status, "message": self.message, "step": self.step,
                "rank": self.rank, "names": self.names, "steps_checked": self.steps_checked,
                "torch_step": self.torch_step}


@dataclass
class Identity:
    """What ``probe compare`` found about the runs before their ops (``Report.identity``)."""

    differences: list[EnvironmentDifference]
    checks: list[StartCheck]
    notes: list[str] = field(default_factory=list)
    """What could not be checked, in words (a run written by an older probe, ...)."""

    def check(self, what: str) -> StartCheck:
        return next(c for c in self.checks if c.what == what)

    @property
    def differing(self) -> list[StartCheck]:
        """The start checks that differ, earliest step first."""
        return sorted((c for c in self.checks if c.status == DIFFER), key=lambda c: c.step or 0)

    @property
    def started_alike(self) -> bool | None:
        """True when weights, inputs and RNG all match; False when one differs; None (unknown)
        when one was not recorded or not comparable and none differs."""
        if self.differing:
            return False
        return True if all(c.status == SAME for c in self.checks) else None

    @property
    def cause(self) -> str | None:
        """The differences at the start, in words (None when none differs)."""
        found = self.differing
        return "; ".join(c.message for c in found) if found else None

    @property
    def conclusion(self) -> str:
        """One sentence: did the runs start alike, and do their environments differ."""
        alike = self.started_alike
        if alike is False:
            text = f"the runs did not start alike: {self.cause}"
        elif alike:
            text = "the runs started alike: " + "; ".join(c.message for c in self.checks)
        else:
            text = "whether the runs started alike is not known: " + "; ".join(c.message for c in self.checks)
        if self.differences:
            shown = ", ".join(f"{d.kind} {d.name}" for d in self.differences[:NAMES_SHOWN])
            extra = len(self.differences) - NAMES_SHOWN
            more = f" and {extra} more" if extra > 0 else ""
            text += f"; their environments differ ({shown}{more})"
        return text

    def explain(self, conclusion: str, divergence_step: int | None, random_ops: bool | None = None) -> str:
        """``Report.conclusion``: the ops' conclusion, led by the start's difference when that
        explains it (one that can change the ops, :meth:`StartCheck.explains_from`, found at or
        before the step of the first divergence). ``random_ops``: whether a compared op draws
        random numbers (None: not known)."""
        if self.cause is None:
            return conclusion
        causes = [(first, c) for c in self.differing if (first := c.explains_from(random_ops)) is not None]
        if not causes:
            why = "; ".join(f"{c.message}: {c.immaterial()}" for c in self.differing)
            return f"{conclusion} (the runs' {why})"
        cause = "; ".join(c.message for _, c in causes)
        first = min(step for step, _ in causes)
        if divergence_step is None:
            return f"{conclusion} (though the runs did not start alike: {cause})"
        if divergence_step >= first:
            return f"the runs did not start alike: {cause}; that explains the differences downstream " \
                   f"({conclusion})"
        return f"{conclusion}; later the runs did not start alike either: {cause}"

    def lines(self) -> list[str]:
        """The identity section as lines: each start check, then each environment difference."""
        out = [f"{c.what}: {c.status} ({c.message})" for c in self.checks]
        out += [d.describe() for d in self.differences]
        return out + self.notes

    def to_dict(self) -> dict[str, Any]:
        return {"started_alike": self.started_alike, "conclusion": self.conclusion,
                "checks": [c.to_dict() for c in self.checks],
                "differences": [d.to_dict() for d in self.differences], "notes": self.notes}

    def to_csv(self, path: str | Path) -> None:
        """One line per start check and per environment difference."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["Section", "Kind", "Name", "Run A", "Run B", "Status", "Step", "Rank",
                             "Message"])
            for c in self.checks:
                row = ["start", c.what, ", ".join(c.names), "", "", c.status, c.step, c.rank, c.message]
                writer.writerow([csv_safe("" if v is None else str(v)) for v in row])
            for d in self.differences:
                ranks = "" if d.ranks is None else ",".join(map(str, d.ranks))
                row = ["environment", d.kind, d.name, _word(d.a), _word(d.b), DIFFER, "", ranks, d.describe()]
                writer.writerow([csv_safe(str(v)) for v in row])


# -- environment -------------------------------------------------------------------


def _environment_differences(run_a: Run, run_b: Run, ranks: list[int], notes: list[str]
                             ) -> list[EnvironmentDifference]:
    found: dict[tuple[str, str, str, str], EnvironmentDifference] = {}
    compared: list[int] = []
    for rank in ranks:
        env_a = run_a.process(rank).get("environment")
        env_b = run_b.process(rank).get("environment")
        if not isinstance(env_a, dict) or not isinstance(env_b, dict):
            lacking = [name for name, env in (("A", env_a), ("B", env_b)) if not isinstance(env, dict)]
            notes.append(f"rank {rank}: run {' and '.join(lacking)} recorded no environment (written by an "
                         "older probe): its versions and settings are not compared")
            continue
        compared.append(rank)
        for section, kind in _ENV_SECTIONS:
            part_a, part_b = env_a.get(section, {}), env_b.get(section, {})
            if not isinstance(part_a, dict) or not isinstance(part_b, dict):
                continue
            for name in sorted(set(part_a) | set(part_b)):
                a, b = part_a.get(name), part_b.get(name)
                if a != b:
                    key = (kind, name, repr(a), repr(b))
                    ranks = found.setdefault(key, EnvironmentDifference(kind, name, a, b, [])).ranks
                    assert ranks is not None  # set to None only below, once every rank is read
                    ranks.append(rank)
    differences = list(found.values())
    for d in differences:
        if d.ranks == compared:
            d.ranks = None
    info_a, info_b = run_a.info, run_b.info
    if info_a.get("probe_version") != info_b.get("probe_version"):
        differences.append(EnvironmentDifference("version", "probe", info_a.get("probe_version"),
                                                 info_b.get("probe_version")))
    differences += _hparam_differences(info_a.get("hparams"), info_b.get("hparams"), notes)
    differences += _seed_differences(info_a.get("seed"), info_b.get("seed"))
    return differences


def _hparam_differences(a: Any, b: Any, notes: list[str]) -> list[EnvironmentDifference]:
    if not isinstance(a, dict) or not isinstance(b, dict):
        if isinstance(a, dict) or isinstance(b, dict):
            notes.append(f"hyperparameters were recorded in run {'A' if isinstance(a, dict) else 'B'} only "
                         "(probe.mode(..., hparams=...))")
        return []
    flat_a, flat_b = flatten(a), flatten(b)
    return [EnvironmentDifference("hparam", name, flat_a.get(name), flat_b.get(name))
            for name in sorted(set(flat_a) | set(flat_b)) if flat_a.get(name) != flat_b.get(name)]


def _seed_differences(a: Any, b: Any) -> list[EnvironmentDifference]:
    if a is None and b is None:
        return []
    a = a if isinstance(a, dict) else {}
    b = b if isinstance(b, dict) else {}
    return [EnvironmentDifference("seed", key, a.get(key), b.get(key))
            for key in ("seed", "deterministic") if a.get(key) != b.get(key)]


# -- start -------------------------------------------------------------------------


def _listed(names: list[str], total: int | None = None, what: str = "") -> str:
    shown = ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")
    count = f"{len(names)} of {total} {what}: " if total is not None else ""
    return f"{count}{shown}"


def _tensor_differences(a: dict[str, TensorChecksum], b: dict[str, TensorChecksum]
                        ) -> tuple[list[str], list[str], list[str]]:
    """(differ, not comparable, unknown) names of two checksummed tensor sets."""
    differ, other_dtype, unknown = [], [], []
    for name in list(a) + [n for n in b if n not in a]:
        ta, tb = a.get(name), b.get(name)
        if ta is None or tb is None:
            differ.append(f"{name} (only in run {'A' if tb is None else 'B'})")
        elif ta.dtype != tb.dtype:
            other_dtype.append(name)
        elif ta.shape != tb.shape:
            differ.append(f"{name} (shape {list(ta.shape)} vs {list(tb.shape)})")
        elif ta.checksum is None or tb.checksum is None:
            unknown.append(name)
        elif ta.checksum != tb.checksum:
            differ.append(name)
    return differ, other_dtype, unknown


def _step_checksums(run: Run, step: int, rank: int) -> StepChecksums | None:
    """The checksums a run recorded for one step, or None without them (read through the reader
    the checksums mode registered: the modes sit above the analyses)."""
    return cast(ChecksumsOfRun, run.mode("checksums")).checksums(step, rank)


class _Steps:
    """The checksums of each (run, step, rank), read once."""

    def __init__(self, run_a: Run, run_b: Run) -> None:
        self.runs = {"A": run_a, "B": run_b}
        self._read: dict[tuple[str, int, int], StepChecksums | None] = {}
        self.unreadable: list[str] = []
        """The steps whose checksums could not be read (a damaged step), in words."""

    def get(self, side: str, step: int, rank: int) -> StepChecksums | None:
        key = (side, step, rank)
        if key not in self._read:
            run = self.runs[side]
            try:
                self._read[key] = _step_checksums(run, step, rank) if run.has_step(step, rank) else None
            except ProbeError:  # a damaged step (its ops "not compared"): it holds no checksums to go by
                self._read[key] = None
                self.unreadable.append(f"step {step} rank {rank} of run {side}")
        return self._read[key]

    def lacking(self, steps: dict[int, list[int]], part: str) -> str:
        """Which run recorded none of ``part`` over ``steps``, in words."""
        names = [side for side in ("A", "B")
                 if not any(getattr(self.get(side, s, r), part, None) is not None
                            for r, ss in steps.items() for s in ss)]
        if self.unreadable:
            return f"{_listed(self.unreadable)} could not be read"
        if not names:
            return "recorded at no common step"
        return f"run {' and '.join(names)} recorded none (record with probe.mode(..., model=model))"


def _buffers_listed(names: list[str], total: int) -> str:
    """``buffer NAME differs``, or ``N of M buffers differ: NAME, ...``."""
    if len(names) == 1:
        return f"buffer {names[0]} differs"
    return f"{len(names)} of {total} buffers differ: {_listed(names)}"


def _counted(count: int, what: str) -> str:
    return f"{count} {what}{'s' if count != 1 else ''}"


def _weights(steps: _Steps, run_a: Run, run_b: Run, plan: dict[int, list[int]], notes: list[str]
             ) -> StartCheck:
    """The parameters and buffers at the first step both runs recorded them (on each rank)."""
    results: list[StartCheck] = []
    for rank, compared in plan.items():
        last = max(compared)
        common = sorted(s for s in set(run_a.steps_of(rank)) & set(run_b.steps_of(rank)) if s <= last)
        for step in common:
            a, b = steps.get("A", step, rank), steps.get("B", step, rank)
            if a is None or b is None or a.parameters is None or b.parameters is None:
                continue
            where = f"step {step}" + (f" rank {rank}" if len(plan) > 1 else "")
            differ, other_dtype, unknown = _tensor_differences(a.parameters, b.parameters)
            total = len(set(a.parameters) | set(b.parameters))
            buffers_differ: list[str] = []
            buffer_total = 0
            counts = _counted(total, "parameter")
            if a.buffers is not None and b.buffers is not None:
                buffers_differ, buffers_other, buffers_unknown = _tensor_differences(a.buffers, b.buffers)
                other_dtype, unknown = other_dtype + buffers_other, unknown + buffers_unknown
                buffer_total = len(set(a.buffers) | set(b.buffers))
                counts += f", {_counted(buffer_total, 'buffer')}"
            else:
                lacking = " and ".join(side for side, c in (("A", a), ("B", b)) if c.buffers is None)
                note = (f"run {lacking} recorded no buffers (written by an older probe): the weights are "
                        "compared on their parameters only")
                if note not in notes:
                    notes.append(note)
            state = "weights" if differ or not buffers_differ else "buffers"
            initial = f"initial {state}" if step == common[0] else f"{state} at the start of step"
            if differ or buffers_differ:
                found = ([_listed(differ, total, "parameters")] if differ else []) + \
                    ([_buffers_listed(buffers_differ, buffer_total)] if buffers_differ else [])
                results.append(StartCheck("weights", DIFFER, f"{initial} differ at {where} "
                                          f"({'; '.join(found)})", step, rank, differ + buffers_differ, 1))
            elif other_dtype or unknown:
                why = f"{len(other_dtype)} held in another dtype" if other_dtype else \
                    f"{len(unknown)} without a checksum"
                results.append(StartCheck("weights", NOT_COMPARABLE, f"weights not compared bit for bit at "
                                          f"{where}: {why} ({_listed(other_dtype or unknown)})", step, rank,
                                          other_dtype or unknown, 1))
            else:
                results.append(StartCheck("weights", SAME, f"same {initial} at {where} ({counts})",
                                          step, rank, [], 1))
            break
    if not results:
        lacking = steps.lacking(plan, "parameters")
        return StartCheck("weights", NOT_RECORDED, f"weights not recorded: {lacking}")
    return _worst(results)


def _worst(results: list[StartCheck]) -> StartCheck:
    order = {DIFFER: 0, NOT_COMPARABLE: 1, NOT_RECORDED: 2, SAME: 3}
    worst = min(results, key=lambda c: (order[c.status], c.step or 0, c.rank or 0))
    worst.steps_checked = sum(c.steps_checked for c in results)
    return worst


def _input_differences(a: StepChecksums, b: StepChecksums) -> tuple[list[str], bool]:
    """(what differs, comparable) between two steps' input calls."""
    assert a.inputs is not None and b.inputs is not None
    if len(a.inputs) != len(b.inputs):
        fewer, more = sorted((len(a.inputs), len(b.inputs)))
        if fewer and more % fewer == 0:  # micro-batches: each call holds a slice of the other's batch
            return [], False
        return [f"{len(a.inputs)} calls of the model vs {len(b.inputs)}"], True
    differ: list[str] = []
    comparable = True
    for call_a, call_b in zip(a.inputs, b.inputs, strict=True):
        module = f"{call_a.module} " if call_a.module else ""
        prefix = f"{module}call {call_a.call}: " if len(a.inputs) > 1 else ""
        found, other_dtype, unknown = _tensor_differences({t.name: t for t in call_a.tensors},
                                                          {t.name: t for t in call_b.tensors})
        differ += [prefix + name for name in found]
        comparable = comparable and not other_dtype and not unknown
    return differ, comparable


def _per_step(steps: _Steps, plan: dict[int, list[int]], what: str) -> StartCheck:
    """Inputs or RNG states at each step compared: the first step where they differ."""
    part = "inputs" if what == "inputs" else "rng"
    label = "inputs" if what == "inputs" else "RNG state"
    checked, first_checked, incomparable = 0, None, False
    calls: tuple[int, int] | None = None  # (run A's, run B's) calls of the model, where micro-batches differ
    found: StartCheck | None = None
    for step in sorted({s for ss in plan.values() for s in ss}):
        for rank in sorted(r for r, ss in plan.items() if step in ss):
            a, b = steps.get("A", step, rank), steps.get("B", step, rank)
            part_a, part_b = getattr(a, part, None), getattr(b, part, None)
            if a is None or b is None or part_a is None or part_b is None:
                continue
            checked += 1
            first_checked = step if first_checked is None else first_checked
            where = f"step {step}" + (f" rank {rank}" if len(plan) > 1 else "")
            if what == "inputs":
                differ, comparable = _input_differences(a, b)
                if len(part_a) != len(part_b) and calls is None:
                    calls = (len(part_a), len(part_b))
            else:
                kinds = sorted(set(part_a) & set(part_b))
                differ, comparable = [k for k in kinds if part_a[k] != part_b[k]], bool(kinds)
            if differ:
                torch_differs = what == "rng" and not HOST_GENERATORS.issuperset(differ)
                if found is None:
                    verb = "differ" if what == "inputs" else "differs"
                    words = differ if what == "inputs" else [_GENERATORS.get(k, f"{k} generator")
                                                             for k in differ]
                    found = StartCheck(what, DIFFER, f"{label} {verb} at {where} ({_listed(words)})", step,
                                       rank, differ, checked)
                elif torch_differs:  # found at an earlier step, in Python's or NumPy's generators only
                    found.message += f"; torch's generators from {where}"
                if what == "inputs" or torch_differs:
                    found.torch_step = step if torch_differs else None
                    return found
            incomparable = incomparable or not comparable
    if found is not None:  # only Python's or NumPy's generators differ
        return found
    if not checked:
        return StartCheck(what, NOT_RECORDED, f"{label} not recorded: {steps.lacking(plan, part)}")
    steps_word = f"{checked} step{'s' if checked > 1 else ''} compared"
    if calls is not None:
        return StartCheck(what, NOT_COMPARABLE, f"{label} not compared bit for bit (micro-batches: "
                          f"{calls[0]} call(s) of the model in run A vs {calls[1]} in run B; {steps_word})",
                          first_checked, None, [], checked)
    if incomparable:
        return StartCheck(what, NOT_COMPARABLE, f"{label} not compared bit for bit (held in other dtypes "
                          f"or without a checksum; {steps_word})", first_checked, None, [], checked)
    return StartCheck(what, SAME, f"same {label} ({steps_word})", first_checked, None, [], checked)


def identity(run_a: Run, run_b: Run, plan: dict[int, list[int]]) -> Identity:
    """Compare what the runs started from over ``plan`` (rank -> steps compared)."""
    plan = {rank: steps for rank, steps in plan.items() if steps}
    notes: list[str] = []
    differences = _environment_differences(run_a, run_b, sorted(plan), notes)
    steps = _Steps(run_a, run_b)
    if not plan:
        checks = [StartCheck(what, NOT_RECORDED, f"{what}: no step in common") for what in CHECKS]
        return Identity(differences, checks, notes)
    checks = [_weights(steps, run_a, run_b, plan, notes), _per_step(steps, plan, "inputs"),
              _per_step(steps, plan, "rng")]
    return Identity(differences, checks, notes)


def same_kernels(run_a: Run, run_b: Run, rank: int) -> bool:
    """Whether ``rank`` of both runs computed with the same kernels: environments recorded and
    equal (library versions, CPU and its vector instructions, devices, torch's settings with the
    thread count, variables, packages), on the CPU or with deterministic algorithms on. Then an
    op given bit-identical inputs gives bit-identical results in both, whatever their dtype;
    one that does not computed something else (an eps, a scale, other code). An accelerator's
    atomics (a scatter's, a backward's) sum in another order on every run unless torch is told
    to be deterministic."""
    env_a = run_a.process(rank).get("environment")
    env_b = run_b.process(rank).get("environment")
    if not isinstance(env_a, dict) or not isinstance(env_b, dict) or env_a != env_b:
        return False
    devices, settings = env_a.get("devices"), env_a.get("settings")
    if not isinstance(devices, dict) or not isinstance(settings, dict):
        return False
    return devices.get("accelerator") is None or settings.get("deterministic_algorithms") is True
