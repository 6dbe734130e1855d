"""Each mode owns its files: its reader sits beside its writer and ``probe.load`` finds it
through the mode registry; a step the writer gave up and a run's tail are surfaced."""

from __future__ import annotations

import ast
import errno
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SharedBlockNet, run_modes, train_steps

import probe
from probe import ProbeWarning
from probe.analysis.summary import lost_steps, tails
from probe.cli import main
from probe.modes.base import SessionPlugin
from probe.modes.dump.file_names import TENSOR_INDEX_FILE
from probe.modes.free_benchmark.files import CHECKS_FILE
from probe.modes.monitor.file_names import ANOMALIES_FILE, MONITOR_FILE
from probe.modes.registry import MODES, register_mode
from probe.modes.stats.file_names import STATS_FILE
from probe.modes.stats.mode import StatsFiles
from probe.rundir import layout
from probe.rundir.mode_files import ModeFiles
from probe.rundir.records import OpRecord
from probe.rundir.untrusted_reads import read_json, reading
from probe.rundir.writer import StepWriter

NOTES_FILE = "notes.json"


class NotesFiles(ModeFiles):
    """The test plug-in's reader: its one file, and the largest output dtype it saw of each op."""

    def notes(self) -> list[str]:
        path = self.where.directory / NOTES_FILE
        data = read_json(path)
        with reading(path):
            return [str(n) for n in data["notes"]]

    def attach(self, records: dict[int, OpRecord]) -> None:
        self.attached = sorted(records)


class NotesStep:
    def __init__(self, step: int) -> None:
        self.step = step

    def write(self, writer: StepWriter) -> dict[str, Any]:
        writer.write_json(NOTES_FILE, {"notes": [f"step {self.step} was here"]})
        return {"notes": 1}


@register_mode
class NotesPlugin(SessionPlugin):
    """A plug-in of this test alone: one file a step, read back by ``NotesFiles``."""

    name = "test_notes"
    files = NotesFiles

    def end_step(self, step: int) -> NotesStep:
        return NotesStep(step)


def _train(session: probe.Session, steps: int, tail: bool = False) -> None:
    w = torch.randn(4, 4)
    with session:
        for _ in range(steps):
            torch.tanh(torch.randn(2, 4) @ w).sum()
            session.step()
        if tail:
            torch.randn(3).exp().sum().item()  # after the last step(): the tail


def test_a_plugin_registered_elsewhere_is_read_back_through_its_own_reader(tmp_path):
    _train(probe.mode(["stats", "test_notes"], out=tmp_path / "r"), steps=2)
    run = probe.load(tmp_path / "r")
    assert run.steps == [0, 1]
    for step in run.steps:
        files = run.mode_files("test_notes", step)
        assert isinstance(files, NotesFiles)
        assert files.notes() == [f"step {step} was here"]
        assert files.where.summary == {"notes": 1}
        ops = run.ops(step)
        assert files.attached == [op.index for op in ops]  # called while the records were decoded
        assert all(t.stats is not None for op in ops for t in op.outputs)  # the stats mode's reader too
    assert isinstance(run.mode_files("stats", 0), StatsFiles)
    assert run.mode_files("dump", 0) is None and not run.has_dump(0)  # not in the step's manifest


def test_a_manifest_mode_nobody_registered_warns_once_and_the_step_reads_without_it(tmp_path):
    _train(probe.mode(["stats", "test_notes"], out=tmp_path / "r"), steps=3)
    for step in range(3):  # as a run written by a probe that had a plug-in this one lacks
        path = layout.step_dir(tmp_path / "r", 0, step) / layout.MANIFEST_FILE
        manifest = json.loads(path.read_text())
        manifest["modes"]["test_unregistered_mode"] = manifest["modes"]["test_notes"]
        path.write_text(json.dumps(manifest))
    assert "test_unregistered_mode" not in MODES
    run = probe.load(tmp_path / "r")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = [run.ops(step) for step in run.steps]
    said = [str(w.message) for w in caught if issubclass(w.category, ProbeWarning)]
    assert len(said) == 1 and "'test_unregistered_mode'" in said[0], said
    assert all(t.stats is not None for step_ops in ops for op in step_ops for t in op.outputs)
    assert run.mode_files("test_unregistered_mode", 0) is None


def _full_once(monkeypatch, step: int, name: str) -> list[Path]:
    """``StepWriter.write_array`` of ``name`` in step ``step`` fails as a full disk does, once."""
    refused: list[Path] = []
    real = StepWriter.write_array

    def write_array(self: StepWriter, file: str, array: np.ndarray) -> None:
        if self.step == step and file == name and not refused:
            path = self.directory / file
            path.write_bytes(b"\x93NUMPY")  # a first few bytes, then the disk is full
            refused.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(self, file, array)

    monkeypatch.setattr(StepWriter, "write_array", write_array)
    return refused


