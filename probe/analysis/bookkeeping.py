"""Which outputs of an op are values of the model, and which are bookkeeping.

The "largest" tables of ``probe summary`` rank ops by their outputs' magnitudes. Three kinds of
output carry no magnitude of the model, and filled those tables (issue 36):

- **an op's by-products**: results after the first of an op whose schema returns several
  tensors, in the forward pass (and its recompute). The first result is the op's value; the
  others are what it saves for its backward or counts beside it: ``nll_loss_forward``'s
  ``total_weight`` (the number of targets: 128), layer norm's mean and rstd, attention's
  logsumexp. (Backward ops' several results are gradients, and stay.) This also leaves out
  ``var_mean``'s mean, ``aminmax``'s max and an RNN's states: rare in the rankings' place,
  and their op's first result still stands for it.
- **counters**: single-element results of the optimizer holding a whole number: AdamW's
  ``step`` (``add_`` of 1, 2, 3, ...). Bias corrections and learning rates are not whole.
- **repeats**: results that are their input again: every view (``detach``, ``view``, ``t``,
  ``expand``, ...: the schema marks the result an alias of an input, so it holds no value of
  its own), and any result whose statistics (min, max, norm, element count) equal those of
  one of the op's inputs (``clone``, ``contiguous``, a copy to the same dtype): the op that
  made the input is ranked for it.
"""

from __future__ import annotations

from functools import cache

from probe.errors import ProbeError
from probe.rundir.records import OpRecord, TensorRecord
from probe.vocabulary.op_class import classify, resolve_op

_FORWARD_PHASES = frozenset({"forward", "recompute"})


@cache
def _schema_facts(name: str) -> tuple[bool, int]:
    """(whether the op's result aliases an input, how many tensors its schema returns); for an
    op this process cannot resolve, (False, 1): nothing is left out for it."""
    try:
        func = resolve_op(name)
    except ProbeError:
        return False, 1
    return classify(func).is_view, len(func._schema.returns)


def _counter(op: OpRecord, tensor: TensorRecord) -> bool:
    stats = tensor.stats
    if op.phase != "optimizer" or stats is None or _numel(tensor) != 1:
        return False
    value = stats.get("max")
    return isinstance(value, float | int) and float(value).is_integer()


def _numel(tensor: TensorRecord) -> int:
    n = 1
    for size in tensor.shape:
        n *= size
    return n


def _same_values(a: TensorRecord, b: TensorRecord) -> bool:
    if a.stats is None or b.stats is None or _numel(a) != _numel(b):
        return False
    return all(a.stats.get(key) is not None and a.stats.get(key) == b.stats.get(key)
               for key in ("min", "max", "norm"))


def model_outputs(op: OpRecord) -> list[TensorRecord]:
    """The outputs of ``op`` that are values of the model: all of them but its by-products,
    counters and repeats of its inputs (see the module's docstring)."""
    is_view, returns = _schema_facts(op.name)
    if is_view:
        return []
    kept = []
    for position, tensor in enumerate(op.outputs):
        if position > 0 and returns > 1 and op.phase in _FORWARD_PHASES:
            continue
        if _counter(op, tensor) or any(_same_values(tensor, source) for source in op.inputs):
            continue
        kept.append(tensor)
    return kept
