"""probe.integrations.hf_trainer.ProbeCallback on a real ``transformers.Trainer`` (tiny Llama, CPU)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import tiny_llama
from trainer_ops import module_calls, optimizer_frames

import probe
from probe.rewind import read_verdicts

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from probe.integrations.hf_trainer import ProbeCallback  # noqa: E402

STEPS = 2
ACCUMULATION = 2
EVAL_BATCHES = 2


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences; a causal LM learns to predict them."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(
    tmp_path: Path, callbacks: list[Any], **args: Any
) -> tuple[transformers.Trainer, dict[str, torch.Tensor]]:
    """Two optimizer steps of two micro-batches each, an evaluation after each."""
    model = tiny_llama(seed=0)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION, per_device_eval_batch_size=4, eval_strategy="steps",
        eval_steps=1, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=0, **args,
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Tokens(16, 0),
                                   eval_dataset=Tokens(4 * EVAL_BATCHES, 1), callbacks=callbacks)
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_probe_step_is_an_optimizer_step_and_evaluation_is_untraced(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run")
    _train(tmp_path, [callback])
    assert probe.active_session() is None and not callback.session.running

    run = probe.load(callback.out)
    # Evaluations ran after each step, yet the run holds exactly the optimizer steps.
    assert run.steps == list(range(STEPS))
    forward_ops = None
    for step in run.steps:
        info = run.step_info(step)
        assert info.complete and "kind" not in info.manifest
        ops = run.ops(step=step)
        # Both micro-batches, forward and backward, and one optimizer step; no evaluation forward
        # (it would be a third call of the embedding, without backward).
        assert module_calls(ops, "model.embed_tokens", "forward") == {0, 1}
        assert module_calls(ops, "lm_head", "backward") == {0, 1}
        assert optimizer_frames(ops) == {"optimizer.AdamW[0]"}
        phase_counts = Counter(op.phase for op in ops if op.phase != "optimizer")
        forward_ops = forward_ops or phase_counts
        assert phase_counts == forward_ops  # the same work every step: nothing of the loop's own leaks in


@pytest.mark.slow
def test_the_callback_leaves_training_bit_identical(tmp_path: Path) -> None:
    trainer_a, plain = _train(tmp_path / "a", [])
    trainer_b, probed = _train(tmp_path / "b", [ProbeCallback("stats", out=tmp_path / "run")])
    assert plain.keys() == probed.keys()
    assert all(torch.equal(plain[name], probed[name]) for name in plain)
    def losses(trainer: transformers.Trainer) -> list[list[float | None]]:
        return [[entry.get("loss"), entry.get("eval_loss")] for entry in trainer.state.log_history[:-1]]

    assert losses(trainer_a) == losses(trainer_b) and losses(trainer_a)


def test_trace_evaluation_records_each_evaluation_as_a_step(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run", trace_evaluation=True)
    _train(tmp_path, [callback], eval_on_start=True)
    run = probe.load(callback.out)
    kinds = [run.step_info(step).manifest.get("kind") for step in run.steps]
    # eval_on_start, then each optimizer step and the evaluation after it.
    assert kinds == ["evaluation", None, "evaluation", None, "evaluation"]
    for step, kind in zip(run.steps, kinds, strict=True):
        ops = run.ops(step=step)
        if kind == "evaluation":
            assert {op.phase for op in ops} == {"forward"}
            assert module_calls(ops, "model.embed_tokens", "forward") == set(range(EVAL_BATCHES))
        else:
            assert module_calls(ops, "model.embed_tokens", "forward") == {0, 1}
            assert optimizer_frames(ops) == {"optimizer.AdamW[0]"}


class _FailAfterFirstMicroBatch(transformers.TrainerCallback):
    """Raises between the two micro-batches of the second optimizer step."""

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            raise RuntimeError("data loader died")


def test_a_crash_in_train_is_written_when_stop_is_called(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run")
    with pytest.raises(RuntimeError, match="data loader died"):
        try:
            _train(tmp_path, [callback, _FailAfterFirstMicroBatch()])
        finally:
            callback.stop()
    assert probe.active_session() is None
    callback.stop()  # again: nothing to do
    run = probe.load(callback.out)
    assert run.steps == [0, 1]
    assert run.step_info(0).complete
    broken = run.step_info(1)
    assert not broken.complete and "data loader died" in broken.reason
    ops = run.ops(step=1)  # the first micro-batch of the broken step, no optimizer step
    assert module_calls(ops, "model.embed_tokens", "forward") == {0} and not optimizer_frames(ops)


@pytest.mark.slow
def test_a_crashed_train_left_running_is_ended_by_the_next(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run", overwrite=True)
    with pytest.raises(RuntimeError, match="data loader died"):
        _train(tmp_path, [callback, _FailAfterFirstMicroBatch()])
    assert probe.active_session() is callback.session  # the Trainer called no hook: still running
    _train(tmp_path, [callback])
    assert probe.active_session() is None
    assert probe.load(callback.out).steps == list(range(STEPS))


def test_bad_options_are_refused_when_the_callback_is_made() -> None:
    with pytest.raises(probe.ProbeError, match="no_such_option"):
        ProbeCallback("stats", no_such_option=1)
    with pytest.raises(probe.ProbeError, match="trace_evaluation"):
        ProbeCallback("stats", trace_evaluation="yes")


class _Embeddings(torch.utils.data.Dataset):
    """Float inputs (``inputs_embeds``, as a vision or audio front end gives): the ``poisoned``-th
    sample the loader fetches holds an inf, so it lands at the same step whatever the shuffle."""

    def __init__(self, n: int, poisoned: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.embeds = torch.randn(n, 16, 32, generator=generator)
        self.labels = torch.randint(0, 128, (n, 16), generator=generator)
        self.poisoned, self.fetched = poisoned, 0

    def __len__(self) -> int:
        return len(self.embeds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        embeds = self.embeds[i].clone()
        if self.fetched == self.poisoned:
            embeds[3, 5] = float("inf")
        self.fetched += 1
        return {"inputs_embeds": embeds, "labels": self.labels[i]}


def _train_rewound(tmp_path: Path, callbacks: list[Any], dataset: torch.utils.data.Dataset,
                   accumulation: int) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, max_grad_norm=1.0,
    )
    trainer = transformers.Trainer(model=tiny_llama(seed=0), args=arguments, train_dataset=dataset,
                                   callbacks=callbacks)
    trainer.train()
    return trainer


def test_rewind_classifies_a_nan_step_and_training_goes_on(tmp_path: Path) -> None:
    # Sample 1 of step 2's batch (the 6th fetched, batches of 2) is poisoned: a data verdict.
    callback = ProbeCallback("stats", out=tmp_path / "run", rewind=True)
    trainer = _train_rewound(tmp_path, [callback], _Embeddings(16, poisoned=5), accumulation=1)
    assert trainer.state.global_step == 4  # training went on past the rewind
    [verdict] = read_verdicts(callback.out)
    assert (verdict.step, verdict.trigger, verdict.verdict) == (2, "non-finite loss", "data"), verdict.why
    assert verdict.samples == [1]
    assert [r.kind for r in verdict.reruns] == ["same", "float64", "previous_batch"]
    assert verdict.reruns[0].bitwise_equal  # the callback's re-run is the Trainer's step, bit for bit
    assert (callback.out / "rank0" / "step2" / "rewind.json").is_file()
    assert probe.load(callback.out).steps == [0, 1, 2, 3]


def test_a_rewound_step_leaves_the_trainers_training_bit_identical(tmp_path: Path) -> None:
    def alert_at_step_1(observation: Any) -> str | None:  # a finite alert: nothing non-finite to find
        return "planted" if observation.step == 1 and observation.series.slot == "output" else None

    plain = _train_rewound(tmp_path / "a", [], Tokens(16, 0), accumulation=2)
    callback = ProbeCallback("monitor", targets=["model.layers.0"], anomaly_rules=[alert_at_step_1],
                             out=tmp_path / "run", rewind=True)
    rewound = _train_rewound(tmp_path / "b", [callback], Tokens(16, 0), accumulation=2)
    [verdict] = read_verdicts(callback.out)
    # Two micro-batches, clipping and AdamW re-run from the kept start end as the Trainer's step did.
    assert (verdict.step, verdict.verdict) == (1, "reproducible"), verdict.why
    assert verdict.trigger.startswith("monitor rule:") and verdict.reruns[0].bitwise_equal
    pairs = zip(plain.model.named_parameters(), rewound.model.named_parameters(), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), name

    def losses(trainer: transformers.Trainer) -> list[float | None]:
        return [entry.get("loss") for entry in trainer.state.log_history[:-1]]

    assert losses(plain) == losses(rewound) and len(losses(plain)) == 4
    assert "training_step" not in rewound.__dict__  # the Trainer is given back as it was