def test_a_step_the_writer_gave_up_is_listed_by_the_run_and_the_summary(tmp_path, monkeypatch, capsys):
    refused = _full_once(monkeypatch, step=1, name=STATS_FILE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        _train(probe.mode("stats", out=tmp_path / "r"), steps=3)
    assert refused
    run = probe.load(tmp_path / "r")
    assert run.steps == [0, 2] and run.unfinished_steps == [(1, 0)]
    (failure,) = run.write_failures()
    assert (failure.rank, failure.step, failure.tail) == (0, 1, False)
    assert failure.errno == errno.ENOSPC and failure.error == os.strerror(errno.ENOSPC)
    assert failure.file == f".step1.partial/{STATS_FILE}" and failure.directory == ".step1.partial"
    assert failure.ops == len(run.ops(0)) and failure.modes == ("stats",)
    assert run.write_failures(0) == [failure]
    # One line for the lost step, naming the file and the error; not a second "process died" line.
    (line,) = lost_steps(run)
    assert line.startswith("step 1 rank 0: lost") and "stats.npy" in line and "No space left" in line
    assert main(["summary", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "step 1 rank 0: lost" in out and "flush never finished" not in out


def test_the_tail_is_read_apart_from_the_steps_and_named_by_the_summary(tmp_path, capsys):
    _train(probe.mode("stats", out=tmp_path / "r"), steps=2, tail=True)
    run = probe.load(tmp_path / "r")
    assert run.steps == [0, 1] and run.unfinished_steps == []
    tail = run.tail(0)
    assert tail is not None and [op.name.split(".")[1] for op in tail][:2] == ["randn", "exp"]
    assert all(op.step == 2 for op in tail)
    assert tail[1].outputs[0].stats is not None  # the stats mode's reader attached them
    assert torch.all(torch.tensor(tail[1].outputs[0].stats["min"]) > 0)  # exp() > 0
    (line,) = tails(run)
    assert f"{len(tail)} ops" in line and "tail2" in line
    assert main(["summary", str(tmp_path / "r")]) == 0
    assert "a tail of" in capsys.readouterr().out
    _train(probe.mode("stats", out=tmp_path / "no_tail"), steps=2)
    assert probe.load(tmp_path / "no_tail").tail(0) is None and not tails(probe.load(tmp_path / "no_tail"))


def _module_level_imports(path: Path) -> set[str]:
    return {node.module for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ImportFrom) and node.module}


def _all_imports(path: Path) -> set[str]:
    return {node.module for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module}


def test_the_run_reader_knows_no_mode_and_no_mode_imports_it():
    package = Path(probe.__file__).parent
    for path in (package / "rundir").glob("*.py"):
        assert not {m for m in _module_level_imports(path) if m.startswith("probe.modes")}, path.name
    reader = (package / "rundir" / "run.py").read_text()
    for name in (STATS_FILE, CHECKS_FILE, MONITOR_FILE, ANOMALIES_FILE,
                 TENSOR_INDEX_FILE, "STATS_FILE", "CHECKS_FILE", "MONITOR_FILE", "ANOMALIES_FILE",
                 "TENSOR_INDEX_FILE"):
        assert name not in reader, name
    for path in (package / "modes").rglob("*.py"):
        assert "probe.rundir.run" not in _all_imports(path), path.name


def test_run_mode_reads_a_real_runs_monitor_records(tmp_path):
    # Issue 34: run.mode(name) is the mode's own reader over the run; run.monitor() is its alias.
    torch.manual_seed(0)
    model = SharedBlockNet()
    options = {"targets": ["head"], "wg_distribution": True}  # the weight gradients' series too
    with probe.mode("monitor", out=tmp_path / "run", model=model, **options) as session:
        _, last_grads = train_steps(model, 2, session=session)
    run = probe.load(tmp_path / "run")
    monitor = run.mode("monitor")
    series = monitor.series(1, 0)
    grads = {r.name: r.norm for r in series if r.kind == "weight_grad"}
    assert set(grads) == set(last_grads)
    for name, norm in grads.items():  # the norm of the gradient the optimizer applied at step 1
        assert norm == pytest.approx(last_grads[name].double().norm().item(), rel=1e-6)
    assert {(r.step, r.rank) for r in monitor.series()} == {(0, 0), (1, 0)}
    assert [(r.step, r.kind, r.name, r.norm) for r in monitor.series()] == \
        [(r.step, r.kind, r.name, r.norm) for r in run.monitor()]
    assert monitor.anomalies() == run.anomalies() == []
    assert run.mode("free_benchmark").checks() == run.checks() == []  # a mode the run did not use
    with pytest.raises(probe.ProbeError, match=r"no mode 'monitr' to read: the registered .*monitor"):
        run.mode("monitr")


def test_run_mode_reads_a_real_runs_statistics_and_dump(tmp_path):
    # Issue 34: the stats mode and the dump are read over the run by their own readers
    # (run.mode(name), typed through the registry); the Run accessors are their aliases.
    run_modes(tmp_path / "run", ["stats", "dump"])
    run = probe.load(tmp_path / "run")
    stats, dump = run.mode("stats"), run.mode("dump")
    assert [type(reader).__module__ for reader in (stats, dump)] == ["probe.modes.stats.files",
                                                                      "probe.modes.dump.files"]
    op = next(o for o in run.ops(1) if o.phase == "forward" and o.outputs and o.outputs[0].dtype == "float32"
              and o.outputs[0].numel > 1)
    tensor = dump.tensor(op.id, "output", 0, step=1)
    assert torch.equal(tensor, run.tensor(op.id, "output", 0, step=1))
    recorded = op.outputs[0].stats  # taken by the stats mode, independently of the dump
    assert (tensor.min().item(), tensor.max().item()) == (recorded["min"], recorded["max"])
    assert dump.has_dump(1, 0) and dump.dump(1, 0).entries[(op.index, "output", 0)].status is None
    rows_of, rows = stats.output_stats(1, 0)
    alias_rows_of, alias_rows = run.output_stats(1, 0)
    assert np.array_equal(rows_of, alias_rows_of) and np.array_equal(rows, alias_rows)
    assert rows[list(rows_of).index(op.index)][1] == recorded["max"]
    found = stats.nonfinite_parameters(1, 0)
    assert (found.parameters, found.gradients) == (([], 0), ([], 0))
    assert found == run.nonfinite_parameters(1, 0)
