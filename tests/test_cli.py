"""The probe command: demo, summary, exit codes."""

from __future__ import annotations

import subprocess
import sys

import probe
from probe.cli import main


def test_demo_trains_and_summarises(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "losses:" in text and "step 1" in text and "first non-finite op: none" in text
    run = probe.load(out)
    assert run.steps == [0, 1]
    assert {op.phase for op in run.ops(1)} == {"forward", "backward", "optimizer"}
    assert any(op.module.startswith("layers.1.mlp") for op in run.ops(1))

    assert main(["summary", str(out)]) == 0
    text = capsys.readouterr().out
    assert "largest |max|" in text and "largest norm" in text and "step 0" in text


def test_bad_usage_and_unreadable_input_exit_2(tmp_path, capsys):
    assert main(["summary", str(tmp_path / "missing")]) == 2
    assert "not a probe run directory" in capsys.readouterr().err
    assert main(["demo", "--mode", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown mode 'nope'" in capsys.readouterr().err
    assert main(["demo", "--steps", "0"]) == 2


def test_console_script_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "probe.cli", "summary", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "probe: error:" in result.stderr
