"""A failed write never kills training: faults injected for real into the run directory.

The disk is made full at the lowest level the probe writes through (``open`` for
the step's files, ``os.write`` for the dump's shards) for chosen paths, so a
test can say "step 2 cannot be written" and see training go on bit-identical,
the step given up and named in the run, and later steps written again. Also:
an unwritable directory at the start, the user's exception winning over the
probe's, one writer per rank (a real second process, killed with SIGKILL),
Ctrl-C during the step hand-over, and the monitor's cross-rank reduction (its writer thread)
beside DDP's collectives under torchrun.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import SharedBlockNet, train_in, train_steps

import probe
from probe.errors import ProbeError, ProbeWarning
from probe.modes.dump.mode import DumpMode
from probe.rundir import layout
from probe.rundir.writer import RunWriter
from probe.tracer.dispatch_mode import Tracer

STEPS = 5


class FullDisk:
    """Writes under ``root`` fail with ENOSPC while ``full(path)`` is true for the file written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = str(root.resolve())
        self.full: Callable[[str], bool] = lambda path: False
        self.refused: list[str] = []
        real_open, real_write = builtins.open, os.write
        disk = self

        class FailingFile:
            def __init__(self, file, path: str) -> None:
                self._file, self._path = file, path

            def write(self, data):
                disk.check(self._path)
                return self._file.write(data)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._file.close()

            def __getattr__(self, name):
                return getattr(self._file, name)

        def failing_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
                path = os.path.abspath(os.fspath(file))
                if path.startswith(self.root):
                    return FailingFile(handle, path)
            return handle

        def failing_write(fd, data):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if path.startswith(self.root):
                self.check(path)
            return real_write(fd, data)

        monkeypatch.setattr(builtins, "open", failing_open)
        monkeypatch.setattr(os, "write", failing_write)

    def check(self, path: str) -> None:
        if self.full(path):
            self.refused.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _step_files(step: int) -> Callable[[str], bool]:
    """The disk is full for the files of one step (its partial directory and its shards)."""
    return lambda path: f"/.step{step}.partial/" in path or f"/tensors/step{step}/" in path


def _failures(out: Path) -> list[dict]:
    path = layout.rank_dir(out, 0) / layout.WRITE_FAILURES_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def _probe_warnings(caught: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ProbeWarning) and text in str(w.message)]


# -- during a run -------------------------------------------------------------------------


