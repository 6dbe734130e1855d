"""Each step's start kept whole every N steps, the steps between replayed to reach it.

Keeping a step's start copies the whole training state (:class:`~probe.rewind.start.StepStart`); on
a small model that copy is a few percent of the step. With ``keep_every=N`` it is copied every N
steps; every step keeps only what is cheap and what the replay needs: its :class:`Boundary` (RNG
states, scaler, schedulers, hyper-parameters), its batch and the function that ran it, and, once it
ran, its loss. The start of step k is then the kept start of step k0 <= k with steps k0 .. k-1 run
again on their own batches, each from its own boundary (so RNG draws and learning-rate changes the
loop makes between steps are the original's too).

The replay is checked: each replayed step must give the loss it gave the first time, bit for bit.
Where one does not (a transient fault or non-determinism in a step before k), the start of step k is
not known and the rewind says so; it never classifies from a start it could not reproduce.

What the loop does to the training state between steps is not replayed: a step that starts from
a state written since the step before ended (a weight edited in place under ``no_grad``, a
``.data`` rebound, optimizer state loaded; the tensors' version counters and addresses tell) is
copied whole. A write that bumps no counter (in place through ``.data`` or ``.numpy()``, a bit flip
in memory) is not seen: the replayed start then lacks it, and the rerun, differing from the
original, reads as transient; the verdict says its start was replayed.

Host memory: one copy of the training state, plus N + 1 batches (the steps since the kept start and
the one before them, the data rerun's batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from probe.errors import ProbeError
from probe.rewind.start import Batch, Boundary, KeptBatch, StepStart, same_bits


@dataclass
class _Step:
    """One step since the kept start: how it began and how to run it again."""

    step: int
    boundary: Boundary
    batch: KeptBatch
    fn: Callable[[Batch], Any]
    loss: torch.Tensor | None = None


class ReplayMismatch(ProbeError):
    """A replayed step did not reproduce its loss: the start of a later step is not known."""


class KeptSteps:
    """The starts of the steps since the last whole copy of the training state (``every`` steps
    apart), each reachable by :meth:`start_of`."""

    def __init__(self, start: StepStart, every: int) -> None:
        self.start, self.every = start, checked_every(every)
        self._steps: list[_Step] = []
        """The steps from the one before the kept start to the last one, in order."""
        self._spare: list[KeptBatch] = []
        """Batch buffers of steps dropped, reused."""
        self._ended: list[tuple[int, int]] | None = None
        """The state's version counters when the last step ended (``StepStart.versions``)."""

    def keep(self, step: int, batch: Batch, fn: Callable[[Batch], Any]) -> None:
        """Before ``step`` runs ``fn(batch)``: its start (a whole copy every ``every`` steps)."""
        start = self.start
        whole = start.step is None or step - start.step >= self.every or step < start.step
        # Written between the steps (not by a step a replay runs again): this start is copied.
        whole = whole or self._ended is None or start.versions() != self._ended
        if whole:
            start.keep(step)  # its boundary too; the batch is kept below, with the steps'
            # The step before the kept start stays: its batch is the data rerun's.
            drop = [s for s in self._steps if s.step < step - 1]
            self._steps = [s for s in self._steps if s.step >= step - 1]
            self._spare.extend(s.batch for s in drop)
        kept = self._spare.pop() if self._spare else KeptBatch()
        kept.keep(batch)
        boundary = start.boundary if whole else Boundary.now(start.optimizer, start.scaler, start.stateful)
        assert boundary is not None
        self._steps.append(_Step(step, boundary, kept, fn))

    def ran(self, step: int, loss: torch.Tensor | None) -> None:
        """``step`` ran and returned ``loss`` (a copy, detached): what its replay must give again."""
        if self._steps and self._steps[-1].step == step:
            self._steps[-1].loss = loss
        self._ended = self.start.versions()

    def replayed(self, step: int) -> int | None:
        """The step whose whole copy the start of ``step`` is replayed from (None: copied whole)."""
        start = self.start.step
        return start if start is not None and start < step else None

    def holds(self, step: int) -> bool:
        """Whether the start of ``step`` can be reached."""
        start = self.start.step
        return start is not None and start <= step and any(s.step == step for s in self._steps)

    def start_of(self, step: int) -> StepStart:
        """The start of ``step`` as a :class:`StepStart` of its own (its batch and the one before it
        kept in it), the training state left there. The kept start itself where ``step`` is its step
        and every step is kept whole; otherwise the steps between are replayed (the caller runs this
        untraced and restores the state it wants afterwards). Raises :class:`ReplayMismatch` where a
        replayed step's loss differs from the original's."""
        start = self.start
        if not self.holds(step):
            raise ProbeError(f"the start of step {step} is not kept (kept: steps {self._held()})")
        assert start.step is not None
        start.restore()
        by_step = {s.step: s for s in self._steps}
        for index in range(start.step, step):
            replayed = by_step[index]
            if index != start.step:
                replayed.boundary.restore(start.optimizer, start.scaler, start.stateful)
            loss = replayed.fn(replayed.batch.get())
            if not _same_loss(replayed.loss, loss):
                raise ReplayMismatch(
                    f"replaying step {index} from the start kept at step {start.step} gave the loss "
                    f"{_shown(loss)}, where the step gave {_shown(replayed.loss)} the first time: the start "
                    f"of step {step} is not known (a transient fault or non-determinism in step {index}; "
                    "keep_every=1 keeps every step's start)")
        here = by_step[step]
        if step != start.step:
            here.boundary.restore(start.optimizer, start.scaler, start.stateful)
        exact = StepStart(start.model, start.optimizer, start.scaler, start.keep_grads, start.stateful)
        before = by_step.get(step - 1)
        if before is not None:
            exact.step = step - 1
            exact.keep_batch(before.batch.get())
        exact.keep(step, here.batch.get())
        return exact

    def _held(self) -> str:
        steps = [s.step for s in self._steps if self.start.step is not None and s.step >= self.start.step]
        return f"{steps[0]}..{steps[-1]}" if steps else "none"

    def nbytes(self) -> int:
        """Host bytes held: the whole copy and every kept batch."""
        return self.start.nbytes() + sum(s.batch.copies.nbytes() for s in self._steps)


def checked_every(every: Any) -> int:
    """``keep_every=``, refused naming it unless a whole number of steps >= 1."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ProbeError(f"step_fn(keep_every={every!r}): the number of steps between two whole copies "
                         "of the training state must be an integer >= 1 (1: every step)")
    return every


def _same_loss(original: torch.Tensor | None, again: Any) -> bool:
    if original is None or not isinstance(again, torch.Tensor):
        return original is None and not isinstance(again, torch.Tensor)
    return same_bits(original, again.detach())


def _shown(loss: Any) -> str:
    if isinstance(loss, torch.Tensor):
        return repr(float(loss.detach().double().mean())) if loss.numel() else "an empty tensor"
    return repr(loss)
