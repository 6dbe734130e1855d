"""A low-precision plan from one run's what-if statistics: every matmul (op id, forward and
backward apart) ranked by the risk of computing it under a recipe, with the reason, and the
riskiest kept in high precision (``probe plan RUN --recipe mxfp8``).

Two measures order the matmuls. Values lost whole come first: a matmul one of whose operands
has more than :data:`UNDERFLOW_LIMIT` of its nonzero values quantized to 0 is flagged
(TransformerEngine's ``AutoswitchGemm`` moves a GEMM to high precision at the same 5%), since
values lost whole bias what the matmul computes in a way one step's error does not show (the MX
spikes of arXiv 2506.20752 come from such bias). Within each group, matmuls go by their
predicted relative output error: the expected squared error each operand's rounding alone puts
into the product (its errors per reduction index weighted by the other operand's values there,
:func:`~probe.modes.recipes.quantize.product_error_energy`), summed over the operands, over the
output's sum of squares. Where the operands do not pair up (a convolution's backward), it falls
back to sqrt(sum over operands of their relative squared errors), which takes the product to
mix its operands evenly: it misses the cancellation of a product and what an outlier weighs
(benchmarks/recipes.py measures how well each orders the real output errors). Statistics are
pooled over the run's steps (counts and squared sums added) before shares are taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.modes.recipes.files import OperandWhatIf, QuantizationLosses, WhatIfFiles
from probe.modes.recipes.formats import Recipe
from probe.modes.recipes.plan_file import Plan
from probe.modes.registry import RUN_COMMANDS

UNDERFLOW_LIMIT = 0.05
"""The share of an operand's nonzero values quantized to 0 above which its matmul is flagged."""


@dataclass
class OperandRisk(QuantizationLosses):
    """One operand of one matmul, pooled over the steps."""

    role: str
    position: int
    nonzero: int = 0
    underflow: int = 0
    saturated: int = 0
    error_sq: float = 0.0
    signal_sq: float = 0.0
    block_range_log2: float = 0.0
    output_error_sq: float = 0.0
    """Summed over the steps; NaN once a step did not measure it."""
    output_sq: float = 0.0

    def add(self, row: OperandWhatIf) -> None:
        self.nonzero += row.nonzero
        self.underflow += row.underflow
        self.saturated += row.saturated
        self.error_sq += row.error_sq
        self.signal_sq += row.signal_sq
        self.block_range_log2 = max(self.block_range_log2, row.block_range_log2)
        self.output_error_sq += row.output_error_sq
        self.output_sq += row.output_sq

    @property
    def rounding_loss(self) -> float:
        """The relative squared error of quantize-dequantize; a NaN or Inf operand: the worst."""
        return self.relative_mse if math.isfinite(self.relative_mse) else math.inf


@dataclass
class MatmulRisk:
    """One matmul op of the run and the risk of quantizing it."""

    op: str
    module: str
    phase: str
    name: str
    operands: dict[int, OperandRisk] = field(default_factory=dict)

    @property
    def predicted_error(self) -> float:
        """The predicted relative L2 error of the output: the operands' expected squared errors in
        the product over its sum of squares; where they were not measured, sqrt(sum of the
        operands' relative squared errors). A NaN or Inf operand: the worst."""
        operands = self.operands.values()
        if any(math.isinf(o.rounding_loss) for o in operands):
            return math.inf
        output_sq = next(iter(operands)).output_sq
        in_output = [o.output_error_sq for o in operands]
        if all(math.isfinite(e) for e in in_output) and math.isfinite(output_sq) and output_sq > 0:
            return math.sqrt(sum(in_output) / output_sq)
        return math.sqrt(sum(o.rounding_loss for o in operands))

    @property
    def underflow_share(self) -> float:
        """The largest underflow share of its operands."""
        return max(o.underflow_share for o in self.operands.values())

    @property
    def flagged(self) -> bool:
        return self.underflow_share > UNDERFLOW_LIMIT

    def sort_key(self) -> tuple[bool, float, str]:
        return (not self.flagged, -self.predicted_error, self.op)

    def worst(self) -> OperandRisk:
        """The operand that says why: the one losing most values when flagged, else most energy."""
        if self.flagged:
            return max(self.operands.values(), key=lambda o: o.underflow_share)
        return max(self.operands.values(), key=lambda o: o.rounding_loss)

    def reason(self, recipe: str) -> str:
        """One line saying why: the worst operand's losses under ``recipe``."""
        o = self.worst()
        snr = f"SNR {-10 * math.log10(o.relative_mse):.1f} dB" if o.relative_mse > 0 else "exact"
        saturated = f", {100 * o.saturation_share:.2g}% saturate" if o.saturated else ""
        where = self.module or "(no module)"
        short = self.name.split(".")[1] if self.name.count(".") >= 2 else self.name
        return (f"{where} {o.role} ({self.phase} {short}): {100 * o.underflow_share:.2g}% of values "
                f"underflow {recipe}{saturated}, {snr}, max block dynamic range "
                f"2^{o.block_range_log2:.0f}; predicted output error {100 * self.predicted_error:.2g}%")

    def to_json(self, recipe: str) -> dict[str, Any]:
        return {"op": self.op, "module": self.module, "phase": self.phase, "name": self.name,
                "flagged": self.flagged, "underflow": self.underflow_share,
                "predicted_error": self.predicted_error, "reason": self.reason(recipe)}


