"""The step cycle of a probe session driven by a training loop's events, for the callbacks.

A framework's loop says when an optimizer step begins and ends, and when an evaluation
begins and ends; :class:`LoopSession` turns that into ``start``/``step``/``pause``/``resume``/
``stop`` on one :class:`probe.Session`:

- the session starts paused; it records from ``step_begin`` to ``step_end`` (one optimizer
  step, every micro-batch inside it: the loop calls ``micro_batch_end`` / ``micro_batch_begin``
  around what it does between them) and is paused in between;
- an evaluation is left unrecorded, or, with ``trace_evaluation=True``, recorded as a step of
  its own whose manifest says ``"kind": "evaluation"``;
- ``end`` stops the session, marking the step it broke off incomplete when given an error.

:class:`StepRewind` adds the rewind (``rewind=True`` on the callbacks, ``docs/rewind.md``) to a step
the framework's loop runs itself: its start kept before it, its end checked, its re-run the
callback's own replay of the framework's step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from probe.errors import warn_once
from probe.rewind import rewinder_of
from probe.session import Session
from probe.vocabulary.option_values import parse_bool

EVALUATION = "evaluation"
"""The manifest ``"kind"`` of a step that recorded an evaluation."""


class LoopSession:
    """One probe session per training run (``begin`` .. ``end``), driven by loop events."""

    def __init__(self, modes: Any, trace_evaluation: Any, options: dict[str, Any]) -> None:
        self.trace_evaluation = parse_bool("trace_evaluation", trace_evaluation)
        self._modes = modes
        self._options = options
        # Every bad option is a ProbeError now, when the callback is made, not mid-training.
        Session(modes, **options)
        self.session: Session | None = None
        self._in_step = False
        self._in_evaluation = False

    @property
    def out(self) -> Path | None:
        """The run directory of the current (or last) session; None before the first."""
        return self.session.out if self.session is not None else None

    def begin(self, model: Any) -> None:
        """Training starts: start the session, paused until the first optimizer step.

        ``model``: the framework's model, the root of module names unless ``model=`` was given.
        """
        if self.session is not None and self.session.running:
            # The last run of this callback raised where the framework calls no hook: end it now.
            self.end(RuntimeError("training ended without the framework's end-of-training hook"))
        options = dict(self._options)
        if options.get("model") is None and model is not None:
            options["model"] = model
        session = Session(self._modes, **options)
        session.start()
        session.pause()
        self.session, self._in_step, self._in_evaluation = session, False, False

    def step_begin(self) -> None:
        """An optimizer step begins (before its first micro-batch)."""
        session = self._running()
        if session is None:
            return
        if self._in_evaluation:  # an evaluation began but its end was never signalled
            self.evaluation_end()
        self._in_step = True
        session.resume()

    def micro_batch_end(self) -> None:
        """Between two micro-batches of one optimizer step: the loop's own work is not recorded."""
        session = self._running()
        if session is not None and self._in_step:
            session.pause()

    def micro_batch_begin(self) -> None:
        """The next micro-batch of the open optimizer step begins."""
        session = self._running()
        if session is not None and self._in_step:
            session.resume()

    def step_end(self) -> None:
        """The optimizer step is done: write it; record nothing until the next one begins."""
        session = self._running()
        if session is None or not self._in_step:
            return
        self._in_step = False
        session.resume()  # a step ended while paused between micro-batches is still this step
        session.step()
        session.pause()

    @property
    def in_step(self) -> bool:
        """Whether an optimizer step is open (its micro-batches so far recorded)."""
        return self._in_step

    def evaluation_begin(self) -> None:
        """An evaluation begins: with ``trace_evaluation``, record it as a step of its own."""
        session = self._running()
        if session is None or not self.trace_evaluation or self._in_evaluation:
            return
        if self._in_step:
            # Its ops would land among the open step's micro-batches.
            warn_once(
                "integration-eval-mid-step",
                "an evaluation ran inside a gradient-accumulation window (between micro-batches of "
                "one optimizer step): it is left untraced; align the evaluation interval with the "
                "optimizer steps to trace it",
            )
            return
        self._in_evaluation = True
        session.step_kind = EVALUATION
        session.resume()

    def evaluation_end(self) -> None:
        """The evaluation is done: write its step, if it was recorded."""
        session = self._running()
        if session is None or not self._in_evaluation:
            return
        self._in_evaluation = False
        session.step()
        session.pause()

    def end(self, error: BaseException | None = None) -> None:
        """Training ended (``error``: the exception that ended it): stop the session. Idempotent."""
        session = self.session
        if session is None or not session.running:
            return
        if error is None and self._in_evaluation:
            self.evaluation_end()
        self._in_step = self._in_evaluation = False
        session._stop(error)  # with an error, the broken-off step is written marked incomplete

    def _running(self) -> Session | None:
        session = self.session
        return session if session is not None and session.running else None


