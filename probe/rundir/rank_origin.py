"""Which rank a non-finite fault started on, in a multi-rank run.

A NaN made on one rank reaches the others only through a collective: an all-reduce
of gradients hands it to every rank of the group. Each rank then has a first
non-finite op (:func:`probe.rundir.nonfinite_origins.nonfinite_origins_in`), but only one of
them (or several, when ranks went wrong independently) is where the fault began.

The clock that orders ranks is the collectives themselves. Ranks of an SPMD job run
the same collectives in the same order, so "the k-th collective of step s" is one
moment on every rank. An op's place on that clock is how many collectives its rank
had completed in the step when the op ran: the collectives recorded before it, and
the op itself when it is one (its output holds the exchanged result). A rank that
received a NaN through collective #k has its first non-finite op at clock k + 1 or
later, while the rank that sent it had it before, at clock k or earlier; so the
origin is the rank whose first non-finite op has the lowest (step, clock). Ranks
tied at that (step, clock) all went wrong within the same interval between two
collectives, independently, and are all named.

Limits: the clock assumes every rank runs the same sequence of collectives in a step
(data, tensor and sequence parallelism do; pipeline parallelism's point-to-point
send/recv do not, and there the clock is only a rough order). Ops without statistics
are never origins, as in :func:`~probe.rundir.nonfinite_origins.first_nonfinite_in`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from probe.rundir.loss_scaler import handled_by_scaler, scaler_step_in
from probe.rundir.nonfinite_origins import nonfinite_origins_in
from probe.rundir.records import OpRecord


class Run(Protocol):
    """What this module reads of a run (``probe.rundir.run.Run``, which calls it: a Protocol
    here, so the two do not import each other)."""

    @property
    def steps(self) -> list[int]: ...

    @property
    def ranks(self) -> list[int]: ...

    def has_step(self, step: int, rank: int) -> bool: ...

    def ops(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]: ...

    def outputs_nonfinite(self, step: int | None = None, rank: int | None = None) -> bool | None: ...

_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})
# In the collective namespaces but exchanging nothing: the wait that completes a functional
# collective (counting it would count that collective twice), and the autograd wrapper.
_NOT_EXCHANGES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def is_collective(op: OpRecord) -> bool:
    """Whether ``op`` exchanges data with other ranks: it carries a process group, or is a
    ``c10d``/functional collective other than a wait (records of runs that kept no group)."""
    if op.group is not None:
        return True
    parts = op.name.split(".")
    return parts[0] in _COLLECTIVE_NAMESPACES and len(parts) > 1 and parts[1] not in _NOT_EXCHANGES


def collective_clock(ops: list[OpRecord], op: OpRecord) -> int:
    """How many collectives of its step ``op``'s rank had completed when ``op`` ran (``ops``:
    the step's records in execution order): those before it, and ``op`` itself when it is one."""
    return sum(1 for other in ops[:op.index + 1] if is_collective(other))


@dataclass(frozen=True)
class RankFirst:
    """One rank's first non-finite op: in the earliest step that has one, placed on the clock."""

    op: OpRecord
    clock: int
    """Collectives the rank had completed in the step when ``op`` ran (:func:`collective_clock`)."""
    next_collective: OpRecord | None
    """The first collective of the step after ``op`` on this rank (the one that spreads a NaN
    ``op`` made), or None when none follows in the step."""

    @property
    def rank(self) -> int:
        return self.op.rank

    @property
    def step(self) -> int:
        return self.op.step

    @property
    def received(self) -> bool:
        """Whether the NaN came in through a collective: ``op`` is one (its inputs held none)."""
        return is_collective(self.op)

    def where(self) -> str:
        """``before collective #2 (c10d.allreduce_.default)``, ``at collective #2 (...)``."""
        if self.received:
            return f"at collective #{self.clock - 1} ({self.op.name})"
        if self.next_collective is None:
            return f"after the step's last collective (#{self.clock - 1})" if self.clock else \
                "in a step without collectives"
        return f"before collective #{self.clock} ({self.next_collective.name})"


@dataclass(frozen=True)
class RankOrigin:
    """Where a non-finite fault started over the ranks of a run (``run.first_nonfinite_ranks()``)."""

    origins: list[RankFirst]
    """The ranks where it started, by rank: all tied at the lowest (step, clock)."""
    later: list[RankFirst] = field(default_factory=list)
    """Every other rank with a non-finite op, earliest (step, clock) first: the ranks it reached
    (``received``: through a collective) or that went wrong later on their own."""

    @property
    def ranks(self) -> list[int]:
        """The ranks where the fault started (several when tied at the same collective interval)."""
        return [first.rank for first in self.origins]

    @property
    def ops(self) -> list[OpRecord]:
        """The first non-finite op of each origin rank, by rank."""
        return [first.op for first in self.origins]

    @property
    def step(self) -> int:
        return self.origins[0].step

    @property
    def clock(self) -> int:
        """Collectives the origin ranks had completed in :attr:`step` when the fault started."""
        return self.origins[0].clock

    def describe(self) -> str:
        """One line: ``first non-finite: rank 1 op ID (step 1, before collective #2 (NAME));
        ranks 0 received it``."""
        first = self.origins[0]
        if len({f.op.id for f in self.origins}) == 1:
            ranks = ", ".join(map(str, self.ranks))
            what = f"rank{'s' if len(self.origins) > 1 else ''} {ranks} op {first.op.id}"
        else:  # tied ranks that went wrong at different ops
            what = ", ".join(f"rank {f.rank} op {f.op.id}" for f in self.origins)
        line = f"first non-finite: {what} (step {first.step}, {first.where()})"
        received = [f.rank for f in self.later if f.received]
        if received:
            line += f"; ranks {', '.join(map(str, received))} received it"
        own = [f for f in self.later if not f.received]
        if own:
            line += "; non-finite later on " + ", ".join(
                f"rank {f.rank} (step {f.step}, {f.where()})" for f in own)
        return line


def _rank_first(run: Run, rank: int, steps: list[int], handled: bool) -> RankFirst | None:
    """``rank``'s first non-finite op of the earliest of ``steps`` with one (steps whose only
    faults are an overflow the loss scaler handled are passed over unless ``handled``)."""
    for step in steps:
        if not run.has_step(step, rank):
            continue
        # Without a NaN or Inf among the step's outputs (or without statistics, which an origin
        # needs) there is no origin: skip decoding it.
        if not run.outputs_nonfinite(step, rank):
            continue
        ops = run.ops(step, rank)
        origins = nonfinite_origins_in(ops)
        if origins and (handled or not handled_by_scaler(origins, scaler_step_in(ops))):
            op = origins[0]
            following = next((o for o in ops[op.index + 1:] if is_collective(o)), None)
            return RankFirst(op, collective_clock(ops, op), following)
    return None


def rank_origin(run: Run, step: int | None = None, handled: bool = False) -> RankOrigin | None:
    """Where a non-finite fault started over the ranks of ``run`` (in ``step`` when given), or
    None when no rank has one. See the module's docstring for the clock; ``handled``: count the
    gradient overflows the loss scaler handled as faults (:mod:`probe.rundir.loss_scaler`)."""
    steps = run.steps if step is None else [step]
    found = [first for rank in run.ranks if (first := _rank_first(run, rank, steps, handled)) is not None]
    if not found:
        return None
    found.sort(key=lambda f: (f.step, f.clock, f.rank))
    earliest = (found[0].step, found[0].clock)
    return RankOrigin(origins=[f for f in found if (f.step, f.clock) == earliest],
                      later=[f for f in found if (f.step, f.clock) != earliest])
