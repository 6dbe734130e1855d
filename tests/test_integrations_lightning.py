"""probe.integrations.lightning.ProbeCallback on a real Lightning ``Trainer`` (CPU, a small MLP);
and the optimizer-closure form Lightning uses (``optimizer.step(closure)``) in plain torch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trainer_ops import module_calls, optimizer_frames

import probe
from probe.rewind import read_verdicts

L = pytest.importorskip("lightning")

from probe.integrations.lightning import ProbeCallback  # noqa: E402

STEPS = 3
ACCUMULATION = 2
BATCH = 4


class Regressor(L.LightningModule):
    def __init__(self, fail_at_batch: int | None = None) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        self.fail_at_batch = fail_at_batch
        self.batches = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        if self.batches == self.fail_at_batch:
            raise RuntimeError("bad batch")
        self.batches += 1
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.body(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(n: int, seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _fit(callbacks: list[Any], fail_at_batch: int | None = None,
         train: torch.utils.data.DataLoader | None = None, **trainer_args: Any) -> Regressor:
    """Three optimizer steps of two micro-batches each; validation (2 batches) after the second."""
    torch.manual_seed(0)
    module = Regressor(fail_at_batch)
    args: dict[str, Any] = dict(
        max_steps=STEPS, accumulate_grad_batches=ACCUMULATION, val_check_interval=2 * ACCUMULATION,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
    )
    trainer = L.Trainer(**{**args, **trainer_args}, callbacks=callbacks)
    trainer.fit(module, train or _loader(8 * BATCH, 0), _loader(2 * BATCH, 1))
    module.fitted_steps = trainer.global_step
    return module


def test_a_probe_step_is_an_optimizer_step_and_validation_is_untraced(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run")
    _fit([callback])
    assert probe.active_session() is None

    run = probe.load(callback.out)
    assert run.steps == list(range(STEPS))
    model_ops = None
    for step in run.steps:
        assert run.step_info(step).complete
        ops = run.ops(step=step)
        # Both micro-batches: the second one's forward and backward run inside optimizer.step(closure),
        # and still count as forward and backward, not as optimizer ops.
        assert module_calls(ops, "body.0", "forward") == {0, 1}
        assert module_calls(ops, "body.0", "backward") == {0, 1}
        assert optimizer_frames(ops) == {"optimizer.AdamW[0]"}
        counts = Counter(op.phase for op in ops if op.phase != "optimizer")
        model_ops = model_ops or counts
        assert counts == model_ops  # validation (a third forward of body.0, no backward) is not here


def test_the_callback_leaves_training_bit_identical(tmp_path: Path) -> None:
    plain = _fit([])
    probed = _fit([ProbeCallback("stats", out=tmp_path / "run", trace_evaluation=True)])
    for (name, a), (_, b) in zip(plain.named_parameters(), probed.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_trace_evaluation_records_each_validation_as_a_step(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run", trace_evaluation=True)
    _fit([callback], num_sanity_val_steps=1)
    run = probe.load(callback.out)
    kinds = [run.step_info(step).manifest.get("kind") for step in run.steps]
    # The sanity check (1 batch), steps 0 and 1, validation, step 2 (max_steps ends the fit).
    assert kinds == ["evaluation", None, None, "evaluation", None]
    for step, kind in zip(run.steps, kinds, strict=True):
        ops = run.ops(step=step)
        if kind == "evaluation":
            assert {op.phase for op in ops} == {"forward"}
            assert module_calls(ops, "body.0", "forward") == ({0} if step == 0 else {0, 1})
        else:
            assert module_calls(ops, "body.0", "backward") == {0, 1}


def test_a_failed_fit_writes_the_broken_off_step(tmp_path: Path) -> None:
    callback = ProbeCallback("stats", out=tmp_path / "run")
    with pytest.raises(RuntimeError, match="bad batch"):
        _fit([callback], fail_at_batch=3)  # the second micro-batch of step 1
    assert probe.active_session() is None  # on_exception stopped the session
    run = probe.load(callback.out)
    assert run.steps == [0, 1]
    broken = run.step_info(1)
    assert not broken.complete and "bad batch" in broken.reason
    ops = run.ops(step=1)
    assert module_calls(ops, "body.0", "forward") == {0} and not optimizer_frames(ops)


def test_optimizer_closure_ops_keep_their_phases(tmp_path: Path) -> None:
    """``optimizer.step(closure)``: the closure's forward and backward are the model's ops."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    params = list(model.parameters())
    optimizers = [torch.optim.SGD(params, lr=0.1), torch.optim.LBFGS(params, max_iter=2)]
    for optimizer in optimizers:
        out = tmp_path / type(optimizer).__name__
        with probe.mode("stats", out=out, model=model) as session:

            def closure(optimizer: torch.optim.Optimizer = optimizer) -> torch.Tensor:
                optimizer.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                return loss

            optimizer.step(closure)
            session.step()
        ops = probe.load(out).ops(step=0)
        assert module_calls(ops, "0", "forward") and module_calls(ops, "0", "backward")
        assert not {op.module for op in ops if op.phase == "optimizer"} - {""}
        assert any(op.phase == "optimizer" for op in ops)