@pytest.mark.parametrize("async_flush", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("modes", ["stats", "dump"])
def test_a_full_disk_gives_up_the_step_names_it_and_training_goes_on(tmp_path, monkeypatch, modes,
                                                                     async_flush):
    plain_losses, _, plain_params = train_in(None, STEPS)
    out = tmp_path / "run"
    disk = FullDisk(monkeypatch, tmp_path)
    disk.full = _step_files(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _, params = train_in(probe.mode(modes, out=out, async_flush=async_flush), STEPS)
    assert disk.refused  # the fault was hit
    for a, b in zip(losses, plain_losses, strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(params[n], plain_params[n]) for n in plain_params)

    run = probe.load(out)
    assert run.steps == [0, 1, 3, 4]  # later steps are written once there is space again
    assert run.unfinished_steps == [(2, 0)]
    assert all(run.step_info(s).complete and run.ops(s) for s in run.steps)
    partial = layout.partial_step_dir(out, 0, 2)
    assert partial.is_dir() and not any(partial.iterdir())  # emptied: its space is given back
    (failure,) = _failures(out)
    assert failure["step"] == 2 and not failure["tail"]
    assert failure["errno"] == errno.ENOSPC and failure["error"] == os.strerror(errno.ENOSPC)
    assert failure["directory"] == ".step2.partial" and failure["file"].startswith(".step2.partial/")
    assert failure["ops"] == len(run.ops(1)) and modes in failure["modes"]
    said = _probe_warnings(caught, "cannot write step 2")
    assert len(said) == 1 and layout.WRITE_FAILURES_FILE in said[0]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 4 MiB file system (needs root and mount), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    # Unbuffered: a buffered file keeps the bytes a short write left, and its close flushes them
    # into the full disk again (the ENOSPC then escapes, as the free space modulo 64 KiB decides).
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_a_real_full_file_system_mid_run(small_tmpfs):
    plain_losses, _, _ = train_in(None, steps=4)
    out = small_tmpfs / "run"
    torch.manual_seed(0)
    model = SharedBlockNet()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with probe.mode("stats", out=out, async_flush=False) as session:
        for step in range(4):
            x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            filler = _fill(small_tmpfs) if step == 2 else None
            session.step()
            if filler is not None:
                filler.unlink()  # space returns
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    run = probe.load(out)
    assert run.steps == [0, 1, 3] and run.unfinished_steps == [(2, 0)]
    (failure,) = _failures(out)
    assert failure["step"] == 2 and failure["errno"] == errno.ENOSPC


def test_dump_on_error_raise_still_stops_training_on_a_full_disk(tmp_path, monkeypatch):
    out = tmp_path / "run"
    disk = FullDisk(monkeypatch, tmp_path)
    disk.full = _step_files(1)
    with pytest.raises(ProbeError, match=r"dump|on_error"):
        train_in(probe.mode("dump", out=out, on_error="raise", async_flush=False), STEPS)
    assert [f["step"] for f in _failures(out)] == [1]


@pytest.mark.parametrize("async_flush", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("modes,options", [("stats", {}), ("dump", {"on_error": "raise"})],
                         ids=["stats", "dump-raise"])
def test_the_users_exception_wins_over_a_failing_final_flush(tmp_path, monkeypatch, modes, options,
                                                             async_flush):
    out = tmp_path / "run"
    disk = FullDisk(monkeypatch, tmp_path)
    disk.full = _step_files(1)
    torch.manual_seed(0)
    model = SharedBlockNet()
    with (warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="the user's own"),
          probe.mode(modes, out=out, async_flush=async_flush, **options) as session):
        warnings.simplefilter("always")
        train_steps(model, 1, session=session)
        model(torch.randn(4, 8))
        raise ValueError("the user's own")
    assert disk.refused
    assert _probe_warnings(caught, "cannot write step 1")
    if options.get("on_error") == "raise":  # the probe's own ProbeError was said, not raised
        assert _probe_warnings(caught, "the probe's final flush failed too (ProbeError")
    assert [f["step"] for f in _failures(out)] == [1]
    assert probe.load(out).steps == [0]


# -- before tracing ---------------------------------------------------------------------------


def test_a_full_disk_at_the_start_is_a_probe_error_naming_path_and_reason(tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch, tmp_path)
    disk.full = lambda path: True
    with pytest.raises(ProbeError, match="No space left on device") as raised, \
            probe.mode("stats", out=tmp_path / "run"):
        pytest.fail("the session started on a full disk")
    assert str(tmp_path / "run") in str(raised.value)
    # Nothing held: the same directory works once there is space.
    disk.full = lambda path: False
    with probe.mode("stats", out=tmp_path / "run", overwrite=True) as session:
        torch.ones(3).exp()
        session.step()
    assert probe.load(tmp_path / "run").steps == [0]


def test_a_file_in_the_way_is_a_probe_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "run"
    with pytest.raises(ProbeError, match=re.escape(str(tmp_path / "file"))), probe.mode("stats", out=out):
        pass
    # Past the option checks (overwrite=True takes a non-empty directory): the first writes.
    (tmp_path / "run" / layout.RUN_FILE).mkdir(parents=True)
    with pytest.raises(ProbeError, match=r"run\.json.*Is a directory"):
        probe.mode("stats", out=tmp_path / "run", overwrite=True).__enter__()


def test_a_dangling_symlink_as_out_is_a_probe_error(tmp_path):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    out = tmp_path / "run"
    with pytest.raises(ProbeError, match="symbolic link") as raised, probe.mode("stats", out=out):
        pass
    assert str(tmp_path / "gone") in str(raised.value)


# -- one writer per rank ------------------------------------------------------------------------

_HOLDER = """
import sys, time, torch, probe
with probe.mode("stats", out=sys.argv[1], async_flush=False) as session:
    torch.ones(3).exp()
    session.step()
    print("ready", flush=True)
    time.sleep(120)
"""


def test_a_second_writer_of_a_rank_is_refused_naming_the_holder_until_it_dies(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parent.parent)
    try:
        assert holder.stdout.readline().strip() == "ready"
        refused = rf"pid {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(ProbeError, match=refused), probe.mode("stats", out=out, overwrite=True):
            pass
        # overwrite=True removed nothing: the lock comes first.
        assert (layout.step_dir(out, 0, 0) / layout.MANIFEST_FILE).exists()
        assert probe.load(out).process(0)["pid"] == holder.pid
    finally:
        holder.kill()  # SIGKILL: no cleanup runs; the kernel frees the lock
        holder.wait()
    with probe.mode("stats", out=out, overwrite=True) as session:
        torch.ones(3).exp()
        torch.ones(3).exp()
        session.step()
    run = probe.load(out)
    assert run.steps == [0] and len(run.ops(0)) == 4  # the new run alone
    assert run.process(0)["pid"] == os.getpid()


def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    process = {"rank": 0, "world_size": 1}
    first = RunWriter(tmp_path / "run", process, False, {})
    try:
        with pytest.raises(ProbeError, match=rf"another session of this process \(pid {os.getpid()}"):
            RunWriter(tmp_path / "run", process, True, {})
    finally:
        first.close()
    RunWriter(tmp_path / "run", process, True, {}).close()  # freed by close()


# -- Ctrl-C during the hand-over -----------------------------------------------------------------


def _recorded(run: probe.Run, step: int) -> list[tuple[str, list]]:
    return [(op.id, [t.stats for t in op.outputs]) for op in run.ops(step)]


def _reference(tmp_path: Path, step: int) -> list[tuple[str, list]]:
    """The op ids and statistics of ``step`` in an uninterrupted run of the same training."""
    train_in(probe.mode("stats", out=tmp_path / "reference"), steps=step + 1)
    return _recorded(probe.load(tmp_path / "reference"), step)


@pytest.mark.parametrize("async_flush", [True, False], ids=["async", "sync"])
def test_ctrl_c_in_a_modes_hand_over_keeps_the_steps_records(tmp_path, monkeypatch, async_flush):
    end_step = DumpMode.end_step

    def interrupted(self, step):
        if step == 1:
            raise KeyboardInterrupt
        return end_step(self, step)

    monkeypatch.setattr(DumpMode, "end_step", interrupted)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train_in(probe.mode(["stats", "dump"], out=out, async_flush=async_flush), steps=3)
    run = probe.load(out)
    assert run.steps == [0, 1]  # and no empty step written after it by the block's exit
    info = run.step_info(1)
    assert not info.complete and "KeyboardInterrupt during the step hand-over" in info.reason
    assert _recorded(run, 1) == _reference(tmp_path, step=1)
    assert "dump" not in info.manifest["modes"] and "stats" in info.manifest["modes"]


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason="SIGINT is not Python's KeyboardInterrupt here")
@pytest.mark.parametrize("async_flush", [True, False], ids=["async", "sync"])
def test_a_real_sigint_in_the_hand_over_keeps_the_steps_records(tmp_path, monkeypatch, async_flush):
    end_step = Tracer.end_step
    sent = []

    def signalled(self, wait=True):
        records = end_step(self, wait)
        if self.step == 1 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode: inside the hand-over
        return records

    monkeypatch.setattr(Tracer, "end_step", signalled)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train_in(probe.mode("stats", out=out, async_flush=async_flush), steps=3)
    run = probe.load(out)
    assert run.steps == [0, 1]
    assert not run.step_info(1).complete
    assert _recorded(run, 1) == _reference(tmp_path, step=1)


# -- monitor reduce_ranks beside DDP under torchrun ---------------------------------------------

@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_monitor_reduce_ranks_beside_ddp_with_async_flush_finishes_with_the_right_values(tmp_path):
    from test_distributed import first_step_gradients, torchrun, worker_module

    worker = worker_module()
    torch.manual_seed(0)
    model = worker.TinyNet()
    with torch.no_grad():
        heads = torch.cat([model(worker.batches(rank, 2)[0][0]) for rank in (0, 1)]).double()
    sizes = {f"module.{name}": p.numel() for name, p in model.named_parameters()}
    for attempt in range(3):  # a collective mismatch hung or crashed every run before
        out = tmp_path / f"run{attempt}"
        reports = torchrun(out, "--wrap", "ddp", "--modes", "monitor", "--monitor-reduce")
        run = probe.load(out)
        for rank in (0, 1):
            assert reports[rank]["probed_losses"] == reports[rank]["plain_losses"]
            assert run.steps_of(rank) == [0, 1]
            assert run.step_info(0, rank).manifest["modes"]["monitor"]["reduced"] is True
        # Both ranks wrote the reduced values: over both ranks' batches.
        (head,) = [r for r in run.monitor(0, 0) if r.kind == "activation"]
        assert head.numel == heads.numel()
        assert head.min == pytest.approx(heads.min().item()) and head.max == pytest.approx(heads.max().item())
        assert head.mean == pytest.approx(heads.mean().item(), rel=1e-6)
        assert head.norm == pytest.approx(heads.norm().item(), rel=1e-6)
        for step in (0, 1):
            rows = {rank: [(r.kind, r.name, r.min, r.max, r.mean, r.norm, r.numel)
                           for r in run.monitor(step, rank)] for rank in (0, 1)}
            assert rows[0] == rows[1]
        grads = [r for r in run.monitor(1, 0) if r.kind == "weight_grad"]
        # DDP's gradients are the same on every rank: each element counted once, not once per rank.
        assert {r.name: r.numel for r in grads} == sizes
        first = {f"module.{name}": g for name, g in first_step_gradients(worker).items()}
        for r in run.monitor(0, 0):
            if r.kind == "weight_grad":  # the whole gradient's norm, not sqrt(2) times it
                assert r.norm == pytest.approx(first[r.name].norm().item(), rel=1e-5)
                assert r.mean == pytest.approx(first[r.name].mean().item(), rel=1e-4, abs=1e-8)
