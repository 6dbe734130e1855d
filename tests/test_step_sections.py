"""A mode's part of ``probe summary`` is what its reader declares (issue 34, item 4): the summary
and the console render a mode's ``section()`` without naming the mode, so a plug-in registered
here, which neither knows, is shown as the monitor is."""

from __future__ import annotations

from typing import Any

import torch

import probe
from probe.cli import main
from probe.exporters.console import DETAILED_STEPS
from probe.modes.base import SessionPlugin
from probe.modes.registry import register_mode
from probe.rundir.mode_files import ModeFiles
from probe.rundir.step_section import FollowedSeries, SectionLine, StepSection
from probe.rundir.untrusted_reads import read_json, reading
from probe.rundir.writer import StepWriter

GAUGE_FILE = "gauge.json"


class GaugeFiles(ModeFiles):
    """The test plug-in's reader: one value a step, and what the summary shows of it."""

    def value(self) -> float:
        path = self.where.directory / GAUGE_FILE
        data = read_json(path)
        with reading(path):
            return float(data["value"])

    def section(self) -> StepSection:
        value = self.value()
        return StepSection((SectionLine(f"gauge reads {value:g}", "red" if value > 2 else None),),
                           brief=f"gauge {value:g}",
                           followed=FollowedSeries("gauges (per step)", {"pressure": value}, "run.gauge()"))


class GaugeStep:
    def __init__(self, value: float) -> None:
        self.value = value

    def write(self, writer: StepWriter) -> dict[str, Any]:
        writer.write_json(GAUGE_FILE, {"value": self.value})
        return {"gauge": 1}


@register_mode
class GaugePlugin(SessionPlugin):
    """Works without ops (no observer), as the monitor does: one file a step."""

    name = "test_gauge"
    files = GaugeFiles

    def end_step(self, step: int) -> GaugeStep:
        return GaugeStep(1.0 + step)


def _run(tmp_path, steps: int) -> str:
    out = tmp_path / "run"
    with probe.mode("test_gauge", out=out) as session:
        for _ in range(steps):
            torch.randn(3).sum()
            session.step()
    return str(out)


def test_a_mode_s_section_is_the_step_s_summary_when_it_holds_no_ops(tmp_path, capsys):
    out = _run(tmp_path, steps=3)
    capsys.readouterr()
    assert main(["summary", out]) == 0
    text = capsys.readouterr().out
    for step in range(3):
        assert f"gauge reads {1.0 + step:g}" in text
    assert "gauges (per step)" in text
    row = next(line for line in text.splitlines() if line.startswith("pressure"))
    # The last step's value, the smallest, the largest.
    assert [c for c in row.split() if c != "│"][1:4] == ["3", "1", "3"]
    # A step of no ops that a section speaks for: no op counts, and no "add the stats mode".
    assert "total" not in text and "first non-finite op" not in text


def test_the_one_line_view_of_many_steps_carries_each_section_s_brief(tmp_path, capsys):
    out = _run(tmp_path, steps=DETAILED_STEPS + 1)
    capsys.readouterr()
    assert main(["summary", out]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == DETAILED_STEPS + 1
    for step, line in enumerate(lines):
        assert line.endswith(f"| gauge {1.0 + step:g}"), line
