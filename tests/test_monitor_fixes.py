"""Monitor fixes: weight gradients under ``optimizer.step(closure)`` (Lightning's automatic
optimization, LBFGS) are those the closure's backward made, read before the update; a
non-finite alert names the Inf count of an all-Inf series; the vectorized anomaly scan
gives what the per-series rules give."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe.modes.anomaly import AnomalyDetector, Series, incidents
from probe.modes.monitor_config import parse_monitor_options
from probe.modes.statistics.columns import MONITOR_COLUMNS as METRIC_COLUMNS


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


# -- non-finite alerts ----------------------------------------------------------------


def _row(nans: float, infs: float, norm: float = 1.0) -> np.ndarray:
    row = np.zeros((1, len(METRIC_COLUMNS)))
    row[0, METRIC_COLUMNS.index("norm")] = norm
    row[0, METRIC_COLUMNS.index("nan")] = nans
    row[0, METRIC_COLUMNS.index("inf")] = infs
    row[0, METRIC_COLUMNS.index("numel")] = 1024
    return row


@pytest.mark.parametrize(("nans", "infs", "metric", "value"),
                         [(0, 1024, "output.inf", 1024), (3, 0, "output.nan", 3), (3, 5, "output.nan", 3)])
def test_a_nonfinite_alert_names_the_count_it_found(nans, infs, metric, value):
    detector = AnomalyDetector(parse_monitor_options({"targets": ["x"]}))
    (alert,) = detector.scan(0, 0, [Series("activation", "x", "output")], _row(nans, infs, np.inf))
    assert (alert.rule, alert.metric, alert.value) == ("nonfinite", metric, value)
    assert alert.reason == f"{nans} NaN, {infs} Inf"
    for text in (alert.describe(), incidents([alert])[0].describe()):
        assert f"{infs} Inf" in text and f"{nans} NaN" in text
        assert "= 0 " not in text and not text.endswith("= 0")


def test_an_all_inf_output_is_reported_as_inf(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].register_forward_hook(lambda m, a, out: torch.full_like(out, torch.inf))
    with (caplog.at_level(logging.WARNING, logger="probe.monitor"),
          probe.mode("monitor", out=tmp_path / "run", model=model, targets=["0"], tensorboard=False,
                     async_flush=False) as session):
        model(torch.randn(3, 4))
        session.step()
    (alert,) = probe.load(tmp_path / "run").anomalies()
    assert (alert.metric, alert.value, alert.reason) == ("output.inf", 24, "0 NaN, 24 Inf")
    (line,) = [r.getMessage() for r in caplog.records if "incident" in r.getMessage()]
    assert "output.inf = 24" in line and "0 NaN, 24 Inf" in line


# -- the vectorized scan against the per-series rules -----------------------------------


class _PerSeries:
    """The rules one series at a time, as the detector applied them before it ran over arrays
    (the oracle: the same alerts, values, baselines and incidents)."""

    def __init__(self, config) -> None:
        self.config = config
        self.averages: dict = {}
        self.nonfinite: set = set()
        self.incident = None

    def scan(self, step, rank, series, values):
        from probe.modes.anomaly import Anomaly, Observation

        found = []
        rule = self.config.turbulence
        for s, row in zip(series, values, strict=True):
            metrics = {name: float(v) for name, v in zip(METRIC_COLUMNS, row, strict=True)}
            nonfinite = metrics["nan"] + metrics["inf"]
            if self.config.nonfinite and nonfinite > 0 and s not in self.nonfinite:
                count = "nan" if metrics["nan"] > 0 else "inf"
                reason = f"{int(metrics['nan'])} NaN, {int(metrics['inf'])} Inf"
                found.append(Anomaly(step, rank, s.name, f"{s.label}.{count}", metrics[count], 0.0,
                                     "nonfinite", s.kind, s.call, reason))
            if nonfinite > 0:
                self.nonfinite.add(s)
            else:
                self.nonfinite.discard(s)
            if rule is not None and nonfinite == 0 and s.kind in rule.kinds:
                for metric in rule.metrics:
                    value = abs(metrics[metric])
                    if not np.isfinite(value):
                        continue
                    average = self.averages.setdefault((s, metric), {"ema": 0.0, "seen": 0, "outliers": []})
                    if average["seen"] >= rule.warmup and average["ema"] > 0:
                        factor = 1 + rule.threshold
                        if value > average["ema"] * factor or value < average["ema"] / factor:
                            outliers = average["outliers"]
                            outliers.append(value)
                            baseline = average["ema"]
                            if len(outliers) >= rule.warmup:
                                average["ema"] = sum(outliers) / len(outliers)
                                average["outliers"] = []
                            if len(outliers) == 1:
                                found.append(Anomaly(step, rank, s.name, f"{s.label}.{metric}", value,
                                                     baseline, "turbulence", s.kind, s.call))
                            continue
                    average["outliers"] = []
                    average["ema"] = (value if average["seen"] == 0
                                      else rule.decay * average["ema"] + (1 - rule.decay) * value)
                    average["seen"] += 1
            for user_rule in self.config.user_rules:
                verdict = user_rule(Observation(step, rank, s, metrics))
                if verdict:
                    found.append(Anomaly(step, rank, s.name, f"{s.label}.norm", metrics["norm"], None,
                                         f"rule:{user_rule.__name__}", s.kind, s.call,
                                         verdict if isinstance(verdict, str) else ""))
        if found and self.incident is None:
            self.incident = step
        for a in found:
            a.incident = self.incident
        if not (found or self.nonfinite or any(a["outliers"] for a in self.averages.values())):
            self.incident = None
        return found


def _big_norm(observation):
    return "norm over 30" if observation.metrics["norm"] > 30 else None


@pytest.mark.parametrize("options", [
    {},
    {"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {
        "warmup": 0, "threshold": 0.3, "metrics": ["norm", "max", "min", "zeros"]}}]}},
    {"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"warmup": 1, "decay": 0.5,
                                                                     "kinds": ["activation", "exp_avg"]}}]},
     "anomaly_rules": [_big_norm]},
    {"alert": {"rules": [{"rule_name": "AnomalyNan"}]}},
])
def test_the_vectorized_scan_gives_the_per_series_alerts(options):
    config = parse_monitor_options({"targets": ["x"], **options})
    rng = np.random.default_rng(7)
    pool = [Series(kind, f"m{i}", slot, call) for i in range(12)
            for kind, slot in (("activation", "output"), ("weight_grad", ""), ("exp_avg", ""))
            for call in (0, 1)][:60]
    fast, slow = AnomalyDetector(config), _PerSeries(config)
    total = 0
    for step in range(120):
        # Mostly the same series; some steps a changed set, or a series listed twice.
        series = pool[:48] if step % 7 else [pool[j] for j in rng.choice(len(pool), 40)]
        n = len(series)
        values = np.abs(rng.normal(1.0, 0.15, size=(n, len(METRIC_COLUMNS))))
        values[:, METRIC_COLUMNS.index("nan")] = 0
        values[:, METRIC_COLUMNS.index("inf")] = 0
        spikes = rng.random(n) < 0.04
        values[spikes] *= rng.choice([0.01, 40.0, 1e308], size=(int(spikes.sum()), 1))  # 1e308 * 40: Inf
        if step >= 60:
            with np.errstate(over="ignore"):
                values[:5] *= 8.0  # a level shift (a spike of 1e308 becomes Inf)
        for column, share in (("nan", 0.01), ("inf", 0.01)):
            hit = rng.random(n) < share
            values[hit, METRIC_COLUMNS.index(column)] = rng.integers(1, 50, size=int(hit.sum()))
        unknown = rng.random(n) < 0.01  # a row whose values are unknown (NaN counts too)
        values[unknown] = np.nan
        got = fast.scan(step, 0, series, values.copy())
        want = slow.scan(step, 0, series, values.copy())
        assert got == want, step
        total += len(got)
    assert total > 50  # the sequence exercised the rules


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
