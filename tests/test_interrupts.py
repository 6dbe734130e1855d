"""A Ctrl-C at any point of a step leaves every step on disk readable.

The interrupt is injected, not timed: each stage of a step (a mode's per-op work, the
tracer's own, the hand-over of the step in ``session.step()``, the writer) is wrapped to
raise ``KeyboardInterrupt`` at its Nth call in step 1 of a three-step training, in every
mode, with ``async_flush`` True and False. Afterwards the broken-off step is either on disk
marked incomplete with its reason, or not on disk at all (an unfinished ``.step1.partial``);
no index disagrees with its records (the stats mode's ``stats_index.npy`` against
``ops.jsonl`` was the case seen: a real SIGINT just after the stats mode recorded an op's row
left an index pointing past the ops, and the whole run unreadable); ``probe.load`` reads
every other step whole, and ``probe summary`` and ``probe compare`` exit 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import run_modes

import probe
from probe import cli
from probe.modes.dump.mode import DumpMode
from probe.modes.free_benchmark.mode import FreeBenchmarkMode
from probe.modes.monitor.mode import MonitorMode
from probe.modes.stats.mode import StatsMode
from probe.modes.structure.mode import StructureMode
from probe.rundir.background import BackgroundWriter
from probe.rundir.writer import StepWriter
from probe.session_writer import SessionWriter
from probe.tracer.dispatch_mode import Tracer
from probe.tracer.value_ids import ValueIndex

STEPS = 3
BROKEN = 1  # the step interrupted
MODE_CLASSES = {"stats": StatsMode, "dump": DumpMode, "structure": StructureMode, "monitor": MonitorMode,
                "free_benchmark": FreeBenchmarkMode}


def _options(mode: str) -> dict[str, Any]:
    return {"targets": ["block", "head"]} if mode == "monitor" else {}


def _current_step() -> int | None:
    session = probe.active_session()
    return None if session is None else session.step_index


@dataclass(frozen=True)
class Stage:
    """Where the interrupt lands: ``owner.attribute`` raises at its ``nth`` call in step
    :data:`BROKEN`, before (``when="before"``) or after the real call."""

    name: str
    owner: Callable[[str], Any]  # mode -> the class whose attribute is wrapped (None: not in this mode)
    attribute: str
    when: str
    nth: int = 1
    step_of: Callable[[tuple, dict], int | None] = lambda args, kwargs: _current_step()
    only_async: bool = False
    handed_over: bool = False
    """The interrupt lands after the step was handed over whole: it is on disk, complete."""


def _observer(mode: str, hook: str) -> Any:
    cls = MODE_CLASSES[mode]
    from probe.modes.base import OpObserver
    overridden = getattr(cls, hook, None) is not getattr(OpObserver, hook)
    return cls if mode != "monitor" and overridden else None


STAGES = [
    # A mode's per-op work: before the op runs, and just after it recorded the op's rows.
    Stage("op before", lambda m: _observer(m, "before"), "before", "before", nth=40),
    Stage("op after", lambda m: _observer(m, "after"), "after", "after", nth=40),
    # The tracer's own per-op work (every mode that traces ops): outputs registered, record not yet.
    Stage("tracer op", lambda m: None if m == "monitor" else ValueIndex, "register_outputs", "after", nth=40),
    # The monitor works from hooks: one series recorded.
    Stage("monitor record", lambda m: MonitorMode if m == "monitor" else None, "record", "after", nth=3),
    # The step's hand-over in session.step().
    Stage("tracer end_step", lambda m: Tracer, "end_step", "after"),
    Stage("mode end_step", lambda m: MODE_CLASSES[m], "end_step", "before",
          step_of=lambda args, kwargs: args[1]),
    Stage("mode end_step done", lambda m: MODE_CLASSES[m], "end_step", "after",
          step_of=lambda args, kwargs: args[1]),
    Stage("step job", lambda m: SessionWriter, "step_job", "after", step_of=lambda args, kwargs: args[1]),
    Stage("submit", lambda m: BackgroundWriter, "submit", "before", only_async=True, handed_over=True),
    Stage("submitted", lambda m: BackgroundWriter, "submit", "after", only_async=True, handed_over=True),
    # The writer (on the writer thread with async_flush): a file, and the commit.
    Stage("write ops", lambda m: StepWriter, "write_chunks", "before", step_of=lambda args, _: args[0].step),
    Stage("commit", lambda m: StepWriter, "commit", "before", step_of=lambda args, _: args[0].step),
]


def _inject(monkeypatch: pytest.MonkeyPatch, stage: Stage, owner: Any) -> list[bool]:
    real = getattr(owner, stage.attribute)
    calls, fired = [0], []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        due = False
        if not fired and stage.step_of(args, kwargs) == BROKEN:
            calls[0] += 1
            due = calls[0] == stage.nth
        if due and stage.when == "before":
            fired.append(True)
            raise KeyboardInterrupt
        result = real(*args, **kwargs)
        if due:
            fired.append(True)
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(owner, stage.attribute, wrapped)
    return fired


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """An uninterrupted run of each mode, made once."""
    made: dict[str, Path] = {}

    def reference(mode: str) -> Path:
        if mode not in made:
            made[mode] = tmp_path_factory.mktemp("reference") / mode
            run_modes(made[mode], mode, STEPS, async_flush=True, **_options(mode))
        return made[mode]

    return reference


def _read_whole(run: probe.Run, step: int) -> None:
    """Every file of the step, through the public readers (raises when any disagrees)."""
    ops = run.ops(step)
    run.graph(step)
    run.checks(step, 0)
    run.monitor(step, 0)
    run.anomalies_of(step, 0)
    if run.has_dump(step):
        dump = run.dump(step)
        for op_index, io, position in list(dump.entries)[:50]:
            assert ops[op_index].index == op_index
            run.tensor(ops[op_index].id, io, position, step=step)


CASES = [(stage, mode, async_flush) for stage in STAGES for mode in MODE_CLASSES
         for async_flush in (True, False)
         if stage.owner(mode) is not None and (async_flush or not stage.only_async)]


@pytest.mark.parametrize(("stage", "mode", "async_flush"), CASES,
                         ids=[f"{s.name}-{m}-{'async' if a else 'sync'}" for s, m, a in CASES])
def test_an_interrupt_leaves_every_step_readable(tmp_path, monkeypatch, capsys, references, stage, mode,
                                                 async_flush):
    reference = references(mode)
    fired = _inject(monkeypatch, stage, stage.owner(mode))
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_modes(out, mode, STEPS, async_flush=async_flush, **_options(mode))
    assert fired, f"the interrupt never landed in {stage.name}"
    monkeypatch.undo()

    run = probe.load(out)
    assert 0 in run.steps and run.step_info(0).complete
    for step in run.steps:
        _read_whole(run, step)
        info = run.step_info(step)
        if step == BROKEN and not stage.handed_over:
            # The broken-off step is on disk only marked incomplete, with the interruption as its reason.
            assert not info.complete and "KeyboardInterrupt" in (info.reason or "")
        else:
            assert info.complete, (step, info.reason)
    if stage.handed_over:
        assert BROKEN in run.steps  # the interrupted hand-over did not lose it
    if BROKEN not in run.steps:
        assert (BROKEN, 0) in run.unfinished_steps or stage.name not in ("write ops", "commit")
    assert run.damaged_steps() == []

    capsys.readouterr()
    assert cli.main(["summary", str(out)]) == 0, capsys.readouterr().err
    assert cli.main(["compare", str(reference), str(out)]) == 0, capsys.readouterr().err
