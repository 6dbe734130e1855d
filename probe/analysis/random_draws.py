"""Whether a recorded call drew random numbers.

An op that can draw (dropout, attention with ``dropout_p``, ``bernoulli``) given probability 0
draws none its results depend on: HF's attention calls SDPA with ``dropout_p=0.0`` in eval and
often in training, and its results are then a function of its inputs like any other op's. What
reads an op's randomness (the micro-batch fold, the random-draw judgement, the RNG cause of a
conclusion, replay) asks of the call, not of the op's name.
"""

from __future__ import annotations

from probe.rundir.run import OpRecord
from probe.vocabulary.op_class import draws_random, probability_argument


def probability(op: OpRecord, recorded: bool) -> float | None:
    """The probability ``op`` was given (dropout's ``p``, attention's ``dropout_p``), from its
    recorded constants; its schema's default where the call left it out and its run recorded
    constants (``recorded``); None where unknown or it takes none."""
    found = probability_argument(op.name)
    if found is None:
        return None
    position, name, default = found
    value = op.constants.get(str(position), op.constants.get(name))
    if value is None:
        return default if recorded else None
    return value if isinstance(value, float) else None


def draws(op: OpRecord, recorded: bool) -> bool | None:
    """Whether the call ``op`` drew random numbers its results depend on: an op that can draw,
    unless given probability 0. None where no op of its name is registered in this process.
    ``recorded``: whether its run records constants (else an argument left out is unknown)."""
    random = draws_random(op.name)
    if not random:
        return random
    return probability(op, recorded) != 0.0


def records_constants(ops: list[OpRecord]) -> bool:
    """Whether a run's ops carry their constant arguments (a run recorded before they were is
    read without them: a probability left out is then unknown, not its default)."""
    return any(op.constants for op in ops)
