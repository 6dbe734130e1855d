"""Ready callbacks that put a probe session into a framework's training loop.

- :mod:`probe.integrations.hf_trainer`: ``ProbeCallback`` for the Hugging Face ``Trainer``;
- :mod:`probe.integrations.lightning`: ``ProbeCallback`` for the PyTorch Lightning ``Trainer``.

Both take the arguments of :func:`probe.mode` plus ``trace_evaluation`` (default False). A probe
step is one optimizer step, with every micro-batch of gradient accumulation inside it; what the
loop does between optimizer steps (data loading, logging, evaluation, checkpoints) is not
recorded, except evaluation when ``trace_evaluation=True``: then each evaluation is a probe step
of its own, marked ``"kind": "evaluation"`` in its manifest. See ``docs/integrations.md``.

Importing this package imports neither framework; each module imports its own.
"""
