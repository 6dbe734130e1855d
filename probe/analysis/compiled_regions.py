"""What a run says about its ``torch.compile``d code: whether it was observed at all.

Under the default ``compiled="eager"`` a compiled region runs eagerly while the probe is active
(every op is seen, but compiled code's own numerics are not: fused kernels, and code that
branches on ``torch.compiler.is_compiling()``). The session counts those entries per step in the
manifest (``layout.COMPILED_EAGER_KEY``); a comparison or a summary of such a run must say that
the compiled numerics were not observed, never let "no divergence" stand for them.
"""

from __future__ import annotations

from probe.errors import ProbeError
from probe.rundir import layout
from probe.rundir.reader import Run


def eager_compiled_entries(run: Run) -> int:
    """How many times, over the run's readable steps and ranks, a compiled region was entered
    and ran eagerly under the probe (0 when none was, or for a run of ``compiled="keep"``)."""
    total = 0
    for rank in run.ranks:
        for step in run.steps_of(rank):
            try:
                count = run.step_info(step, rank).manifest.get(layout.COMPILED_EAGER_KEY, 0)
            except ProbeError:  # a damaged step is reported where it is read; it counts nothing here
                continue
            total += count if type(count) is int and count > 0 else 0
    return total


def not_observed_note(run: Run, label: str) -> str | None:
    """The sentence that says ``run``'s compiled code ran eagerly, or None when it did not.

    ``label`` names the run in the sentence ("run B", or the run's path in a summary)."""
    if not eager_compiled_entries(run):
        return None
    return (f"{label}'s compiled code ran eagerly under the probe: the numerics of compiled code "
            "were not observed; record with compiled='keep'")


def compare_notes(run_a: Run, run_b: Run) -> list[str]:
    """The notes a comparison's conclusion carries about compiled code, run A's then run B's."""
    return [note for run, label in ((run_a, "run A"), (run_b, "run B"))
            if (note := not_observed_note(run, label)) is not None]
