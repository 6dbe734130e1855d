"""A session without a ``with`` block: start() / step() / stop(), active_session(), pausing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import SharedBlockNet, train_steps
from torch import nn

import probe
from probe import ProbeError


def _ids(run: probe.Run, step: int) -> list[str]:
    return [op.id for op in run.ops(step=step)]


def test_start_stop_writes_what_the_with_block_writes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("stats", out=tmp_path / "with", model=model) as session:
        losses_with, _ = train_steps(model, 2, session=session)

    torch.manual_seed(0)
    model = SharedBlockNet()
    session = probe.mode("stats", out=tmp_path / "started", model=model)
    assert session.start() is session
    losses_started, _ = train_steps(model, 2, session=session)
    session.stop()

    assert torch.equal(torch.stack(losses_with), torch.stack(losses_started))
    a, b = probe.load(tmp_path / "with"), probe.load(tmp_path / "started")
    assert a.steps == b.steps == [0, 1]
    for step in a.steps:
        assert _ids(a, step) == _ids(b, step) and _ids(a, step)
        def stats(run: probe.Run, step: int) -> list[list[dict]]:
            return [[t.stats for t in op.outputs] for op in run.ops(step=step)]

        assert stats(a, step) == stats(b, step)


def test_active_session_is_the_running_one(tmp_path: Path) -> None:
    assert probe.active_session() is None
    session = probe.mode("stats", out=tmp_path / "a")
    assert probe.active_session() is None and not session.running
    session.start()
    assert probe.active_session() is session and session.running
    session.stop()
    assert probe.active_session() is None and not session.running
    with probe.mode("stats", out=tmp_path / "b") as inner:
        assert probe.active_session() is inner
    assert probe.active_session() is None


def test_start_twice_and_after_stop_are_refused(tmp_path: Path) -> None:
    session = probe.mode("stats", out=tmp_path / "a").start()
    try:
        with pytest.raises(ProbeError, match="already running"):
            session.start()
        other = probe.mode("stats", out=tmp_path / "b")
        with pytest.raises(ProbeError, match=r"already active.*stop\(\)"):
            other.start()
        assert not other.running and probe.active_session() is session
    finally:
        session.stop()
    with pytest.raises(ProbeError, match="has stopped and runs once"):
        session.start()
    assert probe.active_session() is None


def test_stop_is_safe_twice_and_after_a_failed_start(tmp_path: Path) -> None:
    session = probe.mode("stats", out=tmp_path / "blocked")
    (tmp_path / "blocked").write_text("a file where the run directory goes")  # after the options' check
    with pytest.raises((ProbeError, OSError)):
        session.start()
    session.stop()  # nothing started: nothing to do, nothing raised
    session.stop()
    assert probe.active_session() is None and not session.running

    started = probe.mode("stats", out=tmp_path / "run").start()
    torch.ones(3).mul(2)
    started.step()
    started.stop()
    started.stop()
    assert probe.load(tmp_path / "run").steps == [0]


def test_calls_outside_the_session_are_refused(tmp_path: Path) -> None:
    session = probe.mode("stats", out=tmp_path / "a")
    for call in (session.step, session.pause, session.resume):
        with pytest.raises(ProbeError, match="outside the session"):
            call()
    with pytest.raises(ProbeError, match="outside the session"), session.paused():
        pass


def test_stop_in_finally_marks_the_broken_off_step_incomplete(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    session = probe.mode("stats", out=tmp_path / "run", model=model).start()
    with pytest.raises(RuntimeError, match="boom"):
        try:
            model(torch.randn(2, 4)).sum().backward()
            session.step()
            model(torch.randn(2, 4))
            raise RuntimeError("boom")
        finally:
            session.stop()
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1]
    assert run.step_info(0).complete
    info = run.step_info(1)
    assert not info.complete and "RuntimeError: boom" in info.reason
    assert {op.phase for op in run.ops(step=1)} == {"forward"} and run.ops(step=1)
    assert probe.active_session() is None


def test_stop_given_the_error_marks_the_step_incomplete(tmp_path: Path) -> None:
    session = probe.mode("stats", out=tmp_path / "run").start()
    torch.ones(3).mul(2)
    session.stop(ValueError("the loop failed"))
    info = probe.load(tmp_path / "run").step_info(0)
    assert not info.complete and info.reason == "ValueError: the loop failed"


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def test_paused_ops_are_not_recorded_and_use_no_module_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SharedBlockNet()
    x = torch.randn(2, 8)
    with probe.mode("stats", out=tmp_path / "plain", model=model) as session:
        _forward(model, x).backward()
    model.zero_grad(set_to_none=True)
    with probe.mode("stats", out=tmp_path / "paused", model=model) as session:
        with session.paused():
            assert session.is_paused
            with torch.no_grad():
                _forward(model, x)  # an evaluation: neither its ops nor its module calls count
        assert not session.is_paused
        _forward(model, x).backward()
        session.pause()
        _forward(model, x)
        session.resume()
    plain, paused = probe.load(tmp_path / "plain"), probe.load(tmp_path / "paused")
    assert _ids(paused, 0) == _ids(plain, 0)
    assert {op.module_call for op in paused.ops(step=0) if op.module == "inp"} == {0}


def test_a_pause_spans_step(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    session = probe.mode("stats", out=tmp_path / "run", model=model).start()
    model(torch.randn(2, 4))
    session.pause()
    session.step()  # step 0 written; step 1 starts paused
    assert session.is_paused
    model(torch.randn(2, 4))
    with session.paused():  # already paused: stays paused after the block
        model(torch.randn(2, 4))
    assert session.is_paused
    session.resume()
    model(torch.randn(2, 4))
    torch.ones(2).relu()
    session.step()
    session.stop()
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1]
    assert Counter(op.name for op in run.ops(step=1)) == Counter(op.name for op in run.ops(step=0)) + Counter(
        {"aten.ones.default": 1, "aten.relu.default": 1}
    )
    assert {(op.module, op.module_call) for op in run.ops(step=1) if op.module} == {("0", 0)}


def test_step_kind_is_written_to_the_manifest(tmp_path: Path) -> None:
    with probe.mode("stats", out=tmp_path / "run") as session:
        torch.ones(2).mul(2)
        session.step_kind = "evaluation"
        session.step()
        assert session.step_kind is None  # reset for the new step
        torch.ones(2).mul(3)
        session.step()
    run = probe.load(tmp_path / "run")
    assert run.step_info(0).manifest["kind"] == "evaluation"
    assert "kind" not in run.step_info(1).manifest


def test_pause_stops_hook_based_modes_too(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SharedBlockNet()
    x = torch.randn(2, 8)
    targets = {"head": {"output": "tensor"}}
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=targets) as s:
        _forward(model, x).backward()
        with s.paused():
            _forward(model, x)
        s.step()
        with s.paused():
            _forward(model, x)
        _forward(model, x)
        s.step()
    run = probe.load(tmp_path / "run")
    for step in (0, 1):
        rows = [r for r in run.monitor(step=step) if r.kind == "activation" and r.name == "head"]
        assert [(r.slot, r.call) for r in rows] == [("output", 0)], step
