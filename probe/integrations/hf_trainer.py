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
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from probe.integrations.loop_session import LoopCallback, LoopSession


class ProbeCallback(TrainerCallback, LoopCallback):
    """Runs ``probe.mode(modes, **options)`` over ``Trainer.train()``, one probe step per optimizer
    step.

    ``modes`` and ``options`` are those of :func:`probe.mode` (checked now: a bad one raises
    :class:`probe.ProbeError` here); ``model`` defaults to the Trainer's model. Each ``train()``
    call is one session (one run directory: give a new ``out``, or ``overwrite=True``, to train
    twice). ``trace_evaluation``: record evaluations too, each as a step of its own.
    """

    def __init__(self, modes: Any = None, *, trace_evaluation: bool = False, **options: Any) -> None:
        self._loop = LoopSession(modes, trace_evaluation, options)

    # -- Trainer events ----------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._loop.begin(kwargs.get("model"))
        if args.eval_on_start:
            self._loop.evaluation_begin()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._loop.step_begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
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
