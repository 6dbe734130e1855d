"""What the training-loop integration tests ask of a run's op records."""

from __future__ import annotations

import probe


def module_calls(ops: list[probe.OpRecord], module: str, phase: str) -> set[int]:
    """The call indices of ``module`` that have ops of ``phase``."""
    return {op.module_call for op in ops if op.module == module and op.phase == phase}


def optimizer_frames(ops: list[probe.OpRecord]) -> set[str]:
    """The optimizer frames (``optimizer.AdamW[0]``) the step's optimizer ops ran in."""
    return {op.id.split(":")[1] for op in ops if op.phase == "optimizer"}
