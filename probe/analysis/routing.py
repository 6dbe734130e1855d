"""Routing: discrete results computed from real values, and what depends on them.

A mixture-of-experts router picks each token's experts with ``topk`` of its logits; a mask
compares scores with a threshold; ``argmax``, ``sort`` and a cast to an integer do the like.
Their results (indices, booleans, counts) are discrete: where two candidates are nearly tied,
a rounding of the scores picks the other one. So when a run computes the scores in lower
precision, the choice of a few tokens legitimately changes, and no numeric bound relates
"inputs differ by rounding" to "indices differ by one expert".

Such an op is a **routing decision** when its real inputs differ within precision (nothing
diverged upstream) and a discrete result differs: the routing differs, consistent with
precision. What is computed from that result (the counts per expert, their cumulative sums,
the tokens gathered per expert, the experts' products) depends on which tokens went where,
and statistics, blind to permutations, cannot say how far it may differ: those ops are
**not compared**, never a pass. Their extent is the **scope** of the decision: the innermost
module holding the decision and every op its discrete results reach through discrete values
(the MoE block, router and experts). Outside it, the block's outputs are real values again,
judged as any other op by their measured difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from probe.analysis.module_graph import common_module, within
from probe.rundir.run import OpRecord, TensorRecord


def discrete(record: TensorRecord) -> bool:
    """Whether ``record`` holds integers or booleans (indices, counts, masks)."""
    return not record.floating


def decides(op: OpRecord) -> bool:
    """Whether ``op`` makes discrete results from real values (``topk``'s indices, a comparison,
    ``argmax``, a cast to an integer)."""
    return any(t.floating for t in op.inputs) and any(discrete(t) for t in op.outputs)


@dataclass
class Routed:
    """One run's ops computed from a routing that differs between the runs, in a step."""

    ops: Sequence[OpRecord]
    scopes: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Op index -> (scope, id of the decision it depends on)."""
    _readers: dict[int, list[OpRecord]] | None = None

    def reads(self, op: OpRecord) -> tuple[str, str] | None:
        """(scope, decision id) when ``op`` reads a routed value inside its decision's scope."""
        for t in op.inputs:
            found = self.scopes.get(t.source[0]) if t.source is not None else None
            if found is not None and _inside(op, found[0]):
                return found
        return None

    def decided(self, op: OpRecord) -> None:
        """Marks ``op`` a routing decision: what reads it inside its scope is routed."""
        self.scopes[op.index] = (self.scope(op), op.id)

    def follows(self, op: OpRecord, found: tuple[str, str]) -> None:
        """Marks ``op`` routed by the decision ``found`` names (:meth:`reads`); discrete
        results it makes of routed values (a second ``topk`` over routed scores) widen the scope
        to where they are read."""
        where = found[0]
        if any(discrete(t) for t in op.outputs):
            where = common_module([where, self.scope(op)])
        self.scopes[op.index] = (where, found[1])

    def scope(self, start: OpRecord) -> str:
        """The innermost module holding ``start`` and every op its discrete results reach
        through discrete values."""
        if self._readers is None:
            self._readers = {}
            for op in self.ops:
                for source in {t.source[0] for t in op.inputs if t.source is not None and discrete(t)}:
                    self._readers.setdefault(source, []).append(op)
        modules, seen, stack = [start.module], {start.index}, [start.index]
        while stack:
            for reader in self._readers.get(stack.pop(), []):
                if reader.index not in seen:
                    seen.add(reader.index)
                    if not _unattributed(reader):
                        modules.append(reader.module)
                    if any(discrete(t) for t in reader.outputs):
                        stack.append(reader.index)
        return common_module(modules)


def _unattributed(op: OpRecord) -> bool:
    """A backward op autograd ran outside every module's hooks (``gather``'s backward, a
    ``scatter_add_``): it belongs to whichever module's forward saved what it reads."""
    return not op.module and op.phase == "backward"


def _inside(op: OpRecord, scope: str) -> bool:
    return within(op.module, scope) or _unattributed(op)
