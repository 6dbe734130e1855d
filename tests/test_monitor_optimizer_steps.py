"""The monitor across optimizer steps: weight gradients under ``optimizer.step(closure)``
(Lightning's automatic optimization, LBFGS) are those the closure's backward made, read before
the update; a subclassed optimizer whose ``step`` calls ``super().step()`` is one step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import probe


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen, dtype=torch.float64),
             torch.randn(6, 2, generator=gen, dtype=torch.float64)) for _ in range(steps)]


def _hand_grads(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    """Gradients of ``mean((x W^T + b - y)^2)``, worked out by hand: ``2 r / n`` back through the layer."""
    r = x @ weight.T + bias - y
    dr = 2 * r / r.numel()
    return {"0.weight": dr.T @ x, "0.bias": dr.sum(0)}


def _closure_run(tmp_path, make_optimizer, steps: int = 3, monitored: bool = True):
    """A linear model trained with ``optimizer.step(closure)``; per step and closure call, the
    weights the closure saw (to derive the gradients by hand) and the losses it returned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2)).double()
    opt = make_optimizer(model.parameters())
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    losses = []
    session = (probe.mode("monitor", out=tmp_path / "run", model=model, targets=["0"], wg_distribution=True,
                          xy_distribution=False, tensorboard=False) if monitored else None)
    if session is not None:
        session.start()
    try:
        for x, y in _data(steps):
            calls: list[tuple[torch.Tensor, torch.Tensor]] = []

            def closure(x=x, y=y, calls=calls):
                calls.append((model[0].weight.detach().clone(), model[0].bias.detach().clone()))
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss

            losses.append(float(opt.step(closure).detach()))
            seen.append(calls)
            if session is not None:
                session.step()
    finally:
        if session is not None:
            session.stop()
    return model, losses, seen


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_closure_weight_grads_are_those_of_the_step(tmp_path, optimizer):
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
            "lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3, history_size=3)}[optimizer]
    data = _data(3)
    model, losses, seen = _closure_run(tmp_path, make)
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1, 2]
    for step, calls in enumerate(seen):
        rows = {(r.name, r.call): r for r in run.monitor(step) if r.kind == "weight_grad"}
        if optimizer == "lbfgs":
            assert len(calls) == 3  # each closure evaluation is a call of the series, as for modules
        assert sorted(rows) == sorted((name, i) for i in range(len(calls)) for name in ("0.weight", "0.bias"))
        for i, (weight, bias) in enumerate(calls):
            for name, grad in _hand_grads(weight, bias, *data[step]).items():
                row = rows[(name, i)]
                assert row.norm == pytest.approx(grad.norm().item(), rel=1e-9), (step, name, i)
                assert row.min == pytest.approx(grad.min().item(), rel=1e-9)
                assert row.max == pytest.approx(grad.max().item(), rel=1e-9)
    # Passive: the same training without the monitor.
    bare, bare_losses, _ = _closure_run(tmp_path, make, monitored=False)
    assert losses == bare_losses
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p, q)


def test_weight_grads_without_a_closure_are_read_at_the_pre_hook(tmp_path):
    """No closure: today's behaviour, the gradient the step is given (call 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data(2)
    refs = []
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=["0"], wg_distribution=True,
                    xy_distribution=False, tensorboard=False) as session:
        for x, y in data:
            refs.append(_hand_grads(model[0].weight.detach().clone(), model[0].bias.detach().clone(), x, y))
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            session.step()
    run = probe.load(tmp_path / "run")
    for step, ref in enumerate(refs):
        rows = {(r.name, r.call): r for r in run.monitor(step) if r.kind == "weight_grad"}
        assert sorted(rows) == [("0.bias", 0), ("0.weight", 0)]
        for name, grad in ref.items():
            assert rows[(name, 0)].norm == pytest.approx(grad.norm().item(), rel=1e-9)


class _IgnoresClosure(torch.optim.Optimizer):
    """Takes a closure and never calls it (SGD on the gradients it is given)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_closure_never_called_gives_the_gradients_the_step_was_given(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2)).double()
    opt = _IgnoresClosure(model.parameters())
    (x, y), = _data(1)
    ref = _hand_grads(model[0].weight.detach().clone(), model[0].bias.detach().clone(), x, y)
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=["0"], wg_distribution=True,
                    xy_distribution=False, tensorboard=False) as session:
        ((model(x) - y) ** 2).mean().backward()
        opt.step(lambda: None)
        session.step()
    rows = {(r.name, r.call): r for r in probe.load(tmp_path / "run").monitor(0) if r.kind == "weight_grad"}
    assert sorted(rows) == [("0.bias", 0), ("0.weight", 0)]
    for name, grad in ref.items():
        assert rows[(name, 0)].norm == pytest.approx(grad.norm().item(), rel=1e-9)


