"""What ``probe summary`` says of a whole run: each step's summary as it is read, each linked to
the incidents of ``on_anomaly="trace"``, and then the findings over the run (the escalation's
links, lost steps, tails, rewinds, compiled code not observed, and across ranks the rank a
non-finite value started on and the ranks' consistency). Computed here; the console renders it
(``probe.exporters.console.render_run``) and runs no analysis of its own."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from probe.analysis.compiled_regions import not_observed_note
from probe.analysis.consistency import ConsistencyReport, check_consistency
from probe.analysis.escalations import EscalationLinks, IncidentLink
from probe.analysis.summary import StepSummary, lost_steps, rewinds, tails
from probe.errors import ProbeError
from probe.rundir.rank_origin import RankOrigin
from probe.rundir.run import Run


@dataclass(frozen=True)
class AcrossRanks:
    """The checks of a run of several ranks, as far as they got: a damaged step stops them."""

    origin: RankOrigin | None
    """Which rank a non-finite value started on, before it spread; None when none did."""
    consistency: ConsistencyReport | None
    """Whether the ranks agree on replicated values; None when not checked."""
    not_checked: str | None
    """Why the checks stopped (the damaged step's error), or None."""


@dataclass(frozen=True)
class RunFindings:
    """The run-wide findings, in the order the summary says them."""

    links: list[IncidentLink]
    """Each incident and what the steps traced because of it found."""
    lost: list[str]
    """One line per step the run lost."""
    unreadable: list[StepSummary]
    """The steps that could not be read (skipped)."""
    tails: list[str]
    rewinds: list[str]
    not_observed: str | None
    """The note that compiled code ran unobserved ("no non-finite value" must not stand for it)."""
    across_ranks: AcrossRanks | None
    """None for a run of one rank."""


class RunSummary:
    """A run's summary: :meth:`steps` while they are read (one at a time: a long run is shown as it
    is read), then :meth:`findings`."""

    def __init__(self, run: Run, summaries: Iterable[StepSummary]) -> None:
        self.run = run
        self._summaries = summaries
        self._links = EscalationLinks(run)
        self._unreadable: list[StepSummary] = []

    def steps(self) -> Iterator[StepSummary]:
        """The steps' summaries, each readable one noted by the escalation's links."""
        for summary in self._summaries:
            if summary.unreadable is not None:
                self._unreadable.append(summary)
                yield summary
            else:
                yield from self._links.follow([summary])

    def findings(self) -> RunFindings:
        """The run-wide findings, once :meth:`steps` has been read."""
        return RunFindings(self._links.links(), lost_steps(self.run), list(self._unreadable),
                           tails(self.run), rewinds(self.run), not_observed_note(self.run, "this run"),
                           self._across_ranks())

    def _across_ranks(self) -> AcrossRanks | None:
        if len(self.run.ranks) <= 1:
            return None
        origin = None
        try:
            origin = self.run.first_nonfinite_ranks()
            return AcrossRanks(origin, check_consistency(self.run), None)
        except ProbeError as e:  # a damaged step: the steps above are what could be read
            return AcrossRanks(origin, None, str(e))
