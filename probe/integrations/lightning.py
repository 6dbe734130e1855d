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

With ``rewind=True`` the callback keeps the start of each optimizer step (parameters, buffers,
optimizer and loss-scaler state, RNG, and the step's micro-batches as they come) and rewinds a step
that ends with a non-finite loss or parameter, or that a monitor alert is about (``docs/rewind.md``):
the step is re-run from its start by the module's ``training_step`` on each kept micro-batch, the
strategy's backward, and its ``optimizer_step`` (gradient clipping included), with ``self.log``
silenced; the verdict is written and training goes on from where the original step ended. Automatic
optimization with one optimizer only (else a warning, and no rewind).

Works with the ``lightning`` package, or with the older ``pytorch_lightning`` when that is the
one installed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the package under its older name
    from pytorch_lightning import LightningModule, Trainer  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from probe.errors import warn_once
from probe.integrations.loop_session import LoopCallback, LoopSession, StepRewind, summed_loss
from probe.vocabulary.option_values import parse_bool


class ProbeCallback(Callback, LoopCallback):
    """Runs ``probe.mode(modes, **options)`` over ``Trainer.fit``, one probe step per optimizer
    step.

    ``modes`` and ``options`` are those of :func:`probe.mode` (checked now: a bad one raises
    :class:`probe.ProbeError` here); ``model`` defaults to the ``LightningModule``. Each ``fit``
    is one session (one run directory: give a new ``out``, or ``overwrite=True``, to fit twice).
    ``trace_evaluation``: record validation too, each run as a step of its own. ``rewind``: keep
    each optimizer step's start and rewind a step that went wrong (``docs/rewind.md``).
    """

    def __init__(self, modes: Any = None, *, trace_evaluation: bool = False, rewind: bool = False,
                 **options: Any) -> None:
        self._loop = LoopSession(modes, trace_evaluation, options)
        self._global_step = 0
        self._rewind = parse_bool("rewind", rewind)
        self._steps: _FitSteps | None = None

    # -- Trainer events ----------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop.begin(pl_module)
        self._steps = _FitSteps.for_fit(trainer, pl_module) if self._rewind else None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._loop.in_step:
            self._loop.micro_batch_begin()  # the next micro-batch of the same optimizer step
        else:
            self._global_step = trainer.global_step
            if self._steps is not None:
                self._steps.begin(self._loop)
            self._loop.step_begin()
        if self._steps is not None:
            self._steps.micro_batch(batch, batch_idx)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._steps is not None:
            self._steps.micro_batch_end(outputs)
        if trainer.global_step != self._global_step:
            if self._steps is not None:
                self._steps.end(self._loop)
            else:
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


class _FitSteps:
    """Lightning's optimizer step (automatic optimization, one optimizer), kept and re-run for the
    rewind: the micro-batches are kept as ``on_train_batch_start`` sees them and their losses as
    ``on_train_batch_end`` does (the loss over ``accumulate_grad_batches``, as Lightning backpropagates
    it); the re-run is the module's ``training_step``, the strategy's ``backward`` and its
    ``optimizer_step`` with the last micro-batch in its closure, as Lightning runs them."""

    def __init__(self, trainer: Trainer, module: LightningModule) -> None:
        self.trainer, self.module = trainer, module
        self._micro_batches: list[tuple[Any, int]] = []
        self._losses: list[torch.Tensor] = []
        self._rewind = StepRewind()

    @classmethod
    def for_fit(cls, trainer: Trainer, module: LightningModule) -> _FitSteps | None:
        if not module.automatic_optimization or len(trainer.optimizers) != 1:
            warn_once("lightning-rewind-manual", "ProbeCallback(rewind=True) re-runs Lightning's automatic "
                      "optimization with one optimizer; this module's steps are not rewound")
            return None
        return cls(trainer, module)

    def begin(self, loop: LoopSession) -> None:
        self._micro_batches, self._losses = [], []
        self._rewind.keep_start(loop, None, self.trainer.optimizers[0],
                                getattr(self.trainer.precision_plugin, "scaler", None))

    def micro_batch(self, batch: Any, index: int) -> None:
        self._micro_batches.append((batch, index))

    def micro_batch_end(self, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss)

    def end(self, loop: LoopSession) -> None:
        self._rewind.step_end(loop, self.run, summed_loss(self._losses), batch=self._micro_batches)

    def run(self, micro_batches: list[tuple[Any, int]]) -> torch.Tensor | None:
        """The optimizer step on ``micro_batches`` (each with its ``batch_idx``); returns its loss as
        :meth:`end` sums it."""
        trainer, module = self.trainer, self.module
        optimizer = trainer.optimizers[0]
        losses: list[torch.Tensor] = []

        def forward_backward(batch: Any, index: int) -> torch.Tensor:
            output = module.training_step(batch, index)
            loss = output["loss"] if isinstance(output, Mapping) else output
            loss = loss / trainer.accumulate_grad_batches
            trainer.strategy.backward(loss, optimizer)
            losses.append(loss.detach())
            return loss

        with _logging_off(module):
            optimizer.zero_grad()
            for batch, index in micro_batches[:-1]:
                forward_backward(batch, index)
            batch, index = micro_batches[-1]
            trainer.strategy.optimizer_step(optimizer, lambda: forward_backward(batch, index), module)
        return summed_loss(losses)


@contextmanager
def _logging_off(module: LightningModule) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing in the block: a re-run's values are no metrics of
    the fit."""
    def silent(*args: Any, **kwargs: Any) -> None:
        return None

    module.log, module.log_dict = silent, silent  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
