"""Sums the two runs group otherwise: the same terms, added in another order.

Autograd sums the partial gradients of a value read several times where they meet, and where that
is depends on the program's casts: a bf16 model's norm computing in float32 casts its input up, so
the norm's two terms are summed in float32 before the cast back and the residual's term is added
after, where the float32 run adds the three in turn. The last add of each run is the same quantity
(the input's whole gradient), so the two are paired, but their inputs are partial sums of other
terms: ``(g + g) + g*w`` in one run, ``g + (g + g*w)`` in the other. Comparing such inputs position
by position compares different quantities; the add is judged by its result.

Two paired adds are one sum regrouped when expanding each through the adds and value-keeping ops
(casts, same-order views) that its run alone has reaches the same multiset of matched values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from probe.analysis.precision import SAME_ORDER_VIEWS, VALUE_CASTS, short_name
from probe.rundir.run import OpRecord

_SUMS = frozenset({"add", "add_"})
"""What autograd's engine emits where the gradients of one value meet."""


def is_regrouped_sum(a: OpRecord, b: OpRecord, ops_a: dict[int, OpRecord], ops_b: dict[int, OpRecord],
                     only_a: set[int], only_b: set[int],
                     partner_of_b: Callable[[int], int | None], limit: int = 64) -> bool:
    """Whether paired ops ``a`` and ``b`` add the same matched values, grouped otherwise.

    ``ops_*``: each run's ops by index; ``only_*``: the indices of each run's ops the other run
    does not have; ``partner_of_b``: run A's index of a matched op of run B (None when unmatched).
    False when either is not a plain sum, or a term comes from an op of one run only that is not a
    sum or a value-keeping op (what such an op does is for the other rules to judge)."""
    if short_name(a.name) not in _SUMS or short_name(b.name) not in _SUMS:
        return False
    terms_a = _terms(a, ops_a, only_a, lambda index: index, limit)
    terms_b = _terms(b, ops_b, only_b, partner_of_b, limit)
    return terms_a is not None and terms_a == terms_b


def _terms(op: OpRecord, ops: dict[int, OpRecord], only: set[int],
           name_in_a: Callable[[int], int | None], limit: int) -> Counter[tuple[int, int]] | None:
    """The matched values ``op`` sums, in run A's names, each as often as it is added; None when
    one cannot be named."""
    terms: Counter[tuple[int, int]] = Counter()
    stack = [t.source for t in op.inputs if t.source is not None]
    if len(stack) != 2 or len(stack) != len(op.inputs):
        return None  # a scalar or a tensor from outside the step is added: not autograd's sum
    walked = 0
    while stack:
        source = stack.pop()
        if source[0] not in only:
            index = name_in_a(source[0])
            if index is None:
                return None
            terms[(index, source[1])] += 1
            continue
        walked += 1
        producer = ops.get(source[0])
        if producer is None or walked > limit:
            return None
        short = short_name(producer.name)
        sources = [t.source for t in producer.inputs]
        if short in _SUMS and len(sources) == 2 and None not in sources:
            stack.extend(s for s in sources if s is not None)
        elif (short in VALUE_CASTS or short in SAME_ORDER_VIEWS) and len(sources) == 1 \
                and sources[0] is not None:
            stack.append(sources[0])
        else:
            return None
    return terms
