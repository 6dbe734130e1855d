"""A process forked while a session runs neither hangs nor touches the parent's run.

Fork copies the forking thread only: the session's writer threads (the step writer's, the
dump's) are not in the child, and the run directory and its lock are the parent's. Before,
the child's next ``session.step()`` (or its ``sys.exit``, through the end of the block)
waited forever for a job no thread would run, and the parent waiting for the child with it.
Now the child's copy is detached (it traces and writes nothing, says so once), every call
returns at once, and the parent's run reads back whole.

The parent waits for the child with a deadline (``os.waitpid`` polled) and fails the test
instead of hanging; the child always leaves with ``os._exit`` (never back into pytest) or,
in the scripted case, by ``sys.exit`` from inside the ``with`` block.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import probe
from probe.errors import ProbeWarning
from probe.rundir import layout
from probe.rundir.lock import RankLock

DEADLINE = 60.0  # seconds: what a child that returns at once never comes near


def _read_line(fd: int, seconds: float) -> bytes | None:
    """A line from the pipe ``fd``, or None when none came within ``seconds``."""
    data = b""
    deadline = time.monotonic() + seconds
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    return data


def _exit_code(pid: int, seconds: float) -> int | None:
    """The child's exit code, or None when it is still running after ``seconds`` (it is killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def _in_child(session: probe.Session, model: nn.Module, x: torch.Tensor, report: int, go: int) -> None:
    """The forked child: ops, every call of the session, a report to the parent; never returns."""
    code = 1
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.linalg.det(torch.eye(3) * 2)  # an op the parent never runs
            _train_step(model, x)
            session.step()
            session.pause()
            session.resume()
            _train_step(model, x)
            session.step()
            running = session.running
            os.write(report, b"returned\n")
            _read_line(go, DEADLINE)  # the parent has finished its run meanwhile
            session.stop()
        said = [w for w in caught if issubclass(w.category, ProbeWarning) and "forked" in str(w.message)]
        code = 0 if len(said) == 1 and not running else 2
    finally:
        os._exit(code)


@pytest.mark.parametrize(("modes", "async_flush"),
                         [("stats", True), (["stats", "dump"], True), ("stats", False)])
def test_a_forked_child_returns_at_once_and_leaves_the_parent_run_whole(tmp_path, modes, async_flush):
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    out = tmp_path / "run"
    session = probe.mode(modes, out=out, async_flush=async_flush).start()
    pid = None
    try:
        for _ in range(2):
            _train_step(model, x)
            session.step()
        _train_step(model, x)  # a step in progress: the child's copy holds its records
        report_read, report_write = os.pipe()
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            _in_child(session, model, x, report_write, go_read)
        os.close(report_write)
        os.close(go_read)
        assert _read_line(report_read, DEADLINE) == b"returned\n", "the child's step() did not return"
        session.step()
        _train_step(model, x)
        session.step()
        session.stop()
        # The child lives on, and the rank's lock is free: its copy of the descriptor is closed.
        RankLock.acquire(layout.rank_dir(out, 0)).release()
        os.write(go_write, b"go\n")
        code, pid = _exit_code(pid, DEADLINE), None
        assert code == 0, f"the forked child ended with {code} (None: still running; 2: wrong warnings)"
    finally:
        session.stop()
        if pid is not None:
            _exit_code(pid, 0)
    run = probe.load(out)
    assert run.steps == [0, 1, 2, 3]
    assert run.damaged_steps() == [] and run.unfinished_steps == []
    names = {op.name for step in run.steps for op in run.ops(step=step, rank=0)}
    assert "aten.addmm.default" in names
    assert not any("linalg_det" in name for name in names), "the child's ops are in the parent's run"


_SCRIPT = textwrap.dedent("""
    import json, os, sys, time, torch, probe

    out, modes = sys.argv[1], sys.argv[2].split(",")
    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    child = None
    with probe.mode(modes, out=out) as session:
        for _ in range(2):
            model(x).sum().backward()
            session.step()
        model(x).sum().backward()
        pid = os.fork()
        if pid == 0:
            torch.linalg.det(torch.eye(3) * 2)
            model(x).sum().backward()
            session.step()
            sys.exit(0)  # out of the block (SystemExit), then the interpreter's own exit
        deadline = time.monotonic() + float(sys.argv[3])
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                child = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        session.step()
        model(x).sum().backward()
        session.step()
    print(json.dumps({"child": child}))
""")


@pytest.mark.parametrize("modes", ["stats", "stats,dump"])
def test_a_forked_child_that_calls_sys_exit_inside_the_block_ends(tmp_path, modes):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), modes, str(DEADLINE)],
                          capture_output=True, text=True, timeout=DEADLINE + 240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"child": 0}, "the child hung (killed)"
    assert done.stderr.count("was forked from pid") == 1, done.stderr[-3000:]
    run = probe.load(Path(out))
    assert run.steps == [0, 1, 2, 3]
    assert run.damaged_steps() == [] and run.unfinished_steps == []
    assert not any("linalg_det" in op.name for step in run.steps for op in run.ops(step=step, rank=0))
