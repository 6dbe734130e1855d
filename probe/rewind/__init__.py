"""Rewind the bad step: keep each step's start, re-run a step that went wrong under full tracing and
name the cause (transient, precision, data, code). See docs/rewind.md."""

from probe.rewind.rewinder import Rewinder, nonfinite_after_step, rewinder_of
from probe.rewind.start import StepStart
from probe.rewind.verdict import Rerun, Verdict, read_verdicts

__all__ = ["Rerun", "Rewinder", "StepStart", "Verdict", "nonfinite_after_step", "read_verdicts",
           "rewinder_of"]