def test_adam_with_a_closure_reads_grads_and_moments_of_the_same_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    data = _data(2)
    grads, moments = [], []
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=["0"], wg_distribution=True,
                    mv_distribution=True, ur_distribution=True, xy_distribution=False,
                    tensorboard=False) as session:
        for x, y in data:
            def closure(x=x, y=y):
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                grads.append(model[0].weight.grad.detach().clone())
                return loss

            opt.step(closure)
            moments.append(opt.state[model[0].weight]["exp_avg"].detach().clone())
            session.step()
    run = probe.load(tmp_path / "run")
    for step in range(2):
        rows = {(r.kind, r.name): r for r in run.monitor(step)}
        assert rows[("weight_grad", "0.weight")].norm == pytest.approx(grads[step].norm().item(), rel=1e-9)
        assert rows[("exp_avg", "0.weight")].norm == pytest.approx(moments[step].norm().item(), rel=1e-9)
        assert ("update_ratio", "0.weight") in rows


def test_lightning_weight_grads_are_the_clipped_ones_the_update_used(tmp_path):
    """Lightning's automatic optimization: ``optimizer.step(closure)``, the closure running
    forward, backward and gradient clipping; accumulation over two micro-batches."""
    L = pytest.importorskip("lightning")
    from probe.integrations.lightning import ProbeCallback

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    used: list[dict[str, float]] = []

    class UsedGrads(L.Callback):
        """The gradients the update used: read after the step (AdamW leaves .grad as it was)."""

        def on_train_start(self, trainer, module) -> None:
            trainer.optimizers[0].register_step_post_hook(lambda o, a, k: used.append(
                {n: p.grad.norm().item() for n, p in module.named_parameters()}))

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=gen), 10 * torch.randn(24, 1, generator=gen)
    data = torch.utils.data.TensorDataset(x, y)
    callback = ProbeCallback("monitor", out=tmp_path / "run", targets=["body.0"], wg_distribution=True,
                             xy_distribution=False, tensorboard=False)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, callbacks=[callback, UsedGrads()])
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=3))
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1, 2] and len(used) == 3
    for step in run.steps:
        rows = {r.name: r.norm for r in run.monitor(step) if r.kind == "weight_grad"}
        assert rows.keys() == used[step].keys()
        assert sum(v ** 2 for v in rows.values()) ** 0.5 == pytest.approx(0.05, rel=1e-4)  # clipped
        for name, norm in used[step].items():
            assert rows[name] == pytest.approx(norm, rel=1e-6), (step, name)


class _ClippingAdamW(torch.optim.AdamW):
    """A subclass adding work around ``super().step()``: torch runs the global step hooks for
    each class's own ``step``, so twice per step here."""

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1.0)
        return super().step(closure)


@pytest.mark.parametrize("closure", [False, True])
def test_a_subclassed_optimizer_is_one_step_for_the_monitor_and_the_checks(tmp_path, closure):
    torch.optim.AdamW(nn.Linear(1, 1).parameters())  # AdamW.step wrapped too, as in any program using it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    opt = _ClippingAdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with probe.mode(["monitor", "stats"], out=tmp_path / "r", model=model, targets=["0"],
                    wg_distribution=True, mv_distribution=True, async_flush=False) as session:
        for step in range(3):
            def loss_fn():
                opt.zero_grad()
                loss = (model(x) - y).square().mean()
                loss.backward()
                return loss

            if step == 1:  # a step that raises inside optimizer.step: its post-hooks never run
                model[0].weight.grad = None
                with pytest.raises(RuntimeError, match="broke"), torch.no_grad():
                    opt.step(lambda: (_ for _ in ()).throw(RuntimeError("broke")))
            elif closure:
                opt.step(loss_fn)
            else:
                loss_fn()
                opt.step()
            session.step()
    run = probe.load(tmp_path / "r")
    for step in (0, 2):
        series = [(r.kind, r.name, r.call) for r in run.monitor(step, 0) if r.kind != "activation"]
        assert sorted(series) == sorted({(kind, name, 0) for kind in ("weight_grad", "exp_avg", "exp_avg_sq")
                                         for name in ("0.weight", "0.bias")})
        checks = run.step_info(step, 0).manifest["modes"]["stats"]["nonfinite_parameters"]
        assert checks["gradients"]["checked"] == 2  # each gradient once, not once per level
