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
from probe.rundir.run import Run


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
    """The notes a comparison's conclusion carries about compiled code, run A's then run B's: code
    that ran eagerly, and compiled regions judged against eager and fp64 on their recorded inputs
    (``probe.analysis.compiled_judge``)."""
    from probe.analysis.compiled_judge import verdict_note

    notes = []
    for run, label in ((run_a, "run A"), (run_b, "run B")):
        for note in (not_observed_note(run, label), verdict_note(run, label)):
            if note is not None:
                notes.append(note)
    return notes


def opened_regions(run: Run, step: int, rank: int) -> dict[str, range]:
    """A step's compiled region ops whose graphs were re-run node by node: region op id -> the
    indices of the ops the re-run recorded (in the modules they came from). Such a region is
    judged at those ops, not as one op (its outputs mix its results with what it saves for
    backward, in any dtype)."""
    from probe.analysis.compiled_judge import manifest_mapping

    opened = manifest_mapping(run, step, rank, layout.COMPILED_OPENED_KEY)
    return {op_id: range(span[0], span[1]) for op_id, span in opened.items()
            if isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)}


def replayed_ops(run: Run, step: int, rank: int) -> tuple[set[int], set[int]]:
    """The indices of the ops that re-runs of compiled region graphs recorded in a step, as
    matching takes them (``probe.analysis.matching.match_ops``): forward ops matched with the eager
    twin's only where input and output shapes agree (a graph's decomposition orders and shapes
    its views its own way); backward ops left unmatched (AOTAutograd orders a backward its own
    way; what the backward computes is seen where it ends, the gradients the optimizer reads)."""
    forward: set[int] = set()
    backward: set[int] = set()
    opened = opened_regions(run, step, rank)
    if not opened:
        return forward, backward
    phases = {op.index: op.phase for op in run.ops(step, rank)}
    for span in opened.values():
        for i in span:
            (forward if phases.get(i) == "forward" else backward).add(i)
    return forward, backward
