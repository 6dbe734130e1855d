"""``probe summary``'s findings over a run are computed by analysis (``analysis.run_summary``) and
the console renders what it is handed (``exporters.console.render_run``), running no analysis."""

from __future__ import annotations

import io

from conftest import run_modes
from rich.console import Console

import probe
from probe.analysis.run_summary import AcrossRanks, RunFindings, RunSummary
from probe.analysis.summary import summarize
from probe.exporters.console import render_run


def _run_with_a_tail(out) -> probe.Run:
    run_modes(out, "stats", tail=True)
    return probe.load(out)


def _rendered(summary: RunSummary) -> str:
    buffer = io.StringIO()
    render_run(Console(file=buffer, width=250), summary)
    return buffer.getvalue()


def test_the_findings_are_computed_once_the_steps_are_read(tmp_path):
    run = _run_with_a_tail(tmp_path / "r")
    summary = RunSummary(run, summarize(run))
    assert [(s.step, s.rank) for s in summary.steps()] == [(0, 0), (1, 0)]
    found = summary.findings()
    assert len(found.tails) == 1 and "recorded after the last session.step()" in found.tails[0]
    assert (found.lost, found.unreadable, found.rewinds, found.links) == ([], [], [], [])
    assert found.across_ranks is None  # one rank: nothing checked across ranks
    assert found.tails[0] in _rendered(RunSummary(run, summarize(run)))


class _Handed(RunSummary):
    """A summary whose findings are given: what the console shows must be these."""

    def findings(self) -> RunFindings:
        return RunFindings([], ["step 7 lost (handed)"], [], ["a handed tail"], [], None,
                           AcrossRanks(None, None, "handed damage"))


def test_the_console_renders_the_findings_it_is_handed(tmp_path):
    run = _run_with_a_tail(tmp_path / "r")
    text = _rendered(_Handed(run, summarize(run)))
    assert "step 7 lost (handed)" in text and "a handed tail" in text
    assert "across ranks: not checked (handed damage)" in text  # though the run has one rank
    assert "recorded after the last session.step()" not in text  # the run's own tail: not looked up here
