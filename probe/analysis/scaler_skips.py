"""A step one run's loss scaler skipped and the other's did not: where the two runs' training parts.

A ``GradScaler`` multiplies the loss by its scale; where a scaled gradient overflows the dtype it
is computed in, it skips the optimizer step and lowers the scale. That is loss scaling working as
designed: an fp16 run's first steps at the default scale 65536 are skipped this way, and an fp32
run beside it, at the same scale, skips none. From the overflow on, the two runs do different
things by design: one run's gradients are Inf where the other's are finite, one run updates its
weights and the other does not, and every later step starts from weights one update apart.

None of that is a divergence, and none of it can be compared: the step's ops from the first
overflow on, and every later step, are "not compared", with this reason. What came before the
overflow (the forward, the backward up to it) is compared as usual. An overflow that began in the
forward is the model's, not the scaler's (``handled_by_scaler``): it is judged as any non-finite
value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from probe.analysis.verdicts import NOT_COMPARED, RULE_NOT_COMPARED
from probe.errors import ProbeError
from probe.rundir.loss_scaler import ScalerStep, handled_by_scaler
from probe.rundir.nonfinite_origins import nonfinite_origins_in
from probe.rundir.records import OpRecord


class _Scaled(Protocol):
    def loss_scaler(self, step: int | None = None, rank: int | None = None) -> ScalerStep | None: ...

    def outputs_nonfinite(self, step: int | None = None, rank: int | None = None) -> bool | None: ...


class _Output(Protocol):
    verdict: str
    message: str
    rule: str


class _Row(Protocol):
    a: OpRecord | None
    b: OpRecord | None
    verdict: str
    message: str
    rule: str
    enters: bool
    outputs: Sequence[_Output]


def one_sided_skip(runs: tuple[_Scaled, _Scaled], ops: tuple[Sequence[OpRecord], Sequence[OpRecord]],
                   step: int, rank: int) -> tuple[int, OpRecord, str] | None:
    """Where exactly one of two runs' loss scalers skipped ``step`` for a gradient overflow it
    handled: (which run, 0 for A or 1 for B; that run's first non-finite op; the reason, in words).
    None otherwise (neither skipped, both did, or the non-finite values began in the forward)."""
    scalers: list[ScalerStep | None] = []
    for run in runs:
        try:
            # A skip leaves Inf or NaN in the gradients: without one (the stats table says, no op
            # decoded), the scaler's ops are not looked for.
            overflowed = run.outputs_nonfinite(step, rank) is not False
            scalers.append(run.loss_scaler(step, rank) if overflowed else None)
        except ProbeError:  # a damaged step: judged as it is
            scalers.append(None)
    skipped = [side for side, scaler in enumerate(scalers) if scaler is not None and scaler.skipped]
    if len(skipped) != 1:
        return None
    side = skipped[0]
    scaler = scalers[side]
    assert scaler is not None
    origins = nonfinite_origins_in(list(ops[side]))
    if not handled_by_scaler(origins, scaler):
        return None
    name, other = "AB"[side], "AB"[1 - side]
    reason = (f"run {name}'s {scaler.describe()} (first at {origins[0].id}); run {other}'s did not skip: "
              "from there the runs' gradients and updates differ by design (loss scaling), and every later "
              "step starts from weights one update apart")
    return side, origins[0], reason


def not_compared_from(rows: Sequence[_Row], side: int, origin: OpRecord, reason: str) -> None:
    """Marks ``rows`` "not compared" from the first whose op of run ``side`` is ``origin`` or comes
    after it (rows are in execution order, the other run's unpaired ops among them)."""
    cut = False
    for row in rows:
        op = row.b if side else row.a
        cut = cut or (op is not None and op.index >= origin.index)
        if cut:
            row.verdict, row.rule, row.message, row.enters = NOT_COMPARED, RULE_NOT_COMPARED, reason, False
            for output in row.outputs:
                output.verdict, output.rule, output.message = NOT_COMPARED, RULE_NOT_COMPARED, reason
