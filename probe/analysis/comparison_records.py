"""What a comparison of two runs finds: per tensor, per op, per step (with what the step hands
to the next), and the first divergence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from probe.analysis.verdicts import RULE_SHAPE, VERDICTS
from probe.rundir.run import OpRecord

METRIC_KEYS = ("cosine", "max_abs_err", "max_rel_err", "one_thousandth_ratio",
               "five_thousandth_ratio", "rmse", "max_ulp", "ref_rms", "max_ulp_at_scale")

STATS_KEYS = ("max_rel", "min_rel", "mean_rel", "norm_rel", "nan_diff", "inf_diff")

_WORSE_IS_LOWER = {"cosine", "one_thousandth_ratio", "five_thousandth_ratio"}

@dataclass(slots=True)  # a report holds one an op: no __dict__ each
class TensorComparison:
    io: str
    position: int
    verdict: str
    message: str = ""
    kind: str = "shape"
    """What was compared: "data", "stats", only "shape" (and dtype), or "none" (not compared)."""
    metrics: dict[str, float] = field(default_factory=dict)
    rule: str = RULE_SHAPE
    """The rule that decided the verdict (``probe.analysis.verdicts.RULE_*``)."""

@dataclass(slots=True)  # a report holds one an op: no __dict__ each
class OpComparison:
    step: int
    rank: int
    a: OpRecord | None
    b: OpRecord | None
    match: str
    verdict: str
    message: str = ""
    outputs: list[TensorComparison] = field(default_factory=list)
    rule: str = ""
    """The rule that decided the verdict (``probe.analysis.verdicts.RULE_*``)."""
    enters: bool = False
    """A divergence enters at this op: its difference is more than its inputs and each run's
    precision explain (or it lowers precision unexplained)."""
    input_error: float | None = None
    """The inputs' difference (relative) the propagation rule judged this op by, when it did:
    how far its outputs' elements may be apart, whatever their statistics show."""

    def row(self) -> dict[str, Any]:
        op = self.a or self.b
        assert op is not None
        ref = self.a.outputs[0] if self.a and self.a.outputs else None
        test = self.b.outputs[0] if self.b and self.b.outputs else None
        row: dict[str, Any] = {
            "step": self.step, "rank": self.rank,
            "op_a": self.a.id if self.a else None, "op_b": self.b.id if self.b else None,
            "name": op.name, "module": op.module, "phase": op.phase, "match": self.match,
            "dtype_a": ref.dtype if ref else None, "dtype_b": test.dtype if test else None,
            "shape_a": list(ref.shape) if ref else None, "shape_b": list(test.shape) if test else None,
            "compared": ",".join(sorted({t.kind for t in self.outputs})) or None,
            "verdict": self.verdict, "rule": self.rule, "message": self.message, "enters": self.enters,
        }
        for key in (*METRIC_KEYS, *STATS_KEYS):
            values = [t.metrics[key] for t in self.outputs if key in t.metrics]
            if values:
                row[key] = min(values) if key in _WORSE_IS_LOWER else max(values, key=abs)
        return row

@dataclass
class Divergence:
    step: int
    rank: int
    op_a: OpRecord | None
    """Run A's op where the divergence enters; None when it enters through ops of run B only."""
    op_b: OpRecord | None
    comparison: OpComparison
    inputs_assumed: bool
    """True when the producer of some input could not be matched or compared and was assumed to agree."""
    chain: list[str]
    """Op ids the divergence propagates through, in execution order (run A's, after a B-only start)."""

    @property
    def op(self) -> OpRecord:
        """The op where the divergence enters (run A's, or run B's when it exists in B only)."""
        op = self.op_a or self.op_b
        assert op is not None
        return op

    @property
    def rule(self) -> str:
        return self.comparison.rule

@dataclass(frozen=True)
class Carry:
    """What the steps compared before this one say about the state the runs carry into it
    (weights, optimizer state, buffers: the inputs from outside the step).

    A difference explained once stays explained: the weights two runs of different precision
    hold at step k differ by what their earlier steps computed differently, and that is no
    new divergence. Two runs that computed alike bit for bit so far are in the exact regime:
    any difference in what they carry, however small, entered between the steps."""

    before: int = 0
    """How many steps were compared before this one."""
    identical: bool = True
    """Every op compared so far had bit-identical results (statistics or data) in both runs."""
    explained: bool = True
    """No divergence entered in the steps before."""
    bound: float = 0.0
    """The largest difference (relative, as ``error_of`` measures it) of a value the steps
    before wrote and that may be read again: optimizer outputs and in-place writes."""
    absolute: float = 0.0
    """The largest such difference times its value's norm: what a part of one may differ by,
    absolutely (a split of a parameter read whole by no op is no value the steps wrote)."""
    state_a: dict[tuple, float | None] = field(default_factory=dict, repr=False)
    """Run A's values the step before left (what it wrote in place or in its optimizer, and
    what it read from outside), by :func:`fingerprint`, with their difference from run B's."""
    state_b: frozenset[tuple] = field(default=frozenset(), repr=False)
    """Run B's values the step before may have left (what forward made included: a value run B
    holds that is none of these changed between the steps), by :func:`fingerprint`."""
    same_kernels: bool = False
    """The runs computed with the same kernels (:func:`run_identity.same_kernels`): in the exact
    regime, an op whose inputs are bit-identical and whose results are not computed otherwise."""
    elements_apart: float = 0.0
    """How far apart, element by element, the state this step reads is (the largest sketched
    distance of an input from outside the step, forward and backward; 0 without sketches): what
    a value computed from it may differ by where its own elements were not measured."""

@dataclass
class StepComparison:
    step: int
    rank: int
    comparisons: list[OpComparison]
    divergence: Divergence | None
    policy: str = ""
    """How run B's precision differs from run A's, in words ("bf16 autocast")."""
    carry: Carry = field(default_factory=Carry)
    """What this step hands to the next (:class:`Carry`)."""
    unreadable: str | None = None
    """Why the step could not be read in one run or both (its ops are "not compared"); None when read."""
    apart: str | None = None
    """Why the runs' training parted in this step or before it (one run's loss scaler skipped an update
    the other made: ``probe.analysis.scaler_skips``): its ops from there, and every later step's, are
    "not compared"; None while they train alike."""

def count_verdicts(comparisons: list[OpComparison]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    for c in comparisons:
        counts[c.verdict] += 1
    return counts
