"""A damaged or unreadable step is reported and skipped, never the end of the whole run.

A three-step run (stats and dump) has one step damaged on disk in each way a reader refuses
(a statistics index pointing past the op records, op records cut short, a manifest cut short,
a dump index that is not JSON). ``probe.load`` reads the other steps and names the damaged one
(``Run.damaged_steps()``); ``probe summary`` prints the others and names it; ``probe compare``
marks its ops "not compared" with the reason and compares the rest (exit 0; 1 with
``--fail-on-divergence``, as for any op not compared). Before, any such step ended summary and
compare with exit 2.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import run_modes

import probe
from probe import ProbeError, cli
from probe.analysis.verdicts import NOT_COMPARED, PASS
from probe.errors import ProbeWarning
from probe.modes.stats.file_names import STATS_INDEX_FILE
from probe.rundir import layout

STEPS = 3
DAMAGED = 1


def _index_past_the_ops(step: Path) -> None:
    index = np.load(step / STATS_INDEX_FILE)
    index[-1, 0] = 10**6
    np.save(step / STATS_INDEX_FILE, index)


def _cut_short(name: str) -> Callable[[Path], None]:
    def damage(step: Path) -> None:
        data = (step / name).read_bytes()
        (step / name).write_bytes(data[: len(data) // 2])
    return damage


DAMAGE = {
    "stats index past the ops": (_index_past_the_ops, STATS_INDEX_FILE),
    "ops.jsonl cut short": (_cut_short(layout.OPS_FILE), layout.OPS_FILE),
    "manifest cut short": (_cut_short(layout.MANIFEST_FILE), layout.MANIFEST_FILE),
    "tensors.json not JSON": (lambda step: (step / "tensors.json").write_text("{not json"), "tensors.json"),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return {}


@pytest.fixture
def runs(tmp_path_factory: pytest.TempPathFactory, made: dict[str, tuple[Path, Path]],
         kind: str) -> tuple[Path, Path]:
    """A run and an identical one (the reference, and what each test damages a copy of), made once
    per module: with a dump where the damage is to the dump, statistics alone otherwise (faster
    to compare)."""
    modes = ["stats", "dump"] if kind == "tensors.json not JSON" else ["stats"]
    key = "+".join(modes)
    if key not in made:
        root = tmp_path_factory.mktemp(key)
        run_modes(root / "reference", modes, steps=STEPS)
        run_modes(root / "same", modes, steps=STEPS)
        made[key] = (root / "reference", root / "same")
    return made[key]


def _damaged_copy(tmp_path: Path, source: Path, kind: str) -> tuple[Path, str]:
    out = tmp_path / "damaged"
    shutil.copytree(source, out)
    damage, name = DAMAGE[kind]
    damage(layout.step_dir(out, 0, DAMAGED))
    return out, name


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_api_reads_the_good_steps_and_names_the_damaged_one(tmp_path, runs, kind):
    out, name = _damaged_copy(tmp_path, runs[1], kind)
    run = probe.load(out)
    assert run.steps == [0, 1, 2]
    (damaged,) = run.damaged_steps()
    assert (damaged.step, damaged.rank) == (DAMAGED, 0) and name in damaged.reason
    assert run.step_damage(0) is None and run.step_damage(2) is None
    reference = probe.load(runs[0])
    for step in (0, 2):
        assert [(op.id, [t.stats for t in op.outputs]) for op in run.ops(step)] == \
               [(op.id, [t.stats for t in op.outputs]) for op in reference.ops(step)]
    if kind != "tensors.json not JSON":  # the op records themselves cannot be read
        with pytest.raises(ProbeError, match=name):
            run.ops(DAMAGED)
        # A run-wide reader passes the damaged step over, with a warning naming it.
        fresh = probe.load(out)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fresh.first_nonfinite() is None
            assert fresh.checks() == [] and fresh.skipped_steps() == []
        assert any(issubclass(w.category, ProbeWarning) and f"step {DAMAGED} rank 0" in str(w.message)
                   for w in caught)
    else:
        with pytest.raises(ProbeError, match=name):
            run.dump(DAMAGED)


@pytest.mark.parametrize("kind", DAMAGE)
def test_summary_prints_the_other_steps_and_names_the_damaged_one(tmp_path, capsys, runs, kind):
    out, name = _damaged_copy(tmp_path, runs[1], kind)
    capsys.readouterr()
    assert cli.main(["summary", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    damaged = f"step {DAMAGED} rank 0: UNREADABLE, skipped:"
    if kind == "tensors.json not JSON":  # the summary reads no dump index: the step is summarized
        assert damaged not in printed
    else:
        assert damaged in printed and name in printed
        assert f"1 step(s) unreadable, skipped: step {DAMAGED} rank 0" in printed
    for step in (0, 2):
        assert f"step {step} · rank 0" in printed


# The dump's comparison is the slow one (tensors, fp64 replays): its damage on one side only.
SIDES = [(kind, side) for kind in DAMAGE for side in ("A", "B") if side == "B" or "tensors" not in kind]


@pytest.mark.parametrize(("kind", "damaged_side"), SIDES, ids=[f"{k}-{s}" for k, s in SIDES])
def test_compare_marks_the_damaged_steps_ops_not_compared_and_goes_on(tmp_path, capsys, runs, kind,
                                                                      damaged_side):
    out, name = _damaged_copy(tmp_path, runs[1], kind)
    a, b = (out, runs[0]) if damaged_side == "A" else (runs[0], out)
    report = probe.compare(a, b)
    by_step = {s.step: s for s in report.steps}
    assert sorted(by_step) == [0, 1, 2]
    assert by_step[DAMAGED].unreadable is not None and name in by_step[DAMAGED].unreadable
    rows = [r for r in report.rows if r["step"] == DAMAGED]
    assert rows and all(r["verdict"] == NOT_COMPARED for r in rows)
    assert all(f"run {damaged_side}: unreadable" in r["message"] and name in r["message"] for r in rows)
    for step in (0, 2):  # the other steps are compared: the runs are the same training
        assert by_step[step].unreadable is None
        assert {r["verdict"] for r in report.rows if r["step"] == step} == {PASS}
    assert report.first_divergence is None and not report.ok

    capsys.readouterr()
    # Exit 0 without --fail-on-divergence (tests/test_interrupts.py runs that); 1 with it, as
    # for any op not compared, never 2 (unreadable input) for the whole run.
    assert cli.main(["compare", str(a), str(b), "--fail-on-divergence", "-o", str(tmp_path / "report")]) == 1
    printed = " ".join(capsys.readouterr().out.split())
    assert f"not compared: step {DAMAGED} rank 0, run {damaged_side}: unreadable" in printed
    assert name in printed
    assert (tmp_path / "report" / "report.csv").is_file()
