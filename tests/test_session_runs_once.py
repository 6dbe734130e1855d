"""A session runs once: entering it again after it stopped (a second ``with``, ``start()`` after
the ``with`` block, ``with`` after ``stop()``) or while it runs is a ``ProbeError``, and the
finished run on disk is left exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SharedBlockNet, train_steps

import probe
from probe import ProbeError


def _train_two_steps(session: probe.Session) -> None:
    torch.manual_seed(0)
    train_steps(SharedBlockNet(), 2, session=session)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("first", ["with", "start"])
@pytest.mark.parametrize("again", ["with", "start"])
def test_a_stopped_session_cannot_run_again(tmp_path: Path, first: str, again: str) -> None:
    out = tmp_path / "run"
    session = probe.mode("stats", out=out)
    if first == "with":
        with session:
            _train_two_steps(session)
    else:
        session.start()
        _train_two_steps(session)
        session.stop()
    written = _files(out)
    assert probe.load(out).steps == [0, 1]

    with pytest.raises(ProbeError, match="runs once") as refused:
        if again == "with":
            with session:
                _train_two_steps(session)
        else:
            session.start()
    assert str(out) in str(refused.value)
    # Nothing was traced, appended or replaced: the finished run is byte for byte what it was.
    assert not session.running and probe.active_session() is None
    assert _files(out) == written
    assert probe.load(out).steps == [0, 1]


def test_a_running_session_cannot_be_entered_again(tmp_path: Path) -> None:
    session = probe.mode("stats", out=tmp_path / "run")
    with session:
        with pytest.raises(ProbeError, match="already running"), session:
            pass
        # The refused entry left the running session alone: it still records and ends normally.
        assert session.running and probe.active_session() is session
        _train_two_steps(session)
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1] and all(run.step_info(s).complete for s in run.steps)


def test_a_failed_start_may_be_retried(tmp_path: Path) -> None:
    out = tmp_path / "run"
    session = probe.mode("stats", out=out)
    out.write_text("a file where the run directory goes")  # after the options' check
    with pytest.raises(ProbeError):
        session.start()
    out.unlink()
    session.start()  # nothing ran: the session may start now
    _train_two_steps(session)
    session.stop()
    assert probe.load(out).steps == [0, 1]