class LoopCallback:
    """What both frameworks' callbacks offer the user on top of their loop events."""

    _loop: LoopSession

    @property
    def session(self) -> Session | None:
        """The session of the current (or last) training run; None before the first."""
        return self._loop.session

    @property
    def out(self) -> Path | None:
        """Its run directory, for :func:`probe.load`."""
        return self._loop.out

    def stop(self, error: BaseException | None = None) -> None:
        """End the session if training did not (a framework may call no hook when training
        raises); safe to call always. In ``finally:``/``except:`` the exception being handled
        marks the step it broke off incomplete."""
        self._loop.end(error if error is not None else sys.exc_info()[1])


class StepRewind:
    """The rewind of the steps a framework's loop runs (``session.step_fn`` for a loop the probe does
    not call): :meth:`keep_start` before the step's first micro-batch, :meth:`step_end` in place of
    ``LoopSession.step_end``. A failure of the rewind's own is a warning and the rewind turned off
    for the run, never an exception in the training loop."""

    def __init__(self) -> None:
        self._kept = False
        self._off = False

    def keep_start(self, loop: LoopSession, batch: Any, optimizer: Any = None, scaler: Any = None) -> None:
        """The step about to run on ``batch`` (every micro-batch of it; None: given to :meth:`step_end`):
        keep its start."""
        session = loop._running()
        self._kept = False
        if session is None or self._off:
            return
        try:
            rewinder_of(session).keep_start(batch, optimizer, scaler)
            self._kept = True
        except Exception as e:
            self._turn_off(e)

    def step_end(self, loop: LoopSession, rerun: Callable[[Any], Any], loss: Any, batch: Any = None) -> None:
        """The step ended with ``loss`` (None where the loop gives none: then the parameters are checked
        alone); ``rerun(batch)`` runs it again from its start; ``batch``: what it ran on, where
        :meth:`keep_start` was not given it. Ends the step, then rewinds it if it went wrong."""
        session, kept, self._kept = loop._running(), self._kept, False
        trigger = None
        if session is not None and kept and not self._off:
            try:
                rewinder = rewinder_of(session)
                if batch is not None:
                    rewinder.keep_batch(batch)
                trigger = rewinder.step_ran(rerun, loss)
            except Exception as e:
                self._turn_off(e)
        loop.step_end()
        if session is not None and kept and not self._off and session.running:
            try:
                rewinder_of(session).step_ended(trigger)
            except Exception as e:
                self._turn_off(e)

    def _turn_off(self, error: Exception) -> None:
        self._off = True
        warn_once("integration-rewind-off", f"rewind=True: the step's start could not be kept or rewound "
                  f"({type(error).__name__}: {error}); training goes on without the rewind")


def summed_loss(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """A step's loss from its micro-batches' (the sum the frameworks log), computed one way for the
    step and for its re-run so that the two compare bit for bit; None without any."""
    return torch.stack([loss.detach() for loss in losses]).sum() if losses else None
