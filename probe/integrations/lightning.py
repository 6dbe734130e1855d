"""A probe session inside a PyTorch Lightning ``Trainer.fit``: ``ProbeCallback``.

>>> from probe.integrations.lightning import ProbeCallback
>>> trainer = lightning.Trainer(max_steps=100, callbacks=[ProbeCallback("stats", out="runs/pl")])
>>> trainer.fit(module, train_loader, val_loader)

A probe step is one optimizer step: with ``accumulate_grad_batches=k`` it holds the
``training_step``, backward and hooks of all k micro-batches (from ``on_train_batch_start`` to
``on_train_batch_end``) and the optimizer step; it ends at the end of the batch in which the
optimizer stepped (``trainer.global_step`` moved). What the loop does between batches (fetching
data, logging, validation, checkpoints) is not recorded; with ``trace_evaluation=True`` each
validation run inside ``fit`` (the sanity check included) is a probe step of its own, marked
``"kind": "evaluation"`` in its manifest. A failed ``fit`` (``on_exception``) writes the step it
broke off, marked incomplete.

Works with the ``lightning`` package, or with the older ``pytorch_lightning`` when that is the
one installed.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the package under its older name
    from pytorch_lightning import LightningModule, Trainer  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from probe.integrations.loop_session import LoopCallback, LoopSession


class ProbeCallback(Callback, LoopCallback):
    """Runs ``probe.mode(modes, **options)`` over ``Trainer.fit``, one probe step per optimizer
    step.

    ``modes`` and ``options`` are those of :func:`probe.mode` (checked now: a bad one raises
    :class:`probe.ProbeError` here); ``model`` defaults to the ``LightningModule``. Each ``fit``
    is one session (one run directory: give a new ``out``, or ``overwrite=True``, to fit twice).
    ``trace_evaluation``: record validation too, each run as a step of its own.
    """

    def __init__(self, modes: Any = None, *, trace_evaluation: bool = False, **options: Any) -> None:
        self._loop = LoopSession(modes, trace_evaluation, options)
        self._global_step = 0

    # -- Trainer events ----------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop.begin(pl_module)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._loop.in_step:
            self._loop.micro_batch_begin()  # the next micro-batch of the same optimizer step
        else:
            self._global_step = trainer.global_step
            self._loop.step_begin()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._global_step:
            self._loop.step_end()
        else:  # accumulating: the optimizer steps after a later micro-batch
            self._loop.micro_batch_end()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop.evaluation_begin()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop.evaluation_end()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop.end()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._loop.end(exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._loop.end()