def test_a_fit_run_inside_an_except_block_ends_complete(tmp_path: Path) -> None:
    """The exception being handled around ``fit`` (a retry after an OOM, say) is not the fit's."""
    callback = ProbeCallback("stats", out=tmp_path / "run")
    try:
        raise MemoryError("the first attempt")
    except MemoryError:
        _fit([callback])
    run = probe.load(callback.out)
    assert run.steps == list(range(STEPS))
    assert all(run.step_info(step).complete for step in run.steps)


def test_gradient_checks_read_the_gradients_lightnings_closure_makes(tmp_path: Path) -> None:
    # Lightning steps the optimizer with a closure that runs the last micro-batch's backward:
    # before, the checks ran before it and found no gradient to check (or the last step's).
    callback = ProbeCallback("stats", out=tmp_path / "run")
    _fit([callback])
    run = probe.load(callback.out)
    for step in run.steps:
        checks = run.step_info(step).manifest["modes"]["stats"]["nonfinite_parameters"]
        assert checks["gradients"] == {"checked": 4, "names": [], "count": 0}
        assert checks["parameters"]["checked"] == 4


def test_rewind_classifies_a_nan_step_and_the_fit_goes_on(tmp_path: Path) -> None:
    loader = _loader(8 * BATCH, 0)
    x, _ = loader.dataset.tensors
    x[2 * 2 * BATCH + BATCH + 2, 5] = float("inf")  # step 2, its second micro-batch, row 2
    callback = ProbeCallback("stats", out=tmp_path / "run", rewind=True)
    module = _fit([callback], train=loader)
    assert module.fitted_steps == STEPS  # the fit went on past the rewind
    [verdict] = read_verdicts(callback.out)
    assert (verdict.step, verdict.trigger, verdict.verdict) == (2, "non-finite loss", "data"), verdict.why
    # A sample of an accumulated step is that row of each micro-batch.
    assert verdict.samples == [2]
    assert verdict.reruns[0].bitwise_equal  # the callback's re-run is Lightning's step, bit for bit
    assert (callback.out / "rank0" / "step2" / "rewind.json").is_file()


def test_a_rewound_step_leaves_the_fit_bit_identical(tmp_path: Path) -> None:
    def alert_at_step_1(observation: Any) -> str | None:  # a finite alert: nothing non-finite to find
        return "planted" if observation.step == 1 and observation.series.slot == "output" else None

    plain = _fit([], gradient_clip_val=0.5)
    callback = ProbeCallback("monitor", targets=["body.0"], anomaly_rules=[alert_at_step_1],
                             out=tmp_path / "run", rewind=True)
    rewound = _fit([callback], gradient_clip_val=0.5)
    [verdict] = read_verdicts(callback.out)
    # Two micro-batches, clipping and AdamW re-run from the kept start end as Lightning's step did.
    assert (verdict.step, verdict.verdict) == (1, "reproducible"), verdict.why
    assert verdict.reruns[0].bitwise_equal
    for (name, a), (_, b) in zip(plain.named_parameters(), rewound.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert rewound.fitted_steps == plain.fitted_steps == STEPS
