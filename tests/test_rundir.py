"""The run directory: per rank, per step; nothing lost or half-written when training fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import probe
from probe import ProbeError
from probe.modes.checksums.files import CHECKSUMS_FILE
from probe.modes.stats.file_names import STATS_FILE, STATS_INDEX_FILE
from probe.rundir import layout
from tests.conftest import SharedBlockNet, train_steps


def test_layout_manifest_and_format_version(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("stats", out=tmp_path / "r", model=model) as session:
        train_steps(model, 2, session=session)
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["format"] == "probe-run" and info["format_version"] == layout.FORMAT_VERSION
    assert info["modes"] == ["stats"]
    run = probe.load(tmp_path / "r")
    assert run.ranks == [0] and run.steps == [0, 1]
    step = run.step_info(1)
    assert step.complete and step.manifest["ops"] == len(run.ops(1))
    assert step.manifest["phases"]["backward"] > 0
    assert run.module_types(1)["block.fc"] == "Linear" and run.module_types(1)[""] == "SharedBlockNet"
    assert sorted(os.listdir(tmp_path / "r" / "rank0" / "step1")) == sorted(
        [layout.MANIFEST_FILE, layout.OPS_FILE, STATS_FILE, STATS_INDEX_FILE,
         layout.MODULES_FILE, CHECKSUMS_FILE]  # checksums: with model= (docs/format.md)
    )


def test_exception_in_training_keeps_flushed_steps_and_marks_the_failing_one(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with (
        pytest.raises(RuntimeError, match="diverged"),
        probe.mode("stats", out=tmp_path / "r", model=model) as session,
    ):
        train_steps(model, 2, session=session)
        model(torch.randn(4, 8)).exp()
        raise RuntimeError("loss diverged")
    run = probe.load(tmp_path / "r")
    assert run.steps == [0, 1, 2]
    assert run.step_info(0).complete and run.step_info(1).complete
    last = run.step_info(2)
    assert not last.complete and "diverged" in last.reason
    # The ops leading up to the failure were kept, statistics included.
    exp = [op for op in run.ops(2) if op.name == "aten.exp.default"]
    assert len(exp) == 1 and exp[0].outputs[0].stats is not None


@pytest.mark.parametrize("async_flush", [False, True])
def test_killed_process_leaves_every_flushed_step_readable(tmp_path, async_flush):
    out = tmp_path / "r"
    script = textwrap.dedent(
        f"""
        import os, torch, probe
        with probe.mode("stats", out={str(out)!r}, async_flush={async_flush}) as session:
            for step in range(3):
                torch.randn(16).exp().sum()
                session.step()
            torch.randn(4).neg()
            os._exit(9)  # dies mid-step, without unwinding
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 9, result.stderr
    run = probe.load(out)
    # Synchronous: every ended step is on disk. Asynchronous: when step() returns
    # every earlier step is; the last one may have been in flight, and is then
    # either whole or reported as unfinished, never half-read.
    if async_flush:
        assert run.steps[:2] == [0, 1] and run.steps in ([0, 1], [0, 1, 2])
        assert run.unfinished_steps in ([], [(2, 0)])
    else:
        assert run.steps == [0, 1, 2]
    assert all(run.step_info(s).complete for s in run.steps)
    assert [op.name for op in run.ops(1)][-1] == "aten.sum.default"


def test_unfinished_flush_is_reported_not_read(tmp_path):
    with probe.mode("stats", out=tmp_path / "r") as session:
        torch.ones(2).exp()
        session.step()
    # What a process that died while writing step 1 leaves behind.
    partial = layout.partial_step_dir(tmp_path / "r", 0, 1)
    partial.mkdir()
    (partial / layout.OPS_FILE).write_text('{"i": 0, "id": "trunc')
    run = probe.load(tmp_path / "r")
    assert run.steps == [0]
    assert run.unfinished_steps == [(1, 0)]
    with pytest.raises(ProbeError, match="step 1 of rank 0 is not in"):
        run.ops(1)


def test_unreadable_runs_name_the_file(tmp_path):
    with pytest.raises(ProbeError, match="not a probe run directory"):
        probe.load(tmp_path)
    with probe.mode("stats", out=tmp_path / "r"):
        torch.ones(2).exp()
    run_file = tmp_path / "r" / "run.json"
    info = json.loads(run_file.read_text())
    run_file.write_text(json.dumps({**info, "format_version": layout.FORMAT_VERSION + 1}))
    with pytest.raises(ProbeError, match="upgrade probe"):
        probe.load(tmp_path / "r")
    run_file.write_text(json.dumps(info))
    (tmp_path / "r" / "rank0" / "step0" / layout.OPS_FILE).write_text("{not json")
    with pytest.raises(ProbeError, match=r"ops\.jsonl"):
        probe.load(tmp_path / "r").ops(0)
