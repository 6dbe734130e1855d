"""Training on a thread the dispatch mode does not see.

A ``TorchDispatchMode`` is per thread: a session entered on the main thread sees none of the ops
of training run in a ``threading.Thread``. Before, such a run had no steps and no warning. The
module and optimizer hooks run on the calling thread, so their calls there are the evidence: the
user is warned once, and each step's manifest (and ``probe summary``) says which thread's ops
were not traced. ``session.trace_thread()`` traces that thread instead.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import probe
from probe.cli import main
from probe.errors import ProbeWarning
from probe.rundir import layout
from tests.conftest import SharedBlockNet, train_steps


def _train_on_thread(session: probe.Session, model: torch.nn.Module, traced: bool) -> None:
    failures: list[BaseException] = []

    def work() -> None:
        try:
            if traced:
                with session.trace_thread():
                    train_steps(model, 2, session=session)
            else:
                train_steps(model, 2, session=session)
        except BaseException as e:  # surfaced on the main thread below
            failures.append(e)

    thread = threading.Thread(target=work, name="trainer")
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


def _records(run: probe.Run) -> list[list[tuple]]:
    return [[(op.id, op.module, op.phase, [t.stats for t in op.outputs]) for op in run.ops(step)]
            for step in run.steps]


def test_training_on_an_untraced_thread_is_warned_about_and_recorded(tmp_path, capsys):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with (pytest.warns(ProbeWarning, match="thread 'trainer'.*dispatch mode is not active"),
          probe.mode("stats", out=tmp_path / "run", model=model) as session):
        _train_on_thread(session, model, traced=False)
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1]  # before: no step at all
    for step in run.steps:
        assert run.ops(step) == []
        untraced = run.step_info(step).manifest[layout.UNTRACED_THREADS_KEY]
        # Each step: the model's call and its submodules' (inp, block twice and its fc and act,
        # drop, head) and the optimizer's step.
        assert list(untraced) == ["trainer"] and untraced["trainer"] >= 9
    assert main(["summary", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.count("NOT TRACED: ops on thread(s) 'trainer'") == 2


def test_trace_thread_records_a_worker_thread_as_the_main_thread(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    # Tensor work on a helper thread outside any module (a data loader) is no evidence of
    # untraced model ops: no warning.
    loader = threading.Thread(target=lambda: torch.ones(4, 8) * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)
        with probe.mode("stats", out=tmp_path / "main", model=model) as session:
            loader.start()
            loader.join()
            train_steps(model, 2, session=session)
    torch.manual_seed(0)
    model = SharedBlockNet()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)  # nothing went unseen
        with probe.mode("stats", out=tmp_path / "thread", model=model) as session:
            _train_on_thread(session, model, traced=True)
    on_main, on_thread = probe.load(tmp_path / "main"), probe.load(tmp_path / "thread")
    assert on_thread.steps == [0, 1]
    assert len(on_thread.ops(0)) > 50  # forward, backward (the autograd engine's) and the optimizer
    assert {op.phase for op in on_thread.ops(0)} == {"forward", "backward", "optimizer"}
    assert _records(on_thread) == _records(on_main)
    for step in on_thread.steps:
        assert layout.UNTRACED_THREADS_KEY not in on_thread.step_info(step).manifest