def rank_matmuls(run: Any, recipe: str, rank: int | None = None) -> list[MatmulRisk]:
    """Every matmul the run's whatif mode measured, riskiest first under ``recipe`` (a recipe the
    run recorded, by name)."""
    rank = run.ranks[0] if rank is None else rank
    found: dict[str, MatmulRisk] = {}
    recorded: set[str] = set()
    steps_with_data = 0
    for step in run.steps_of(rank):
        files = run.mode_files("whatif", step, rank)
        if not isinstance(files, WhatIfFiles):
            continue
        steps_with_data += 1
        recorded |= {r.name for r in files.recipes()}
        rows = [row for row in files.operands() if row.recipe == recipe]
        if not rows:
            continue
        ops = run.ops(step, rank)
        for row in rows:
            record = ops[row.op_index]
            matmul = found.get(record.id)
            if matmul is None:
                matmul = found[record.id] = MatmulRisk(record.id, record.module, record.phase, record.name)
            operand = matmul.operands.get(row.position)
            if operand is None:
                operand = matmul.operands[row.position] = OperandRisk(row.role, row.position)
            operand.add(row)
    if not steps_with_data:
        raise ProbeError(f"{run.path} holds no what-if statistics: record the run with "
                         "probe.mode('whatif', recipes=[...]) first")
    if recipe not in recorded:
        raise ProbeError(f"recipe {recipe!r} was not recorded in {run.path}; recorded: {sorted(recorded)}")
    return sorted(found.values(), key=MatmulRisk.sort_key)


def plan(run: Any, recipe: str, keep_fraction: float = 0.1, rank: int | None = None) -> Plan:
    """The plan for ``recipe``: the riskiest ``keep_fraction`` of the matmuls (rounded up) keep
    high precision, the rest are quantized."""
    if not 0.0 <= keep_fraction <= 1.0:
        raise ProbeError(f"keep fraction {keep_fraction!r} is not between 0 and 1")
    ranking = rank_matmuls(run, recipe, rank)
    files = next(f for s in run.steps_of(run.ranks[0] if rank is None else rank)
                 if isinstance(f := run.mode_files("whatif", s, rank), WhatIfFiles))
    chosen: Recipe = next(r for r in files.recipes() if r.name == recipe)
    keep_count = math.ceil(keep_fraction * len(ranking))
    keep = [m.op for m in ranking[:keep_count]]
    quantize = [m.op for m in ranking if m.op not in set(keep)]
    return Plan(chosen, tuple(quantize), tuple(keep), tuple(m.to_json(recipe) for m in ranking))


def write_plan(run: Any, recipe: str, out: str | Path | None = None, keep_fraction: float = 0.1,
               rank: int | None = None) -> tuple[Plan, Path]:
    """:func:`plan` of ``run`` (a loaded run: ``probe.load(path)``; a mode reads runs it is
    handed, never loads one), written to ``out`` (default ``RUN/plan.json``)."""
    made = plan(run, recipe, keep_fraction, rank)
    return made, made.save(Path(out) if out is not None else Path(run.path) / "plan.json")


RUN_COMMANDS["plan"] = write_plan
