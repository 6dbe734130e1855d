"""A probe session inside the Hugging Face ``Trainer``: ``ProbeCallback``.

>>> from probe.integrations.hf_trainer import ProbeCallback
>>> probe_cb = ProbeCallback("stats", out="runs/hf")
>>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[probe_cb])
>>> try:
...     trainer.train()
... finally:
...     probe_cb.stop()   # after a normal end a no-op; after a crash, writes the step it broke off

A probe step is one optimizer step (``on_step_begin`` .. ``on_step_end``): with
``gradient_accumulation_steps=k`` it holds the forward and backward of all k micro-batches, the
gradient clipping and the optimizer step. The Trainer's work between optimizer steps (fetching
batches, logging, evaluation, checkpoints) is not recorded; with ``trace_evaluation=True`` each
evaluation the Trainer runs during ``train()`` is a probe step of its own, marked
``"kind": "evaluation"`` in its manifest. It begins when the Trainer decides to evaluate
(``control.should_evaluate`` after a step or an epoch, or ``eval_on_start``), so it also holds
the few ops of the Trainer's logging at that point, and ends at ``on_evaluate``.

With ``rewind=True`` the callback keeps the start of each optimizer step (parameters, buffers,
optimizer and loss-scaler state, RNG, the step's micro-batches) and rewinds a step that ends with a
non-finite loss or parameter, or that a monitor alert is about (``docs/rewind.md``): the Trainer's
step is re-run from its start by the Trainer's own ``training_step`` on each kept micro-batch,
gradient clipping and ``optimizer.step()``, the verdict is written, and training goes on from where
the original step ended.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from probe.errors import warn_once
from probe.integrations.loop_session import LoopCallback, LoopSession, StepRewind, summed_loss
from probe.vocabulary.option_values import parse_bool


class ProbeCallback(TrainerCallback, LoopCallback):
    """Runs ``probe.mode(modes, **options)`` over ``Trainer.train()``, one probe step per optimizer
    step.

    ``modes`` and ``options`` are those of :func:`probe.mode` (checked now: a bad one raises
    :class:`probe.ProbeError` here); ``model`` defaults to the Trainer's model. Each ``train()``
    call is one session (one run directory: give a new ``out``, or ``overwrite=True``, to train
    twice). ``trace_evaluation``: record evaluations too, each as a step of its own. ``rewind``:
    keep each optimizer step's start and rewind a step that went wrong (``docs/rewind.md``).
    """

    def __init__(self, modes: Any = None, *, trace_evaluation: bool = False, rewind: bool = False,
                 **options: Any) -> None:
        self._loop = LoopSession(modes, trace_evaluation, options)
        self._rewind = parse_bool("rewind", rewind)
        self._steps: _TrainerSteps | None = None

    # -- Trainer events ----------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._loop.begin(kwargs.get("model"))
        if self._rewind:
            self._steps = _TrainerSteps.install(self)
        if args.eval_on_start:
            self._loop.evaluation_begin()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._steps is not None:
            self._steps.begin(self._loop)
        self._loop.step_begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._steps is not None:
            self._steps.end(self._loop)
        else:
            self._loop.step_end()
        # The flow callback (run before this one) has decided whether an evaluation follows.
        if control.should_evaluate:
            self._loop.evaluation_begin()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_evaluate:
            self._loop.evaluation_begin()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._loop.evaluation_end()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._loop.end()
        if self._steps is not None:
            self._steps.uninstall()
            self._steps = None


def _training_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose ``train()`` is calling ``callback`` (a callback is given no Trainer: it is
    the ``self`` of a frame up the stack, one whose callbacks hold this one)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and callback in candidate.callback_handler.callbacks:
            return candidate
        frame = frame.f_back
    return None


class _TrainerSteps:
    """The Trainer's optimizer step, kept and re-run for the rewind.

    The Trainer fetches a step's micro-batches (``get_batch_samples``) before ``on_step_begin`` and
    sums what ``training_step`` returns into its loss; both are wrapped on the instance for the
    training run, to keep the batch with the step's start and to read the step's loss. The re-run
    is the Trainer's own step: ``training_step`` on each micro-batch, gradient clipping,
    ``optimizer.step()`` and ``zero_grad`` (the learning-rate scheduler is not stepped: the kept
    start holds the learning rate the original step ran with)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._training_step = trainer.training_step
        self._get_batch_samples = trainer.get_batch_samples
        self._fetched: tuple[list[Any], Any] | None = None
        self._losses: list[torch.Tensor] = []
        self._rewind = StepRewind()

    @classmethod
    def install(cls, callback: TrainerCallback) -> _TrainerSteps | None:
        trainer = _training_trainer(callback)
        if trainer is None:
            warn_once("hf-rewind-no-trainer", "ProbeCallback(rewind=True): the Trainer calling the callback "
                      "was not found; steps are not rewound")
            return None
        steps = cls(trainer)
        trainer.training_step = steps._record_loss  # type: ignore[method-assign]
        trainer.get_batch_samples = steps._record_batch  # type: ignore[method-assign]
        return steps

    def uninstall(self) -> None:
        for name in ("training_step", "get_batch_samples"):
            self.trainer.__dict__.pop(name, None)

    def _record_batch(self, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
        samples, items = self._get_batch_samples(*args, **kwargs)
        self._fetched = (samples, items)
        return samples, items

    def _record_loss(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = self._training_step(model, inputs, num_items_in_batch)
        self._losses.append(loss)
        return loss

    def run(self, batch: tuple[list[Any], Any]) -> torch.Tensor | None:
        """The Trainer's optimizer step on ``batch`` (its micro-batches, the item count that scales
        their loss); returns the step's loss as the Trainer sums it."""
        trainer, (micro_batches, items) = self.trainer, batch
        model = trainer.model_wrapped
        # Accelerate's optimizer steps only where the gradients are synchronized, which the Trainer
        # says before each micro-batch (the last one's): a rewind at the next step's begin finds
        # its first micro-batch's "not yet".
        gradients = trainer.accelerator.gradient_state
        synchronized = gradients.sync_gradients
        losses = []
        try:
            for index, inputs in enumerate(micro_batches):
                gradients._set_sync_gradients(index == len(micro_batches) - 1)
                losses.append(self._training_step(model, inputs, items))
            if trainer.args.max_grad_norm > 0:
                trainer._clip_grad_norm(model)
            trainer.optimizer.step()
            model.zero_grad()
        finally:
            gradients._set_sync_gradients(synchronized)
        return summed_loss(losses)

    def begin(self, loop: LoopSession) -> None:
        fetched, self._fetched = self._fetched, None
        self._losses = []
        if fetched is None:  # not fetched through get_batch_samples: nothing to re-run this step on
            return
        optimizer = self.trainer.optimizer
        self._rewind.keep_start(loop, fetched, getattr(optimizer, "optimizer", optimizer),
                                self.trainer.accelerator.scaler)

    def end(self, loop: LoopSession) -> None:
        self._rewind.step_end(loop, self.run, summed_loss(self._losses))
