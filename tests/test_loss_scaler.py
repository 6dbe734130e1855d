"""fp16 training with torch.amp.GradScaler: the steps the scaler skips (its first steps overflow at
a large initial scale) are named with their scale, are no model fault, its own ops are no
magnitudes of the model, the monitor records the scale, and training under the probe is unchanged."""

from __future__ import annotations

import io

import pytest
import torch
from hf_models import tiny_llama
from rich.console import Console
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from probe.analysis.run_summary import RunSummary
from probe.analysis.summary import summarize
from probe.exporters.console import render_run
from probe.vocabulary.op_class import classify
from probe.vocabulary.op_tensors import counted_writes, written_tensors

STEPS = 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _train_mlp(model: nn.Module, scaler: torch.amp.GradScaler, session=None,
               poison_step: int | None = None, autocast: bool = True) -> list[torch.Tensor]:
    """SGD steps under fp16 autocast (fp32 without ``autocast``) with ``scaler``; ``poison_step``: the
    last layer's output is Inf in that step's forward (a fault of the model, whatever the scaler does)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
    losses = []
    for step in range(STEPS):
        poison = model[2].register_forward_hook(lambda m, a, out: out * float("inf")) \
            if step == poison_step else None
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if poison is not None:
            poison.remove()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
        if session is not None:
            session.step()
    return losses


def _train_llama(model: nn.Module, scaler: torch.amp.GradScaler, session=None) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
        if session is not None:
            session.step()
    return losses


def _summary_text(run: probe.rundir.run.Run) -> str:
    buffer = io.StringIO()
    render_run(Console(file=buffer, width=250), RunSummary(run, summarize(run)))
    return buffer.getvalue()


def _assert_transparent(plain_model, plain_losses, model, losses) -> None:
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """2**18: steps 0 and 1 overflow (scales 2**18, 2**17), steps 2 and 3 train at 2**16."""
    out = tmp_path_factory.mktemp("scaler") / "mlp"
    plain = _mlp()
    plain_losses = _train_mlp(plain, torch.amp.GradScaler("cpu", init_scale=2.0**18))
    model, scaler = _mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**18)
    with probe.mode("stats", out=out, model=model) as session:
        losses = _train_mlp(model, scaler, session)
    _assert_transparent(plain, plain_losses, model, losses)
    assert scaler.get_scale() == 2.0**16
    return probe.load(out)


def test_skipped_steps_are_named_with_their_scale(mlp_run):
    skipped = mlp_run.skipped_steps()
    assert [(s.step, s.scale) for s in skipped] == [(0, 2.0**18), (1, 2.0**17)]
    assert [s.next_scale for s in skipped] == [2.0**17, 2.0**16]
    assert skipped[0].describe() == "step 0 skipped by the loss scaler: gradients overflowed at scale 262144"
    assert skipped[1].describe() == "step 1 skipped by the loss scaler: gradients overflowed at scale 131072"


def test_a_healthy_step_is_not_called_skipped(mlp_run):
    for step in (2, 3):
        scaler = mlp_run.loss_scaler(step)
        assert scaler is not None and scaler.overflowed is False and not scaler.skipped
        assert scaler.scale == 2.0**16
        assert "skipped" not in scaler.describe()


def test_the_handled_overflow_is_no_fault_but_is_said(mlp_run):
    assert mlp_run.first_nonfinite() is None
    bad = mlp_run.first_nonfinite(handled=True)
    assert bad is not None and bad.step == 0 and bad.phase == "backward"
    text = _summary_text(mlp_run)
    assert "step 0 skipped by the loss scaler: gradients overflowed at scale 262144" in text
    assert "step 1 skipped by the loss scaler: gradients overflowed at scale 131072" in text
    assert f"id {bad.id} (step skipped by the loss scaler: the overflow was handled)" in text
    assert "step 2: loss scaler at scale 65536, no overflow" in text


def test_the_scalers_ops_are_not_among_the_largest_values(mlp_run):
    for summary in summarize(mlp_run):
        scaler = summary.loss_scaler
        assert scaler is not None
        ranked = summary.largest_abs_max + summary.largest_norm
        assert ranked and not any(e.op.name.startswith("aten._amp_") for e in ranked)
        # Nor the scale itself, its copies, or the loss times it.
        assert not any(scaler.owns(e.op) for e in ranked)
        assert all(e.value < scaler.scale for e in ranked if e.op.phase == "forward")
    text = _summary_text(mlp_run)
    assert "_amp_update_scale_" not in text


def test_a_fault_in_the_forward_stays_a_fault_in_a_skipped_step(tmp_path):
    model, scaler = _mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**10)  # no overflow of its own
    with probe.mode(["stats", "monitor"], out=tmp_path / "r", model=model, targets=[""],
                    scaler=scaler) as session:
        _train_mlp(model, scaler, session, poison_step=2)
    run = probe.load(tmp_path / "r")
    assert [s.step for s in run.skipped_steps()] == [2]
    bad = run.first_nonfinite()
    assert bad is not None and (bad.step, bad.phase, bad.name) == (2, "forward", "aten.mul.Tensor")
    text = _summary_text(run)
    assert "step 2 skipped by the loss scaler: gradients overflowed at scale 1024; the NaN/Inf started " \
           "before the backward" in text
    assert "the overflow was handled" not in text
    # The monitor alerts on the model's output; its gradient's NaN is the one the scaler skipped.
    assert [(a.step, a.module, a.metric, a.rule) for a in run.anomalies()] == [(2, "", "output.inf",
                                                                                 "nonfinite")]


def _fp32_reference(out) -> probe.rundir.run.Run:
    """The fp32 twin of ``mlp_run``: the same scaler at 2**18, which fp32 gradients never overflow."""
    model, scaler = _mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**18)
    with probe.mode("stats", out=out, model=model) as session:
        _train_mlp(model, scaler, session, autocast=False)
    assert scaler.get_scale() == 2.0**18
    return probe.load(out)


def test_compare_stops_where_one_runs_scaler_skipped_an_update_the_other_made(mlp_run, tmp_path):
    """fp32 against fp16 autocast, one scaler each at 2**18: run B's step 0 overflows in the backward
    and is skipped, run A's is not. That is loss scaling at work, no divergence; but from the overflow
    on the runs do different things (Inf gradients in B, an update in A only), and steps 1-3 start
    from weights an update apart: not compared, and said. Missing data is no agreement: not ok."""
    report = probe.compare(_fp32_reference(tmp_path / "fp32"), mlp_run)
    assert report.divergence is None, report.conclusion
    assert not report.ok
    skipped = "run B's step 0 skipped by the loss scaler: gradients overflowed at scale 262144"
    assert skipped in report.conclusion
    assert "run A's did not skip" in report.conclusion
    origin = mlp_run.first_nonfinite(handled=True)
    assert origin is not None and (origin.step, origin.phase) == (0, "backward")
    step0 = [c for c in report.comparisons if c.step == 0]
    before = [c for c in step0 if c.b is not None and c.b.index < origin.index]
    assert len(before) > 10 and all(c.verdict != "not compared" for c in before)  # compared as usual
    after = [c for c in step0 if c.b is not None and c.b.index >= origin.index]
    assert after and all(c.verdict == "not compared" for c in after)
    assert [c.verdict for c in after if c.b.id == origin.id] == ["not compared"]
    later = [c for c in report.comparisons if c.step > 0]
    assert later and all(c.verdict == "not compared" and "one update apart" in c.message for c in later)
    assert [s["step"] for s in report.summary["apart"]] == [0, 1, 2, 3]


def test_a_forward_fault_in_a_step_one_scaler_skipped_is_still_the_divergence(tmp_path):
    """The scaler skips step 2 of run B because the model's forward made an Inf: that overflow is
    the model's, not the scaler's, and compare names it."""
    runs = []
    for name, poison in (("a", None), ("b", 2)):
        model, scaler = _mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with probe.mode("stats", out=tmp_path / name, model=model) as session:
            _train_mlp(model, scaler, session, poison_step=poison)
        runs.append(probe.load(tmp_path / name))
    assert [s.step for s in runs[1].skipped_steps()] == [2] and not runs[0].skipped_steps()
    report = probe.compare(*runs)
    d = report.divergence
    assert d is not None and (d.step, d.op.phase) == (2, "forward"), report.conclusion
    assert not report.summary["apart"]


def test_the_monitor_records_the_scale_in_force_each_step(tmp_path):
    model, scaler = _mlp(), torch.amp.GradScaler("cpu", init_scale=2.0**18)
    with probe.mode("monitor", out=tmp_path / "m", model=model, targets=["0", "2"], wg_distribution=True,
                    scaler=scaler) as session:
        _train_mlp(model, scaler, session)
    run = probe.load(tmp_path / "m")
    series = [(m.step, m.kind, m.mean) for m in run.monitor() if m.name == "scaler"]
    assert series == [(0, "loss_scale", 2.0**18), (0, "loss_scale_skipped", 1.0),
                      (1, "loss_scale", 2.0**17), (1, "loss_scale_skipped", 1.0),
                      (2, "loss_scale", 2.0**16), (2, "loss_scale_skipped", 0.0),
                      (3, "loss_scale", 2.0**16), (3, "loss_scale_skipped", 0.0)]
    # The overflowed output gradients are the scaler's business: no alert.
    overflowed = [m for m in run.monitor(0, 0) if m.slot == "output_grad"]
    assert overflowed and all(m.inf + m.nan > 0 for m in overflowed)
    assert run.anomalies() == []
    # Without a traced op, the monitor's series say which steps were skipped.
    assert [s.describe() for s in run.skipped_steps()] == [
        "step 0 skipped by the loss scaler: gradients overflowed at scale 262144",
        "step 1 skipped by the loss scaler: gradients overflowed at scale 131072"]
    text = _summary_text(run)
    assert "step 1 skipped by the loss scaler: gradients overflowed at scale 131072" in text
    assert "step 2: loss scaler at scale 65536, no overflow" in text


def test_the_monitor_refuses_a_scaler_that_is_not_one(tmp_path):
    with pytest.raises(probe.ProbeError, match=r"'scaler': expected the torch\.amp\.GradScaler"):
        probe.mode("monitor", out=tmp_path / "m", model=_mlp(), targets=["0"], scaler=2.0**16)


@pytest.mark.slow
def test_hf_llama_skipped_steps_summary_and_transparency(tmp_path):
    pytest.importorskip("transformers")
    plain = tiny_llama()
    plain_losses = _train_llama(plain, torch.amp.GradScaler("cpu", init_scale=2.0**20))
    model, scaler = tiny_llama(), torch.amp.GradScaler("cpu", init_scale=2.0**20)
    with probe.mode(["stats", "monitor"], out=tmp_path / "r", model=model, targets=["model.layers.0"],
                    scaler=scaler) as session:
        losses = _train_llama(model, scaler, session)
    _assert_transparent(plain, plain_losses, model, losses)
    run = probe.load(tmp_path / "r")
    assert [(s.step, s.scale) for s in run.skipped_steps()] == [(0, 2.0**20), (1, 2.0**19)]
    assert [run.loss_scaler(step).skipped for step in range(STEPS)] == [True, True, False, False]
    assert run.first_nonfinite() is None
    text = _summary_text(run)
    assert "step 0 skipped by the loss scaler: gradients overflowed at scale 1048576" in text
    assert "step 1 skipped by the loss scaler: gradients overflowed at scale 524288" in text
    assert "_amp_" not in text
    scales = [m.mean for m in run.monitor() if m.kind == "loss_scale"]
    assert scales == [2.0**20, 2.0**19, 2.0**18, 2.0**18]


class _VersionBumps(TorchDispatchMode):
    """Per op: each written argument's version counter when the op returns inside the mode
    (before autograd counts the write), to compare with its counter afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool, int]] = []
        self._pending: list[tuple[str, torch.Tensor, bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        info = classify(func)
        counted = {id(t) for t in counted_writes(info, args, kwargs)}
        for t in written_tensors(info, args, kwargs):
            self._pending.append((info.name, t, id(t) in counted, t._version))
        return out

    def settle(self) -> None:
        self.seen += [(name, counted, t._version - before) for name, t, counted, before in self._pending]
        self._pending.clear()


def test_the_tracer_knows_which_writes_autograd_counts():
    # The scaler's ops, fused optimizers and _foreach ops write without a version bump (the
    # growth tracker of _amp_update_scale_ too, its scale with one); in-place and out= ops bump.
    mode = _VersionBumps()
    grads, found_inf = [torch.ones(3)], torch.zeros(())
    scale, tracker = torch.ones(()), torch.zeros((), dtype=torch.int32)
    weight = nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    adamw = torch.optim.AdamW([weight], fused=True)
    calls = [lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones(())),
             lambda: torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 10),
             adamw.step,
             lambda: torch._foreach_add_(grads, 1.0),
             lambda: grads[0].add_(1.0),
             lambda: torch.max(torch.ones(2, 3), 0, out=(torch.empty(3), torch.empty(3, dtype=torch.long)))]
    for call in calls:
        with mode:
            call()
        mode.settle()
    assert all(bumped == int(counted) for _, counted, bumped in mode.seen), mode.seen
    names = {name for name, _, _ in mode.seen}
    assert {"aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._amp_update_scale_.default",
            "aten._fused_adamw_.default", "aten.add_.Tensor", "aten.max.dim_max"} <= names


def test_the_optimizer_reads_the_unscaled_gradients(mlp_run):
    # Unscaling writes the gradients in place without a version bump: the optimizer's reads are
    # of the unscale op's outputs (the unscaled values), not of the scaled gradients before it.
    ops = mlp_run.ops(3)
    unscale = next(op for op in ops if op.name.startswith("aten._amp_foreach_non_finite"))
    update = next(op for op in ops if op.name.startswith("aten._amp_update_scale_"))
    assert update.inputs[2].source == (unscale.index, len(unscale.outputs) - 1)  # found_inf
    grad_reads = [t for op in ops if op.phase == "optimizer" for t in op.inputs
                  if t.source is not None and t.source[0] == unscale.index]
    assert len(grad_reads) == len(unscale.outputs) - 1  # every gradient, once (SGD's add_)
    for t in grad_reads:
        assert t.stats == unscale.outputs[t.source[1]].stats
